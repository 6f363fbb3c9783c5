"""Probe 34: global state the reference is timed under, and honest responses the extraction refused.

Fixed here (each was wrong before):
- A candidate's C++ could register its own kernel over an aten op's (``static torch::Library lib(torch::Library::IMPL,
  "aten", c10::DispatchKey::CPU, ...); lib.impl("relu", slow)``): the reference, timed in the child, ran the slow
  kernel and an honest relu kernel passed at 45x. The native rules now refuse ``Library``, ``_TORCH_LIBRARY*``,
  ``TorchLibraryInit`` and ``RegisterOperators``; behind them the child compares the dispatcher's registrations
  with a snapshot from before the candidate (every op after import and before timing, the reference's ops before
  every timed batch), which catches a ``decltype(m)`` spelling that names no Library (``StateGuard.kernels``).
- ``auto& c = at::globalContext(); c.setSDPUseFlash(false)`` passed the native rule (it matched
  ``globalContext().set*`` only), and the SDPA backend flags were not among the guarded state: the reference's CPU
  SDPA ran 2.7x slower. The global context may now be used only as ``globalContext().getter()``, and StateGuard
  reads and restores the SDPA, reduced-precision, preferred-library, NNPACK/oneDNN flags and the thread-local
  dispatch keys.
- A compile error's feedback was the last 1200 characters of a log that starts at the first error: an ambiguous
  call's notes and include chains pushed the error itself out, so the model read only ``In file included from``.
  It keeps the beginning and the end now.
- Honest responses refused as format errors: ```` ```python:model_new.py ```` and ```` ```{python} ```` info
  strings, a fence indented in a list item (its content indented too), a reasoning section whose unclosed fence
  swallowed the answer's opening fence, and plain source whose docstring holds a fenced example.

Tried and already right (not all pinned): C++ thread spellings through namespace aliases are refused or caught at
run time; flatten_outputs never calls a returned object's methods; NFKC-normalised identifiers
(``class ＭodelNew``) are judged as the AST spells them.
"""
import textwrap

import pytest
import torch

from verifier import feedback
from verifier._child import StateGuard, dispatch_tables
from verifier.evaluate import verify
from verifier.extract import extract_candidate
from verifier.native_checks import scan_native
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import task_path

GOOD = "import torch.nn as nn\n\nclass ModelNew(nn.Module):\n    pass\n"


# ------------------------------------------------------------------------------------------- native rules
@pytest.mark.parametrize("src,rule", [
    ('static torch::Library lib(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);',
     "monkey_patching"),
    ('_TORCH_LIBRARY_IMPL(aten, CPU, m, C10_UID) { m.impl("relu", slow); }', "monkey_patching"),
    ('static auto r = torch::RegisterOperators().op("aten::relu(Tensor self) -> Tensor", &slow);', "monkey_patching"),
    ('static const torch::detail::TorchLibraryInit i(k, &f, "aten", std::nullopt, __FILE__, __LINE__);',
     "monkey_patching"),
    ("void f(){ auto& ctx = at::globalContext(); ctx.setSDPUseFlash(false); }", "global_torch_state"),
    ("void f(){ at::Context* c = &at::globalContext(); c->setUserEnabledMkldnn(false); }", "global_torch_state"),
    ("void f(){ at::globalContext() . setSDPUseMath(false); }", "global_torch_state"),
])
def test_native_registrations_and_the_global_context_are_refused(src, rule):
    assert rule in {r for r, _ in scan_native([src], [], "cpu")}


@pytest.mark.parametrize("src", [
    "void f(){ bool d = at::globalContext().deterministicAlgorithms(); }",
    'TORCH_LIBRARY(myops, m) { m.def("fused(Tensor x) -> Tensor", &fused); }',
])
def test_getters_and_an_own_library_stay_allowed(src):
    assert scan_native([src], [], "cpu") == []


# ------------------------------------------------------------------------------------------ state guard
def test_the_state_guard_restores_sdpa_flags_and_sees_replaced_kernels():
    guard = StateGuard(torch, dispatch_tables(torch))
    assert guard.check_and_restore(full=True) == []
    torch._C._set_sdp_use_flash(False)
    torch._C._set_cublas_allow_bf16_reduced_precision_reduction(False, False)
    assert {"flash_sdp", "cublas_bf16_reduction"} <= set(guard.check_and_restore())
    assert torch._C._get_flash_sdp_enabled() and torch._C._get_cublas_allow_bf16_reduced_precision_reduction()[0]

    lib = torch.library.Library("aten", "IMPL")   # what the candidate's C++ did, from Python
    try:
        with pytest.warns(UserWarning):
            lib.impl("relu", lambda x: x, "CPU")
        assert any("aten::relu" in d for d in guard.check_and_restore(full=True))
        assert guard.check_and_restore() == []      # not watched: checked only where full
        guard.watch(["aten::relu", "aten::empty"])
        assert any("aten::relu" in d for d in guard.check_and_restore())
    finally:
        lib._destroy()
    assert guard.check_and_restore(full=True) == []


# ------------------------------------------------------------------------------------------ feedback
def test_compile_error_feedback_keeps_the_first_error():
    log = ("main.cpp:28:14: error: call of overloaded 'relu(at::Tensor&)' is ambiguous\n"
           + "In file included from /torch/include/ATen/Functions.h:1135,\n" * 60
           + "Error building extension 'x'")
    text = feedback.compile_error(log)
    assert "error: call of overloaded" in text and text.endswith("Functions.h:1135,")   # the log's end too
    assert "Error building extension" not in text                                   # torch's, not the compiler's
    assert len(text) < 1300


# ------------------------------------------------------------------------------------------ extraction
def _indented(src: str, n: int) -> str:
    return "".join(" " * n + line if line.strip() else line for line in src.splitlines(True))


@pytest.mark.parametrize("response", [
    "```python:model_new.py\n" + GOOD + "```\n",
    "```cpp\nint x;\n```\n```{python}\n" + GOOD + "```\n",
    "1. The kernel:\n   ```python\n" + _indented(GOOD, 3) + "   ```\n2. Done.\n",
    "- nested:\n    ```python\n" + _indented(GOOD, 4) + "    ```\n",
    "<think>\nSketch:\n```python\ndef f(x):\n    return x\nno, fuse it instead.\n</think>\nFinal:\n```python\n"
    + GOOD + "```\n",
    '"""Usage:\n```python\nm = ModelNew()\n```\n"""\n' + GOOD,
])
def test_honest_response_shapes_are_extracted(response):
    assert extract_candidate(response, 200_000).endswith(GOOD)


# ------------------------------------------------------------------------------------------ end to end
# the kernel registration spelled without the word Library (the type of TORCH_LIBRARY's own argument), at import
OVERRIDE = r'''
#include <torch/extension.h>
#include <type_traits>
torch::Tensor fast_relu(torch::Tensor a) {
  auto out = torch::empty_like(a);
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) o[i] = x[i] > 0.f ? x[i] : 0.f;
  return out;
}
static torch::Tensor slow_relu(const torch::Tensor& a) {
  auto out = torch::empty_like(a);
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int r = 0; r < 200; ++r)
    for (int64_t i = 0, n = a.numel(); i < n; ++i) o[i] = x[i] > 0.f ? x[i] : 0.f * r;
  return out;
}
TORCH_LIBRARY(probe34ops, m) {
  using L = std::remove_reference_t<decltype(m)>;
  static L other(static_cast<L::Kind>(1), "aten", c10::DispatchKey::CPU, "", 0);
  other.impl("relu", slow_relu);
}
'''


@pytest.mark.slow
def test_a_kernel_registered_over_an_aten_op_is_caught_at_run_time(make_cfg):
    response = textwrap.dedent('''\
        ```python
        import torch
        import torch.nn as nn
        from torch.utils.cpp_extension import load_inline

        SRC = r"""{src}"""
        ext = load_inline(name="probe34_override", cpp_sources=SRC, functions=["fast_relu"], extra_cflags=["-O2"])


        class ModelNew(nn.Module):
            def forward(self, x):
                return ext.fast_relu(x)
        ```
        ''').format(src=OVERRIDE)
    r = verify(load_task(task_path("relu")), response, make_cfg())
    assert r.category == Category.CHEATING and r.rule == "global_state", (r.category, r.rule, r.feedback)
    assert "aten::relu" in r.feedback
