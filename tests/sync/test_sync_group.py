"""The weight-update process group is stateless: it leaves torch.distributed's default group alone."""
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_rl.rollout.sglang_engine import free_port
from megatron_rl.sync.buckets import flatten
from megatron_rl.sync.transport import (WeightGroupSpec, WeightUpdateGroup, distributed_request,
                                        receive_flattened)


def test_flattened_broadcast_between_two_stateless_ranks_beside_a_default_group(tmp_path):
    # A default (trainer) group of its own, which the weight group must not disturb.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        spec = WeightGroupSpec("127.0.0.1", free_port(), world_size=2, group_name="wg-test", backend="gloo",
                               timeout_s=60)
        tensors = [("x", torch.randn(3, 4)), ("y", torch.arange(7, dtype=torch.float32))]
        bucket = flatten(tensors)
        req = distributed_request(bucket, torch.float32)
        received = {}

        def engine_side():
            g = WeightUpdateGroup(spec, rank=1)
            received["tensors"] = receive_flattened(g, req["names"], req["dtypes"], req["shapes"])
            g.destroy()

        t = threading.Thread(target=engine_side)
        t.start()
        trainer = WeightUpdateGroup(spec, rank=0)
        trainer.broadcast(bucket.buffers[torch.float32])
        t.join(timeout=60)
        trainer.destroy()
        got = dict(received["tensors"])
        assert all(torch.equal(got[n], v) for n, v in tensors)
        # the default group is untouched and still works
        assert dist.is_initialized() and dist.get_world_size() == 1
        x = torch.ones(2)
        dist.all_reduce(x)
        assert torch.equal(x, torch.ones(2))
    finally:
        dist.destroy_process_group()


def test_bad_specs_are_named():
    with pytest.raises(ValueError, match="backend"):
        WeightGroupSpec("127.0.0.1", 1234, 2, backend="mpi")
    with pytest.raises(ValueError, match="world_size"):
        WeightGroupSpec("127.0.0.1", 1234, 1)
    with pytest.raises(ValueError, match="one dtype"):
        receive_flattened(None, ["a", "b"], ["float32", "bfloat16"], [[1], [1]])
