"""PPO-clip with clip-higher, KL estimators, TIS, entropy, MirrorPop inside the loss: hand numbers."""
import math

import pytest
import torch

from megatron_rl.algorithms.kl import kl_estimate
from megatron_rl.algorithms.policy_loss import PolicyLoss, PolicyLossConfig, ppo_clip_losses, tis_weights

from megatron_rl.actor.losses import LossContext


def make_ctx(logprobs, fields, mask=None, weight=None, sample_index=None, entropy=None):
    lp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    n = lp.shape[0]
    mask = torch.ones(n, dtype=torch.float64) if mask is None else torch.tensor(mask, dtype=torch.float64)
    weight = (mask / mask.sum()) if weight is None else torch.tensor(weight, dtype=torch.float64)
    idx = torch.zeros(n, dtype=torch.long) if sample_index is None else torch.tensor(sample_index)
    f = {k: torch.tensor(v, dtype=torch.float64) for k, v in fields.items()}
    ent = None if entropy is None else torch.tensor(entropy, dtype=torch.float64)
    return LossContext(logprobs=lp, entropy=ent, loss_mask=mask, token_weight=weight, fields=f, sample_index=idx)


def metric(metrics, name):
    s, c = metrics[name]
    return float(s) / float(c)


# ratios on each side of both bounds (ε_low = 0.2 -> 0.8, ε_high = 0.28 -> 1.28), A = +1 and -1
RATIOS = [1.5, 1.1, 0.5, 1.5, 0.5, 1.1]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
# A>0: r=1.5 clipped to 1.28; r=1.1 inside; r=0.5 below 0.8 but max() keeps the unclipped -0.5
# A<0: r=1.5 unclipped 1.5 (pessimistic max); r=0.5 clipped to 0.8; r=1.1 inside
EXPECTED_TOKEN_LOSS = [-1.28, -1.1, -0.5, 1.5, 0.8, 1.1]
EXPECTED_CLIPPED = [True, False, False, False, True, False]


def test_ppo_clip_higher_hand_numbers():
    old = [-1.0, -2.0, -0.5, -1.0, -3.0, -0.7]
    lp = [o + math.log(r) for o, r in zip(old, RATIOS)]
    ctx = make_ctx(lp, {"advantages": ADVS, "old_logprobs": old})
    loss, metrics = PolicyLoss(PolicyLossConfig(log_entropy=False))(ctx)
    assert float(loss) == pytest.approx(sum(EXPECTED_TOKEN_LOSS) / 6, abs=1e-12)   # 0.52 / 6
    assert metric(metrics, "pg_clipfrac") == pytest.approx(2 / 6)
    loss.backward()
    # gradient of -A·r w.r.t. log π is -A·r where the unclipped branch is active, 0 where clipped
    expected_grad = [0.0, -1.1 / 6, -0.5 / 6, 1.5 / 6, 0.0, 1.1 / 6]
    assert ctx.logprobs.grad.tolist() == pytest.approx(expected_grad, abs=1e-12)

    pg, ratio, clipped = ppo_clip_losses(torch.tensor(lp, dtype=torch.float64), torch.tensor(old, dtype=torch.float64),
                                         torch.tensor(ADVS, dtype=torch.float64), 0.2, 0.28)
    assert pg.tolist() == pytest.approx(EXPECTED_TOKEN_LOSS, abs=1e-12)
    assert clipped.tolist() == EXPECTED_CLIPPED
    assert ratio.tolist() == pytest.approx(RATIOS, abs=1e-12)


def test_symmetric_clip_differs_from_clip_higher():
    old = [-1.0]
    lp = [-1.0 + math.log(1.25)]
    sym = PolicyLoss(PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.2, log_entropy=False))
    hi = PolicyLoss(PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28, log_entropy=False))
    ctx = make_ctx(lp, {"advantages": [1.0], "old_logprobs": old})
    assert float(sym(ctx)[0]) == pytest.approx(-1.2)     # clipped at 1 + 0.2
    assert float(hi(ctx)[0]) == pytest.approx(-1.25)     # inside 1 + 0.28


def test_masked_tokens_and_sequence_mean_weights():
    # token 2 is a prompt token holding garbage: it must not reach the loss or produce NaN
    old = [-1.0, -1.0, float("nan"), -1.0, -1.0, -1.0]
    lp = [-1.0 + math.log(1.1), -1.0, -5.0, -1.0 + math.log(1.1), -1.0, -1.0]
    mask = [1, 1, 0, 1, 1, 1]
    # seq-mean over 2 sequences: seq 0 = tokens 0-1 (2 trained), seq 1 = tokens 3-5 (3 trained)
    weight = [1 / (2 * 2), 1 / (2 * 2), 0.0, 1 / (2 * 3), 1 / (2 * 3), 1 / (2 * 3)]
    ctx = make_ctx(lp, {"advantages": [1.0, 1.0, float("nan"), -2.0, -2.0, -2.0], "old_logprobs": old},
                   mask=mask, weight=weight, sample_index=[0, 0, 0, 1, 1, 1])
    loss, m = PolicyLoss(PolicyLossConfig(log_entropy=False))(ctx)
    seq0 = (-1.1 - 1.0) / 2
    seq1 = (2.2 + 2.0 + 2.0) / 3
    assert float(loss) == pytest.approx((seq0 + seq1) / 2, abs=1e-12)
    assert float(m["pg_loss"][1]) == 5


@pytest.mark.parametrize("kind,expected", [
    ("k1", [0.5, -1.0]),                                            # log π − log π_ref
    ("k2", [0.125, 0.5]),                                           # ½·(log ratio)²
    ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),                   # e^{−lr} + lr − 1
    ("low_var_kl", [0.10653065971263342, 0.7182818284590451]),
])
def test_kl_estimators_hand_numbers(kind, expected):
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    assert kl_estimate(lp, ref, kind).tolist() == pytest.approx(expected, abs=1e-12)


def test_k3_clamp_and_its_gradient():
    lp = torch.tensor([-31.0, 29.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    kl = kl_estimate(lp, ref, "k3")
    # log ratio −30: e^{min(30,20)} − 20 − 1 ≈ 4.85e8 -> 10;  +30: e^{−20} + 20 − 1 ≈ 19 -> 10;  0 -> 0
    assert kl.tolist() == pytest.approx([10.0, 10.0, 0.0])
    kl.sum().backward()
    assert lp.grad.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unknown KL"):
        kl_estimate(lp, ref, "k4")


def test_kl_term_in_loss_and_entropy_bonus():
    lp = [-1.0, -2.0]
    ctx = make_ctx(lp, {"advantages": [0.0, 0.0], "old_logprobs": lp, "ref_logprobs": [-1.5, -1.0]},
                   entropy=[0.7, 0.3])
    loss, m = PolicyLoss(PolicyLossConfig(kl_loss_coef=0.1, kl_estimator="k1", entropy_coef=0.01))(ctx)
    # A = 0 -> pg = 0; + 0.1·mean(k1 = [0.5, -1.0]) − 0.01·mean(H = [0.7, 0.3])
    assert float(loss) == pytest.approx(0.1 * (-0.25) - 0.01 * 0.5, abs=1e-12)
    assert metric(m, "kl_loss") == pytest.approx(-0.25)
    assert metric(m, "entropy") == pytest.approx(0.5)
    with pytest.raises(KeyError, match="ref_logprobs"):
        PolicyLoss(PolicyLossConfig(kl_loss_coef=0.1))(make_ctx(lp, {"advantages": [0, 0], "old_logprobs": lp}))


def test_tis_hand_numbers():
    old = [-1.0, -1.0, -1.0]
    rollout = [-1.5, -0.5, -1.0]
    w = tis_weights(torch.tensor(old), torch.tensor(rollout), cap=1.5)
    assert w.tolist() == pytest.approx([1.5, math.exp(-0.5), 1.0], abs=1e-6)   # min(e^{0.5}=1.6487, 1.5)
    ctx = make_ctx(old, {"advantages": [1.0] * 3, "old_logprobs": old, "rollout_logprobs": rollout})
    loss, m = PolicyLoss(PolicyLossConfig(use_tis=True, tis_cap=1.5, log_entropy=False))(ctx)
    assert float(loss) == pytest.approx(-1.035510219904211, abs=1e-12)     # −(1.5 + e^{−0.5} + 1)/3
    assert metric(m, "tis_clipfrac") == pytest.approx(1 / 3)
    loss.backward()   # the weight carries no gradient: d/dlogπ = −A·r·w = −w/3
    assert ctx.logprobs.grad.tolist() == pytest.approx([-0.5, -math.exp(-0.5) / 3, -1 / 3], abs=1e-12)


def test_mirrorpop_inside_the_loss():
    # seq 0: log ρ = ±0.3 alternating (signed mean 0, |mean| 0.3 > δ) -> masked by MirrorPop only
    # seq 1: small drift 0.05 -> kept
    rollout = [-1.0] * 6
    old = [-0.7, -1.3, -0.7, -1.3, -0.95, -1.05]
    idx = [0, 0, 0, 0, 1, 1]
    fields = {"advantages": [1.0] * 6, "old_logprobs": old, "rollout_logprobs": rollout}
    loss_abs, m_abs = PolicyLoss(PolicyLossConfig(mirrorpop_delta=0.2, log_entropy=False))(
        make_ctx(old, fields, sample_index=idx))
    loss_signed, m_signed = PolicyLoss(PolicyLossConfig(mirrorpop_delta=0.2, mirrorpop_mode="signed",
                                                        log_entropy=False))(make_ctx(old, fields, sample_index=idx))
    # ratio r_t = 1 everywhere (logπ = old), A = 1 -> per-token loss −1, weight 1/6
    assert float(loss_abs) == pytest.approx(-2 / 6, abs=1e-12)      # only seq 1's 2 tokens remain
    assert float(loss_signed) == pytest.approx(-6 / 6, abs=1e-12)   # the cancelling drift hid seq 0
    assert [float(x) for x in m_abs["mirrorpop_masked_frac"]] == [1.0, 2.0]
    assert [float(x) for x in m_signed["mirrorpop_masked_frac"]] == [0.0, 2.0]


def test_on_policy_invariant():
    """rollout == old == current: ratio exactly 1, PPO-KL exactly 0, nothing masked, TIS weight 1."""
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(50, generator=g, dtype=torch.float64) * 5).tolist()
    adv = torch.randn(50, generator=g, dtype=torch.float64).tolist()
    idx = [i // 10 for i in range(50)]
    ctx = make_ctx(lp, {"advantages": adv, "old_logprobs": lp, "rollout_logprobs": lp}, sample_index=idx)
    cfg = PolicyLossConfig(use_tis=True, mirrorpop_delta=0.0, log_entropy=False)
    loss, m = PolicyLoss(cfg)(ctx)
    assert float(m["ratio"][0]) == 50.0 and float(m["ppo_kl"][0]) == 0.0
    assert float(m["pg_clipfrac"][0]) == 0.0 and float(m["mirrorpop_masked_frac"][0]) == 0.0
    assert float(m["tis_weight"][0]) == 50.0
    assert float(loss) == pytest.approx(-sum(adv) / 50, abs=1e-12)


def test_the_loss_declares_what_the_train_ranks_compute():
    """π_old and π_ref are the train ranks' to compute (and only when the loss reads them); the rollout's own
    logprobs as π_old need nothing."""
    assert PolicyLoss(PolicyLossConfig()).computed_fields == {"old_logprobs": "policy"}
    with_kl = PolicyLoss(PolicyLossConfig(kl_loss_coef=0.1, ref_logprobs_field="ref"))
    assert with_kl.computed_fields == {"old_logprobs": "policy", "ref": "reference"}
    assert set(with_kl.computed_fields) <= set(with_kl.required_fields)
    assert PolicyLoss(PolicyLossConfig(old_logprobs_field="rollout_logprobs")).computed_fields == {}


def test_bad_context_is_named():
    lp = [-1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="advantages.*samples \\[4\\]"):
        PolicyLoss()(make_ctx(lp, {"advantages": [1.0, float("nan"), 1.0], "old_logprobs": lp},
                              sample_index=[3, 4, 4]))
    ctx = make_ctx(lp, {"advantages": [1.0, 1.0], "old_logprobs": lp})
    with pytest.raises(ValueError, match="'advantages' has shape"):
        PolicyLoss()(ctx)
    ctx = make_ctx(lp, {"advantages": [1.0] * 3, "old_logprobs": lp})
    ctx.loss_mask = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="loss_mask has shape"):
        PolicyLoss()(ctx)
    with pytest.raises(ValueError, match="unknown policy-loss option"):
        PolicyLossConfig.from_dict({"eps_clip": 0.2})
    with pytest.raises(ValueError, match="entropy"):
        PolicyLoss(PolicyLossConfig(entropy_coef=0.1))(make_ctx(lp, {"advantages": [1.0] * 3, "old_logprobs": lp}))


def test_with_the_actors_token_weights():
    """The actor's seq-mean / token-mean weights turn the summed loss into the right mean."""
    from megatron_rl.actor.losses import token_weights
    from megatron_rl.types import TrainSample

    # two samples, trained tokens 2 and 3; ratio 1 everywhere so per-token loss = −A
    samples = [TrainSample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], fields={}),
               TrainSample(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], fields={})]
    adv = [[0.0, 1.0, 1.0], [0.0, -2.0, -2.0, -2.0]]
    lp = [-1.0] * 7
    for aggregation, expected in (("seq_mean", (-1.0 + 2.0) / 2), ("token_mean", (-2.0 + 6.0) / 5)):
        w = [x for arr in token_weights(samples, aggregation) for x in arr]
        ctx = make_ctx(lp, {"advantages": adv[0] + adv[1], "old_logprobs": lp}, mask=[0, 1, 1, 0, 1, 1, 1],
                       weight=w, sample_index=[0, 0, 0, 1, 1, 1, 1])
        loss, _ = PolicyLoss(PolicyLossConfig(log_entropy=False))(ctx)
        assert float(loss) == pytest.approx(expected, abs=1e-12), aggregation
