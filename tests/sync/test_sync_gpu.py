"""GPU paths of the weight sync (run on a GPU machine: pytest -m gpu tests/sync)."""
import pytest
import torch

from megatron_rl.check_sync import run_check


@pytest.mark.gpu
def test_colocated_cuda_ipc_sync_matches_actor_logprobs(tmp_path):
    r = run_check(tp=1, pp=1, model=None, transport="colocated", dtype="float32", workdir=str(tmp_path))
    assert r["max_abs_logprob_diff"] < 1e-3 and r["weight_version"] == "1"


@pytest.mark.gpu
def test_distributed_nccl_sync_to_a_second_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    r = run_check(tp=1, pp=1, model=None, transport="distributed", dtype="float32", workdir=str(tmp_path),
                  engine_device="cuda:1")
    assert r["max_abs_logprob_diff"] < 1e-3 and r["weight_version"] == "1"
