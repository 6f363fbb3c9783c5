"""Qwen3 checkpoints of shapes the defaults do not exercise: the bridge's shape table against real HF
models, the spec's accept/reject decisions for real-world config fields, and one megatron-core run
per shape (HF logit parity at TP=2, bitwise export after resharding to PP=2)."""
import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron_rl.bridge import HFCheckpointError, LazyHFState, get_bridge
from megatron_rl.models import ConfigMismatchError, ParallelSizes, spec_for
from megatron_rl.parallel import spawn
from tests.bridge.tiny_qwen3 import hf_tensors, tiny_config, tiny_model

# name -> tiny_config kwargs; every one divides tp=2 and pp=2
SHAPES = {
    "head_dim_not_hidden_over_heads": dict(hidden=32, heads=4, kv_heads=2, head_dim=16),  # as Qwen3-0.6B/8B
    "mha": dict(kv_heads=4),
    "mqa": dict(kv_heads=1),  # tp=2 > kv heads
    "kv_between_tp_and_heads": dict(heads=8, kv_heads=4, head_dim=8),
    "odd_ffn": dict(ffn=3 * 64 + 2),  # divisible by tp=2 only
    "vocab_below_128_tp_tied": dict(vocab=100, tied=True),  # TP rank 1 holds padding rows only
    "vocab_odd": dict(vocab=389),
    "rope_theta_1e6": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_table_matches_the_hf_model(name):
    cfg = tiny_config(**SHAPES[name])
    state = hf_tensors(tiny_model(cfg))
    bridge = get_bridge(cfg)
    shapes = bridge.hf_shapes()
    assert {n: shapes[n] for n in state} == {n: tuple(t.shape) for n, t in state.items()}
    assert bridge.check_hf_tensors(state) == []
    assert bridge.check_hf_names(list(state)) == ([], [])


def test_tensor_problems_name_the_tensor_and_both_shapes():
    cfg = tiny_config(**SHAPES["head_dim_not_hidden_over_heads"])
    state = hf_tensors(tiny_model(cfg))
    state["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(32, 32)  # needs (32, heads*head_dim=64)
    state["model.norm.weight"] = state["model.norm.weight"].long()
    problems = get_bridge(cfg).check_hf_tensors(state)
    assert len(problems) == 2
    assert "'model.layers.1.self_attn.o_proj.weight'" in problems[1] and "(32, 32)" in problems[1] \
        and "(32, 64)" in problems[1]
    assert "'model.norm.weight'" in problems[0] and "int64" in problems[0]


def _v4_style(**fields):
    """A transformers-4 era Qwen3 config.json (as on the hub), tiny sizes."""
    raw = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 250, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
           "max_window_layers": 28, "use_sliding_window": False, "sliding_window": None, "rope_scaling": None,
           "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.51.0"}
    raw.update(fields)
    return raw


def _config(tmp_path, raw):
    from megatron_rl.bridge.hf_dir import load_hf_config

    (tmp_path / "config.json").write_text(json.dumps(raw))
    return load_hf_config(tmp_path)


@pytest.mark.parametrize("fields", [
    {},
    {"sliding_window": 4096},  # ignored while use_sliding_window is false (as in Qwen3-8B's config)
    {"layer_types": ["full_attention"] * 2},
    {"rope_scaling": None, "rope_theta": 5e5, "torch_dtype": "float16"},
    {"hidden_act": "swish"},  # transformers' ACT2FN: swish is SiLU
])
def test_real_world_config_fields_are_accepted(tmp_path, fields):
    cfg = _config(tmp_path, _v4_style(**fields))
    spec_for(cfg).validate(cfg, ParallelSizes(2, 2))
    from megatron_rl.models.qwen3.spec import rope_theta as _rope_theta

    assert _rope_theta(cfg) == float(fields.get("rope_theta", 1e6))


@pytest.mark.parametrize("fields,par,needles", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
     ParallelSizes(), ["rope_scaling", "yarn"]),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ParallelSizes(), ["rope_scaling", "linear"]),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                          "original_max_position_embeddings": 128}}, ParallelSizes(), ["rope_parameters", "yarn"]),
    ({"num_hidden_layers": 3, "max_window_layers": 3}, ParallelSizes(pp=2), ["num_hidden_layers=3", "pp=2"]),
    ({"num_hidden_layers": 6}, ParallelSizes(pp=2, vpp=2), ["num_hidden_layers=6", "vpp=2"]),
    ({}, ParallelSizes(pp=1, vpp=2), ["vpp=2", "pp > 1"]),
    ({"head_dim": 15, "num_attention_heads": 4}, ParallelSizes(), ["head_dim=15", "even"]),
    ({"num_attention_heads": 0}, ParallelSizes(), ["num_attention_heads=0"]),
])
def test_unsupported_fields_are_named(tmp_path, fields, par, needles):
    cfg = _config(tmp_path, _v4_style(**fields))
    with pytest.raises(ConfigMismatchError) as e:
        spec_for(cfg).validate(cfg, par)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_single_file_wins_over_a_stale_index_as_in_transformers(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    assert torch.equal(LazyHFState(tmp_path)["w"], torch.ones(2))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(HFCheckpointError, match="gone.safetensors"):
        LazyHFState(tmp_path)


# ----- megatron-core round trips ------------------------------------------------------------
CASES = [(name, "float32") for name in sorted(SHAPES)] + [
    ("head_dim_not_hidden_over_heads", "bfloat16"), ("vocab_below_128_tp_tied", "float16")]


def _round_trips(root):
    from ckpt_tools.forward import megatron_logits
    from ckpt_tools.verify import default_tol
    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.models import BuildOptions, build_model
    from megatron_rl.parallel import init_parallel
    from tests.bridge.tiny_qwen3 import tokens

    torch.set_num_threads(1)
    init_parallel(1, 1)
    for i, (name, dtype_name) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        cfg = tiny_config(**SHAPES[name])
        hf = tiny_model(cfg, seed=i, dtype=dtype)
        ref = hf_tensors(hf)
        path = os.path.join(root, f"{name}_{dtype_name}")
        if dist.get_rank() == 0:
            hf.save_pretrained(os.path.join(path, "hf"), max_shard_size="30KB")
        dist.barrier()
        bridge = get_bridge(cfg)
        opt = BuildOptions(params_dtype=dtype, perform_initialization=False)

        init_parallel(2, 1)
        chunks = build_model(cfg, ParallelSizes(2, 1), opt)
        bridge.load_hf_into(chunks, LazyHFState(os.path.join(path, "hf")))
        for c in chunks:
            c.eval()
        ids = tokens(cfg.vocab_size)
        got = megatron_logits(chunks, ids)[..., : cfg.vocab_size]
        with torch.no_grad():
            want = hf(ids).logits.float()
        diff = (got - want).abs().max().item()
        tol = default_tol(dtype, want.abs().max().item())
        assert diff <= tol, f"{name} {dtype_name}: max logit diff {diff} > {tol}"
        save_checkpoint(os.path.join(path, "mcore"), 0, chunks, hf_config=cfg)

        init_parallel(1, 2)
        chunks = build_model(cfg, ParallelSizes(1, 2), opt)
        load_checkpoint(os.path.join(path, "mcore"), chunks, load_optimizer=False)
        exported = dict(bridge.export_hf(chunks))
        assert sorted(exported) == sorted(n for n in ref if not (cfg.tie_word_embeddings and n == "lm_head.weight"))
        for n, t in exported.items():
            assert t.dtype == dtype and torch.equal(t, ref[n]), f"{name} {dtype_name}: {n} differs"


@pytest.mark.slow
def test_every_shape_round_trips_through_megatron(tmp_path):
    spawn(_round_trips, 2, str(tmp_path))
