"""Independent references for the actor tests: tiny random HF Qwen3 models and plain-torch math.

Every parameter (norms included) gets distinct random values so a mis-laid tensor shows up, and
the vocabulary (250) is not a multiple of 128, so megatron pads it and the padded logits must be
masked for the results to match.
"""
from __future__ import annotations

import torch

from megatron_rl.actor.losses import token_weights
from megatron_rl.types import TrainSample

VOCAB = 250


def tiny_config(*, tied: bool = False, layers: int = 2):
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=tied, max_position_embeddings=512, rms_norm_eps=1e-6)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def tiny_model(cfg, seed: int = 0):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.08 * noise)
    return model.float().eval()


def hf_state(model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def make_samples(lengths=(7, 12, 5, 20, 9, 3), prompt=3, seed: int = 1, weights=None) -> list[TrainSample]:
    """Random token sequences; the first ``prompt`` tokens of each are untrained."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(lengths):
        toks = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        p = min(prompt, n - 1)
        mask = [0] * p + [1] * (n - p)
        adv = torch.randn(n, generator=g).tolist()
        w = 1.0 if weights is None else weights[k]
        out.append(TrainSample(toks, mask, {"advantages": adv}, weight=w))
    return out


def hf_logprobs_entropy(model, sample: TrainSample) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense reference: full-vocab log-softmax of the HF logits (index 0 = 0)."""
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    n = len(sample.tokens)
    lp, en = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    lp[1:] = logp[:-1].gather(-1, torch.tensor(sample.tokens[1:])[:, None])[:, 0]
    en[1:] = ent[:-1]
    return lp, en


def hf_sft_loss_and_grads(model, samples, aggregation: str = "token_mean"):
    """The SFT objective the actor optimises, evaluated and differentiated in plain HF/torch."""
    weights = token_weights(samples, aggregation)
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for s, w in zip(samples, weights):
        logits = model(torch.tensor([s.tokens])).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        lp = logp[:-1].gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
        total = total + (torch.as_tensor(w[1:], dtype=torch.float64) * -lp.double()).sum()
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    return total.item(), norm, grads


def reference_adam_step(model, grads: dict, *, lr: float, eps: float, betas=(0.9, 0.999)) -> dict:
    """One torch AdamW step (no weight decay, no clipping) on a copy of the HF params."""
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=lr, betas=betas, eps=eps, weight_decay=0.0)
    for n, p in params.items():
        p.grad = grads[n].clone() if n in grads else torch.zeros_like(p)
    opt.step()
    out = {n: p.detach() for n, p in params.items()}
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
