"""Name tables of the Qwen3 bridge against transformers' real parameter names (no processes)."""
import pytest

from megatron_rl.bridge import BridgeError, get_bridge
from megatron_rl.models import ConfigMismatchError
from tests.bridge.tiny_qwen3 import hf_tensors, tiny_config, tiny_model


@pytest.mark.parametrize("tied", [False, True])
def test_hf_names_are_exactly_the_checkpoint_tensors_in_layer_order(tied):
    cfg = tiny_config(tied=tied, layers=3)
    names = get_bridge(cfg).hf_param_names(cfg)
    assert sorted(names) == sorted(hf_tensors(tiny_model(cfg)))
    assert len(set(names)) == len(names)
    assert names[0] == "model.embed_tokens.weight"
    assert names[-1] == ("model.norm.weight" if tied else "lm_head.weight")
    layer_of = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layer_of == sorted(layer_of)  # layer 0 entirely before layer 1, ...


def test_check_hf_names_reports_missing_and_unexpected():
    cfg = tiny_config(tied=True)
    bridge = get_bridge(cfg)
    names = bridge.hf_param_names()
    missing, unexpected = bridge.check_hf_names(names[1:] + ["model.layers.7.mlp.up_proj.weight"])
    assert missing == ["model.embed_tokens.weight"]
    assert unexpected == ["model.layers.7.mlp.up_proj.weight"]
    # a tied checkpoint may carry lm_head.weight (checked for equality at load) and stale rotary buffers
    ok = names + ["lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert bridge.check_hf_names(ok) == ([], [])
    untied = get_bridge(tiny_config(tied=False))
    assert untied.check_hf_names(names) == (["lm_head.weight"], [])


def test_local_and_te_spec_names_resolve_to_the_same_hf_tensor():
    bridge = get_bridge(tiny_config(layers=4))
    local = bridge._resolve("decoder.layers.1.input_layernorm.weight", layer_offset=2, num_local_layers=2)
    te = bridge._resolve("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", 2, 2)
    assert local.hf_names == te.hf_names == ("model.layers.3.input_layernorm.weight",)
    mlp_norm = bridge._resolve("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", 2, 2)
    assert mlp_norm.hf_names == ("model.layers.2.post_attention_layernorm.weight",)
    qkv = bridge._resolve("decoder.layers.0.self_attention.linear_qkv.weight", 0, 2)
    assert qkv.hf_names == tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")


def test_tied_output_layer_loads_from_the_embedding_and_is_not_exported():
    bridge = get_bridge(tiny_config(tied=True))
    unit = bridge._resolve("output_layer.weight", 0, 0)
    assert unit.hf_names == ("model.embed_tokens.weight",) and not unit.mapping.export
    assert bridge.duplicate_hf_names() == {"lm_head.weight": "model.embed_tokens.weight"}


def test_unknown_parameters_and_layers_are_errors():
    bridge = get_bridge(tiny_config())
    with pytest.raises(BridgeError, match="linear_fc3"):
        bridge._resolve("decoder.layers.0.mlp.linear_fc3.weight", 0, 2)
    with pytest.raises(BridgeError, match="mtp.fc.weight"):
        bridge._resolve("mtp.fc.weight", 0, 2)
    with pytest.raises(BridgeError, match="local layer 2"):
        bridge._resolve("decoder.layers.2.input_layernorm.weight", 0, 2)


def test_unsupported_model_type():
    class Cfg:
        model_type = "llama"
        num_hidden_layers = 2

    with pytest.raises(ConfigMismatchError, match="llama"):
        get_bridge(Cfg())
