"""The RL math of the MusaCoder recipe. Pure torch/numpy: no Ray, no engines, no actor.

- ``rewards``: per-turn score (eq. 2) and PrimeEcho trajectory reward; pluggable reward fns.
- ``advantages``: GRPO / Dr.GRPO group advantages and DAPO dynamic sampling.
- ``policy_loss``: PPO-clip with clip-higher, KL loss, entropy, TIS, MirrorPop (the actor's loss fn).
- ``kl``: k1/k2/k3 KL estimators.
- ``mirrorpop``: off-policy sequence masking by mean |log ρ|.
- ``bdr``: Buffered Dynamic Retry of all-failed prompts.
"""
from .advantages import (AdvantageConfig, DynamicSampler, DynamicSamplingStats, RewardGroup, batch_advantages,
                         fill_batch, group_advantages, has_reward_variance, validate_rewards)
from .bdr import BDRConfig, BufferedDynamicRetry, FailedPrompt, pick_failing_sample
from .kl import KL_ESTIMATORS, kl_estimate
from .mirrorpop import SequenceMask, mirrorpop_keep, mirrorpop_mask, sequence_drift
from .policy_loss import PolicyLoss, PolicyLossConfig, ppo_clip_losses, tis_weights
from .rewards import (InfraVerdictError, PrimeEchoConfig, TurnOutcome, checked_turn_score, eq2_turn_reward,
                      load_callable, primeecho_reward, resolve_turn_reward)

__all__ = [
    "AdvantageConfig", "DynamicSampler", "DynamicSamplingStats", "RewardGroup", "batch_advantages", "fill_batch",
    "group_advantages", "has_reward_variance", "validate_rewards",
    "BDRConfig", "BufferedDynamicRetry", "FailedPrompt", "pick_failing_sample",
    "KL_ESTIMATORS", "kl_estimate",
    "SequenceMask", "mirrorpop_keep", "mirrorpop_mask", "sequence_drift",
    "PolicyLoss", "PolicyLossConfig", "ppo_clip_losses", "tis_weights",
    "InfraVerdictError", "PrimeEchoConfig", "TurnOutcome", "checked_turn_score", "eq2_turn_reward",
    "load_callable", "primeecho_reward", "resolve_turn_reward",
]
