"""Process-group setup for the Megatron actor, on GPU (NCCL) and CPU (gloo).

`init_parallel` is the one entry point: it starts torch.distributed from the usual env vars
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) when needed, applies the CPU patches
when there is no CUDA, and builds megatron-core's TP/PP/DP groups. `spawn` runs a function on N
local ranks; the checkpoint tools and the CPU tests use it.
"""
from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_rl.ports import free_port

from . import cpu_compat


@dataclasses.dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device


def init_parallel(tp: int = 1, pp: int = 1, *, vpp: int | None = None, seed: int = 1234,
                  timeout_minutes: int = 30) -> ParallelInfo:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cpu = cpu_compat.apply()
    if not dist.is_initialized():
        backend = "gloo" if cpu else "nccl"
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        distributed_timeout_minutes=timeout_minutes,
    )
    torch.manual_seed(seed)
    if not cpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_info()


def current_info() -> ParallelInfo:
    from megatron.core import parallel_state as ps

    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"),
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


#: torch.distributed's TCPStore, when the port it was given is taken
_LOST_PORT = ("The server socket has failed", "EADDRINUSE")


def _spawn_entry(local_rank: int, world_size: int, port: int, fn: Callable, args: tuple, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        fn(*args)
    finally:
        try:
            destroy_parallel()
        except Exception:
            pass


def spawn(fn: Callable[..., Any], world_size: int, *args, env: dict | None = None) -> None:
    """Run ``fn(*args)`` on ``world_size`` fresh local processes (spawn start method).

    Each process sees RANK/WORLD_SIZE/MASTER_* and should call `init_parallel`. A failure on any
    rank raises here with that rank's traceback.
    """
    import torch.multiprocessing as mp

    for attempt in range(3):
        try:
            mp.spawn(_spawn_entry, args=(world_size, free_port(), fn, args, dict(env or {})),
                     nprocs=world_size, join=True)
            return
        except mp.ProcessRaisedException as e:
            # rank 0's rendezvous store lost its port to another process between the check and its bind, so the
            # group never formed: again on a fresh port, up to three times
            if attempt == 2 or not all(m in str(e) for m in _LOST_PORT):
                raise
