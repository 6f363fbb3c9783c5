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
    (dict(use_sliding_window=True, sliding_window=16), ParallelSizes(), "use_sliding_window"),
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
