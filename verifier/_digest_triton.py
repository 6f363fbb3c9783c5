"""The Triton kernel behind ``verifier.digest_kernel`` (a module of its own so that importing the verifier, as every
sandboxed child does, does not import Triton where no CUDA tensor is ever digested)."""
import triton
import triton.language as tl


@triton.jit
def fmix(x, mul1, mul2):
    x ^= (x >> 33) & 0x7FFFFFFF   # logical shift of a signed word
    x *= mul1
    x ^= (x >> 33) & 0x7FFFFFFF
    x *= mul2
    x ^= (x >> 33) & 0x7FFFFFFF
    return x


# n_blocks unspecialised: one build per entry size serves every output (the child builds them before any
# candidate is known, on a small probe)
@triton.jit(do_not_specialize=["n_blocks"])
def digest_blocks(words_ptr, keys_ptr, muls_ptr, out_ptr, n_blocks, mul1, mul2, key_stride,
                   WORDS: tl.constexpr, LEVELS: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WORDS)
    mask = rows < n_blocks
    x = tl.load(words_ptr + rows[:, None] * WORDS + cols[None, :], mask=mask[:, None], other=0)
    for lane in tl.static_range(LANES):
        key = tl.load(keys_ptr + lane * key_stride + cols)
        y = fmix(x ^ key[None, :], mul1, mul2)
        for level in tl.static_range(LEVELS):
            pairs = tl.reshape(y, (ROWS, WORDS >> (level + 1), 2))
            even, odd = tl.split(pairs)
            y = fmix(even * tl.load(muls_ptr + level * LANES + lane) + odd, mul1, mul2)
        tl.store(out_ptr + rows * LANES + lane, tl.reshape(y, (ROWS,)), mask=mask)
