"""HF checkpoints of layouts the other tests do not use.

- A half-precision Qwen3.5 checkpoint that stores GDN's ``A_log`` / ``dt_bias`` in bf16 like every other
  weight: the actor holds them in fp32, and the export must still write them back in bf16, bitwise.
- A hub-style one that stores them in fp32 beside bf16 weights: not a "mixed dtype" checkpoint.
- A multimodal config whose top-level ``tie_word_embeddings`` says tied and whose ``text_config`` does not, saved
  without an output layer: the error names both flags.
- Names the weights decide, not the config: a ``qwen3_5_text`` config over the multimodal ``model.language_model.*``
  names (and the reverse), and a tied checkpoint that stores ``lm_head.weight`` anyway; the export writes them back.
"""
import json

import pytest
import torch

from ckpt_tools.__main__ import main
from megatron_rl.bridge import get_bridge
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


def _round_trip_bitwise(hf_dir, tmp_path):
    """HF -> Megatron -> HF with the CLI; asserts the export holds exactly the source's tensors (names, dtypes,
    bytes) and returns (megatron dir, export dir)."""
    mcore, out = tmp_path / "mcore", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--no-progress"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(mcore), "--out", str(out), "--no-progress"]) == 0
    src, got = read_weights(hf_dir), read_weights(out)
    assert sorted(got) == sorted(src)
    for name, t in src.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), (name, t.dtype, got[name].dtype)
    return mcore, out


@pytest.mark.slow
@pytest.mark.parametrize("gdn_fp32", [False, True])
def test_half_precision_hybrid_round_trips_its_gdn_dtypes(tmp_path, gdn_fp32):
    hf_dir = _save_hf(tmp_path / "hf", gdn_fp32=gdn_fp32)
    mcore, out = _round_trip_bitwise(hf_dir, tmp_path)
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


# ----- names the weights decide: the language model's prefix, a tied lm_head stored anyway -------------------------
MM = "model.language_model."


def _save_names(d, cfg, tensors):
    """`cfg` (its own model_type) over `tensors` in one model.safetensors."""
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(d)
    return d


def _text_over_multimodal_names(d):
    """A ``qwen3_5_text`` config whose weights hold the released multimodal names (vision tower and MTP beside)."""
    cfg = tiny_config(layers=2, layer_types=["linear_attention", "full_attention"])
    return _save_names(d, cfg, multimodal_tensors(tiny_model(cfg, seed=5), multimodal_config(cfg)))


def _tied_with_lm_head(d, *, stored: bool):
    """A tied Qwen3 checkpoint, with (`stored`) or without the redundant ``lm_head.weight`` copy."""
    from tests.bridge.tiny_qwen3 import hf_tensors, tiny_config as qwen3_config, tiny_model as qwen3_model

    cfg = qwen3_config(tied=True)
    tensors = hf_tensors(qwen3_model(cfg, seed=6))
    if stored:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    return _save_names(d, cfg, tensors)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5", "qwen3"])
@pytest.mark.parametrize("prefix", ["model.", MM])
def test_the_weights_not_the_model_type_decide_the_language_model_prefix(tmp_path, arch, prefix):
    """Either prefix loads under either model_type; its names are the ones the export writes (recorded in
    source_layout.json only where they differ from the config's own class)."""
    from megatron_rl.bridge.hf_dir import check_hf_input, fp32_source_dtypes, save_source_layout
    from megatron_rl.models import ParallelSizes
    from tests.bridge import tiny_qwen3

    if arch == "qwen3":
        cfg = tiny_qwen3.tiny_config()
        tensors = tiny_qwen3.hf_tensors(tiny_qwen3.tiny_model(cfg))
    else:
        text = tiny_config(layers=2, layer_types=["linear_attention", "full_attention"])
        cfg = multimodal_config(text) if arch == "qwen3_5" else text
        tensors = tiny_qwen3.hf_tensors(tiny_model(text))
    tensors = {(prefix + n[len("model."):] if n.startswith("model.") else n): t for n, t in tensors.items()}
    hf_dir = _save_names(tmp_path / "hf", cfg, tensors)
    _cfg, bridge, state = check_hf_input(str(hf_dir), ParallelSizes())
    assert bridge.lm_prefix == prefix
    assert sorted(bridge.hf_param_names()) == sorted(tensors)
    default = MM if arch == "qwen3_5" else "model."
    recorded = save_source_layout(hf_dir, tmp_path / "assets")
    assert recorded == ({"single_file": True} if prefix == default else {"single_file": True, "lm_prefix": prefix})
    if arch != "qwen3":
        assert set(fp32_source_dtypes(get_bridge(cfg), state)) == {prefix + "layers.0.linear_attn.A_log",
                                                                     prefix + "layers.0.linear_attn.dt_bias"}


def test_a_text_config_over_multimodal_names_carries_the_vision_tower_and_mtp(tmp_path):
    from megatron_rl.bridge.hf_dir import check_hf_input
    from megatron_rl.models import ParallelSizes

    hf_dir = _text_over_multimodal_names(tmp_path / "hf")
    _cfg, bridge, state = check_hf_input(str(hf_dir), ParallelSizes())
    carried = bridge.passthrough_hf_names(list(state.keys()))
    assert any(n.startswith("model.visual.") for n in carried) and any(n.startswith("mtp.") for n in carried)
    assert sorted(bridge.hf_param_names() + carried) == sorted(state.keys())


def test_weights_under_no_known_prefix_name_what_was_expected_and_found(tmp_path, capsys):
    from tests.bridge.tiny_qwen3 import hf_tensors

    cfg = tiny_config(layers=2, layer_types=["linear_attention", "full_attention"])
    tensors = {n.replace("model.", "transformer.", 1): t for n, t in hf_tensors(tiny_model(cfg)).items()}
    hf_dir = _save_names(tmp_path / "hf", cfg, tensors)
    out = tmp_path / "outs" / "mcore"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    for needle in (str(hf_dir), "'model.embed_tokens.weight'", "'model.language_model.embed_tokens.weight'",
                   "transformer.layers.*.", "lm_head.weight"):
        assert needle in err, (needle, err)
    assert "Traceback" not in err and not (tmp_path / "outs").exists()


@pytest.mark.parametrize("stored", [True, False])
def test_a_tied_lm_head_is_recorded_and_named_for_export_only_when_stored(tmp_path, stored):
    from megatron_rl.bridge import BridgeError
    from megatron_rl.bridge.hf_dir import load_source_layout
    from megatron_rl.checkpoint import copy_hf_assets
    from tests.bridge.tiny_qwen3 import tiny_config as qwen3_config

    hf_dir = _tied_with_lm_head(tmp_path / "hf", stored=stored)
    copy_hf_assets(hf_dir, tmp_path / "assets")
    layout = load_source_layout(tmp_path / "assets")
    names = get_bridge(qwen3_config(tied=True), layout=layout).hf_param_names()
    assert sorted(names) == sorted(read_weights(hf_dir))
    if stored:
        assert layout == {"single_file": True, "duplicates": ["lm_head.weight"]}
        assert names[:2] == ["model.embed_tokens.weight", "lm_head.weight"]
        with pytest.raises(BridgeError, match="lm_head.weight"):  # an untied config has no copy to write
            get_bridge(qwen3_config(tied=False), layout=layout).hf_param_names()
    else:
        assert layout == {"single_file": True} and "lm_head.weight" not in names


@pytest.mark.slow
@pytest.mark.parametrize("case", ["text_over_multimodal_names", "tied_lm_head_stored", "tied_lm_head_absent"])
def test_export_reproduces_the_names_it_was_given(tmp_path, case):
    """HF -> Megatron -> HF gives back exactly the source's tensors, names and bytes: the multimodal prefix under a
    text config (vision tower and MTP carried), and a tied lm_head.weight when, and only when, the source had it."""
    make = {"text_over_multimodal_names": _text_over_multimodal_names,
            "tied_lm_head_stored": lambda d: _tied_with_lm_head(d, stored=True),
            "tied_lm_head_absent": lambda d: _tied_with_lm_head(d, stored=False)}[case]
    hf_dir = make(tmp_path / "hf")
    _, out = _round_trip_bitwise(hf_dir, tmp_path)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert json.loads((out / "config.json").read_text())["model_type"] == \
        json.loads((hf_dir / "config.json").read_text())["model_type"]
