"""The output commitment's block digests (``correctness.block_digests``) as one fused Triton kernel.

Why: the torch form runs about forty elementwise int64 passes with temporaries over each output. On one H200 a
6.4 GB KernelBench output took about 0.5 s to commit (digests plus their handover), and a full-size check commits
after every one of its 120 timed batches: 60-70 s of a check that should hold the device about 5 s
(``bench/results/verifier_fullsize_h200.md``). This kernel reads each block's words once and keeps the hash tree
in registers. It computes the same function bit for bit (wrapping int64 arithmetic, the same keys and
multipliers); ``tests/verifier_core/test_digest_kernel.py`` checks that under Triton's interpreter on a CPU, and
the GPU test on the device.

Triton is imported (``verifier._digest_triton``) only when a digest runs through the kernel; ``available()`` says
whether it can.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

_BLOCK_ELEMS = 4096   # words a program holds per lane (block rows x words per block)


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(t: torch.Tensor) -> bool:
    """Whether ``t``'s digests can come from this kernel (Triton installed and ``t`` on a CUDA device)."""
    return t.is_cuda and _has_triton()


@functools.cache
def _on_device(word_keys: torch.Tensor, level_muls: torch.Tensor, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's [lanes, max W] keys and [levels, lanes] multipliers on ``device``, copied once per device
    (a full-size check commits after every timed batch; the constants are ``correctness``'s module tensors)."""
    lanes = word_keys.shape[0]
    return (word_keys.reshape(lanes, -1).to(device).contiguous(),
            level_muls.reshape(level_muls.shape[0], lanes).to(device).contiguous())


def digest_words(words: torch.Tensor, word_keys: torch.Tensor, level_muls: torch.Tensor,
                 fmix_muls: tuple[int, int]) -> torch.Tensor:
    """[blocks, W] int64 words (W a power of two) -> [blocks, lanes] int64 digests; the arguments are
    ``correctness``'s keys ([lanes, 1, max W]), level multipliers ([levels, lanes, 1, 1]) and fmix multipliers."""
    from verifier._digest_triton import digest_blocks, triton   # Triton only where a digest runs on it
    blocks, width = words.shape
    lanes = word_keys.shape[0]
    levels = width.bit_length() - 1
    words = words.contiguous()
    keys, muls = _on_device(word_keys, level_muls, words.device)
    out = torch.empty(blocks, lanes, dtype=torch.int64, device=words.device)
    if blocks:
        rows = max(1, _BLOCK_ELEMS // width)
        # Triton launches on the process's current device, not the tensors': a device worker for cuda:3 whose
        # current device is cuda:0 would hand cuda:0 pointers into cuda:3's memory
        with torch.cuda.device(words.device) if words.is_cuda else contextlib.nullcontext():   # CPU: interpreter
            digest_blocks[(triton.cdiv(blocks, rows),)](words, keys, muls, out, blocks, fmix_muls[0], fmix_muls[1],
                                                        keys.shape[1], WORDS=width, LEVELS=levels, ROWS=rows,
                                                        LANES=lanes)
    return out
