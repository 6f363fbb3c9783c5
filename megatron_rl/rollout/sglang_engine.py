"""Launch and keep alive a real SGLang server; the Ray actor that owns it on its GPUs.

`ServerProcess` is the plain launcher: it builds ``python -m sglang.launch_server --model-path ...
--host --port --tp-size --mem-fraction-static --enable-memory-saver --skip-server-warmup ...`` (any
other server argument passes through from the config's `server_args` dict: ``{"key_name": v}`` ->
``--key-name v``, ``True`` -> ``--key-name``, ``False``/``None`` -> omitted, a list -> repeated
values), pins it to its GPUs (``CUDA_VISIBLE_DEVICES`` and/or ``--base-gpu-id``), writes its output
to a log file, waits on ``/health_generate`` (a timeout or an early exit raises `ServerLaunchError`
with the log tail), and relaunches it if it dies (watchdog thread, bounded restarts).

`SGLangEngine` is the Ray actor body wrapping one `ServerProcess`; `RayEngineLauncher` lets an
`HttpEngine` relaunch through the actor. Because the embedded engine accepts the same command-line
flags and HTTP API, the launcher logic is tested by pointing `launch_module` at
``megatron_rl.rollout.embedded_server``.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from megatron_rl.ports import free_port

from .client import ClientConfig, EngineClient
from .engine import HttpEngine

log = logging.getLogger(__name__)
# set in every launched server's environment: the launching process, whose death ends an embedded server
PARENT_PID_ENV = "MEGATRON_RL_PARENT_PID"


class ServerLaunchError(RuntimeError):
    """The server did not become healthy; the message carries the tail of its log."""


@dataclasses.dataclass
class SGLangServerConfig:
    model_path: str | None                  # None: the model comes from server_args (e.g. --hf-config)
    host: str = "127.0.0.1"
    port: int | None = None                 # None: a free port, kept across relaunches
    tp_size: int = 1
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = False
    skip_server_warmup: bool = True
    base_gpu_id: int | None = None
    cuda_visible_devices: str | None = None  # None: inherit (Ray sets it for GPU actors)
    weight_version: str | None = "0"
    server_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # passthrough
    launch_module: str = "sglang.launch_server"
    python: str = sys.executable
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    log_dir: str | None = None
    startup_timeout_s: float = 900.0
    health_poll_s: float = 1.0
    watchdog_interval_s: float | None = 5.0  # None: no automatic relaunch
    max_restarts: int = 3

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if not isinstance(self.server_args, dict):
            raise TypeError(f"server_args must be a dict of SGLang server arguments, got {type(self.server_args).__name__}")


_EXPLICIT = {"model_path", "host", "port", "tp_size", "mem_fraction_static", "enable_memory_saver",
             "skip_server_warmup", "base_gpu_id", "weight_version"}


def _flag(key: str) -> str:
    return "--" + key.strip().lstrip("-").replace("_", "-")


def args_to_flags(args: dict[str, Any]) -> list[str]:
    """``{"key_name": value}`` -> SGLang-style command-line flags."""
    out: list[str] = []
    for key, value in args.items():
        if value is None or value is False:
            continue
        if value is True:
            out.append(_flag(key))
        elif isinstance(value, (list, tuple)):
            out.append(_flag(key))
            out.extend(str(v) for v in value)
        elif isinstance(value, dict):
            import json
            out += [_flag(key), json.dumps(value)]
        else:
            out += [_flag(key), str(value)]
    return out


def server_command(cfg: SGLangServerConfig, port: int) -> list[str]:
    clash = sorted({k.replace("-", "_") for k in cfg.server_args} & _EXPLICIT)
    if clash:
        raise ValueError(f"server_args sets {clash}; use the SGLangServerConfig fields of the same name instead")
    explicit: dict[str, Any] = {
        "model_path": cfg.model_path, "host": cfg.host, "port": port, "tp_size": cfg.tp_size,
        "mem_fraction_static": cfg.mem_fraction_static, "enable_memory_saver": cfg.enable_memory_saver,
        "skip_server_warmup": cfg.skip_server_warmup, "base_gpu_id": cfg.base_gpu_id,
        "weight_version": cfg.weight_version,
    }
    return [cfg.python, "-m", cfg.launch_module] + args_to_flags(explicit) + args_to_flags(cfg.server_args)


class ServerProcess:
    """One SGLang-compatible server subprocess with health waiting, logs and relaunch."""

    def __init__(self, cfg: SGLangServerConfig, *, on_relaunch: Callable[[str], None] | None = None,
                 command: Callable[[int], list[str]] | None = None, health_endpoint: str = "/health_generate"):
        """`command(port)` overrides the SGLang command line (the router reuses this class)."""
        self.cfg = cfg
        self._command = command
        self.health_endpoint = health_endpoint
        self.port = cfg.port or free_port(cfg.host)
        self.log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="sglang-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.on_relaunch = on_relaunch
        self.launches = 0
        self.restarts = 0
        self.last_error: str | None = None
        self._proc: subprocess.Popen | None = None
        self._log_path: str | None = None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._ready = threading.Event()  # set while a launched server has passed its health wait
        self._watchdog: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::") else self.cfg.host
        return f"http://{host}:{self.port}"

    @property
    def log_path(self) -> str | None:
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the server is up and healthy (e.g. after a watchdog relaunch); False on timeout."""
        return self._ready.wait(timeout) and self.alive()

    def command(self) -> list[str]:
        return self._command(self.port) if self._command is not None else server_command(self.cfg, self.port)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.cfg.env)
        if self.cfg.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.cuda_visible_devices
        if self.cfg.enable_memory_saver:
            # SGLang's memory saver cannot work with expandable segments.
            conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
            parts = [p for p in conf.split(",") if p and not p.startswith("expandable_segments")]
            if parts:
                env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(parts)
            else:
                env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # the server runs in its own session (a Ctrl-C meant for the parent must not kill it mid-request), so it
        # would outlive a parent killed without running stop(); the embedded server exits when this pid is gone
        env[PARENT_PID_ENV] = str(os.getpid())
        return env

    # ------------------------------------------------------------------ start / stop

    def start(self) -> str:
        """Launch and wait until healthy; returns the base URL. Starts the watchdog if configured."""
        with self._lock:
            self._stopping.clear()
            self._launch()
            self._wait_healthy()
        if self.cfg.watchdog_interval_s and (self._watchdog is None or not self._watchdog.is_alive()):
            self._watchdog = threading.Thread(target=self._watch, name=f"sglang-watchdog-{self.port}", daemon=True)
            self._watchdog.start()
        return self.url

    def _launch(self) -> None:
        self._ready.clear()
        self.launches += 1
        self._log_path = os.path.join(self.log_dir, f"server-{self.port}-{self.launches}.log")
        cmd = self.command()
        log.info("launching %s (log: %s)", " ".join(cmd), self._log_path)
        with open(self._log_path, "ab") as logf:
            logf.write(("$ " + " ".join(cmd) + "\n").encode())
            logf.flush()
            self._proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self._env(),
                                          start_new_session=True)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        client = EngineClient(self.url, ClientConfig(health_timeout_s=max(5.0, self.cfg.health_poll_s * 5), retries=0))

        async def poll() -> str | None:
            try:
                while time.monotonic() < deadline:
                    if self._proc is None or self._proc.poll() is not None:
                        code = None if self._proc is None else self._proc.returncode
                        return f"server exited with code {code} before becoming healthy"
                    healthy = await (client.health_generate() if self.health_endpoint == "/health_generate"
                                     else client.health())
                    if healthy:
                        return None
                    await asyncio.sleep(self.cfg.health_poll_s)
                return f"server not healthy after {self.cfg.startup_timeout_s:.0f}s"
            finally:
                await client.close()

        loop = asyncio.new_event_loop()
        try:
            problem = loop.run_until_complete(poll())
        finally:
            loop.close()
        if problem is not None:
            self._kill()
            self.last_error = problem
            raise ServerLaunchError(f"{problem} ({self.url}); command: {' '.join(self.command())}\n"
                                    f"--- last lines of {self._log_path} ---\n{self.log_tail(40)}")
        self._ready.set()
        log.info("server healthy at %s", self.url)

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            self._kill()

    def _kill(self, grace_s: float = 15.0) -> None:
        self._ready.clear()
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=grace_s)

    def restart(self) -> str:
        """Kill (if running) and relaunch on the same port; returns the URL once healthy."""
        with self._lock:
            self._kill()
            self.restarts += 1
            self._launch()
            self._wait_healthy()
        if self.on_relaunch is not None:
            self.on_relaunch(self.url)
        return self.url

    def ensure_alive(self) -> bool:
        """Relaunch if the process died. Returns True when a relaunch happened."""
        with self._lock:
            if self.alive() or self._stopping.is_set():
                return False
            code = self._proc.returncode if self._proc is not None else None
            log.warning("server %s died (exit code %s); relaunching", self.url, code)
            self.restart()
            return True

    def _watch(self) -> None:
        while not self._stopping.wait(self.cfg.watchdog_interval_s):
            if self.alive():
                continue
            self._ready.clear()
            if self.restarts >= self.cfg.max_restarts:
                self.last_error = f"server died and max_restarts={self.cfg.max_restarts} is exhausted"
                log.error("%s: %s", self.url, self.last_error)
                return
            try:
                self.ensure_alive()
            except ServerLaunchError as e:
                self.last_error = str(e)
                log.error("relaunch of %s failed: %s", self.url, e)

    def log_tail(self, lines: int = 50) -> str:
        if not self._log_path or not os.path.exists(self._log_path):
            return "<no log>"
        with open(self._log_path, "rb") as f:
            tail = collections.deque(f, maxlen=lines)
        return b"".join(tail).decode(errors="replace")


class ProcessLauncher:
    """`EngineLauncher` over a local `ServerProcess` (no Ray)."""

    def __init__(self, server: ServerProcess):
        self.server = server

    async def relaunch(self) -> str:
        return await asyncio.to_thread(self.server.restart)


class SGLangEngine:
    """Ray actor body: owns one SGLang server on the GPUs Ray gave this actor."""

    def __init__(self, cfg: SGLangServerConfig):
        self.server = ServerProcess(cfg)

    def start(self) -> str:
        return self.server.start()

    def url(self) -> str:
        return self.server.url

    def restart(self) -> str:
        return self.server.restart()

    def ensure_alive(self) -> bool:
        return self.server.ensure_alive()

    def alive(self) -> bool:
        return self.server.alive()

    def log_tail(self, lines: int = 50) -> str:
        return self.server.log_tail(lines)

    def stop(self) -> None:
        self.server.stop()


class RayEngineLauncher:
    """`EngineLauncher` that relaunches through an `SGLangEngine` actor handle."""

    def __init__(self, actor):
        self.actor = actor

    async def relaunch(self) -> str:
        return await self.actor.restart.remote()


def create_sglang_engine_actor(cfg: SGLangServerConfig, *, num_gpus: float | None = None, num_cpus: float = 1,
                               **ray_options):
    """Start the actor (not yet the server: call ``actor.start.remote()``)."""
    import ray

    opts = {"num_gpus": cfg.tp_size if num_gpus is None else num_gpus, "num_cpus": num_cpus, **ray_options}
    return ray.remote(SGLangEngine).options(**opts).remote(cfg)


def launch_sglang_engines(cfgs: list[SGLangServerConfig], **ray_options) -> list[HttpEngine]:
    """One actor per config, servers started in parallel; returns engines ready for `EngineManager`."""
    import ray

    actors = [create_sglang_engine_actor(c, **ray_options) for c in cfgs]
    urls = ray.get([a.start.remote() for a in actors])
    return [HttpEngine(u, name=f"sglang-{i}", launcher=RayEngineLauncher(a), tp_size=c.tp_size)
            for i, (u, a, c) in enumerate(zip(urls, actors, cfgs))]
