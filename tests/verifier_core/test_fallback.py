"""The aten allowlist against what torch 2.11 actually emits, and the outermost-op rule."""
import torch

from verifier.devices import get_backend
from verifier.fallback import (ALLOWED_ATEN_OPS, APPENDIX_J_OPS, candidate_kernels, forbidden_ops,
                               outermost_aten_ops)


def profiled(fn):
    with get_backend("cpu").profiler() as prof:
        fn()
    return outermost_aten_ops(prof.function_events)


def test_appendix_j_has_42_entries_counting_the_assert_async_overload():
    assert len(APPENDIX_J_OPS) == 41  # `_assert_async` and `_assert_async.msg` share one profiler name
    assert APPENDIX_J_OPS <= ALLOWED_ATEN_OPS


def test_legal_glue_emits_only_allowed_ops():
    x = torch.randn(8, 16)

    def glue():
        y = torch.empty_like(x)
        x.contiguous().view(-1).reshape(8, 16)
        x.t().contiguous()
        x.to(torch.float16)
        x.permute(1, 0).unsqueeze(0).squeeze(0).flatten()
        x.expand(2, 8, 16)
        torch.zeros(3)
        torch.ones(2)
        torch.full((2,), 1.0)
        torch.tensor([1.0, 2.0])
        torch.arange(4)
        torch.rand(2)
        x.detach().clone()
        x[1:3, 0]
        y.zero_()
        x.new_empty((2,))
        float(x[0, 0].item())
        return y

    ops = profiled(glue)
    assert forbidden_ops(ops) == [], ops
    assert {"empty_like", "to", "t", "rand", "lift_fresh", "item"} <= set(ops)
    # implementation ops of allowed ops are not judged separately
    assert "_to_copy" not in ops and "uniform_" not in ops and "copy_" not in ops


def test_compute_ops_are_forbidden():
    x = torch.randn(8, 16)
    w = torch.randn(16, 4)
    ops = profiled(lambda: (torch.relu(x), x @ w, torch.nn.functional.softmax(x, dim=1), x + 1, x.sum()))
    assert {"relu", "matmul", "softmax", "add", "sum"} <= set(forbidden_ops(ops)), ops


def test_device_kernel_classification():
    assert candidate_kernels(["void at::native::vectorized_elementwise_kernel<4>(...)", "Memcpy HtoD (Pageable)",
                              "Memset (Device)", "my_add_kernel(float const*, float*, int)",
                              "triton_poi_fused_add_0"]) == ["my_add_kernel(float const*, float*, int)",
                                                             "triton_poi_fused_add_0"]
    assert candidate_kernels(["void at::native::reduce_kernel<512, 1>(...)"]) == []
