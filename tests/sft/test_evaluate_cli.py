"""`python -m megatron_rl.evaluate` on inputs nobody tuned for: KernelBench's own folder layouts, bad flags and paths
(a one-line `error:` and exit 2 before anything is loaded or written), a stale `--out`, and a tiny random model whose
answers are all cheap format_error verdicts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import REPO_ROOT
from megatron_rl.evaluate import EvalConfig, ModelError, _tasks, _write, main, resolve_model

MATMUL = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A, B)

N = 16

def get_inputs():
    return [torch.rand(N, N), torch.rand(N, N)]

def get_init_inputs():
    return []  # No special initialization inputs needed'''

SCALAR = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, A: torch.Tensor, s: float) -> torch.Tensor:
        return torch.sum(A * s, dim=self.dim)

def get_inputs():
    return [torch.rand(8, 8), 3.14]

def get_init_inputs():
    return [1]
'''

# KernelBench level 4: the task builds an HF model at import (network); only its static form is read here
HF_TASK = '''
import torch
from transformers import AutoModelForCausalLM, AutoConfig

class Model(torch.nn.Module):
    def __init__(self, model_name, config):
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(model_name, config=config)

    def forward(self, x):
        return self.model(x).logits

model_name = "gpt2"
config = AutoConfig.from_pretrained(model_name)

def get_inputs():
    return [torch.randint(0, config.vocab_size, (1, 8))]

def get_init_inputs():
    return [model_name, config]'''


def _kernelbench(root: Path, with_level4: bool = True) -> Path:
    """A KernelBench-style tree: level1..level4 folders of ``N_Name.py`` files."""
    files = {"level1/1_Square_matrix_multiplication_.py": MATMUL, "level1/19_ReLU.py": MATMUL.replace(
        "torch.matmul(A, B)", "torch.relu(A + B)"), "level1/5_Matrix_scalar_multiplication.py": SCALAR,
        "level2/1_Conv2D_ReLU_BiasAdd.py": MATMUL}
    if with_level4:
        files["level4/16_gpt2_bs1_seq1023.py"] = HF_TASK
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _hf_stub(d: Path, **config) -> Path:
    """A folder that looks like an HF model dir (nothing in it is loaded before the inputs are checked)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 512, **config}))
    (d / "model.safetensors").write_bytes(b"")
    return d


def _run(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = main(args)
    return rc, capsys.readouterr().err


def test_kernelbench_layouts_load_unchanged(tmp_path):
    root = _kernelbench(tmp_path / "KernelBench")
    tasks = _tasks(EvalConfig(model="m", tasks=str(root), out="o"))
    first_two = ["level1/1_Square_matrix_multiplication_", "level1/5_Matrix_scalar_multiplication"]   # natural order
    assert [t.task_id for t in tasks] == [*first_two, "level1/19_ReLU", "level2/1_Conv2D_ReLU_BiasAdd",
                                          "level4/16_gpt2_bs1_seq1023"]
    assert [t.level for t in tasks] == [1, 1, 1, 2, 4]
    one = _tasks(EvalConfig(model="m", tasks=str(root / "level1"), out="o", levels=(1,), limit=2))
    assert [t.task_id for t in one] == first_two
    single = _tasks(EvalConfig(model="m", tasks=str(root / "level1" / "19_ReLU.py"), out="o"))
    assert [(t.task_id, t.level) for t in single] == [("19_ReLU", 1)]


def test_a_task_listed_twice_is_evaluated_once(tmp_path):
    root = _kernelbench(tmp_path / "KernelBench", with_level4=False)
    listing = tmp_path / "tasks.txt"
    listing.write_text("KernelBench/level1/19_ReLU.py\nKernelBench/level1/19_ReLU.py\nKernelBench/level2\n")
    assert [t.task_id for t in _tasks(EvalConfig(model="m", tasks=str(listing), out="o"))] == [
        "19_ReLU", "level2/1_Conv2D_ReLU_BiasAdd"]
    assert root.is_dir()


BAD_INPUTS = {
    "missing tasks": (["--tasks", "{tmp}/nope"], "no such task file, folder"),
    "empty folder": (["--tasks", "{tmp}/empty"], "no task files"),
    "syntax error": (["--tasks", "{tmp}/broken"], "does not parse"),
    "no get_inputs": (["--tasks", "{tmp}/noinputs"], "get_inputs"),
    "duplicate ids": (["--tasks", "{tmp}/dups.txt"], "duplicate task_id"),
    "repo root": (["--tasks", "{tmp}/repo"], "KernelBench's tasks are in"),
    "no such level": (["--levels", "3"], "no task of --levels 3 (its tasks have levels [1, 2, 4])"),
    "samples 0": (["--samples", "0"], "--samples and --turns must be >= 1"),
    "samples negative": (["--samples", "-2"], "--samples and --turns must be >= 1"),
    "turns 0": (["--turns", "0"], "--samples and --turns must be >= 1"),
    "limit negative": (["--limit", "-1"], "--limit must be >= 1"),
    "max new tokens 0": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    "context 0": (["--max-context-tokens", "0"], "--max-context-tokens must be >= 1"),
    "concurrency 0": (["--concurrency", "0"], "--concurrency must be >= 1"),
    "trials 0": (["--trials", "0"], "--trials must be >= 1"),
    "top p 0": (["--top-p", "0"], "--top-p must be in (0, 1]"),
    "negative temperature": (["--temperature", "-1"], "--temperature must be"),
    "precision": (["--precision", "fp8"], "--precision must be auto or one of"),
    "device": (["--device", "tpu"], "--device must be auto, cpu, cuda"),
    "model missing": (["--model", "{tmp}/no-model"], "not found"),
    "model not a model": (["--model", "{tmp}/empty"], "neither an HF model dir"),
    "out is a file": (["--out", "{tmp}/afile"], "exists and is not a folder"),
    "result cache is a folder": (["--result-cache", "{tmp}/empty"], "is a folder"),
    "size profile no task has": (["--size-profile", "gpu"], "--size-profile gpu: no task of --tasks has this profile"),
    "size profile bad budget": (["--size-profile", "fit:lots"], "--size-profile: size profile 'fit:lots'"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_exit_2_with_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys, case):
    tasks = _kernelbench(tmp_path / "kb")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "1_ok.py").write_text(MATMUL)
    (tmp_path / "broken" / "2_bad.py").write_text("class Model(:\n")
    (tmp_path / "noinputs").mkdir()
    (tmp_path / "noinputs" / "1_x.py").write_text(MATMUL.split("def get_inputs")[0] + "def get_init_inputs():\n"
                                                  "    return []\n")
    for d in ("a", "b"):   # two level1 folders: both give level1/19_ReLU
        (tmp_path / d / "level1").mkdir(parents=True)
        (tmp_path / d / "level1" / "19_ReLU.py").write_text(MATMUL)
    (tmp_path / "dups.txt").write_text("a/level1\nb/level1\n")
    _kernelbench(tmp_path / "repo" / "KernelBench")          # KernelBench's repository: tasks + scripts
    (tmp_path / "repo" / "scripts").mkdir()
    (tmp_path / "repo" / "scripts" / "run_and_check.py").write_text("import sys\n")
    (tmp_path / "afile").write_text("x")
    model = _hf_stub(tmp_path / "model")
    extra, expected = BAD_INPUTS[case]
    args = {"--model": str(model), "--tasks": str(tasks), "--out": str(tmp_path / "out"), "--no-progress": None}
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    for flag, value in zip(extra[::2], extra[1::2]):
        args[flag] = value
    argv = [x for k, v in args.items() for x in ((k,) if v is None else (k, v))]
    rc, err = _run(monkeypatch, capsys, argv)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("backend", ["cuda", "musa"])
def test_a_backend_without_its_device_is_refused_up_front(tmp_path, monkeypatch, capsys, backend):
    from verifier.devices import get_backend

    if get_backend(backend).is_available():
        pytest.skip(f"this host has a {backend} device")
    rc, err = _run(monkeypatch, capsys, ["--model", str(_hf_stub(tmp_path / "model")), "--tasks",
                                         str(_kernelbench(tmp_path / "kb")), "--out", str(tmp_path / "out"),
                                         "--backend", backend])
    assert rc == 2 and err.startswith(f"error: --backend {backend}: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_model_dir_that_cannot_serve_is_named_in_one_line(tmp_path, monkeypatch, capsys):
    tasks = str(_kernelbench(tmp_path / "kb", with_level4=False))
    garbled = tmp_path / "garbled"
    _hf_stub(garbled)
    (garbled / "config.json").write_text("{not json")
    rc, err = _run(monkeypatch, capsys, ["--model", str(garbled), "--tasks", tasks, "--out", str(tmp_path / "o1")])
    assert rc == 2 and "cannot read config.json" in err and len(err.strip().splitlines()) == 1, err
    # a random model without a tokenizer of its own gets Qwen3's, whose ids its 512-row embedding cannot look up
    small = _hf_stub(tmp_path / "small", max_position_embeddings=1024)
    rc, err = _run(monkeypatch, capsys, ["--model", str(small), "--tasks", tasks, "--out", str(tmp_path / "o2")])
    assert rc == 2 and "vocab_size 512 is smaller than the" in err.strip().splitlines()[-1], err


def test_a_model_the_engine_cannot_load_is_named_in_one_line(tmp_path, monkeypatch, capsys):
    model = _hf_stub(tmp_path / "model", vocab_size=200_000, max_position_embeddings=4096)   # empty safetensors
    rc, err = _run(monkeypatch, capsys, ["--model", str(model), "--tasks", str(_kernelbench(tmp_path / "kb", False)),
                                         "--out", str(tmp_path / "out"), "--no-progress", "--engine-threads", "1"])
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"error: --model {model}: the inference engine did not start: "), err
    assert "engine_logs" in last


def test_a_run_that_scores_no_task_writes_its_reports_and_exits_3(tmp_path, monkeypatch, capsys):
    """Every task unscored (here: persistent infra verdicts) is no result to use: exit 3, the reason on stderr, the
    reports written; the JSON line names each --pass-k figure asked for, not a pass_at_1 nobody asked for."""
    import types

    import megatron_rl.evaluate as ev

    tasks = _tasks(EvalConfig(model="m", tasks=str(_kernelbench(tmp_path / "kb", with_level4=False)), out="o"))

    def unscored(cfg):
        groups = [types.SimpleNamespace(request=types.SimpleNamespace(task=t), ok=False, status="infra",
                                        error=f"task {t.task_id}: the task needs about 12 GiB of host memory")
                  for t in tasks]
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        return _write(cfg, out, tasks, groups, cfg.model, "tok", 1.0)

    monkeypatch.setattr(ev, "evaluate", unscored)
    out = tmp_path / "out"
    rc = main(["--model", "m", "--tasks", "t", "--out", str(out), "--samples", "4", "--pass-k", "2"])
    captured = capsys.readouterr()
    assert rc == 3
    err = captured.err.strip().splitlines()[-1]
    assert err.startswith("error: no task could be scored (4 unscored; level1/1_Square_matrix_multiplication_: infra")
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert last["scored_tasks"] == 0 and "pass_at_1" not in last and {"pass_at_2", "pass_at_4"} <= set(last)
    assert "12 GiB of host memory" in (out / "report.md").read_text()


def test_size_profile_fit_resizes_full_size_kernelbench_tasks_and_says_so(tmp_path):
    root = tmp_path / "KernelBench" / "level1"
    root.mkdir(parents=True)
    (root / "19_ReLU.py").write_text(MATMUL.replace("torch.matmul(A, B)", "torch.relu(A + B)")
                                     .replace("N = 16", "N = 16384 * 2"))
    (root / "1_Square_matrix_multiplication_.py").write_text(MATMUL)
    tasks = _tasks(EvalConfig(model="m", tasks=str(root.parent), out="o", size_profile="fit:16"))
    relu = next(t for t in tasks if t.task_id.endswith("19_ReLU"))
    assert relu.meta["resized"]["N"][0] == 32768 and relu.meta["resized"]["N"][1] <= 1024
    assert "N = 16384 * 2" not in relu.source
    small = next(t for t in tasks if t.task_id.endswith("1_Square_matrix_multiplication_"))
    assert "resized" not in small.meta and small.source == MATMUL
    cfg = EvalConfig(model="m", tasks=str(root.parent), out=str(tmp_path / "out"), size_profile="fit:16")
    (tmp_path / "out").mkdir()
    summary = _write(cfg, tmp_path / "out", tasks, [], "m", "tok", 1.0)
    assert list(summary["resized"]) == [relu.task_id] and summary["size_profile"] == "fit:16"
    assert "N 32768 -> " in (tmp_path / "out" / "report.md").read_text()


def test_write_drops_a_previous_runs_plots(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("speedup_level3.png", "pass_rate_by_family.png", "results.jsonl"):
        (out / name).write_text("from an earlier run")
    cfg = EvalConfig(model="m", tasks="t", out=str(out), samples=2)
    summary = _write(cfg, out, [], [], "m", "tok", 1.0)
    assert summary["tasks"] == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.md", "results.jsonl", "summary.json"]
    assert (out / "results.jsonl").read_text() == ""


def _fake_checkpoint(root: Path, iteration: int) -> Path:
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"iteration": iteration}))
    (d / "metadata.json").write_text("{}")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def test_out_holding_another_checkpoints_conversion_is_converted_again(tmp_path, monkeypatch):
    import ckpt_tools.convert

    conversions = []

    def fake_mcore_to_hf(job):
        conversions.append(job.ckpt_dir)
        _hf_stub(Path(job.out_dir))
        (Path(job.out_dir) / "source.txt").write_text(job.ckpt_dir)
        return Path(job.out_dir)

    monkeypatch.setattr(ckpt_tools.convert, "mcore_to_hf", fake_mcore_to_hf)
    a, b = _fake_checkpoint(tmp_path / "run_a", 5), _fake_checkpoint(tmp_path / "run_b", 5)
    out = tmp_path / "out"
    out.mkdir()
    first = resolve_model(str(a), out, progress=False)
    assert resolve_model(str(a), out, progress=False) == first and len(conversions) == 1   # reused
    second = resolve_model(str(b), out, progress=False)                                    # same iteration number
    assert second == first and len(conversions) == 2
    assert Path((Path(second) / "source.txt").read_text()).resolve() == b.resolve()
    (b / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(ModelError, match="iter_0000007"):
        resolve_model(str(b), out, progress=False)


def test_a_run_dir_whose_checkpoint_is_newer_than_its_export_evaluates_the_checkpoint(tmp_path, monkeypatch, capsys):
    """An SFT run resumed and extended but killed (or run with export off) keeps its old hf/: the newer checkpoint is
    what the run trained, so it is converted instead (the stale export was taken without a word)."""
    import os

    import ckpt_tools.convert

    conversions = []
    monkeypatch.setattr(ckpt_tools.convert, "mcore_to_hf",
                        lambda job: conversions.append(job.iteration) or _hf_stub(Path(job.out_dir)))
    run = tmp_path / "sft_run"
    _fake_checkpoint(run / "ckpt", 4)
    _hf_stub(run / "hf")
    old = (run / "ckpt" / "iter_0000004" / "meta.json").stat().st_mtime_ns
    os.utime(run / "hf" / "config.json", ns=(old + 10**9, old + 10**9))    # exported after its step-4 save
    out = tmp_path / "out"
    out.mkdir()
    assert resolve_model(str(run), out, progress=False) == str((run / "hf").resolve()) and not conversions
    _fake_checkpoint(run / "ckpt", 12)
    os.utime(run / "ckpt" / "iter_0000012" / "meta.json", ns=(old + 2 * 10**9, old + 2 * 10**9))   # resumed to 12
    assert resolve_model(str(run), out, progress=False) == str(out / "model_hf_iter0000012") and conversions == [12]
    assert "iter_0000012) was saved after its hf/ export" in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_random_model_on_kernelbench_layout_writes_format_error_verdicts(tmp_path):
    from megatron_rl.check_sync import write_tiny_model
    from megatron_rl.tokenizer import load_tokenizer

    tok = load_tokenizer("qwen3-offline")
    model = write_tiny_model(str(tmp_path / "model"), arch="qwen3", vocab_size=len(tok), hidden_size=32,
                             intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)
    tok.save_pretrained(model)
    root = _kernelbench(tmp_path / "KernelBench")
    out = tmp_path / "out"
    out.mkdir()
    (out / "speedup_level1.png").write_text("an earlier run's plot")
    (out / "summary.json").write_text("{}")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")   # level 4 tries to fetch gpt2 at import
    r = subprocess.run([sys.executable, "-m", "megatron_rl.evaluate", "--model", model, "--tasks", str(root),
                        "--levels", "1,4", "--samples", "2", "--turns", "2", "--max-new-tokens", "4",
                        "--out", str(out), "--no-progress", "--engine-threads", "1", "--compile-workers", "1"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["tasks"] == 4 and last["scored_tasks"] == 4 and last["pass_at_2"] == 0.0
    summary = json.loads((out / "summary.json").read_text())
    # level 4 (an HF model built at import) is scored too: a format error never runs the task
    assert summary["overall"]["categories"] == {"format_error": 8} and list(summary["levels"]) == ["1", "4"]
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(len(r["turn_verdicts"]) == 2 for r in rows)    # feedback, then a second turn
    assert {r["task_id"] for r in rows} == {"level1/1_Square_matrix_multiplication_", "level1/19_ReLU",
                                            "level1/5_Matrix_scalar_multiplication", "level4/16_gpt2_bs1_seq1023"}
    assert not (out / "speedup_level1.png").exists() and (out / "report.html").is_file()
