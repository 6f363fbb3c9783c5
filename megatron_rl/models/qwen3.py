"""Qwen3 dense (``model_type: qwen3``): GQA, QK RMSNorm, SwiGLU, RMSNorm, RoPE, tied/untied."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import BuildOptions, ConfigMismatchError, ModelSpec, ParallelSizes, padded_vocab_size, register


def _rope_theta(hf) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    if getattr(hf, "rope_theta", None) is not None:
        return float(hf.rope_theta)
    raise ConfigMismatchError("rope_theta: missing from the HF config (rope_parameters.rope_theta)")


def head_dim(hf) -> int:
    hd = getattr(hf, "head_dim", None)
    return int(hd) if hd else hf.hidden_size // hf.num_attention_heads


def validate(hf, par: ParallelSizes) -> None:
    """Reject every HF field value the local/TE GPT spec would silently compute differently."""
    problems: list[str] = []

    def need(cond: bool, msg: str):
        if not cond:
            problems.append(msg)

    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "rms_norm_eps"):
        need(getattr(hf, f, None) is not None, f"{f}: missing")
    if problems:
        raise ConfigMismatchError("invalid HF config: " + "; ".join(problems))
    need(hf.hidden_act == "silu", f"hidden_act={hf.hidden_act!r}: only 'silu' (SwiGLU) is supported")
    need(not getattr(hf, "attention_bias", False), "attention_bias=True: Qwen3 spec has no QKV bias")
    need(not getattr(hf, "use_sliding_window", False), "use_sliding_window=True: sliding-window attention is not supported")
    lt = getattr(hf, "layer_types", None)
    need(lt is None or all(t == "full_attention" for t in lt),
         f"layer_types: only 'full_attention' layers are supported, got {sorted(set(lt or []))}")
    rope = getattr(hf, "rope_parameters", None) or {}
    rtype = rope.get("rope_type", rope.get("type", "default"))
    need(rtype in (None, "default"), f"rope_parameters.rope_type={rtype!r}: only default RoPE is supported")
    need(float(rope.get("partial_rotary_factor", 1.0)) == 1.0, "rope_parameters.partial_rotary_factor must be 1.0 for Qwen3")
    need(not getattr(hf, "attention_dropout", 0.0), "attention_dropout must be 0")
    nh, ng = hf.num_attention_heads, hf.num_key_value_heads
    need(nh % ng == 0, f"num_attention_heads={nh} is not a multiple of num_key_value_heads={ng}")
    need(nh % par.tp == 0, f"num_attention_heads={nh} is not divisible by tp={par.tp}")
    need(ng % par.tp == 0 or par.tp % ng == 0,
         f"num_key_value_heads={ng} and tp={par.tp}: one must divide the other")
    need(hf.intermediate_size % par.tp == 0, f"intermediate_size={hf.intermediate_size} is not divisible by tp={par.tp}")
    need(hf.num_hidden_layers % par.pp == 0,
         f"num_hidden_layers={hf.num_hidden_layers} is not divisible by pp={par.pp}")
    if problems:
        raise ConfigMismatchError("HF config does not match the Qwen3 Megatron spec: " + "; ".join(problems))


def transformer_config(hf, par: ParallelSizes, opt: BuildOptions):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = opt.params_dtype
    kwargs = dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=opt.init_method_std,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        sequence_parallel=par.sequence_parallel and par.tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=opt.use_cpu_initialization,
        perform_initialization=opt.perform_initialization,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # only to satisfy validation; the model is dense
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        recompute_granularity=opt.recompute_granularity,
    )
    if opt.recompute_granularity == "full":
        kwargs.update(recompute_method="uniform", recompute_num_layers=opt.recompute_num_layers or 1)
    kwargs.update(opt.extra)
    return TransformerConfig(**kwargs)


def gpt_model_kwargs(hf, par: ParallelSizes, opt: BuildOptions) -> dict:
    return dict(
        vocab_size=padded_vocab_size(hf.vocab_size, par.tp, opt.vocab_pad_multiple),
        max_sequence_length=int(getattr(hf, "max_position_embeddings", 4096)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=_rope_theta(hf),
        share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def layer_spec(config, use_te: bool):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    return specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")


QWEN3 = register(ModelSpec(
    name="qwen3",
    hf_model_types=("qwen3",),
    validate=validate,
    transformer_config=transformer_config,
    gpt_model_kwargs=gpt_model_kwargs,
    layer_spec=layer_spec,
))
