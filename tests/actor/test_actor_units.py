"""Single-process pieces of the actor: SFT loss, vocab-parallel entropy math, packed RoPE, config."""
import math

import pytest
import torch

from megatron_rl.actor import ActorConfig, LossContext, SFTLoss
from megatron_rl.actor.batching import pack_micro_batch
from megatron_rl.actor.forward import restart_rope_positions
from megatron_rl.actor.logprobs import _mask_padded_vocab, vocab_parallel_entropy
from megatron_rl.types import TrainSample


class _OneRankGroup:
    def size(self):
        return 1

    def rank(self):
        return 0


def test_sft_loss_hand_computed():
    lp = torch.tensor([-1.0, -2.0, -0.5, -4.0], requires_grad=True)
    ctx = LossContext(logprobs=lp, entropy=torch.tensor([1.0, 2.0, 3.0, 4.0]),
                      loss_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]),
                      token_weight=torch.tensor([0.25, 0.25, 0.25, 0.5]),
                      sample_index=torch.tensor([0, 0, 1, 1]))
    loss, metrics = SFTLoss()(ctx)
    assert math.isclose(loss.item(), 0.25 * 1 + 0.25 * 2 + 0.5 * 4)
    loss.backward()
    assert lp.grad.tolist() == [-0.25, -0.25, 0.0, -0.5]
    s, c = metrics["nll"]
    assert (s.item(), c.item()) == (7.0, 3.0)
    assert metrics["entropy"][0].item() == 7.0


def test_vocab_parallel_entropy_matches_dense_value_and_gradient():
    torch.manual_seed(0)
    logits = (3 * torch.randn(5, 1, 40, dtype=torch.float64)).requires_grad_(True)
    got = vocab_parallel_entropy(logits, _OneRankGroup())
    p = torch.softmax(logits, -1)
    want = -(p * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(got, want, atol=1e-12)
    g_got, = torch.autograd.grad(got.sum(), logits)
    g_want, = torch.autograd.grad(want.sum(), logits)
    assert torch.allclose(g_got, g_want, atol=1e-12)


def test_padded_vocab_is_masked_to_zero_probability():
    logits = torch.zeros(2, 1, 8)
    masked = _mask_padded_vocab(logits, vocab_size=6, tp_group=_OneRankGroup())
    p = torch.softmax(masked, -1)
    assert torch.equal(p[..., 6:], torch.zeros(2, 1, 2))
    assert torch.allclose(p[..., :6], torch.full((2, 1, 6), 1 / 6))
    ent = vocab_parallel_entropy(masked, _OneRankGroup())
    assert torch.allclose(ent, torch.full((2, 1), math.log(6)))
    assert _mask_padded_vocab(logits, vocab_size=8, tp_group=_OneRankGroup()) is logits


def test_restart_rope_positions(monkeypatch):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary_pos_emb = rope

    chunk = Chunk()
    samples = [TrainSample([1] * 5, [0] * 5), TrainSample([2] * 3, [0] * 3)]
    mb = pack_micro_batch(samples, [0, 1], rows="all", pad_multiple=4)  # 5 + 3 + 0 pad
    table = rope.get_emb(8)
    default = rope(8)
    with restart_rope_positions(chunk, mb):
        emb = chunk.rotary_pos_emb(8)
        with pytest.raises(RuntimeError, match="asked for 9 positions"):
            chunk.rotary_pos_emb(9)
    want = torch.cat([table[:5], table[:3]])
    assert torch.equal(emb, want)
    assert not torch.equal(emb, default)
    assert torch.equal(chunk.rotary_pos_emb(8), default)  # restored on exit
    assert "forward" not in vars(rope)


@pytest.mark.parametrize("kw,match", [
    (dict(tp=0), "tp=0"),
    (dict(params_dtype="float16"), "params_dtype"),
    (dict(max_tokens_per_gpu=None, micro_batch_size=None), "max_tokens_per_gpu"),
    (dict(loss_aggregation="sum"), "loss_aggregation"),
    (dict(vpp=2, pp=1), "vpp=2"),
    (dict(lr=0.0), "lr=0.0"),
    (dict(lr_decay_style="step"), "lr_decay_style"),
    (dict(lr_warmup_steps=10, lr_decay_steps=5), "lr_decay_steps=5"),
    (dict(recompute_granularity="some"), "recompute_granularity"),
])
def test_actor_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        ActorConfig(**kw).validate()


def test_gradient_accumulation_fusion_without_cuda_is_a_clear_error():
    import pytest
    import torch

    from megatron_rl.parallel import wgrad_fusion

    if torch.cuda.is_available():
        pytest.skip("the error is for machines without CUDA")
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion needs CUDA"):
        wgrad_fusion.install()
