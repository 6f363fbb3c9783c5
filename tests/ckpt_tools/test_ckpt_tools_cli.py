"""`python -m ckpt_tools`: HF -> Megatron -> HF bitwise through files, logit parity, and bad input.

The command's `main()` runs in-process (it still spawns its own ranks); one test goes through a
real `python -m ckpt_tools` subprocess for the entry point and exit code.
"""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools.__main__ import main
from tests.bridge.tiny_qwen3 import read_weights, tiny_config, tiny_model, tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "tiny"
    model = tiny_model(tiny_config(tied=True), seed=3)
    model.save_pretrained(d, max_shard_size="60KB")
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    return d


@pytest.fixture(scope="module")
def mcore_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mc") / "ckpt"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(out), "--tp", "1", "--pp", "2",
                 "--no-progress"]) == 0
    return out


def _json_line(capsys):
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])


@pytest.mark.slow
def test_converted_checkpoint_layout(mcore_dir, hf_dir):
    assert (mcore_dir / "latest_checkpointed_iteration.txt").read_text() == "0"
    meta = json.loads((mcore_dir / "iter_0000000" / "meta.json").read_text())
    assert (meta["tp"], meta["pp"], meta["bridge"], meta["params_dtype"]) == (1, 2, "qwen3", "float32")
    assets = sorted(os.listdir(mcore_dir / "iter_0000000" / "hf_assets"))
    assert {"config.json", "generation_config.json", "tokenizer_config.json"} <= set(assets)
    assert not [p for p in os.listdir(mcore_dir.parent) if p.startswith(".")]


@pytest.mark.slow
def test_verify_reports_parity_at_another_tp(mcore_dir, hf_dir, capsys):
    assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(mcore_dir), "--tp", "2", "--pp", "1"]) == 0
    report = _json_line(capsys)
    assert report["ok"] and report["max_abs_logit_diff"] < 1e-4 and report["tol"] == 1e-4
    assert report["top1_agreement"] == 1.0 and report["tokens"] == 64


@pytest.mark.slow
def test_verify_fails_on_a_wrong_checkpoint(mcore_dir, hf_dir, tmp_path, capsys):
    wrong = tmp_path / "wrong"
    shutil.copytree(hf_dir, wrong)
    name = "model.layers.1.self_attn.q_norm.weight"  # one small tensor changed in the HF files
    for f in glob.glob(str(wrong / "*.safetensors")):
        t = load_file(f)
        if name in t:
            t[name] = torch.full_like(t[name], 0.5)
            save_file(t, f, metadata={"format": "pt"})
    assert main(["verify", "--hf", str(wrong), "--ckpt", str(mcore_dir)]) == 1
    report = _json_line(capsys)
    assert not report["ok"] and report["max_abs_logit_diff"] > report["tol"]


@pytest.mark.slow
def test_mcore_to_hf_is_a_bitwise_hf_release(mcore_dir, hf_dir, tmp_path):
    out = tmp_path / "release"
    assert main(["mcore-to-hf", "--ckpt", str(mcore_dir), "--out", str(out), "--max-shard-size", "50KB",
                 "--no-progress"]) == 0
    original, exported = read_weights(hf_dir), read_weights(out)
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(glob.glob(str(out / "model-*-of-*.safetensors")))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {os.path.basename(s) for s in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert (out / "tokenizer_config.json").exists() and (out / "generation_config.json").exists()

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ids = tokens(250)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ref(ids).logits)


@pytest.mark.slow
def test_mcore_to_hf_refuses_stored_architectures_of_another_model(mcore_dir, tmp_path, capsys):
    """A checkpoint converted before `architectures` were checked must not carry a wrong class into a release."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(mcore_dir, ckpt)
    meta_path = ckpt / "iter_0000000" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["hf_config"]["architectures"] = ["LlamaForCausalLM"]
    meta_path.write_text(json.dumps(meta))
    out = tmp_path / "o" / "hf"
    _assert_failed_cleanly(main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--no-progress"]), capsys,
                           str(out), f"{meta_path}: hf_config: architectures=['LlamaForCausalLM']",
                           "expected ['Qwen3ForCausalLM']")


def _assert_failed_cleanly(rc, capsys, out, *needles):
    err = capsys.readouterr().err
    assert rc == 2, err
    for needle in needles:
        assert needle in err, (needle, err[-2000:])
    assert not os.path.exists(out)
    parent = os.path.dirname(out)
    if os.path.exists(parent):
        assert not [p for p in os.listdir(parent) if p.startswith(".")], "temp dir left behind"


def _edit_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("breakage,args,needles", [
    ("missing_dir", [], ["does not exist"]),
    ("no_config", [], ["config.json", "missing"]),
    ("truncated", [], ["model-00001-of-", "not a readable safetensors file"]),
    ("more_layers", [], ["model.layers.2.", "missing"]),
    ("gelu", [], ["hidden_act"]),
    ("ok", ["--tp", "3"], ["num_attention_heads", "tp=3"]),
    ("ok", ["--pp", "4"], ["num_hidden_layers", "pp=4"]),
    ("nonempty_out", [], ["refusing to overwrite"]),
])
def test_hf_to_mcore_bad_input(hf_dir, tmp_path, capsys, breakage, args, needles):
    src = tmp_path / "src"
    if breakage != "missing_dir":
        shutil.copytree(hf_dir, src)
    if breakage == "no_config":
        os.remove(src / "config.json")
    elif breakage == "truncated":
        f = sorted(glob.glob(str(src / "model-00001-*.safetensors")))[0]
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) - 100)
    elif breakage == "more_layers":
        _edit_config(src, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    elif breakage == "gelu":
        _edit_config(src, hidden_act="gelu")
    outs = tmp_path / "outs"
    outs.mkdir()
    out = outs / "ckpt"
    if breakage == "nonempty_out":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    rc = main(["hf-to-mcore", "--hf", str(src), "--out", str(out), *args])
    if breakage == "nonempty_out":
        assert rc == 2 and (out / "keep.txt").read_text() == "mine"
        return
    _assert_failed_cleanly(rc, capsys, str(out), *needles)


@pytest.mark.slow
def test_shape_mismatch_found_by_the_ranks_leaves_nothing(hf_dir, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    _edit_config(src, intermediate_size=128)  # the weights say 96
    out = tmp_path / "outs" / "deeper" / "ckpt"
    rc = main(["hf-to-mcore", "--hf", str(src), "--out", str(out), "--no-progress"])
    _assert_failed_cleanly(rc, capsys, str(out), "gate_proj")
    assert not (tmp_path / "outs").exists(), "parent dirs created for the output were not removed"


def test_mcore_to_hf_and_verify_bad_input(hf_dir, tmp_path, capsys):
    out = tmp_path / "o" / "hf"
    (tmp_path / "o").mkdir()
    _assert_failed_cleanly(main(["mcore-to-hf", "--ckpt", str(tmp_path / "none"), "--out", str(out)]),
                           capsys, str(out), "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_failed_cleanly(main(["mcore-to-hf", "--ckpt", str(empty), "--out", str(out)]),
                           capsys, str(out), "latest_checkpointed_iteration.txt")
    rc = main(["verify", "--hf", str(hf_dir), "--ckpt", str(empty)])
    assert rc == 2 and "latest_checkpointed_iteration.txt" in capsys.readouterr().err


def test_module_entry_point_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ckpt_tools", "hf-to-mcore", "--hf", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "out"), "--tp", "1", "--pp", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert not (tmp_path / "out").exists()
