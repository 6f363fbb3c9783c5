"""Bridge probe 34: HF checkpoints of layouts and config fields real users have that the other tests do not use.

- A base model's names without the ``model.`` prefix (``Qwen3Model.save_pretrained``, as Qwen3-Embedding ships them),
  which transformers' causal-LM classes load: converted, and exported under the same names.
- A stale ``rotary_emb.inv_freq`` buffer: accepted before, but dropped by the export; now carried back verbatim.
- A quantized checkpoint (``quantization_config``): refused by that field, not by the scale tensors it adds.
- Qwen3.5 hybrid shapes (partial RoPE 0.5 / 1.0, GDN value/key head ratios 1 and 4, equal key/value head dims, conv
  kernels 2 and 3, attention-first / all-attention patterns, ``full_attention_interval`` without ``layer_types``):
  the shape table matches transformers' model, and megatron-core's logits match transformers' in fp32.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools.__main__ import main
from megatron_rl.bridge import get_bridge
from megatron_rl.models import ParallelSizes, spec_for
from tests.bridge import tiny_qwen3, tiny_qwen3_5
from tests.bridge.tiny_qwen3 import read_weights

INV_FREQ = "model.layers.0.self_attn.rotary_emb.inv_freq"


def _rewrite(d, fn):
    path = d / "model.safetensors"
    save_file(fn(load_file(path)), str(path), metadata={"format": "pt"})
    return d


def _qwen3_dir(d, *, tied=False, prefix="model.", inv_freq=False):
    tiny_qwen3.tiny_model(tiny_qwen3.tiny_config(tied=tied), seed=3).save_pretrained(d)

    def edit(t):
        out = {(prefix + n[len("model."):] if n.startswith("model.") else n): w for n, w in t.items()}
        if inv_freq:
            out[prefix + INV_FREQ[len("model."):]] = torch.arange(8.0)
        return out
    return _rewrite(d, edit)


def _cli_refuses(tmp_path, hf_dir, capsys, needles):
    out = tmp_path / "outs" / "mcore"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in err and not (tmp_path / "outs").exists()


# ----- names: a base model's layout, stale rotary buffers ------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_a_base_model_layout_without_prefix_is_read_and_recorded(tmp_path, tied):
    from megatron_rl.bridge.hf_dir import check_hf_input, save_source_layout

    hf_dir = _qwen3_dir(tmp_path / "hf", tied=tied, prefix="")
    names = sorted(read_weights(hf_dir))
    assert "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)
    _cfg, bridge, _state = check_hf_input(str(hf_dir), ParallelSizes(2))
    assert bridge.lm_prefix == "" and sorted(bridge.hf_param_names()) == names
    assert save_source_layout(hf_dir, tmp_path / "assets") == {"single_file": True, "lm_prefix": ""}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text", "qwen3_5"])
def test_stale_rotary_buffers_are_carried_for_the_export(tmp_path, arch):
    from megatron_rl.bridge.hf_dir import PASSTHROUGH_FILE, check_hf_input
    from megatron_rl.checkpoint import copy_hf_assets

    if arch == "qwen3":
        cfg = tiny_qwen3.tiny_config()
        tensors = tiny_qwen3.hf_tensors(tiny_qwen3.tiny_model(cfg))
        buffer = INV_FREQ
    else:
        text = tiny_qwen3_5.tiny_config(layers=2, layer_types=["linear_attention", "full_attention"])
        model = tiny_qwen3_5.tiny_model(text)
        cfg = tiny_qwen3_5.multimodal_config(text) if arch == "qwen3_5" else text
        tensors = (tiny_qwen3_5.multimodal_tensors(model, cfg) if arch == "qwen3_5"
                   else tiny_qwen3_5.hf_tensors(model))
        buffer = ("model.language_model." if arch == "qwen3_5" else "model.") + "layers.1.self_attn.rotary_emb.inv_freq"
    tensors[buffer] = torch.arange(4.0)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(hf_dir)
    _cfg, bridge, state = check_hf_input(str(hf_dir), ParallelSizes())
    carried = bridge.passthrough_hf_names(list(state.keys()))
    assert buffer in carried and len(set(carried)) == len(carried)
    assert sorted(bridge.hf_param_names() + carried) == sorted(tensors)   # the export writes every source tensor
    copy_hf_assets(hf_dir, tmp_path / "assets")
    assert torch.equal(load_file(tmp_path / "assets" / PASSTHROUGH_FILE)[buffer], torch.arange(4.0))


@pytest.mark.slow
def test_base_layout_with_a_stale_buffer_round_trips_bitwise_and_verifies(tmp_path, capsys):
    """TP=2 conversion of a tied, prefix-less Qwen3 checkpoint holding an inv_freq buffer: the export (one rank) has
    exactly the source's tensors, names and bytes, and both the source and the export verify in fp32."""
    hf_dir = _qwen3_dir(tmp_path / "hf", tied=True, prefix="", inv_freq=True)
    mcore, out = tmp_path / "mcore", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--tp", "2", "--no-progress"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(mcore), "--out", str(out), "--no-progress"]) == 0
    src, got = read_weights(hf_dir), read_weights(out)
    assert sorted(got) == sorted(src) and "layers.0.self_attn.rotary_emb.inv_freq" in got
    for name, t in src.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    for hf in (hf_dir, out):
        capsys.readouterr()
        assert main(["verify", "--hf", str(hf), "--ckpt", str(mcore)]) == 0
        report = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])
        assert report["ok"] and report["max_abs_logit_diff"] <= 1e-4


# ----- refused by name ----------------------------------------------------------------------------------------------
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_a_quantized_qwen3_checkpoint_is_refused_by_its_config_field(tmp_path, capsys):
    hf_dir = _rewrite(_qwen3_dir(tmp_path / "hf"), lambda t: {
        **t, "model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(1, 1)})
    raw = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**raw, "quantization_config": FP8}))
    _cli_refuses(tmp_path, hf_dir, capsys, ["quantization_config", "'fp8'"])


def test_a_quantized_multimodal_config_is_refused_by_its_top_level_field():
    from megatron_rl.models import ConfigMismatchError

    cfg = tiny_qwen3_5.multimodal_config(tiny_qwen3_5.tiny_config())
    cfg.quantization_config = FP8
    with pytest.raises(ConfigMismatchError, match="quantization_config"):
        spec_for(cfg).validate(cfg, ParallelSizes())


def test_the_moe_hybrid_is_refused_by_its_model_type(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_qwen3_5.tiny_model(tiny_qwen3_5.tiny_config(layers=2, layer_types=["linear_attention", "full_attention"])
                            ).save_pretrained(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3_5_moe",
                                                    "architectures": ["Qwen3_5MoeForCausalLM"]}))
    _cli_refuses(tmp_path, hf_dir, capsys, ["model_type='qwen3_5_moe'", "not supported"])


# ----- Qwen3.5 hybrid shapes ------------------------------------------------------------------------------------------
HYBRID = {
    "partial_rope_half": dict(rope={"partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}),
    "full_rope": dict(rope={"partial_rotary_factor": 1.0, "mrope_section": [3, 3, 2]}),
    "gdn_ratio_1": dict(key_heads=2, value_heads=2),
    "gdn_ratio_4": dict(key_heads=1, value_heads=4),
    "gdn_equal_head_dims": dict(key_dim=8, value_dim=8),
    "conv_2": dict(conv=2),
    "conv_3": dict(conv=3),
    "attention_first": dict(layers=3, layer_types=["full_attention", "linear_attention", "full_attention"]),
    "all_attention": dict(layers=2, layer_types=["full_attention"] * 2),
    "head_dim_not_hidden_over_heads": dict(hidden=48, kv_heads=1),
}


def _hybrid_config(name):
    kw = {"layers": 2, "layer_types": ["linear_attention", "full_attention"], **HYBRID[name]}
    return tiny_qwen3_5.tiny_config(**kw)


@pytest.mark.parametrize("name", sorted(HYBRID))
def test_hybrid_shape_table_matches_the_hf_model(name):
    cfg = _hybrid_config(name)
    spec_for(cfg).validate(cfg, ParallelSizes())
    state = tiny_qwen3_5.hf_tensors(tiny_qwen3_5.tiny_model(cfg))
    bridge = get_bridge(cfg)
    shapes = bridge.hf_shapes()
    assert {n: shapes[n] for n in state} == {n: tuple(t.shape) for n, t in state.items()}
    assert bridge.check_hf_names(list(state)) == ([], []) and bridge.check_hf_tensors(state) == []


def test_full_attention_interval_without_layer_types_is_read_as_transformers_reads_it(tmp_path):
    from megatron_rl.bridge.hf_dir import load_hf_config
    from megatron_rl.models.qwen3_5.spec import layer_types

    raw = tiny_qwen3_5.tiny_config(layers=4).to_dict()
    raw.pop("layer_types")
    raw["full_attention_interval"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_hf_config(tmp_path)
    assert layer_types(cfg) == ["linear_attention", "full_attention"] * 2


def _hybrid_parity(names):
    from megatron_rl.models import BuildOptions, build_model
    from megatron_rl.parallel import init_parallel

    torch.set_num_threads(1)
    init_parallel(1, 1)
    for name in names:
        cfg = _hybrid_config(name)
        hf = tiny_qwen3_5.tiny_model(cfg, seed=3)
        chunks = build_model(cfg, ParallelSizes(), BuildOptions(perform_initialization=False))
        get_bridge(cfg).load_hf_into(chunks, tiny_qwen3_5.hf_tensors(hf))
        tiny_qwen3_5.assert_megatron_matches_hf(chunks, hf, cfg.vocab_size, name)


@pytest.mark.slow
def test_hybrid_shapes_match_transformers_logits():
    from megatron_rl.parallel import spawn

    spawn(_hybrid_parity, 1, sorted(HYBRID))
