"""The comparison rule: elementwise tolerance AND error relative to the reference's scale."""
import math

import torch

from verifier.correctness import compare_outputs, compare_tensor, flatten_outputs, same_structure


def test_all_zero_output_fails_on_tiny_magnitude_softmax():
    ref = torch.softmax(torch.rand(2, 393216, generator=torch.Generator().manual_seed(0)), dim=1)
    assert ref.max() < 1e-4  # outputs are ~2.5e-6: an absolute tolerance alone would accept zeros
    assert torch.allclose(torch.zeros_like(ref), ref, atol=1e-4, rtol=1e-4)
    c = compare_tensor(torch.zeros_like(ref), ref, 1e-4, 1e-4)
    assert not c.ok and c.max_rel_diff == 1.0
    assert "reference scale" in c.mismatch.reason
    # a correct kernel with float32 rounding noise passes
    noisy = ref * (1 + 1e-6 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)))
    assert compare_tensor(noisy, ref, 1e-4, 1e-4).ok


def test_elementwise_rule_and_first_mismatch():
    ref = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    got = ref.clone()
    got[1, 2] += 0.01
    c = compare_tensor(got, ref, 1e-4, 1e-4)
    assert not c.ok and c.mismatch.index == (1, 2)
    assert c.mismatch.expected == 6.0 and math.isclose(c.mismatch.got, 6.01, rel_tol=1e-6)
    assert c.mismatched_elements == 1
    assert math.isclose(c.max_abs_diff, 0.01, rel_tol=1e-4)
    # |a-b| <= atol + rtol*|b| with atol=rtol=1e-2: 0.01 <= 0.01 + 0.06 passes
    assert compare_tensor(got, ref, 1e-2, 1e-2).ok


def test_nan_and_inf_must_agree():
    ref = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    assert compare_tensor(ref.clone(), ref, 1e-4, 1e-4).ok
    hide = ref.clone()
    hide[1] = 0.0  # NaN in the reference hidden by a finite value
    assert not compare_tensor(hide, ref, 1e-4, 1e-4).ok
    spurious = ref.clone()
    spurious[0] = float("nan")  # NaN where the reference is finite
    c = compare_tensor(spurious, ref, 1e-4, 1e-4)
    assert not c.ok and c.mismatch.index == (0,)
    flip = ref.clone()
    flip[2] = -float("inf")
    assert not compare_tensor(flip, ref, 1e-4, 1e-4).ok


def test_shape_dtype_type_and_structure():
    ref = torch.ones(2, 3)
    assert "shape" in compare_tensor(torch.ones(3, 2), ref, 1e-4, 1e-4).mismatch.reason
    assert "dtype" in compare_tensor(torch.ones(2, 3, dtype=torch.float16), ref, 1e-4, 1e-4).mismatch.reason
    assert not compare_tensor([1.0], ref, 1e-4, 1e-4).ok
    assert "outputs" in compare_outputs([ref], [ref, ref], 1e-4, 1e-4).mismatch.reason
    ints = torch.tensor([1, 2, 3])
    assert compare_tensor(ints.clone(), ints, 1e-4, 1e-4).ok
    assert not compare_tensor(torch.tensor([1, 2, 4]), ints, 1e-4, 1e-4).ok
    leaves, spec = flatten_outputs((ref, [ref, {"a": ref}]))
    assert len(leaves) == 3
    _, spec_list = flatten_outputs([ref, (ref, {"a": ref})])
    assert same_structure(spec, spec_list)
    _, other = flatten_outputs((ref, ref))
    assert not same_structure(spec, other)


def test_zero_reference_needs_zero_output():
    ref = torch.zeros(5)
    assert compare_tensor(torch.zeros(5), ref, 1e-4, 1e-4).ok
    assert not compare_tensor(torch.full((5,), 1e-6), ref, 1e-4, 1e-4).ok
