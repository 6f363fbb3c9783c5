"""The offline teacher: covers the simple families, passes the verifier's static rules, and its rows pass the
real CPU verifier."""
import dataclasses
import json

import pytest

from data_synth.distill import DistillConfig, distill
from data_synth.generate import GenConfig, generate_candidate
from data_synth.render import render_graph
from data_synth.taskset import read_task_set, verifier_task, write_task_set
from data_synth.teacher import Unsupported, offline_answer, supports
from data_synth.templates import TEMPLATES
from verifier.config import VerifierConfig
from verifier.evaluate import precheck
from verifier.types import VerifyResult

from conftest import FAST_VERIFIER


@pytest.mark.parametrize("stage, families", [
    (1, ("elementwise", "broadcast", "reduction")),
    (1, ("softmax", "scan", "normalization", "gemm", "loss")),
    (2, None),
])
def test_teacher_writes_every_teacher_only_task_and_the_static_rules_accept_it(stage, families):
    cfg = GenConfig(stage=stage, seed=8, families=families, teacher_only=True)
    vcfg = VerifierConfig(backend="cpu")
    kinds = set()
    for i in range(25 if stage == 1 else 12):
        t = generate_candidate(cfg, i)
        assert supports(t) is None, (t.task_id, supports(t))
        for backend in ("cpu", "cuda"):
            ans = offline_answer(t, backend)
            assert ans.response.count("```python") == 1 and "class ModelNew" in ans.code
            kinds.add(ans.recipe)
        code = precheck(verifier_task(t), offline_answer(t, "cpu").response, vcfg)
        assert not isinstance(code, VerifyResult), (t.task_id, code.category, code.feedback)
    assert len(kinds) >= 3


def test_simple_families_are_fully_covered_without_restriction():
    """Stage-1 elementwise / broadcast / reduction tasks drawn without teacher_only: all writable."""
    cfg = GenConfig(stage=1, seed=13, families=("elementwise", "broadcast", "reduction"))
    tasks = [generate_candidate(cfg, i) for i in range(60)]
    assert all(supports(t) is None for t in tasks), [(t.task_id, supports(t)) for t in tasks if supports(t)]


def test_unsupported_tasks_say_why():
    conv = generate_candidate(GenConfig(stage=1, seed=1, families=("conv",)), 0)
    assert "has no template" in supports(conv)
    with pytest.raises(Unsupported, match="has no template"):
        offline_answer(conv)
    tmpl = generate_candidate(GenConfig(stage=3, seed=1, templates=(next(iter(TEMPLATES)),)), 0)
    assert "no generator graph" in supports(tmpl)


def _half_variant(task):
    """The same graph with float16 inputs: its kernel source is the same (dtype-generic), so no new build."""
    g = task.graph
    inputs = tuple(dataclasses.replace(i, spec=i.spec.with_(dtype="float16")) for i in g.inputs)
    graph = dataclasses.replace(g, inputs=inputs,
                                nodes=tuple(dataclasses.replace(n, out=n.out.with_(dtype="float16")) for n in g.nodes))
    r = render_graph(graph)
    return dataclasses.replace(task, task_id=task.task_id + "_fp16", source=r.source, graph=graph,
                               precisions=["float16"], path=None, meta=dict(task.meta, bindings=r.bindings))


def test_offline_rows_pass_the_real_cpu_verifier(tmp_path, teacher_set, build_cache):
    """A reduction + elementwise chain through the real CPU verifier, at float32 and (one farm per dtype) at
    float16 (wider coverage: bench/results/data_synth_teacher_cpu.md)."""
    _, (task,) = teacher_set
    half = _half_variant(task)
    assert offline_answer(half).code.split("ext = ")[0] == offline_answer(task).code.split("ext = ")[0]
    folder = write_task_set([task, half], str(tmp_path / "tasks"))
    tasks = read_task_set(folder)
    out, verdicts = tmp_path / "sft.jsonl", tmp_path / "verdicts.jsonl"
    cfg = DistillConfig(offline=True, backend="cpu", cache_dir=build_cache, compile_workers=2,
                        verifier=FAST_VERIFIER)
    summary = distill(tasks, str(out), cfg, verdicts_path=str(verdicts), progress=False)
    assert summary.rows_written == 2 and summary.passed_samples == 2, summary
    rows = [json.loads(x) for x in open(out)]
    assert [r["task_id"] for r in rows] == [t.task_id for t in tasks]
    for r in rows:
        assert r["passed"] and r["verdict"]["category"] == "pass" and r["speedup"] > 0
        assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant"]
        assert [m["step_loss_mask"] for m in r["messages"]] == [0, 0, 1]
        assert "shape=" in r["messages"][1]["content"] and "load_inline" in r["messages"][2]["content"]
        assert r["source"] == "offline:cpu" and r["families"]
    vrows = [json.loads(x) for x in open(verdicts)]
    assert len(vrows) == 2 and all(v["category"] == "pass" and "task_id" in v for v in vrows)
    assert [v["details"]["tolerance"]["precision"] for v in vrows] == ["float32", "float16"]
    assert {"reduce", "elementwise"} <= set(offline_answer(tasks[0]).recipe.split(":")[1].split("+"))
    assert not (tmp_path / "sft.jsonl.partial").exists()
