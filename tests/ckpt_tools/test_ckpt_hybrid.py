"""ckpt_tools on the Qwen3.5 hybrid, as released: the multimodal layout (language model under
``model.language_model.``, a vision tower and an MTP layer beside it) goes HF -> Megatron (TP=2) -> HF with every
tensor bitwise equal, the vision and MTP tensors included in their own dtypes, and the same HF model type;
`verify` passes at another layout; unsupported config fields are refused by name with nothing written."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from ckpt_tools.__main__ import main
from tests.bridge.tiny_qwen3 import read_weights
from tests.bridge.tiny_qwen3_5 import multimodal_config, multimodal_tensors, tiny_config, tiny_model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "qwen3_5"
    d.mkdir()
    cfg = tiny_config(layers=4)
    mm = multimodal_config(cfg)
    tensors = multimodal_tensors(tiny_model(cfg, seed=9), mm)
    half = sorted(tensors)
    save_file({n: tensors[n] for n in half[: len(half) // 2]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in half[len(half) // 2:]}, str(d / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {n: f"model-0000{1 + (i >= len(half) // 2)}-of-00002.safetensors"
                                            for i, n in enumerate(half)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    mm.save_pretrained(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    return d, tensors


@pytest.mark.slow
def test_multimodal_release_round_trips_bitwise_and_verifies(release, tmp_path, capsys):
    hf_dir, tensors = release
    mcore, out = tmp_path / "mcore", tmp_path / "release"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--tp", "2", "--no-progress"]) == 0
    assets = mcore / "iter_0000000" / "hf_assets"
    assert (assets / "passthrough.safetensors").is_file()
    assert main(["mcore-to-hf", "--ckpt", str(mcore), "--out", str(out), "--no-progress"]) == 0
    got = read_weights(out)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (out / "tokenizer_config.json").is_file()
    capsys.readouterr()
    assert main(["verify", "--hf", str(out), "--ckpt", str(mcore), "--pp", "2"]) == 0
    report = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])
    assert report["ok"] and report["max_abs_logit_diff"] < 1e-4


@pytest.mark.slow
def test_all_linear_single_file_release_round_trips_unsharded_and_verifies(tmp_path, capsys):
    """Every layer linear attention (transformers' cached forward raises on it, so `verify` runs uncached), in one
    model.safetensors without an index: the export is one model.safetensors again, bitwise, with the processor's
    side files, and verifies at another layout."""
    hf_dir, mcore, out = tmp_path / "hf", tmp_path / "mcore", tmp_path / "release"
    tiny_model(tiny_config(layers=2, layer_types=["linear_attention"] * 2), seed=4).save_pretrained(hf_dir)
    assert sorted(p.name for p in hf_dir.glob("model*")) == ["model.safetensors"]
    side = {"processor_config.json": '{"processor_class": "Qwen3VLProcessor"}',
            "video_preprocessor_config.json": '{"fps": 2}'}
    for name, text in side.items():
        (hf_dir / name).write_text(text)
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--tp", "2", "--no-progress"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(mcore), "--out", str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    want, got = read_weights(hf_dir), read_weights(out)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], t) for n, t in want.items())
    for name, text in side.items():
        assert (out / name).read_text() == text, name
    capsys.readouterr()
    assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(mcore), "--pp", "2"]) == 0
    report = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])
    assert report["ok"] and report["max_abs_logit_diff"] < 1e-4


@pytest.mark.parametrize("multimodal,architectures,ok", [
    (True, ["Qwen3_5ForConditionalGeneration"], True),
    (True, None, True),
    (False, ["Qwen3_5ForCausalLM"], True),
    (True, ["Qwen3_5ForCausalLM"], False),
    (False, ["Qwen3_5ForConditionalGeneration"], False),
    (False, ["Qwen3ForCausalLM"], False),
])
def test_architectures_must_be_the_class_of_the_model_type(tmp_path, multimodal, architectures, ok):
    from megatron_rl.bridge import HFCheckpointError
    from megatron_rl.bridge.hf_dir import load_hf_config

    cfg = multimodal_config(tiny_config()) if multimodal else tiny_config()
    cfg.architectures = architectures
    cfg.save_pretrained(tmp_path)
    if ok:
        assert load_hf_config(tmp_path).architectures == architectures
        return
    expected = "Qwen3_5ForConditionalGeneration" if multimodal else "Qwen3_5ForCausalLM"
    with pytest.raises(HFCheckpointError, match=rf"config.json: architectures=\['{architectures[0]}'\] does not match "
                                                rf"model_type='{cfg.model_type}'; expected \['{expected}'\]"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("edit,field", [
    (lambda t: t.update(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "sliding_attention"),
    (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t["rope_parameters"].update(rope_type="yarn", factor=4.0), "rope_type"),
    (lambda t: t.update(attn_output_gate=False), "attn_output_gate"),
    (lambda t: t.update(linear_num_value_heads=3), "linear_num_value_heads"),
])
def test_unsupported_fields_are_refused_by_name_nothing_written(release, tmp_path, edit, field, capsys):
    hf_dir, _ = release
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(hf_dir):
        os.symlink(hf_dir / f, bad / f) if f != "config.json" else None
    cfg = json.loads((hf_dir / "config.json").read_text())
    edit(cfg["text_config"])
    (bad / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(bad), "--out", str(out), "--no-progress"]) == 2
    assert field in capsys.readouterr().err
    assert not out.exists()


def test_tp_that_does_not_divide_the_gdn_heads_is_refused(release, tmp_path, capsys):
    hf_dir, _ = release
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o"), "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "linear_num_key_heads=2 is not divisible by tp=4" in err and not (tmp_path / "o").exists()
