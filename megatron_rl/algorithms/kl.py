"""Per-token estimators of KL(π_θ ‖ π_ref) from sampled-token log-probs (Schulman's k1/k2/k3).

With ``log_r = log π_θ(y) − log π_ref(y)`` for y sampled from π_θ:
- ``k1 = log_r``                      unbiased, high variance, can be negative;
- ``k2 = ½·log_r²``                   biased, non-negative;
- ``k3 = exp(−log_r) + log_r − 1``    unbiased, non-negative, low variance ("low_var_kl").

k3 is clamped the way verl does it (slime clamps the output the same way): the inner log-ratio
``−log_r`` to [−20, 20] before ``exp`` so it cannot overflow, and the estimate to [−10, 10]. The clamp
zeroes the gradient of tokens outside those ranges. k1 and k2 are not clamped.
"""
from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate; same shape as the inputs (float32 or wider)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"KL: logprobs {tuple(logprobs.shape)} vs ref_logprobs {tuple(ref_logprobs.shape)}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    log_r = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    neg = torch.clamp(-log_r, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(neg) - neg - 1.0, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)
