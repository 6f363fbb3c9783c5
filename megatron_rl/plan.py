"""Cluster planner: memory per role, per-phase step time, tokens/s/GPU and the best layout of an RL run.

    python -m megatron_rl.plan --config configs/qwen3_6_27b.yaml --nodes 64 --gpus-per-node 8 --gpu h200
    python -m megatron_rl.plan --config configs/qwen3_8b.yaml --hf-config /ckpt/Qwen3-8B/config.json --nodes 1
    python -m megatron_rl.plan --config configs/qwen3_6_27b.yaml --nodes 64 --json      # one JSON object

The model shape comes from an HF config (`--hf-config` file or directory, or `model.path`'s config.json),
from HF-style fields in the YAML's `model:` section (`model.hf_config` / `model.shape`, or `model.tiny`), or
from a built-in shape named after the config (`--hf-config qwen3.6-27b`; `KNOWN_SHAPES`). The hybrid
Qwen3.5 family is read from its HF fields: `layer_types` / `full_attention_interval` decide which layers
are Gated DeltaNet (no KV cache; a fixed fp32 recurrent state per sequence) and which are full attention,
`linear_num_key_heads` / `linear_num_value_heads` / `linear_key_head_dim` / `linear_value_head_dim` /
`linear_conv_kernel_dim` size the GDN projections and state.

The workload (prompts per step, group size, turns, lengths) comes from the YAML (`data`, `agent`), with
flags to override; the mean response length is an assumption (`--mean-response-tokens`, default a quarter
of `max_new_tokens`).

Models (formulas in `docs` of each function; constants in `Calibration`):
* train: FLOPs/token = 6 N + 6 s n_h d_h L_attn + a GDN recurrence term, at the MFU measured on an H200
  (TP=1) plus explicit TP all-reduce time over NVLink, the pipeline bubble and exposed DP reduce-scatter;
* logprobs: 2 N per token at the measured forward MFU;
* memory: bf16 weights, fp32 (or bf16) grads, distributed Adam (12 B/param over DP), activations
  (Korthikanti et al. with flash attention; full recompute keeps each layer's input), the output layer's
  logits, and a calibrated fixed overhead;
* decode: memory-bandwidth bound, weights + KV + GDN state read per step, at a decode efficiency of the
  measured H200 copy bandwidth; the longest response sets a floor;
* sync: 2 N bytes at the measured colocated CUDA-IPC rate, or over the inter-node link;
* verification: compile CPU-seconds per candidate over the nodes' cores, timing seconds per candidate
  over the GPUs, one candidate's latency exposed per turn.

What is calibrated and how well: `python -m pytest tests/plan` compares the planner against the figures in
bench/results/*h200* (within 20 %). TP > 1, PP, multi-node links, SGLang decode and the S5000 are not
measured anywhere yet: those parts are formulas with spec-sheet numbers, and the output says so.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from megatron_rl.presets import ConfigError, load_preset

GiB = 1024 ** 3
GB = 1e9


class PlanError(ValueError):
    """Bad input to the planner (unknown GPU, no model shape, a layout that cannot fit); names what."""


# ---------------------------------------------------------------------------------------------- hardware

@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_gib: float                 # usable device memory
    peak_tflops: float             # dense bf16 spec (MFU is reported against this, as NeMo-RL does)
    matmul_tflops: float           # achievable bf16 GEMM rate (measured on the H200)
    hbm_gbps: float                # achievable device memory bandwidth (measured copy rate on the H200)
    intra_node_gbps: float         # per GPU, one direction (NVLink / MTLink)
    inter_node_gbps: float         # per GPU, one direction (one 400 Gb/s NIC per GPU)
    ipc_gbps: float                # colocated weight sync (CUDA IPC), measured on the H200
    measured: bool                 # False: spec-sheet numbers, nothing calibrated on this device


GPUS: dict[str, GpuSpec] = {
    # H200 SXM: 143,771 MiB; dense bf16 989 TFLOP/s (spec); GEMMs at ~790 TFLOP/s and copies at ~4.3 TB/s
    # measured (GPU_MACHINE.md); NVLink 4: 450 GB/s per direction; colocated sync 74.9 GB/s
    # (bench/results/sync_generate_h200.md).
    "h200": GpuSpec("h200", 140.4, 989.0, 790.0, 4300.0, 450.0, 50.0, 74.9, True),
    # MTT S5000: 80 GB at 1.6 TB/s, ~1000 TFLOP/s FP8 (so ~500 bf16); nothing measured: the H200's
    # ratios of achieved to spec figures are applied.
    "s5000": GpuSpec("s5000", 80 * GB / GiB, 500.0, 500.0 * 790 / 989, 1600.0 * 4300 / 4800, 200.0, 50.0,
                     74.9 * 1600 / 4800, False),
}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Constants fitted to measured H200 figures (bench/results); each names its source."""

    train_mfu_vs_matmul: float = 0.5594   # actor_h200.json actor_mfu_2026_12_01 ..._wgrad_fusion: 55.94 % of 790
    fwd_mfu_vs_matmul: float = 0.4957     # actor_h200.json logprobs_throughput, 4 seqs/micro-batch, chunk 1024
    mem_overhead_gib: float = 10.1        # actor_h200.json 2026-12-01 wgrad-fusion row: 83.0 GiB peak minus the modelled 72.9
    compile_cpu_s: float = 82.0           # compile_pch_cuda_h200.md: 79-89 CPU-s per CUDA candidate build
    compile_pool_busy: float = 0.90       # verifier_farm_h200.md: compile pool busy fraction
    device_stage_s: float = 8.3           # verifier_farm_h200.md medians: start 2.9 + correctness 2.1 + timing 3.3
    timing_exclusive_s: float = 3.3       # ... of which the GPU is held alone (timing)
    decode_efficiency: float = 0.7        # of hbm_gbps; literature (launch_scale.md 4.6), not measured here
    tp_comm_efficiency: float = 0.7       # of intra_node_gbps for TP all-reduces; not measured here
    sync_link_efficiency: float = 0.8     # of inter_node_gbps for the disaggregated broadcast; not measured
    offload_gbps: float = 25.0            # actor offload/onload over PCIe (colocated); not measured here
    engine_overhead_gib: float = 6.0      # CUDA graphs, activations, allocator slack of an engine


CAL = Calibration()


# ---------------------------------------------------------------------------------------------- model shape

@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    attn_output_gate: bool = False
    attn_layers: int | None = None       # None: all layers
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    gdn_conv: int = 4

    @property
    def n_attn(self) -> int:
        return self.layers if self.attn_layers is None else self.attn_layers

    @property
    def n_gdn(self) -> int:
        return self.layers - self.n_attn

    def attn_layer_params(self) -> int:
        h, q = self.hidden, self.heads * self.head_dim
        return h * q * (2 if self.attn_output_gate else 1) + 2 * h * self.kv_heads * self.head_dim + q * h

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim

    def gdn_layer_params(self) -> int:
        h, v = self.hidden, self.gdn_v_heads * self.gdn_v_dim
        return h * self.gdn_conv_dim + h * v + 2 * h * self.gdn_v_heads + v * h + self.gdn_conv_dim * self.gdn_conv

    def mlp_params(self) -> int:
        return 3 * self.hidden * self.ffn

    def decoder_params(self) -> int:
        return (self.n_attn * self.attn_layer_params() + self.n_gdn * self.gdn_layer_params()
                + self.layers * self.mlp_params())

    def matmul_params(self) -> int:
        """Parameters that take part in matmuls per token: decoder layers + the output layer."""
        return self.decoder_params() + self.vocab * self.hidden

    def total_params(self) -> int:
        return self.decoder_params() + self.vocab * self.hidden * (1 if self.tied else 2)

    def train_flops_per_token(self, seq: float) -> float:
        """6 N + causal attention 6 s n_h d_h per attention layer (bench/actor_mfu.py's formula) + GDN recurrence
        (15 d_k d_v H_v per GDN layer, verl's hybrid estimator)."""
        attn = 6.0 * seq * self.heads * self.head_dim * self.n_attn
        gdn = 15.0 * self.gdn_k_dim * self.gdn_v_dim * self.gdn_v_heads * self.n_gdn
        return 6.0 * self.matmul_params() + attn + gdn

    def fwd_flops_per_token(self, seq: float) -> float:
        return self.train_flops_per_token(seq) / 3.0

    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_attn * self.kv_heads * self.head_dim * 2

    def gdn_state_bytes(self) -> int:
        """Per sequence: the fp32 recurrent state plus the bf16 conv state of every GDN layer."""
        state = self.n_gdn * self.gdn_v_heads * self.gdn_k_dim * self.gdn_v_dim * 4
        conv = self.n_gdn * self.gdn_conv_dim * (self.gdn_conv - 1) * 2
        return state + conv


def rollout_cache_bytes(m: ModelShape, sequences: int, tokens_per_sequence: int, dtype_bytes: int = 2) -> int:
    """Engine cache of `sequences` running requests of up to `tokens_per_sequence` tokens each: K/V of the
    attention layers in the engine's dtype, plus every GDN layer's fixed state per request."""
    kv = m.kv_bytes_per_token() // 2 * dtype_bytes
    return sequences * (tokens_per_sequence * kv + m.gdn_state_bytes())


def shape_from_hf(cfg: dict[str, Any], name: str = "hf") -> ModelShape:
    """ModelShape from an HF config dict (text_config of a multimodal config is used when present)."""
    c = cfg.get("text_config") or cfg
    need = ["hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size"]
    missing = [k for k in need if c.get(k) is None]
    if missing:
        raise PlanError(f"model shape {name}: HF config lacks {', '.join(missing)}")
    layers = int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    types = c.get("layer_types")
    hybrid = any(k in c for k in ("linear_num_value_heads", "full_attention_interval")) or (
        types is not None and any(t != "full_attention" for t in types))
    attn_layers = None
    gdn: dict[str, int] = {}
    if hybrid:
        if types is not None:
            if len(types) != layers:
                raise PlanError(f"model shape {name}: layer_types has {len(types)} entries for {layers} layers")
            unknown = sorted({t for t in types} - {"full_attention", "linear_attention"})
            if unknown:
                raise PlanError(f"model shape {name}: unknown layer_types {unknown}")
            attn_layers = sum(1 for t in types if t == "full_attention")
        else:
            interval = int(c.get("full_attention_interval") or 4)
            attn_layers = sum(1 for i in range(layers) if (i + 1) % interval == 0)
        fields = {"gdn_k_heads": "linear_num_key_heads", "gdn_v_heads": "linear_num_value_heads",
                  "gdn_k_dim": "linear_key_head_dim", "gdn_v_dim": "linear_value_head_dim"}
        missing = [v for v in fields.values() if c.get(v) is None]
        if missing and attn_layers < layers:
            raise PlanError(f"model shape {name}: hybrid config lacks {', '.join(missing)}")
        gdn = {k: int(c.get(v) or 0) for k, v in fields.items()}
        gdn["gdn_conv"] = int(c.get("linear_conv_kernel_dim") or 4)
    return ModelShape(
        name=name, hidden=int(c["hidden_size"]), layers=layers, ffn=int(c["intermediate_size"]), heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=head_dim, vocab=int(c["vocab_size"]),
        tied=bool(c.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        attn_output_gate=bool(c.get("attn_output_gate", False)), attn_layers=attn_layers, **gdn)


def _qwen35(layers: int, hidden: int, ffn: int, heads: int, v_heads: int) -> dict[str, Any]:
    return {"model_type": "qwen3_5_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": v_heads, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (layers // 4),
            "vocab_size": 248320, "tie_word_embeddings": False, "attn_output_gate": True}


def _qwen3(layers: int, hidden: int, ffn: int, heads: int) -> dict[str, Any]:
    return {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": ffn,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False}


# Shapes from the HF configs (shared/reference/models_megatron.md 1.2 and 1.6).
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": _qwen3(36, 4096, 12288, 32),
    "qwen3-32b": _qwen3(64, 5120, 25600, 64),
    "qwen3.5-9b": _qwen35(32, 4096, 12288, 16, 32),
    "qwen3.6-27b": _qwen35(64, 5120, 17408, 24, 48),
}
KNOWN_SHAPES["qwen3.5-27b"] = KNOWN_SHAPES["qwen3.6-27b"]


def _norm_name(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def known_shape(name: str) -> ModelShape | None:
    for k, v in KNOWN_SHAPES.items():
        if _norm_name(k) == _norm_name(name):
            return shape_from_hf(v, k)
    return None


def _read_hf_config(path: Path) -> dict[str, Any]:
    f = path / "config.json" if path.is_dir() else path
    if not f.is_file():
        raise PlanError(f"HF config not found: {f}")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"{f}: not a JSON HF config ({e})") from None


def resolve_shape(model_section: dict[str, Any], config_name: str, hf_config: str | None) -> tuple[ModelShape, str]:
    """(shape, where it came from). Order: --hf-config, model.path's config.json, model.hf_config / model.shape
    (HF field names), model.tiny (when the preset trains the tiny model), the built-in shape of the config's name."""
    if hf_config:
        s = known_shape(hf_config)
        if s is not None:
            return s, f"built-in shape {s.name}"
        return shape_from_hf(_read_hf_config(Path(hf_config)), Path(hf_config).name), f"HF config {hf_config}"
    path = model_section.get("path")
    if path and Path(str(path)).expanduser().exists():
        p = Path(str(path)).expanduser()
        return shape_from_hf(_read_hf_config(p), p.name), f"model.path {p}"
    for key in ("hf_config", "shape", "hf"):
        v = model_section.get(key)
        if isinstance(v, dict) and v:
            return shape_from_hf(v, f"model.{key}"), f"model.{key} in the config"
        if isinstance(v, str) and v:
            s = known_shape(v)
            if s is not None:
                return s, f"built-in shape {s.name} (model.{key})"
            return shape_from_hf(_read_hf_config(Path(v)), v), f"model.{key} {v}"
    s = known_shape(config_name)
    if s is not None:
        return s, f"built-in shape {s.name} (named after the config)"
    tiny = model_section.get("tiny")
    if not path and isinstance(tiny, dict) and tiny:
        t = {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "intermediate_size": 128, "tie_word_embeddings": True, "vocab_size": 151669, **tiny}
        hf = {"hidden_size": t["hidden_size"], "num_hidden_layers": t["num_layers"],
              "intermediate_size": t["intermediate_size"], "num_attention_heads": t["num_attention_heads"],
              "num_key_value_heads": t["num_key_value_heads"], "head_dim": t["head_dim"],
              "vocab_size": t["vocab_size"] or 151669, "tie_word_embeddings": t["tie_word_embeddings"]}
        hf.update({k: v for k, v in tiny.items() if k.startswith("linear_") or k in ("layer_types", "full_attention_interval")})
        return shape_from_hf(hf, "model.tiny"), "model.tiny in the config"
    raise PlanError(f"no model shape for config {config_name!r}: model.path is unset or missing, the model section has "
                    f"no hf_config/shape; pass --hf-config CONFIG_JSON_OR_DIR or a built-in name "
                    f"({', '.join(sorted(KNOWN_SHAPES))})")


# ---------------------------------------------------------------------------------------------- workload

@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: int                 # groups per step
    group_size: int
    max_turns: int
    mean_turns: float
    prompt_tokens: int           # first-turn prompt
    feedback_tokens: int         # what each later turn appends (verdict summary)
    max_response_tokens: int
    mean_response_tokens: int
    kl: bool                     # reference logprobs too
    grad_reduce_fp32: bool = True
    recompute: str = "full"      # none | selective | full
    sequence_parallel: bool = True
    micro_batch_tokens: int = 16384

    @property
    def trajectories(self) -> int:
        return self.prompts * self.group_size

    @property
    def generated_tokens(self) -> float:
        return self.trajectories * self.mean_turns * self.mean_response_tokens

    @property
    def trained_tokens(self) -> float:
        """The loss reads the first turn (PrimeEcho): prompt + first response per trajectory."""
        return self.trajectories * (self.prompt_tokens + self.mean_response_tokens)

    @property
    def train_seq(self) -> float:
        return self.prompt_tokens + self.mean_response_tokens

    @property
    def mean_context(self) -> float:
        return self.prompt_tokens + (self.mean_turns - 1) * (self.mean_response_tokens + self.feedback_tokens) \
            + self.mean_response_tokens / 2


def workload_from_config(cfg: dict[str, Any], overrides: dict[str, Any]) -> Workload:
    data, agent, actor, loss = (cfg.get(k) or {} for k in ("data", "agent", "actor", "loss"))
    sampling = agent.get("sampling") or {}
    max_resp = int(overrides.get("max_response_tokens") or sampling.get("max_new_tokens") or 4096)
    max_turns = int(overrides.get("max_turns") or agent.get("max_turns") or 1)
    w = Workload(
        prompts=int(overrides.get("prompts") or data.get("prompts_per_step") or 8),
        group_size=int(overrides.get("group_size") or agent.get("group_size") or 8),
        max_turns=max_turns,
        mean_turns=float(overrides.get("mean_turns") or (1 + (max_turns - 1) * 0.5)),
        prompt_tokens=int(overrides.get("prompt_tokens") or min(int(agent.get("max_prompt_tokens") or 2048), 2048)),
        feedback_tokens=int(overrides.get("feedback_tokens") or 512),
        max_response_tokens=max_resp,
        mean_response_tokens=int(overrides.get("mean_response_tokens") or max(1, max_resp // 4)),
        kl=float(loss.get("kl_loss_coef") or 0) > 0,
        grad_reduce_fp32=bool((actor.get("megatron") or {}).get("grad_reduce_in_fp32", True)),
        recompute=str(actor.get("recompute_granularity") or "none"),
        sequence_parallel=bool(actor.get("sequence_parallel", True)),
        micro_batch_tokens=int(actor.get("max_tokens_per_gpu") or 16384),
    )
    for f in ("prompts", "group_size", "max_turns", "prompt_tokens", "max_response_tokens", "mean_response_tokens"):
        if getattr(w, f) < 1:
            raise PlanError(f"workload {f} must be >= 1, got {getattr(w, f)}")
    if w.mean_response_tokens > w.max_response_tokens:
        raise PlanError(f"--mean-response-tokens {w.mean_response_tokens} exceeds max_new_tokens {w.max_response_tokens}")
    return w


# ---------------------------------------------------------------------------------------------- memory

@dataclasses.dataclass
class TrainMemory:
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    overhead_gib: float

    @property
    def total_gib(self) -> float:
        return (self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.logits_gib
                + self.overhead_gib)


def train_memory(m: ModelShape, tp: int, pp: int, dp: int, *, micro_batch_tokens: float, seq: float,
                 recompute: str = "full", sequence_parallel: bool = True, grad_reduce_fp32: bool = True,
                 keep_logit_chunks: bool = True, logit_chunk: int = 1024, microbatches: int = 8) -> TrainMemory:
    """Peak per GPU of the most loaded pipeline stage (first: embedding and pp micro-batches in flight; last:
    output layer and its logits). Peak = weights + grads + Adam state + the larger of (activations + logits)
    and the optimizer step's transient fp32 copy of the shard's gradients, + a calibrated fixed overhead."""
    layers = math.ceil(m.layers / pp)
    avg_layer = m.decoder_params() / m.layers
    h, t, tok = m.hidden, tp, micro_batch_tokens               # tok: tokens of one micro-batch (s * b)
    if recompute == "full":
        per_layer = 2.0 * tok * h / (t if sequence_parallel else 1)
        full_layer = tok * h * (18 + 4 * m.ffn / h) / t
        act_layers = per_layer * layers + full_layer
    else:
        coeff = (18 + 4 * m.ffn / h) / t if sequence_parallel else 10 + (8 + 4 * m.ffn / h) / t
        act_layers = tok * h * coeff * layers
    logit_tokens = tok if keep_logit_chunks else min(tok, logit_chunk)
    logits = logit_tokens * m.vocab / t * (2 + 4 + 4)            # bf16 logits, fp32 log-softmax, fp32 grad
    stages = []
    for first, last in ([(True, True)] if pp == 1 else [(True, False), (False, True)]):
        n_emb = (1 if first else 0) + (1 if last and not m.tied else 0)
        shard = (layers * avg_layer + n_emb * m.vocab * m.hidden) / tp
        weights, grads, opt = shard * 2, shard * (4 if grad_reduce_fp32 else 2), shard * 12 / dp
        act = act_layers * (min(pp, microbatches) if first and pp > 1 else 1)
        lg = logits if last else 0.0
        transient = shard * 4 / dp
        peak_extra = max(act + lg, transient)
        share = (act / (act + lg)) if act + lg > 0 else 1.0
        act_part, lg_part = (peak_extra * share, peak_extra * (1 - share)) if act + lg >= transient else (transient, 0.0)
        stages.append(TrainMemory(weights / GiB, grads / GiB, opt / GiB, act_part / GiB, lg_part / GiB,
                                  CAL.mem_overhead_gib))
    return max(stages, key=lambda x: x.total_gib)


@dataclasses.dataclass
class EngineMemory:
    weights_gib: float
    kv_per_token_kib: float
    gdn_state_per_seq_mib: float
    per_seq_gib: float              # KV at the mean context + GDN state, per GPU of the engine
    max_concurrency: int            # sequences that fit per engine
    overhead_gib: float


def engine_memory(m: ModelShape, gpu: GpuSpec, tp: int, mem_fraction: float, context: float) -> EngineMemory:
    kv_shard = max(1, min(tp, m.kv_heads))
    weights = 2.0 * m.total_params() / tp
    per_seq = m.kv_bytes_per_token() * context / kv_shard + m.gdn_state_bytes() / tp
    free = gpu.hbm_gib * GiB * mem_fraction - weights - CAL.engine_overhead_gib * GiB
    if free <= 0:
        conc = 0
    else:   # no per-sequence state at all (context 0, no GDN): memory does not bound the batch
        conc = int(free // per_seq) if per_seq > 0 else 10 ** 6
    return EngineMemory(weights / GiB, m.kv_bytes_per_token() / 1024, m.gdn_state_bytes() / 2 ** 20,
                        per_seq / GiB, max(conc, 0), CAL.engine_overhead_gib)


# ---------------------------------------------------------------------------------------------- phases

def train_tokens_per_s(m: ModelShape, gpu: GpuSpec, tp: int, pp: int, dp: int, seq: float,
                       micro_batch_tokens: float, global_tokens: float, recompute: str = "full",
                       mfu: float | None = None) -> float:
    """Training tokens/s of the whole train group: compute at the calibrated MFU (per-GPU rate, TP=1),
    plus TP all-reduce time over the intra-node link, the pipeline bubble (p-1)/m, and the exposed part
    of the distributed optimizer's reduce-scatter + all-gather."""
    g = tp * pp * dp
    mfu = CAL.train_mfu_vs_matmul if mfu is None else mfu
    flops = m.train_flops_per_token(seq)
    if recompute == "full":
        flops_exec = flops + m.fwd_flops_per_token(seq)   # the forward once more
        flops_exec -= 2.0 * m.vocab * m.hidden            # the output layer is not recomputed
    else:
        flops_exec = flops
    compute_s = global_tokens * flops_exec / (g * mfu * gpu.matmul_tflops * 1e12)
    tp_s = 0.0
    if tp > 1:  # 4 all-reduces per layer per pass (2 fwd, 2 bwd), +2 with full recompute; bf16 activations
        per_token = (6 if recompute == "full" else 4) * 2 * (tp - 1) / tp * m.hidden * 2 * math.ceil(m.layers / pp)
        link = gpu.intra_node_gbps if tp <= 8 else gpu.inter_node_gbps
        tp_s = global_tokens / (dp * pp) * per_token / (CAL.tp_comm_efficiency * link * GB)
    micro = max(1.0, global_tokens / dp / micro_batch_tokens)
    bubble = (pp - 1) / (micro + pp - 1) if pp > 1 else 0.0
    shard_bytes = 2.0 * m.total_params() / (tp * pp)
    dp_s = 2 * (dp - 1) / dp * shard_bytes / (CAL.sync_link_efficiency * gpu.inter_node_gbps * GB) if dp > 1 else 0.0
    step = (compute_s + tp_s) / (1 - bubble) + 0.2 * dp_s   # most of the DP traffic overlaps the backward pass
    return global_tokens / step


def logprob_tokens_per_s(m: ModelShape, gpu: GpuSpec, g: int, seq: float, tp: int = 1) -> float:
    flops = m.fwd_flops_per_token(seq)
    rate = g * CAL.fwd_mfu_vs_matmul * gpu.matmul_tflops * 1e12 / flops
    if tp > 1:
        per_token = 2 * 2 * (tp - 1) / tp * m.hidden * 2 * m.layers
        rate = 1.0 / (1.0 / rate + per_token / (g / tp) / (CAL.tp_comm_efficiency * gpu.intra_node_gbps * GB) / tp)
    return rate


def decode_step_s(m: ModelShape, gpu: GpuSpec, tp: int, batch: int, context: float) -> float:
    """One decode step of an engine with TP tp and `batch` running sequences: bytes read (weights + KV + the
    GDN state read and written) over the achievable bandwidth, or the matmul time if that is longer."""
    kv_shard = max(1, min(tp, m.kv_heads))
    read = 2.0 * m.total_params() / tp + batch * (m.kv_bytes_per_token() * context / kv_shard
                                                 + 2.0 * m.gdn_state_bytes() / tp)
    mem_s = read / (CAL.decode_efficiency * gpu.hbm_gbps * GB)
    compute_s = 2.0 * m.matmul_params() * batch / tp / (0.5 * gpu.matmul_tflops * 1e12)
    return max(mem_s, compute_s) + 25e-6 * (tp > 1) * m.layers   # TP all-reduce latency per layer


def sync_seconds(m: ModelShape, gpu: GpuSpec, colocated: bool) -> float:
    size = 2.0 * m.total_params()
    if colocated:
        return size / (gpu.ipc_gbps * GB)
    return size / (CAL.sync_link_efficiency * gpu.inter_node_gbps * GB) + 0.5


def farm_seconds(candidates: float, cores: int, gpus: int) -> float:
    """Verifier farm wall time for a batch of candidates: compile-bound over the cores, timing-bound over the
    GPUs (one candidate timed per GPU at a time), plus one candidate's device stage at the end."""
    compile_s = candidates * CAL.compile_cpu_s / (cores * CAL.compile_pool_busy)
    timing_s = candidates * CAL.timing_exclusive_s / max(gpus, 1)
    return max(compile_s, timing_s) + CAL.device_stage_s


# ---------------------------------------------------------------------------------------------- the plan

@dataclasses.dataclass
class Layout:
    placement: str                 # colocated | disaggregated
    train_gpus: int
    rollout_gpus: int
    tp: int
    pp: int
    dp: int
    engine_tp: int
    engines: int


@dataclasses.dataclass
class Estimate:
    layout: Layout
    train_memory: TrainMemory
    engine_memory: EngineMemory
    phases_s: dict[str, float]
    step_s: float
    tokens_per_s_per_gpu: dict[str, float]
    train_mfu: float               # vs the GPU's dense bf16 spec peak
    concurrency_per_engine: int
    fits: bool
    why_not: str = ""


def estimate(m: ModelShape, w: Workload, gpu: GpuSpec, lay: Layout, *, cpus_per_node: int, gpus_per_node: int,
             mem_fraction: float) -> Estimate:
    g_all = lay.train_gpus + (lay.rollout_gpus if lay.placement == "disaggregated" else 0)
    colocated = lay.placement == "colocated"
    micro = min(w.micro_batch_tokens, w.train_seq * max(1, w.micro_batch_tokens // max(w.train_seq, 1)))
    micro = max(micro, w.train_seq)
    n_micro = max(1, int(w.trained_tokens / lay.dp / micro))
    tm = train_memory(m, lay.tp, lay.pp, lay.dp, micro_batch_tokens=micro, seq=w.train_seq, recompute=w.recompute,
                      sequence_parallel=w.sequence_parallel, grad_reduce_fp32=w.grad_reduce_fp32,
                      microbatches=n_micro)
    em = engine_memory(m, gpu, lay.engine_tp, mem_fraction, w.mean_context)
    why = []
    if tm.total_gib > gpu.hbm_gib:
        why.append(f"train needs {tm.total_gib:.1f} GiB/GPU at TP{lay.tp} PP{lay.pp} DP{lay.dp} (> {gpu.hbm_gib:.0f})")
    if em.max_concurrency < 1:
        why.append(f"engine at TP{lay.engine_tp} holds no sequence ({em.weights_gib:.1f} GiB of weights per GPU)")
    # generation
    running = max(1.0, w.trajectories / lay.engines)
    batch = int(max(1, min(running, em.max_concurrency or 1)))
    step_full = decode_step_s(m, gpu, lay.engine_tp, batch, w.mean_context)
    gen_rate = lay.engines * batch / step_full
    tail_batch = max(1, batch // 8)
    t_tail = decode_step_s(m, gpu, lay.engine_tp, tail_batch, w.mean_context + w.max_response_tokens / 2)
    prefill_s = w.trajectories * w.mean_turns * w.mean_context * 2 * m.matmul_params() / (
        lay.rollout_gpus * 0.5 * gpu.matmul_tflops * 1e12)
    gen_throughput_s = w.generated_tokens / gen_rate + prefill_s
    latency = CAL.compile_cpu_s + CAL.device_stage_s                   # one candidate, build to verdict
    # the longest trajectory: a max-length response, the others at the mean, one verdict per turn
    gen_critical = (w.max_response_tokens + (w.max_turns - 1) * w.mean_response_tokens) * t_tail
    cores = cpus_per_node * max(1, math.ceil(g_all / gpus_per_node))
    verify_s = farm_seconds(w.trajectories * w.mean_turns, cores, lay.rollout_gpus)
    rollout_s = max(gen_throughput_s + latency, gen_critical + w.max_turns * latency, verify_s)
    gen_s = max(gen_throughput_s, gen_critical)
    train_rate = train_tokens_per_s(m, gpu, lay.tp, lay.pp, lay.dp, w.train_seq, micro, w.trained_tokens, w.recompute)
    train_s = w.trained_tokens / train_rate
    lp_s = w.trained_tokens / logprob_tokens_per_s(m, gpu, lay.train_gpus, w.train_seq, lay.tp) * (2 if w.kl else 1)
    sync_s = sync_seconds(m, gpu, colocated)
    offload_s = 2 * (tm.weights_gib + tm.grads_gib + tm.optimizer_gib) * GiB / (CAL.offload_gbps * GB) if colocated else 0.0
    phases = {"generation": gen_s, "verification_exposed": max(0.0, rollout_s - gen_s),
              "logprobs": lp_s, "train": train_s, "weight_sync": sync_s, "offload_onload": offload_s}
    if colocated:
        step = rollout_s + lp_s + train_s + sync_s + offload_s
    else:   # async: the next rollout runs while this step trains (one step off-policy)
        step = max(rollout_s, lp_s + train_s + sync_s)
        phases["idle_train_side"] = max(0.0, rollout_s - (lp_s + train_s + sync_s))
    total_tokens = w.trajectories * (w.prompt_tokens + w.mean_turns * w.mean_response_tokens
                                     + (w.mean_turns - 1) * w.feedback_tokens)
    tps = {"e2e": total_tokens / step / g_all,
           "generation": w.generated_tokens / rollout_s / lay.rollout_gpus,
           "train": w.trained_tokens / train_s / lay.train_gpus,
           "logprobs": w.trained_tokens / lp_s * (2 if w.kl else 1) / lay.train_gpus}
    mfu = w.trained_tokens * m.train_flops_per_token(w.train_seq) / train_s / lay.train_gpus / (gpu.peak_tflops * 1e12)
    return Estimate(lay, tm, em, phases, step, tps, mfu, batch, not why, "; ".join(why))


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def search(m: ModelShape, w: Workload, gpu: GpuSpec, nodes: int, gpus_per_node: int, *, cpus_per_node: int,
           mem_fraction: float, placements: tuple[str, ...] = ("colocated", "disaggregated")) -> list[Estimate]:
    """Every layout: train TP in {1,2,4,8} (inside a node), PP dividing the layers (<= 8), DP the rest; engine TP in
    {1,2,4,8}; disaggregated splits at node granularity. Sorted best first (fitting, then E2E tokens/s/GPU)."""
    g = nodes * gpus_per_node
    out: list[Estimate] = []
    tps = [t for t in (1, 2, 4, 8) if t <= gpus_per_node]
    splits: list[tuple[str, int, int]] = []
    if "colocated" in placements:
        splits.append(("colocated", g, g))
    if "disaggregated" in placements and nodes >= 2:
        for train_nodes in range(1, nodes):
            splits.append(("disaggregated", train_nodes * gpus_per_node, (nodes - train_nodes) * gpus_per_node))
    for placement, g_train, g_roll in splits:
        for tp in tps:
            for pp in _divisors(m.layers, 8):
                if g_train % (tp * pp):
                    continue
                dp = g_train // (tp * pp)
                for etp in tps:
                    if g_roll % etp:
                        continue
                    lay = Layout(placement, g_train, g_roll, tp, pp, dp, etp, g_roll // etp)
                    out.append(estimate(m, w, gpu, lay, cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node,
                                        mem_fraction=mem_fraction))
    out.sort(key=lambda e: (not e.fits, -round(e.tokens_per_s_per_gpu["e2e"], 3),
                            e.phases_s["train"] + e.phases_s["logprobs"], e.layout.tp * e.layout.pp, e.layout.engine_tp))
    return out


def _layout_of_config(cfg: dict[str, Any], nodes: int, gpn: int) -> Layout | None:
    actor, cluster, rollout = (cfg.get(k) or {} for k in ("actor", "cluster", "rollout"))
    tp, pp = int(actor.get("tp") or 1), int(actor.get("pp") or 1)
    g = nodes * gpn
    colocated = (cluster.get("placement") or "colocated") == "colocated"
    etp = int(rollout.get("gpus_per_engine") or 1)
    if colocated:
        if g % (tp * pp) or g % etp:
            return None
        return Layout("colocated", g, g, tp, pp, g // (tp * pp), etp, g // etp)
    roll = int(cluster.get("rollout_gpus") or g // 2)
    train = g - roll
    if train <= 0 or train % (tp * pp) or roll % etp:
        return None
    return Layout("disaggregated", train, roll, tp, pp, train // (tp * pp), etp, roll // etp)


# ---------------------------------------------------------------------------------------------- CLI

def _fmt_layout(lay: Layout) -> str:
    s = f"{lay.placement}: train TP{lay.tp} PP{lay.pp} DP{lay.dp} on {lay.train_gpus} GPUs, "
    return s + f"{lay.engines} engines x TP{lay.engine_tp}" + ("" if lay.placement == "colocated" else f" on {lay.rollout_gpus} GPUs")


def render(e: Estimate, m: ModelShape, w: Workload, gpu: GpuSpec, title: str) -> str:
    lines = [f"## {title}", f"layout: {_fmt_layout(e.layout)}" + ("" if e.fits else f"  [DOES NOT FIT: {e.why_not}]"),
             "", "memory per GPU (GiB)    train: " + ", ".join(
                 f"{k} {getattr(e.train_memory, k + '_gib'):.1f}" for k in
                 ("weights", "grads", "optimizer", "activations", "logits", "overhead"))
             + f" = {e.train_memory.total_gib:.1f} of {gpu.hbm_gib:.0f}",
             f"                        engine: weights {e.engine_memory.weights_gib:.1f}, KV {e.engine_memory.kv_per_token_kib:.0f} KiB/token"
             + (f" + GDN state {e.engine_memory.gdn_state_per_seq_mib:.0f} MiB/sequence" if m.n_gdn else "")
             + f", {e.engine_memory.per_seq_gib * 1024:.0f} MiB per running sequence; fits {e.engine_memory.max_concurrency} "
               f"sequences per engine (running {e.concurrency_per_engine})", "", "step time (s):"]
    for k, v in e.phases_s.items():
        lines.append(f"  {k:<22} {v:9.1f}  ({100 * v / e.step_s:4.1f} %)")
    lines.append(f"  {'step':<22} {e.step_s:9.1f}")
    t = e.tokens_per_s_per_gpu
    lines += ["", f"tokens/s/GPU: end-to-end {t['e2e']:.0f}, generation {t['generation']:.0f}, train {t['train']:.0f}, "
                  f"logprobs {t['logprobs']:.0f}; train MFU {100 * e.train_mfu:.1f} % of {gpu.peak_tflops:.0f} TFLOP/s"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_rl.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="trainer preset (configs/*.yaml)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="h200", help=f"one of {', '.join(GPUS)}")
    ap.add_argument("--cpus-per-node", type=int, default=96, help="CPU cores per node for the compile pool")
    ap.add_argument("--hf-config", help="HF config.json (or its directory) or a built-in shape name")
    ap.add_argument("--mem-fraction", type=float, default=None, help="engine memory fraction (rollout.sglang.mem_fraction_static)")
    for flag in ("prompts", "group-size", "max-turns", "prompt-tokens", "max-response-tokens", "mean-response-tokens",
                 "feedback-tokens"):
        ap.add_argument(f"--{flag}", type=int)
    ap.add_argument("--mean-turns", type=float)
    ap.add_argument("--placement", choices=["colocated", "disaggregated", "both"], default="both")
    ap.add_argument("--top", type=int, default=5, help="how many layouts to list")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    a = ap.parse_args(argv)
    try:
        if a.gpu.lower() not in GPUS:
            raise PlanError(f"unknown GPU kind {a.gpu!r}: known {', '.join(GPUS)}")
        gpu = GPUS[a.gpu.lower()]
        if a.nodes < 1 or a.gpus_per_node < 1:
            raise PlanError(f"--nodes and --gpus-per-node must be >= 1 (got {a.nodes}, {a.gpus_per_node})")
        path = Path(a.config)
        try:
            cfg = OmegaConf.to_container(load_preset(path), resolve=False)
        except ConfigError as e:
            raise PlanError(str(e)) from None
        shape, source = resolve_shape(cfg.get("model") or {}, str(cfg.get("name") or path.stem), a.hf_config)
        over = {k: getattr(a, k) for k in ("prompts", "group_size", "max_turns", "prompt_tokens", "max_response_tokens",
                                           "mean_response_tokens", "feedback_tokens", "mean_turns")}
        w = workload_from_config(cfg, over)
        frac = a.mem_fraction or float(((cfg.get("rollout") or {}).get("sglang") or {}).get("mem_fraction_static") or 0.8)
        placements = ("colocated", "disaggregated") if a.placement == "both" else (a.placement,)
        ranked = search(shape, w, gpu, a.nodes, a.gpus_per_node, cpus_per_node=a.cpus_per_node, mem_fraction=frac,
                        placements=placements)
        if not ranked or not ranked[0].fits:
            best = ranked[0].why_not if ranked else "no layout divides the GPUs"
            raise PlanError(f"no layout of {shape.name} fits {a.nodes} x {a.gpus_per_node} {gpu.name}: {best}")
        preset = _layout_of_config(cfg, a.nodes, a.gpus_per_node)
        preset_est = (estimate(shape, w, gpu, preset, cpus_per_node=a.cpus_per_node, gpus_per_node=a.gpus_per_node,
                               mem_fraction=frac) if preset else None)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    best = ranked[0]
    if a.json:
        out = {"model": dataclasses.asdict(shape), "shape_source": source, "gpu": dataclasses.asdict(gpu),
               "workload": dataclasses.asdict(w), "best": _est_json(best),
               "config_layout": _est_json(preset_est) if preset_est else None,
               "ranked": [_est_json(e) for e in ranked[: a.top]]}
        print(json.dumps(out))
        return 0
    note = "" if gpu.measured else f" ({gpu.name}: spec-sheet figures, nothing calibrated on this device)"
    print(f"# Plan: {shape.name} ({shape.total_params() / 1e9:.2f} B params, {shape.n_attn} attention + {shape.n_gdn} GDN "
          f"layers; {source}) on {a.nodes} x {a.gpus_per_node} {gpu.name}{note}")
    print(f"workload: {w.prompts} prompts x {w.group_size} samples, {w.mean_turns:g} turns (max {w.max_turns}), prompt "
          f"{w.prompt_tokens}, response mean {w.mean_response_tokens} / max {w.max_response_tokens} tokens"
          f"{', KL reference' if w.kl else ''}\n")
    print(render(best, shape, w, gpu, "best layout"))
    if preset_est:
        print("\n" + render(preset_est, shape, w, gpu, f"the config's own layout ({a.config})"))
    print(f"\n## top {min(a.top, len(ranked))} layouts (E2E tokens/s/GPU, step s)")
    for e in ranked[: a.top]:
        print(f"  {e.tokens_per_s_per_gpu['e2e']:8.0f}  {e.step_s:8.1f}  {_fmt_layout(e.layout)}"
              + ("" if e.fits else f"  [does not fit: {e.why_not}]"))
    print("\nCalibrated on one H200 (train MFU, forward MFU, memory overhead, colocated sync, verifier farm);"
          " TP/PP communication, inter-node links and SGLang decode are formulas, not yet measured.")
    return 0


def _est_json(e: Estimate) -> dict[str, Any]:
    d = dataclasses.asdict(e)
    d["train_memory"]["total_gib"] = e.train_memory.total_gib
    return d


if __name__ == "__main__":
    sys.exit(main())
