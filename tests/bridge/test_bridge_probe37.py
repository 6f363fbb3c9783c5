"""Bridge probe 37: HF checkpoints of shapes and layouts nobody tuned for, checked against transformers' own classes.

Found and fixed:
- An index whose ``weight_map`` gives a tensor something other than a file name (``null``, a number, a list) crashed
  ``hf-to-mcore`` with a TypeError traceback; it is now refused naming the index and the tensor.
- A tied multimodal checkpoint storing an ``lm_head.weight`` that differs from the embedding, under a config whose
  top-level ``tie_word_embeddings`` is false and whose ``text_config`` says true, was refused with "config.json ties
  them (tie_word_embeddings=true)", the opposite of the top-level field a reader sees: the message now names
  ``text_config.tie_word_embeddings`` and the top-level flag.
- An index that lists a tensor in a shard it is not in said so without saying where the tensor is; a tensor left in a
  shard that the index does not list, and that the config does not use, was refused without naming its file. Both
  messages now name the file holding the tensor.
- A missing ``lm_head.weight`` under an untied config (a checkpoint saved tied), and a tied checkpoint that stores the
  shared matrix only as ``lm_head.weight`` (transformers ties it back into the embedding), were reported as missing
  tensors alone: both now name ``tie_word_embeddings``.

Held and pinned (each checked against transformers' model, logits and export):
- Qwen3.5 configs: transformers-4 style RoPE (``rope_theta`` / ``partial_rotary_factor`` beside the fields,
  ``rope_scaling`` holding the mRoPE sections), ``rope_parameters`` without ``partial_rotary_factor`` (transformers'
  0.25), ``full_attention_interval`` alone with a layer count that is not a multiple of it, legacy layer type names,
  ``mtp_num_hidden_layers`` 0 and 2, a hub-style multimodal config (vision ``model_type: qwen3_5``); tied embeddings,
  conv kernels 1/3/5, key head dims above the value head dims, ``head_dim`` above hidden/heads, every head a KV head,
  at TP=2 and (interval-only, tied) at PP=2.
- Refused by field: ``attn_output_gate=false``, ``attention_bias=true`` with its bias tensors present, yarn in a
  transformers-4 ``rope_scaling``, Qwen3 sliding windows.
- Layouts: duplicated tensors across shards; a model tensor a shard holds but the index omits (transformers loads it
  too) is converted and written back where it was; a hub-style tied multimodal release in shards with ``lm_head.weight``
  stored, two MTP layers, a bf16 vision tower and ``torch_dtype`` only: TP=2 conversion, byte-identical shard files and
  index on export, verified at PP=2.
"""
import filecmp
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools.__main__ import main
from megatron_rl.bridge import HFCheckpointError, LazyHFState, get_bridge
from megatron_rl.models import ConfigMismatchError, ParallelSizes, spec_for
from tests.bridge import tiny_qwen3, tiny_qwen3_5
from tests.bridge.test_bridge_probe35 import _sharded_qwen3
from tests.bridge.test_bridge_probe36 import _refused
from tests.bridge.tiny_qwen3 import read_weights

MM = "model.language_model."
TWO = ["linear_attention", "full_attention"]


def _write_config(d, raw):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw))
    return d


def _index(d):
    return json.loads((d / "model.safetensors.index.json").read_text())


def _write_index(d, index):
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


# ----- Qwen3.5 config fields: read as transformers reads them ---------------------------------------------------------
def _v4_rope(t):
    """transformers-4 style: no rope_parameters, theta and partial factor beside the other fields."""
    t.pop("rope_parameters")
    t.update(rope_theta=5e5, partial_rotary_factor=0.5)


def _v4_rope_scaling(t):
    t.pop("rope_parameters")
    t.update(rope_theta=5e5, partial_rotary_factor=0.5,
             rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True})


HYBRID_FIELDS = {
    "v4_rope_beside_the_fields": _v4_rope,
    "v4_rope_scaling_with_mrope": _v4_rope_scaling,
    "rope_parameters_without_partial_factor": lambda t: t["rope_parameters"].pop("partial_rotary_factor"),
    "interval_3_of_4_layers": lambda t: (t.pop("layer_types"), t.update(full_attention_interval=3)),
    "interval_4_of_6_layers": lambda t: (t.pop("layer_types"),
                                         t.update(full_attention_interval=4, num_hidden_layers=6)),
    "full_attention_first_and_last": lambda t: t.update(layer_types=["full_attention", "linear_attention",
                                                                     "linear_attention", "full_attention"]),
    "legacy_layer_type_names": lambda t: t.update(layer_types=["mamba", "mamba", "mamba", "attention"]),
    "mtp_0": lambda t: t.update(mtp_num_hidden_layers=0),
    "mtp_2": lambda t: t.update(mtp_num_hidden_layers=2, mtp_use_dedicated_embeddings=False),
    "explicit_gate_and_ssm_dtype": lambda t: t.update(attn_output_gate=True, mamba_ssm_dtype="float32"),
    "tied_head_dim_32": lambda t: t.update(tie_word_embeddings=True, head_dim=32),
}


def _hybrid_raw(edit, multimodal=False):
    text = tiny_qwen3_5.tiny_config(layers=4).to_dict()
    edit(text)
    if not multimodal:
        return text
    raw = tiny_qwen3_5.multimodal_config(tiny_qwen3_5.tiny_config(layers=4)).to_dict()
    raw["text_config"] = text
    raw["vision_config"]["model_type"] = "qwen3_5"   # as the hub's early configs name it (transformers renames it)
    raw["tie_word_embeddings"] = text.get("tie_word_embeddings", False)
    return raw


@pytest.mark.parametrize("multimodal", [False, True])
@pytest.mark.parametrize("name", sorted(HYBRID_FIELDS))
def test_hybrid_config_fields_map_as_transformers_builds_the_model(tmp_path, name, multimodal):
    """The spec reads the layer pattern, RoPE theta and rotary share, and tensor shapes the way transformers' model is
    built from the same config.json: the inverse frequencies Megatron computes equal HF's rotary buffer exactly."""
    from transformers import Qwen3_5ForCausalLM

    from megatron_rl.bridge.hf_dir import load_hf_config
    from megatron_rl.models import BuildOptions
    from megatron_rl.models.qwen3_5.spec import layer_types, text_config

    cfg = load_hf_config(_write_config(tmp_path, _hybrid_raw(HYBRID_FIELDS[name], multimodal)))
    spec_for(cfg).validate(cfg, ParallelSizes(2))
    text = text_config(cfg)
    hf = Qwen3_5ForCausalLM(text)
    assert layer_types(cfg) == ["linear_attention" if hasattr(layer, "linear_attn") else "full_attention"
                                for layer in hf.model.layers]
    kw = spec_for(cfg).gpt_model_kwargs(cfg, ParallelSizes(), BuildOptions())
    head = text.head_dim
    dim = int(head * kw["rotary_percent"])
    inv_freq = 1.0 / (kw["rotary_base"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    assert torch.equal(inv_freq, hf.model.rotary_emb.inv_freq)
    assert kw["share_embeddings_and_output_weights"] == text.tie_word_embeddings
    state = tiny_qwen3_5.hf_tensors(hf)
    if multimodal:
        state = {(MM + n[len("model."):] if n.startswith("model.") else n): t for n, t in state.items()}
    bridge = get_bridge(cfg, hf_names=state)
    shapes = bridge.hf_shapes()
    assert {n: shapes[n] for n in state} == {n: tuple(t.shape) for n, t in state.items()}
    assert bridge.check_hf_names(list(state)) == ([], [])


HYBRID_REFUSED = {
    "attn_output_gate_false": (lambda t: t.update(attn_output_gate=False), ["attn_output_gate=false"]),
    "yarn_in_v4_rope_scaling": (lambda t: (t.pop("rope_parameters"), t.update(
        rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                      "mrope_section": [1, 1, 0]})), ["rope_scaling", "yarn"]),
    "odd_rotary_dims": (lambda t: t["rope_parameters"].update(partial_rotary_factor=0.3125),   # 5 of 16 dims
                        ["partial_rotary_factor=0.3125", "even number of rotary dims"]),
    "linear_value_heads_not_a_multiple": (lambda t: t.update(linear_num_key_heads=2, linear_num_value_heads=5),
                                          ["linear_num_value_heads=5"]),
}


@pytest.mark.parametrize("name", sorted(HYBRID_REFUSED))
def test_hybrid_fields_the_spec_cannot_compute_are_refused_by_name(tmp_path, name):
    from megatron_rl.bridge.hf_dir import load_hf_config

    edit, needles = HYBRID_REFUSED[name]
    cfg = load_hf_config(_write_config(tmp_path, _hybrid_raw(edit)))
    with pytest.raises(ConfigMismatchError) as e:
        spec_for(cfg).validate(cfg, ParallelSizes())
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_attention_bias_with_its_bias_tensors_is_refused_by_the_field(tmp_path, capsys, arch):
    """A checkpoint saved with attention_bias=true holds q/k/v/o biases: named by the config field, not as tensors the
    config does not use."""
    if arch == "qwen3":
        model = tiny_qwen3.tiny_model(tiny_qwen3.tiny_config(attention_bias=True))
    else:
        model = tiny_qwen3_5.tiny_model(tiny_qwen3_5.tiny_config(layers=2, layer_types=TWO, attention_bias=True))
    model.save_pretrained(tmp_path / "hf")
    assert any(n.endswith("q_proj.bias") for n in read_weights(tmp_path / "hf"))
    _refused(tmp_path, tmp_path / "hf", capsys, ["attention_bias=True"], absent=["does not use"])


@pytest.mark.parametrize("fields,needles", [
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, ["use_sliding_window=True"]),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, "rope_theta": 1e6},
     ["rope_scaling", "yarn"]),
])
def test_qwen3_sliding_windows_and_yarn_are_refused_by_name(tmp_path, capsys, fields, needles):
    hf_dir = tmp_path / "hf"
    tiny_qwen3.tiny_model(tiny_qwen3.tiny_config(), seed=1).save_pretrained(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    if "rope_scaling" in fields:
        raw.pop("rope_parameters", None)
    (hf_dir / "config.json").write_text(json.dumps({**raw, **fields}))
    _refused(tmp_path, hf_dir, capsys, needles)


# ----- index and shard layouts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [None, 3, ["model-00001-of-00007.safetensors"], ""])
def test_an_index_entry_that_is_not_a_file_name_is_refused_naming_it(tmp_path, capsys, value):
    hf_dir = _sharded_qwen3(tmp_path / "hf")
    index = _index(hf_dir)
    index["weight_map"]["model.norm.weight"] = value
    _write_index(hf_dir, index)
    with pytest.raises(HFCheckpointError, match=r"model.safetensors.index.json: weight_map\['model.norm.weight'\]"):
        LazyHFState(hf_dir)
    _refused(tmp_path, hf_dir, capsys,
             ["model.safetensors.index.json", "'model.norm.weight'", "not a safetensors file"])


def test_an_index_naming_the_wrong_shard_says_where_the_tensor_is(tmp_path, capsys):
    hf_dir = _sharded_qwen3(tmp_path / "hf")
    index = _index(hf_dir)
    actual = index["weight_map"]["model.norm.weight"]
    listed = next(f for f in sorted(set(index["weight_map"].values())) if f != actual)
    index["weight_map"]["model.norm.weight"] = listed
    _write_index(hf_dir, index)
    _refused(tmp_path, hf_dir, capsys, [f"{hf_dir / listed}: model.safetensors.index.json lists 'model.norm.weight'",
                                        f"(it is in {actual})"])


def test_duplicated_tensors_across_shards_are_refused_naming_both_files(tmp_path, capsys):
    hf_dir = _sharded_qwen3(tmp_path / "hf")
    files = sorted(set(_index(hf_dir)["weight_map"].values()))
    first, second = load_file(hf_dir / files[0]), load_file(hf_dir / files[1])
    name = sorted(second)[0]
    save_file({**first, name: second[name]}, str(hf_dir / files[0]), metadata={"format": "pt"})
    _refused(tmp_path, hf_dir, capsys, [files[0], files[1], repr(name), "also appears"])


def test_a_tensor_a_shard_holds_but_the_index_omits(tmp_path, capsys):
    """A model tensor left out of the index is loaded from its shard (as transformers does) and the recorded layout
    writes it back there; a tensor the config does not use is refused naming its file and the index."""
    from megatron_rl.bridge.hf_dir import check_hf_input, save_source_layout
    from megatron_rl.bridge.hf_dir import load_source_weight_map

    hf_dir = _sharded_qwen3(tmp_path / "hf")
    index = _index(hf_dir)
    shard = index["weight_map"].pop("model.norm.weight")
    _write_index(hf_dir, index)
    _cfg, _bridge, state = check_hf_input(str(hf_dir), ParallelSizes())
    assert state.unlisted == ["model.norm.weight"]
    save_source_layout(hf_dir, tmp_path / "assets")
    assert load_source_weight_map(tmp_path / "assets")["model.norm.weight"] == shard

    tensors = load_file(hf_dir / shard)
    save_file({**tensors, "model.extra_head.weight": torch.ones(4)}, str(hf_dir / shard), metadata={"format": "pt"})
    _refused(tmp_path, hf_dir, capsys, ["does not use", "'model.extra_head.weight'",
                                        f"is in {shard}, which model.safetensors.index.json does not list"])


# ----- tied output layers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_tied", [True, False])
def test_a_tied_multimodal_lm_head_that_differs_names_the_flag_the_language_model_reads(tmp_path, capsys, top_tied):
    from tests.bridge.test_bridge_other_layouts import _save_names

    text = tiny_qwen3_5.tiny_config(layers=2, layer_types=TWO, tied=True)
    mm = tiny_qwen3_5.multimodal_config(text)
    mm.tie_word_embeddings = top_tied
    tensors = tiny_qwen3_5.multimodal_tensors(tiny_qwen3_5.tiny_model(text, seed=3), mm)
    tensors["lm_head.weight"] = tensors[MM + "embed_tokens.weight"] + 0.5   # what an untied class would save
    hf_dir = _save_names(tmp_path / "hf", mm, tensors)
    needles = ["'lm_head.weight' differs", "text_config.tie_word_embeddings=true"]
    if not top_tied:
        needles += ["top-level tie_word_embeddings=false", "set text_config.tie_word_embeddings to false"]
    _refused(tmp_path, hf_dir, capsys, needles)


def test_a_plain_tied_lm_head_that_differs_names_tie_word_embeddings(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    tiny_qwen3.tiny_model(tiny_qwen3.tiny_config(tied=True), seed=1).save_pretrained(hf_dir)
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].to(torch.bfloat16).float()   # rounded: differs
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    _refused(tmp_path, hf_dir, capsys, ["'lm_head.weight' differs", "ties them (tie_word_embeddings=true)"],
             absent=["text_config"])


def test_a_missing_output_layer_or_embedding_names_the_tie_flag(tmp_path, capsys):
    """An untied config over a checkpoint saved tied (no lm_head.weight), and a tied checkpoint that stores the shared
    matrix only as lm_head.weight (transformers ties it back into the embedding): both name the flag."""
    untied = tmp_path / "untied"
    tiny_qwen3.tiny_model(tiny_qwen3.tiny_config(tied=True), seed=1).save_pretrained(untied)
    raw = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": False}))
    _refused(tmp_path, untied, capsys, ["missing", "['lm_head.weight']", "tie_word_embeddings=false",
                                        "set tie_word_embeddings to true"])

    head_only = tmp_path / "head_only"
    tiny_qwen3.tiny_model(tiny_qwen3.tiny_config(tied=True), seed=1).save_pretrained(head_only)
    tensors = load_file(head_only / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(head_only / "model.safetensors"), metadata={"format": "pt"})
    _refused(tmp_path, head_only, capsys, ["missing", "['model.embed_tokens.weight']",
                                           "holds 'lm_head.weight', the tied copy of 'model.embed_tokens.weight' "
                                           "(tie_word_embeddings=true)"])


# ----- dtype declared in one key only ---------------------------------------------------------------------------------
@pytest.mark.parametrize("where,key,declared,warns", [
    ("top", "torch_dtype", "bfloat16", False),
    ("top", "dtype", "float32", True),
    ("text", "dtype", "bfloat16", False),
    ("text", "torch_dtype", "float16", False),   # only the top-level declaration is compared with the weights
])
def test_the_dtype_comes_from_the_weights_whichever_key_declares_one(tmp_path, capsys, where, key, declared, warns):
    from ckpt_tools.convert import _resolve_dtype
    from megatron_rl.bridge.hf_dir import check_hf_input
    from tests.bridge.test_bridge_other_layouts import _save_hf

    hf_dir = _save_hf(tmp_path / "hf", gdn_fp32=True, multimodal=True)   # bf16 LM, fp32 A_log, bf16 vision
    raw = json.loads((hf_dir / "config.json").read_text())
    for d in (raw, raw["text_config"]):
        d.pop("dtype", None)
        d.pop("torch_dtype", None)
    (raw if where == "top" else raw["text_config"])[key] = declared
    (hf_dir / "config.json").write_text(json.dumps(raw))
    cfg, bridge, state = check_hf_input(str(hf_dir), ParallelSizes())
    capsys.readouterr()
    assert _resolve_dtype(None, cfg, state, bridge) == torch.bfloat16
    err = capsys.readouterr().err
    assert "mix dtypes" not in err
    assert ("declares dtype float32 but the weights are bfloat16" in err) == warns, err


# ----- megatron-core: logits against transformers, bitwise export -----------------------------------------------------
#: name -> tiny_qwen3_5.tiny_config kwargs (two layers, GDN then attention, unless given); run at TP=2
TP2_SHAPES = {
    "tied_conv3_head_dim_32": dict(tied=True, conv=3, head_dim=32),
    "conv1": dict(conv=1),
    "conv5_gdn_ratio_1": dict(conv=5, key_heads=2, value_heads=2),
    "key_dim_above_value_dim": dict(key_dim=16, value_dim=8),
    "every_head_a_kv_head_half_rope": dict(kv_heads=4, rope={"partial_rotary_factor": 0.5}),
    "vocab_below_128_tied": dict(vocab=100, tied=True),
}


def _untuned_hybrids(names):
    from megatron_rl.models import BuildOptions, build_model
    from megatron_rl.parallel import init_parallel

    torch.set_num_threads(1)
    opt = BuildOptions(perform_initialization=False)
    init_parallel(2, 1)
    for name in names:
        cfg = tiny_qwen3_5.tiny_config(**{"layers": 2, "layer_types": TWO, **TP2_SHAPES[name]})
        hf = tiny_qwen3_5.tiny_model(cfg, seed=7)
        ref = tiny_qwen3_5.hf_tensors(hf)
        chunks = build_model(cfg, ParallelSizes(2, 1), opt)
        bridge = get_bridge(cfg)
        bridge.load_hf_into(chunks, ref)
        tiny_qwen3_5.assert_megatron_matches_hf(chunks, hf, cfg.vocab_size, name, bridge, ref)
    # six layers from the default interval (GDN x3, attention, GDN x2), tied: PP=2 gives each stage one pattern
    init_parallel(1, 2)
    cfg = tiny_qwen3_5.tiny_config(layers=6, tied=True)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    hf = tiny_qwen3_5.tiny_model(cfg, seed=8)
    ref = tiny_qwen3_5.hf_tensors(hf)
    chunks = build_model(cfg, ParallelSizes(1, 2), opt)
    bridge = get_bridge(cfg)
    bridge.load_hf_into(chunks, ref)
    tiny_qwen3_5.assert_megatron_matches_hf(chunks, hf, cfg.vocab_size, "interval_4_of_6_layers_tied_pp2", bridge, ref)


@pytest.mark.slow
def test_untuned_hybrid_shapes_match_transformers_at_tp2_and_pp2():
    from megatron_rl.parallel import spawn

    spawn(_untuned_hybrids, 2, sorted(TP2_SHAPES))


def _hub_style_release(d):
    """A tied multimodal release as the hub's small Qwen3.5 ship it, in three shards: bf16 language model with fp32
    A_log/dt_bias, a bf16 vision tower, two MTP layers, ``lm_head.weight`` stored though tied, a transformers-4 style
    text_config (theta and partial factor beside the fields) and ``torch_dtype`` only."""
    text = tiny_qwen3_5.tiny_config(layers=4, tied=True, mtp_num_hidden_layers=2)
    model = tiny_qwen3_5.tiny_model(text, seed=9, dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            p.data = p.data.float()
    mm = tiny_qwen3_5.multimodal_config(text)
    tensors = tiny_qwen3_5.multimodal_tensors(model, mm)
    h = text.hidden_size
    tensors["mtp.layers.1.mlp.down_proj.weight"] = torch.randn(h, 8, generator=torch.Generator().manual_seed(1))
    tensors["lm_head.weight"] = tensors[MM + "embed_tokens.weight"].clone()
    names = sorted(tensors)
    d.mkdir(parents=True)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = names[i::3]
        save_file({n: tensors[n] for n in part}, str(d / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    _write_index(d, {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))})
    raw = mm.to_dict()
    for cfg in (raw, raw["text_config"], raw["vision_config"]):
        cfg.pop("dtype", None)
    raw["torch_dtype"] = "bfloat16"
    raw["vision_config"]["model_type"] = "qwen3_5"
    t = raw["text_config"]
    rope = t.pop("rope_parameters")
    t.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
             full_attention_interval=4, mlp_only_layers=[], attn_output_gate=True,
             rope_scaling={"rope_type": "default", "mrope_section": rope["mrope_section"], "mrope_interleaved": True})
    (d / "config.json").write_text(json.dumps(raw, indent=2))
    return d, tensors


@pytest.mark.slow
def test_hub_style_tied_multimodal_release_round_trips_its_files_and_verifies(tmp_path, capsys):
    hf_dir, tensors = _hub_style_release(tmp_path / "hf")
    mcore, out = tmp_path / "mcore", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--tp", "2", "--no-progress"]) == 0
    meta = json.loads((mcore / "iter_0000000" / "meta.json").read_text())
    assert meta["params_dtype"] == "bfloat16"
    assert main(["mcore-to-hf", "--ckpt", str(mcore), "--out", str(out), "--no-progress"]) == 0
    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    for f in files:
        assert filecmp.cmp(hf_dir / f, out / f, shallow=False), f
    assert _index(out)["weight_map"] == _index(hf_dir)["weight_map"]
    got = read_weights(out)
    assert got["lm_head.weight"].dtype == torch.bfloat16
    assert got[MM + "layers.0.linear_attn.A_log"].dtype == torch.float32
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["text_config"]["tie_word_embeddings"]
    assert cfg["text_config"]["rope_parameters"]["partial_rotary_factor"] == 0.25
    capsys.readouterr()
    assert main(["verify", "--hf", str(out), "--ckpt", str(mcore), "--pp", "2"]) == 0
    report = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])
    assert report["ok"] and report["max_abs_logit_diff"] <= 1e-4 and report["checkpoint_dtype"] == "bfloat16"
