"""Decontamination: renamed copies are caught by every layer; generated tasks are not; the report says why."""
import json
import os
import re
import subprocess

import pytest

from data_synth import cli
from data_synth.decontam import (DEFAULT_THRESHOLD, Decontaminator, Reference, fingerprint, jaccard,
                                 normalized_hash, op_signature, shape_key)
from data_synth.taskset import read_task_set

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED = os.path.join(ROOT, "verifier", "tasks")
KB_MIRROR = "/work/.mirror/ScalingIntelligence+KernelBench/repo"


def renamed_copy(source: str) -> str:
    """The same task with every user identifier renamed, comments/docstrings changed and re-formatted."""
    names = set(re.findall(r"^([a-z_][a-z0-9_]*)\s*=", source, re.M))
    names |= set(re.findall(r"self\.([a-z_][a-z0-9_]*)\s*=", source))
    names |= set(re.findall(r"def forward\(self, ([^)]*)\)", source)[0].replace(" ", "").split(","))
    names = {n.split(":")[0] for n in names if n and n not in ("self",)}
    out = source
    for i, n in enumerate(sorted(names, key=len, reverse=True)):
        out = re.sub(rf"\b{re.escape(n)}\b", f"renamed_{i}_q", out)
    out = re.sub(r'"""[^"]*"""', '"""Another description."""', out)
    return "# copied\nimport math\n" + out.replace("    ", "  ").replace("\n\n\n", "\n\n")


def test_renamed_bundled_task_is_caught_by_every_layer():
    src = open(os.path.join(BUNDLED, "level2", "9_Gemm_GroupNorm_Tanh.py")).read()
    copy = renamed_copy(src)
    assert copy != src and "in_features" not in copy
    # each layer on its own
    assert normalized_hash(copy) == normalized_hash(src)
    assert op_signature(copy) == op_signature(src) == ("linear", "groupnorm", "tanh")
    assert shape_key(copy) == shape_key(src) is not None
    a, b = fingerprint(src), fingerprint(copy)
    assert jaccard(a.shingles, b.shingles) >= DEFAULT_THRESHOLD
    # and through the decontaminator, with a reference built from the bundled folder
    ref = Reference.from_sources("bundled", ((t.task_id, t.source) for t in read_task_set(BUNDLED)))
    v = Decontaminator([ref]).check("copy", copy)
    assert v.dropped and v.layer == "exact" and "9_Gemm_GroupNorm_Tanh" in v.match
    # with other sizes the exact layer no longer fires, the n-gram layer still does
    resized = copy.replace("= 32", "= 48")
    v2 = Decontaminator([ref]).check("resized", resized)
    assert v2.dropped and v2.layer == "ngram" and v2.similarity >= DEFAULT_THRESHOLD


def test_same_ops_same_shapes_but_rewritten_is_caught_by_the_signature_layer():
    src = open(os.path.join(BUNDLED, "level1", "12_Softmax.py")).read()
    rewritten = ("import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def __init__(self):\n"
                 "        super().__init__()\n        self.unused = 1\n\n    def forward(self, inp):\n"
                 "        out = torch.softmax(inp, dim=1)\n        return out\n\n"
                 + "\n".join(ln for ln in src.splitlines() if re.match(r"^[a-z_]+ = \d+", ln))
                 + "\n\ndef get_inputs():\n    return [torch.randn(batch_size, dim)]\n\n"
                   "def get_init_inputs():\n    return []\n")
    ref = Reference.from_sources("bundled", [("12_Softmax", src)])
    v = Decontaminator([ref], threshold=0.99).check("rw", rewritten)
    assert v.dropped and v.layer == "signature_shapes", v.to_dict()


def test_committed_index_covers_kernelbench_history(kb_reference):
    info = kb_reference.info
    assert info["source"]["repository"].endswith("ScalingIntelligence/KernelBench")
    assert info["source"]["task_file_versions"] >= 1000 and info["source"]["commits_touching_tasks"] >= 100
    assert len(kb_reference) >= 1000
    labels = {e.label for e in kb_reference.entries}
    assert any("level1/19_ReLU.py" in x for x in labels) and any("level3/" in x for x in labels)


@pytest.mark.skipif(not os.path.isdir(KB_MIRROR), reason="needs a KernelBench git mirror (fetch tool)")
def test_renamed_real_kernelbench_task_is_caught_by_the_committed_index(kb_reference):
    def show(path):
        return subprocess.run(["git", "--git-dir", KB_MIRROR, "show", f"HEAD:KernelBench/{path}"], check=True,
                              capture_output=True, text=True).stdout
    d = Decontaminator([kb_reference])
    for path in ("level1/23_Softmax.py", "level2/1_Conv2D_ReLU_BiasAdd.py", "level3/1_MLP.py"):
        v = d.check(path, renamed_copy(show(path)))
        assert v.dropped and path in v.match, (path, v.to_dict())


def test_generated_tasks_are_kept_and_tagged(stage_sets, kb_reference):
    d = Decontaminator([kb_reference])
    tagged = 0
    for stage, (_, tasks, records) in stage_sets.items():
        for t in tasks:
            v = d.check(t.task_id, t.source)
            assert not v.dropped, v.to_dict()
            assert v.similarity < DEFAULT_THRESHOLD
            tagged += "kb_op_overlap" in v.tags
    assert tagged >= 1   # single-op tasks share KernelBench level-1 op signatures (other shapes)


def test_cli_decontaminate_drops_copies_with_a_report(tmp_path, stage_sets, capsys):
    folder, tasks, _ = stage_sets[1]
    bundled_copy = renamed_copy(open(os.path.join(BUNDLED, "level1", "18_RMSNorm.py")).read())
    mixed = tmp_path / "mixed"
    os.makedirs(mixed / "level1")
    for t in tasks[:3]:
        (mixed / "level1" / f"{t.task_id}.py").write_text(t.source)
    (mixed / "level1" / "99_copy.py").write_text(bundled_copy)
    (mixed / "level1" / "98_dup.py").write_text(tasks[0].source)
    report, out = tmp_path / "report.jsonl", tmp_path / "clean"
    assert cli.main(["--no-progress", "decontaminate", "--tasks", str(mixed), "--against", BUNDLED,
                     "--report", str(report), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tasks"] == 5 and summary["kept"] == 3
    rows = {r["task_id"]: r for r in map(json.loads, open(report))}
    assert rows["level1/99_copy"]["dropped"] and "18_RMSNorm" in rows["level1/99_copy"]["reason"]
    assert rows["level1/98_dup"]["dropped"] and rows["level1/98_dup"]["layer"] == "exact"
    assert sorted(t.task_id for t in read_task_set(str(out))) == sorted(f"level1/{t.task_id}" for t in tasks[:3])


@pytest.mark.parametrize("source,reason", [
    ("import torch\nx = " + "+".join(["a"] * 4000) + "\n", "nested too deeply"),
    ("import torch\nx = " + "(" * 300 + "1" + ")" * 300 + "\n", ""),
    ("x = 1\0\n", "null bytes"),
])
def test_a_reference_the_analyses_cannot_take_is_named_not_a_traceback(source, reason):
    """An --against set's file nested past the recursion limit (or holding NUL bytes) stopped decontamination with a
    RecursionError traceback; it is now refused as not parsing, naming the file."""
    with pytest.raises(cli.DataSynthError, match=f"reference mine: deep.py does not parse: .*{reason}"):
        Reference.from_sources("mine", [("deep.py", source)])
