"""Checks that run inside spawned gloo ranks (imported by the spawned processes by module name).

Each entry point runs several layouts in one process group (init_parallel rebuilds the megatron
groups in place) so the start-up cost is paid once per world size. Assertions raise on the rank
that fails and `spawn` re-raises them with that rank's traceback.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from tests.actor import reference as ref

LR = 0.05
EPS = 10.0  # eps >> |g| makes Adam's first step ~ lr * g / eps: sensitive to the gradient's scale


def _actor(tp=1, pp=1, vpp=None, tied=False, layers=2, *, source=None, **overrides):
    from megatron_rl.actor import ActorConfig, MegatronActor
    from megatron_rl.parallel import init_parallel

    init_parallel(tp, pp, vpp=vpp)
    cfg = ref.tiny_config(tied=tied, layers=layers)
    hf = ref.tiny_model(cfg, seed=layers + int(tied))
    kwargs = dict(tp=tp, pp=pp, vpp=vpp, params_dtype="float32", lr=LR, adam_eps=EPS, clip_grad=0.0,
                  max_tokens_per_gpu=30, logprob_chunk_size=8)
    kwargs.update(overrides)
    actor = MegatronActor(ActorConfig(**kwargs), cfg)
    actor.load_hf(source if source is not None else ref.hf_state(hf))
    return actor, hf


def _hybrid_actor(tp=1):
    """The tiny Qwen3.5 hybrid (one Gated DeltaNet layer, one gated-attention layer) as an actor."""
    from megatron_rl.actor import ActorConfig, MegatronActor
    from megatron_rl.parallel import init_parallel
    from tests.bridge.tiny_qwen3_5 import tiny_config, tiny_model

    init_parallel(tp, 1)
    cfg = tiny_config(layers=2, layer_types=["linear_attention", "full_attention"])
    hf = tiny_model(cfg, seed=3)
    actor = MegatronActor(ActorConfig(tp=tp, params_dtype="float32", attention_backend="sdpa", lr=LR, adam_eps=EPS,
                                      clip_grad=0.0, max_tokens_per_gpu=64), cfg)
    actor.load_hf(ref.hf_state(hf))
    return actor, hf


def _export(actor) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in actor.export_hf()}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), f"name mismatch: {sorted(set(a) ^ set(b))}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def check_logprobs(actor, hf, samples, tol=1e-5):
    lps, ents = actor.compute_logprobs(samples, with_entropy=True)
    assert len(lps) == len(samples) and len(ents) == len(samples)
    for i, (s, lp, en) in enumerate(zip(samples, lps, ents)):
        want_lp, want_en = ref.hf_logprobs_entropy(hf, s)
        assert lp.shape == (len(s.tokens),) and lp[0] == 0 and en[0] == 0
        d_lp = (lp.double() - want_lp).abs().max().item()
        d_en = (en.double() - want_en).abs().max().item()
        assert d_lp < tol, f"sample {i}: logprob differs from HF by {d_lp}"
        assert d_en < tol, f"sample {i}: entropy differs from the dense reference by {d_en}"
    # trained_only: the same numbers on loss-masked tokens, zeros elsewhere
    part = actor.compute_logprobs(samples, trained_only=True)
    for i, (s, full, got) in enumerate(zip(samples, lps, part)):
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert not got[~m].any(), f"sample {i}: trained_only filled untrained tokens"
        if m.any():
            assert (got[m] - full[m]).abs().max().item() < 1e-6, f"sample {i}: trained_only differs"
    return lps


def check_sft_step(actor, hf, samples, aggregation="token_mean"):
    """One SFT step: loss and grad norm equal HF autograd's; weights equal a torch AdamW step."""
    from megatron_rl.actor import SFTLoss

    want_loss, want_norm, grads = ref.hf_sft_loss_and_grads(hf, samples, aggregation)
    want_w = ref.reference_adam_step(hf, grads, lr=LR, eps=EPS)
    m = actor.train_step(samples, SFTLoss())
    assert not m["skipped"], m
    assert abs(m["loss"] - want_loss) < 1e-5, f"loss {m['loss']} vs HF {want_loss}"
    assert abs(m["grad_norm"] - want_norm) < 1e-5 * max(1.0, want_norm), \
        f"grad norm {m['grad_norm']} vs HF {want_norm}"
    assert m["num_tokens"] == sum(s.num_trained_tokens for s in samples)
    got_w = _export(actor)
    d = _max_diff(got_w, want_w)
    assert d < 1e-6, f"updated weights differ from the reference AdamW step by {d}"
    return m, got_w


class NaNLoss:
    """SFT loss times NaN: the step must be skipped without touching any state."""

    needs_entropy = False

    def __call__(self, ctx):
        from megatron_rl.actor import SFTLoss

        loss, metrics = SFTLoss()(ctx)
        return loss * float("nan"), metrics


def _eval_loss(actor, samples) -> float:
    """Token-mean NLL of the trained tokens from compute_logprobs (the checkpoint probe)."""
    lps = actor.compute_logprobs(samples)
    num = sum(-(lp * torch.tensor(s.loss_mask, dtype=torch.float32)).sum().item() for s, lp in zip(samples, lps))
    return num / sum(s.num_trained_tokens for s in samples)


def check_fused_vs_foreach_adam():
    """torch's fused Adam (actor.fused_adam) updates the weights like megatron's foreach fallback."""
    from megatron_rl.actor import ActorConfig, MegatronActor, SFTLoss
    from megatron_rl.parallel import init_parallel

    init_parallel(1, 1)
    cfg = ref.tiny_config()
    hf = ref.tiny_model(cfg, seed=3)
    samples = ref.make_samples()
    weights = {}
    for fused in (True, False):
        actor = MegatronActor(ActorConfig(lr=1e-2, fused_adam=fused), cfg)
        actor.load_hf(ref.hf_state(hf))
        groups = [g for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
                  for g in o.optimizer.param_groups]
        assert all(bool(g.get("fused")) == fused for g in groups)
        for _ in range(3):
            actor.train_step(samples, SFTLoss())
        weights[fused] = dict(actor.export_hf())
    moved = max((weights[True][k] - v).abs().max().item() for k, v in ref.hf_state(hf).items())
    diff = max((weights[True][k] - weights[False][k]).abs().max().item() for k in weights[True])
    assert moved > 1e-3 and diff < 1e-5, (moved, diff)


def check_ppo_mini_batches():
    """An RL batch in 4 PPO mini-batches: π_old (the loss's declared field) is computed once, before the first
    optimizer step, so the first mini-batch is on-policy (ratio 1) and the later ones are not: the clip acts.
    In one mini-batch (the old behaviour) the ratio is 1 and the clip fraction exactly 0."""
    from megatron_rl.algorithms import PolicyLoss, PolicyLossConfig

    def rl_samples():
        samples = ref.make_samples(lengths=(7, 12, 5, 20, 9, 3, 14, 11))
        for i, s in enumerate(samples):
            s.fields = {"advantages": [(1.0 if i % 2 else -1.0) * m for m in s.loss_mask]}
        return samples

    loss = PolicyLoss(PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28, log_entropy=False))
    assert loss.computed_fields == {"old_logprobs": "policy"}
    seen = {}
    for n in (1, 4):
        actor, _ = _actor(lr=3e-2, adam_eps=1e-8, clip_grad=0.0)
        steps = []
        real_step = actor.train_step
        actor.train_step = lambda batch, fn: steps.append(real_step(batch, fn)) or steps[-1]
        samples = rl_samples()
        m = actor.train_rl_batch(samples, loss, num_mini_batches=n)
        assert m["mini_batches"] == n and m["num_samples"] == len(samples) and not m["skipped"], m
        assert actor.iteration == n and all("old_logprobs" in s.fields for s in samples)
        assert steps[0]["pg_clipfrac"] == 0.0 and abs(steps[0]["ppo_kl"]) < 1e-7, steps[0]
        seen[n] = m
    assert seen[1]["pg_clipfrac"] == 0.0
    assert seen[4]["pg_clipfrac"] > 0.0 and abs(seen[4]["ppo_kl"]) > 1e-4, seen[4]


# ----------------------------------------------------------------------------------------------
def single_rank(out_dir: str) -> None:
    """World size 1: HF parity, packing, micro-batch equivalence, learning, NaN skip, checkpoint."""
    from megatron_rl.actor import SFTLoss

    samples = ref.make_samples()
    results = {}

    # HF parity of logprobs/entropy on packed micro-batches (30-token budget -> several samples
    # per micro-batch), loaded from an HF directory through the lazy safetensors reader.
    cfg = ref.tiny_config()
    hf_dir = os.path.join(out_dir, "hf")
    ref.tiny_model(cfg, seed=2).save_pretrained(hf_dir)
    actor, hf = _actor(source=hf_dir)
    packed = check_logprobs(actor, hf, samples)
    # packed == unpacked: one sample per micro-batch (budget below any two samples)
    alone = [actor.compute_logprobs([s])[0] for s in samples]
    for i, (a, b) in enumerate(zip(packed, alone)):
        assert (a - b).abs().max().item() < 1e-6, f"sample {i}: packed != alone"

    # megatron's local attention (block-diagonal mask + RoPE restarted per packed sample)
    actor, hf = _actor(attention_backend="local")
    assert actor.packed_mode == "mask"
    check_logprobs(actor, hf, samples)
    check_sft_step(actor, hf, samples)

    # One SFT step: 1 micro-batch, several packed ones, fixed-size ones, with activation
    # recomputation, with the output-layer chunks kept instead of recomputed -> the same gradient and update.
    for overrides in (dict(max_tokens_per_gpu=4096), dict(max_tokens_per_gpu=14),
                      dict(max_tokens_per_gpu=None, micro_batch_size=1),
                      dict(recompute_granularity="full"), dict(recompute_granularity="selective"),
                      dict(recompute_logprob_chunks=False)):
        actor, hf = _actor(**overrides)
        m, w = check_sft_step(actor, hf, samples)
        if overrides.get("max_tokens_per_gpu") == 4096:
            assert m["num_micro_batches"] == 1
            results["dp1_weights"] = w
        elif "recompute_granularity" not in overrides and "recompute_logprob_chunks" not in overrides:
            assert m["num_micro_batches"] >= 3, m

    # seq_mean aggregation with per-sample weights (0 drops a sample)
    weighted = ref.make_samples(weights=[1.0, 0.5, 0.0, 2.0, 1.0, 1.0])
    actor, hf = _actor(loss_aggregation="seq_mean")
    check_sft_step(actor, hf, weighted, aggregation="seq_mean")

    # NaN loss: skipped, nothing changes; the next good step equals a fresh actor's first step.
    actor, hf = _actor()
    before = _export(actor)
    steps_before = actor.scheduler.num_steps
    m = actor.train_step(samples, NaNLoss())
    assert m["skipped"] is True and math.isnan(m["loss"]), m
    assert actor.scheduler.num_steps == steps_before
    after = _export(actor)
    assert all(torch.equal(before[k], after[k]) for k in before), "weights changed on a skipped step"
    check_sft_step(actor, hf, samples)

    # A learning curve: Adam steps on a fixed batch keep lowering the loss.
    actor, _ = _actor(lr=3e-3, adam_eps=1e-8, clip_grad=1.0)
    losses = [actor.train_step(samples, SFTLoss())["loss"] for _ in range(6)]
    assert all(b < a for a, b in zip(losses, losses[1:])), f"loss did not decrease: {losses}"
    assert losses[-1] < losses[0] - 0.3, losses

    check_ppo_mini_batches()
    check_fused_vs_foreach_adam()

    # Checkpoint: 2 steps, save, record what comes next (eval loss, RNG draw, third step).
    actor, _ = _actor(lr=3e-3, adam_eps=1e-8, clip_grad=1.0, lr_warmup_steps=2, lr_decay_steps=20,
                      lr_decay_style="cosine", min_lr=1e-4)
    for _ in range(2):
        actor.train_step(samples, SFTLoss())
    ckpt = os.path.join(out_dir, "ckpt")
    actor.save(ckpt, extra={"data_position": 17})
    results["ckpt_eval_loss"] = _eval_loss(actor, samples)
    results["ckpt_rand"] = torch.rand(4)
    m3 = actor.train_step(samples, SFTLoss())
    results["ckpt_step3"] = {k: m3[k] for k in ("loss", "grad_norm", "lr")}
    results["ckpt_step3_weights"] = _export(actor)
    torch.save(results, os.path.join(out_dir, "single_rank.pt"))


def two_ranks(out_dir: str) -> None:
    """World size 2: TP=2, DP=2, PP=2 (tied), VPP, and the TP=1 checkpoint reloaded at TP=2."""
    from megatron_rl.actor import SFTLoss

    samples = ref.make_samples()
    single = torch.load(os.path.join(out_dir, "single_rank.pt"), weights_only=False)

    # TP=2
    actor, hf = _actor(tp=2)
    check_logprobs(actor, hf, samples)
    check_sft_step(actor, hf, samples)

    # TP=2 of the hybrid: the GDN output norm's gain is replicated but each rank applies it to its own value heads;
    # its gradient is summed over TP, so the step equals HF's and the replicas stay equal
    actor, hf = _hybrid_actor(tp=2)
    check_sft_step(actor, hf, samples)
    for name, p in actor.model[0].module.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            copies = [torch.empty_like(p.data) for _ in range(2)]
            dist.all_gather(copies, p.data.contiguous())
            assert torch.equal(copies[0], copies[1]), f"TP replicas of {name} differ after a step"

    # DP=2: the batch is split over ranks; the update equals DP=1's
    actor, hf = _actor(tp=1)
    assert actor.dp_size == 2
    check_logprobs(actor, hf, samples)
    _, w = check_sft_step(actor, hf, samples)
    d = _max_diff(w, single["dp1_weights"])
    assert d < 1e-6, f"DP=2 update differs from DP=1 by {d}"

    # DP=2 with overlapped grad reduction: megatron counts grad hooks per parameter from the
    # first batch; batches with other micro-batch/chunk structures must still sync correctly.
    other = ref.make_samples(lengths=(40, 3, 17, 9), seed=5)
    norms = {}
    for overlap in (False, True):
        actor, _ = _actor(tp=1, overlap_grad_reduce=overlap, max_tokens_per_gpu=14)
        norms[overlap] = [actor.train_step(b, SFTLoss())["grad_norm"] for b in (samples, other, samples)]
    assert norms[True] == norms[False], norms

    # PP=2 with tied embeddings (the last stage holds a synchronised copy of the embedding)
    actor, hf = _actor(pp=2, tied=True)
    check_logprobs(actor, hf, samples)
    check_sft_step(actor, hf, samples)

    # Interleaved pipeline (PP=2 x VPP=2, 4 layers), several micro-batches
    actor, hf = _actor(pp=2, vpp=2, layers=4, max_tokens_per_gpu=14)
    check_logprobs(actor, hf, samples)
    m, _ = check_sft_step(actor, hf, samples)
    assert m["num_micro_batches"] % 2 == 0

    # Checkpoint saved at TP=1 -> TP=2: same eval loss, RNG, iteration, extra, next step
    actor, _ = _actor(tp=2, lr=3e-3, adam_eps=1e-8, clip_grad=1.0, lr_warmup_steps=2, lr_decay_steps=20,
                      lr_decay_style="cosine", min_lr=1e-4)
    extra = actor.load(os.path.join(out_dir, "ckpt"))
    assert extra["data_position"] == 17 and extra["iteration"] == 2, extra
    assert actor.iteration == 2
    assert torch.equal(torch.rand(4), single["ckpt_rand"]), "RNG state not restored"
    loss = _eval_loss(actor, samples)
    assert abs(loss - single["ckpt_eval_loss"]) < 1e-6, (loss, single["ckpt_eval_loss"])
    m3 = actor.train_step(samples, SFTLoss())
    for k, v in single["ckpt_step3"].items():
        assert abs(m3[k] - v) < 1e-6 * max(1.0, abs(v)), f"{k}: {m3[k]} after reload vs {v}"
    # Adam's update lr*m/(sqrt(v)+eps) turns fp32 rounding differences of near-zero gradients between
    # TP=1 and TP=2 into weight differences of up to ~1e-6 (seen: 1.3e-6 on AVX-512 hosts, foreach and
    # fused alike). A lost, stale or misaligned optimizer state moves weights by O(lr) = 3e-3.
    d = _max_diff(_export(actor), single["ckpt_step3_weights"])
    assert d < 1e-5, f"third step after reload differs by {d} (optimizer state not restored?)"
    if dist.get_rank() == 0:
        torch.save({"ok": True}, os.path.join(out_dir, "two_ranks.pt"))
