"""The Megatron actor: policy logprobs, one optimizer step per global batch, RL batches, checkpoints.

One `MegatronActor` lives on every rank of the training group (after
`megatron_rl.parallel.init_parallel`). Every call takes the *global* batch on every rank; the
actor splits it over DP ranks (balanced by tokens) and packs each share into micro-batches that
go through megatron's ``get_forward_backward_func`` (no pipelining, 1F1B or interleaved 1F1B).

Gradient semantics: ``calculate_per_token_loss`` makes megatron sum (not average) over
micro-batches and DP ranks, and the actor's grad finaliser skips megatron's division by the token
count, so the gradient is exactly d/dθ of the summed loss-function outputs; the loss function's
token weights (precomputed over the global batch) make that sum the chosen mean. The result is
independent of DP size and micro-batch split.

An RL rollout batch (`train_rl_batch`) is trained as PPO does it: the logprob fields its loss declares
(π_old from the current weights, π_ref from the initial-policy snapshot) are computed on the train ranks
once, before the first optimizer step, then the batch is split into ``mini_batches`` optimizer steps.
With more than one, the ratio π_θ/π_old moves away from 1 and the clip (clip-higher) acts.
"""
from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.types import TrainSample, validate_samples

from . import optim
from .attention import install_sdpa_attention, install_sync_free_thd_rope
from .batching import MicroBatch, mini_batch_indices, pack_micro_batch, plan_batches
from .forward import ForwardSpec, make_forward_step, unwrap_model
from .losses import LossContext, LossFn, token_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_RNG_KEY = "_actor_rng"


@dataclass
class ActorConfig(optim.OptimSettings):
    """Parallelism, numerics, optimizer (inherited) and batching of the actor (``actor:`` in configs)."""

    hf_config_path: str | None = None          # HF model dir (config.json); or pass hf_config directly
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    params_dtype: str = "bfloat16"             # bfloat16 | float32
    # auto: TransformerEngine when importable on CUDA, else sdpa. te: TE layer spec (packed thd).
    # sdpa: local spec with PyTorch fused attention (packed thd; varlen flash on CUDA).
    # local: megatron's local DotProductAttention (block-diagonal mask for packed samples).
    attention_backend: str = "auto"
    # batching
    max_tokens_per_gpu: int | None = 16384     # dynamic micro-batching budget (tokens per micro-batch)
    micro_batch_size: int | None = None        # fixed samples per micro-batch (used if no token budget)
    logprob_chunk_size: int = 4096             # rows per output-projection chunk
    # recompute each chunk's logits in backward (memory: one chunk's logits at a time) or keep them
    # (saves re-running the output layer, ~7% of an 8B-shaped step's FLOPs; costs chunk x vocab x 8 bytes
    # per chunk of a micro-batch)
    recompute_logprob_chunks: bool = True
    # logits as the output GEMM's fp32 result instead of its bf16 rounding (no effect in fp32). The rollout engines
    # get the same setting (SGLang's enable_fp32_lm_head): the train-vs-rollout logprob mismatch of a trained model
    # comes largely from the two sides rounding logits of magnitude 20-30 to bf16 (`megatron_rl.models.fp32_logits`)
    fp32_lm_head: bool = True
    loss_aggregation: str = "token_mean"       # token_mean | seq_mean
    mini_batches: int = 1                      # optimizer steps per RL rollout batch (PPO mini-batches)
    # memory
    recompute_granularity: str | None = None   # None | selective | full
    recompute_num_layers: int | None = None
    seed: int = 1234
    megatron: dict[str, Any] = field(default_factory=dict)  # extra TransformerConfig fields

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return _DTYPES[self.params_dtype]
        except KeyError:
            raise ValueError(f"params_dtype={self.params_dtype!r}: use 'bfloat16' or 'float32'") from None

    def optim_settings(self) -> optim.OptimSettings:
        return self

    def validate(self) -> None:
        problems = []
        for name in ("tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                problems.append(f"{name}={v!r} must be a positive int")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            problems.append(f"vpp={self.vpp} needs pp >= 2 and vpp >= 2 (or leave it unset)")
        self.torch_dtype  # noqa: B018 - raises on a bad name
        if self.max_tokens_per_gpu is None and self.micro_batch_size is None:
            problems.append("set max_tokens_per_gpu (dynamic micro-batching) or micro_batch_size")
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            problems.append(f"max_tokens_per_gpu={self.max_tokens_per_gpu} must be >= 1")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            problems.append(f"micro_batch_size={self.micro_batch_size} must be >= 1")
        if not isinstance(self.mini_batches, int) or self.mini_batches < 1:
            problems.append(f"mini_batches={self.mini_batches!r} must be an int >= 1")
        if self.logprob_chunk_size < 1:
            problems.append(f"logprob_chunk_size={self.logprob_chunk_size} must be >= 1")
        if self.loss_aggregation not in ("token_mean", "seq_mean"):
            problems.append(f"loss_aggregation={self.loss_aggregation!r}: use token_mean or seq_mean")
        if self.attention_backend not in ("auto", "te", "sdpa", "local"):
            problems.append(f"attention_backend={self.attention_backend!r}: use auto, te, sdpa or local")
        if self.recompute_granularity not in (None, "selective", "full"):
            problems.append(f"recompute_granularity={self.recompute_granularity!r}: use null, selective or full")
        if problems:
            raise ValueError("invalid actor config: " + "; ".join(problems))
        super().validate()


def _finalize_grads_without_token_scaling(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's finalize_model_grads minus its 1/num_tokens scaling (token weights did that), plus the TP sum of
    the grads megatron leaves partial (`megatron_rl.models.build.sum_tp_partial_grads`)."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_rl.models.build import sum_tp_partial_grads

    out = finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    sum_tp_partial_grads(model)
    return out


class MegatronActor:
    """Policy model on this rank: megatron GPTModel chunks under DDP + distributed optimizer."""

    def __init__(self, cfg: ActorConfig, hf_config=None):
        from megatron.core import parallel_state as ps
        from megatron_rl.models import BuildOptions, ParallelSizes, build_model, spec_for, te_available, text_config

        cfg.validate()
        if hf_config is None:
            if not cfg.hf_config_path:
                raise ValueError("MegatronActor needs hf_config or ActorConfig.hf_config_path")
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(cfg.hf_config_path)
        if not ps.model_parallel_is_initialized():
            raise RuntimeError("call megatron_rl.parallel.init_parallel(tp, pp) before building the actor")
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (cfg.tp, cfg.pp):
            raise RuntimeError(
                f"parallel state is tp={ps.get_tensor_model_parallel_world_size()} "
                f"pp={ps.get_pipeline_model_parallel_world_size()}, actor config asks tp={cfg.tp} pp={cfg.pp}")
        if ps.get_context_parallel_world_size() != 1:
            raise RuntimeError("context parallelism is not supported by the actor")
        self.cfg = cfg
        self.hf_config = hf_config
        self.vocab_size = int(text_config(hf_config).vocab_size)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")

        backend = cfg.attention_backend
        if backend == "auto":
            backend = "te" if te_available() else "sdpa"
        if backend == "te" and not te_available():
            raise RuntimeError("attention_backend='te' needs TransformerEngine and CUDA")
        self.attention_backend = backend
        use_te = backend == "te"
        self.packed_mode = "mask" if backend == "local" else "thd"
        if self.packed_mode == "mask" and spec_for(hf_config).needs_thd_packing:
            raise ValueError(f"attention_backend='local' packs samples with a block mask, which cannot keep them "
                             f"apart in {spec_for(hf_config).name}'s recurrent (Gated DeltaNet) layers; use 'sdpa' "
                             f"or 'te' (packed thd with cu_seqlens)")
        extra = {"calculate_per_token_loss": True}
        if cfg.vpp:
            # Interleaved 1F1B sends activations and grads between the same two ranks in one batch
            # when pp == 2; overlapped (unbatched) p2p keeps them apart (Megatron-LM's default).
            extra.update(overlap_p2p_comm=True, batch_p2p_comm=False)
        extra.update(cfg.megatron)
        build_opts = BuildOptions(
            params_dtype=cfg.torch_dtype, use_te=use_te,
            recompute_granularity=cfg.recompute_granularity,
            recompute_num_layers=cfg.recompute_num_layers, extra=extra)
        par = ParallelSizes(cfg.tp, cfg.pp, cfg.vpp, cfg.sequence_parallel)
        _seed_everything(cfg.seed)  # reproducible random init (before weights are loaded)
        chunks = build_model(hf_config, par, build_opts)
        if backend == "sdpa":
            install_sdpa_attention(chunks)
        if self.packed_mode == "thd":
            install_sync_free_thd_rope()   # megatron's unfused thd RoPE syncs with the host 4x per layer
        settings = cfg.optim_settings()
        self.model = optim.wrap_ddp(chunks, settings)
        self.config = unwrap_model(self.model[0]).config
        if not self.config.calculate_per_token_loss:
            raise ValueError("megatron.calculate_per_token_loss must stay True (the actor's gradient "
                             "semantics depend on it)")
        self.config.finalize_model_grads_func = _finalize_grads_without_token_scaling
        if cfg.overlap_grad_reduce:
            no_sync = [c.no_sync for c in self.model]
            grad_sync = [c.start_grad_sync for c in self.model]
            self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
            self.config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
        self.optimizer = optim.build_optimizer(self.model, settings, cfg.torch_dtype)
        self.scheduler = optim.build_scheduler(self.optimizer, settings)
        self.iteration = 0
        self._pad_multiple = cfg.tp if (cfg.sequence_parallel and cfg.tp > 1) else 1
        self._offloaded = False
        self._host_stash = optim.HostStash()   # pinned host copies of the state, reused by every offload
        self._reference: list[torch.Tensor] | None = None

    # ----- parallel layout -------------------------------------------------------------------
    @staticmethod
    def _ps():
        from megatron.core import parallel_state as ps

        return ps

    @property
    def dp_size(self) -> int:
        return self._ps().get_data_parallel_world_size()

    @property
    def dp_rank(self) -> int:
        return self._ps().get_data_parallel_rank()

    def _is_last_stage(self) -> bool:
        return self._ps().is_pipeline_last_stage(ignore_virtual=True)

    def _reports_results(self) -> bool:
        """Exactly one rank per DP replica contributes results to world-wide sums."""
        return self._is_last_stage() and self._ps().get_tensor_model_parallel_rank() == 0

    # ----- weights ---------------------------------------------------------------------------
    def load_hf(self, hf_dir_or_state: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
        """Initialise the weights from an HF checkpoint dir (read lazily) or a name -> tensor map."""
        from megatron_rl.bridge import LazyHFState, get_bridge

        state = LazyHFState(hf_dir_or_state) if isinstance(hf_dir_or_state, (str, os.PathLike)) \
            else hf_dir_or_state
        get_bridge(self.hf_config).load_hf_into(self.model, state)
        self.optimizer.reload_model_params()  # fp32 main params := the new model params

    def export_hf(self, dtype: torch.dtype | None = None, hf_names: Sequence[str] | None = None):
        """Stream (HF name, full tensor) pairs (collective over the model-parallel group). `hf_names`, a source
        checkpoint's tensor names, make the stream use that checkpoint's names (`get_bridge`); without them the
        config class's own names."""
        from megatron_rl.bridge import get_bridge

        return get_bridge(self.hf_config, hf_names=hf_names).export_hf(self.model, dtype=dtype)

    # ----- batching --------------------------------------------------------------------------
    def _plan(self, samples: Sequence[TrainSample]):
        count_multiple = self.cfg.pp if self.cfg.vpp else 1
        return plan_batches([len(s) for s in samples], self.dp_size,
                            max_tokens_per_gpu=self.cfg.max_tokens_per_gpu,
                            micro_batch_size=self.cfg.micro_batch_size, count_multiple=count_multiple)

    def _data_iterator(self, micro_batches: list[MicroBatch]):
        if len(self.model) == 1:
            return iter(micro_batches)
        return [iter(micro_batches) for _ in self.model]

    def _run_schedule(self, micro_batches: list[MicroBatch], spec: ForwardSpec, on_output, *, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
        return fb(
            forward_step_func=make_forward_step(spec, on_output),
            data_iterator=self._data_iterator(micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=max(mb.seq_len for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    # ----- logprobs --------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample], with_entropy: bool = False,
                         trained_only: bool = False):
        """Per-sample ``log p(tokens[i] | tokens[:i])`` (index 0 is 0), on every rank.

        Returns a list of float32 CPU tensors of ``len(tokens)``; with ``with_entropy`` a pair
        ``(logprobs, entropies)`` where ``entropies[i]`` is the entropy of the distribution that
        predicted token i. ``trained_only`` computes tokens with ``loss_mask == 1`` only (the
        others are 0): RL losses read nothing else, and it spares the output layer the prompts.
        Forward-only through the pipeline schedule; results are assembled from the last PP stage
        of every DP replica with one world all-reduce.
        """
        validate_samples(samples, vocab_size=self.vocab_size)
        self._check_onloaded()
        plan = self._plan(samples)
        rows = "trained" if trained_only else "all"
        mbs = [pack_micro_batch(samples, idx, rows=rows, pad_multiple=self._pad_multiple).to(self.device)
               for idx in plan.for_rank(self.dp_rank)]
        spec = ForwardSpec(self.vocab_size, self.cfg.logprob_chunk_size, with_entropy, self.packed_mode,
                           fp32_logits=self.cfg.fp32_lm_head)

        def on_output(mb, output, non_loss_data=False):
            return mb, output.detach().float()

        for c in self.model:
            c.eval()
        try:
            outputs = self._run_schedule(mbs, spec, on_output, forward_only=True)
        finally:
            for c in self.model:
                c.train()

        lengths = [len(s) for s in samples]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        k = 2 if with_entropy else 1
        flat = torch.zeros(k, int(sum(lengths)), dtype=torch.float32, device=self.device)
        if self._reports_results():
            starts_t = torch.as_tensor(starts, device=self.device)
            for mb, out in outputs:
                real = mb.row_sample >= 0
                pos = starts_t[mb.row_sample[real]] + mb.row_token[real]
                flat[:, pos] = out[real].T
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        flat = flat.cpu()
        per_sample = [list(torch.split(flat[j], lengths)) for j in range(k)]
        return (per_sample[0], per_sample[1]) if with_entropy else per_sample[0]

    # ----- training --------------------------------------------------------------------------
    def train_step(self, samples: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the global batch. Returns metrics reduced over the batch:
        ``loss`` (the summed loss = the aggregated mean), each loss-fn metric as sum/count,
        ``grad_norm``, ``lr``, ``num_tokens`` (trained tokens), ``num_samples``,
        ``num_micro_batches``, ``skipped`` and ``iteration``.

        A non-finite loss or gradient skips the update: params, optimizer state and LR schedule
        stay as they were and ``skipped`` is True.
        """
        validate_samples(samples, vocab_size=self.vocab_size,
                         required_fields=tuple(getattr(loss_fn, "required_fields", ()) or ()))
        self._check_onloaded()
        if not any(s.num_trained_tokens for s in samples):
            raise ValueError("train_step: no sample has a trained token (every loss_mask is all 0)")
        field_names = sorted(samples[0].fields)
        weights = token_weights(samples, self.cfg.loss_aggregation)
        plan = self._plan(samples)
        mbs = [pack_micro_batch(samples, idx, token_weights=weights, field_names=field_names, rows="trained",
                                pad_multiple=self._pad_multiple).to(self.device)
               for idx in plan.for_rank(self.dp_rank)]
        spec = ForwardSpec(self.vocab_size, self.cfg.logprob_chunk_size, bool(loss_fn.needs_entropy),
                           self.packed_mode, recompute_chunks=self.cfg.recompute_logprob_chunks,
                           fp32_logits=self.cfg.fp32_lm_head)

        def on_output(mb, output, non_loss_data=False):
            ctx = LossContext(
                logprobs=output[:, 0],
                entropy=output[:, 1] if output.shape[1] > 1 else None,
                loss_mask=mb.row_loss_mask,
                token_weight=mb.row_weight,
                fields=mb.row_fields,
                sample_index=mb.row_sample,
            )
            loss, metrics = loss_fn(ctx)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"loss function must return a scalar tensor, got {loss!r}")
            loss = loss.reshape(())
            reduced = {name: torch.stack([torch.as_tensor(s, device=self.device).detach().double().reshape(()),
                                          torch.as_tensor(c, device=self.device).detach().double().reshape(())])
                       for name, (s, c) in metrics.items()}
            reduced["loss"] = torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64,
                                                                              device=self.device)])
            num_rows = torch.tensor(int(mb.rows.numel()), dtype=torch.int, device=self.device)
            return loss, num_rows, reduced

        for c in self.model:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced_per_mb = self._run_schedule(mbs, spec, on_output, forward_only=False)

        metrics, grads_finite = self._reduce_metrics(reduced_per_mb)
        lr = optim.current_lr(self.optimizer)
        skipped = not (grads_finite and math.isfinite(metrics.get("loss", 0.0)))
        grad_norm = float("nan")
        if not skipped:
            ok, norm, _ = self.optimizer.step()
            grad_norm = float(norm) if norm is not None else float("nan")
            skipped = not ok
        if skipped:
            logger.warning("iteration %d: non-finite loss/gradient (loss=%s, grad_norm=%s); update skipped",
                           self.iteration, metrics.get("loss"), grad_norm)
            # Leave no trace of the bad step in the grad buffers.
            for c in self.model:
                c.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.scheduler.step(increment=1)
        self.iteration += 1
        num_tokens = int(sum(s.num_trained_tokens for s in samples))
        metrics.update(grad_norm=grad_norm, lr=lr, num_tokens=float(num_tokens),
                       num_samples=float(len(samples)), num_micro_batches=float(len(mbs)),
                       skipped=bool(skipped), iteration=float(self.iteration))
        return metrics

    # ----- RL: one rollout batch ---------------------------------------------------------------
    def snapshot_reference(self) -> None:
        """Keep this rank's shards of the current weights on the host as π_ref, the KL reference."""
        self._reference = [p.detach().to("cpu", copy=True) for p in self._params()]

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.model for p in chunk.parameters()]

    @torch.no_grad()
    def reference_logprobs(self, samples: Sequence[TrainSample], trained_only: bool = True) -> list[torch.Tensor]:
        """`compute_logprobs` under the reference snapshot: swap it in, compute, swap the policy back."""
        if self._reference is None:
            raise RuntimeError("no reference snapshot: call snapshot_reference() first")
        params = self._params()
        current = [p.detach().to("cpu", copy=True) for p in params]
        for p, r in zip(params, self._reference):
            p.copy_(r.to(p.device))
        try:
            return self.compute_logprobs(samples, trained_only=trained_only)
        finally:
            for p, c in zip(params, current):
                p.copy_(c.to(p.device))

    def train_rl_batch(self, samples: Sequence[TrainSample], loss_fn: LossFn,
                       num_mini_batches: int | None = None) -> dict[str, float]:
        """Train on one rollout batch: the loss's ``computed_fields`` (``{field: "policy" | "reference"}``)
        that the samples do not carry are computed here, once, before the first optimizer step (so π_old is the
        policy that generated the batch), then one `train_step` per mini-batch (``cfg.mini_batches`` by default).

        Metrics: token-weighted means over mini-batches of the loss metrics, ``grad_norm`` averaged over the
        steps taken, sums of the counts, the last ``lr`` and ``iteration``, ``mini_batches``,
        ``skipped_mini_batches``, and ``skipped`` when every step was skipped (weights unchanged).
        """
        validate_samples(samples, vocab_size=self.vocab_size)
        for name, weights in getattr(loss_fn, "computed_fields", {}).items():
            if name in samples[0].fields:
                continue
            if weights == "policy":
                lps = self.compute_logprobs(samples, trained_only=True)
            elif weights == "reference":
                lps = self.reference_logprobs(samples)
            else:
                raise ValueError(f"loss field {name!r}: unknown weights {weights!r} (use 'policy' or 'reference')")
            for s, lp in zip(samples, lps):
                s.fields[name] = lp.numpy()
        parts = mini_batch_indices(len(samples), num_mini_batches or self.cfg.mini_batches)
        results = [self.train_step([samples[i] for i in idx], loss_fn) for idx in parts]
        return _combine_mini_batches(results)

    def _reduce_metrics(self, reduced_per_mb: list[dict]) -> tuple[dict[str, float], bool]:
        """Sum (sum, count) pairs over micro-batches, DP replicas and stages; one all-reduce also
        carries every rank's "gradients are finite" flag."""
        local_names = sorted({k for d in reduced_per_mb for k in d}) if self._reports_results() else []
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[list[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(gathered, local_names)
            names = sorted({n for g in gathered for n in g})
        else:
            names = local_names
        vec = torch.zeros(len(names) * 2 + 1, dtype=torch.float64, device=self.device)
        if self._reports_results():
            for d in reduced_per_mb:
                for j, n in enumerate(names):
                    if n in d:
                        vec[2 * j: 2 * j + 2] += d[n].to(vec.device)
        vec[-1] = 0.0 if optim.grads_are_finite(self.model) else 1.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec)
        vals = vec.cpu().tolist()
        out: dict[str, float] = {}
        for j, n in enumerate(names):
            s, c = vals[2 * j], vals[2 * j + 1]
            if n == "loss":
                out[n] = s
            else:
                out[n] = s / c if c else float("nan")
        return out, vals[-1] == 0.0

    # ----- checkpoints -----------------------------------------------------------------------
    def save(self, ckpt_root: str | os.PathLike, iteration: int | None = None, extra: dict | None = None,
             hf_assets_dir: str | os.PathLike | None = None) -> str:
        """Save weights, optimizer, LR schedule, this rank's RNG states and ``extra`` (and the HF config, tokenizer
        and chat template files of ``hf_assets_dir``, which an HF export of the checkpoint carries)."""
        from megatron_rl.checkpoint import save_checkpoint

        self._check_onloaded()
        iteration = self.iteration if iteration is None else iteration
        payload = dict(extra or {})
        payload[_RNG_KEY] = _rng_state()
        payload["_actor_iteration"] = self.iteration
        return save_checkpoint(ckpt_root, iteration, self.model, optimizer=self.optimizer,
                               opt_param_scheduler=self.scheduler, extra=payload, hf_config=self.hf_config,
                               hf_assets_dir=hf_assets_dir)

    def load(self, ckpt_root: str | os.PathLike, iteration: int | None = None, load_optimizer: bool = True) -> dict:
        """Load a checkpoint (any TP/PP it was saved at); returns the saved ``extra`` (+ iteration)."""
        from megatron_rl.checkpoint import load_checkpoint

        self._check_onloaded()
        extra = load_checkpoint(ckpt_root, self.model, optimizer=self.optimizer if load_optimizer else None,
                                opt_param_scheduler=self.scheduler if load_optimizer else None,
                                iteration=iteration, load_optimizer=load_optimizer)
        if not load_optimizer:
            self.optimizer.reload_model_params()
        rng = extra.pop(_RNG_KEY, None)
        if rng is not None:
            _set_rng_state(rng)
        self.iteration = int(extra.pop("_actor_iteration", extra.get("iteration", 0)))
        return extra

    # ----- colocation ------------------------------------------------------------------------
    def state_offload(self) -> None:
        """Move params, grads and optimizer state to host memory (no-op on CPU)."""
        if not self._offloaded:
            optim.offload_to_cpu(self.model, self.optimizer, self._host_stash)
            self._offloaded = True

    def state_onload(self) -> None:
        if self._offloaded:
            optim.restore_from_cpu(self.model, self.optimizer, self._host_stash)
            self._offloaded = False

    def _check_onloaded(self) -> None:
        if self._offloaded:
            raise RuntimeError("actor state is offloaded; call state_onload() first")


_SUMMED = ("num_tokens", "num_samples", "num_micro_batches")
_LAST = ("lr", "iteration")


def _combine_mini_batches(results: list[dict[str, float]]) -> dict[str, float]:
    """Per-mini-batch `train_step` metrics -> one row for the rollout batch (see `train_rl_batch`)."""
    out: dict[str, Any] = {k: sum(r[k] for r in results) for k in _SUMMED}
    out.update({k: results[-1][k] for k in _LAST})
    taken = [r for r in results if not r["skipped"]]
    out["grad_norm"] = sum(r["grad_norm"] for r in taken) / len(taken) if taken else float("nan")
    for k in sorted({k for r in results for k in r} - set(out) - {"skipped"}):
        pairs = [(r[k], r["num_tokens"]) for r in results if k in r and math.isfinite(r[k])]
        weight = sum(w for _, w in pairs)
        out[k] = sum(v * w for v, w in pairs) / weight if weight else float("nan")
    out.update(mini_batches=float(len(results)), skipped_mini_batches=float(len(results) - len(taken)),
               skipped=not taken)
    return out


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["megatron_cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda_tracker"])
