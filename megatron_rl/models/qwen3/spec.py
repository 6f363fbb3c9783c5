"""Qwen3 dense (``model_type: qwen3``): HF config -> TransformerConfig, GPTModel arguments, layer spec.

GQA, QK RMSNorm, SwiGLU, RMSNorm, RoPE, tied/untied embeddings.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import BuildOptions, ConfigMismatchError, ParallelSizes, padded_vocab_size


def rope_theta(hf) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    if getattr(hf, "rope_theta", None) is not None:
        return float(hf.rope_theta)
    raise ConfigMismatchError("rope_theta: missing from the HF config (rope_parameters.rope_theta)")


def head_dim(hf) -> int:
    hd = getattr(hf, "head_dim", None)
    return int(hd) if hd else hf.hidden_size // hf.num_attention_heads


def rope_problems(hf, partial_allowed: bool = False) -> list[str]:
    """Only plain RoPE maps onto Megatron's ``position_embedding_type='rope'`` (over the whole head,
    or over its leading ``partial_rotary_factor`` share where the architecture has partial RoPE).

    transformers 5 reads a transformers-4 ``rope_scaling`` into ``rope_parameters``; the message
    names both keys so it points at the field in either style of config.json."""
    field = "rope_parameters (rope_scaling in transformers-4 configs)"
    rope = getattr(hf, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return [f"{field}: expected an object, got {type(rope).__name__}"]
    if any(isinstance(v, dict) for v in rope.values()):
        return [f"{field}: per-layer-type RoPE parameters ({sorted(rope)}) are not supported"]
    problems = []
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in (None, "default"):
        problems.append(f"{field}: rope_type={rtype!r} is not supported (only default RoPE; "
                        f"scaled RoPE such as yarn/linear/dynamic would change the model)")
    partial = partial_rotary_factor(hf)
    if not partial_allowed and partial != 1.0:
        problems.append(f"{field}: partial_rotary_factor={partial} must be 1.0 for Qwen3")
    elif not 0.0 < partial <= 1.0:
        problems.append(f"{field}: partial_rotary_factor={partial} must be in (0, 1]")
    elif int(head_dim(hf) * partial) % 2 or head_dim(hf) * partial != int(head_dim(hf) * partial):
        problems.append(f"{field}: partial_rotary_factor={partial} x head_dim={head_dim(hf)} must be an even "
                        f"number of rotary dims")
    return problems


def partial_rotary_factor(hf) -> float:
    rope = getattr(hf, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None)) \
        if isinstance(rope, dict) else None
    return 1.0 if partial is None else float(partial)


def quantization_problems(*configs) -> list[str]:
    """A quantized checkpoint (fp8 blocks with ``weight_scale_inv``, GPTQ/AWQ ``qweight``...) holds other tensors
    than the spec's weights: named by the config field, not by the tensors it adds or lacks. `configs`: the
    top-level config and the language model's (a multimodal config keeps the field at its top)."""
    for cfg in configs:
        q = getattr(cfg, "quantization_config", None)
        if q:
            method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
            return [f"quantization_config (quant_method={method!r}): "
                    f"quantized weights are not supported; convert the unquantized (bf16/fp16/fp32) release"]
    return []


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def decoder_problems(hf, par: ParallelSizes, extra_sizes: tuple[str, ...] = ()) -> list[str]:
    """What every Qwen-style decoder (GQA attention, SwiGLU, RMSNorm, RoPE) must satisfy at `par`.

    Missing or non-integer sizes are raised at once: nothing else can be checked without them."""
    problems: list[str] = []

    def need(cond: bool, msg: str):
        if not cond:
            problems.append(msg)

    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", *extra_sizes)
    for f in (*sizes, "rms_norm_eps"):
        need(getattr(hf, f, None) is not None, f"{f}: missing")
    for f in sizes:
        v = getattr(hf, f, None)
        need(v is None or _positive_int(v), f"{f}={v!r}: must be a positive integer")
    hd = getattr(hf, "head_dim", None)
    need(hd is None or _positive_int(hd), f"head_dim={hd!r}: must be a positive integer")
    if problems:
        raise ConfigMismatchError("invalid HF config: " + "; ".join(problems))
    need(head_dim(hf) % 2 == 0, f"head_dim={head_dim(hf)}: RoPE needs an even head_dim")
    act = getattr(hf, "hidden_act", None)
    need(act in ("silu", "swish"), f"hidden_act={act!r}: only 'silu' (= 'swish', SwiGLU) is supported")
    need(not getattr(hf, "attention_bias", False), "attention_bias=True: the spec has no QKV bias")
    need(not getattr(hf, "attention_dropout", 0.0), "attention_dropout must be 0")
    nh, ng = hf.num_attention_heads, hf.num_key_value_heads
    need(nh % ng == 0, f"num_attention_heads={nh} is not a multiple of num_key_value_heads={ng}")
    need(nh % par.tp == 0, f"num_attention_heads={nh} is not divisible by tp={par.tp}")
    need(ng % par.tp == 0 or par.tp % ng == 0,
         f"num_key_value_heads={ng} and tp={par.tp}: one must divide the other")
    need(hf.intermediate_size % par.tp == 0, f"intermediate_size={hf.intermediate_size} is not divisible by tp={par.tp}")
    stages = par.pp * (par.vpp or 1)
    need(hf.num_hidden_layers % stages == 0,
         f"num_hidden_layers={hf.num_hidden_layers} is not divisible by pp={par.pp}"
         + (f" x vpp={par.vpp}" if par.vpp else "") + " (every pipeline stage needs the same number of layers)")
    need(not par.vpp or par.pp > 1, f"vpp={par.vpp} needs pp > 1 (interleaved pipeline), got pp={par.pp}")
    return problems


def validate(hf, par: ParallelSizes) -> None:
    """Reject every HF field value the local/TE GPT spec would silently compute differently."""
    problems = decoder_problems(hf, par) + quantization_problems(hf)
    problems += sliding_window_problems(hf)
    problems += rope_problems(hf)
    if problems:
        raise ConfigMismatchError("HF config does not match the Qwen3 Megatron spec: " + "; ".join(problems))


def sliding_window_problems(hf) -> list[str]:
    """Why some layer of this Qwen3 config attends through a sliding window (which the spec cannot compute), or [].

    ``use_sliding_window`` alone does not make a layer sliding: transformers windows the layers that ``layer_types``
    marks ``sliding_attention`` (by default those from ``max_window_layers`` on), and transformers-4 style readers
    (vLLM, SGLang) window layer ``i`` when ``use_sliding_window`` and ``i >= max_window_layers``. A config where
    ``max_window_layers`` covers every layer is plain attention for all of them and is accepted; one where either
    reading windows a layer is refused, naming the fields."""
    n = hf.num_hidden_layers
    problems = []
    lt = getattr(hf, "layer_types", None)
    if lt is not None and not all(t == "full_attention" for t in lt):
        problems.append(f"layer_types: only 'full_attention' layers are supported, got {sorted(set(lt))}")
    window = getattr(hf, "use_sliding_window", False) and getattr(hf, "sliding_window", None) is not None
    first = getattr(hf, "max_window_layers", None)
    if window and (not isinstance(first, int) or first < n):
        problems.append(f"use_sliding_window=True with max_window_layers={first!r} < num_hidden_layers={n}: layers "
                        f"from {first!r} on use sliding-window attention, which is not supported")
    return problems


def transformer_config(hf, par: ParallelSizes, opt: BuildOptions):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**transformer_config_kwargs(hf, par, opt))


def transformer_config_kwargs(hf, par: ParallelSizes, opt: BuildOptions, **arch) -> dict:
    """TransformerConfig fields of a Qwen-style decoder; `arch` adds the architecture's own fields
    before the user's `opt.extra` (the config's ``megatron:`` section) is applied last."""
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
    kwargs.update(arch)
    kwargs.update(opt.extra)
    return kwargs


def gpt_model_kwargs(hf, par: ParallelSizes, opt: BuildOptions) -> dict:
    return dict(
        vocab_size=padded_vocab_size(hf.vocab_size, par.tp, opt.vocab_pad_multiple),
        max_sequence_length=int(getattr(hf, "max_position_embeddings", 4096)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta(hf),
        share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def layer_spec(config, use_te: bool, vp_stage=None, pp_rank=None):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    return specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
