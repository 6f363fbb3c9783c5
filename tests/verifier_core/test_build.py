"""Build stage: cache hits, extension sharing across candidates, concurrent builds, failures, timeouts."""
import multiprocessing as mp
import os

import pytest

from verifier.build import build_candidate, code_hash
from verifier.config import VerifierConfig
from verifier.tasks import load_task

from .candidates import task_path

pytestmark = pytest.mark.slow

# tiny extensions without torch headers: they compile in about a second
FAST = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

lib = load_inline(name="fast_{tag}", cpp_sources="extern \\"C\\" int f_{tag}(int x) {{ return x + 1; }}",
                  no_implicit_headers=True, is_python_module=False)
{extra}
class ModelNew(nn.Module):
    def forward(self, x):
        return x
'''


def _build_in_process(args):
    cache, code = args
    r = build_candidate(load_task(task_path("relu")), code, VerifierConfig(build_cache_dir=cache, max_jobs=1))
    return r.ok, r.compiled, r.extensions, r.cached


def test_concurrent_builds_of_shared_sources_compile_once(tmp_path):
    cache = str(tmp_path / "cache")
    codes = [FAST.format(tag="shared", extra=f"VARIANT = {i}") for i in range(2)]  # different code, same extension
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.map(_build_in_process, [(cache, c) for c in codes])
    assert all(ok for ok, _, _, _ in results)
    assert sum(compiled for _, compiled, _, _ in results) == 1
    assert results[0][2] == results[1][2] and len(results[0][2]) == 1
    cfg = VerifierConfig(build_cache_dir=cache)
    again = build_candidate(load_task(task_path("relu")), codes[0], cfg)
    assert again.cached and again.ok and again.compiled == 0 and again.seconds < 5
    assert again.code_hash == code_hash(codes[0], cfg)
    assert os.path.isfile(os.path.join(again.build_dir, "record.json"))
    published = os.listdir(os.path.join(cache, "ext"))
    assert results[0][2][0] in published and not any(p.startswith(".tmp") for p in published)


def test_compile_error_is_reported_and_cached(tmp_path):
    cfg = VerifierConfig(build_cache_dir=str(tmp_path / "cache"))
    code = FAST.format(tag="broken", extra="").replace("return x + 1;", "return x + nope_undefined;")
    r = build_candidate(load_task(task_path("relu")), code, cfg)
    assert not r.ok and r.error == "compile" and not r.timed_out
    assert "nope_undefined" in r.log_tail
    again = build_candidate(load_task(task_path("relu")), code, cfg)
    assert again.cached and not again.ok and "nope_undefined" in again.log_tail


def test_compile_timeout_is_not_cached(tmp_path):
    cfg = VerifierConfig(build_cache_dir=str(tmp_path / "cache"), compile_timeout_s=0.5)
    code = FAST.format(tag="slow", extra="")
    r = build_candidate(load_task(task_path("relu")), code, cfg)
    assert not r.ok and r.timed_out and r.error == "timeout"
    assert not os.path.exists(os.path.join(r.build_dir, "record.json"))


def test_pure_python_candidates_need_no_build(tmp_path):
    cfg = VerifierConfig(build_cache_dir=str(tmp_path / "cache"))
    r = build_candidate(load_task(task_path("relu")), "import torch\nclass ModelNew(torch.nn.Module):\n    pass\n", cfg)
    assert r.ok and r.details.get("skipped") and r.compiled == 0


def test_toolchain_problems_are_told_apart_from_candidate_errors():
    from verifier.build import _TOOLCHAIN_PROBLEM, compiler_excerpt
    assert _TOOLCHAIN_PROBLEM.search("/usr/bin/ld: cannot find -lcudart: No such file or directory")
    assert _TOOLCHAIN_PROBLEM.search("/bin/sh: 1: nvcc: not found")
    assert not _TOOLCHAIN_PROBLEM.search("main.cpp:3:10: error: 'nope' was not declared in this scope")
    assert not _TOOLCHAIN_PROBLEM.search("undefined reference to `my_kernel'")
    log = "[1/2] c++ ... main.cpp\nmain.cpp:3:10: error: 'nope' was not declared\n  3 | nope;\nninja: build stopped\n" \
          "Error building extension 'k'"
    assert compiler_excerpt(log).startswith("main.cpp:3:10: error")
