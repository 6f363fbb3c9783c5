"""Metrics against numbers worked out by hand."""
import math

import pytest

from verifier.metrics import format_table, geometric_mean, pass_at_k, summarize


def row(task, level, cat, s=None, sc=None, stage=None):
    r = {"task_id": task, "level": level, "category": cat, "speedup": s, "speedup_compile": sc}
    if stage:
        r["details"] = {"farm_stage": stage}
    return r


ROWS = [
    row("A", 1, "pass", 2.0, stage="device"), row("A", 1, "pass", 0.5, stage="device"),
    row("A", 1, "compile_error", stage="compile"), row("A", 1, "correctness_error", stage="device"),
    row("B", 1, "pass", 1.05), row("B", 1, "runtime_error"), row("B", 1, "format_error", stage="precheck"),
    row("B", 1, "infra", stage="device"),
    row("C", 2, "pass", 1.2, sc=0.9, stage="device"), row("C", 2, "cheating", stage="device"),
]


def test_pass_at_k_estimator():
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert pass_at_k(3, 1, 2) == pytest.approx(1 - 1 / 3)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(2, 1, 2) == 1.0  # n - c < k: every k-subset holds a pass
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_level_summary_by_hand():
    s = summarize(ROWS, ks=(1, 2), ps=(1.0, 1.1))
    l1 = s["level1"]
    assert (l1.n_tasks, l1.n_samples, l1.n_infra) == (2, 7, 1)
    assert l1.compile_rate == pytest.approx(5 / 7)
    assert l1.correct_rate == pytest.approx(3 / 7)
    assert l1.pass_at_k[1] == pytest.approx((0.5 + 1 / 3) / 2)
    assert l1.pass_at_k[2] == pytest.approx((5 / 6 + 2 / 3) / 2)
    assert l1.avg_at_k[1] == pytest.approx((0.5 + 1 / 3) / 2)
    assert l1.fast_p["fast_1.0"] == pytest.approx((1 / 4 + 1 / 3) / 2)
    assert l1.fast_p["fast_1.1"] == pytest.approx((1 / 4 + 0) / 2)
    assert l1.geomean_speedup == pytest.approx(1.05 ** (1 / 3))
    assert l1.fast_p_compile == {} and l1.geomean_speedup_compile is None

    l2 = s["level2"]
    assert l2.compile_rate == 1.0 and l2.correct_rate == 0.5
    assert l2.pass_at_k[1] == 0.5 and l2.pass_at_k[2] == 1.0
    assert l2.fast_p == {"fast_1.0": 0.5, "fast_1.1": 0.5}
    assert l2.fast_p_compile == {"fast_1.0": 0.0, "fast_1.1": 0.0}
    assert l2.geomean_speedup_compile == pytest.approx(0.9)

    a = s["all"]
    assert a.n_tasks == 3 and a.pass_at_k[1] == pytest.approx((0.5 + 1 / 3 + 0.5) / 3)
    table = format_table(s, with_compile=True)
    assert "level1" in table and "pass@2" in table and "fast_1.1(compile)" in table


def test_fast_p_is_strict_and_counts_failures_over_all_tasks():
    rows = [row("A", 1, "pass", 1.0), row("B", 1, "pass", 1.1000001), row("C", 1, "compile_error"),
            row("D", 1, "correctness_error")]
    s = summarize(rows, ps=(1.0, 1.1))["level1"]
    assert s.fast_p["fast_1.0"] == pytest.approx(1 / 4)   # speedup == 1.0 is not > 1.0
    assert s.fast_p["fast_1.1"] == pytest.approx(1 / 4)
    assert s.correct_rate == 0.5


def test_pass_at_k_unavailable_when_a_task_has_too_few_samples():
    s = summarize([row("A", 1, "pass", 1.0), row("B", 1, "pass", 1.0), row("B", 1, "pass", 1.0)], ks=(2,))
    assert s["level1"].pass_at_k[2] is None
    assert "n/a" in format_table(s)


def test_all_infra_task_is_left_out_and_unknown_category_rejected():
    s = summarize([row("A", 1, "infra"), row("B", 1, "pass", 3.0)])
    assert s["level1"].n_tasks == 1 and s["level1"].n_infra == 1 and s["level1"].correct_rate == 1.0
    with pytest.raises(ValueError):
        summarize([row("A", 1, "passed")])


def test_geometric_mean_ignores_missing_and_nonpositive():
    assert geometric_mean([4.0, 1.0, None, float("nan")]) == pytest.approx(2.0)
    assert geometric_mean([]) is None
    assert math.isclose(geometric_mean([8.0]), 8.0)
