"""The compact teacher (answers a tiny model can learn) and RFT's clustering and cross-cluster draw."""
import json
import random

import pytest

from data_synth.compact import STYLES, compact_answer, op_source, supported_ops, supports
from data_synth.generate import GenConfig, generate_candidate
from data_synth.rft import (Candidate, RFTConfig, cluster, draw_targets, native_sources, native_tokens, select,
                            signature)
from data_synth.teacher import Unsupported
from data_synth.util import DataSynthError
from verifier.extract import extract_candidate
from verifier.static_checks import check_source

OPS = ("relu", "tanh", "sigmoid", "neg", "square", "abs")


def _tasks(stage, n, seed=0, **kw):
    cfg = GenConfig(stage=stage, n=n, seed=seed, families=("elementwise",), dtypes={"float32": 1.0}, ops=OPS,
                    min_ops=2, max_ops=2, **kw)
    return [generate_candidate(cfg, i) for i in range(n)]


def test_generation_keeps_to_the_op_list_and_compact_answers_pass_the_static_rules():
    tasks = _tasks(1, 12) + _tasks(2, 12)
    assert all(set(t.ops) <= set(OPS) for t in tasks) and any(len(t.ops) == 2 for t in tasks)
    with pytest.raises(DataSynthError, match="unknown op"):
        GenConfig(ops=("relu", "no_such_op"))
    for t in tasks:
        ans = compact_answer(t, "cpu", seed=3)
        code = extract_candidate(ans.response, max_bytes=1 << 20)
        assert code == ans.code and check_source(code, "cpu") == []
        # one extension per distinct op, each the same text in every answer; calls in the reference's order
        distinct = list(dict.fromkeys(t.ops))
        for k, op in enumerate(distinct, 1):
            assert any(f'src{k} = """\n{op_source(op, s)}"""' in code for s in STYLES)
            assert f'ext{k} = load_inline(name="{op}_ext", cpp_sources=src{k},' in code
        calls = [ln.split("=")[1].split(".run")[0].strip() for ln in code.splitlines() if ".run(" in ln]
        assert calls == [f"ext{distinct.index(op) + 1}" for op in t.ops]
        assert native_sources(code) and len(native_sources(code)) == len(set(t.ops))
    # the style is drawn per (seed, task, op): both appear, and a fixed style list is honoured
    styles = {s for t in tasks for s in compact_answer(t, "cpu").recipe.split(":")[1].replace("+", "/").split("/")
              if s in STYLES}
    assert styles == set(STYLES)
    assert "pointer" not in compact_answer(tasks[0], "cpu", styles=("index",)).code.split("for (")[1][:20]
    assert supported_ops() and set(OPS) <= set(supported_ops())


def test_unsupported_tasks_say_why():
    scalar = next(t for t in (generate_candidate(GenConfig(stage=1, n=1, seed=1, ops=("leaky_relu",),
                                                           dtypes={"float32": 1.0}), i) for i in range(3)))
    assert "hyper-parameters" in supports(scalar)
    half = generate_candidate(GenConfig(stage=1, n=1, seed=1, ops=("relu",), dtypes={"float16": 1.0}), 0)
    assert "float32" in supports(half)
    assert "cpu backend only" in supports(_tasks(1, 1)[0], "cuda")
    with pytest.raises(Unsupported):
        compact_answer(scalar)


def _row(task_id, code, passed=True):
    return {"task_id": task_id, "passed": passed, "source": "sglang:x", "sample_id": f"{task_id}#0",
            "messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": f"```python\n{code}```"}]}


def test_clusters_follow_the_strategy_not_the_naming_and_targets_span_clusters():
    t = _tasks(1, 1)[0]
    index = compact_answer(t, styles=("index",)).code
    pointer = compact_answer(t, styles=("pointer",)).code
    renamed = index.replace("p[i]", "src[i]").replace("float* p ", "float* src ").replace("q[i]", "dst[i]") \
        .replace("float* q ", "float* dst ")
    assert native_tokens(native_sources(index)[0]) == native_tokens(native_sources(renamed)[0])
    assert dict(signature(pointer))["pointer_walk"] == 1 and dict(signature(index))["pointer_walk"] == 0
    cands = [Candidate.from_row(_row("t", c)) for c in (index, renamed, pointer, pointer, index)]
    groups = cluster(cands)
    assert sorted(map(sorted, groups)) == [[0, 1, 4], [2, 3]]
    picked = draw_targets(groups, 2, random.Random(0))
    assert sorted(ci for ci, _ in picked) == [0, 1]                      # one from each cluster
    assert len(draw_targets(groups, 5, random.Random(0))) == 5          # then more members, round robin
    rows = [_row("t", c) for c in (index, renamed, pointer)] + [_row("t", "garbage", passed=False),
                                                                _row("u", index, passed=False)]
    targets, report = select(rows, RFTConfig(samples=4, targets=2))
    assert len(targets) == 2 and {r["rft"]["cluster"] for r in targets} == {0, 1}
    assert all(r["source"] == "rft:sglang:x" and r["rft"]["clusters"] == 2 for r in targets)
    per = {p["task_id"]: p for p in report["per_prompt"]}
    assert per["t"]["clusters_before"] == 2 and per["t"]["clusters_after"] == 2 and per["t"]["verified"] == 3
    assert per["u"]["verified"] == 0 and per["u"]["targets"] == 0
    assert report["clusters_per_prompt_before"] == 2 and report["clusters_per_prompt_best_of_k"] == 1.0
    json.dumps(report)
    with pytest.raises(DataSynthError):
        RFTConfig(targets=0)
