"""Patterns of KernelBench's own problem files, written here in its style, that the verifier must accept.

Each case reproduces what real KernelBench problems do and once broke us: size constants assigned in
chains and tuples (``height = width = 128``, ``depth, height, width = 16, 32, 32``) that the size-profile
rewriter must handle; inputs made with ``.cuda()`` / ``device="cuda"`` / fp16 (older problems); GPU-sized
shapes (6 GB inputs) that must get a clear verdict on the cpu backend before anything is allocated or
compiled; and the CLI exiting 0 with that verdict.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from verifier import inputs
from verifier.build import build_candidate
from verifier.config import VerifierConfig
from verifier.evaluate import run_candidate, verify
from verifier.extract import extract_candidate
from verifier.size_profiles import apply_size_profile, load_tasks, module_constants, rewrite_constants
from verifier.tasks import load_task, load_task_module, load_task_set
from verifier.types import Category

from tests.verifier_core.candidates import RELU, calling, compiled, python_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 1 << 30

# level2-style fused op: constants in a chain, in a tuple, and as expressions
CONV_TASK = '''import torch
import torch.nn as nn

class Model(nn.Module):
    """3D convolution, softmax over channels, then max pooling."""
    def __init__(self, in_channels, out_channels, kernel_size, pool_kernel_size):
        super(Model, self).__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size)
        self.pool = nn.MaxPool3d(pool_kernel_size)

    def forward(self, x):
        return self.pool(torch.softmax(self.conv(x), dim=1))

batch_size = 128
in_channels = 3
out_channels = 16
depth, height, width = 16, 32, 32
kernel_size = 3
pool_kernel_size = 2

def get_inputs():
    return [torch.rand(batch_size, in_channels, depth, height, width)]

def get_init_inputs():
    return [in_channels, out_channels, kernel_size, pool_kernel_size]
'''

CHAIN_TASK = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, bias_shape):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        return torch.relu(x) + self.bias

batch_size = 128
channels = 64
height = width = 2048
height, width = (32, 32)   # a later assignment wins, as in level2/11
bias_shape = (channels, 1, 1)
scale = 2048 * 2

def get_inputs():
    return [torch.rand(batch_size, channels, height, width)]

def get_init_inputs():
    return [bias_shape]
'''

# level1-style elementwise op at KernelBench's GPU size (6 GiB of fp32 per input)
HUGE_RELU = '''import torch
import torch.nn as nn

class Model(nn.Module):
    """Simple model that performs a ReLU activation."""
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

batch_size = BATCH
dim = 393216

def get_inputs():
    x = torch.rand(batch_size, dim)
    return [x]

def get_init_inputs():
    return []  # No special initialization inputs needed
'''

# an older-KernelBench-style problem that creates its inputs on cuda in fp16
CUDA_INPUTS = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v, scale):
        return torch.relu(q) * scale + k - v

batch_size = height = 4
dim = 8

def get_inputs():
    q = torch.randn(batch_size, dim, device='cuda', dtype=torch.float16)
    k = torch.rand(batch_size, dim).cuda()
    v = torch.rand(batch_size, dim).to("cuda")
    return [q, k, v, 0.5]

def get_init_inputs():
    return []
'''


def _write(path, text: str) -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


@pytest.fixture(scope="module")
def kb_tree(tmp_path_factory):
    """A KernelBench-shaped checkout: KernelBench/level1..level4 plus a changelog folder of notes."""
    root = tmp_path_factory.mktemp("kb") / "KernelBench"
    _write(root / "level1" / "19_ReLU.py", HUGE_RELU.replace("BATCH", "4096"))
    _write(root / "level1" / "100_ReLU_cuda.py", CUDA_INPUTS)
    _write(root / "level2" / "6_Conv3d_Softmax_MaxPool.py", CONV_TASK)
    _write(root / "level2" / "11_Chain_Bias.py", CHAIN_TASK)
    # level4-style: a module-level import the host may lack; listing a folder never runs a task
    _write(root / "level4" / "1_hub_model.py", "import no_such_hub_module\n" + CONV_TASK)
    _write(root / "changelog" / "v0.1", "notes, not a task\n")
    return str(root)


def test_kernelbench_tree_lists_every_level_with_ids(kb_tree):
    tasks = load_task_set(kb_tree)
    assert {t.task_id: t.level for t in tasks} == {
        "level1/19_ReLU": 1, "level1/100_ReLU_cuda": 1, "level2/6_Conv3d_Softmax_MaxPool": 2,
        "level2/11_Chain_Bias": 2, "level4/1_hub_model": 4}
    one_level = load_tasks(os.path.join(kb_tree, "level2"))
    assert [t.task_id for t in one_level] == ["level2/6_Conv3d_Softmax_MaxPool", "level2/11_Chain_Bias"]
    assert load_task(os.path.join(kb_tree, "level1", "19_ReLU.py")).task_id == "19_ReLU"


def test_chained_and_unpacked_size_constants_are_read_and_rewritten(kb_tree):
    conv = load_task(os.path.join(kb_tree, "level2", "6_Conv3d_Softmax_MaxPool.py"))
    chain = load_task(os.path.join(kb_tree, "level2", "11_Chain_Bias.py"))
    assert {k: module_constants(conv.source)[k] for k in ("depth", "height", "width")} == \
        {"depth": 16, "height": 32, "width": 32}
    consts = module_constants(chain.source)
    assert (consts["height"], consts["width"], consts["channels"]) == (32, 32, 64)
    assert "scale" not in consts and "bias_shape" not in consts   # expressions, not literals

    small = rewrite_constants(conv.source, {"batch_size": 2, "height": 8, "depth": 6})
    assert "depth, height, width = 6, 8, 32\n" in small and "batch_size = 2\n" in small
    assert small.replace("6, 8, 32", "16, 32, 32").replace("batch_size = 2", "batch_size = 128") == conv.source
    x, = load_task_module(dataclass_replace(conv, small)).get_inputs()
    assert tuple(x.shape) == (2, 3, 6, 8, 32)

    # every assignment of a name is rewritten; a chain whose names now differ is split, the other keeps its value
    split = rewrite_constants(chain.source, {"height": 8, "channels": 4, "scale": 3})
    assert "height, width = 8, 2048\n" in split and "height, width = (8, 32)" in split and "scale = 3\n" in split
    mod = load_task_module(dataclass_replace(chain, split))
    assert tuple(mod.get_inputs()[0].shape) == (128, 4, 8, 32) and mod.bias_shape == (4, 1, 1)
    both = rewrite_constants(chain.source, {"height": 8, "width": 8})
    assert "height = width = 8\n" in both and "height, width = (8, 8)" in both
    with pytest.raises(ValueError, match="assigned together from an expression"):
        rewrite_constants("a = b = f(2)\n", {"a": 1})


def dataclass_replace(task, source):
    import dataclasses
    return dataclasses.replace(task, source=source)


def test_manifest_profile_shrinks_a_kernelbench_task(tmp_path):
    """A user-written manifest gives real problems a small profile, tuple and chain constants included."""
    _write(tmp_path / "level2" / "6_Conv3d.py", CONV_TASK)
    _write(tmp_path / "level2" / "11_Chain.py", CHAIN_TASK)
    manifest = {"tasks": [
        {"path": "level2/6_Conv3d.py", "level": 2, "sizes": {"tiny": {"batch_size": 2, "depth": 5, "height": 6,
                                                                       "width": 7}}},
        {"path": "level2/11_Chain.py", "level": 2, "sizes": {"tiny": {"batch_size": 1, "height": 3, "width": 3}}}]}
    _write(tmp_path / "manifest.json", json.dumps(manifest))
    shapes = []
    for t in load_tasks(str(tmp_path)):
        mod = load_task_module(apply_size_profile(t, "tiny"))
        shapes.append(tuple(mod.get_inputs()[0].shape))
    assert shapes == [(2, 3, 5, 6, 7), (1, 64, 3, 3)]


def test_inputs_made_on_cuda_in_fp16_land_on_the_verified_device(kb_tree):
    mod = load_task_module(load_task(os.path.join(kb_tree, "level1", "100_ReLU_cuda.py")))
    a = inputs.make_inputs(mod, 5, "cpu", "float32")
    b = inputs.make_inputs(mod, 5, "cpu", "float32")
    assert [x.device.type for x in a[:3]] == ["cpu"] * 3 and all(x.dtype == torch.float32 for x in a[:3])
    assert a[3] == 0.5 and all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))
    assert not torch.equal(a[1], inputs.make_inputs(mod, 6, "cpu", "float32")[1])
    fp = inputs.estimate_footprint(mod, "float32")
    assert (fp.input_bytes, fp.output_bytes, fp.param_bytes) == (3 * 4 * 8 * 4, 4 * 8 * 4, 0)


def test_footprint_of_gpu_sized_tasks_is_measured_without_allocating(kb_tree):
    t0 = time.monotonic()
    relu = load_task_module(load_task(os.path.join(kb_tree, "level1", "19_ReLU.py")))
    fp = inputs.estimate_footprint(relu, "float32")
    assert (fp.input_bytes, fp.output_bytes, fp.param_bytes) == (6 * GiB, 6 * GiB, 0)
    assert inputs.estimate_footprint(relu, "bfloat16").input_bytes == 3 * GiB
    conv = load_task_module(load_task(os.path.join(kb_tree, "level2", "6_Conv3d_Softmax_MaxPool.py")))
    fp2 = inputs.estimate_footprint(conv, "float32")
    assert fp2.input_bytes == 128 * 3 * 16 * 32 * 32 * 4
    assert fp2.output_bytes == 128 * 16 * 7 * 15 * 15 * 4 and fp2.param_bytes == (16 * 3 * 27 + 16) * 4
    assert time.monotonic() - t0 < 60

    msg = inputs.memory_problem(fp, is_gpu=False, backend_name="cpu", host_free=20 * GiB, child_limit=32 * GiB)
    assert "host memory" in msg and "inputs 6.0 GiB" in msg and "20.0 GiB is available" in msg
    assert "size profile" in msg
    assert inputs.memory_problem(fp2, is_gpu=False, backend_name="cpu", host_free=20 * GiB,
                                 child_limit=32 * GiB) is None
    limit = inputs.memory_problem(fp, is_gpu=False, backend_name="cpu", host_free=None, child_limit=16 * GiB)
    assert "memory_limit_bytes" in limit
    gpu = inputs.memory_problem(fp, is_gpu=True, backend_name="cuda", host_free=None, child_limit=None,
                                device_free=16 * GiB)
    assert "cuda device memory" in gpu
    assert inputs.memory_problem(fp, is_gpu=True, backend_name="cuda", host_free=None, child_limit=None,
                                 device_free=140 * GiB) is None


def test_footprint_of_data_dependent_tasks_degrades_gracefully():
    class Mod:
        @staticmethod
        def get_inputs():
            x = torch.rand(8, 4)
            return [x[: int(x.sum().item())]]   # data-dependent: cannot run on meta tensors

        @staticmethod
        def get_init_inputs():
            return []

    assert inputs.estimate_footprint(Mod, "float32") is None

    class Linspace(torch.nn.Module):   # Swin-style __init__: .item() over a linspace
        def __init__(self):
            super().__init__()
            self.rates = [x.item() for x in torch.linspace(0, 0.1, 4)]

        def forward(self, x):
            return x * 2

    Mod.get_inputs = staticmethod(lambda: [torch.rand(16, 4)])
    Mod.Model = Linspace
    fp = inputs.estimate_footprint(Mod, "float32")
    assert fp.input_bytes == 256 and fp.output_bytes is None
    msg = inputs.memory_problem(fp, is_gpu=False, backend_name="cpu", host_free=100, child_limit=None)
    assert "(assumed)" in msg


def _cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "verifier", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_check_on_a_task_too_large_for_the_host_is_a_quick_clear_verdict(tmp_path):
    """GPU-sized inputs (here 1.5 TiB) on the cpu backend: an infra verdict naming the memory, before any
    compile or allocation, and exit code 0 because a verdict was printed."""
    task = _write(tmp_path / "level1" / "19_ReLU.py", HUGE_RELU.replace("BATCH", "1048576"))
    cand = _write(tmp_path / "c.md", compiled(RELU))
    t0 = time.monotonic()
    r = _cli("check", "--task", task, "--candidate", cand, "--backend", "cpu", "--json",
             "--cache", str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["category"] == "infra" and out["reward"] is None and out["speedup"] is None
    assert "19_ReLU" in out["feedback"] and "host memory" in out["feedback"] and "1536.0 GiB" in out["feedback"]
    assert out["details"]["footprint"]["input_bytes"] == 1536 * GiB
    assert "build" not in out["details"]   # nothing was compiled
    assert time.monotonic() - t0 < 120


def test_device_stage_refuses_a_task_too_large_for_the_host(tmp_path):
    """The farm calls the device stage directly: it checks the footprint too, before starting a child."""
    task = load_task(_write(tmp_path / "level1" / "19_ReLU.py", HUGE_RELU.replace("BATCH", "1048576")))
    cfg = VerifierConfig(build_cache_dir=str(tmp_path / "cache"))
    code = extract_candidate(python_only(calling("torch.relu(x)", "x")), cfg.max_response_bytes)
    build = build_candidate(task, code, cfg)
    assert build.ok
    r = run_candidate(task, code, build, cfg)
    assert r.category == Category.INFRA and "host memory" in r.feedback
    assert "child" not in r.details


KB_RELU_SMALL = textwrap.dedent('''\
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        """Simple model that performs a ReLU activation."""
        def __init__(self):
            super(Model, self).__init__()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x)

    batch_size = dim = 64
    batch_size, dim = 16, 512

    def get_inputs():
        x = torch.rand(batch_size, dim).cuda() - 0.5
        return [x]

    def get_init_inputs():
        return []  # No special initialization inputs needed
    ''')


@pytest.mark.slow
def test_kernelbench_style_task_end_to_end(tmp_path, make_cfg):
    """A KernelBench-style task whose inputs are made with .cuda(): a C++ kernel passes on the cpu backend,
    a PyTorch fallback is cheating (same shared kernel library as the core red-team tests)."""
    task = load_task(_write(tmp_path / "level1" / "19_ReLU.py", KB_RELU_SMALL))
    r = verify(task, compiled(RELU), make_cfg(num_correct_trials=2))
    assert r.category == Category.PASS, (r.feedback, r.details.get("traceback"))
    assert r.details["footprint"]["input_bytes"] == 16 * 512 * 4
    r = verify(task, python_only(calling("torch.relu(x)", "x")), make_cfg(num_correct_trials=2))
    assert r.category == Category.CHEATING and r.rule == "forbidden_op", r.feedback


@pytest.fixture(scope="module")
def make_cfg(build_cache):
    """Small timing protocol and the session's build cache (the kernel library is compiled once)."""
    cache = build_cache

    def make(**overrides):
        base = dict(build_cache_dir=cache, num_timing_trials=3, num_warmup=1, time_budget_s=2.0, max_jobs=2,
                    run_timeout_s=120.0)
        base.update(overrides)
        return VerifierConfig(**base)
    return make


SLOW_REFERENCE = '''import time
import torch
import torch.nn as nn

class Model(nn.Module):
    """A reference far slower than its data (a GPU-sized conv on a CPU host behaves like this)."""
    def __init__(self):
        super().__init__()

    def forward(self, x):
        time.sleep(0.8)
        return torch.relu(x)

batch_size, dim = 4, 8

def get_inputs():
    return [torch.rand(batch_size, dim)]

def get_init_inputs():
    return []
'''


def test_the_parents_reference_time_is_not_the_candidates(tmp_path, make_cfg):
    """The parent computes every reference itself; on KernelBench shapes that takes minutes on a CPU. That
    time must not count against the candidate (once it did: correct kernels timed out), and a task whose
    checking alone exceeds run_timeout_s is infra with the reason, not a timeout of the code."""
    task = load_task(_write(tmp_path / "level1" / "1_Slow.py", SLOW_REFERENCE))
    cand = python_only(calling("x.clone()", "x"))
    r = verify(task, cand, make_cfg(num_correct_trials=8, run_timeout_s=2.5))
    assert r.category == Category.INFRA, (r.category, r.feedback)
    assert "verifier's own work" in r.feedback and "run_timeout_s=2.5" in r.feedback


def test_conversation_clock_stops_during_parent_work():
    from verifier.evaluate import _Conversation

    class Child:
        def send(self, msg):
            pass

        def recv(self, deadline):
            return {"op": "ok"}

    conv = _Conversation(Child(), None, timeout_s=10.0)
    conv.ask({"op": "a"})
    before = conv.deadline
    time.sleep(0.2)            # the parent checks outputs
    conv.ask({"op": "b"})
    assert conv.deadline - before >= 0.2 and conv.parent_s >= 0.2
    spent = conv.parent_s
    time.sleep(0.3)
    conv.pause(0.3)            # that was waiting for a spare: on neither clock
    conv.ask({"op": "c"})
    assert conv.deadline - before >= 0.5 and conv.parent_s - spent < 0.1
