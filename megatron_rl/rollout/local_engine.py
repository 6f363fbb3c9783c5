"""One embedded engine serving an HF model dir on this machine, for the tools that sample from a checkpoint
(RFT, evaluation): the same server process and HTTP API (SGLang's ``/generate``) as the RL rollouts use."""
from __future__ import annotations

import contextlib
import signal
import tempfile
import threading
from typing import Iterator

from .sglang_engine import ServerProcess, SGLangServerConfig


def _terminate_as_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit in the main thread instead of ending the process on the spot,
    so ``finally`` blocks (stopping a launched server, removing temp files) run on a plain ``kill``. A handler
    someone else installed is left alone."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _terminate_as_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def serve_embedded(model_dir: str, *, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                   max_batch_size: int = 64, log_dir: str | None = None, startup_timeout_s: float = 600.0,
                   threads: int | None = None) -> Iterator[str]:
    """Start ``megatron_rl.rollout.embedded_server`` on ``model_dir`` and yield its URL; stop it on exit.
    ``threads``: torch threads of the server on a CPU (None: torch's default)."""
    cpu = not device.startswith("cuda")
    cfg = SGLangServerConfig(
        model_path=model_dir, launch_module="megatron_rl.rollout.embedded_server",
        log_dir=log_dir or tempfile.mkdtemp(prefix="embedded-engine-"), startup_timeout_s=startup_timeout_s,
        cuda_visible_devices="" if cpu else None, watchdog_interval_s=None,
        server_args={"dtype": dtype, "device": device, "random_seed": seed, "max_batch_size": max_batch_size},
        env={"OMP_NUM_THREADS": str(threads)} if cpu and threads else {})
    server = ServerProcess(cfg)
    with sigterm_unwinds():
        try:   # a SIGTERM during start-up stops the half-started server too
            yield server.start()
        finally:
            server.stop()
