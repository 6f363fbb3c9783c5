"""The CPU stand-ins for fla's GDN kernels (megatron_rl.parallel.cpu_compat) are transformers' own torch path
for Qwen3.5, applied to the packed sequences as one zero-padded batch, with fla's call signatures and layouts."""
import inspect

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.parallel.cpu_compat import gdn_causal_conv1d, gdn_chunk_gated_delta_rule, gdn_l2norm

LENS = [5, 70, 1, 33]


def _cu():
    return torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32)


def test_packed_gated_delta_rule_is_transformers_torch_path_per_sequence():
    """Each packed sequence gets what transformers' torch path gives it alone (outputs and final state, also from
    its own initial state), though they run as one padded batch."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    ref_fn = inspect.unwrap(torch_chunk_gated_delta_rule)
    g = torch.Generator().manual_seed(0)
    t, h, dk, dv = sum(LENS), 3, 8, 12
    q, k = (F.normalize(torch.randn(1, t, h, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(1, t, h, dv, generator=g)
    gate, beta = -torch.rand(1, t, h, generator=g), torch.rand(1, t, h, generator=g)
    init = torch.randn(len(LENS), h, dk, dv, generator=g)
    for initial in (None, init):
        out, final = gdn_chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, cu_seqlens=_cu(), output_final_state=True,
                                                initial_state=initial)
        assert out.shape == (1, t, h, dv) and final.shape == (len(LENS), h, dk, dv)
        start = 0
        for i, n in enumerate(LENS):
            s = slice(start, start + n)
            want, state = ref_fn(q[:, s], k[:, s], v[:, s], g=gate[:, s], beta=beta[:, s], output_final_state=True,
                                 initial_state=None if initial is None else initial[i:i + 1])
            torch.testing.assert_close(out[:, s], want, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(final[i], state[0], atol=1e-6, rtol=1e-5)
            start += n
    # a packed sequence does not see its neighbours: the same sequence alone gives the same output
    out, _ = gdn_chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, cu_seqlens=_cu())
    alone, _ = gdn_chunk_gated_delta_rule(q[:, 5:75], k[:, 5:75], v[:, 5:75], g=gate[:, 5:75], beta=beta[:, 5:75])
    torch.testing.assert_close(alone, out[:, 5:75], atol=1e-6, rtol=1e-5)


def test_packed_causal_conv1d_restarts_per_sequence_and_matches_torch_conv():
    g = torch.Generator().manual_seed(1)
    t, d, w = sum(LENS), 6, 4
    x, weight = torch.randn(1, t, d, generator=g), torch.randn(d, w, generator=g)
    y, state = gdn_causal_conv1d(x=x, weight=weight, activation="silu", cu_seqlens=_cu())
    assert state is None and y.shape == x.shape
    start = 0
    for n in LENS:
        seg = x[:, start:start + n].transpose(1, 2)
        want = F.silu(F.conv1d(seg, weight[:, None], padding=w - 1, groups=d)[..., :n]).transpose(1, 2)
        assert torch.allclose(y[:, start:start + n], want, atol=1e-6, rtol=1e-6)
        start += n


def test_l2norm_is_fp32_and_keeps_dtype():
    x = torch.randn(4, 16).to(torch.bfloat16)
    y = gdn_l2norm(x)
    assert y.dtype == torch.bfloat16
    want = x.float() / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    assert torch.allclose(y.float(), want, atol=1e-2)


def test_bad_cu_seqlens_and_unsupported_arguments_are_named():
    x = torch.randn(1, 10, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gdn_causal_conv1d(x=x, weight=torch.randn(4, 3), cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(NotImplementedError, match="initial_state"):
        gdn_causal_conv1d(x=x, weight=torch.randn(4, 3), initial_state=torch.zeros(1, 4, 3))


def test_megatrons_torch_compiled_helpers_run_eagerly_on_cpu():
    """megatron decorates the GDN helpers and gated attention's output gate with ``torch.compile``; on a CPU that
    compiled C++ with Inductor on first use (16 s of every process that built the hybrid). After ``apply()`` they
    run eagerly: dynamo sees no frame, and the gate is still x * sigmoid(gate)."""
    from megatron.core.transformer.attention import Attention
    from torch._dynamo.utils import counters

    from megatron_rl.parallel import cpu_compat

    assert cpu_compat.apply()
    frames = counters["frames"]["total"]
    x, gate = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    out = Attention._apply_output_gate(None, x, gate)
    assert torch.equal(out, x * torch.sigmoid(gate)) and counters["frames"]["total"] == frames
