"""megatron_rl.evaluate's figures: the unbiased Pass@k against hand-computed numbers, and the paper's table."""
import math

import pytest

from megatron_rl.evaluate import SampleOutcome, markdown_report, pass_at_k, summarize, table


def test_pass_at_k_matches_hand_computed_values():
    # 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 1, 1) == pytest.approx(1 / 8)
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(10, 2, 3) == pytest.approx(1 - 56 / 120)         # C(8,3)=56, C(10,3)=120
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)            # C(3,2)=3, C(5,2)=10
    assert pass_at_k(16, 4, 8) == pytest.approx(1 - math.comb(12, 8) / math.comb(16, 8))
    assert pass_at_k(200, 13, 100) == pytest.approx(1 - math.comb(187, 100) / math.comb(200, 100))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def _o(task, level, passed, speedup=None, family="elementwise", first=None, compile_=None):
    return SampleOutcome(task_id=task, level=level, family=family, passed=passed,
                         first_turn_passed=passed if first is None else first, speedup=speedup,
                         speedup_compile=compile_, turns=1, category="pass" if passed else "correctness_error")


def test_table_per_level_and_overall_weighted_by_tasks():
    outs = ([_o("a", 1, True, 2.0), _o("a", 1, False), _o("a", 1, True, 1.05), _o("a", 1, False)] +
            [_o("b", 1, False)] * 4 +
            [_o("c", 2, True, 0.5, family="reduction", first=False), _o("c", 2, True, 1.2, family="reduction"),
             _o("c", 2, True, 3.0, family="reduction"), _o("c", 2, True, 1.0, family="reduction")])
    s = summarize(outs, [1, 4])
    l1, l2, ov = s["levels"]["1"], s["levels"]["2"], s["overall"]
    assert l1["tasks"] == 2 and l1["pass_at_4"] == pytest.approx(0.5) and l1["pass_at_1"] == pytest.approx(0.25)
    assert l1["avg_at_n"] == pytest.approx(0.25) and l1["faster_eager"] == pytest.approx(1 / 8)
    assert l2["pass_at_4"] == 1.0 and l2["avg_at_n"] == 1.0 and l2["faster_eager"] == pytest.approx(0.5)
    assert l2["first_turn_avg_at_n"] == pytest.approx(0.75)
    assert ov["pass_at_4"] == pytest.approx(2 / 3) and ov["avg_at_n"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert ov["speedup_median"] == pytest.approx((1.05 + 1.2) / 2) and ov["speedup_mean"] == pytest.approx(8.75 / 6)
    assert ov["faster_compile"] is None                      # torch.compile was not timed
    assert s["families"]["reduction"]["tasks"] == 1
    text = markdown_report({"model": "m", "label": None, "tasks_dir": "t", "scored_tasks": 3, "tasks": 4,
                            "backend": "cpu", "samples": 4, "temperature": 0.7, "turns": 1, "pass_k": [1, 4],
                            "unscored": {"d": "infra: no"}, **s})
    assert "| L1 | 2 | 25.0 | 50.0 | 25.0 | 12.5 | - |" in text and "| Overall | 3 |" in text and "- d: infra" in text
    compiled = table([_o("x", 1, True, 2.0, compile_=1.5), _o("x", 1, False)], [1])
    assert compiled["faster_compile"] == pytest.approx(0.5)
