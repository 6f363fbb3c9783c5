"""Command-line probe 34: bad input to the entry points fails fast with exit 2 and a message naming the problem,
and leaves every input and existing output as it was (no traceback, no half-written output)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROW = {"messages": [{"role": "user", "content": "write relu"}, {"role": "assistant", "content": "x = relu(x)"}]}


# ------------------------------------------------------------------------------------------ megatron_rl.tokenizer


def _tok(args, capsys):
    from megatron_rl.tokenizer import main

    rc = main(["train", "--vocab-size", "300", *args])
    return rc, capsys.readouterr().err


def test_tokenizer_out_never_replaces_its_own_data_file(tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    before = data.read_text()
    rc, err = _tok(["--data", str(data), "--out", str(data)], capsys)
    assert rc == 2 and "is a file" in err and "Traceback" not in err
    assert data.is_file() and data.read_text() == before


def test_tokenizer_out_never_replaces_the_folder_holding_its_data(tmp_path, capsys):
    folder = tmp_path / "ünï data"
    folder.mkdir()
    data = folder / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    (folder / "notes.txt").write_text("keep")
    rc, err = _tok(["--data", str(data), "--out", str(folder)], capsys)
    assert rc == 2 and "--data" in err and str(data) in err
    assert data.is_file() and (folder / "notes.txt").read_text() == "keep"
    (tmp_path / "afile").write_text("x")
    rc, err = _tok(["--data", str(data), "--out", str(tmp_path / "afile" / "tok")], capsys)
    assert rc == 2 and "is a file, not a folder" in err


# ------------------------------------------------------------------------------------------ verifier CLI


def _verifier(args, capsys):
    from verifier.cli import main

    rc = main(args)
    return rc, capsys.readouterr()


def _src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "level1").mkdir(parents=True)
    (src / "level1" / "1_a.py").write_text("import torch\nx = torch.randn(2, device='cuda')\n")
    return src


def test_port_musa_refuses_a_file_out_and_an_out_inside_src(tmp_path, capsys):
    src = _src(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("keep")
    rc, cap = _verifier(["port-musa", "--src", str(src), "--out", str(afile)], capsys)
    assert rc == 2 and "--out is a file" in cap.err and afile.read_text() == "keep"
    rc, cap = _verifier(["port-musa", "--src", str(src), "--out", str(src / "ported")], capsys)
    assert rc == 2 and "inside --src" in cap.err and not (src / "ported").exists()


def test_port_musa_writes_nothing_when_a_source_is_bad(tmp_path, capsys):
    src = _src(tmp_path)
    (src / "level1" / "9_bad.py").write_bytes(b"\xff\xfe not utf-8\n")
    out = tmp_path / "out dir"
    rc, cap = _verifier(["port-musa", "--src", str(src), "--out", str(out)], capsys)
    assert rc == 2 and "9_bad.py" in cap.err and "not UTF-8" in cap.err
    assert not out.exists()     # the good file ported before the bad one was not written either


def test_verifier_eval_refuses_a_folder_or_the_samples_file_as_out_before_verifying(tmp_path, capsys):
    samples = ROOT / "verifier/tasks/examples/samples.jsonl"
    tasks = str(ROOT / "verifier/tasks")
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    rc, cap = _verifier(["eval", "--tasks", tasks, "--samples", str(samples), "--out", str(out_dir)], capsys)
    assert rc == 2 and "is a folder" in cap.err and not list(tmp_path.glob("results.*"))
    copy = tmp_path / "samples.jsonl"
    copy.write_text(samples.read_text())
    rc, cap = _verifier(["eval", "--tasks", tasks, "--samples", str(copy), "--out", str(copy)], capsys)
    assert rc == 2 and "--samples file" in cap.err and copy.read_text() == samples.read_text()
    rc, cap = _verifier(["eval", "--tasks", tasks, "--samples", str(samples), "--out", str(tmp_path / "r.jsonl"),
                         "--summary-json", str(out_dir)], capsys)
    assert rc == 2 and "--summary-json" in cap.err


# ------------------------------------------------------------------------------------------ data_synth


@pytest.fixture(scope="module")
def task_set(tmp_path_factory) -> Path:
    from data_synth.cli import main

    out = tmp_path_factory.mktemp("ds") / "tasks"
    assert main(["generate", "--n", "2", "--out", str(out), "--no-validate", "--no-decontaminate",
                 "--no-progress"]) == 0
    return out


def _ds(args, capsys):
    from data_synth.cli import main

    rc = main(args)
    return rc, capsys.readouterr().err


def test_data_synth_bad_log_level_is_a_usage_error(tmp_path, capsys):
    from data_synth.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--log-level", "loud", "generate", "--n", "1", "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--log-level" in err and "loud" in err and "Traceback" not in err


def test_generate_refuses_probabilities_outside_0_1(tmp_path, capsys):
    for flag, value in (("--noncontiguous", "7"), ("--odd-shapes", "-0.5"), ("--odd-shapes", "nan")):
        rc, err = _ds(["generate", "--n", "1", "--out", str(tmp_path / "g"), "--no-validate", "--no-decontaminate",
                       flag, value], capsys)
        assert rc == 2 and flag in err, (flag, value, err)
    assert not (tmp_path / "g").exists()


def test_output_files_that_are_folders_are_refused_before_the_work(task_set, tmp_path, capsys):
    folder = tmp_path / "a folder"
    folder.mkdir()
    rc, err = _ds(["validate", "--tasks", str(task_set), "--report", str(folder), "--no-progress"], capsys)
    assert rc == 2 and "--report" in err and "is a folder" in err
    rc, err = _ds(["distill", "--tasks", str(task_set), "--offline", "--out", str(folder), "--no-progress"], capsys)
    assert rc == 2 and "--out" in err and "is a folder" in err
    rc, err = _ds(["distill", "--tasks", str(task_set), "--offline", "--out", str(tmp_path / "rows.jsonl"),
                   "--verdicts", str(folder)], capsys)
    assert rc == 2 and "--verdicts" in err
    assert list(tmp_path.iterdir()) == [folder] and not list(folder.iterdir())   # no .partial / .tmp left


def test_diagnose_out_that_is_its_results_file_is_refused(task_set, tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"task_id": "x", "category": "pass"}) + "\n")
    before = results.read_text()
    rc, err = _ds(["diagnose", "--results", str(results), "--tasks", str(task_set), "--out", str(results)], capsys)
    assert rc == 2 and "is also an input" in err and results.read_text() == before


def test_distill_refuses_an_unknown_size_profile(task_set, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    rc, err = _ds(["distill", "--tasks", str(task_set), "--offline", "--out", str(out), "--size-profile", "bogus"],
                  capsys)
    assert rc == 2 and "--size-profile bogus" in err and "gpu" in err
    rc, err = _ds(["distill", "--tasks", str(task_set), "--offline", "--out", str(out), "--size-profile", "fit:x"],
                  capsys)
    assert rc == 2 and "--size-profile" in err and "fit:x" in err
    assert not list(tmp_path.iterdir())


def test_rft_checks_the_model_dir_before_starting_an_engine(task_set, tmp_path, capsys):
    empty = tmp_path / "empty model"
    empty.mkdir()
    out = tmp_path / "rft" / "rows.jsonl"
    rc, err = _ds(["rft", "--tasks", str(task_set), "--model", str(empty), "--out", str(out)], capsys)
    assert rc == 2 and str(empty) in err and "config.json" in err
    assert not (tmp_path / "rft").exists()    # no engine logs, no pool


# ------------------------------------------------------------------------------------------ megatron_rl.train


def test_train_resume_without_a_checkpoint_is_a_usage_error_that_writes_nothing(tmp_path, capsys):
    from megatron_rl.train import main

    run = tmp_path / "run"
    rc = main(["--config", str(ROOT / "configs/toy_learn.yaml"), "--resume", f"train.log_dir={run}"])
    err = capsys.readouterr().err
    assert rc == 2 and "--resume" in err and "no checkpoint" in err and str(run / "ckpt") in err
    assert not run.exists()
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "latest_checkpointed_iteration.txt").write_text("garbage")
    rc = main(["--config", str(ROOT / "configs/toy_learn.yaml"), "--resume", f"train.log_dir={run}"])
    err = capsys.readouterr().err
    assert rc == 2 and "garbage" in err and not (run / "config.yaml").exists()


def test_sft_resume_without_a_checkpoint_and_a_folder_as_data_are_usage_errors(tmp_path, capsys):
    from megatron_rl.sft import main

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    run = tmp_path / "run"
    rc = main(["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(data), "--resume",
               f"train.log_dir={run}"])
    err = capsys.readouterr().err
    assert rc == 2 and "--resume" in err and "no checkpoint" in err and str(run / "ckpt") in err
    assert not run.exists()
    rc = main(["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(tmp_path), f"train.log_dir={run}"])
    err = capsys.readouterr().err
    assert rc == 2 and "is a folder" in err and not run.exists()


def test_an_hf_dir_that_is_a_file_is_named_as_one(tmp_path):
    from megatron_rl.bridge.hf_dir import HFCheckpointError, load_hf_config

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(HFCheckpointError, match="is a file, not a directory"):
        load_hf_config(f)
    with pytest.raises(HFCheckpointError, match="does not exist"):
        load_hf_config(tmp_path / "nope")


@pytest.mark.parametrize("loader", ["megatron_rl.config:load_config", "megatron_rl.sft:load_sft_config",
                                    "megatron_rl.recipe:load_recipe_config"])
def test_every_launcher_names_a_folder_or_bad_yaml_given_as_its_config(tmp_path, loader):
    import importlib

    from megatron_rl.config import ConfigError

    module, name = loader.split(":")
    load = getattr(importlib.import_module(module), name)
    with pytest.raises(ConfigError, match="is a folder, not a YAML file"):
        load(str(tmp_path), [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml: not a valid YAML config"):
        load(str(bad), [])
