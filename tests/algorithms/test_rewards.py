"""Per-turn score (eq. 2), PrimeEcho and pluggable reward functions: hand-computed numbers."""
import math

import pytest

from megatron_rl.algorithms.rewards import (InfraVerdictError, PrimeEchoConfig, TurnOutcome, checked_turn_score,
                                            eq2_turn_reward, load_callable, primeecho_reward, resolve_turn_reward)
from verifier.types import Category, RewardParams, VerifyResult


def outcome(category, q=0.0, speedup=None, turn=1):
    return TurnOutcome(task=None, turn=turn, response_text="",
                       verdict=VerifyResult(task_id="t", category=category, q=q, speedup=speedup))


@pytest.mark.parametrize("category,q,speedup,expected", [
    (Category.PASS, 1.0, 2.0, 1.5),            # 1 + 0.5·min(max(2-1, 0), 4)
    (Category.PASS, 1.0, 10.0, 3.0),           # speedup bonus capped at ν_max = 4
    (Category.PASS, 1.0, 0.5, 1.0),            # slower than eager: no bonus, still correct
    (Category.PASS, 1.0, None, 1.0),
    (Category.CORRECTNESS_ERROR, 0.6, None, -0.2),   # -0.5 + 0.5·0.6
    (Category.CORRECTNESS_ERROR, 0.0, None, -1.0),
    (Category.COMPILE_ERROR, 0.0, None, -1.0),
    (Category.FORMAT_ERROR, 0.0, None, -1.0),
    (Category.CHEATING, 1.0, 3.0, -1.0),       # forbidden fallback: -1 whatever q
    (Category.TIMEOUT, 0.0, None, -1.0),
    (Category.RUNTIME_ERROR, 0.0, None, -1.0),
])
def test_eq2_turn_scores(category, q, speedup, expected):
    assert eq2_turn_reward(outcome(category, q, speedup)) == pytest.approx(expected, abs=1e-12)
    fn = resolve_turn_reward(None)
    assert checked_turn_score(fn, outcome(category, q, speedup)) == pytest.approx(expected, abs=1e-12)


def test_eq2_uses_given_params():
    p = RewardParams(lam=1.0, nu_max=2.0)
    assert eq2_turn_reward(outcome(Category.PASS, 1.0, 5.0), p) == pytest.approx(3.0)   # 1 + 1·min(4, 2)


def test_infra_is_never_scored():
    with pytest.raises(InfraVerdictError, match="re-queue"):
        eq2_turn_reward(outcome(Category.INFRA))
    # even a custom reward fn that would happily score it is not called
    with pytest.raises(InfraVerdictError):
        checked_turn_score(lambda o: 1.0, outcome(Category.INFRA))


def test_reward_fn_output_is_checked():
    with pytest.raises(ValueError, match="turn 2"):
        checked_turn_score(lambda o: float("nan"), outcome(Category.PASS, 1.0, turn=2))
    with pytest.raises(ValueError, match="returned"):
        checked_turn_score(lambda o: "1.0", outcome(Category.PASS, 1.0))


@pytest.mark.parametrize("scores,passed,expected", [
    ([1.5], [True], 1.65),                               # 0.75·1.5 + 0.25·1.5 + b(1)=0.15
    ([-1.0, 1.5], [False, True], -0.295),                # -0.75 + 0.375 + b(2)=0.08
    ([-0.2, -1.0, 1.2], [False, False, True], 0.15),     # -0.15 + 0.3 + 0 (no bonus on turn 3)
    ([-1.0, -0.5, -0.2], [False, False, False], -0.8),   # -0.75 + 0.25·(-0.2)
])
def test_primeecho_hand_numbers(scores, passed, expected):
    assert primeecho_reward(scores, passed) == pytest.approx(expected, abs=1e-12)


def test_primeecho_config_and_first_turn_anchor():
    cfg = PrimeEchoConfig(alpha=1.0, early_bonus={})
    assert primeecho_reward([-1.0, 3.0], [False, True], cfg) == -1.0     # α = 1: only the first turn counts
    cfg = PrimeEchoConfig(alpha=0.5, early_bonus={1: 0.2, 2: 0.1, 3: 0.05})
    assert primeecho_reward([-1.0, -1.0, 1.0], [False, False, True], cfg) == pytest.approx(0.05)
    # a deliberately weak first turn that is repaired later earns less than a first-turn pass
    assert primeecho_reward([-1.0, 1.5], [False, True]) < primeecho_reward([1.5], [True])


def test_primeecho_rejects_bad_input():
    with pytest.raises(ValueError, match="turn 2"):
        primeecho_reward([1.0, math.nan], [False, False])
    with pytest.raises(ValueError):
        primeecho_reward([], [])
    with pytest.raises(ValueError):
        primeecho_reward([1.0], [True, False])
    with pytest.raises(ValueError):
        PrimeEchoConfig(alpha=1.5)


def test_load_callable_by_import_path(tmp_path, monkeypatch):
    mod = tmp_path / "toy_reward_mod.py"
    mod.write_text("def reward(outcome):\n    return 2.0 if 'magic' in outcome.response_text else -1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_turn_reward("toy_reward_mod:reward")
    o = outcome(Category.CORRECTNESS_ERROR, 0.5)
    o.response_text = "the magic word"
    assert checked_turn_score(fn, o) == 2.0
    assert resolve_turn_reward("megatron_rl.algorithms.rewards:eq2_turn_reward") is eq2_turn_reward
    assert load_callable("math:sqrt")(9.0) == 3.0


@pytest.mark.parametrize("path,exc,msg", [
    ("math", ValueError, "import path"),
    ("no_such_module_xyz:f", ImportError, "no_such_module_xyz"),
    ("math:no_such_fn", AttributeError, "no_such_fn"),
    ("math:pi", TypeError, "non-callable"),
])
def test_load_callable_errors(path, exc, msg):
    with pytest.raises(exc, match=msg):
        load_callable(path)
