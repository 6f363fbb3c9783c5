"""The async rollout-engine protocol and the manager that drives several engines as one.

An engine is anything reached over SGLang's HTTP API (a real SGLang server, the embedded engine, or a
router in front of either). `HttpEngine` implements the protocol with the one `EngineClient`, plus an
optional launcher that can relaunch the server process. `EngineManager` dispatches each generate
call to the least-loaded healthy engine and fans control calls (pause, flush, memory, weight
version...) out to all engines, reporting every failure by engine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, Awaitable, Callable, Coroutine, Protocol, Sequence, TypeVar, runtime_checkable

from .client import ClientConfig, EngineClient, EngineError
from .protocol import GenerateResult, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


@runtime_checkable
class EngineLauncher(Protocol):
    """Owns an engine's server process (SGLang Ray actor, local subprocess...)."""

    async def relaunch(self) -> str:
        """Restart the server; returns its (possibly new) base URL once it is healthy."""


@runtime_checkable
class RolloutEngine(Protocol):
    name: str
    client: EngineClient

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams) -> GenerateResult: ...
    async def pause(self, mode: str = "abort") -> None: ...
    async def continue_generation(self) -> None: ...
    async def flush_cache(self, retries: int = 0) -> None: ...
    async def release_memory(self, tags: Sequence[str] | None = None) -> None: ...
    async def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...
    async def health(self) -> bool: ...
    async def weight_version(self) -> str | None: ...
    async def relaunch(self) -> None: ...
    # weight updates from buckets (payloads built by megatron_rl.sync.transport)
    async def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], **kw) -> dict: ...
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> dict: ...
    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], **kw) -> dict: ...
    async def destroy_weights_update_group(self, group_name: str) -> dict: ...


class HttpEngine:
    """One engine behind an HTTP base URL. Weight-update calls go through `self.client` directly."""

    def __init__(self, url: str, *, name: str | None = None, launcher: EngineLauncher | None = None,
                 tp_size: int = 1, client_config: ClientConfig | None = None):
        self.client = EngineClient(url, client_config)
        self.name = name or self.client.url
        self.launcher = launcher
        self.tp_size = tp_size
        self._client_config = client_config

    def __repr__(self) -> str:
        return f"HttpEngine({self.name})"

    @property
    def url(self) -> str:
        return self.client.url

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams) -> GenerateResult:
        return await self.client.generate(input_ids, sampling, return_logprob=True)

    async def pause(self, mode: str = "abort") -> None:
        await self.client.pause_generation(mode)

    async def continue_generation(self) -> None:
        await self.client.continue_generation()

    async def flush_cache(self, retries: int = 0) -> None:
        await self.client.flush_cache(retries=retries)

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        await self.client.release_memory_occupation(tags)

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        await self.client.resume_memory_occupation(tags)

    async def health(self) -> bool:
        return await self.client.health()

    async def weight_version(self) -> str | None:
        return await self.client.get_weight_version()

    async def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], **kw) -> dict:
        return await self.client.update_weights_from_tensor(serialized_named_tensors, **kw)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        return await self.client.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                           group_name, backend)

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], **kw) -> dict:
        return await self.client.update_weights_from_distributed(names, dtypes, shapes, **kw)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self.client.destroy_weights_update_group(group_name)

    async def relaunch(self) -> None:
        if self.launcher is None:
            raise EngineError(self.url, "(relaunch)", "this engine has no launcher; it cannot be relaunched")
        url = await self.launcher.relaunch()
        if url.rstrip("/") != self.client.url:
            await self.client.close()
            self.client = EngineClient(url, self._client_config)


class EngineGroupError(RuntimeError):
    """A fanned-out call failed on some engines; `failures` maps engine name -> exception."""

    def __init__(self, call: str, failures: dict[str, BaseException]):
        self.call, self.failures = call, failures
        detail = "; ".join(f"{n}: {e}" for n, e in failures.items())
        super().__init__(f"{call} failed on {len(failures)} engine(s): {detail}")


@dataclasses.dataclass
class _Slot:
    engine: RolloutEngine
    in_flight: int = 0
    healthy: bool = True


class EngineManager:
    """Several engines as one: least-loaded dispatch for generation, fan-out for control."""

    def __init__(self, engines: Sequence[RolloutEngine]):
        if not engines:
            raise ValueError("EngineManager needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self._slots = [_Slot(e) for e in engines]

    @property
    def engines(self) -> list[RolloutEngine]:
        return [s.engine for s in self._slots]

    def __len__(self) -> int:
        return len(self._slots)

    # -- generation ------------------------------------------------------------------------------

    def _pick(self) -> _Slot:
        candidates = [s for s in self._slots if s.healthy] or self._slots
        return min(candidates, key=lambda s: s.in_flight)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams) -> GenerateResult:
        slot = self._pick()
        slot.in_flight += 1
        try:
            return await slot.engine.generate(input_ids, sampling)
        finally:
            slot.in_flight -= 1

    # -- fan-out ---------------------------------------------------------------------------------

    async def fan_out(self, call: str, fn: Callable[[RolloutEngine], Awaitable[T]]) -> list[T]:
        """Run `fn(engine)` on every engine concurrently; raise EngineGroupError naming each failure."""
        results = await asyncio.gather(*(fn(s.engine) for s in self._slots), return_exceptions=True)
        failures = {s.engine.name: r for s, r in zip(self._slots, results) if isinstance(r, BaseException)}
        if failures:
            raise EngineGroupError(call, failures)
        return list(results)

    async def pause(self, mode: str = "abort") -> None:
        await self.fan_out("pause_generation", lambda e: e.pause(mode))

    async def continue_generation(self) -> None:
        await self.fan_out("continue_generation", lambda e: e.continue_generation())

    async def flush_cache(self, retries: int = 60) -> None:
        await self.fan_out("flush_cache", lambda e: e.flush_cache(retries))

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        await self.fan_out("release_memory_occupation", lambda e: e.release_memory(tags))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        await self.fan_out("resume_memory_occupation", lambda e: e.resume_memory(tags))

    async def weight_versions(self) -> dict[str, str | None]:
        versions = await self.fan_out("get_weight_version", lambda e: e.weight_version())
        return {s.engine.name: v for s, v in zip(self._slots, versions)}

    async def health(self) -> dict[str, bool]:
        ok = await asyncio.gather(*(s.engine.health() for s in self._slots))
        for s, h in zip(self._slots, ok):
            s.healthy = bool(h)
        return {s.engine.name: bool(h) for s, h in zip(self._slots, ok)}

    async def relaunch(self, name: str) -> None:
        slot = self._slot(name)
        slot.healthy = False
        await slot.engine.relaunch()
        slot.healthy = True

    async def ensure_healthy(self) -> list[str]:
        """Relaunch every engine that fails its health check; returns the names relaunched."""
        status = await self.health()
        dead = [n for n, ok in status.items() if not ok]
        for n in dead:
            log.warning("engine %s is unhealthy; relaunching", n)
            await self.relaunch(n)
        return dead

    def _slot(self, name: str) -> _Slot:
        for s in self._slots:
            if s.engine.name == name:
                return s
        raise KeyError(f"no engine named {name!r}; engines: {[s.engine.name for s in self._slots]}")

    async def close(self) -> None:
        for s in self._slots:
            client = getattr(s.engine, "client", None)
            if client is not None:
                await client.close()


class BackgroundLoop:
    """An event loop on a daemon thread, so synchronous code (the trainer) can await engine calls."""

    def __init__(self, name: str = "engine-io"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()
