"""The output commitment's block digests (``correctness.block_digests``) as one fused Triton kernel.

Why: the torch form runs about forty elementwise int64 passes with temporaries over each output. On one H200 a
6.4 GB KernelBench output took about 0.5 s to commit (digests plus their handover), and a full-size check commits
after every one of its 120 timed batches: 60-70 s of a check that should hold the device about 5 s
(``bench/results/verifier_fullsize_h200.md``). This kernel reads each block's words once and keeps the hash tree
in registers. It computes the same function bit for bit (wrapping int64 arithmetic, the same keys and
multipliers); ``tests/verifier_core/test_digest_kernel.py`` checks that under Triton's interpreter on a CPU, and
the GPU test on the device.

Triton is imported here and nowhere else in the verifier; ``available()`` says whether it can be used.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # a CPU-only or MUSA install: block_digests keeps its torch form
    triton = None

_BLOCK_ELEMS = 4096   # words a program holds per lane (block rows x words per block)


def available(t: torch.Tensor) -> bool:
    """Whether ``t``'s digests can come from this kernel (Triton present and ``t`` on a CUDA device)."""
    return triton is not None and t.is_cuda


if triton is not None:
    @triton.jit
    def _fmix(x, mul1, mul2):
        x ^= (x >> 33) & 0x7FFFFFFF   # logical shift of a signed word
        x *= mul1
        x ^= (x >> 33) & 0x7FFFFFFF
        x *= mul2
        x ^= (x >> 33) & 0x7FFFFFFF
        return x

    # n_blocks unspecialised: one build per entry size serves every output (the child builds them before any
    # candidate is known, on a small probe)
    @triton.jit(do_not_specialize=["n_blocks"])
    def _digest_kernel(words_ptr, keys_ptr, muls_ptr, out_ptr, n_blocks, mul1, mul2, key_stride,
                       WORDS: tl.constexpr, LEVELS: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, WORDS)
        mask = rows < n_blocks
        x = tl.load(words_ptr + rows[:, None] * WORDS + cols[None, :], mask=mask[:, None], other=0)
        for lane in tl.static_range(LANES):
            key = tl.load(keys_ptr + lane * key_stride + cols)
            y = _fmix(x ^ key[None, :], mul1, mul2)
            for level in tl.static_range(LEVELS):
                pairs = tl.reshape(y, (ROWS, WORDS >> (level + 1), 2))
                even, odd = tl.split(pairs)
                y = _fmix(even * tl.load(muls_ptr + level * LANES + lane) + odd, mul1, mul2)
            tl.store(out_ptr + rows * LANES + lane, tl.reshape(y, (ROWS,)), mask=mask)


def digest_words(words: torch.Tensor, word_keys: torch.Tensor, level_muls: torch.Tensor,
                 fmix_muls: tuple[int, int]) -> torch.Tensor:
    """[blocks, W] int64 words (W a power of two) -> [blocks, lanes] int64 digests; the arguments are
    ``correctness``'s keys ([lanes, 1, max W]), level multipliers ([levels, lanes, 1, 1]) and fmix multipliers."""
    blocks, width = words.shape
    lanes = word_keys.shape[0]
    levels = width.bit_length() - 1
    words = words.contiguous()
    keys = word_keys.reshape(lanes, -1).to(words.device).contiguous()
    muls = level_muls.reshape(level_muls.shape[0], lanes).to(words.device).contiguous()
    out = torch.empty(blocks, lanes, dtype=torch.int64, device=words.device)
    if blocks:
        rows = max(1, _BLOCK_ELEMS // width)
        _digest_kernel[(triton.cdiv(blocks, rows),)](words, keys, muls, out, blocks, fmix_muls[0], fmix_muls[1],
                                                     keys.shape[1], WORDS=width, LEVELS=levels, ROWS=rows,
                                                     LANES=lanes)
    return out
