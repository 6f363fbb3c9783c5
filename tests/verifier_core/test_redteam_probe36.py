"""Probe 36: work done in a process of the candidate's own, and references that ignore their inputs.

Fixed here (each was a false pass before):
- A native candidate forked a helper process (``_Fork``, which no rule named) and handed it the work through SysV
  shared memory (``shmget``/``shmat``, also unnamed). A process of its own is neither the child's CPU time (the
  background-work check sums the threads of the child only) nor inside any timed span, so it computed while the
  candidate was timed, or after (on a host with 16 cores, 15 helpers give a 15x "speedup" over a one-thread
  reference), and the check passed. A cpu run child now refuses new processes to every thread once the task is
  loaded and before the candidate is imported (``syscall_filter.install_no_processes``: fork, vfork, clone3, and
  clone without CLONE_THREAD answer ENOSYS; threads still start and are counted as before), and the native rules
  name ``_Fork``, ``forkpty``, ``wordexp`` and shared memory (``shmget``, ``shmat``, ``shm_open``, ``memfd_create``).
- A reference whose output is the same for every input (KernelBench's level2/83 clamps ``min(x, 0)`` to [0, 1]:
  zeros; level2/23 averages a GroupNorm's output: 0 up to rounding) passed any kernel that writes that constant,
  ignoring its inputs, and the ablation could not tell (the constant came from the native call). When the
  reference's outputs on the correctness trials' different inputs all agree (within a hundredth of the tolerance:
  a loss over many entries moves by less than the tolerance and is still scored), the verdict is now ``infra`` (``reference_insensitive``, the task's fault: not retried by the farm), as for a reference that
  does not repeat.

Tried and already right (not pinned): a thread started through a namespace alias (``namespace s = std;
s::thread{...}``; no rule names it) is counted by the background-CPU check once its work adds up (10 ms per check);
output comparisons patched in the child (the parent compares); precomputing the next calls' outputs from the
pre-made timing inputs (the span floor charges the batch's whole time); ``-Wa,--defsym`` (refused as a flag).
"""
import ctypes
import subprocess
import sys
import textwrap

import pytest

import verifier.evaluate as evaluate_module
from verifier.evaluate import verify
from verifier.farm import TASK_FAULT_RULES
from verifier.native_checks import scan_native
from verifier.static_checks import check_source
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import compiled, task_path


def expect(result, category, rule=None):
    assert result.category == category, (result.category, result.rule, result.feedback,
                                         result.details.get("traceback"))
    if rule is not None:
        assert result.rule == rule, (result.rule, result.feedback)


# ------------------------------------------------------------------------------------- a process of its own
FORK_HELPER_CPP = r'''
#include <sys/ipc.h>
#include <sys/shm.h>
#include <unistd.h>
#include <sched.h>
#include <atomic>
#include <cstring>
#include <new>

struct Box { std::atomic<long> seq; std::atomic<long> done; long n; float in[1 << 16]; float out[1 << 16]; };
static Box* box = nullptr;

static void serve(pid_t parent) {   // the helper: relu of whatever the candidate hands it, forever
  long seen = 0;
  for (;;) {
    long s = box->seq.load();
    if (s != seen) {
      for (long i = 0; i < box->n; ++i) box->out[i] = box->in[i] > 0.f ? box->in[i] : 0.f;
      box->done.store(s);
      seen = s;
    } else if (getppid() != parent) {
      abort();
    } else {
      usleep(20);
    }
  }
}

torch::Tensor relu(torch::Tensor x) {
  if (box == nullptr) {
    int id = shmget(IPC_PRIVATE, sizeof(Box), IPC_CREAT | 0600);
    box = (Box*)shmat(id, nullptr, 0);
    shmctl(id, IPC_RMID, nullptr);
    new (box) Box();
    pid_t me = getpid();
    pid_t pid = _Fork();
    if (pid == 0) serve(me);
    TORCH_CHECK(pid > 0, "no helper process");
  }
  auto out = torch::empty_like(x);
  box->n = x.numel();
  std::memcpy(box->in, x.data_ptr<float>(), sizeof(float) * box->n);
  long s = box->seq.load() + 1;
  box->seq.store(s);
  while (box->done.load() != s) sched_yield();
  std::memcpy(out.data_ptr<float>(), box->out, sizeof(float) * box->n);
  return out;
}
'''

FORK_HELPER = f'''```python
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SRC = r"""{FORK_HELPER_CPP}"""

ext = load_inline(name="p36_fork_helper", cpp_sources=SRC, functions=["relu"], extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
```
'''


@pytest.mark.parametrize("src,rule", [
    ("void f(){ _Fork(); }", "process_or_thread"),
    ("void f(){ int m; forkpty(&m, 0, 0, 0); }", "process_or_thread"),
    ('void f(){ wordexp("$(ls)", 0, 0); }', "process_or_thread"),     # command substitution runs a shell
    ("void f(){ shmat(shmget(0, 4096, 0), 0, 0); }", "dynamic_code"),
    ('void f(){ shm_open("/x", 0, 0); }', "dynamic_code"),
    ('void f(){ memfd_create("x", 0); }', "dynamic_code"),
])
def test_process_creation_and_shared_memory_are_named(src, rule):
    assert rule in {r for r, _ in scan_native([src], [], "cpu")}


def test_names_that_only_contain_them_stay_allowed():
    assert scan_native(["int my_Fork = 1; int shmat_count = 2; float wordexp_x = 0.f;"], [], "cpu") == []


_FILTER_PROBE = r'''
import ctypes, errno, json, os, sys, threading
sys.path.insert(0, sys.argv[1])
from verifier import syscall_filter
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0          # PR_SET_NO_NEW_PRIVS (the sandbox sets it before its filters)
report = syscall_filter.install_no_processes(libc)
out = {"report": report}
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    out["fork"] = "forked"
except OSError as e:
    out["fork"] = errno.errorcode.get(e.errno)
ran = []
t = threading.Thread(target=lambda: ran.append(1))
t.start()
t.join()
out["thread"] = bool(ran)
print(json.dumps(out))
'''


def test_the_no_processes_filter_refuses_fork_and_keeps_threads():
    import json
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _FILTER_PROBE, root], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["report"]["applied"]:
        pytest.skip(f"no process filter here: {out['report']}")
    assert out["fork"] == "ENOSYS" and out["thread"] is True, out


def test_the_static_rules_were_the_only_other_guard():
    """What the end-to-end test below bypasses: the native rules now name the helper's calls."""
    from verifier.extract import extract_candidate
    code = extract_candidate(FORK_HELPER, 200_000)
    assert {v.rule for v in check_source(code, "cpu")} & {"process_or_thread", "dynamic_code"}


@pytest.mark.slow
def test_a_forked_helper_cannot_compute_for_the_candidate(make_cfg, monkeypatch):
    """With the static stage bypassed (as native code could reach the same calls under names no rule knows), the
    helper is never started: before the fix this candidate passed with its relu computed in another process."""
    monkeypatch.setattr(evaluate_module, "check_candidate", lambda code, cfg: [])
    r = verify(load_task(task_path("relu")), FORK_HELPER, make_cfg())
    expect(r, Category.RUNTIME_ERROR)
    assert "no helper process" in r.feedback
    assert r.details["process_filter"]["applied"] is True


CTOR_FORK_CPP = r'''
#include <sys/wait.h>
#include <unistd.h>

static int64_t fork_result = 0;   // 0: the constructor never ran, 1: a process was made, -1: refused

__attribute__((constructor)) static void spawn_at_load() {   // runs at dlopen, before any kernel is called
  pid_t pid = fork();
  if (pid == 0) _exit(0);          // a helper would serve from here on, outliving the build child into the run
  if (pid > 0) waitpid(pid, nullptr, 0);
  fork_result = pid > 0 ? 1 : -1;
}

int64_t forked() { return fork_result; }

torch::Tensor relu(torch::Tensor x) { return x.clamp_min(0); }
'''


@pytest.mark.slow
def test_the_build_child_refuses_a_process_forked_at_load(make_cfg):
    """The build child imports the candidate and loads its extension (a global constructor runs at dlopen): it now
    refuses new processes as the cpu run child does. The compiler runs in the parent's compile child, so nothing
    honest there needs a process; before the fix the constructor's fork succeeded in the build child."""
    import uuid

    from verifier.build import build_candidate
    code = (f"# {uuid.uuid4().hex}: a fresh build record (the extension itself is cached)\n"
            "import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n\n"
            f"SRC = r\"\"\"{CTOR_FORK_CPP}\"\"\"\n"
            "ext = load_inline(name='p36_ctor_fork', cpp_sources=SRC, functions=['relu', 'forked'])\n"
            "if ext.forked() != -1:\n"
            "    raise RuntimeError(f'fork at load gave {ext.forked()} (1: forked, 0: no constructor ran)')\n\n\n"
            "class ModelNew(nn.Module):\n    def forward(self, x):\n        return ext.relu(x)\n")
    res = build_candidate(load_task(task_path("relu")), code, make_cfg())
    assert res.ok and res.extensions, (res.error, res.log_tail[-2000:])
    assert "import_error" not in res.details, res.details["import_error"]


# ---------------------------------------------------------------------------- a reference that ignores its inputs
CLAMPED_TASK = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """min(x, 0) clamped to [0, 1] (KernelBench level2/83's tail): zeros for every input."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = torch.minimum(x, torch.zeros((), dtype=x.dtype))
        return torch.clamp(x, min=0.0, max=1.0)


def get_inputs():
    return [torch.randn(16, 512)]


def get_init_inputs():
    return []
'''
IGNORES_ITS_INPUT = '''
class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(torch.zeros_like(x))   # a native call (the ablation sees it matter), no use of x
'''


@pytest.mark.slow
def test_a_reference_that_ignores_its_inputs_cannot_score_a_kernel(make_cfg, tmp_path):
    task = tmp_path / "clamped.py"
    task.write_text(textwrap.dedent(CLAMPED_TASK))
    r = verify(load_task(str(task)), compiled(IGNORES_ITS_INPUT), make_cfg())
    expect(r, Category.INFRA, "reference_insensitive")
    assert "same output" in r.feedback
    assert "reference_insensitive" in TASK_FAULT_RULES   # the farm does not retry it


def test_a_reference_that_varies_by_less_than_the_tolerance_is_still_scored():
    """A large reduction to one scalar moves by less than the tolerance from trial to trial (an MSE over 2^18
    entries: 2 +- 0.0055, inside float16's 1e-2 and a full-size KernelBench loss inside float32's 1e-4) and is no
    constant: its honest kernels must get a verdict, not infra (the first version of the check said infra)."""
    import torch

    from verifier.evaluate import _probe, reference_ignores_inputs

    def mse(seed):
        g = torch.Generator().manual_seed(seed)
        a, b = torch.randn(64, 4096, generator=g), torch.randn(64, 4096, generator=g)
        return _probe([torch.mean((a - b) ** 2)])

    losses = [mse(seed) for seed in range(5)]
    assert all(abs(p[0] - losses[0][0]) < 2e-2 for p in losses)        # all alike at float16's tolerance
    assert not reference_ignores_inputs(losses, 1e-2, 1e-30)
    zeros = [_probe([torch.zeros(16, 512)]) for _ in range(5)]       # level2/83's clamp: no input matters
    assert reference_ignores_inputs(zeros, 1e-2, 1e-30) and reference_ignores_inputs(zeros, 1e-4, 1e-30)
    big = torch.randn(3000, 1000)                                     # above the probe's size: a sample
    assert _probe([big])[0].numel() <= 1 << 20
    # a layout a stride aliases with: at an even stride of 4 only the constant column was sampled (infra for all)
    layout = [_probe([torch.cat([torch.ones(2 ** 20, 1), torch.randn(2 ** 20, 3, generator=g)], 1)])
              for g in (torch.Generator().manual_seed(seed) for seed in range(2))]
    assert not reference_ignores_inputs(layout, 1e-4, 1e-30)


def test_the_probe_samples_without_copying_the_whole_output():
    """A non-contiguous (here expanded) reference output is sampled where it lies: ``reshape(-1)`` copied all of it
    (an expanded 2 GiB view cost 2 GiB, on the device too). Zero-dim and empty outputs are kept whole."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from verifier.evaluate import REFERENCE_PROBE_ELEMENTS, _probe

    allocated = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    allocated.append((str(func), t.untyped_storage().nbytes()))
            return out

    wide = torch.randn(3).expand(REFERENCE_PROBE_ELEMENTS * 12, 3)    # 144 MiB if copied, 12 bytes as it is
    with Sizes():
        sample = _probe([wide])[0]
    assert sample.numel() == REFERENCE_PROBE_ELEMENTS
    # the largest allocation is the positions' (int64, one column per dimension), a ninth of a copy's 144 MiB
    largest = sorted(allocated, key=lambda a: -a[1])[:3]
    assert largest[0][1] <= REFERENCE_PROBE_ELEMENTS * 8 * wide.dim(), largest
    assert set(sample.tolist()) <= set(wide[0].tolist())
    assert torch.equal(_probe([wide])[0], sample)                      # the same positions every time
    small = _probe([torch.tensor(2.5), torch.empty(0, 4), torch.empty(REFERENCE_PROBE_ELEMENTS * 2, 0), 7])
    assert small[0].tolist() == [2.5] and small[1].numel() == 0 and small[2].numel() == 0 and small[3] == 7


# ---------------------------------------------------------------------------------- honest and still passing
NON_CONTIGUOUS = '''
class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x.t().contiguous()).t()   # right values in a transposed (non-contiguous) layout
'''
ROW_SUMSQ = '''
class ModelNew(nn.Module):
    def forward(self, x):
        return ext.row_sumsq(x)    # one value per row: outputs vary from trial to trial, if only a little
'''


@pytest.mark.slow
@pytest.mark.parametrize("task_name,model", [("relu", NON_CONTIGUOUS), ("row_sumsq", ROW_SUMSQ)])
def test_honest_kernels_still_pass(make_cfg, task_name, model):
    r = verify(load_task(task_path(task_name)), compiled(model), make_cfg())
    expect(r, Category.PASS)
    assert r.details["process_filter"]["applied"] is True
