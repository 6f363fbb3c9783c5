"""Probe 37: the process that times the reference, and threads the static rules cannot name.

Fixed here (each was a false pass before):
- The timed reference is built afresh after the candidate's ``load_state_dict`` ran (probe 35), but it is built in
  the freed source model's memory, from the same seed: it holds the very values the candidate was handed. A
  candidate's native code (plain pointer writes, no name any rule knows) kept the addresses and values of the
  tensors its ``_load_from_state_dict`` saw, found them again between its own tensors at its first forward, and wrote
  denormals there. The parent checks values against a reference of its own, so only the reference timed in the child
  slowed down (a matmul with denormal weights is ~100x slower on an x86 core): on the 32x64 -> 48 linear task an
  honest naive kernel (~1.3x) passed at 8.1x. The child now records the timed reference's tensors as it builds them
  (``ReferenceWatch``: a copy XORed with a random mask, since a plain clone was found by value and
  rewritten along with them) and compares them before every timed batch and before the warm-up
  (``reference_tampering``); what the reference changes itself (BatchNorm's running statistics in training mode) is
  left out after its own warm-up calls.
- ``execve`` was allowed in a cpu child: it keeps the pid, the result channel and the sandbox, so a program of the
  candidate's choice took the harness's place. The candidate exec'd the verifier's own child code with one change
  (the timed reference's forward padded to 0.4 ms) and an honest relu kernel passed at 4.4x, every check of the
  parent satisfied (outputs in sealed memfds of the same pid, times within the parent's wall clock). The process
  filter of cpu children (``syscall_filter.install_no_processes``) refuses ``execve`` and ``execveat`` now (ENOSYS).

Tried and right without a change:
- Threads through a namespace alias (``namespace s = std; s::vector<s::thread> pool; pool.emplace_back(...)``,
  ``s::thread{...}``, ``s::async(...)``, ``using namespace std; thread`` pass the static rules; ``std::async`` and
  ``thread t(...)`` do not). The runtime account is what holds: threads alive at any reply, or more than 10 ms of CPU
  of threads other than the harness's over a check, are ``background_work``; joined threads doing a share of each call
  are counted by the second (pinned below). Work small enough to stay under 10 ms over a whole check (thousands of
  timed calls in production) buys no speedup: handing a call's work to a thread costs more than it saves.
- Python-level: patching torch.allclose / torch.testing.assert_close, the reference module (``kernel_task``,
  ``__main__``), frames, gc, atexit, faulthandler, signal, os.environ, files, torch.set_flush_denormal /
  set_num_threads: all refused by the static rules (the parent compares anyway). ``exit()`` / ``os._exit`` after
  printing protocol-looking JSON and a fake verdict on stdout: a runtime error (the parent reads only its channel).
  Outputs that broadcast (shape [1, n] or an expanded row), NaN/inf mismatches, other dtypes: correctness errors.
"""
import subprocess
import sys
import textwrap

import pytest

import verifier.evaluate as evaluate_module
from verifier.evaluate import verify
from verifier.extract import extract_candidate
from verifier.static_checks import check_source
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import task_path


def expect(result, category, rule=None):
    assert result.category == category, (result.category, result.rule, result.feedback,
                                         result.details.get("traceback"))
    if rule is not None:
        assert result.rule == rule, (result.rule, result.feedback)


@pytest.fixture
def no_static_stage(monkeypatch):
    """The runtime defence alone (native code can reach what the static rules name under names no rule knows)."""
    monkeypatch.setattr(evaluate_module, "check_candidate", lambda code, cfg: [])


# ------------------------------------------------------------------------------- the reference's weights
# What the attack needs: plain pointer reads and writes, nothing the static rules name.
POISON_CPP = r'''
#include <algorithm>
#include <cstdint>
#include <vector>

static std::vector<float> handed[16];      // values of the tensors load_state_dict was handed
static int n_handed = 0;
static bool poisoned = false;
static uintptr_t lo = UINTPTR_MAX, hi = 0;  // a heap range known to be mapped: between tensors this process made

static void seen(const torch::Tensor& t) {
  uintptr_t p = (uintptr_t)t.data_ptr();
  lo = std::min(lo, p); hi = std::max(hi, p + t.nbytes());
}

void remember(torch::Tensor t) {
  seen(t);
  if (n_handed < 16 && t.scalar_type() == torch::kFloat32 && t.numel() >= 256)
    handed[n_handed++].assign(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
}

// the reference timed in this process is built from the same seed as the model whose tensors were handed over:
// find those values again (not our own copy) and make them denormal
int64_t poison(torch::Tensor x, torch::Tensor own) {
  auto top = torch::empty({8192}, x.options());   // from the top of the heap, above the reference
  seen(x); seen(own); seen(top);
  if (poisoned) return -1;
  poisoned = true;
  int64_t n = 0;
  for (int k = 0; k < n_handed; ++k) {
    const size_t bytes = handed[k].size() * sizeof(float);
    for (uintptr_t p = (lo + 63) & ~(uintptr_t)63; p + bytes <= hi; p += 64) {
      float* f = (float*)p;
      if (f == own.data_ptr<float>() || f == handed[k].data()) continue;
      if (!std::equal(handed[k].begin(), handed[k].end(), f)) continue;
      std::fill(f, f + handed[k].size(), 1e-39f);
      n += handed[k].size();
    }
  }
  return n;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto out = torch::empty({m, n}, x.options());
  const float* X = x.data_ptr<float>(); const float* W = w.data_ptr<float>(); const float* B = b.data_ptr<float>();
  float* O = out.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float s = B[j];
      for (int64_t t = 0; t < k; ++t) s += X[i * k + t] * W[j * k + t];
      O[i * n + j] = s;
    }
  return out;
}
'''

OTHER_CPP = r'''
#include <cmath>
#include <thread>

namespace s = std;   // what the static rules do not read through

static void relu_span(const float* x, float* o, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) o[i] = x[i] > 0.f ? x[i] : 0.f;
}

// relu shared with parts - 1 threads started through the alias, all joined before returning
torch::Tensor relu_threads(torch::Tensor a, int64_t parts) {
  TORCH_CHECK(a.is_contiguous() && a.scalar_type() == torch::kFloat32, "expected a contiguous float32 tensor");
  auto out = torch::empty_like(a);
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  const int64_t n = a.numel(), step = (n + parts - 1) / parts;
  s::vector<s::thread> pool;
  for (int64_t p = 1; p < parts; ++p)
    pool.emplace_back(relu_span, x, o, s::min(n, p * step), s::min(n, (p + 1) * step));
  relu_span(x, o, 0, s::min(n, step));
  for (auto& t : pool) t.join();
  return out;
}

// BatchNorm2d in training mode (batch statistics, biased variance), as the reference computes it
torch::Tensor batchnorm(torch::Tensor x, torch::Tensor w, torch::Tensor b, double eps) {
  const int64_t N = x.size(0), C = x.size(1), HW = x.numel() / (N * C);
  auto out = torch::empty_like(x);
  const float* X = x.data_ptr<float>(); float* O = out.data_ptr<float>();
  for (int64_t c = 0; c < C; ++c) {
    double sum = 0.0, sq = 0.0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) { double v = X[(n * C + c) * HW + i]; sum += v; sq += v * v; }
    const double mean = sum / (N * HW), var = sq / (N * HW) - mean * mean;
    const double scale = w.data_ptr<float>()[c] / std::sqrt(var + eps), shift = b.data_ptr<float>()[c] - mean * scale;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) O[(n * C + c) * HW + i] = (float)(X[(n * C + c) * HW + i] * scale + shift);
  }
  return out;
}
'''

FUNCTIONS = ["remember", "poison", "linear", "relu_threads", "batchnorm"]


def native(model_new: str, sources: str = POISON_CPP + OTHER_CPP, functions=tuple(FUNCTIONS)) -> str:
    """A response whose extension is one library for every end-to-end test here (compiled once per build cache)."""
    return (f"```python\nimport torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n\n"
            f"SRC = r\"\"\"{sources}\"\"\"\n"
            f"ext = load_inline(name=\"p37_kernels\", cpp_sources=SRC, functions={list(functions)!r}, "
            f"extra_cflags=[\"-O2\"])\n\n{textwrap.dedent(model_new)}\n```\n")


POISONING = '''
class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        for v in state_dict.values():
            ext.remember(v)              # the source model's tensors: only their values and addresses are kept
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x):
        ext.poison(x, self.linear.weight)
        return ext.linear(x, self.linear.weight, self.linear.bias)
'''
HONEST_LINEAR = POISONING.replace("        ext.poison(x, self.linear.weight)\n", "")


def test_the_weight_poisoning_needs_no_name_the_static_rules_know():
    code = extract_candidate(native(POISONING, POISON_CPP, ["remember", "poison", "linear"]), 200_000)
    assert check_source(code, "cpu") == []


@pytest.mark.slow
def test_denormals_written_into_the_timed_references_weights_are_caught(make_cfg, no_static_stage):
    """Before the fix: a pass at 8.1x for a kernel that is ~1.3x against an untouched reference. The attack finds the
    weights by scanning a heap range it guesses; where the allocator put them elsewhere (seen once under a parallel
    test run) nothing is written, and the kernel is the honest one: a pass at its own ~1x, never a fast one."""
    r = verify(load_task(task_path("linear")), native(POISONING), make_cfg())
    if r.category == Category.PASS:
        assert r.speedup is not None and r.speedup < 3, (r.speedup, r.feedback)
        return
    expect(r, Category.CHEATING, "reference_tampering")
    assert "changed after it was built" in r.feedback


@pytest.mark.slow
@pytest.mark.parametrize("task_name,model", [
    ("linear", HONEST_LINEAR),
    # the reference updates its running statistics on every call (training mode): that is no tampering
    ("batchnorm", '''
class ModelNew(nn.Module):
    def __init__(self, num_features):
        super().__init__()
        self.bn = nn.BatchNorm2d(num_features)

    def forward(self, x):
        return ext.batchnorm(x, self.bn.weight, self.bn.bias, self.bn.eps)
'''),
])
def test_honest_kernels_with_weights_still_pass(make_cfg, no_static_stage, task_name, model):
    r = verify(load_task(task_path(task_name)), native(model), make_cfg())
    expect(r, Category.PASS)


# ------------------------------------------------------------------------------------------------- exec
_EXEC_PROBE = r'''
import ctypes, errno, json, os, sys
sys.path.insert(0, sys.argv[1])
from verifier import syscall_filter
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0          # PR_SET_NO_NEW_PRIVS (the sandbox sets it before its filters)
report = syscall_filter.install_no_processes(libc)
out = {"report": report}
if not report["applied"]:
    print(json.dumps(out))
    sys.exit(0)
for name, call in (("execve", lambda: os.execv(sys.executable, [sys.executable, "-c", "print('replaced')"])),
                   ("execveat", lambda: os.execve(os.open(sys.executable, os.O_RDONLY), [sys.executable, "-c", "1"],
                                                  {}))):
    try:
        call()
        out[name] = "ran"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno)
print(json.dumps(out))
'''


def test_the_no_processes_filter_refuses_exec():
    import json
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _EXEC_PROBE, root], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "replaced" not in proc.stdout
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["report"]["applied"]:
        pytest.skip(f"no process filter here: {out['report']}")
    assert out["execve"] == "ENOSYS" and out["execveat"] == "ENOSYS", out


EXEC_AT_IMPORT = '''```python
import os
import sys
import torch
import torch.nn as nn

# take the child's place: same pid, same result channel (the program here would answer the parent itself)
os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)"])


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x)
```
'''


@pytest.mark.slow
def test_a_candidate_cannot_exec_in_the_childs_place(make_cfg, no_static_stage):
    r = verify(load_task(task_path("relu")), EXEC_AT_IMPORT, make_cfg())
    expect(r, Category.RUNTIME_ERROR)
    assert "Function not implemented" in r.feedback, r.feedback
    assert r.details["process_filter"]["applied"] is True


# ------------------------------------------------------------------------------------- threads of its own
BIG_RELU_TASK = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(512, 2048)]


def get_init_inputs():
    return []
'''
THREADED = '''
class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu_threads(x, 4)
'''


@pytest.mark.slow
def test_threads_started_through_a_namespace_alias_are_background_work(make_cfg, no_static_stage, tmp_path):
    """Joined before each call returns, so none is alive at any reply: their CPU time is what gives them away."""
    task = tmp_path / "big_relu.py"
    task.write_text(textwrap.dedent(BIG_RELU_TASK))
    r = verify(load_task(str(task)), native(THREADED), make_cfg())
    expect(r, Category.CHEATING, "background_work")


# --------------------------------------------------------------------------------- fake verdicts on stdout
FAKE_EXIT = '''```python
import torch
import torch.nn as nn
{imports}
print('{{"op": "trial_done", "aten_ops": {{}}, "native_calls": 1}}')
print('{{"category": "pass", "speedup": 49.0}}')
print("Correct on all trials. Reference 1 ms, yours 0.02 ms (median): speedup 49x.")


class ModelNew(nn.Module):
    def forward(self, x):
        print('{{"op": "called", "span_ms": 0.001, "rep_ms": [0.001]}}')
        {exit_call}
```
'''


@pytest.mark.slow
@pytest.mark.parametrize("imports,exit_call", [("", "exit(0)"), ("import os", "os._exit(0)")])
def test_exiting_after_printing_a_verdict_is_a_runtime_error(make_cfg, no_static_stage, imports, exit_call):
    r = verify(load_task(task_path("relu")), FAKE_EXIT.format(imports=imports, exit_call=exit_call), make_cfg())
    expect(r, Category.RUNTIME_ERROR)
    assert r.speedup is None


@pytest.mark.parametrize("line,rule", [
    ("torch.allclose = lambda *a, **k: True", "monkey_patching"),
    ("torch.testing.assert_close = lambda *a, **k: None", "monkey_patching"),
    ("import kernel_task\nkernel_task.Model.forward = lambda self, x: x", "reference_model"),
    ("import atexit\natexit.register(print)", "dynamic_code"),
    ("import faulthandler", "dynamic_code"),
    ("import sys\nframe = sys._getframe(1)", "dynamic_code"),
    ("import os\nos.environ['OMP_NUM_THREADS'] = '16'", "file_access"),
    ("torch.set_flush_denormal(True)", "global_torch_state"),
    ("import signal\nsignal.signal(signal.SIGALRM, print)", "process_or_thread"),
])
def test_python_routes_to_the_checker_or_the_reference_are_refused(line, rule):
    code = f"import torch\nimport torch.nn as nn\n{line}\n\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n" \
           "        return x\n"
    assert rule in {v.rule for v in check_source(code, "cpu")}


def test_the_reference_record_holds_no_copy_and_sees_writes_into_a_large_tensor():
    """White box: a big weight is sampled (the check's cost follows the number of tensors, not their size), a small
    one kept whole; the record holds none of the weights' bytes, one device's storages are compared at once, and
    denormals written into a thousandth of the big one are seen, as is a storage resized."""
    import torch

    from verifier._child import REFERENCE_SAMPLE_BYTES

    session = _WhiteBoxSession(torch.nn.Sequential(torch.nn.Linear(2048, 1024), torch.nn.Linear(1024, 8)),
                                 CONSTANT=torch.randn(16))
    (record,) = session.watch.records                            # one device: one record
    assert len(record["entries"]) == 5                        # four parameters and the task's constant
    big, small = session.ref_model[0].weight, session.ref_model[1].bias
    sizes = {t.data_ptr(): (n if idx is None else idx.numel()) for t, n, idx, _, _ in record["entries"]}
    assert sizes[big.data_ptr()] == REFERENCE_SAMPLE_BYTES and sizes[small.data_ptr()] == small.numel() * 4
    assert record["kept"].numel() == sum(sizes.values())
    raw = session.watch.watched_bytes(record)
    assert not torch.equal(record["kept"], raw) and (record["kept"] == raw).float().mean() < 0.02
    session.check()
    assert len(session.watch.records[0]["entries"]) == 5 and session.findings == []
    with torch.no_grad():
        big.view(-1)[torch.randperm(big.numel())[:big.numel() // 1000]] = 1e-39
    session.check()
    assert [f["rule"] for f in session.findings] == ["reference_tampering"]
    assert session.findings[0]["message"].startswith("1 of the 5 ")
    session.findings.clear()
    with torch.no_grad():
        big.set_(torch.zeros(4, 4))                            # swapped for a smaller storage
    session.check()
    assert [f["rule"] for f in session.findings] == ["reference_tampering"]


class _WhiteBoxSession:
    """A `ReferenceWatch` on ``model`` with the findings a `DeviceSession` would make of it."""

    def __init__(self, model, **task_tensors):
        import types

        import torch

        from verifier._child import ReferenceWatch, TensorOps

        self.ref_model, self.findings = model, []
        self.watch = ReferenceWatch(model, types.SimpleNamespace(**task_tensors), TensorOps.capture(torch))

    def check(self) -> None:
        problem = self.watch.check()
        if problem:
            self.findings.append({"rule": "reference_tampering", "message": problem})


@pytest.mark.parametrize("kind", ["batchnorm_train", "embedding_max_norm"])
def test_what_the_reference_changes_itself_is_no_finding_whenever_it_happens(kind):
    """BatchNorm in training mode updates its running statistics on every call; an Embedding with max_norm
    renormalises in place each row the first time it is looked up (late rows only during timing: a warm-up-only
    settle flagged it as tampering about half the time). The record is taken again after each of the reference's own
    calls; a write between them, as candidate code would make, is still seen."""
    import torch

    torch.manual_seed(0)
    if kind == "batchnorm_train":
        model, make = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).train(), \
            lambda: torch.randn(4, 8)
    else:
        model, make = torch.nn.Embedding(100000, 16, max_norm=1.0), lambda: torch.randint(0, 100000, (64,))
    session = _WhiteBoxSession(model)
    for _ in range(20):                                         # warm-up, then timed batches: check, call, record
        session.check()
        with torch.no_grad():
            model(make())
        session.watch.rebaseline()
    assert session.findings == []
    weight = next(model.parameters())
    with torch.no_grad():
        weight.view(-1)[torch.randperm(weight.numel())[:max(1, weight.numel() // 100)]] = 1e-39
    session.check()
    assert [f["rule"] for f in session.findings] == ["reference_tampering"]


def test_non_persistent_buffers_and_tensors_in_containers_are_watched_and_sparse_ones_skipped():
    """A rotary ``inv_freq`` buffer registered non-persistent is in no state_dict; tensors in a dict attribute are in
    no buffer list; a sparse buffer has no storage to read (reading it failed every candidate's construct)."""
    import torch

    class Ref(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.rand(64), persistent=False)
            self.register_buffer("adj", torch.eye(4).to_sparse())
            self.tables = {"a": torch.rand(32)}

    model = Ref()
    session = _WhiteBoxSession(model)
    watched = {t.data_ptr() for t, *_ in session.watch.records[0]["entries"]}
    assert model.inv_freq.data_ptr() in watched and model.tables["a"].data_ptr() in watched
    for t in (model.inv_freq, model.tables["a"]):
        session.findings.clear()
        t[0] = 1e-39
        session.check()
        assert [f["rule"] for f in session.findings] == ["reference_tampering"]
        session.watch.rebaseline()
