"""Outputs too large to hand over in full more than once (KernelBench's full sizes: 6.4 GB per call): the first
correctness trial hands over and compares every entry; the other trials, the ablation trial, the audits and the
hidden trials hand over a sample the parent picks after the call returned. Here the threshold is lowered so that
the test tasks' outputs (a few thousand entries) count as large, and every defence the sampled checks carry is
run against its red-team candidate."""
import pytest
import torch

from verifier.correctness import sample_index
from verifier.evaluate import verify
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import compiled, task_path
from .test_redteam_2026 import (BATCH_AND_SKIP, DECOY_THROWN_AWAY, PERSISTENT_OUT_PARAMETER, REPLAY_FROM_HARNESS,
                               calling)

SAMPLED = {"sample_outputs_above_bytes": 1024, "output_sample_elements": 256}


def run(task_name, response, cfg):
    return verify(load_task(task_path(task_name)), response, cfg)


def test_sample_indices_are_reproducible_sorted_blocks_with_both_ends():
    a, b = sample_index(10_000, 256, 7), sample_index(10_000, 256, 7)
    assert torch.equal(a, b) and not torch.equal(a, sample_index(10_000, 256, 8))
    assert a[0] == 0 and a[-1] == 9_999 and bool((a[1:] > a[:-1]).all())
    assert 128 <= a.numel() <= 256
    assert sample_index(256, 256, 1) is None   # small outputs: every entry
    assert sample_index(150, 16, 1) is None    # below three blocks, whatever k


def test_sample_entries_bounds_every_sample_and_the_device_form_is_the_same():
    """``sample_entries`` sizes the device buffer a sample is offered: no seed may pick more."""
    from verifier.correctness import sample_entries
    for numel, k in ((10_000, 256), (10_000, 1), (1 << 20, 4096), (4096, 512)):
        assert max(sample_index(numel, k, seed).numel() for seed in range(20)) <= sample_entries(numel, k) < numel
    assert sample_entries(256, 256) == 256 and sample_entries(150, 16) == 150
    assert torch.equal(sample_index(1 << 20, 4096, 3, torch.device("cpu")), sample_index(1 << 20, 4096, 3))


def test_a_small_sample_budget_still_samples_whole_committed_blocks():
    """output_sample_elements below 256 used to shrink the sampled blocks below COMMIT_BLOCK, so that no sampled
    entry was covered by the commitment: a fix-up of the sample went unseen."""
    from verifier.correctness import COMMIT_BLOCK, block_digests, uncommitted_entry

    out = torch.randn(10_000)
    for k in (1, 16, 100):
        idx = sample_index(out.numel(), k, 5)
        rows = idx.view(-1, COMMIT_BLOCK)
        assert bool((rows[:, 1:] - rows[:, :-1] == 1).all()) and rows.shape[0] >= 3
        fixed = out.clone()
        fixed[idx[COMMIT_BLOCK + 3]] += 1.0     # inside the first random (aligned) block
        assert uncommitted_entry(fixed[idx], idx, out.numel(), block_digests(out)) is not None, k


@pytest.mark.slow
def test_large_outputs_are_handed_over_in_full_once_per_check(make_cfg):
    """The count of full-output handovers per check: one where outputs are large, every one otherwise (before
    sampling, a check of a 6.4 GB output made a dozen full host round trips of it)."""
    response = compiled(calling("ext.add(a, b)"))
    small = run("elementwise_add", response, make_cfg())
    assert small.category == Category.PASS, small.feedback
    assert small.details["handover"]["sampled"] == 0 and small.details["handover"]["full"] >= 8

    large = run("elementwise_add", response, make_cfg(**SAMPLED))
    assert large.category == Category.PASS, large.feedback
    h = large.details["handover"]
    # the other four correctness trials, the ablation trial, the audits and the hidden trials (their number
    # depends on the batches timing chose) all sampled
    assert h["full"] == 1 and h["sampled"] >= 4 + 1 + 2, h
    # one full output (4096 float32) plus samples of at most 256 entries
    assert h["bytes"] <= 4096 * 4 + h["sampled"] * 256 * 4
    assert [t.get("sampled", False) for t in large.details["trials"]] == [False, True, True, True, True]
    assert large.details["child_seconds"]["digests"] > 0   # the timed batches' commitments, timed apart
    assert large.details["ablation"]["conclusive"] and not large.details["ablation"]["output_still_correct"]


@pytest.mark.slow
@pytest.mark.parametrize("task_name,model,category,rule", [
    ("transpose", DECOY_THROWN_AWAY, Category.CHEATING, "decoy_kernel"),
    ("elementwise_add", BATCH_AND_SKIP, Category.CHEATING, "timing_output_mismatch"),
    # an out-parameter kernel writing a persistent model buffer: the ablation restores the buffer only after
    # the sample was handed over, so the poisoned output is judged (and the honest kernel passes)
    ("elementwise_add", PERSISTENT_OUT_PARAMETER, Category.PASS, None),
    # a wrong shape: the first trial (full) names it
    ("relu", calling("ext.relu(x)[:, :-1].contiguous()", "x"),
     Category.CORRECTNESS_ERROR, None),
], ids=["decoy", "batch_and_skip", "persistent_out_parameter", "wrong_shape"])
def test_sampled_checks_keep_their_verdicts(make_cfg, task_name, model, category, rule):
    r = run(task_name, compiled(model), make_cfg(**SAMPLED))
    assert r.category == category, (r.category, r.rule, r.feedback, r.details.get("traceback"))
    assert r.rule == rule, (r.rule, r.feedback)
    assert r.details["handover"]["full"] >= 1


@pytest.mark.slow
def test_replay_from_the_harness_is_caught_by_sampled_audits(make_cfg, monkeypatch):
    import random

    import verifier.evaluate as evaluate_module
    monkeypatch.setattr(evaluate_module, "check_candidate", lambda code, cfg: [])
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: None)   # the reference always runs first
    r = run("elementwise_add", compiled(REPLAY_FROM_HARNESS), make_cfg(**SAMPLED))
    assert (r.category, r.rule) == (Category.CHEATING, "timing_output_mismatch"), r.feedback
    assert r.details["handover"]["sampled"] >= 1


# Native code that hooks the harness's handover (here in Python, static stage bypassed): every call returns
# garbage, and the hook fixes up, as the harness saves an output, all of a full handover and exactly the sampled
# entries of a sampled one (the seed tells it which); it leaves the ablation trial's output alone, so the ablation
# sees no decoy. Only a commitment made before the seed existed catches it.
SAMPLE_FIXUP = '''
import gc


def _find_session():   # the harness froze its objects (gc.freeze: out of get_objects' sight); native code
    gc.unfreeze()     # can thaw them, or find the session another way
    return [o for o in gc.get_objects() if type(o).__name__ == "DeviceSession"][0]

from verifier.correctness import sample_index


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.inputs = {}
        self.hooked = False

    def _hook(self):
        session = _find_session()
        save, inputs = session._save, self.inputs
        self.session = session

        def save_fixed_up(out, sample=None, **kw):
            a, b, fix = inputs.get(id(out), (None, None, False))
            if fix:
                flat, want = out.view(-1), (lambda i: a.reshape(-1)[i] + b.reshape(-1)[i])
                idx = None if sample is None else sample_index(flat.numel(), int(sample[1]), int(sample[0]))
                if idx is None:
                    flat.copy_(ext.add(a, b).view(-1))
                else:
                    flat[idx] = want(idx)
            return save(out, sample, **kw)
        session._save = save_fixed_up
        self.hooked = True

    def forward(self, a, b):
        if not self.hooked:
            self._hook()
        ext.add(a[:1], b[:1])          # a native call, so the output does not read as host-computed
        out = torch.full_like(a, 3.0)   # no work: wrong everywhere until the hook fixes it up
        self.inputs[id(out)] = (a, b, self.session._ablation is None)
        return out
'''


@pytest.mark.slow
def test_fixing_up_only_the_sampled_entries_after_the_seed_is_caught_by_the_commitment(make_cfg, monkeypatch):
    import verifier.evaluate as evaluate_module
    monkeypatch.setattr(evaluate_module, "check_candidate", lambda code, cfg: [])
    r = run("elementwise_add", compiled(SAMPLE_FIXUP), make_cfg(**SAMPLED))
    assert (r.category, r.rule) == (Category.CHEATING, "sample_fixup"), (r.category, r.rule, r.feedback)
    # the first trial (a full handover, fixed up in full) passed; the first sampled one was caught
    assert r.details["handover"]["full"] == 1 and r.details["handover"]["sampled"] >= 1


# Native code that hooks the harness's commitment handover and pads it with a large extra tensor (the parent must not
# map whatever size the child chooses): the limit comes from the reference outputs' own digests.
OVERSIZED_COMMITMENT = '''
import gc


def _find_session():   # the harness froze its objects (gc.freeze: out of get_objects' sight); native code
    gc.unfreeze()     # can thaw them, or find the session another way
    return [o for o in gc.get_objects() if type(o).__name__ == "DeviceSession"][0]


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.hooked = False

    def forward(self, a, b):
        if not self.hooked:
            session = _find_session()
            hand_over = session._hand_over

            def padded(name, tensors, *args, **kw):
                if name == "verifier-commit":
                    tensors = {**tensors, "d0_7": torch.zeros(1 << 19, 2, dtype=torch.int64)}   # 8 MiB
                return hand_over(name, tensors, *args, **kw)
            session._hand_over = padded
            self.hooked = True
        return ext.add(a, b)
'''


@pytest.mark.slow
def test_a_commitment_larger_than_the_reference_outputs_justify_is_refused(make_cfg, monkeypatch):
    import verifier.evaluate as evaluate_module
    monkeypatch.setattr(evaluate_module, "check_candidate", lambda code, cfg: [])
    r = run("elementwise_add", compiled(OVERSIZED_COMMITMENT), make_cfg(**SAMPLED))
    assert r.category == Category.RUNTIME_ERROR and "oversized output commitment" in r.feedback, (r.category,
                                                                                                   r.feedback)


def test_a_commitment_catches_a_changed_block_and_nothing_else():
    from verifier.correctness import block_digests, uncommitted_entry

    out = torch.randn(10_000)
    digests = block_digests(out)
    idx = sample_index(out.numel(), 1024, 3)
    assert uncommitted_entry(out[idx], idx, out.numel(), digests) is None
    fixed = out.clone()
    fixed[idx[200]] += 1e-3            # one sampled entry changed after the commitment
    assert uncommitted_entry(fixed[idx], idx, out.numel(), digests) == int(idx[200]) // 64 * 64
    other = out.clone()
    other[5] += 1.0                    # an entry outside the sample: the comparison's business, not the commitment's
    if 5 not in idx.tolist():
        assert uncommitted_entry(other[idx], idx, out.numel(), digests) is None
    # a commitment of the wrong size commits to nothing
    assert uncommitted_entry(out[idx], idx, out.numel(), digests[:-1]) is not None
    # nor one of another dtype (a child's re-viewed digests must not crash the parent's comparison)
    assert uncommitted_entry(out[idx], idx, out.numel(), digests.view(torch.float64)) is not None
    # the same digests on any device and chunking (the child digests on its device, the parent on the host)
    assert torch.equal(block_digests(out, chunk=640), digests)


def test_the_commitment_binds_where_a_linear_digest_did_not():
    """The first digest, a keyed sum of the entries' bits, was linear: negating two float64 entries of a block adds
    2^63 times the sum of two odd keys, 0 mod 2^64, so a fix-up that flipped two signs met it. The hash tree must
    catch that, and every single-bit change of a block must give a digest of its own in both lanes."""
    from verifier.correctness import block_digests, uncommitted_entry

    out = torch.randn(6_400, dtype=torch.float64)
    idx = sample_index(out.numel(), 1024, 3)
    j, k = int(idx[128]), int(idx[129])          # two entries of one sampled block
    assert j // 64 == k // 64
    fixed = out.clone()
    fixed[j], fixed[k] = -fixed[j], -fixed[k]
    assert uncommitted_entry(fixed[idx], idx, out.numel(), block_digests(out)) == j // 64 * 64

    block = torch.randn(64)                      # 2,048 bits: flip each one
    bits = block.view(torch.int32)
    seen = {tuple(block_digests(block)[0].tolist())}
    lanes = [set(), set()]
    for i in range(64):
        for b in range(32):
            flipped = bits.clone()
            flipped[i] ^= (1 << b) if b < 31 else -(1 << 31)
            d = block_digests(flipped.view(torch.float32))[0].tolist()
            seen.add(tuple(d))
            lanes[0].add(d[0])
            lanes[1].add(d[1])
    assert len(seen) == 1 + 64 * 32 and len(lanes[0]) == len(lanes[1]) == 64 * 32


def test_the_digest_mixer_is_murmur3_fmix64_with_wrapping_int64():
    """The tree's mixer in torch int64 ops (arithmetic shifts masked to logical ones, wrapping multiplies) equals
    the published fmix64 computed on Python integers mod 2^64."""
    from verifier.correctness import _fmix_

    def fmix64(x):
        x %= 1 << 64
        x ^= x >> 33
        x = x * 0xFF51AFD7ED558CCD % (1 << 64)
        x ^= x >> 33
        x = x * 0xC4CEB9FE1A85EC53 % (1 << 64)
        x ^= x >> 33
        return x - (1 << 64) if x >= 1 << 63 else x

    words = torch.cat([torch.tensor([0, 1, -1, -(2**63), 2**63 - 1]),
                       torch.randint(-(2**63), 2**63 - 1, (2_000,), generator=torch.Generator().manual_seed(1))])
    assert _fmix_(words.clone()).tolist() == [fmix64(int(w)) for w in words]


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64, torch.float64, torch.bfloat16, torch.bool,
                                   torch.int8])
def test_every_output_dtype_is_committed_and_a_change_in_either_half_of_a_complex_entry_is_caught(dtype):
    """An output the child cannot commit to is flagged as a fix-up by the parent: every dtype must be committable
    (complex128, 16 bytes an entry, was not: an honest complex128 output was judged cheating)."""
    from verifier.correctness import block_digests, committable, uncommitted_entry

    out = (torch.randn(5_000, dtype=torch.float64) * 4).to(dtype) if not dtype.is_complex else \
        torch.randn(5_000, dtype=dtype)
    assert committable(out)
    digests = block_digests(out)
    assert digests.shape == (-(-out.numel() // 64), 2) and digests.dtype == torch.int64
    idx = sample_index(out.numel(), 512, 11)
    assert uncommitted_entry(out[idx], idx, out.numel(), digests) is None
    changes = [1j, 1.0] if dtype.is_complex else [1]
    for delta in changes:
        fixed = out.clone()
        j = int(idx[100])
        fixed[j] = (~fixed[j]) if dtype == torch.bool else fixed[j] + torch.tensor(delta).to(dtype)
        assert uncommitted_entry(fixed[idx], idx, out.numel(), digests) == j // 64 * 64, delta
    assert torch.equal(block_digests(out, chunk=640), digests)


COMPLEX_TASK = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.complex(x.double(), 2 * x.double())


def get_inputs():
    return [torch.randn(4096)]


def get_init_inputs():
    return []
"""

COMPLEX_RESPONSE = '''```python
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = """
torch::Tensor run(torch::Tensor x) {
  auto y = torch::empty({x.numel()}, x.options().dtype(torch::kComplexDouble));
  const float* p = x.data_ptr<float>();
  c10::complex<double>* q = y.data_ptr<c10::complex<double>>();
  for (int64_t i = 0; i < x.numel(); i++) q[i] = c10::complex<double>((double)p[i], 2.0 * (double)p[i]);
  return y;
}
"""
ext = load_inline(name="cplx_ext", cpp_sources=src, functions=["run"], extra_cflags=["-O3"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.run(x.contiguous())
```'''


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, SAMPLED], ids=["full", "sampled"])
def test_an_honest_complex128_output_passes_handed_over_in_full_and_sampled(make_cfg, tmp_path, overrides):
    """safetensors has no complex128: the child hands such outputs over as float64 pairs, the parent reads them
    back, and the sample's commitment covers 16-byte entries (before: a KeyError in the child, a runtime error)."""
    path = tmp_path / "complex_task.py"
    path.write_text(COMPLEX_TASK)
    v = verify(load_task(str(path)), COMPLEX_RESPONSE, make_cfg(**overrides))
    assert v.category == Category.PASS, v.feedback
