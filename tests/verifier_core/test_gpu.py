"""cuda backend on a real GPU (skipped without one): a correct CUDA kernel passes, ATen inside CUDA C++ is
caught, and glue-only candidates (no kernel of their own) are cheating. bench/verifier_cuda_redteam.py has
the full CUDA red-team."""
import dataclasses

import pytest

from verifier.config import VerifierConfig
from verifier.evaluate import verify
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import task_path

pytestmark = pytest.mark.gpu

CUDA = r'''
#include <ATen/cuda/CUDAContext.h>
__global__ void add_kernel(const float* a, const float* b, float* o, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) o[i] = a[i] + b[i];
}
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
  auto o = torch::empty_like(a);
  add_kernel<<<(a.numel() + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), o.data_ptr<float>(), a.numel());
  return o;
}
torch::Tensor aten_add(torch::Tensor a, torch::Tensor b) { return at::add(a, b); }
'''

HEADER = f'''```python
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SRC = r"""{CUDA}"""
ext = load_inline(name="gpu_test_add", cpp_sources="torch::Tensor add(torch::Tensor a, torch::Tensor b);\\n"
                  "torch::Tensor aten_add(torch::Tensor a, torch::Tensor b);", cuda_sources=SRC,
                  functions=["add", "aten_add"])

class ModelNew(nn.Module):
    def forward(self, a, b):
        return {{expr}}
```'''


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return VerifierConfig(backend="cuda", build_cache_dir=str(tmp_path_factory.mktemp("gpu-cache")),
                          num_timing_trials=10)


@pytest.mark.parametrize("expr,category,rule", [
    ("ext.add(a, b)", Category.PASS, None),
    ("ext.aten_add(a, b)", Category.CHEATING, "forbidden_op"),
    ("torch.empty_like(a).copy_(a)", Category.CHEATING, "no_device_kernel"),
])
def test_cuda_verdicts(cfg, expr, category, rule):
    r = verify(load_task(task_path("elementwise_add")), HEADER.replace("{expr}", expr), cfg)
    assert r.category == category, (r.feedback, r.details.get("traceback"))
    assert r.rule == rule
    if category == Category.PASS:
        assert r.q == 1.0 and r.speedup > 0 and r.device_name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64", "complex128", "bool"])
def test_output_digests_on_the_gpu_equal_the_hosts(dtype):
    """The child commits digests computed on the output's device and the parent recomputes sampled blocks on the
    host: int64 wrap-around, shifts and the tree's strided folds must agree bit for bit (a full-size output too)."""
    import torch

    from verifier.correctness import block_digests

    dt = getattr(torch, dtype)
    for n in (1_000, 50_000_003):
        x = torch.randn(n, dtype=torch.float64) * 3
        out = x > 0 if dt == torch.bool else torch.complex(x, -x).to(dt) if dt.is_complex else x.to(dt)
        assert torch.equal(block_digests(out.cuda()).cpu(), block_digests(out)), (dtype, n)


def test_full_handovers_go_through_a_device_buffer(cfg):
    """With every output size offered the device buffer (``verifier.device_handover``), an honest kernel passes
    and a wrong one is caught, both compared from the parent's own snapshot of the buffer."""
    dev_cfg = dataclasses.replace(cfg, device_handover_above_bytes=0)
    task = load_task(task_path("elementwise_add"))
    r = verify(task, HEADER.replace("{expr}", "ext.add(a, b)"), dev_cfg)
    assert r.category == Category.PASS, (r.feedback, r.details.get("handover"), r.details.get("traceback"))
    info = r.details["handover"]   # the correctness trials, the ablation trial, the hidden trials and the audits
    assert info["device"] == info["full"] >= 6 + len(r.details["audits"]), info
    assert not {"device_off", "device_error"} & set(info), info
    r = verify(task, HEADER.replace("{expr}", "ext.add(a, a)"), dev_cfg)
    assert r.category == Category.CORRECTNESS_ERROR, (r.feedback, r.details.get("handover"))
    assert r.details["handover"]["device"] >= 1


def test_outputs_too_large_to_share_the_device_go_through_its_buffer_once_it_is_held_alone(cfg, monkeypatch):
    """A stage sharing the device hands large outputs over through a memfd (a buffer would take memory the other
    stages were not told about); once it holds the device alone, for timing, its audits and hidden trials use the
    device buffer (through a memfd, a 256 MB output cost the child ~0.23 s a handover, a dozen per check)."""
    from verifier import evaluate
    monkeypatch.setattr(evaluate, "DEVICE_HANDOVER_SHARED_MAX_BYTES", 0)   # every output counts as large
    dev_cfg = dataclasses.replace(cfg, device_handover_above_bytes=0)
    task = load_task(task_path("elementwise_add"))
    r = verify(task, HEADER.replace("{expr}", "ext.add(a, b)"), dev_cfg)
    assert r.category == Category.PASS, (r.feedback, r.details.get("handover"), r.details.get("traceback"))
    info = r.details["handover"]
    assert r.details["device_use"] == "shared, exclusive while timing"
    # the timing's audits (and its hidden trials) through the device; the shared correctness trials not
    assert len(r.details["audits"]) <= info.get("device", 0) < info["full"], info
    assert not {"device_off", "device_error"} & set(info), info


def test_sampled_handovers_and_commitments_go_through_device_buffers(cfg):
    """Outputs sampled as a full-size task's are (every trial after the first, and the audits): the sample comes
    back through the device buffer offered for samples and the commitment through its own, indices drawn on the
    device; an honest kernel passes and a wrong one is caught from the sample."""
    dev_cfg = dataclasses.replace(cfg, device_handover_above_bytes=0, sample_outputs_above_bytes=1024,
                                  output_sample_elements=512)
    task = load_task(task_path("elementwise_add"))
    r = verify(task, HEADER.replace("{expr}", "ext.add(a, b)"), dev_cfg)
    assert r.category == Category.PASS, (r.feedback, r.details.get("handover"), r.details.get("traceback"))
    info = r.details["handover"]
    assert info["sampled"] >= 4 and info["device"] >= info["sampled"] + 1, info
    assert not {"device_off", "device_error"} & set(info), info
    assert r.details["child_seconds"].get("digests", 0) > 0, r.details["child_seconds"]
    r = verify(task, HEADER.replace("{expr}", "ext.add(a, a)"), dev_cfg)
    assert r.category == Category.CORRECTNESS_ERROR, (r.feedback, r.details.get("handover"))
