"""Qwen3.5 / Qwen3.6 hybrid (``qwen3_5_text``, and the released multimodal ``qwen3_5``): HF config ->
TransformerConfig, GPTModel arguments and the layer spec, on megatron-core's own hybrid support.

The decoder interleaves Gated DeltaNet layers (``layer_types[i] == "linear_attention"``) with gated
full-attention layers. megatron-core 0.19 models both: ``experimental_attention_variant=
"gated_delta_net"`` with ``linear_attention_freq`` as the per-layer pattern builds its
``GatedDeltaNet`` module, and ``attention_output_gate`` the sigmoid output gate of attention. Further:
QK RMSNorm, partial RoPE (``partial_rotary_factor`` of the head, theta from the config), zero-centred
norms ``(1 + w)`` as in HF, and a plain gain for the GDN output norm as in HF (megatron would apply
``layernorm_zero_centered_gamma`` to it too; `PlainGain` builds it without), ``A_log`` and ``dt_bias`` kept in
fp32.

Layer spec: with TransformerEngine, megatron's
``get_transformer_block_with_experimental_attention_variant_spec``. Without it (CPU, or GPUs without TE),
megatron asserts TE; `local_block_spec` assembles the same per-layer modules from megatron's local
building blocks (``GatedDeltaNet``, ``SelfAttention``, ``MLP``, Column/RowParallelLinear) with our
zero-centred `RMSNorm`. The GDN kernels come from fla-core on a GPU and from torch references on CPU
(`megatron_rl.parallel.cpu_compat`).

Text-only RoPE: with the same position for the three mRoPE sections, HF's (interleaved) mRoPE is
plain 1-D RoPE over the first ``partial_rotary_factor * head_dim`` dims, which is what Megatron computes.
"""
from __future__ import annotations

import torch

from ..norms import PlainGain, RMSNorm
from ..qwen3.spec import (decoder_problems, head_dim, partial_rotary_factor, quantization_problems, rope_problems,
                          rope_theta, transformer_config_kwargs)
from ..spec import BuildOptions, ConfigMismatchError, ParallelSizes, padded_vocab_size

LINEAR, FULL = "linear_attention", "full_attention"
GDN_SIZES = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
             "linear_conv_kernel_dim")
#: pip requirement for the GDN kernels on a GPU. megatron-core 0.19 imports ``fla.modules.convolution``, which
#: fla-core 0.6 moved. fla-core 0.5.x refuses the gated backward on Hopper with Triton < 3.7.1 (fla issue #640,
#: a Triton miscompilation of ``chunk_bwd_dqkwg`` with BK=64 tiles); 0.4.2 tiles Qwen3.5's 128-wide heads at
#: BK=128 on Hopper, outside the miscompiled case. tests/models/test_qwen3_5_gpu.py checks its forward and
#: every gradient against the torch reference on the GPU.
FLA_REQUIREMENT = "fla-core==0.4.2"


def text_config(hf):
    """The language model's config: the config itself, or ``text_config`` of the multimodal one."""
    return hf.text_config if getattr(hf, "model_type", None) == "qwen3_5" else hf


def layer_types(hf) -> list[str]:
    cfg = text_config(hf)
    types = getattr(cfg, "layer_types", None)
    if types is None:  # older configs: every full_attention_interval-th layer is attention
        interval = int(getattr(cfg, "full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(cfg.num_hidden_layers)]
    return list(types)


def validate(hf, par: ParallelSizes) -> None:
    """Reject every HF field the hybrid spec would compute differently, naming the field."""
    cfg = text_config(hf)
    problems = decoder_problems(cfg, par, extra_sizes=GDN_SIZES) + quantization_problems(hf, cfg)
    types = layer_types(hf)
    if len(types) != cfg.num_hidden_layers:
        problems.append(f"layer_types: {len(types)} entries for num_hidden_layers={cfg.num_hidden_layers}")
    unknown = sorted(set(types) - {LINEAR, FULL})
    if unknown:
        problems.append(f"layer_types: {unknown} cannot be expressed (only {LINEAR!r} and {FULL!r} layers)")
    problems += rope_problems(cfg, partial_allowed=True)
    if getattr(cfg, "attn_output_gate", True) is not True:
        problems.append("attn_output_gate=false: the spec's attention always has the output gate")
    ssm_dtype = getattr(cfg, "mamba_ssm_dtype", "float32")
    if ssm_dtype not in (None, "float32"):
        problems.append(f"mamba_ssm_dtype={ssm_dtype!r}: the GDN state and A_log/dt_bias are fp32 here")
    if getattr(cfg, "linear_conv_bias", False):
        problems.append("linear_conv_bias=true: the GDN convolution has no bias in this spec")
    nk, nv = getattr(cfg, "linear_num_key_heads", None), getattr(cfg, "linear_num_value_heads", None)
    if nk and nv:
        if nv % nk:
            problems.append(f"linear_num_value_heads={nv} is not a multiple of linear_num_key_heads={nk}")
        if nk % par.tp:
            problems.append(f"linear_num_key_heads={nk} is not divisible by tp={par.tp}")
        if nv % par.tp:
            problems.append(f"linear_num_value_heads={nv} is not divisible by tp={par.tp}")
    if problems:
        raise ConfigMismatchError("HF config does not match the Qwen3.5 hybrid Megatron spec: " + "; ".join(problems))


def transformer_config(hf, par: ParallelSizes, opt: BuildOptions):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = text_config(hf)
    return TransformerConfig(**transformer_config_kwargs(
        cfg, par, opt,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1 if t == LINEAR else 0 for t in layer_types(hf)],
        linear_conv_kernel_dim=int(cfg.linear_conv_kernel_dim),
        linear_key_head_dim=int(cfg.linear_key_head_dim),
        linear_value_head_dim=int(cfg.linear_value_head_dim),
        linear_num_key_heads=int(cfg.linear_num_key_heads),
        linear_num_value_heads=int(cfg.linear_num_value_heads),
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
    ))


def gpt_model_kwargs(hf, par: ParallelSizes, opt: BuildOptions) -> dict:
    cfg = text_config(hf)
    return dict(
        vocab_size=padded_vocab_size(cfg.vocab_size, par.tp, opt.vocab_pad_multiple),
        max_sequence_length=int(getattr(cfg, "max_position_embeddings", 4096)),
        position_embedding_type="rope",
        rotary_percent=partial_rotary_factor(cfg),
        rotary_base=rope_theta(cfg),
        share_embeddings_and_output_weights=tied_embeddings(hf),
    )


def tied_embeddings(hf) -> bool:
    cfg = text_config(hf)
    return bool(getattr(cfg, "tie_word_embeddings", getattr(hf, "tie_word_embeddings", False)))


def layer_spec(config, use_te: bool, vp_stage=None, pp_rank=None):
    if torch.cuda.is_available():
        _require_fla()
    if use_te:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec)

        return plain_gdn_out_norm(get_transformer_block_with_experimental_attention_variant_spec(
            config, vp_stage=vp_stage, pp_rank=pp_rank))
    return local_block_spec(config, vp_stage, pp_rank)


def plain_gdn_out_norm(block_spec):
    """megatron's TE hybrid block spec with each GDN output norm built by `PlainGain` (HF's plain gain)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.spec_utils import ModuleSpec

    for layer in block_spec.layer_specs:
        mixer = layer.submodules.self_attention
        if getattr(mixer, "module", None) is GatedDeltaNet:
            norm = mixer.submodules.out_norm
            if getattr(norm, "module", None) is not PlainGain:   # layers may share one mixer spec
                mixer.submodules.out_norm = ModuleSpec(module=PlainGain, params={"norm": norm})
    return block_spec


def _require_fla() -> None:
    from megatron.core.ssm.gated_delta_net import common

    if not common.HAVE_FLA:
        raise ImportError(f"Qwen3.5's Gated DeltaNet layers need flash-linear-attention's kernels on a GPU: "
                          f"pip install {FLA_REQUIREMENT} (megatron-core could not import fla)")


def local_block_spec(config, vp_stage=None, pp_rank=None):
    """The hybrid block from megatron's local modules: per global layer a GDN or a gated-attention
    token mixer, a SwiGLU MLP, and our zero-centred RMSNorm wherever TE would fuse a norm."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import (TransformerLayer, TransformerLayerSubmodules,
                                                             get_transformer_layer_offset)

    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=ModuleSpec(module=PlainGain, params={"norm": RMSNorm}),
        out_proj=RowParallelLinear))
    attention = ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=SelfAttentionSubmodules(
                               linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                               linear_proj=RowParallelLinear, q_layernorm=RMSNorm, k_layernorm=RMSNorm))
    mlp = get_mlp_module_spec_for_backend(backend=LocalSpecProvider())

    def layer(mixer):
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm, self_attention=mixer, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm, mlp=mlp, mlp_bda=get_bias_dropout_add))

    per_layer = [layer(gdn if linear else attention) for linear in get_linear_attention_pattern(config)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=per_layer[offset:offset + count], layer_norm=RMSNorm)


__all__ = ["FLA_REQUIREMENT", "head_dim", "layer_spec", "layer_types", "local_block_spec", "text_config",
           "tied_embeddings", "validate"]
