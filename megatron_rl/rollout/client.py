"""The one HTTP client for rollout engines: real SGLang servers, the SGLang router and the embedded engine.

Every engine is reached through SGLang's native endpoint names and payloads (see
``docs/advanced_features/sglang_for_rl.md`` and ``io_struct.py`` in sgl-project/sglang), so the code
the tests exercise against the embedded engine is the code that drives SGLang in production.

Failure policy:
* connection failures of *idempotent* calls (version, flush, pause/continue, abort,
  memory release/resume, destroy group) are retried with exponential backoff;
* ``/generate`` and weight updates are never retried here (a retry could double work or apply a
  bucket twice); the caller decides;
* every error names the endpoint, the engine URL, the HTTP status and the server's own message.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any, Sequence

import aiohttp

from .protocol import GenerateResult, SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine call failed. `status` is the HTTP status (None when no response arrived)."""

    def __init__(self, url: str, endpoint: str, message: str, status: int | None = None):
        self.url, self.endpoint, self.status, self.server_message = url, endpoint, status, message
        where = f"{url}{endpoint}"
        super().__init__(f"{where} failed" + (f" (HTTP {status})" if status is not None else "") + f": {message}")


class EngineConnectionError(EngineError):
    """No HTTP response: the engine is down, unreachable, or the connection broke."""


class EngineTimeoutError(EngineError):
    """The engine did not answer within the call's timeout."""


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    generate_timeout_s: float = 3600.0   # a long rollout is legitimate
    control_timeout_s: float = 300.0     # pause/flush/memory/weights
    health_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    retries: int = 3                     # extra attempts for idempotent calls on connection errors
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    max_connections: int = 2048


def _parse_version(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def parse_generate_response(d: dict, *, url: str = "", return_logprob: bool = True) -> GenerateResult:
    """SGLang ``/generate`` response (one prompt) -> GenerateResult."""
    meta = d.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(url, "/generate", f"response has no meta_info: {str(d)[:300]}")
    fr = meta.get("finish_reason")
    reason = fr.get("type") if isinstance(fr, dict) else (fr if isinstance(fr, str) else "abort")
    if return_logprob:
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise EngineError(url, "/generate", "return_logprob was set but meta_info.output_token_logprobs is missing")
        tokens = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) if p[0] is not None else float("nan") for p in pairs]
    else:
        tokens = [int(t) for t in d.get("output_ids", [])]
        logprobs = []
    return GenerateResult(token_ids=tokens, logprobs=logprobs, finish_reason=str(reason),
                          weight_version=_parse_version(meta.get("weight_version")),
                          prompt_tokens=int(meta.get("prompt_tokens", 0) or 0))


class EngineClient:
    """Async client for one engine (or router) base URL. Safe to share between tasks of one event loop;
    a new aiohttp session is opened per event loop it is used from."""

    def __init__(self, base_url: str, config: ClientConfig | None = None):
        if not base_url.startswith(("http://", "https://")):
            base_url = "http://" + base_url
        self.url = base_url.rstrip("/")
        self.config = config or ClientConfig()
        self._sessions: dict[int, tuple[asyncio.AbstractEventLoop, aiohttp.ClientSession]] = {}

    def __repr__(self) -> str:
        return f"EngineClient({self.url})"

    # -- plumbing ------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        entry = self._sessions.get(id(loop))
        if entry is None or entry[0] is not loop or entry[1].closed:
            for key, (lp, _s) in list(self._sessions.items()):
                if lp.is_closed():
                    del self._sessions[key]
            conn = aiohttp.TCPConnector(limit=self.config.max_connections)
            entry = (loop, aiohttp.ClientSession(connector=conn))
            self._sessions[id(loop)] = entry
        return entry[1]

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        entry = self._sessions.pop(id(loop), None)
        if entry is not None:
            await entry[1].close()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def request(self, method: str, endpoint: str, *, json_body: Any = None, params: dict | None = None,
                      idempotent: bool, timeout_s: float | None = None) -> Any:
        """Send one request; returns parsed JSON (or text, or None for an empty body). Raises EngineError."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.config.control_timeout_s,
                                        connect=self.config.connect_timeout_s)
        attempts = 1 + (self.config.retries if idempotent else 0)
        delay = self.config.backoff_s
        for attempt in range(attempts):
            try:
                async with self._session().request(method, self.url + endpoint, json=json_body, params=params,
                                                   timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status >= 400:
                        raise EngineError(self.url, endpoint, _server_message(text), status=resp.status)
                    return _parse_body(text)
            except EngineError:
                raise
            except asyncio.TimeoutError:
                raise EngineTimeoutError(self.url, endpoint, f"no answer within {timeout.total:.0f}s") from None
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
                if attempt + 1 >= attempts:
                    raise EngineConnectionError(self.url, endpoint, f"{type(e).__name__}: {e}") from None
                log.warning("%s%s: %s; retrying in %.1fs (%d/%d)", self.url, endpoint, e, delay, attempt + 1,
                            attempts - 1)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.backoff_max_s)
        raise AssertionError("unreachable")

    async def _post_checked(self, endpoint: str, body: dict, *, idempotent: bool) -> dict:
        """POST to an endpoint answering {"success", "message"}; success=false is an error too."""
        out = await self.request("POST", endpoint, json_body=body, idempotent=idempotent)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(self.url, endpoint, str(out.get("message", "success=false")), status=200)
        return out if isinstance(out, dict) else {"message": out}

    # -- generation ----------------------------------------------------------------------------

    async def generate_raw(self, payload: dict) -> Any:
        return await self.request("POST", "/generate", json_body=payload, idempotent=False,
                                  timeout_s=self.config.generate_timeout_s)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams | dict, *,
                       return_logprob: bool = True, rid: str | None = None) -> GenerateResult:
        params = sampling.to_sglang() if isinstance(sampling, SamplingParams) else dict(sampling)
        payload: dict[str, Any] = {"input_ids": [int(t) for t in input_ids], "sampling_params": params,
                                   "return_logprob": return_logprob}
        if rid is not None:
            payload["rid"] = rid
        out = await self.generate_raw(payload)
        if isinstance(out, list):
            out = out[0]
        if not isinstance(out, dict):
            raise EngineError(self.url, "/generate", f"unexpected response: {str(out)[:300]}")
        return parse_generate_response(out, url=self.url, return_logprob=return_logprob)

    # -- health and state ----------------------------------------------------------------------

    async def health(self) -> bool:
        try:
            await self.request("GET", "/health", idempotent=False, timeout_s=self.config.health_timeout_s)
            return True
        except EngineError:
            return False

    async def health_generate(self) -> bool:
        try:
            await self.request("GET", "/health_generate", idempotent=False, timeout_s=self.config.health_timeout_s)
            return True
        except EngineError:
            return False

    async def get_weight_version(self) -> str | None:
        out = await self.request("GET", "/get_weight_version", idempotent=True)
        v = out.get("weight_version") if isinstance(out, dict) else None
        return None if v is None else str(v)

    async def get_server_info(self) -> dict:
        return await self.request("GET", "/get_server_info", idempotent=True)

    # -- control -------------------------------------------------------------------------------

    async def flush_cache(self, *, retries: int = 0, interval_s: float = 1.0) -> None:
        """SGLang refuses to flush (HTTP 400) while requests run; retry `retries` times, then raise."""
        for i in range(retries + 1):
            try:
                await self.request("POST", "/flush_cache", idempotent=True)
                return
            except EngineError as e:
                if e.status != 400 or i == retries:
                    raise
            await asyncio.sleep(interval_s)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self.request("POST", "/pause_generation", json_body={"mode": mode}, idempotent=True)

    async def continue_generation(self) -> None:
        await self.request("POST", "/continue_generation", json_body={}, idempotent=True)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self.request("POST", "/abort_request", json_body={"rid": rid, "abort_all": abort_all}, idempotent=True)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.request("POST", "/release_memory_occupation",
                           json_body={"tags": list(tags) if tags is not None else None}, idempotent=True)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.request("POST", "/resume_memory_occupation",
                           json_body={"tags": list(tags) if tags is not None else None}, idempotent=True)

    # -- weights -------------------------------------------------------------------------------

    async def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], *,
                                         load_format: str | None = "flattened_bucket", flush_cache: bool = False,
                                         weight_version: str | None = None, abort_all_requests: bool = False,
                                         staged: dict | None = None) -> dict:
        body: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors),
                                "load_format": load_format, "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests, "weight_version": weight_version}
        if staged is not None:
            body["staged"] = staged
        return await self._post_checked("/update_weights_from_tensor", body, idempotent=False)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        body = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                "world_size": int(world_size), "group_name": group_name, "backend": backend}
        return await self._post_checked("/init_weights_update_group", body, idempotent=False)

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], *,
                                              group_name: str = "weight_update_group",
                                              load_format: str | None = "flattened_bucket",
                                              weight_version: str | None = None, flush_cache: bool = False,
                                              abort_all_requests: bool = False, staged: dict | None = None) -> dict:
        body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                                "group_name": group_name, "load_format": load_format, "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests, "weight_version": weight_version}
        if staged is not None:
            body["staged"] = staged
        return await self._post_checked("/update_weights_from_distributed", body, idempotent=False)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._post_checked("/destroy_weights_update_group", {"group_name": group_name}, idempotent=True)


def _parse_body(text: str) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _server_message(text: str) -> str:
    """Pull the human message out of SGLang's error shapes ({"error": {"message"}}, {"message"}, text)."""
    body = _parse_body(text)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
    return (text or "<empty body>")[:2000]
