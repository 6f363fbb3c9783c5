"""HTTP front of the embedded engine: the SGLang endpoint subset used for RL, same names and payloads.

Run as a process (SGLang-style flags are accepted, so launchers written for SGLang work unchanged):

    python -m megatron_rl.rollout.embedded_server --model-path HF_DIR --port 30000 [--device cuda:0]

or start in-process on a background thread (tests): ``EmbeddedServer(engine).start_in_thread()``.

Endpoints: /generate, /health, /health_generate, /flush_cache, /pause_generation,
/continue_generation, /abort_request, /release_memory_occupation, /resume_memory_occupation,
/update_weights_from_tensor, /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /get_weight_version, /get_model_info, /get_server_info.
Errors follow SGLang's shapes: ``{"error": {"message"}}`` (HTTP 400) for generation and control,
``{"success": false, "message"}`` (HTTP 400) for weight updates.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import torch
from aiohttp import web

from ..observability import dump_stacks_on_sigusr1
from ..sync.transport import (WeightGroupSpec, WeightUpdateGroup, decode_payload, default_shm_dir,
                              receive_flattened, receive_per_tensor)
from .embedded_engine import EmbeddedEngine, EmbeddedEngineConfig, EngineStateError, check_tags
from .sampling import RequestSampling, SamplingParamError
from .sglang_engine import PARENT_PID_ENV

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 512 * 1024 * 1024


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}, "message": message}, status=status)


def _weights_result(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


@web.middleware
async def _unexpected_errors(request: web.Request, handler):
    """A bug reached by some request still answers JSON with a message (aiohttp's bare 500 says nothing)."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as e:  # noqa: BLE001 - every handler validates its input; this is the backstop
        log.exception("%s %s failed", request.method, request.path)
        return _error(f"internal error in {request.path}: {type(e).__name__}: {e}", 500)


async def _json(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"request body is not valid JSON: {e}") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


class EmbeddedServer:
    def __init__(self, engine: EmbeddedEngine, *, host: str = "127.0.0.1", port: int = 0,
                 shm_dir: str | None = None):
        self.engine = engine
        self.host = host
        self.port = port
        self.shm_dir = shm_dir or default_shm_dir()
        self._groups: dict[str, WeightUpdateGroup] = {}
        self._weights_lock: asyncio.Lock | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ app

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_unexpected_errors])
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for m in ("GET", "POST"):
            r.add_route(m, "/flush_cache", self.flush_cache)
            r.add_route(m, "/release_memory_occupation", self.release_memory)
            r.add_route(m, "/resume_memory_occupation", self.resume_memory)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/get_model_info", self.get_model_info)
        r.add_get("/get_server_info", self.get_server_info)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_shutdown(self, app) -> None:
        for g in self._groups.values():
            g.destroy()
        self._groups.clear()

    def _lock(self) -> asyncio.Lock:
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        return self._weights_lock

    # ------------------------------------------------------------------ generation

    async def generate(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        futures, reqs, submitted = [], [], []
        try:
            body = await _json(request)
            if body.get("stream"):
                raise ValueError("stream=true is not supported by the embedded engine")
            prompts, batched = self._prompts(body)
            n = len(prompts)
            sps = _per_item(body.get("sampling_params"), n, "sampling_params")
            rlp = _per_item(body.get("return_logprob", False), n, "return_logprob")
            rid = body.get("rid")
            rids = [f"{rid}_{i}" for i in range(n)] if batched and isinstance(rid, str) else _per_item(rid, n, "rid")
            for i, prompt in enumerate(prompts):
                fut = loop.create_future()
                sampling = RequestSampling.from_sglang(sps[i], default_max_new_tokens=self.engine.config.default_max_new_tokens)
                if sampling.stop_strings and self.engine.tokenizer is None:
                    raise ValueError("sampling_params.stop (strings) needs a tokenizer; use stop_token_ids")
                explicit = isinstance(sps[i], dict) and sps[i].get("max_new_tokens") is not None
                self._check_fits(prompt, sampling.max_new_tokens if explicit else None)
                req = self.engine.new_request(prompt, sampling, return_logprob=_flag(rlp[i], "return_logprob"),
                                              rid=_rid(rids[i]), on_done=_resolver(loop, fut))
                futures.append(fut)
                reqs.append(req)
            for req in reqs:
                self.engine.submit(req)
                submitted.append(req)
        except (ValueError, SamplingParamError, EngineStateError) as e:
            for req in submitted:  # a batch is accepted whole or not at all
                self.engine.abort(req.rid)
            return _error(str(e))
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # client went away: stop spending compute on it
            for req in reqs:
                self.engine.abort(req.rid)
            raise
        return web.json_response(results if batched else results[0])

    def _check_fits(self, prompt: list, max_new: int | None) -> None:
        """SGLang's check: an explicit max_new_tokens must leave prompt + completion inside the context
        (it answers 400 rather than silently cutting the completion short, or decoding for minutes)."""
        ctx = self.engine.context_length
        if len(prompt) >= ctx:
            raise ValueError(f"The input ({len(prompt)} tokens) is longer than the model's context length "
                             f"({ctx} tokens).")
        if max_new is not None and len(prompt) + max_new >= ctx:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                             f"You requested a total of {len(prompt) + max_new} tokens: {len(prompt)} tokens from "
                             f"the input messages and {max_new} tokens for the completion "
                             f"(sampling_params.max_new_tokens).")

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        ids, text = body.get("input_ids"), body.get("text")
        if ids is None and text is None:
            raise ValueError("either input_ids or text is required")
        if ids is not None:
            if not isinstance(ids, list) or not ids:
                raise ValueError("input_ids must be a non-empty list of token ids (or a list of such lists)")
            if all(isinstance(x, list) for x in ids):
                return [list(x) for x in ids], True
            return [list(ids)], False
        if self.engine.tokenizer is None:
            raise ValueError("text input needs a tokenizer; this engine has none, send input_ids")
        if isinstance(text, str):
            texts, batched = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            texts, batched = list(text), True
        else:
            raise ValueError(f"text must be a string or a non-empty list of strings, got {str(text)[:100]}")
        return [self.engine.tokenizer.encode(t) for t in texts], batched

    # ------------------------------------------------------------------ health & info

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.alive:
            return _error(f"engine scheduler is not running: {self.engine.error!r}", 503)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Like SGLang: run a one-token generation when idle; when busy, paused or released, liveness suffices."""
        if not self.engine.alive:
            return _error(f"engine scheduler is not running: {self.engine.error!r}", 503)
        if self.engine.paused or self.engine.released_tags or not self.engine.is_idle():
            return web.Response(status=200)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = self.engine.new_request([0], RequestSampling.from_sglang({"max_new_tokens": 1, "temperature": 0.0}),
                                      return_logprob=False, on_done=_resolver(loop, fut))
        try:
            self.engine.submit(req)
            await asyncio.wait_for(fut, timeout=20)
        except (EngineStateError, asyncio.TimeoutError) as e:
            return _error(f"health generation failed: {e!r}", 503)
        return web.Response(status=200)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def get_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.engine.model_path, "is_generation": True,
                                  "weight_version": self.engine.weight_version})

    async def get_server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({
            "engine": "embedded", "model_path": e.model_path, "device": str(e.device),
            "weight_version": e.weight_version, "paused": e.paused, "released": e.released_tags,
            "max_batch_size": e.config.max_batch_size, "context_length": e.context_length,
            "enable_fp32_lm_head": e.config.fp32_lm_head,   # SGLang's server_info echoes its server args
            "weight_update_groups": sorted(self._groups), **e.load(), **e.decode_info(),
        })

    # ------------------------------------------------------------------ control

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            self.engine.flush_cache()
        except EngineStateError as e:
            return _error(str(e))
        return web.Response(text="Cache flushed.\n")

    async def pause(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            await asyncio.get_running_loop().run_in_executor(None, self.engine.pause, body.get("mode") or "abort")
        except (ValueError, EngineStateError) as e:
            return _error(str(e))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.continue_generation()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            rid = body.get("rid") or ""
            if not isinstance(rid, str):
                raise ValueError(f"rid must be a string, got {type(rid).__name__}")
            abort_all = _flag(body.get("abort_all", False), "abort_all")
        except ValueError as e:
            return _error(str(e))
        self.engine.abort(rid, abort_all)
        return web.Response(status=200)

    async def release_memory(self, request: web.Request) -> web.Response:
        return await self._memory(request, self.engine.release_memory)

    async def resume_memory(self, request: web.Request) -> web.Response:
        return await self._memory(request, self.engine.resume_memory)

    async def _memory(self, request: web.Request, fn) -> web.Response:
        try:
            body = await _json(request)
            tags = check_tags(body.get("tags"))  # refused before waiting for a weight update to finish
            async with self._lock():
                await asyncio.get_running_loop().run_in_executor(None, fn, tags)
        except (ValueError, EngineStateError) as e:
            return _error(str(e))
        return web.Response(status=200)

    # ------------------------------------------------------------------ weights

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            payloads = body.get("serialized_named_tensors")
            if not isinstance(payloads, list) or not payloads:
                raise ValueError("serialized_named_tensors must be a non-empty list (one entry per TP rank)")
            load_format = body.get("load_format")
            # One entry per TP rank; this engine is a single rank and reads the first.
            async with self._lock():
                msg = await asyncio.get_running_loop().run_in_executor(
                    None, self._apply_tensor_payload, payloads[0], load_format, body)
        except (ValueError, EngineStateError) as e:
            return _weights_result(False, f"Failed to update weights: {e}")
        return _weights_result(True, msg)

    def _apply_tensor_payload(self, payload: Any, load_format: str | None, body: dict) -> str:
        if not isinstance(payload, str):
            raise ValueError("each serialized_named_tensors entry must be a base64 string")
        try:
            decoded = decode_payload(payload, shm_dir=self.shm_dir, load_format=load_format)
        except ValueError:
            self.engine.discard_staged()
            raise
        return self.engine.update_weights(decoded.tensors, staged=body.get("staged"),
                                          weight_version=_opt_str(body.get("weight_version")),
                                          abort_all_requests=bool(body.get("abort_all_requests", False)))

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            name = str(body.get("group_name") or "weight_update_group")
            spec = WeightGroupSpec(master_address=str(body["master_address"]),
                                   master_port=_int_field(body, "master_port"),
                                   world_size=_int_field(body, "world_size"), group_name=name,
                                   backend=str(body.get("backend") or "nccl"))
            rank = _int_field(body, "rank_offset")
            if name in self._groups:
                raise ValueError(f"weight update group {name!r} already exists; destroy it first")
            if spec.backend == "nccl" and self.engine.device.type != "cuda":
                raise ValueError("backend 'nccl' needs the engine on a GPU; this engine runs on CPU (use 'gloo')")
            device = self.engine.device if self.engine.device.type == "cuda" else None
            group = await asyncio.get_running_loop().run_in_executor(None, WeightUpdateGroup, spec, rank, device)
            self._groups[name] = group
        except KeyError as e:
            return _weights_result(False, f"Failed to init group: missing field {e}")
        except Exception as e:  # rendezvous failures (timeouts, refused connections) are reported, not raised
            return _weights_result(False, f"Failed to init group: {type(e).__name__}: {e}")
        return _weights_result(True, f"Succeeded to initialize group {name} as rank {rank} of {spec.world_size}.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            name = str(body.get("group_name") or "weight_update_group")
            group = self._groups.get(name)
            if group is None:
                raise ValueError(f"weight update group {name!r} does not exist; call /init_weights_update_group")
            async with self._lock():
                msg = await asyncio.get_running_loop().run_in_executor(None, self._receive_and_apply, group, body)
        except (ValueError, EngineStateError) as e:
            return _weights_result(False, f"Failed to update weights: {e}")
        except RuntimeError as e:  # collective failures (peer died, timeout)
            self.engine.discard_staged()
            return _weights_result(False, f"Failed to receive weights: {e}")
        return _weights_result(True, msg)

    def _receive_and_apply(self, group: WeightUpdateGroup, body: dict) -> str:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not all(isinstance(x, list) for x in (names, dtypes, shapes)):
            self.engine.discard_staged()
            raise ValueError("names, dtypes and shapes must be lists")
        load_format = body.get("load_format")
        # Receive first, always: the trainer is already broadcasting and a skipped receive would desync the group.
        if load_format == "flattened_bucket":
            tensors = receive_flattened(group, names, dtypes, shapes)
        elif load_format in (None, "direct"):
            tensors = receive_per_tensor(group, names, dtypes, shapes)
        else:
            self.engine.discard_staged()
            raise ValueError(f"unsupported load_format {load_format!r}")
        # The received buffers belong to this engine: stage them without another copy.
        return self.engine.update_weights(tensors, staged=body.get("staged"),
                                          weight_version=_opt_str(body.get("weight_version")),
                                          abort_all_requests=bool(body.get("abort_all_requests", False)),
                                          owned=True)

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
        except ValueError as e:
            return _weights_result(False, str(e))
        name = str(body.get("group_name") or "weight_update_group")
        group = self._groups.pop(name, None)
        if group is None:
            return _weights_result(False, f"weight update group {name!r} does not exist")
        group.destroy()
        return _weights_result(True, f"Succeeded to destroy group {name}.")

    # ------------------------------------------------------------------ running

    async def _start(self) -> None:
        self.engine.start()
        self._runner = web.AppRunner(self.build_app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]  # bound port of an ephemeral bind
        log.info("embedded engine serving on %s", self.url)

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self.engine.shutdown()

    def serve_forever(self) -> None:
        """Blocking (process mode)."""
        async def main():
            await self._start()
            print(f"embedded engine ready on {self.url}", flush=True)
            try:
                await asyncio.Event().wait()
            finally:
                await self._cleanup()
        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            pass

    def start_in_thread(self, timeout: float = 60.0) -> str:
        """Serve from a daemon thread; returns the base URL once it accepts connections."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run():
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start())
            except BaseException as e:
                failure.append(e)
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._cleanup())
                loop.close()
                self._stopped.set()

        self._thread = threading.Thread(target=run, name="embedded-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"embedded server did not start within {timeout}s")
        if failure:
            raise failure[0]
        return self.url

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)


def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
    def done(result: dict) -> None:
        def set_result():
            if not fut.done():
                fut.set_result(result)
        loop.call_soon_threadsafe(set_result)
    return done


def _per_item(value: Any, n: int, field: str) -> list:
    """SGLang batch convention: a list gives one value per prompt, anything else applies to all."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{field} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _flag(v: Any, field: str) -> bool:
    """A JSON boolean (0/1 and null accepted): a string such as "false" must not silently mean True."""
    if v is None or isinstance(v, bool) or v in (0, 1):
        return bool(v)
    raise ValueError(f"{field} must be a boolean, got {v!r}")


def _rid(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    raise ValueError(f"rid must be a string (or a list of strings for a batch), got {str(v)[:100]}")


def _int_field(body: dict, field: str) -> int:
    v = body[field]  # KeyError: reported as a missing field
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"{field} must be an integer, got {v!r}")
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{field} must be an integer, got {v!r}") from None


# ----------------------------------------------------------------------------------------------
# Building an engine and the command line
# ----------------------------------------------------------------------------------------------

def resolve_device(device: str | None, base_gpu_id: int | None = None) -> torch.device:
    if device in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", base_gpu_id or 0)
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str) -> torch.dtype | str:
    if name == "auto":
        return "auto"
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if name not in table:
        raise ValueError(f"unknown --dtype {name!r}; use auto, float32, bfloat16 or float16")
    return table[name]


#: parameters released checkpoints store, and the trainer keeps, in fp32 (Gated DeltaNet's decay
#: parameters); transformers would load them in the model dtype
FP32_PARAM_SUFFIXES = (".A_log", ".dt_bias")


def keep_fp32_params(model):
    """Hold `FP32_PARAM_SUFFIXES` in fp32 whatever the model dtype, as the trainer and the release do, so
    synced values arrive unrounded (HF's Qwen3.5 computes with them in fp32 anyway)."""
    for name, p in model.named_parameters():
        if name.endswith(FP32_PARAM_SUFFIXES) and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def load_model(model_path: str | None, *, hf_config: dict | None = None, device: torch.device,
               dtype: torch.dtype | str = "auto", init_seed: int = 0):
    """HF checkpoint dir -> (model, tokenizer); or an HF config dict -> randomly initialised model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (model_path is None) == (hf_config is None):
        raise ValueError("give exactly one of a model path or an HF config")
    if hf_config is not None:
        cfg = dict(hf_config)
        model_type = cfg.pop("model_type", None)
        if model_type is None:
            raise ValueError("the HF config needs a 'model_type' field (e.g. 'qwen3')")
        # a multimodal config (Qwen3.5 as released) serves its language model, as from_pretrained does
        config = AutoConfig.for_model(model_type, **cfg).get_text_config(decoder=True)
        torch.manual_seed(init_seed)
        target = torch.float32 if dtype == "auto" else dtype
        with torch.device(device):  # initialise in place: an 8B random init on the host takes minutes
            model = AutoModelForCausalLM.from_config(config, dtype=target)
        return keep_fp32_params(model).eval(), None
    import os
    if not os.path.isdir(model_path) or not os.path.exists(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"model path {model_path!r} is not an HF checkpoint directory (no config.json)")
    if device.type == "cpu":
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    else:
        try:  # straight onto the GPU (needs `accelerate`)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map=str(device))
        except (ImportError, ValueError):
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model = keep_fp32_params(model).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as e:  # a weights-only directory is fine: input_ids work without a tokenizer
        log.warning("no tokenizer loaded from %s (%s); text input disabled", model_path, e)
        tokenizer = None
    return model, tokenizer


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.rollout.embedded_server",
                                description="Embedded HF rollout engine behind SGLang's HTTP API subset.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", "--model", dest="model_path", help="HF checkpoint directory")
    src.add_argument("--hf-config", help="JSON file or inline JSON of an HF config: random-init model (tests)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--base-gpu-id", type=int, default=None, help="SGLang-compatible: GPU index when --device auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-running-requests", "--max-batch-size", dest="max_batch_size", type=int, default=32)
    p.add_argument("--gather-ms", type=float, default=20.0,
                   help="before a wave starts, wait this long for more requests to batch with it")
    p.add_argument("--default-max-new-tokens", type=int, default=128)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--decode", choices=("auto", "slots", "dynamic"), default="auto",
                   help="slots: preallocated cache slots with CUDA graphs on a GPU; dynamic: transformers' DynamicCache; "
                        "auto: slots when the model's layers allow it")
    p.add_argument("--disable-cuda-graph", action="store_true", help="slot decoding without CUDA graphs (SGLang's flag)")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="torch.compile the slot decode step (SGLang's flag; the first step of each shape compiles)")
    p.add_argument("--disable-compiled-blocks", action="store_true",
                   help="run the model's norm and MLP blocks eagerly; by default, on a GPU, they are torch.compiled "
                        "(fuses a third of a decode step's small kernels; compiles in seconds)")
    p.add_argument("--enable-compiled-blocks", action="store_true", help=argparse.SUPPRESS)   # the default now
    p.add_argument("--disable-grouped-projections", action="store_true",
                   help="run q/k/v, gate/up and GDN input projections as separate GEMMs; by default, on a GPU, each "
                        "set reads its input once as one GEMM (the HF parameters become slices of its weight)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens back before launching the next (SGLang's flag); by default "
                        "the next step is launched first and the host's bookkeeping overlaps the device's step")
    p.add_argument("--enable-fp32-lm-head", action="store_true",
                   help="logits as the LM head GEMM's fp32 result instead of its bf16 rounding (SGLang's flag; the "
                        "trainer passes the actor's fp32_lm_head)")
    p.add_argument("--kv-cache-fraction", type=float, default=0.6,
                   help="share of the device memory free at allocation that the slot cache may take")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="joining requests are prefilled in chunks of at most this many padded tokens (SGLang's flag)")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--init-seed", type=int, default=0, help="seed of the random init with --hf-config")
    p.add_argument("--shm-dir", default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    # SGLang flags that have no meaning here; accepted so SGLang launch commands run unchanged.
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--skip-server-warmup", action="store_true",
                   help="serve without the start-up request that builds kernels and the first decode graph")
    return p


def exit_with_parent(poll_s: float = 1.0) -> threading.Thread | None:
    """Exit this server once the process that launched it (``PARENT_PID_ENV``) is gone: it runs in a session of
    its own, so a launcher killed without stopping it (SIGKILL, an OOM kill, Ray tearing an actor down) would
    otherwise leave it holding its port and its device memory. None when no launcher pid was given."""
    raw = os.environ.get(PARENT_PID_ENV)
    if not raw:
        return None
    parent = int(raw)
    if os.getppid() != parent:   # already orphaned (or launched through a wrapper): nothing to watch reliably
        log.warning("%s=%s but the parent is %d; not watching it", PARENT_PID_ENV, raw, os.getppid())
        return None

    def watch() -> None:
        while os.getppid() == parent:   # an orphan is re-parented (to init or a subreaper)
            time.sleep(poll_s)
        log.warning("launching process %d is gone; exiting", parent)
        logging.shutdown()
        os._exit(0)

    t = threading.Thread(target=watch, name="parent-watch", daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    args, unknown = parser.parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if unknown:
        log.warning("ignoring SGLang arguments the embedded engine does not use: %s", " ".join(unknown))
    exit_with_parent()
    dump_stacks_on_sigusr1()   # the stacks land in the server log (its stderr)
    if args.tp_size != 1:
        parser.error(f"--tp-size {args.tp_size}: the embedded engine runs one rank; use SGLang for tensor parallelism")
    hf_config = None
    if args.hf_config:
        text = args.hf_config
        if not text.lstrip().startswith("{"):
            with open(text) as f:
                text = f.read()
        try:
            hf_config = json.loads(text)
        except json.JSONDecodeError as e:
            parser.error(f"--hf-config is not valid JSON: {e}")
    try:
        device = resolve_device(args.device, args.base_gpu_id)
        model, tok = load_model(args.model_path, hf_config=hf_config, device=device, dtype=resolve_dtype(args.dtype),
                                init_seed=args.init_seed)
        engine = EmbeddedEngine(model, EmbeddedEngineConfig(
            max_batch_size=args.max_batch_size, gather_ms=args.gather_ms,
            default_max_new_tokens=args.default_max_new_tokens, weight_version=str(args.weight_version),
            seed=args.random_seed, context_length=args.context_length, decode=args.decode,
            cuda_graphs=not args.disable_cuda_graph, compile_decode=args.enable_torch_compile,
            compile_blocks=not args.disable_compiled_blocks, overlap_decode=not args.disable_overlap_schedule,
            group_projections=False if args.disable_grouped_projections else None,
            fp32_lm_head=args.enable_fp32_lm_head,
            kv_cache_fraction=args.kv_cache_fraction,
            max_prefill_tokens=args.max_prefill_tokens,
        ), tokenizer=tok, model_path=args.model_path)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((args.host, args.port))
    except OSError as e:
        print(f"error: cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    if not args.skip_server_warmup:
        try:
            log.info("warm-up request served in %.1f s", engine.warm_up())
        except (EngineStateError, ValueError) as e:
            print(f"error: warm-up: {e}", file=sys.stderr)
            return 2
    EmbeddedServer(engine, host=args.host, port=args.port, shm_dir=args.shm_dir).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
