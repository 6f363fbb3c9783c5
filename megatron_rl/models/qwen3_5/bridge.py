"""Qwen3.5 / Qwen3.6 hybrid: the HF <-> Megatron parameter table, for both released layouts.

- ``qwen3_5_text`` (``Qwen3_5ForCausalLM``): ``model.layers.{i}.*``, ``model.embed_tokens``, ``model.norm``.
- ``qwen3_5`` (``Qwen3_5ForConditionalGeneration``, what the hub ships): the same under
  ``model.language_model.``, next to ``model.visual.*`` (the vision tower) and ``mtp.*`` (the
  multi-token-prediction layer). The actor trains the language model only; those tensors are carried
  through untouched (`passthrough_hf_names`) so an exported RL checkpoint is the same HF model type with
  byte-identical vision and MTP weights.

Which prefix a checkpoint uses is read from its weights, not its model_type (`Bridge.for_names`): some
conversions ship a ``qwen3_5_text`` config over ``model.language_model.*`` weights, and an export writes back the
names it read.

Megatron names cover megatron's TE hybrid spec (norms fused into ``in_proj`` / ``linear_qkv`` /
``linear_fc1``) and our local spec (separate norm modules) as aliases.
"""
from __future__ import annotations

from megatron_rl.bridge.base import Bridge, ParamMapping
from megatron_rl.bridge.transforms import (ColumnParallel, GatedDeltaNetParts, GatedMLP, QKVInterleave, Replicated,
                                           RowParallel, VocabParallel)

from .spec import FULL, head_dim, layer_types, text_config, tied_embeddings

#: the language model's prefix in the multimodal layout
MULTIMODAL_PREFIX = "model.language_model."
#: HF name prefixes of tensors the actor does not train, carried verbatim (multimodal layout)
PASSTHROUGH_PREFIXES = ("model.visual.", "mtp.")


class Qwen35Bridge(Bridge):
    name = "qwen3_5"
    hf_model_types = ("qwen3_5_text", "qwen3_5")

    def __init__(self, hf_config, layout=None):
        cfg = text_config(hf_config)
        self.multimodal = getattr(hf_config, "model_type", None) == "qwen3_5"
        super().__init__(hf_config, num_layers=cfg.num_hidden_layers, layout=layout)
        self.hf_architectures = (("Qwen3_5ForConditionalGeneration",) if self.multimodal
                                 else ("Qwen3_5ForCausalLM",))
        lm = self.lm_prefix
        self.tied = tied_embeddings(hf_config)
        self.layer_types = layer_types(hf_config)
        V, h, ffn = int(cfg.vocab_size), int(cfg.hidden_size), int(cfg.intermediate_size)
        nh, ng, hd = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), head_dim(cfg)
        nk, nv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
        dk, dv, width = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim), int(cfg.linear_conv_kernel_dim)
        qkv_rows = 2 * nk * dk + nv * dv
        vocab = VocabParallel(vocab_size=V)
        embed = lm + "embed_tokens.weight"
        self._pre = [ParamMapping("embedding.word_embeddings.weight", embed, vocab, hf_shapes=((V, h),))]
        self._post = [
            ParamMapping("decoder.final_layernorm.weight", lm + "norm.weight", Replicated(), hf_shapes=((h,),)),
            ParamMapping("output_layer.weight", embed if self.tied else "lm_head.weight", vocab,
                         export=not self.tied, hf_shapes=((V, h),)),
        ]
        L = lm + "layers.{layer}."
        mlp = [
            ParamMapping(("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                         L + "post_attention_layernorm.weight", Replicated(), hf_shapes=((h,),)),
            ParamMapping("mlp.linear_fc1.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), GatedMLP(),
                         hf_shapes=((ffn, h), (ffn, h))),
            ParamMapping("mlp.linear_fc2.weight", L + "mlp.down_proj.weight", RowParallel(), hf_shapes=((h, ffn),)),
        ]
        A = L + "self_attn."
        self._attention = [
            ParamMapping(("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                         L + "input_layernorm.weight", Replicated(), hf_shapes=((h,),)),
            ParamMapping("self_attention.linear_qkv.weight",
                         (A + "q_proj.weight", A + "k_proj.weight", A + "v_proj.weight"),
                         QKVInterleave(num_heads=nh, num_groups=ng, head_dim=hd, gated=True),
                         hf_shapes=((2 * nh * hd, h), (ng * hd, h), (ng * hd, h))),
            ParamMapping("self_attention.q_layernorm.weight", A + "q_norm.weight", Replicated(), hf_shapes=((hd,),)),
            ParamMapping("self_attention.k_layernorm.weight", A + "k_norm.weight", Replicated(), hf_shapes=((hd,),)),
            ParamMapping("self_attention.linear_proj.weight", A + "o_proj.weight", RowParallel(),
                         hf_shapes=((h, nh * hd),)),
            *mlp,
        ]
        G = L + "linear_attn."
        heads = dict(num_key_heads=nk, num_value_heads=nv, key_head_dim=dk, value_head_dim=dv)
        self._gdn = [
            ParamMapping(("input_layernorm.weight", "self_attention.in_proj.layer_norm_weight"),
                         L + "input_layernorm.weight", Replicated(), hf_shapes=((h,),)),
            ParamMapping("self_attention.in_proj.weight",
                         (G + "in_proj_qkv.weight", G + "in_proj_z.weight", G + "in_proj_b.weight",
                          G + "in_proj_a.weight"),
                         GatedDeltaNetParts("in_proj", **heads),
                         hf_shapes=((qkv_rows, h), (nv * dv, h), (nv, h), (nv, h))),
            ParamMapping("self_attention.conv1d.weight", G + "conv1d.weight", GatedDeltaNetParts("conv1d", **heads),
                         hf_shapes=((qkv_rows, 1, width),)),
            ParamMapping("self_attention.A_log", G + "A_log", ColumnParallel(), hf_shapes=((nv,),)),
            ParamMapping("self_attention.dt_bias", G + "dt_bias", ColumnParallel(), hf_shapes=((nv,),)),
            ParamMapping("self_attention.out_norm.weight", G + "norm.weight", Replicated(), hf_shapes=((dv,),)),
            ParamMapping("self_attention.out_proj.weight", G + "out_proj.weight", RowParallel(),
                         hf_shapes=((h, nv * dv),)),
            *mlp,
        ]
        self._embed_name = embed

    def default_lm_prefix(self):
        return MULTIMODAL_PREFIX if self.multimodal else "model."

    def pre_mappings(self):
        return self._pre

    def layer_mappings(self, layer):
        return self._attention if self.layer_types[layer] == FULL else self._gdn

    def post_mappings(self):
        return self._post

    def duplicate_hf_names(self):
        return {"lm_head.weight": self._embed_name} if self.tied else {}

    def passthrough_hf_names(self, names):
        # a vision tower goes with the multimodal layout, whichever model_type the config names
        if self.multimodal or any(n.startswith(MULTIMODAL_PREFIX) for n in names):
            own = [n for n in names if n.startswith(PASSTHROUGH_PREFIXES)]
        else:
            own = [n for n in names if n.startswith("mtp.")]
        return own + [n for n in super().passthrough_hf_names(names) if n not in own]
