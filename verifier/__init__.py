"""Verifier farm: compiles, checks and times model-written kernels against PyTorch references.

Standalone: imports nothing from megatron_rl and works without Ray (Ray only wraps the farm).
"""
from .types import Category, RewardParams, VerifyResult, reward_eq2

__all__ = ["Category", "RewardParams", "VerifyResult", "reward_eq2"]
