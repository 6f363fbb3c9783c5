"""The RL policy loss: PPO-clip with asymmetric clip-higher, optional KL-to-reference, entropy bonus,
truncated importance sampling (TIS) and MirrorPop sequence masking.

Per trained token t (``r_t = π_θ/π_old``, ``A`` the sequence's advantage):

    pg_t   = max(−A·r_t, −A·clip(r_t, 1 − ε_low, 1 + ε_high))          (DAPO clip-higher)
    pg_t  *= min(π_old/π_rollout, C)                                      (TIS, optional, no grad)
    loss_t = pg_t + β·KL_est(π_θ ‖ π_ref) − c_H·H_t                       (optional terms)
    loss_t *= M_seq                                                       (MirrorPop, optional)

and the micro-batch loss is ``Σ token_weight · loss_mask · loss_t``; the actor chooses ``token_weight``
so that the global sum is a token-mean or a sequence-mean. ``log r_t`` is clamped to [−20, 20]
before ``exp`` so an extreme ratio cannot produce inf·0 = NaN.

:class:`PolicyLoss` implements the actor's loss interface (``needs_entropy``, ``__call__(ctx) ->
(loss, metrics)``, metrics as ``name -> (sum, count)``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .kl import KL_ESTIMATORS, kl_estimate
from .mirrorpop import MODES as MIRRORPOP_MODES
from .mirrorpop import mirrorpop_mask

LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28               # DAPO's clip-higher; the paper's ε values are unpublished
    advantages_field: str = "advantages"
    old_logprobs_field: str = "old_logprobs"  # "rollout_logprobs" = use the engine's logprobs as π_old
    rollout_logprobs_field: str = "rollout_logprobs"
    ref_logprobs_field: str = "ref_logprobs"
    kl_loss_coef: float = 0.0                 # β; 0 disables the KL term (no ref logprobs needed)
    kl_estimator: str = "k3"                  # k1 | k2 | k3 (= low_var_kl)
    entropy_coef: float = 0.0                 # c_H; entropy is still logged when the actor gives it
    log_entropy: bool = True                  # ask the actor for entropy just for the metric
    use_tis: bool = False
    tis_cap: float = 2.0                      # C in min(π_old/π_rollout, C)
    mirrorpop_delta: float | None = None      # δ; None disables MirrorPop
    mirrorpop_mode: str = "abs"               # "abs" (MirrorPop) | "signed" (the OPSM-style ablation)

    def __post_init__(self):
        if not (0.0 <= self.eps_clip_low < 1.0) or not (self.eps_clip_high >= 0.0):
            raise ValueError(f"need 0 <= eps_clip_low < 1 and eps_clip_high >= 0, got "
                             f"{self.eps_clip_low}, {self.eps_clip_high}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; expected one of {KL_ESTIMATORS}")
        if self.kl_loss_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_loss_coef and entropy_coef must be >= 0")
        if self.use_tis and not (self.tis_cap > 0):
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.mirrorpop_delta is not None and not (self.mirrorpop_delta >= 0):
            raise ValueError(f"mirrorpop_delta must be >= 0, got {self.mirrorpop_delta}")
        if self.mirrorpop_mode not in MIRRORPOP_MODES:
            raise ValueError(f"unknown mirrorpop_mode {self.mirrorpop_mode!r}; expected one of {MIRRORPOP_MODES}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PolicyLossConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown policy-loss option(s) {unknown}; valid: {sorted(names)}")
        return cls(**d)


def ppo_clip_losses(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate. Returns (pg_loss, ratio, clipped) with ``clipped`` = the clip was binding."""
    log_ratio = torch.clamp(logprobs - old_logprobs.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped_loss), ratio, clipped_loss > unclipped


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weight ``min(exp(old − rollout), C)``; no gradient flows through it."""
    log_w = torch.clamp((old_logprobs - rollout_logprobs).detach(), max=LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_w), max=cap)


class PolicyLoss:
    """PPO-clip policy loss as the actor's loss callable."""

    def __init__(self, cfg: PolicyLossConfig = PolicyLossConfig()):
        self.cfg = cfg

    @property
    def needs_entropy(self) -> bool:
        return self.cfg.entropy_coef > 0 or self.cfg.log_entropy

    @property
    def required_fields(self) -> tuple[str, ...]:
        """The ``TrainSample.fields`` this loss reads (the actor checks them up front)."""
        cfg = self.cfg
        names = [cfg.advantages_field, cfg.old_logprobs_field]
        if cfg.use_tis or cfg.mirrorpop_delta is not None:
            names.append(cfg.rollout_logprobs_field)
        if cfg.kl_loss_coef > 0:
            names.append(cfg.ref_logprobs_field)
        return tuple(dict.fromkeys(names))

    @property
    def computed_fields(self) -> dict[str, str]:
        """The required fields the train ranks fill in themselves, and from which weights: ``"policy"`` (π_old,
        the weights before this batch's first optimizer step) or ``"reference"`` (π_ref, the initial policy).
        The rollout supplies the rest (advantages, rollout logprobs)."""
        cfg = self.cfg
        out = {}
        if cfg.old_logprobs_field != cfg.rollout_logprobs_field:
            out[cfg.old_logprobs_field] = "policy"
        if cfg.kl_loss_coef > 0:
            out[cfg.ref_logprobs_field] = "reference"
        return out

    def _field(self, ctx, name: str, n: int) -> torch.Tensor:
        fields = ctx.fields or {}
        if name not in fields:
            raise KeyError(f"policy loss needs per-token field {name!r}; the batch has {sorted(fields)}")
        t = fields[name]
        if t.shape != (n,):
            raise ValueError(f"field {name!r} has shape {tuple(t.shape)}, expected ({n},) like logprobs")
        return t

    def _check_finite(self, ctx, name: str, t: torch.Tensor, mask: torch.Tensor) -> None:
        bad = mask.bool() & ~torch.isfinite(t)
        if bad.any():
            if ctx.sample_index is not None:
                where = f"samples {sorted(set(ctx.sample_index[bad].tolist()))[:10]}"
            else:
                where = f"packed positions {bad.nonzero().flatten().tolist()[:10]}"
            raise ValueError(f"field {name!r} is NaN/inf on trained tokens of {where}")

    def __call__(self, ctx) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        cfg = self.cfg
        logprobs = ctx.logprobs
        n = logprobs.shape[0]
        if logprobs.dim() != 1:
            raise ValueError(f"logprobs must be packed 1-D, got shape {tuple(logprobs.shape)}")
        for name in ("loss_mask", "token_weight", "sample_index"):
            t = getattr(ctx, name)
            if t is None and name == "sample_index" and cfg.mirrorpop_delta is None:
                continue
            if t is None or t.shape != (n,):
                got = None if t is None else tuple(t.shape)
                raise ValueError(f"{name} has shape {got} but logprobs has ({n},)"
                                 + (" (MirrorPop needs sample_index)" if t is None else ""))
        mask = ctx.loss_mask.to(logprobs.dtype)
        self._check_finite(ctx, "logprobs", logprobs.detach(), mask)

        advantages = self._field(ctx, cfg.advantages_field, n).to(logprobs.dtype)
        old = self._field(ctx, cfg.old_logprobs_field, n).to(logprobs.dtype)
        self._check_finite(ctx, cfg.advantages_field, advantages, mask)
        self._check_finite(ctx, cfg.old_logprobs_field, old, mask)
        zeros = torch.zeros_like(logprobs)
        # masked positions (prompt, feedback) may carry placeholders: never let them reach the math
        advantages = torch.where(mask > 0, advantages, zeros)
        old = torch.where(mask > 0, old, logprobs.detach())

        rollout = None
        if cfg.use_tis or cfg.mirrorpop_delta is not None or cfg.rollout_logprobs_field in (ctx.fields or {}):
            rollout = self._field(ctx, cfg.rollout_logprobs_field, n).to(logprobs.dtype)
            self._check_finite(ctx, cfg.rollout_logprobs_field, rollout, mask)
            rollout = torch.where(mask > 0, rollout, old)

        pg, ratio, clipped = ppo_clip_losses(logprobs, old, advantages, cfg.eps_clip_low, cfg.eps_clip_high)
        metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if cfg.use_tis:
            w = tis_weights(old, rollout, cfg.tis_cap)
            pg = pg * w
            metrics["tis_weight"] = _masked_sum(w, mask)
            metrics["tis_clipfrac"] = _masked_sum((w >= cfg.tis_cap).to(mask.dtype), mask)
        per_token = pg

        if cfg.kl_loss_coef > 0:
            ref = self._field(ctx, cfg.ref_logprobs_field, n).to(logprobs.dtype)
            self._check_finite(ctx, cfg.ref_logprobs_field, ref, mask)
            ref = torch.where(mask > 0, ref, logprobs.detach())
            kl = kl_estimate(logprobs, ref, cfg.kl_estimator).to(logprobs.dtype)
            per_token = per_token + cfg.kl_loss_coef * kl
            metrics["kl_loss"] = _masked_sum(kl.detach(), mask)

        entropy = getattr(ctx, "entropy", None)
        if cfg.entropy_coef > 0:
            if entropy is None:
                raise ValueError("entropy_coef > 0 but the actor passed no entropy (needs_entropy=True)")
            per_token = per_token - cfg.entropy_coef * torch.where(mask > 0, entropy, zeros)
        if entropy is not None:
            metrics["entropy"] = _masked_sum(entropy.detach(), mask)

        keep = mask
        if cfg.mirrorpop_delta is not None:
            # ρ = π_train/π_rollout with π_train the training engine's logprobs before the update
            train_lp = old if cfg.old_logprobs_field != cfg.rollout_logprobs_field else logprobs.detach()
            mp = mirrorpop_mask(train_lp - rollout, mask, ctx.sample_index, cfg.mirrorpop_delta,
                                cfg.mirrorpop_mode)
            keep = mask * mp.token_keep.to(mask.dtype)
            metrics["mirrorpop_masked_frac"] = (
                torch.tensor(float(mp.num_masked), dtype=torch.float64, device=mask.device),
                torch.tensor(float(mp.num_sequences), dtype=torch.float64, device=mask.device))

        per_token = torch.where(keep > 0, per_token, zeros)
        loss = (ctx.token_weight.to(logprobs.dtype) * keep * per_token).sum()

        metrics["pg_loss"] = _masked_sum(pg.detach(), keep)
        metrics["pg_clipfrac"] = _masked_sum(clipped.to(mask.dtype), keep)
        metrics["ppo_kl"] = _masked_sum((old - logprobs).detach(), mask)
        metrics["ratio"] = _masked_sum(ratio.detach(), mask)
        if rollout is not None:
            metrics["train_rollout_abs_logratio"] = _masked_sum((old - rollout).abs(), mask)
        return loss, metrics


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.to(torch.float64)
    v = torch.where(m > 0, values.detach().to(torch.float64), torch.zeros_like(m))
    return (v * m).sum(), m.sum()
