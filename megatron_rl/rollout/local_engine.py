"""One embedded engine serving an HF model dir on this machine, for the tools that sample from a checkpoint
(RFT, evaluation): the same server process and HTTP API (SGLang's ``/generate``) as the RL rollouts use."""
from __future__ import annotations

import contextlib
import tempfile
from typing import Iterator


@contextlib.contextmanager
def serve_embedded(model_dir: str, *, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                   max_batch_size: int = 64, log_dir: str | None = None, startup_timeout_s: float = 600.0,
                   threads: int | None = None) -> Iterator[str]:
    """Start ``megatron_rl.rollout.embedded_server`` on ``model_dir`` and yield its URL; stop it on exit.
    ``threads``: torch threads of the server on a CPU (None: torch's default)."""
    from .sglang_engine import ServerProcess, SGLangServerConfig

    cpu = not device.startswith("cuda")
    cfg = SGLangServerConfig(
        model_path=model_dir, launch_module="megatron_rl.rollout.embedded_server",
        log_dir=log_dir or tempfile.mkdtemp(prefix="embedded-engine-"), startup_timeout_s=startup_timeout_s,
        cuda_visible_devices="" if cpu else None, watchdog_interval_s=None,
        server_args={"dtype": dtype, "device": device, "random_seed": seed, "max_batch_size": max_batch_size},
        env={"OMP_NUM_THREADS": str(threads)} if cpu and threads else {})
    server = ServerProcess(cfg)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()
