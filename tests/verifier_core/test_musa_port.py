"""The CUDA -> MUSA port rule table, checked structurally (no MUSA hardware here: nothing ported is run)."""
import ast
import json
import os
import re
import subprocess
import sys

import pytest

from verifier.musa_port import RULES, port_source
from verifier.static_checks import check_source

from .test_static_honest import HONEST

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = os.path.join(ROOT, "verifier", "tasks")
# CUDA spellings that must not survive a port (outside comments a human reads)
_LEFT_OVER = re.compile(r"\bcuda[A-Z]\w*|\btorch\.cuda\b|\bcuda_sources\b|\.cuda\(|[\"']cuda[\"':]|\bcublas\w*"
                        r"|ATen/cuda/|c10/cuda/|\bgetCurrentCUDAStream\b|\bat::cuda::")

CANDIDATE = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

__global__ void accumulate_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n ? x[i] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    if (threadIdx.x % 32 == 0) atomicAdd(y, v);
#if __CUDA_ARCH__ >= 800
    __syncwarp();
#endif
}

torch::Tensor accumulate_cuda(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    const at::cuda::OptionalCUDAGuard guard(device_of(x));
    auto y = torch::zeros({1}, x.options());
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    accumulate_kernel<<<(x.numel() + 255) / 256, 256, 0, stream>>>(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    cudaError_t err = cudaGetLastError();
    TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
    return y;
}
"""

ext = load_inline(name="acc", cpp_sources="torch::Tensor accumulate_cuda(torch::Tensor x);", cuda_sources=src,
                  functions=["accumulate_cuda"], extra_cuda_cflags=["-O3", "--use_fast_math", "-arch=sm_90"])


class ModelNew(nn.Module):
    def forward(self, x):
        if not x.is_cuda:
            x = x.cuda()
        torch.cuda.synchronize()
        return ext.accumulate_cuda(x.to(device="cuda"))
'''


def test_the_rule_table_ports_headers_apis_extension_arguments_and_device_calls():
    r = port_source(CANDIDATE)
    for expected in ['#include <musa_runtime.h>', '#include <musa_fp16.h>',
                     '#include "torch_musa/csrc/aten/musa/MUSAContext.h"', '#include "torch_musa/csrc/core/MUSAGuard.h"',
                     "x.is_privateuseone()", "at::musa::OptionalMUSAGuard", "musaStream_t stream = "
                     "c10::musa::getCurrentMUSAStream()", "C10_MUSA_KERNEL_LAUNCH_CHECK()", "musaError_t err = "
                     "musaGetLastError()", "err == musaSuccess", "musaGetErrorString(err)", "__MUSA_ARCH__ >= 220",
                     "from torch_musa.utils.musa_extension import load_inline", "musa_sources=src",
                     "extra_musa_cflags=", "x.is_musa", "x = x.musa()", "torch.musa.synchronize()",
                     'x.to(device="musa")', "import torch\nimport torch_musa"]:
        assert expected in r.code, expected
    assert not _LEFT_OVER.search(r.code), _LEFT_OVER.search(r.code)
    # names that merely contain "cu"/"cuda" are left alone (word boundaries)
    assert "accumulate_kernel" in r.code and "accumulate_cuda" in r.code and "atomicAdd" in r.code
    assert r.changes["runtime_api"] == 5 and r.changes["py_load_inline_args"] == 2


def test_what_cannot_be_ported_safely_is_flagged():
    flags = " | ".join(port_source(CANDIDATE).flags)
    assert "32-lane warp assumptions" in flags and "0xffffffff" in flags and "% 32" in flags
    assert "architecture threshold" in flags and "nvcc-only compiler flags" in flags and "-arch=sm_90" in flags
    asm = port_source('src = "__global__ void k(float* p){ asm volatile(\\"membar.gl;\\"); }"\n')
    assert any("inline PTX" in f for f in asm.flags)
    assert port_source("import torch\nx = 1\n").flags == []


def test_porting_is_idempotent():
    once = port_source(CANDIDATE).code
    again = port_source(once)
    assert again.code == once and again.changes == {}


@pytest.mark.parametrize("name,code", [(n, c) for n, b, c in HONEST if b == "cuda" and "load_inline" in c],
                         ids=lambda v: v if isinstance(v, str) and len(v) < 60 else "")
def test_honest_cuda_candidates_port_to_clean_musa_candidates(name, code):
    """Every honest CUDA answer of the static corpus becomes a MUSA answer the musa backend's static rules
    accept, with no CUDA spelling left."""
    r = port_source(code)
    ast.parse(r.code)
    assert check_source(r.code, "musa") == [], [str(v) for v in check_source(r.code, "musa")]
    assert not _LEFT_OVER.search(r.code), (name, _LEFT_OVER.search(r.code))
    if "cuda_sources" in code:
        assert "musa_sources" in r.code


def _task_files():
    out = []
    for level in sorted(os.listdir(TASKS)):
        folder = os.path.join(TASKS, level)
        if level.startswith("level") and os.path.isdir(folder):
            out += [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
    return out


def test_every_bundled_task_ports():
    files = _task_files()
    assert len(files) >= 40
    for path in files:
        src = open(path).read()
        r = port_source(src)
        tree = ast.parse(r.code)
        names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        assert {"Model", "get_inputs", "get_init_inputs"} <= names, path
        assert not _LEFT_OVER.search(r.code), path
        if not r.changes:
            assert r.code == src


def test_cli_ports_a_folder_and_writes_a_manifest(tmp_path):
    src = tmp_path / "src"
    (src / "level1").mkdir(parents=True)
    (src / "level1" / "acc.py").write_text(CANDIDATE)
    (src / "notes.txt").write_text("not python")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "verifier", "port-musa", "--src", str(src), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    manifest = json.loads((out / "port_manifest.json").read_text())
    assert manifest["files"]["level1/acc.py"]["flags"] and "runtime_api" in manifest["files"]["level1/acc.py"]["changes"]
    assert "musa_sources" in (out / "level1" / "acc.py").read_text() and not (out / "notes.txt").exists()
    assert "not run on MUSA" in manifest["note"]
    bad = subprocess.run([sys.executable, "-m", "verifier", "port-musa", "--src", str(tmp_path / "nope"), "--out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nope" in bad.stderr


def test_rule_names_are_unique():
    assert len({r.name for r in RULES}) == len(RULES)
