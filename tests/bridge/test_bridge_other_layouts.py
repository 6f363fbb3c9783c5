"""HF checkpoints of layouts the other tests do not use.

- A half-precision Qwen3.5 checkpoint that stores GDN's ``A_log`` / ``dt_bias`` in bf16 like every other
  weight: the actor holds them in fp32, and the export must still write them back in bf16, bitwise.
- A hub-style one that stores them in fp32 beside bf16 weights: not a "mixed dtype" checkpoint.
- A multimodal config whose top-level ``tie_word_embeddings`` says tied and whose ``text_config`` does not, saved
  without an output layer: the error names both flags.
"""
import json

import pytest
import torch

from ckpt_tools.__main__ import main
from tests.bridge.tiny_qwen3 import read_weights
from tests.bridge.tiny_qwen3_5 import multimodal_config, multimodal_tensors, tiny_config, tiny_model


def _save_hf(d, *, gdn_fp32: bool, multimodal: bool = False, tied: bool = False):
    """A bf16 tiny hybrid; A_log/dt_bias in fp32 when `gdn_fp32`, else in bf16 like the rest."""
    from safetensors.torch import save_file

    cfg = tiny_config(layers=2, layer_types=["linear_attention", "full_attention"], tied=tied)
    model = tiny_model(cfg, seed=4, dtype=torch.bfloat16)
    if gdn_fp32:
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.data = p.data.float()
    d.mkdir(parents=True)
    if multimodal:
        mm = multimodal_config(cfg)
        save_file(multimodal_tensors(model, mm), str(d / "model.safetensors"), metadata={"format": "pt"})
        mm.save_pretrained(d)
    else:
        model.save_pretrained(d)
    return d


def test_fp32_source_dtypes_are_recorded_and_get_no_vote(tmp_path, capsys):
    from ckpt_tools.convert import _resolve_dtype
    from megatron_rl.bridge.hf_dir import check_hf_input, load_fp32_source_dtypes, save_fp32_source_dtypes
    from megatron_rl.models import ParallelSizes

    half = _save_hf(tmp_path / "half", gdn_fp32=False)
    assert save_fp32_source_dtypes(half, tmp_path / "a") == {
        "model.layers.0.linear_attn.A_log": "bfloat16", "model.layers.0.linear_attn.dt_bias": "bfloat16"}
    assert load_fp32_source_dtypes(tmp_path / "a")["model.layers.0.linear_attn.A_log"] == "bfloat16"

    hub = _save_hf(tmp_path / "hub", gdn_fp32=True)
    cfg, bridge, state = check_hf_input(str(hub), ParallelSizes())
    assert state.dtype("model.layers.0.linear_attn.A_log") == torch.float32
    capsys.readouterr()
    assert _resolve_dtype(None, cfg, state, bridge) == torch.bfloat16
    assert "mix dtypes" not in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("gdn_fp32", [False, True])
def test_half_precision_hybrid_round_trips_its_gdn_dtypes(tmp_path, gdn_fp32):
    hf_dir = _save_hf(tmp_path / "hf", gdn_fp32=gdn_fp32)
    mcore, out = tmp_path / "mcore", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--no-progress"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(mcore), "--out", str(out), "--no-progress"]) == 0
    src, got = read_weights(hf_dir), read_weights(out)
    assert sorted(got) == sorted(src)
    for name, t in src.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), (name, t.dtype, got[name].dtype)
    assert not (out / "fp32_source_dtypes.json").exists()  # a checkpoint asset, not part of the release
    if not gdn_fp32:
        # verify runs a half checkpoint in fp32 on both sides: this tiny random bf16 hybrid's rounding (0.44 against
        # a 0.12 bound in bf16) is not a layout error
        assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(mcore)]) == 0


def test_verify_computes_half_checkpoints_in_fp32_when_two_fp32_copies_fit():
    from ckpt_tools.verify import choose_compute_dtype

    bf16, fp32 = torch.bfloat16, torch.float32
    assert choose_compute_dtype("auto", bf16, 10**6, 8 * 10**6) == fp32
    assert choose_compute_dtype("auto", bf16, 10**6, 8 * 10**6 - 1) == bf16      # a 27B model on a small host
    assert choose_compute_dtype("auto", bf16, 10**6, None) == fp32
    assert choose_compute_dtype("checkpoint", bf16, 1, None) == bf16
    assert choose_compute_dtype("float32", bf16, 10**12, 1) == fp32
    assert choose_compute_dtype("checkpoint", fp32, 1, None) == fp32
    assert choose_compute_dtype("auto", bf16, 1, None, on_gpu=True) == bf16   # TF32 in fla's kernels, device memory
    with pytest.raises(ValueError, match="compute_dtype='fp8'"):
        choose_compute_dtype("fp8", bf16, 1, None)


def test_multimodal_tie_flags_that_disagree_name_the_flags_when_the_output_layer_is_missing(tmp_path, capsys):
    """Top-level tied, text_config untied, no lm_head saved (the multimodal class tied it): the error names both
    flags, not only the missing tensor. (With lm_head present, both transformers classes run it: converted.)"""
    hf_dir = _save_hf(tmp_path / "hf", gdn_fp32=False, multimodal=True, tied=True)
    raw = json.loads((hf_dir / "config.json").read_text())
    assert raw["tie_word_embeddings"] is True
    raw["text_config"]["tie_word_embeddings"] = False
    (hf_dir / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "outs" / "mcore"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "text_config.tie_word_embeddings" in err and "Traceback" not in err
    assert not (tmp_path / "outs").exists()
