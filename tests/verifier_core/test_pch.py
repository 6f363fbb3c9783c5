"""Precompiled torch/extension.h (verifier.pch): which builds share one, where its flags come from, and that
a PCH GCC cannot use (or that breaks a build) never changes a verdict."""
import os
import shutil
import subprocess

import pytest

from verifier import pch
from verifier.config import VerifierConfig
from verifier.pch import may_have_failed_because_of_pch, parse_ninja_flags, pch_key, pch_was_rejected

TOOLCHAIN = {"torch": "2.x", "cuda": None, "python": "3.12"}


@pytest.fixture(autouse=True)
def confined(request, monkeypatch):
    """Keys need confined writes (Landlock); the unit tests here do not depend on the host kernel's."""
    if "slow" not in request.keywords:
        monkeypatch.setattr(pch, "writes_confined", lambda cfg: bool(cfg.landlock))
ARGS = {"name": "a", "cpp_sources": "int f();", "functions": ["f"], "extra_cflags": ["-O2"]}


def key(**change):
    return pch_key(pch.TORCH_LOAD_INLINE, {**ARGS, **change}, VerifierConfig(), TOOLCHAIN)


def test_one_key_per_flag_set_not_per_source():
    assert key() == key(name="b", cpp_sources="int g();", functions=["g"], verbose=True)
    assert key() != key(extra_cflags=["-O3"])
    assert key() != key(extra_include_paths=["/x"])
    assert key() != key(cuda_sources="__global__ void k() {}")         # the CUDA build's C++ flags differ
    assert key() != pch_key(pch.TORCH_LOAD_INLINE, ARGS, VerifierConfig(backend="cuda"), TOOLCHAIN)
    assert key() != pch_key(pch.TORCH_LOAD_INLINE, ARGS, VerifierConfig(), {**TOOLCHAIN, "torch": "2.y"})


@pytest.mark.parametrize("change", [{"use_pch": True}, {"no_implicit_headers": True}, {"extra_cflags": "-O2"},
                                    {"extra_cflags": [1]}])
def test_no_pch_where_it_cannot_apply(change):
    assert key(**change) is None


def test_no_pch_for_other_toolchains_or_when_switched_off():
    assert pch_key("torch_musa.utils.musa_extension.load_inline", ARGS, VerifierConfig(), TOOLCHAIN) is None
    assert pch_key(pch.TORCH_LOAD_INLINE, ARGS, VerifierConfig(pch_after_compiles=0), TOOLCHAIN) is None
    with pytest.raises(ValueError, match="pch_after_compiles"):
        VerifierConfig(pch_after_compiles=-1)
    # shared by every candidate with the same flags: only where sandboxed children cannot write the store
    assert pch_key(pch.TORCH_LOAD_INLINE, ARGS, VerifierConfig(landlock=False), TOOLCHAIN) is None


def test_flags_come_from_torch_build_ninja_without_the_extension_name():
    text = ("ninja_required_version = 1.3\ncxx = c++\n\ncflags = -DTORCH_EXTENSION_NAME=vc_x "
            "-DTORCH_API_INCLUDE_EXTENSION_H -isystem /opt/my$ torch/include -fPIC -std=c++17 -O2\n"
            "post_cflags = -DX=1\nldflags = -shared\n\nrule compile\n"
            "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out $post_cflags\n")
    assert parse_ninja_flags(text) == {
        "cxx": "c++", "post_cflags": ["-DX=1"],
        "cflags": ["-DTORCH_API_INCLUDE_EXTENSION_H", "-isystem", "/opt/my torch/include", "-fPIC", "-std=c++17",
                   "-O2"]}
    assert parse_ninja_flags("cxx = x86_64-linux-gnu-g++-12\ncflags = -O2\n")["cxx"] == "x86_64-linux-gnu-g++-12"
    assert parse_ninja_flags("cflags = -O2\n") is None                      # no compiler named
    for cxx in ("/bin/bash", "clang++", "sh -c"):                            # not a GCC C++ driver
        assert parse_ninja_flags(f"cxx = {cxx}\ncflags = -O2\n") is None, cxx
    for flag in ("-include /tmp/evil.h", "-imacros m.h", "-wrapper gdb", "-B/tmp/bin", "-fplugin=x.so",
                 "-specs=s", "-save-temps", "-DX=`id`", "-DX=$y", "-DX=$$HOME"):
        # more than torch's header, programs, or what the shell running torch's own build would expand
        assert parse_ninja_flags(f"cxx = c++\ncflags = -O2 {flag}\n") is None, flag
    assert parse_ninja_flags("cxx = c++\ncflags = -c x.cpp -o y.o\n") is None  # not a flags line torch writes
    assert parse_ninja_flags("cxx = c++\ncflags = -I'unterminated\n") is None


def test_no_new_pch_without_room(tmp_path, monkeypatch):
    from verifier.pch import MAX_ENTRIES, PchStore
    store = PchStore(str(tmp_path), VerifierConfig(), None)
    assert store._room()
    for i in range(MAX_ENTRIES):
        os.makedirs(os.path.join(store.dir, f"k{i}", "torch"))
        open(os.path.join(store.dir, f"k{i}", "torch", "extension.h.gch"), "wb").close()
    assert not store._room()
    stale = os.path.join(store.dir, ".tmp-k-dead")
    os.makedirs(stale)
    os.utime(stale, (0, 0))                     # left by a killed build long ago: swept
    shutil.rmtree(os.path.join(store.dir, "k0"))
    assert store._room() and not os.path.exists(stale)
    monkeypatch.setattr(pch, "MIN_FREE_BYTES", 1 << 62)
    assert not store._room()                    # not on a full disk either


def test_which_failed_builds_are_tried_again_without_the_pch():
    nvcc_only = "FAILED: cuda.cuda.o\ncuda.cu(3): error: identifier \"x\" is undefined\n"
    assert not may_have_failed_because_of_pch(nvcc_only)                 # nvcc never sees the PCH
    assert may_have_failed_because_of_pch("FAILED: main.o\nmain.cpp:5:1: error: expected ';'\n")
    assert may_have_failed_because_of_pch(nvcc_only + "cc1plus: error: one or more PCH files were found, "
                                          "but they were invalid\n")
    assert may_have_failed_because_of_pch("Error building extension 'x'")  # no step named: be safe


def test_gcc_says_when_it_does_not_use_a_pch(tmp_path):
    """The warning text pch_was_rejected looks for, from the real compiler (a tiny header, no torch)."""
    (tmp_path / "inc" / "torch").mkdir(parents=True)
    (tmp_path / "inc" / "torch" / "extension.h").write_text("#pragma once\nint answer();\n")
    (tmp_path / "pch" / "torch").mkdir(parents=True)
    (tmp_path / "pch" / "torch" / "extension.h.gch").write_bytes(b"not a precompiled header at all")
    (tmp_path / "main.cpp").write_text("#include <torch/extension.h>\nint main() { return 0; }\n")
    r = subprocess.run(["c++", f"-I{tmp_path / 'pch'}", "-isystem", str(tmp_path / "inc"), "-Winvalid-pch",
                        "-fsyntax-only", str(tmp_path / "main.cpp")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr                     # GCC fell back to the header
    assert pch_was_rejected(r.stderr), r.stderr
    assert not pch_was_rejected("FAILED: main.o\nmain.cpp:5:1: error: expected ';'\n")


# one small function at -O0: the header, not the bindings, dominates its build, and the test needs no optimiser
TINY_RELU = '''```python
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

ext = load_inline(name="pch_relu_TAG", cpp_sources=r"""
torch::Tensor relu(torch::Tensor a) {
  TORCH_CHECK(a.is_contiguous() && a.scalar_type() == torch::kFloat32, "expected contiguous float32");
  auto out = torch::empty_like(a);
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) o[i] = x[i] > 0.f ? x[i] : 0.f;
  return out;
}""", functions=["relu"], extra_cflags=["-O0"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
```'''


@pytest.mark.slow
def test_builds_of_one_flag_set_share_a_pch_and_verdicts_do_not_change(tmp_path):
    """First build: no PCH, its flags recorded. Second: the PCH is built and used, and the candidate built
    with it passes. (What happens to a PCH GCC rejects, or that breaks a build, is scripted below; the real
    compiler's rejection warning is test_gcc_says_when_it_does_not_use_a_pch's.)"""
    import json

    from verifier.build import build_candidate
    from verifier.evaluate import precheck, run_candidate
    from verifier.pch import PchStore
    from verifier.tasks import load_task
    from verifier.types import Category

    from .candidates import task_path

    if not pch.writes_confined(VerifierConfig()):
        pytest.skip("no Landlock on this kernel: PCHs are off by design")
    cfg = VerifierConfig(build_cache_dir=str(tmp_path / "cache"), pch_after_compiles=1, max_jobs=1,
                         num_timing_trials=3, num_warmup=1, time_budget_s=2.0)
    task = load_task(task_path("relu"))

    def build(tag):
        code = precheck(task, TINY_RELU.replace("TAG", tag), cfg)
        b = build_candidate(task, code, cfg)
        assert b.ok, b.log_tail
        with open(os.path.join(cfg.build_cache_dir, "ext", b.extensions[0], "meta.json")) as f:
            return code, b, json.load(f)

    _, _, first = build("a")
    assert first.get("pch") is None
    pch_dir = os.path.join(cfg.build_cache_dir, "pch")
    (flags_file,) = [f for f in os.listdir(pch_dir) if f.endswith(".flags.json")]
    k = flags_file[:-len(".flags.json")]
    code, b, second = build("b")
    assert second["pch"] == "built" and not pch_was_rejected(second["log"])
    gch = os.path.join(pch_dir, k, "torch", "extension.h.gch")
    assert os.path.getsize(gch) > 1 << 20
    r = run_candidate(task, code, b, cfg)
    assert r.category == Category.PASS, r.feedback
    # a build that finds the PCH published now uses it without building it again
    assert PchStore(cfg.build_cache_dir, cfg, None).prepare(k, 0.0)[0] == os.path.join(pch_dir, k)


REJECTED = ("main.cpp:1:29: warning: /c/pch/k/torch/extension.h.gch: too short to be a PCH file [-Winvalid-pch]\n"
            "    1 | #include <torch/extension.h>\n")


def _service_with_a_published_pch(tmp_path, replies):
    """An ExtensionService whose compiler runs are scripted: (ok, log) per call, kwargs recorded."""
    from verifier.build import ExtensionService
    service = ExtensionService(VerifierConfig(build_cache_dir=str(tmp_path / "c"), landlock=True))
    store = service.pch_store
    os.makedirs(os.path.join(store.dir, "k", "torch"))
    open(os.path.join(store.dir, "k", "torch", "extension.h.gch"), "wb").close()
    calls = []

    def run_compiler(api, kwargs, key, deadline):
        ok, log = replies[len(calls)]
        calls.append(kwargs)
        staging = tmp_path / f"staging{len(calls)}"
        staging.mkdir()
        return {"ok": ok, "log": log, "seconds": 1.0, **({"so": "x.so"} if ok else {})}, str(staging), log

    service._run_compiler = run_compiler
    return service, store, calls


def test_a_pch_gcc_rejects_is_retired_and_the_build_stands(tmp_path):
    service, store, calls = _service_with_a_published_pch(tmp_path, [(True, REJECTED)])
    meta = service._compile(pch.TORCH_LOAD_INLINE, dict(ARGS), "e1", 1e18, "k", store.published("k"), None)
    assert meta["ok"] and meta["pch"] == "rejected" and len(calls) == 1
    assert store.published("k") is None and os.path.exists(os.path.join(store.dir, "k.failed"))
    assert store.prepare("k", 1e18) == (None, None)           # never built or used again


def test_a_build_that_fails_through_the_pch_is_judged_without_it(tmp_path):
    failed = "FAILED: main.o\nmain.cpp:5:1: error: expected ';'\n"
    service, store, calls = _service_with_a_published_pch(tmp_path, [(False, failed), (True, "")])
    meta = service._compile(pch.TORCH_LOAD_INLINE, dict(ARGS), "e2", 1e18, "k", store.published("k"), None)
    assert meta["ok"] and len(calls) == 2
    assert any("-Winvalid-pch" in f for f in calls[0]["extra_cflags"])
    assert calls[1]["extra_cflags"] == ARGS["extra_cflags"]   # the verdict's build: no PCH flags
    assert store.published("k") is None                        # it broke a build that passes without it
    # a candidate whose code is wrong fails both ways, and the PCH stays
    service, store, calls = _service_with_a_published_pch(tmp_path / "2", [(False, failed), (False, failed)])
    meta = service._compile(pch.TORCH_LOAD_INLINE, dict(ARGS), "e3", 1e18, "k", store.published("k"), None)
    assert not meta["ok"] and len(calls) == 2 and store.published("k")
