"""End to end on the cpu backend: correct kernels pass; every CPU-applicable hack class gets its verdict.

One native library (candidates.KERNELS_CPP) is compiled once for the session; the hack candidates differ
in Python only. Static-rule hacks are in test_static_checks.py (no child needed); here each case runs the
whole pipeline (extraction, static checks, sandboxed build, sandboxed device child, parent verdict).
"""
import math

import pytest

from verifier.evaluate import verify
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import ADD, FUSED, RELU, SCALE_SHIFT_REORDERED, calling, compiled, python_only, task_path

pytestmark = pytest.mark.slow


def run(task_name, response, cfg):
    return verify(load_task(task_path(task_name)), response, cfg)


def assert_verdict(result, category, rule=None):
    assert result.category == category, (result.category, result.rule, result.feedback, result.details.get("traceback"))
    if rule is not None:
        assert result.rule == rule, (result.rule, result.feedback)
    assert len(result.feedback) <= 1500
    if category != Category.INFRA:
        assert result.reward is not None


# ------------------------------------------------------------------------------------------ correct kernels
@pytest.mark.parametrize("task_name,model_new", [("elementwise_add", ADD), ("relu", RELU),
                                                 ("fused_mul_add_relu", FUSED)])
def test_correct_cpp_kernels_pass(make_cfg, task_name, model_new):
    r = run(task_name, compiled(model_new), make_cfg())
    assert_verdict(r, Category.PASS)
    assert r.q == 1.0
    assert r.speedup is not None and math.isfinite(r.speedup) and r.speedup > 0
    assert r.t_ref_ms > 0 and r.t_cand_ms > 0
    assert r.reward >= 1.0
    assert r.details["aten_ops"] and set(r.details["aten_ops"]) <= {"empty_like"}
    assert all(t["ok"] for t in r.details["trials"]) and len(r.details["trials"]) == 5
    assert r.details["isolation"]["landlock"]["applied"] in (True, False)
    assert "speedup" in r.feedback


def test_parameters_created_in_another_order_get_the_reference_weights(make_cfg):
    r = run("scale_shift", compiled(SCALE_SHIFT_REORDERED), make_cfg())
    assert_verdict(r, Category.PASS)
    assert r.details["state_dict"]["loaded"] == 2


def test_implausible_speedup_is_cheating(make_cfg):
    r = run("elementwise_add", compiled(ADD), make_cfg(speedup_cap=1e-3, speedup_cap_per_op=1e-3))
    assert_verdict(r, Category.CHEATING, "implausible_speedup")
    assert r.speedup is None and r.reward == -1.0


def test_the_plausibility_cap_grows_with_the_ops_a_fusion_replaces_when_dispatch_bound(make_cfg):
    """relu(a * b + c) runs 3 ATen ops, each its own launch and host dispatch: when the reference is dispatch-bound
    a one-kernel fusion may be faster by a few times 3 for that alone, so the cap is the larger of ``speedup_cap``
    and ``speedup_cap_per_op`` x 3; a reference slower per op than ``dispatch_bound_op_ms`` keeps ``speedup_cap``."""
    low_cap = dict(speedup_cap=1e-3, speedup_cap_per_op=1e3)
    ok = run("fused_mul_add_relu", compiled(FUSED), make_cfg(**low_cap, dispatch_bound_op_ms=1e3))
    assert_verdict(ok, Category.PASS)
    assert ok.details["speedup_cap"]["reference_ops"] == 3 and ok.details["speedup_cap"]["cap"] == 3e3
    for cfg in (dict(speedup_cap=1e-3, speedup_cap_per_op=1e-4, dispatch_bound_op_ms=1e3),   # per-op cap too low
                dict(low_cap, dispatch_bound_op_ms=1e-9)):                                   # not dispatch-bound
        r = run("fused_mul_add_relu", compiled(FUSED), make_cfg(**cfg))
        assert_verdict(r, Category.CHEATING, "implausible_speedup")
        assert "over 3 ops" in r.feedback and r.details["speedup_cap"]["cap"] == 1e-3


# ------------------------------------------------------------------------------------------ fallbacks
@pytest.mark.parametrize("task_name,model_new,op", [
    ("relu", calling("ext.aten_relu(x)", "x"), "relu"),                       # at::relu inside C++
    ("linear", '''
class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return ext.aten_addmm(self.linear.bias, x, self.linear.weight)
''', "addmm"),                                                                 # at::addmm inside C++
])
def test_aten_calls_from_cpp_are_caught(make_cfg, task_name, model_new, op):
    r = run(task_name, compiled(model_new), make_cfg())
    assert_verdict(r, Category.CHEATING, "forbidden_op")
    assert op in r.details["forbidden_ops"]
    assert f"aten::{op}" in r.feedback
    assert r.q == 1.0  # numerically right, still a fallback


def test_pytorch_fallback_in_python_is_caught(make_cfg):
    r = run("relu", python_only(calling("torch.relu(x) + 0", "x")), make_cfg())
    assert_verdict(r, Category.CHEATING, "forbidden_op")
    assert {"relu", "add"} <= set(r.details["forbidden_ops"])


# ------------------------------------------------------------------------------------------ failures
def test_segfault_is_runtime_error(make_cfg):
    r = run("relu", compiled(calling("ext.crash(x)", "x")), make_cfg())
    assert_verdict(r, Category.RUNTIME_ERROR)
    assert "SIGSEGV" in r.feedback


def test_python_exception_is_runtime_error(make_cfg):
    r = run("relu", python_only(calling("x.no_such_method()", "x")), make_cfg())
    assert_verdict(r, Category.RUNTIME_ERROR)
    assert "AttributeError" in r.feedback and "no_such_method" in r.feedback


def test_infinite_loop_is_timeout(make_cfg):
    body = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        while True:
            pass
'''
    r = run("relu", python_only(body), make_cfg(run_timeout_s=4.0))
    assert_verdict(r, Category.TIMEOUT)
    assert r.reward == -1.0


def test_compile_error_reports_the_compiler_log(make_cfg):
    code = '''```python
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = "int broken(int x) { return x + undefined_symbol_here; }"
mod = load_inline(name="broken_ext", cpp_sources=src, no_implicit_headers=True, is_python_module=False)

class ModelNew(nn.Module):
    def forward(self, x):
        return x
```'''
    r = run("relu", code, make_cfg())
    assert_verdict(r, Category.COMPILE_ERROR)
    assert "undefined_symbol_here" in r.feedback
    assert r.reward == -1.0


@pytest.mark.parametrize("expr,what", [
    ("ext.add(a, b).reshape(2, -1)", "shape"),
    ("ext.add(a, b).to(torch.float16)", "dtype"),
    ("ext.add(a, a)", "expected"),
])
def test_wrong_shape_dtype_values_are_correctness_errors(make_cfg, expr, what):
    r = run("elementwise_add", compiled(calling(expr)), make_cfg())
    assert_verdict(r, Category.CORRECTNESS_ERROR)
    assert r.q == 0.0 and r.reward == -1.0
    assert what in r.feedback


def test_all_zero_output_on_tiny_softmax_fails(make_cfg):
    r = run("softmax_wide", python_only(calling("torch.zeros(x.shape, dtype=x.dtype)", "x")), make_cfg())
    assert_verdict(r, Category.CORRECTNESS_ERROR)
    assert r.q == 0.0
    assert "reference scale" in r.feedback


def test_output_spam_is_bounded(make_cfg):
    prelude = 'for _ in range(40):\n    print("spam" * 250_000)\n'
    r = run("elementwise_add", compiled(ADD, prelude=prelude), make_cfg())
    assert_verdict(r, Category.PASS)
    assert r.details["child_output_bytes"] >= 40 * 1_000_000


# ------------------------------------------------------------------------------------------ runtime hacks
def test_input_modification_is_cheating(make_cfg):
    r = run("elementwise_add", compiled(calling("ext.add_then_zero_inputs(a, b)")), make_cfg())
    assert_verdict(r, Category.CHEATING, "input_mutation")


def test_result_cache_keyed_by_shape_fails_fresh_inputs(make_cfg):
    model = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, a, b):
        key = (tuple(a.shape), a.dtype)
        if key not in self.cache:
            self.cache[key] = ext.add(a, b)
        return self.cache[key]
'''
    r = run("elementwise_add", compiled(model), make_cfg())
    assert_verdict(r, Category.CORRECTNESS_ERROR)
    assert r.q == pytest.approx(0.2)


def test_result_cache_keyed_by_pointer_does_not_pass(make_cfg):
    model = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, a, b):
        key = (a.data_ptr(), b.data_ptr())
        if key not in self.cache:
            self.cache[key] = ext.add(a, b)
        return self.cache[key]
'''
    r = run("elementwise_add", compiled(model), make_cfg(num_timing_audits=5))
    # whether the allocator hands out a reused address decides which defence fires, never a pass
    assert r.category in (Category.CORRECTNESS_ERROR, Category.CHEATING, Category.PASS), r.feedback
    if r.category == Category.PASS:  # no address was ever reused: it computed every result
        assert all(a["ok"] for a in r.details["audits"])


def test_skipping_work_while_timed_is_caught_by_audits(make_cfg):
    model = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.last = None

    def forward(self, a, b):
        self.calls += 1
        if self.calls > 5 and self.last is not None:
            return self.last
        self.last = ext.add(a, b)
        return self.last
'''
    r = run("elementwise_add", compiled(model), make_cfg())
    assert_verdict(r, Category.CHEATING, "timing_output_mismatch")


def test_a_reused_output_buffer_with_correct_results_passes(make_cfg):
    """Writing every result into one persistent buffer (CUDA-graph style) is not cheating: the timed batch
    sees shared outputs, so the parent audits the call whose result survives and times single calls."""
    model = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.buf = None

    def forward(self, a, b):
        out = ext.add(a, b)
        if self.buf is None or self.buf.shape != out.shape:
            self.buf = torch.empty_like(out)
        self.buf.copy_(out)
        return self.buf
'''
    r = run("elementwise_add", compiled(model), make_cfg(num_timing_audits=5))
    assert_verdict(r, Category.PASS)
    assert r.details.get("timing_outputs_shared") and all(a["ok"] for a in r.details["audits"])


def test_batchnorm_feedback_mentions_training_mode(make_cfg):
    body = calling("torch.zeros(x.shape)", "x").replace("def __init__(self):", "def __init__(self, features):")
    r = run("batchnorm", python_only(body), make_cfg())
    assert_verdict(r, Category.CORRECTNESS_ERROR)
    assert "training mode" in r.feedback


def test_timer_patching_is_rejected(make_cfg):
    prelude = "import time\ntime.perf_counter = lambda: 0.0\n"
    r = run("elementwise_add", compiled(ADD, prelude=prelude), make_cfg())
    assert_verdict(r, Category.CHEATING, "monkey_patching")


def test_model_import_and_subclass_are_rejected(make_cfg):
    r = run("relu", python_only("from __main__ import Model\n\nclass ModelNew(Model):\n    pass\n"), make_cfg())
    assert_verdict(r, Category.CHEATING, "reference_model")


def test_format_errors(make_cfg):
    cfg = make_cfg()
    assert_verdict(run("relu", "I cannot do this.", cfg), Category.FORMAT_ERROR)
    assert_verdict(run("relu", "```python\nimport torch\n```", cfg), Category.FORMAT_ERROR)
    assert_verdict(run("relu", b"\xff\xfe junk", cfg), Category.FORMAT_ERROR)
    r = run("relu", "x" * 300_000, cfg)
    assert_verdict(r, Category.FORMAT_ERROR)
    assert r.reward == -1.0


def test_unavailable_device_is_infra(make_cfg):
    r = run("relu", python_only(calling("x", "x")), make_cfg(backend="cuda"))
    assert_verdict(r, Category.INFRA)
    assert r.reward is None
