"""HF config validation: every unsupported field is a clear error naming the field."""
import pytest
from transformers import Qwen3Config

from megatron_rl.models import ConfigMismatchError, ParallelSizes, padded_vocab_size, spec_for


def tiny(**kw):
    base = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    base.update(kw)
    return Qwen3Config(**base)


def test_valid_config_passes():
    spec_for(tiny()).validate(tiny(), ParallelSizes(2, 2))


@pytest.mark.parametrize("kw,par,field", [
    (dict(hidden_act="gelu"), ParallelSizes(), "hidden_act"),
    (dict(attention_bias=True), ParallelSizes(), "attention_bias"),
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), ParallelSizes(), "use_sliding_window"),
    (dict(num_attention_heads=4, num_key_value_heads=2), ParallelSizes(tp=8), "num_attention_heads"),
    (dict(num_hidden_layers=3), ParallelSizes(pp=2), "num_hidden_layers"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), ParallelSizes(), "rope_type"),
])
def test_mismatch_names_field(kw, par, field):
    cfg = tiny(**kw)
    with pytest.raises(ConfigMismatchError, match=field):
        spec_for(cfg).validate(cfg, par)


def test_unknown_model_type():
    class C:
        model_type = "gpt_bigcode"
    with pytest.raises(ConfigMismatchError, match="gpt_bigcode"):
        spec_for(C())


def test_vocab_padding():
    assert padded_vocab_size(250, 1) == 256
    assert padded_vocab_size(250, 2) == 256
    assert padded_vocab_size(151936, 8) == 152576
    assert padded_vocab_size(256, 2) == 256


# ----- the Qwen3.5 hybrid -------------------------------------------------------------------------

def hybrid(**kw):
    from tests.bridge.tiny_qwen3_5 import tiny_config

    return tiny_config(**kw)


def test_hybrid_spec_maps_the_hf_fields():
    from megatron_rl.models import BuildOptions
    from megatron_rl.models.qwen3_5 import spec as q35

    cfg = hybrid(layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
    spec_for(cfg).validate(cfg, ParallelSizes(2, 2))
    tc = q35.transformer_config(cfg, ParallelSizes(), BuildOptions(use_cpu_initialization=True))
    assert tc.experimental_attention_variant == "gated_delta_net"
    assert tc.linear_attention_freq == [1, 0, 1, 1]   # any pattern layer_types can say, not only every 4th
    assert (tc.linear_num_key_heads, tc.linear_num_value_heads, tc.linear_key_head_dim,
            tc.linear_value_head_dim, tc.linear_conv_kernel_dim) == (2, 4, 8, 12, 4)
    assert tc.attention_output_gate and tc.layernorm_zero_centered_gamma and tc.qk_layernorm
    kw = q35.gpt_model_kwargs(cfg, ParallelSizes(), BuildOptions())
    assert kw["rotary_percent"] == 0.25 and kw["rotary_base"] == 1e7 and kw["vocab_size"] == 256


def test_the_gdn_output_norm_has_a_plain_gain_under_either_spec(monkeypatch):
    """HF's GDN output norm is ``x_hat * w`` while every other Qwen3.5 norm is zero-centred: `PlainGain` builds it
    plain from the zero-centred config, in our local spec and wrapped around TE's norm in megatron's TE spec
    (`plain_gdn_out_norm`, checked here on the local spec's structure: TE is not installed on CPUs)."""
    import torch
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_rl.models import BuildOptions
    from megatron_rl.models.norms import PlainGain, RMSNorm
    from megatron_rl.models.qwen3_5 import spec as q35

    from megatron.core.transformer import transformer_block, transformer_layer

    cfg = hybrid(layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
    tc = q35.transformer_config(cfg, ParallelSizes(), BuildOptions(use_cpu_initialization=True))
    # one stage holding every layer, without initialising megatron's parallel state
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, **_: 4)
    monkeypatch.setattr(transformer_layer, "get_transformer_layer_offset", lambda config, **_: 0)
    block = q35.local_block_spec(tc)
    gdn_norms = [layer.submodules.self_attention.submodules.out_norm for layer in block.layer_specs
                 if layer.submodules.self_attention.module.__name__ == "GatedDeltaNet"]
    assert len(gdn_norms) == 3 and all(n.module is PlainGain for n in gdn_norms)
    norm = build_module(gdn_norms[0], config=tc, hidden_size=12, eps=1e-6)
    assert isinstance(norm, RMSNorm) and not norm.zero_centered and tc.layernorm_zero_centered_gamma
    assert torch.equal(norm.weight, torch.ones(12))   # HF's init of a plain gain
    # a TE-style spec (the norm class straight in the GDN submodules, one mixer spec shared by its layers)
    for n in gdn_norms:
        n.module, n.params = RMSNorm, {}
    shared = block.layer_specs[0].submodules.self_attention
    shared.submodules.out_norm = RMSNorm
    for layer in block.layer_specs:
        if layer.submodules.self_attention.module.__name__ == "GatedDeltaNet":
            layer.submodules.self_attention = shared
    q35.plain_gdn_out_norm(block)
    wrapped = shared.submodules.out_norm
    assert isinstance(wrapped, ModuleSpec) and wrapped.module is PlainGain and wrapped.params == {"norm": RMSNorm}
    assert not build_module(wrapped, config=tc, hidden_size=12, eps=1e-6).zero_centered
    attention = [layer.submodules.self_attention for layer in block.layer_specs][1]
    assert attention.submodules.q_layernorm is RMSNorm   # attention's norms stay zero-centred


@pytest.mark.parametrize("kw,par,field", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     ParallelSizes(), "sliding_attention"),
    (dict(rope={"partial_rotary_factor": 0.3}), ParallelSizes(), "partial_rotary_factor"),
    (dict(value_heads=3), ParallelSizes(), "linear_num_value_heads=3 is not a multiple"),
    (dict(key_heads=2, value_heads=4), ParallelSizes(tp=4), "linear_num_key_heads=2 is not divisible by tp=4"),
    (dict(layers=6), ParallelSizes(pp=4), "num_hidden_layers=6"),
    (dict(hidden_act="gelu"), ParallelSizes(), "hidden_act"),
])
def test_hybrid_mismatch_names_field(kw, par, field):
    cfg = hybrid(**kw)
    with pytest.raises(ConfigMismatchError, match=field):
        spec_for(cfg).validate(cfg, par)


def test_hybrid_needs_fla_on_a_gpu(monkeypatch):
    from megatron.core.ssm.gated_delta_net import common

    from megatron_rl.models.qwen3_5.spec import FLA_REQUIREMENT, _require_fla

    monkeypatch.setattr(common, "HAVE_FLA", False)
    with pytest.raises(ImportError, match=FLA_REQUIREMENT.replace(".", r"\.")):
        _require_fla()


def test_tiny_model_config_builds_both_architectures():
    from megatron_rl.config import TinyModelConfig

    hyb = TinyModelConfig(num_layers=8).hf_config(300)
    assert hyb.model_type == "qwen3_5_text" and hyb.layer_types.count("full_attention") == 2
    assert TinyModelConfig(arch="qwen3").hf_config(300).model_type == "qwen3"
    with pytest.raises(ValueError, match="model.tiny.arch"):
        TinyModelConfig(arch="llama").hf_config(300)
