"""Generation: determinism by seed, KernelBench format the verifier loads unchanged, prompt metadata, CLI."""
import json
import os

import pytest

from data_synth import cli
from data_synth.generate import GenConfig, generate_candidate, stage1_ops
from data_synth.ops import FAMILIES, REGISTRY
from data_synth.taskset import read_task_set
from data_synth.util import DataSynthError
from megatron_rl.fsutil import output_lock
from megatron_rl.rollout.prompts import describe_task_inputs, task_prompt_text
from verifier.size_profiles import apply_size_profile, load_tasks, module_constants
from verifier.tasks import load_task_set


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_same_seed_same_tasks_other_seed_other_tasks(stage):
    a = [generate_candidate(GenConfig(stage=stage, seed=5), i) for i in range(12)]
    b = [generate_candidate(GenConfig(stage=stage, seed=5), i) for i in range(12)]
    c = [generate_candidate(GenConfig(stage=stage, seed=6), i) for i in range(12)]
    assert [t.source for t in a] == [t.source for t in b]
    assert [t.sizes for t in a] == [t.sizes for t in b]
    assert sum(x.source != y.source for x, y in zip(a, c)) >= 10
    # candidate i does not depend on the candidates before it
    assert generate_candidate(GenConfig(stage=stage, seed=5), 7).source == a[7].source


def test_registry_covers_the_families_with_valid_ops():
    fams = {op.family for op in REGISTRY.values()}
    for f in ("elementwise", "reduction", "normalization", "gemm", "conv", "pooling", "indexing", "attention",
              "softmax", "scan", "loss", "layout"):
        assert f in fams
    assert stage1_ops("broadcast", GenConfig()), "binary ops serve the broadcast family"


def test_stage1_variants_cover_shape_stride_and_dtype():
    tasks = [generate_candidate(GenConfig(stage=1, seed=3), i) for i in range(80)]
    layouts = {i.layout for t in tasks for i in t.graph.inputs}
    dtypes = {i.spec.dtype for t in tasks for i in t.graph.inputs}
    assert {"contiguous", "transposed"} <= layouts
    assert {"float32", "float16", "bfloat16"} <= dtypes
    odd = [t for t in tasks if any(v & (v - 1) for v in t.sizes["cpu"].values() if isinstance(v, int) and v > 2)]
    nice = [t for t in tasks if t not in odd]
    assert odd and nice
    assert len({t.primary_family for t in tasks}) >= 10


def test_stage2_graphs_compose_two_to_five_ops_with_shape_inference():
    tasks = [generate_candidate(GenConfig(stage=2, seed=4), i) for i in range(30)]
    counts = [len(t.graph.nodes) for t in tasks]
    assert min(counts) >= 2 and max(counts) <= 5 and len(set(counts)) >= 2
    assert sum(t.primary_family in ("gemm", "conv") for t in tasks) >= 10   # anchor op + epilogue, as KernelBench L2
    for t in tasks:
        for j, n in enumerate(t.graph.nodes):
            assert n.out.rank >= 0
            if j:
                assert any(a.kind == "node" for a in n.args)     # every epilogue consumes an earlier value


def test_generated_sets_load_through_the_verifier_unchanged(stage_sets):
    for stage, (folder, tasks, _) in stage_sets.items():
        assert len(tasks) >= 3
        loaded = load_tasks(folder)                      # verifier's manifest reader (size profiles)
        assert [t.task_id for t in loaded] == [t.task_id for t in tasks]
        assert all(t.level == stage for t in loaded)
        plain = load_task_set(folder)                    # verifier.tasks reader: manifest extras land in meta
        assert plain[0].meta["families"] == tasks[0].families
        for t in loaded:
            gpu = apply_size_profile(t, "gpu")
            consts = module_constants(gpu.source)
            entry = next(x for x in tasks if x.task_id == t.task_id)
            assert all(consts[k] == v for k, v in entry.sizes["gpu"].items())
            meta = describe_task_inputs(t.source, t.path)
            assert meta.method == "meta", meta.note
            assert "shape=" in task_prompt_text(t, "cpu") and "stride=" in task_prompt_text(t, "cpu")


def test_manifest_carries_prompt_metadata_and_graph(stage_sets):
    folder, tasks, _ = stage_sets[1]
    doc = json.load(open(os.path.join(folder, "manifest.json")))
    e = doc["tasks"][0]
    for key in ("families", "ops", "graph", "inputs", "validation", "decontam", "sizes", "precisions"):
        assert key in e, key
    assert e["inputs"][0]["shape"] and e["inputs"][0]["stride"] and e["inputs"][0]["dtype"]
    back = read_task_set(folder)
    assert back[0].graph.to_json() == tasks[0].graph.to_json()


def test_cli_generate_is_reproducible_and_reports_every_candidate(tmp_path, capsys):
    # validation on; the band is widened so no task sits at its (machine-dependent) edge
    args = ["generate", "--no-progress", "--stage", "1", "--n", "4", "--seed", "9", "--compile-fraction", "0",
            "--min-ms", "0.0001", "--max-ms", "5000"]
    assert cli.main(args + ["--out", str(tmp_path / "a")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["accepted"] == 4
    assert cli.main(args + ["--out", str(tmp_path / "b")]) == 0
    def files(root):
        return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)

    files_a, files_b = files(tmp_path / "a"), files(tmp_path / "b")
    assert files_a == files_b
    for rel in files_a:
        if rel.endswith(".py"):
            assert open(tmp_path / "a" / rel).read() == open(tmp_path / "b" / rel).read()
    report = [json.loads(x) for x in open(tmp_path / "a" / "generation_report.jsonl")]
    assert sum(r["status"] == "accepted" for r in report) == 4
    assert all(r["reason"] for r in report if r["status"] == "skipped")
    # an existing folder is not overwritten without --force
    assert cli.main(args + ["--out", str(tmp_path / "a")]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--n", "0", "--out", "X"], "n must be >= 1"),
    (["generate", "--n", "2", "--families", "nope", "--out", "X"], "unknown family 'nope'"),
    (["generate", "--n", "2", "--dtypes", "float64", "--out", "X"], "dtypes"),
    (["generate", "--n", "2", "--stage", "2", "--ops", "1-7", "--out", "X"], "op counts"),
    (["generate", "--n", "2", "--weights", "/nonexistent.json", "--out", "X"], "weights file not found"),
])
def test_cli_bad_input_names_what_is_wrong(tmp_path, capsys, argv, message):
    argv = [a.replace("X", str(tmp_path / "out")) for a in argv]
    assert cli.main(["--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_family_restriction_and_weights_steer_sampling():
    only = [generate_candidate(GenConfig(stage=1, seed=2, families=("reduction", "softmax")), i) for i in range(20)]
    assert {t.primary_family for t in only} <= {"reduction", "softmax"}
    heavy = GenConfig(stage=1, seed=2, weights={f: (20.0 if f == "scan" else 1.0) for f in FAMILIES})
    scans = sum(generate_candidate(heavy, i).primary_family == "scan" for i in range(40))
    base = sum(generate_candidate(GenConfig(stage=1, seed=2), i).primary_family == "scan" for i in range(40))
    assert scans > base + 10
    with pytest.raises(DataSynthError, match="unknown family"):
        GenConfig(weights={"bogus": 1.0})


def test_force_never_replaces_a_file_with_a_task_folder(tmp_path, capsys):
    """--force replaces an earlier output folder; a file at the output path is refused and kept (it was replaced,
    and a hidden copy of it left beside it, before)."""
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    assert cli.main(["--no-progress", "generate", "--n", "2", "--out", str(out), "--force"]) == 2
    assert "is a file, not an output folder" in capsys.readouterr().err
    assert out.read_text() == "keep me" and os.listdir(tmp_path) == ["notes.txt"]


def test_a_second_command_on_the_same_output_is_refused_before_its_work(tmp_path, capsys):
    """Two `generate --force` runs on one folder would each work, then replace the folder under the other's rename
    (one failing after its work, with a hidden temp left behind): the second is refused at once, naming the holder."""
    out = tmp_path / "tasks"
    with output_lock(out, "data_synth generate"):
        assert cli.main(["--no-progress", "generate", "--n", "2", "--no-validate", "--no-decontaminate",
                         "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert "in use by another data_synth generate" in err and f"pid {os.getpid()}" in err
    assert os.listdir(tmp_path) == []   # nothing generated or written, and the lock file went with its holder
    assert cli.main(["--no-progress", "generate", "--n", "2", "--no-validate", "--no-decontaminate",
                     "--out", str(out)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["tasks"]


@pytest.mark.parametrize("command", [["generate", "--n", "2"], ["diagnose", "--results", "R", "--tasks", "R"]])
def test_an_out_under_a_file_is_a_usage_error_naming_the_file(tmp_path, capsys, command):
    """Locking the output first turned it into exit 3 naming the lock file ("afile/.w.json.lock: Not a directory")."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "w"
    argv = [a.replace("R", str(tmp_path / "r.jsonl")) for a in command]
    assert cli.main(["--no-progress", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot create" in err and "afile is a file, not a folder" in err and ".lock" not in err
    assert sorted(os.listdir(tmp_path)) == ["afile"]
