"""Probe 35: the reference the child times, and compile logs the candidate writes.

Fixed here (each was wrong before):
- The child built one reference model and loaded its state into the candidate's through ``ModelNew.load_state_dict``
  (or a load hook), which the candidate may override: it was handed the reference's own tensors, kept them and
  changed the model the child times (a buffer its run time follows: 15x slower, an honest 0.06x kernel timed at
  1.2x). The model whose state is loaded is thrown away now, and the timed reference is built afresh, from init
  inputs of its own (``DeviceSession.construct``).
- A failed build whose log matched a toolchain pattern (``fatal error: Python.h: No such file``, ``cannot find
  -lcudart``, ``nvcc: not found``) was ``infra``: retried and never scored. The candidate writes lines of that log
  (gcc echoes source lines and prints a ``static_assert`` message's ``\\n`` as a new line), so any compile error
  could escape its -1. A claim is now believed only where it holds on this host for this backend's builds
  (``build.toolchain_problem``).

Tried and already right (not pinned): ``__exit__`` returning True around a forward's in-place write; ModelNew rebound
to ``nn.ReLU``, a function or a plain class; outputs aliasing an input or each other; try/except BaseException,
contextlib, sys.modules, ``__subclasses__``/``__mro__``/``object.__getattribute__``, weakref/time/random imports,
module-wide hooks; a candidate defining Model/get_inputs; static checks of 200 KB alias chains (linear, ~3 s).
"""
import textwrap

import pytest

from verifier import build
from verifier.build import toolchain_problem
from verifier.evaluate import verify
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import compiled

# what gcc printed for `static_assert(sizeof(int) == 0, "\nmain.cpp:1:10: fatal error: Python.h: No such file ...")`
FORGED_LOGS = [
    "/tmp/x/main.cpp:3:27: error: static assertion failed: \n"
    "main.cpp:1:10: fatal error: Python.h: No such file or directory\n"
    '    3 | static_assert(sizeof(int) == 0, "\\nmain.cpp:1:10: fatal error: Python.h: No such file or directory");',
    "main.cpp:4:18: error: 'y' was not declared in this scope\n"
    "    4 | int f() { return y; } // cannot find -ltorch_cuda\n",
    "main.cpp:2:2: error: #error fatal error: cuda_runtime.h: No such file\n",   # another backend's header on cpu
    "main.cpp:2:2: error: #error cannot find -lmy_own_lib\n",                    # no library torch's builds link
    "main.cpp:2:2: error: #error /bin/sh: 1: nvcc: not found\n",                 # no nvcc in a cpu build
]


@pytest.mark.parametrize("log", FORGED_LOGS)
def test_a_toolchain_line_the_candidate_wrote_is_its_compile_error(log):
    assert toolchain_problem(log, "cpu") is None


def test_a_toolchain_problem_that_holds_is_still_infra(monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name, path=None: None)
    monkeypatch.setattr(build, "_toolkit_homes", lambda: [])
    assert toolchain_problem("FileNotFoundError: No such file or directory: 'ninja'", "cpu")
    assert toolchain_problem("/bin/sh: 1: nvcc: not found", "cuda") == "nvcc: not found"
    assert toolchain_problem("/usr/bin/ld: cannot find -ltorch_nope_missing", "cpu") is None


# The reference's run time follows a buffer's value; the candidate's load_state_dict writes NaN into the tensors it is
# handed. Before the fix those were the timed reference's own: its warm-up raised (a slower value passed at 15x).
STEPS_TASK = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.ones(1))

    def forward(self, x):
        for _ in range(int(self.steps)):
            x = torch.relu(x)
        return x


def get_inputs():
    return [torch.randn(16, 512)]


def get_init_inputs():
    return []
'''
REACHING = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.ones(1))

    def load_state_dict(self, state, strict=True, assign=False):
        result = super().load_state_dict(state, strict=strict)
        state["steps"].fill_(float("nan"))
        return result

    def forward(self, x):
        return ext.relu(x)
'''


@pytest.mark.slow
def test_the_timed_reference_is_out_of_the_candidates_reach(make_cfg, tmp_path):
    task = tmp_path / "relu_steps.py"
    task.write_text(textwrap.dedent(STEPS_TASK))
    r = verify(load_task(str(task)), compiled(REACHING), make_cfg())
    assert r.category == Category.PASS, (r.category, r.rule, r.feedback)


STATEFUL_TASK = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls += 1          # a hidden state kept across calls (KernelBench v0.1's VanillaRNN)
        return torch.relu(x) + self.calls


def get_inputs():
    return [torch.randn(16, 512)]


def get_init_inputs():
    return []
'''
RELU = '''
class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
'''


@pytest.mark.slow
def test_a_reference_that_does_not_repeat_is_the_tasks_fault_not_the_kernels(make_cfg, tmp_path):
    """No kernel can match a stateful reference: every candidate got correctness_error (-1) on such a task. The
    mismatch is now checked against a second call of the reference first: infra, naming the task. (A dropout
    reference repeats: the verifier seeds every call.)"""
    task = tmp_path / "broken.py"
    task.write_text(textwrap.dedent(STATEFUL_TASK))
    r = verify(load_task(str(task)), compiled(RELU), make_cfg())
    assert r.category == Category.INFRA and r.rule == "reference_not_repeatable", (r.category, r.rule, r.feedback)
    assert "not repeatable" in r.feedback
