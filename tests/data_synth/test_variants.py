"""Prompt variants (data_synth.variants): a verified answer repeated under other tasks that take the same answer."""
import pytest

from data_synth.compact import compact_answer
from data_synth.distill import ROW_FORMAT, sft_messages
from data_synth.generate import GenConfig, generate_candidate
from data_synth.taskset import verifier_task
from data_synth.variants import VARIANT_SOURCE, final_answer, variant_rows
from megatron_rl.rollout.prompts import initial_messages

OPS = ("relu", "tanh", "neg")


def _tasks(stage, n, seed):
    cfg = GenConfig(stage=stage, n=n, seed=seed, families=("elementwise",), dtypes={"float32": 1.0}, ops=OPS,
                    min_ops=2, max_ops=2)
    return [generate_candidate(cfg, i) for i in range(n)]


def _row(task, passed=True, turns=1):
    answer = compact_answer(task, "cpu", 0, ("index",)).response
    prompt = initial_messages(verifier_task(task), "cpu")
    return {"format": ROW_FORMAT, "task_id": task.task_id, "sample_id": f"{task.task_id}#0",
            "messages": sft_messages(prompt, [(answer, None)] * turns), "passed": passed, "turns": turns,
            "source": "offline:cpu:compact", "ops": task.ops}


def test_each_variant_repeats_the_passed_answer_of_its_op_sequence_under_its_own_prompt():
    train = _tasks(1, 6, seed=0) + _tasks(2, 6, seed=0)
    variants = _tasks(1, 6, seed=50) + _tasks(2, 10, seed=51)
    rows = [_row(t) for t in train]
    by_ops = {}
    for t, r in zip(train, rows):
        by_ops.setdefault(tuple(t.ops), r)   # the first passed row of an answer is the one repeated

    def teacher(task):
        return compact_answer(task, "cpu", 0, ("index",)).response

    made, skipped = variant_rows(rows, variants, teacher, "cpu")
    covered = [v for v in variants if tuple(v.ops) in by_ops]
    assert len(made) == len(covered) and 0 < len(covered) and sum(skipped.values()) == len(variants) - len(covered)
    for v, row in zip(covered, made):
        source = by_ops[tuple(v.ops)]
        assert row["task_id"] == v.task_id and row["passed"] and row["source"] == VARIANT_SOURCE
        assert row["verified_on"] == source["sample_id"] and row["ops"] == v.ops
        assert final_answer(row) == final_answer(source) == teacher(v)
        # the variant's own prompt (its shapes and name), the source row's answer; loss on the answer only
        assert row["messages"][:-1] == [dict(m, step_loss_mask=0) for m in initial_messages(verifier_task(v), "cpu")]
        assert [m["step_loss_mask"] for m in row["messages"]] == [0, 0, 1]
        assert row["messages"][1]["content"] != source["messages"][1]["content"]


def test_only_passed_single_turn_answers_that_the_teacher_would_write_are_repeated():
    train = _tasks(1, 3, seed=0)
    variants = [t for t in _tasks(1, 12, seed=7) if tuple(t.ops) == tuple(train[0].ops)]
    assert variants
    rows = [_row(train[0], passed=False)]
    made, skipped = variant_rows(rows, variants, lambda t: compact_answer(t, "cpu", 0, ("index",)).response, "cpu")
    assert made == [] and skipped == {"no passed row has the answer the teacher writes for it": len(variants)}
    made, _ = variant_rows([_row(train[0], turns=2)], variants,
                           lambda t: compact_answer(t, "cpu", 0, ("index",)).response, "cpu")
    assert made == []   # a multi-turn transcript's answer followed feedback the variant's prompt never had
    # a teacher that writes another answer for the variant (another loop style) gets no row
    made, skipped = variant_rows([_row(train[0])], variants,
                                 lambda t: compact_answer(t, "cpu", 0, ("pointer",)).response, "cpu")
    assert made == [] and sum(skipped.values()) == len(variants)
    made, skipped = variant_rows([_row(train[0])], variants, lambda t: None, "cpu")
    assert made == [] and skipped == {"the teacher has no answer for it": len(variants)}
    # variant rows never stand in for verified ones
    made, _ = variant_rows([_row(train[0])], variants, lambda t: compact_answer(t, "cpu", 0, ("index",)).response,
                           "cpu")
    assert made and variant_rows(made, variants, lambda t: final_answer(made[0]), "cpu")[0] == []


def test_a_row_without_an_answer_is_named():
    with pytest.raises(ValueError, match="'t#0' has no assistant message"):
        final_answer({"sample_id": "t#0", "messages": [{"role": "user", "content": "x"}]})
