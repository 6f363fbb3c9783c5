"""Qwen3 dense (``model_type: qwen3``): the HF <-> Megatron parameter table.

GQA attention with QK RMSNorm, SwiGLU MLP, RMSNorm (plain ``w * x``, copied as is), tied or untied
embeddings. Names on the Megatron side cover both the local spec (separate norm modules) and the
TE spec (norms fused into ``linear_qkv`` / ``linear_fc1``). HF names are under ``model.``, or under
``model.language_model.`` when the checkpoint's weights are (`Bridge.lm_prefix`).
"""
from __future__ import annotations

from megatron_rl.bridge.base import Bridge, ParamMapping
from megatron_rl.bridge.transforms import GatedMLP, QKVInterleave, Replicated, RowParallel, VocabParallel

from .spec import head_dim


class Qwen3Bridge(Bridge):
    name = "qwen3"
    hf_model_types = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)

    def __init__(self, hf_config, layout=None):
        super().__init__(hf_config, layout=layout)
        cfg = hf_config
        lm = self.lm_prefix
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        V, h, ffn = int(cfg.vocab_size), int(cfg.hidden_size), int(cfg.intermediate_size)
        nh, ng, hd = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), head_dim(cfg)
        vocab = VocabParallel(vocab_size=V)
        self._embed_name = lm + "embed_tokens.weight"
        self._pre = [ParamMapping("embedding.word_embeddings.weight", self._embed_name, vocab, hf_shapes=((V, h),))]
        self._post = [
            ParamMapping("decoder.final_layernorm.weight", lm + "norm.weight", Replicated(), hf_shapes=((h,),)),
            # Tied: only a PP>1 last stage has this parameter (a copy of the embedding).
            ParamMapping("output_layer.weight", self._embed_name if self.tied else "lm_head.weight",
                         vocab, export=not self.tied, hf_shapes=((V, h),)),
        ]
        qkv = QKVInterleave(num_heads=nh, num_groups=ng, head_dim=hd)
        L = lm + "layers.{layer}."
        self._layer = [
            ParamMapping(("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                         L + "input_layernorm.weight", Replicated(), hf_shapes=((h,),)),
            ParamMapping("self_attention.linear_qkv.weight",
                         (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"),
                         qkv, hf_shapes=((nh * hd, h), (ng * hd, h), (ng * hd, h))),
            ParamMapping("self_attention.q_layernorm.weight", L + "self_attn.q_norm.weight", Replicated(),
                         hf_shapes=((hd,),)),
            ParamMapping("self_attention.k_layernorm.weight", L + "self_attn.k_norm.weight", Replicated(),
                         hf_shapes=((hd,),)),
            ParamMapping("self_attention.linear_proj.weight", L + "self_attn.o_proj.weight", RowParallel(),
                         hf_shapes=((h, nh * hd),)),
            ParamMapping(("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                         L + "post_attention_layernorm.weight", Replicated(), hf_shapes=((h,),)),
            ParamMapping("mlp.linear_fc1.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), GatedMLP(),
                         hf_shapes=((ffn, h), (ffn, h))),
            ParamMapping("mlp.linear_fc2.weight", L + "mlp.down_proj.weight", RowParallel(), hf_shapes=((h, ffn),)),
        ]

    def pre_mappings(self):
        return self._pre

    def layer_mappings(self, layer):
        return self._layer

    def post_mappings(self):
        return self._post

    def duplicate_hf_names(self):
        return {"lm_head.weight": self._embed_name} if self.tied else {}
