"""The fused digest kernel (``verifier.digest_kernel``) computes ``correctness._digest_words`` bit for bit: checked
under Triton's interpreter on a CPU, in a subprocess because the interpreter is chosen when a kernel is defined.
On a GPU, ``test_gpu.py::test_output_digests_on_the_gpu_equal_the_hosts`` checks the compiled kernel."""
import os
import subprocess
import sys

import pytest
import torch

from verifier import digest_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECK = '''
import torch
from verifier import correctness as c, digest_kernel as dk
g = torch.Generator().manual_seed(1)
for width in (8, 16, 32, 64, 128):          # 1-, 2-, 4-, 8- and 16-byte entries
    for blocks in (1, 37, 300):             # less than, and more than, one program's rows
        words = torch.randint(-(2**63), 2**63 - 1, (blocks, width), generator=g, dtype=torch.int64)
        words[0, 0] = -1
        words[-1, -1] = -(2**63)
        got = dk.digest_words(words, c._WORD_KEYS, c._LEVEL_MULS, c._FMIX_MUL)
        want = c._digest_words(words)
        assert got.shape == want.shape == (blocks, c.DIGEST_LANES), (got.shape, want.shape)
        assert torch.equal(got, want), (width, blocks)
print("ok")
'''


@pytest.mark.skipif(not digest_kernel._has_triton(), reason="no Triton in this install")
def test_the_fused_kernel_equals_the_torch_digest_bit_for_bit_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_the_kernel_is_only_used_for_cuda_tensors():
    assert not digest_kernel.available(torch.zeros(64))


def test_importing_the_verifier_does_not_import_triton():
    """Every sandboxed child imports the verifier; on a CPU it never needs Triton (0.1-0.4 s an import)."""
    code = "import sys, verifier.correctness, verifier.evaluate; print('triton' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.strip() == "False", run.stderr[-2000:]
