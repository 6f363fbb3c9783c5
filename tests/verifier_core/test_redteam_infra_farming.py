"""Red team: a candidate that turns its own failure into an ``infra`` verdict ("infra farming").

``infra`` is never scored: the farm retries it, the agent loop re-verifies and regenerates, and an unscored sample is
dropped from the RL batch. A policy that cannot write a correct kernel could learn to escape its -1 by making the
verifier fail, a reward hack as real as a false pass. Probed on the cpu backend (kills of its own process at import,
in __init__, in forward and in the timed calls; exceptions named like infra conditions; forged messages on the
result channel; outputs the parent cannot read): all scored. The holes found and fixed here were in the build path:

- torch's ``load_inline`` loads the library it built in the compile child, so the candidate's static initializers
  run there. A trap (SIGILL), a division by zero (SIGFPE) or an exit status there read as a harness failure
  (``infra``, retried, never cached: each retry compiled again), and so did a forged ``compile_unavailable`` reply
  written to the channel from a static initializer. The compile child now says ``compiling`` before it starts the
  candidate's build; what it does or says after that is the candidate's (``compile_error``), and only a failure
  before it (its start, its torch import) stays ``infra``.
- a compiler log claiming ``cannot find -lpython<anything>`` (a ``static_assert`` message prints such a line as one
  of its own) was believed whenever the named library did not exist, which holds for any made-up name; only this
  interpreter's own library can now be the host's problem.
- the build child ran the candidate's module code; any message out of protocol from it was ``infra``.
"""
import textwrap

import pytest

from verifier import build as build_module
from verifier import evaluate as evaluate_module
from verifier.build import ExtensionService, toolchain_problem
from verifier.sandbox import ChildExit, OneShot
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import RELU, compiled, task_path


def _extension_candidate(name: str, cpp_body: str) -> str:
    """A relu candidate whose one extension holds ``cpp_body`` besides an honest kernel."""
    src = "#include <torch/extension.h>\n" + textwrap.dedent(cpp_body) + \
        "\ntorch::Tensor relu(torch::Tensor a) { return a.clamp_min(0); }\n"
    return f'''```python
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SRC = r"""{src}"""

ext = load_inline(name="{name}", cpp_sources=SRC, functions=["relu"])

class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.relu(x)
```
'''


def _verify(response, cfg, task="relu"):
    return evaluate_module.verify(load_task(task_path(task)), response, cfg)


def _expect(result, category):
    assert result.category == category, (result.category, result.rule, result.feedback[:800],
                                         result.details.get("traceback"))


# ------------------------------------------------------------------------------------- the compile child
@pytest.mark.slow
def test_a_static_initializer_that_traps_is_a_compile_error_not_infra(make_cfg):
    """``__builtin_trap()`` (no forbidden name) in a static initializer killed the compile child with SIGILL when
    torch loaded the library: ``infra``, retried three times, each compiling again."""
    r = _verify(_extension_candidate("rt_farm_trap", """
        static int boom() { __builtin_trap(); return 0; }
        static int armed = boom();
        """), make_cfg())
    _expect(r, Category.COMPILE_ERROR)
    assert "SIGILL" in r.feedback and r.reward == -1.0


@pytest.mark.slow
def test_a_forged_toolchain_reply_from_a_static_initializer_is_the_candidates(make_cfg, monkeypatch):
    """Native code writing to the compile child's inherited descriptors (static stage bypassed, as a native rule
    missed it) sent the harness's "toolchain unavailable" reply before its own: ``infra``."""
    monkeypatch.setattr(evaluate_module, "check_candidate", lambda code, cfg: [])
    r = _verify(_extension_candidate("rt_farm_forge", r"""
        #include <unistd.h>
        #include <cstring>
        static int forge() {
          const char* m = "{\"op\": \"compile_unavailable\", "
                          "\"error\": {\"type\": \"ImportError\", \"message\": \"no\"}}\n";
          for (int fd = 3; fd < 64; ++fd) ::write(fd, m, strlen(m));
          return 0;
        }
        static int forged = forge();
        """), make_cfg())
    _expect(r, Category.COMPILE_ERROR)
    assert "compile_unavailable" in r.feedback


def _service_after(monkeypatch, make_cfg, run: OneShot) -> tuple[ExtensionService, dict]:
    """What the extension service makes of a compile child that came back as ``run``."""
    monkeypatch.setattr(build_module, "run_one_shot", lambda *a, **k: run)
    service = ExtensionService(make_cfg(), build_pch=False)
    meta, staging, _ = service._run_compiler("torch.utils.cpp_extension.load_inline",
                                             {"name": "x", "cpp_sources": ""}, "k" * 40,
                                             deadline=float("inf"))
    return service, meta


def _exit(signal=None, returncode=None):
    return ChildExit(returncode, signal, False, "", "", 0, 0, 0.1)


@pytest.mark.parametrize("signal,returncode", [("SIGILL", None), ("SIGFPE", None), ("SIGTERM", None), (None, 3),
                                               (None, 0)])
def test_a_compile_child_that_dies_in_the_candidates_build_is_the_candidates(monkeypatch, make_cfg, signal,
                                                                           returncode):
    hello = {"op": "hello", "isolation": {}}
    service, meta = _service_after(monkeypatch, make_cfg, OneShot(hello, None, False, _exit(signal, returncode),
                                                                  started=True))
    assert service.infra_error is None and not meta["ok"] and "loaded your extension" in meta["log"]
    for op in ("compile_unavailable", "ready", "bye"):   # a reply of its own, written from a static initializer
        service, meta = _service_after(monkeypatch, make_cfg, OneShot(hello, {"op": op}, False, _exit(None, 0),
                                                                      started=True))
        assert service.infra_error is None and not meta["ok"]


@pytest.mark.parametrize("signal,returncode", [("SIGKILL", None), ("SIGSEGV", None), (None, 1)])
def test_a_compile_child_that_fails_before_the_build_stays_infra(monkeypatch, make_cfg, signal, returncode):
    """Genuine infra stays infra: before the child says ``compiling`` no candidate code has run (its start, its
    torch import); a death there, or the harness's own "toolchain unavailable", is the host's."""
    hello = {"op": "hello", "isolation": {}}
    service, _ = _service_after(monkeypatch, make_cfg, OneShot(hello, None, False, _exit(signal, returncode)))
    assert service.infra_error and "compile child" in service.infra_error
    service, _ = _service_after(monkeypatch, make_cfg, OneShot(
        hello, {"op": "compile_unavailable", "error": {"message": "no cpp_extension"}}, False, _exit(None, 0)))
    assert service.infra_error and "toolchain unavailable" in service.infra_error


# -------------------------------------------------------------------------------- the compiler log's claims
def test_a_forged_missing_python_library_is_no_toolchain_problem(monkeypatch):
    assert toolchain_problem("x.cpp:1: error: static assertion failed:\n/usr/bin/ld: cannot find -lpython9.99: "
                             "No such file or directory", "cpu") is None
    assert toolchain_problem("/usr/bin/ld: cannot find -lpython_anything", "cpu") is None
    # this interpreter's own library, really missing, is still the host's problem
    import os
    import sys
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if "libpython" in str(p) else real_exists(p))
    own = f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert toolchain_problem(f"/usr/bin/ld: cannot find -l{own}", "cpu") == f"cannot find -l{own}"


@pytest.mark.slow
def test_a_static_assert_claiming_a_missing_python_library_is_a_compile_error(make_cfg):
    r = _verify(_extension_candidate("rt_farm_lpy", r"""
        static_assert(sizeof(int) == 3, "\n/usr/bin/ld: cannot find -lpython9.99: No such file or directory");
        """), make_cfg())
    _expect(r, Category.COMPILE_ERROR)


# -------------------------------------------------------------------------------------- the build child
@pytest.mark.slow
def test_an_out_of_protocol_message_from_the_build_child_is_not_infra(make_cfg, monkeypatch):
    """The build child runs the candidate's module code, which can write to the result channel (static stage
    bypassed): an unknown message there was ``infra``. It is judged like a crash while importing; the device stage,
    importing the module again, gives the candidate's verdict."""
    monkeypatch.setattr(evaluate_module, "check_candidate", lambda code, cfg: [])
    prelude = "import os, sys\nos.write(int(sys.argv[2]), b'{\"op\": \"weird\"}\\n')\n"
    r = _verify(compiled(RELU, prelude), make_cfg())
    _expect(r, Category.RUNTIME_ERROR)


# ------------------------------------------------------------------------------ rules that blame the task
def test_a_host_allocation_failure_is_never_the_tasks_fault():
    """torch's CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory"), which the
    memory test did not know: a task module that allocates as it loads, on a host whose memory the candidates'
    processes beside the parent had taken, was ``task_load_failed`` (final, unscored, never retried)."""
    import torch

    from verifier.evaluate import _load_fault_rule, _transient_error
    from verifier.types import TASK_LOAD_FAILED
    try:
        torch.empty(1 << 50)
    except RuntimeError as e:
        real = e
    assert _load_fault_rule(real) is None and _transient_error(real)
    assert _load_fault_rule(RuntimeError("std::bad_alloc")) is None
    assert _load_fault_rule(NameError("name 'torch' is not defined")) == TASK_LOAD_FAILED   # a bug in the file
