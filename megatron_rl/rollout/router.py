"""SGLang router (model gateway): launch it, register and unregister engine workers.

Launch: ``python -m sglang_router.launch_router --host H --port P [--policy ...] [passthrough]``.
Registration uses the newer gateway API ``POST /workers {"url": ...}`` and falls back to the older
``POST /add_worker?url=...`` when the router does not know the route (HTTP 404/405); unregistration
uses ``DELETE /workers/{id or url-encoded url}`` with ``POST /remove_worker?url=...`` as fallback.
Requests go through the same `EngineClient` as engine calls.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any
from urllib.parse import quote

from .client import EngineClient, EngineError
from .sglang_engine import SGLangServerConfig, ServerProcess, args_to_flags

log = logging.getLogger(__name__)

_FALLBACK_STATUSES = (404, 405)


@dataclasses.dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int | None = None
    policy: str | None = None                     # e.g. "cache_aware", "round_robin", "consistent_hashing"
    worker_urls: list[str] = dataclasses.field(default_factory=list)
    router_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # passthrough flags
    launch_module: str = "sglang_router.launch_router"
    python: str = sys.executable
    log_dir: str | None = None
    startup_timeout_s: float = 120.0


class RouterProcess:
    """The router as a subprocess. Health is checked on ``/health`` (a router has no /health_generate)."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        # ServerProcess does the process handling, logs and health wait; only the command line differs.
        process_cfg = SGLangServerConfig(model_path=None, host=cfg.host, port=cfg.port, python=cfg.python,
                                         log_dir=cfg.log_dir, startup_timeout_s=cfg.startup_timeout_s,
                                         watchdog_interval_s=None)
        self._proc = ServerProcess(process_cfg, command=self.command, health_endpoint="/health")

    def command(self, port: int) -> list[str]:
        args: dict[str, Any] = {"host": self.cfg.host, "port": port, "policy": self.cfg.policy}
        if self.cfg.worker_urls:
            args["worker_urls"] = list(self.cfg.worker_urls)
        return [self.cfg.python, "-m", self.cfg.launch_module] + args_to_flags(args) + args_to_flags(self.cfg.router_args)

    @property
    def url(self) -> str:
        return self._proc.url

    def start(self) -> str:
        return self._proc.start()

    def stop(self) -> None:
        self._proc.stop()

    def log_tail(self, lines: int = 50) -> str:
        return self._proc.log_tail(lines)


async def register_worker(router: EngineClient, worker_url: str, *, worker_type: str = "regular") -> str:
    """Add `worker_url` to the router; returns the id to unregister it with (worker id or the url)."""
    try:
        out = await router.request("POST", "/workers", json_body={"url": worker_url, "worker_type": worker_type},
                                   idempotent=False)
        if isinstance(out, dict) and out.get("worker_id"):
            return str(out["worker_id"])
        return worker_url
    except EngineError as e:
        if e.status not in _FALLBACK_STATUSES:
            raise
        log.info("router %s has no POST /workers (HTTP %s); using /add_worker", router.url, e.status)
    await router.request("POST", "/add_worker", params={"url": worker_url}, idempotent=False)
    return worker_url


async def unregister_worker(router: EngineClient, worker_url: str, worker_id: str | None = None) -> None:
    try:
        await router.request("DELETE", "/workers/" + quote(worker_id or worker_url, safe=""), idempotent=True)
        return
    except EngineError as e:
        if e.status not in _FALLBACK_STATUSES:
            raise
        log.info("router %s has no DELETE /workers/{id} (HTTP %s); using /remove_worker", router.url, e.status)
    await router.request("POST", "/remove_worker", params={"url": worker_url}, idempotent=True)
