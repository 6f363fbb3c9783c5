"""The sync-free packed RoPE is bitwise megatron's own thd RoPE, forward and backward."""
import pytest
import torch

from megatron_rl.actor.attention import (install_sync_free_thd_rope, thd_rope_without_host_sync,
                                         uninstall_sync_free_thd_rope)


def _freqs(positions: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]          # [s, 1, 1, dim] like megatron's


class _CP:
    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("lengths", [[7], [3, 5, 1], [4, 4, 4, 4], [1, 1, 9]])
@pytest.mark.parametrize("exact_mapping", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_megatron_thd_rope_bitwise(lengths, exact_mapping, dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    torch.manual_seed(0)
    n, heads, dim = sum(lengths), 3, 16
    cu = torch.cumsum(torch.tensor([0] + lengths, dtype=torch.int32), 0, dtype=torch.int32)
    freqs = _freqs(n if exact_mapping else max(lengths) + 3, dim)   # extra rows: megatron's max_seqlen table
    x = torch.randn(n, heads, dim, dtype=dtype, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    ref = _apply_rotary_pos_emb_thd(x, cu, freqs, mscale=1.0, cp_group=_CP())
    got = thd_rope_without_host_sync(y, cu, freqs, mscale=1.0)
    assert torch.equal(ref, got)
    g = torch.randn_like(ref)
    ref.backward(g)
    got.backward(g)
    assert torch.equal(x.grad, y.grad)


def test_install_routes_only_the_thd_case_and_uninstalls():
    import megatron.core.transformer.attention as attention_module

    was_installed = hasattr(attention_module.apply_rotary_pos_emb, "stock")   # by an actor built earlier
    uninstall_sync_free_thd_rope()
    stock = attention_module.apply_rotary_pos_emb
    install_sync_free_thd_rope()
    try:
        patched = attention_module.apply_rotary_pos_emb
        assert patched is not stock and patched.stock is stock
        install_sync_free_thd_rope()                       # idempotent
        assert attention_module.apply_rotary_pos_emb is patched

        class Cfg:
            apply_rope_fusion = False
            multi_latent_attention = False
            rotary_interleaved = False
            mrope_section = None

        t = torch.randn(6, 2, 8)
        cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        f = _freqs(4, 8)
        assert torch.equal(patched(t, f, Cfg(), cu_seqlens=cu, cp_group=_CP()),
                           stock(t, f, Cfg(), cu_seqlens=cu, cp_group=_CP()))
        bshd = torch.randn(4, 1, 2, 8)
        assert torch.equal(patched(bshd, f, Cfg(), cp_group=_CP()), stock(bshd, f, Cfg(), cp_group=_CP()))
    finally:
        uninstall_sync_free_thd_rope()
    assert attention_module.apply_rotary_pos_emb is stock
    if was_installed:
        install_sync_free_thd_rope()
