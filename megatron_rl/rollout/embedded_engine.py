"""The embedded rollout engine: an HF transformers causal LM with batched, KV-cached generation.

It exists for one machine and for CI, behind the SGLang HTTP subset (`embedded_server.py`). This
module holds the engine itself, independent of HTTP:

* a scheduler thread batches waiting requests (up to `max_batch_size`), left-pads them, prefills once
  and decodes step by step; finished rows leave, and requests that arrive meanwhile are prefilled on
  their own and join the running batch at the next step (continuous batching);
* two decode paths with the same results: ``slots`` (the default wherever the model's layers are full or
  linear attention; `slot_decode.py`): preallocated per-request K/V and GDN-state slots, one CUDA graph per
  batch size on a GPU; ``dynamic``: transformers' DynamicCache, rows concatenated and cropped as requests
  join and leave (any architecture transformers can cache);
* per-request sampling and logprobs (`sampling.py`, SGLang semantics);
* SGLang control semantics: pause (``abort`` ends in-flight requests with finish reason abort;
  ``in_place``/``retract`` freeze them until continue), flush refused unless idle, memory
  release/resume by tag (weights, kv_cache);
* atomic weight updates by HF name: buckets of one update are staged (copied into engine memory) and
  committed together, bumping the weight version, only when the final bucket arrives. A failed or
  partial update never touches the serving weights or the version.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import threading
import time
import uuid
from typing import Any, Callable, Iterable

import torch

from megatron_rl.models.fp32_logits import use_fp32_lm_head

from .sampling import RequestSampling, request_uniforms, sample, seed_tensor, unfiltered
from .grouped_projections import ProjectionGroups, group_projections, grouped
from .slot_decode import SlotDecoder, compile_blocks, slot_compatible, supports_slots, use_decode_attention

log = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
PAUSE_MODES = ("abort", "in_place", "retract")
MAX_WAVE_FAILURES = 3  # consecutive failed waves before the scheduler gives up (and /health fails)
DECODE_PATHS = ("auto", "slots", "dynamic")
SLOW_PREFILL_S = 2.0  # one prefill forward longer than this is logged with its shape
#: fla's L2 norm of q and k inside its gated delta rule autotunes on NB = cdiv(rows, 2048 * 32), rows = prefill
#: tokens x heads, NB a compile-time constant (fla 0.4: ``fla/modules/l2norm.py``; its gated RMSNorm keys the same
#: way where a model uses it): every new NB costs ~8 s of Triton autotuning the first time a machine meets it
FLA_ROWS_PER_BLOCK = 2048 * 32


class EngineStateError(RuntimeError):
    """The request is valid but the engine's state refuses it (busy, paused, memory released...)."""


class WeightUpdateError(ValueError):
    """A weight update was rejected; the staged update (if any) was discarded."""


@dataclasses.dataclass(frozen=True)
class EmbeddedEngineConfig:
    max_batch_size: int = 32
    default_max_new_tokens: int = 128
    weight_version: str = "0"
    seed: int | None = None          # base seed for requests without sampling_seed
    context_length: int | None = None  # default: the model's max_position_embeddings
    # before starting a batch the scheduler waits this long for more requests, so a group sent at once is
    # prefilled together rather than as one request and then the rest
    gather_ms: float = 20.0
    # requests arriving while a batch decodes join it at the next step (False: waves run to completion)
    continuous_batching: bool = True
    # "slots" (preallocated cache slots, CUDA graphs on a GPU), "dynamic" (HF DynamicCache), "auto": slots
    # when the model's layers allow it
    decode: str = "auto"
    cuda_graphs: bool = True
    # torch.compile the slot decode step (fuses its small kernels; the first step of each shape compiles)
    compile_decode: bool = False
    # on a GPU (without compile_decode), torch.compile the model's norm and MLP blocks: a third of a decode
    # step's small kernels fused, compiled in seconds (`slot_decode.compile_blocks`); the 8B shape at 64 requests
    # decodes 4,078 tokens/s with them, 3,665 without (bench/results/embedded_generate_h200.md), and bf16
    # logprobs stay as close to fp32 (tests/rollout/test_slot_decode_gpu.py, passed on an H200)
    compile_blocks: bool = True
    # one GEMM for the projections that read one input (q/k/v, gate/up, GDN in_proj_*), the HF parameters slices
    # of the fused weight (`grouped_projections`): the decode GEMMs read the weights faster and a step launches
    # fewer kernels. None: on a GPU unless compile_decode (whose dynamo trace it would break up); True/False: forced
    group_projections: bool | None = None
    # share of the device memory free at allocation that the slot cache may take (SGLang: mem_fraction_static)
    kv_cache_fraction: float = 0.6
    # a group of joining requests is prefilled in chunks of at most this many (padded) tokens
    max_prefill_tokens: int = 16384
    # slot path: launch decode step k+1 before reading step k's tokens back, so the host's per-step work (the
    # device sync, recording tokens, stop checks, scheduling) runs while the device computes instead of between
    # steps. Outputs are identical (draws are keyed by request seed and token index); a request that stops at
    # step k has computed one more row-step, discarded. Steps over requests with top-k/top-p filters, which
    # sample on the host from the step's logits, run one at a time
    overlap_decode: bool = True
    # logits as the LM head GEMM's fp32 result, not its bf16 rounding (SGLang's enable_fp32_lm_head; the trainer
    # sets it to the actor's fp32_lm_head so both sides compute the same numbers, `megatron_rl.models.fp32_logits`)
    fp32_lm_head: bool = False


@dataclasses.dataclass
class GenRequest:
    rid: str
    prompt: list[int]
    sampling: RequestSampling
    return_logprob: bool
    on_done: Callable[[dict], None]
    seed: int = 0   # the draws' seed: token i uses request_uniforms(seed, i)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: dict | None = None
    abort_message: str | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class _InflightStep:
    """A launched slot decode step whose tokens have not been recorded yet (`EmbeddedEngineConfig.overlap_decode`):
    the requests of its rows in row order, its outputs' host copies, and the event after which they are there."""
    active: list[GenRequest]
    tokens: torch.Tensor
    logprobs: torch.Tensor
    ready: Any   # torch.cuda.Event, or None on a CPU (the copies are synchronous there)
    launched: float


@dataclasses.dataclass
class _StagedUpdate:
    update_id: str
    tensors: dict[str, torch.Tensor]


@dataclasses.dataclass
class EngineStats:
    """Cumulative work of the scheduler (reported by /get_server_info; a client takes differences): where a
    rollout's generation time goes. Each figure is timed around a forward whose results reach the host, so the
    device work is inside it."""
    prefills: int = 0
    prefill_requests: int = 0
    prefill_tokens: int = 0          # prompt tokens (padding excluded)
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0             # running requests summed over the steps (rows / steps = mean batch)
    decode_s: float = 0.0            # CUDA graph captures excluded (slot path: SlotStats.graph_capture_s)
    # rows of overlapped steps whose request had stopped at the step before (computed, then dropped)
    decode_rows_discarded: int = 0

    def prefilled(self, requests: list, seconds: float, width: int, forward_s: float | None = None) -> None:
        if seconds > SLOW_PREFILL_S:   # the per-rollout sums hide one slow forward (a kernel build, a lock wait)
            log.info("slow prefill: %d requests x %d tokens (left-padded) took %.2f s%s", len(requests), width,
                     seconds, "" if forward_s is None else f" (forward and first tokens {forward_s:.2f} s)")
        self.prefills += 1
        self.prefill_requests += len(requests)
        self.prefill_tokens += sum(len(r.prompt) for r in requests)
        self.prefill_s += seconds

    def decoded(self, rows: int, seconds: float, discarded: int = 0) -> None:
        self.decode_steps += 1
        self.decode_rows += rows
        self.decode_rows_discarded += discarded
        self.decode_s += seconds


def prefill_warm_shapes(config: Any, *, max_tokens: int, context_length: int, max_batch: int) -> list[tuple[int, int]]:
    """(rows, length) prefills that meet, before any request does, every autotuning key of fla's Gated DeltaNet
    kernels that a prefill chunk of at most `max_tokens` padded tokens can: NB = cdiv(tokens x heads,
    FLA_ROWS_PER_BLOCK) of its norm kernels (one shape per bucket of the most heads; the key heads' buckets are
    then met too) and the batch size its chunk cumsum keys on (1 to `max_batch` rows, up to one 64-token chunk).
    No row is longer than the context allows. Empty for a model without Gated DeltaNet layers."""
    text = getattr(config, "get_text_config", lambda: config)()
    longest = min(max_tokens, context_length - 1)
    if "linear_attention" not in (getattr(text, "layer_types", None) or ()) or longest < 1:
        return []
    heads = max(int(getattr(text, "linear_num_value_heads", 0) or 0), int(getattr(text, "linear_num_key_heads", 0) or 0))
    if heads < 1:
        return []
    step = max(1, FLA_ROWS_PER_BLOCK // heads)
    totals = list(range(step, max_tokens + 1, step))
    if not totals or totals[-1] != max_tokens:
        totals.append(max_tokens)
    shapes = []
    for total in totals:
        rows = -(-total // longest)
        # rows x (total // rows) lies in (total - rows, total]: the bucket of `total`, as rows < step
        shapes.append((rows, total // rows))
    for b in range(1, min(max_batch, max_tokens) + 1):   # a chunk of b rows holds at most max_tokens // b each
        shape = (b, min(64, longest, max_tokens // b))
        if shape not in shapes:
            shapes.append(shape)
    return shapes


#: the language model's prefix in multimodal HF checkpoints (``model.language_model.layers.0...``)
_MULTIMODAL_LM_PREFIX = "model.language_model."


class EmbeddedEngine:
    def __init__(self, model: torch.nn.Module, config: EmbeddedEngineConfig | None = None, *,
                 tokenizer: Any = None, model_path: str | None = None):
        self.model = model.eval()
        self.config = config or EmbeddedEngineConfig()
        if self.config.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.config.max_batch_size}")
        if self.config.decode not in DECODE_PATHS:
            raise ValueError(f"decode must be one of {DECODE_PATHS}, got {self.config.decode!r}")
        if not 0.0 < self.config.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.config.kv_cache_fraction}")
        if self.config.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.config.max_prefill_tokens}")
        self.tokenizer = tokenizer
        self.model_path = model_path
        hf = model.config
        self.vocab_size = int(getattr(hf, "get_text_config", lambda: hf)().vocab_size)
        self.context_length = int(self.config.context_length or getattr(hf, "max_position_embeddings", 32768))
        self.eos_ids = _eos_ids(model)
        self.device = next(model.parameters()).device
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._weight_version = str(self.config.weight_version)
        self._seed_rng = torch.Generator().manual_seed(self.config.seed) if self.config.seed is not None else None
        use_decode_attention(model)
        if self.config.fp32_lm_head and not use_fp32_lm_head(model):
            raise ValueError("fp32_lm_head: this model's output embedding is not a bias-free linear layer running its "
                             "own forward (a bias, another module type, or a forward replaced by a hook)")
        why_not = supports_slots(model)
        if self.config.decode == "slots" and why_not:
            raise ValueError(f"decode='slots' cannot serve this model: {why_not}")
        if self.config.compile_decode and "linear_attention" in (getattr(model.config, "layer_types", None) or ()):
            # on the CPU, inductor's code for the compiled GDN step corrupted the heap; never tried on a GPU
            raise ValueError("compile_decode supports attention-only models; this one has Gated DeltaNet layers")
        group = self.config.group_projections
        if group and self.config.compile_decode:
            raise ValueError("group_projections and compile_decode do not go together: the grouped projections' "
                             "per-input cache breaks the compiled step's graph at every layer")
        if group is None:
            group = self.device.type == "cuda" and not self.config.compile_decode
        # before compile_blocks (it compiles grouped MLPs). A model another engine grouped stays grouped whatever
        # this engine asked: its release and resume must free and rebuild the same fused tensors
        self.projection_groups: ProjectionGroups | None = group_projections(model) if group else grouped(model)
        self.compiled_blocks = 0
        if self.config.compile_blocks and self.device.type == "cuda" and not self.config.compile_decode:
            self.compiled_blocks = compile_blocks(model)
        self._slots: SlotDecoder | None = None
        if self.config.decode != "dynamic" and why_not is None:
            self._slots = SlotDecoder(model, max_batch=self.config.max_batch_size, context_length=self.context_length,
                                      cuda_graphs=self.config.cuda_graphs,
                                      memory_fraction=self.config.kv_cache_fraction,
                                      compile_decode=self.config.compile_decode)

        self._cv = threading.Condition()
        self._model_lock = threading.RLock()
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._running: list[GenRequest] = []
        self._paused: str | None = None
        self._stop = False
        self._released: set[str] = set()
        self._staged: _StagedUpdate | None = None
        self._staged_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._joinable: bool | None = None  # can requests join a running batch (decided on the first cache)
        self._inflight: _InflightStep | None = None   # the scheduler thread's only
        self._holding = False   # the scheduler holds its requests still (paused in place, nothing in flight)
        self._host_out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]   # pinned, alternating
        self._last_decoded = 0.0
        self.stats = EngineStats()
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="embedded-engine", daemon=True)
            self._thread.start()

    def warm_up(self, timeout_s: float = 600.0, prompt_tokens: int = 16, new_tokens: int = 4) -> float:
        """Serve one short request before taking traffic, as SGLang's server does at start-up: the first use of
        each path builds what it needs (Triton kernels of fla's GDN ops, compiled on first call; the decode
        graph of batch 1; the slot buffers), which would otherwise land inside the first rollout. Seeded and
        greedy, so the engine's own seed stream is untouched. Returns its seconds; raises if it fails."""
        length = min(prompt_tokens, self.context_length - new_tokens - 1)
        if length < 1:
            return 0.0   # a context too small for any warm-up request: nothing to build ahead
        self.start()
        done = threading.Event()
        out: dict = {}

        def finished(o: dict) -> None:
            out.update(o)
            done.set()

        sampling = RequestSampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, max_new_tokens=new_tokens,
                                   stop_token_ids=frozenset(), stop_strings=(), ignore_eos=True, seed=0)
        prompt = [(7 + 13 * i) % self.vocab_size for i in range(length)]
        t0 = time.perf_counter()
        self.submit(self.new_request(prompt, sampling, return_logprob=False, on_done=finished, rid="warmup"))
        if not done.wait(timeout_s):
            raise EngineStateError(f"warm-up request did not finish within {timeout_s:.0f} s")
        reason = (out.get("meta_info") or {}).get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise EngineStateError(f"warm-up request failed: {reason.get('message')}")
        self._warm_prefill_buckets()
        return time.perf_counter() - t0

    def _warm_prefill_buckets(self) -> list[tuple[int, int]]:
        """On a GPU, the prefill shapes of :func:`prefill_warm_shapes` (returned; none on a CPU, where fla's
        kernels are not used): otherwise each new autotuning key of fla's kernels costs its autotuning (~8 s for
        the L2 norm's 30 configs, each compiled anew) inside whichever rollout first meets it (on the H200: 9-13 s
        on every other RL step). Triton keeps the results on disk, so a later start on the same machine only runs
        the forwards."""
        if self.device.type != "cuda":
            return []
        shapes = prefill_warm_shapes(self.model.config, max_tokens=self.config.max_prefill_tokens,
                                     context_length=self.context_length, max_batch=self.config.max_batch_size)
        if not shapes:
            return []
        from transformers import DynamicCache

        t0 = time.perf_counter()
        with self._model_lock, torch.no_grad():
            if "weights" in self._released:
                raise EngineStateError("weights were released before the warm-up")
            for rows, length in shapes:
                ids = torch.full((rows, length), 7 % self.vocab_size, dtype=torch.long, device=self.device)
                pos = torch.arange(length, device=self.device).expand(rows, length)
                self.model(input_ids=ids, position_ids=pos, past_key_values=DynamicCache(config=self.model.config),
                           use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize(self.device)
        log.info("warm-up: %d prefill shapes (up to %d tokens, 1-%d rows) in %.1f s", len(shapes),
                 max(r * n for r, n in shapes), max(r for r, _ in shapes), time.perf_counter() - t0)
        return shapes

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            for r in list(self._waiting) + list(self._running):
                r.abort_message = "engine shutting down"
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._cv:
            for r in list(self._waiting):
                self._finish(r, {"type": "abort", "message": "engine shutting down"})
            self._waiting.clear()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ------------------------------------------------------------------ state queries

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def paused(self) -> str | None:
        return self._paused

    @property
    def released_tags(self) -> list[str]:
        return sorted(self._released)

    def decode_info(self) -> dict:
        """Which decode path serves, (slots) the cache and graph figures, and the cumulative `EngineStats`."""
        stats = {"engine_stats": {**dataclasses.asdict(self.stats),
                                  "graph_capture_s": self._slots.stats.graph_capture_s if self._slots else 0.0},
                 "compiled_blocks": self.compiled_blocks,
                 "grouped_projections": len(self.projection_groups) if self.projection_groups is not None else 0}
        if self._slots is None:
            return {"decode": "dynamic", **stats}
        return {"decode": "slots", **self._slots.info(), **stats}

    def _in_flight(self) -> int:
        """Requests of the current wave not yet answered (lock held). A wave's requests are answered as they
        finish, before the wave itself ends: a client that got its answer must find the engine idle."""
        return sum(r.finish is None for r in self._running)

    def is_idle(self) -> bool:
        with self._cv:
            return not self._waiting and not self._in_flight()

    def load(self) -> dict:
        with self._cv:
            return {"running": self._in_flight(), "waiting": len(self._waiting)}

    # ------------------------------------------------------------------ requests

    def new_request(self, prompt: list[int], sampling: RequestSampling, *, return_logprob: bool,
                    on_done: Callable[[dict], None], rid: str | None = None) -> GenRequest:
        if not prompt:
            raise ValueError("input_ids is empty")
        not_ids = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
        if not_ids:
            raise ValueError(f"input_ids must be integers (token ids), got {len(not_ids)} other value(s), "
                             f"e.g. {not_ids[0]!r}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids contains {len(bad)} token(s) outside [0, {self.vocab_size}), e.g. {bad[0]!r}")
        if len(prompt) >= self.context_length:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context length {self.context_length}")
        return GenRequest(rid=rid or uuid.uuid4().hex, prompt=list(prompt), sampling=sampling,
                          return_logprob=return_logprob, on_done=on_done)

    def submit(self, req: GenRequest) -> None:
        if self.error is not None:
            raise EngineStateError(f"engine failed earlier: {self.error!r}")
        if self._released & {"weights", "kv_cache"}:
            raise EngineStateError(
                f"memory is released ({', '.join(sorted(self._released))}); call /resume_memory_occupation first")
        seed = req.sampling.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng).item()) if self._seed_rng is not None \
                else secrets.randbits(62)
        req.seed = int(seed)
        if req.sampling.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        with self._cv:
            if self._stop:
                raise EngineStateError("engine is shutting down")
            self._waiting.append(req)
            self._cv.notify_all()

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort one request by id, or all; returns how many were found."""
        n = 0
        with self._cv:
            for r in list(self._waiting):
                if abort_all or r.rid == rid:
                    self._waiting.remove(r)
                    self._finish(r, {"type": "abort", "message": "aborted by request"})
                    n += 1
            for r in self._running:
                if abort_all or r.rid == rid:
                    r.abort_message = "aborted by request"
                    n += 1
            self._cv.notify_all()
        return n

    def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._cv:
            self._paused = mode
            if mode == "abort":
                for r in list(self._waiting):
                    self._finish(r, {"type": "abort", "message": "generation paused"})
                self._waiting.clear()
                for r in self._running:
                    r.abort_message = "generation paused"
            self._cv.notify_all()
        if mode == "abort":
            self._wait_until(lambda: not self._running, timeout=300)
        else:   # returns once the scheduler holds (its step in flight recorded): weights may change from here on
            self._wait_until(lambda: self._holding or not self._running or self._stop or self.error is not None,
                             timeout=300)

    def continue_generation(self) -> None:
        with self._cv:
            self._paused = None
            self._cv.notify_all()

    def flush_cache(self) -> None:
        """Drop cached state. There is no prefix cache to drop (the slot buffers hold only running requests and
        stay allocated), so this checks idleness (like SGLang, flushing while requests run or wait is refused)
        and returns freed device memory to the driver."""
        if not self.is_idle():
            raise EngineStateError("cannot flush the cache while requests are running or waiting")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ memory

    def release_memory(self, tags: Iterable[str] | None) -> None:
        tags = check_tags(tags)
        if not self.is_idle():
            raise EngineStateError("cannot release memory while requests are running or waiting")
        with self._model_lock:
            if self._slots is not None:
                if "kv_cache" in tags:
                    self._slots.free()
                if "weights" in tags or "cuda_graph" in tags:   # graphs hold the weights' addresses
                    self._slots.drop_graphs()
            if "weights" in tags and "weights" not in self._released and self.device.type != "cpu":
                self._move_weights(torch.device("cpu"))
            self._released |= set(tags)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self, tags: Iterable[str] | None) -> None:
        tags = check_tags(tags)
        with self._model_lock:
            if "weights" in tags and "weights" in self._released and self.device.type != "cpu":
                self._move_weights(self.device)
            self._released -= set(tags)

    def _move_weights(self, device: torch.device) -> None:
        """Give every parameter and buffer its own copy on `device` (each on its own: grouped projections' slices
        too), then free the fused tensors (to the host) or rebuild them from the copies (back to the engine's device)."""
        for p in self._unique_tensors():
            p.data = p.data.to(device, copy=True)
        if self.projection_groups is not None:
            if device == self.device:
                self.projection_groups.fuse()
            else:
                self.projection_groups.drop_storage()

    def _unique_tensors(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, staged: dict | None = None,
                       weight_version: str | None = None, abort_all_requests: bool = False,
                       owned: bool = False) -> str:
        """Stage tensors by HF name; commit when the update is final. Returns a status message.

        Staged tensors are copies unless `owned` (the caller hands over buffers nobody else writes,
        e.g. freshly received broadcasts) and they already have the parameter's device and dtype.
        """
        if "weights" in self._released:
            raise EngineStateError("weights are released; resume 'weights' before updating them")
        update_id, final, total = _parse_staged(staged)
        with self._staged_lock:
            if self._staged is not None and self._staged.update_id != update_id:
                log.warning("discarding unfinished weight update %s (%d tensors staged): update %s started",
                            self._staged.update_id, len(self._staged.tensors), update_id)
                self._staged = None
            if self._staged is None:
                self._staged = _StagedUpdate(update_id, {})
            try:
                devices = {self.device}
                for name, t in named_tensors:
                    self._stage_one(name, t, owned)
                    devices.add(t.device)
                # The sources may be the sender's memory (CUDA IPC): finish reading before answering.
                for dev in devices:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                if not final:
                    return f"staged {len(self._staged.tensors)} tensors of update {update_id}"
                if total is not None and total != len(self._staged.tensors):
                    raise WeightUpdateError(f"update {update_id} was declared with {total} tensors but "
                                            f"{len(self._staged.tensors)} arrived; nothing was applied")
                update, self._staged = self._staged, None
            except BaseException:
                self._staged = None
                raise
        if abort_all_requests:
            self.abort(abort_all=True)
        with self._model_lock, torch.no_grad():
            for name, t in update.tensors.items():
                self._params[name].data.copy_(t)
            if self.projection_groups is not None:
                self.projection_groups.invalidate()
            if weight_version is not None:
                self._weight_version = str(weight_version)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return f"applied {len(update.tensors)} tensors; weight version {self._weight_version}"

    def discard_staged(self) -> None:
        with self._staged_lock:
            self._staged = None

    def _stage_one(self, name: str, t: torch.Tensor, owned: bool = False) -> None:
        assert self._staged is not None
        p = self._params.get(name)
        if p is None and name.startswith(_MULTIMODAL_LM_PREFIX):
            # a hub multimodal checkpoint (Qwen3.5) loads as its text model; accept its own names
            name = "model." + name[len(_MULTIMODAL_LM_PREFIX):]
            p = self._params.get(name)
        if p is None:
            raise WeightUpdateError(f"unknown parameter {name!r} (engine model has e.g. {next(iter(self._params))!r})")
        if tuple(t.shape) != tuple(p.shape):
            raise WeightUpdateError(f"parameter {name!r}: shape {tuple(t.shape)} does not match the model's {tuple(p.shape)}")
        if t.dtype.is_floating_point != p.dtype.is_floating_point:
            raise WeightUpdateError(f"parameter {name!r}: dtype {t.dtype} cannot be loaded into {p.dtype}")
        if name in self._staged.tensors:
            raise WeightUpdateError(f"parameter {name!r} was sent twice in update {self._staged.update_id}")
        self._staged.tensors[name] = t.to(device=self.device, dtype=p.dtype, copy=not owned)

    # ------------------------------------------------------------------ scheduler

    def _wait_until(self, cond: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not cond():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineStateError("timed out waiting for in-flight requests to stop")
                self._cv.wait(timeout=min(left, 0.5))

    def _loop(self) -> None:
        failures = 0  # consecutive failed waves
        try:
            while True:
                with self._cv:
                    while not self._stop and (self._paused is not None or not self._waiting):
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        return
                    self._gather_more()
                    if self._stop:
                        return
                    if self._paused is not None or not self._waiting:
                        continue
                    wave = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.config.max_batch_size))]
                    self._running = list(wave)
                message = "engine error"
                try:
                    self._run_wave(wave)
                    failures = 0
                except Exception as e:
                    # One failed wave ends its own requests; the engine keeps serving. Failing again and
                    # again means the engine itself is broken: then it stops and /health says so.
                    failures += 1
                    if failures >= MAX_WAVE_FAILURES:
                        raise
                    log.exception("embedded engine: a wave of %d requests failed", len(wave))
                    message = f"engine error: {type(e).__name__}: {e}"
                finally:
                    with self._cv:
                        for r in self._running:
                            if r.finish is None:
                                self._finish(r, {"type": "abort", "message": message})
                        self._running = []
                        self._cv.notify_all()
        except BaseException as e:  # surfaced through /health and every later request
            log.exception("embedded engine scheduler crashed")
            self.error = e
            with self._cv:
                for r in list(self._waiting):
                    self._finish(r, {"type": "abort", "message": f"engine error: {e!r}"})
                self._waiting.clear()

    def _gather_more(self) -> None:
        """Hold (lock held via the condition) until the wave is full, no request has arrived for
        ``gather_ms``, or the engine is paused or stopping."""
        window = self.config.gather_ms / 1e3
        if window <= 0:
            return
        seen = len(self._waiting)
        now = time.monotonic()
        quiet_until, give_up = now + window, now + 5 * window   # a steady trickle cannot hold it forever
        while not self._stop and self._paused is None and seen < self.config.max_batch_size:
            left = min(quiet_until, give_up) - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(timeout=left)
            if len(self._waiting) > seen:            # a new arrival restarts the quiet window
                seen = len(self._waiting)
                quiet_until = time.monotonic() + window

    def _check_controls(self, active: list[GenRequest]) -> bool:
        """Between steps: apply aborts, hold still while paused in place. False when the engine stops. A step still
        in flight is recorded first whenever any of these acts, so what a request holds then is what the synchronous
        path would hold."""
        with self._cv:
            while True:
                if self._inflight is not None and (self._stop or self._paused is not None or any(
                        r.abort_message and r.finish is None for r in active)):
                    self._record_inflight()
                for r in active:
                    if r.abort_message and r.finish is None:
                        self._finish(r, {"type": "abort", "message": r.abort_message})
                if self._stop:
                    self._holding = False
                    return False
                if self._paused in ("in_place", "retract") and any(r.finish is None for r in active):
                    if not self._holding:   # `pause` returns once this is seen
                        self._holding = True
                        self._cv.notify_all()
                    self._cv.wait(timeout=0.5)
                    continue
                self._holding = False
                return True

    @torch.no_grad()
    def _run_wave(self, wave: list[GenRequest]) -> None:
        """Decode `wave` to completion. With `continuous_batching`, requests that arrive meanwhile join at the
        next step (prefilled on their own, then their cache rows appended to the running batch's), so a new
        turn or a late group never waits for the longest running request."""
        if self._slots is not None:
            self._run_slots(list(wave))
            return
        batch = self._prefill(list(wave), None)
        if self._joinable is None:
            self._joinable = self.config.continuous_batching and supports_joining(batch.cache)
        while True:
            if not self._check_controls(batch.active):
                return
            if batch.drop_finished():
                self._decode_step(batch)
                batch.drop_finished()
            joining = self._admit(len(batch.active)) if self._joinable else []
            if joining:
                batch = self._prefill(joining, batch if batch.active else None)
            elif not batch.active:
                return

    def _admit(self, running: int) -> list[GenRequest]:
        """Waiting requests that fit the batch now (none while paused or stopping); they join `_running`."""
        with self._cv:
            if self._paused is not None or self._stop or not self._waiting:
                return []
            room = self.config.max_batch_size - running
            joining = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            self._running = [r for r in self._running if r.finish is None] + joining
            return joining

    # ------------------------------------------------------------------ slot decoding

    def _run_slots(self, pending: list[GenRequest]) -> None:
        """The slot path of `_run_wave`: `pending` requests are taken but not yet in a slot. Each turn applies the
        controls, frees finished slots, prefills what fits (growing the slots' length when a request needs it),
        and otherwise decodes one step."""
        dec = self._slots
        self._inflight = None   # (a failed wave may have left one: its requests were ended with it)
        while True:
            if not self._check_controls(dec.active + pending):
                return
            with self._model_lock:   # release_memory may free the slots from another thread
                dec.drop_finished(lambda r: r.finish is not None)
            pending = [r for r in pending if r.finish is None]
            if self.config.continuous_batching:
                pending += self._admit(len(dec.active) + len(pending))
            chunk = self._slot_chunk(pending)
            if chunk:
                pending = [r for r in pending if r not in chunk]
                self._record_inflight()
                self._prefill_into_slots(chunk)
            elif dec.active:
                self._slot_decode_step()
            elif pending:   # nothing runs and the first waiting request does not fit even alone
                r = pending.pop(0)
                with self._cv:
                    self._finish(r, {"type": "abort", "message": (
                        f"request needs {dec.need(r)} cache tokens; the KV cache memory budget cannot hold them "
                        f"(kv_cache_fraction={self.config.kv_cache_fraction})")})
            elif self._inflight is not None:   # its requests have all stopped (known from the step before it)
                self._record_inflight()
            else:
                return

    def _slot_chunk(self, pending: list[GenRequest]) -> list[GenRequest]:
        """The next pending requests that fit free slots and one prefill chunk (growing the slot length if needed)."""
        dec, chunk, longest = self._slots, [], 0
        for r in pending:
            if r.finish is not None:
                continue
            if not dec.allocated or dec.need(r) > dec.max_len:
                self._record_inflight()   # a reallocation drops the CUDA graphs: none may still be running
                with self._model_lock:   # (a longer length may mean fewer slots: keep room for this chunk)
                    grown = dec.ensure(self._slot_template, max([dec.need(r)] + [dec.need(a) for a in dec.active]),
                                       min_slots=len(dec.active) + len(chunk) + 1)
                if not grown:
                    break
            if len(dec.active) + len(chunk) >= dec.slots:
                break
            longest_if = max(longest, len(r.prompt))
            if chunk and longest_if * (len(chunk) + 1) > self.config.max_prefill_tokens:
                break
            chunk.append(r)
            longest = longest_if
        return chunk

    def _slot_template(self):
        """A one-token DynamicCache: the layer shapes and dtypes the slot buffers copy."""
        from transformers import DynamicCache

        if "weights" in self._released:
            raise EngineStateError("weights were released during generation")
        cache = DynamicCache(config=self.model.config)
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.model(input_ids=one, position_ids=one, past_key_values=cache, use_cache=True, logits_to_keep=1)
        if not slot_compatible(cache):
            raise EngineStateError(f"the model's cache layers {[type(x).__name__ for x in cache.layers]} cannot be "
                                   f"held in slots; serve it with decode='dynamic'")
        return cache

    def _prefill_into_slots(self, joining: list[GenRequest]) -> None:
        from transformers import DynamicCache

        t0 = time.perf_counter()
        ids, mask, pos = self._left_padded(joining)
        cache = DynamicCache(config=self.model.config)
        tokens = self._forward_and_sample(joining, ids, mask, pos, cache)
        forward_s = time.perf_counter() - t0
        width = ids.shape[1]
        seeds = seed_tensor([r.seed for r in joining], self.device)
        with self._model_lock:
            for i, r in enumerate(joining):
                # a request that finished on its first token was answered already (the engine may even have
                # been released since, which frees the slots): it never takes a slot
                if r.finish is None:
                    self._slots.add(r, cache, i, width - len(r.prompt), tokens[i], seeds[i])
        self.stats.prefilled(joining, time.perf_counter() - t0, width, forward_s)

    def _slot_decode_step(self) -> None:
        """One decode step over the active slots. Overlapped (see `EmbeddedEngineConfig.overlap_decode`): launch it,
        then record the step launched before it; the last one is recorded by the next call or `_record_inflight`."""
        dec = self._slots
        active = list(dec.active)
        plain = all(unfiltered(r.sampling) for r in active)   # the graph's own draw stands
        overlap = self.config.overlap_decode and plain
        if not overlap:
            self._record_inflight()
        with self._model_lock:
            if "weights" in self._released:
                raise EngineStateError("weights were released during generation")
            t0, captured = time.perf_counter(), dec.stats.graph_capture_s
            logits, tokens, logprobs = dec.step()
            t0 += dec.stats.graph_capture_s - captured   # a graph captured by this step is not decode time
        if overlap:
            launched = _InflightStep(active, *self._host_copies(tokens, logprobs), launched=t0)
            self._record_inflight()
            self._inflight = launched
            return
        if plain:
            self._record(active, tokens, logprobs)
        else:   # the graph drew without filters; draw again with them, from the same logits and uniforms
            dec.ids[: len(active)] = self._sample_and_record(active, logits)
        self.stats.decoded(len(active), time.perf_counter() - t0)

    def _host_copies(self, tokens: torch.Tensor, logprobs: torch.Tensor):
        """Copies of a step's outputs on the host, queued behind the step (the graph's output buffers are rewritten
        by the next one), and the event after which they are complete. Two pinned pairs alternate: one is read
        while the next step's copy lands in the other."""
        if tokens.device.type != "cuda":
            return tokens.clone(), logprobs.clone(), None
        n = tokens.shape[0]
        pair = self._host_out[0]
        if pair is None or pair[0].shape[0] < n:
            size = max(n, self._slots.slots)
            pair = (torch.empty(size, dtype=tokens.dtype, pin_memory=True),
                    torch.empty(size, dtype=logprobs.dtype, pin_memory=True))
        self._host_out = [self._host_out[1], pair]
        host_tokens, host_lps = pair[0][:n], pair[1][:n]
        host_tokens.copy_(tokens, non_blocking=True)
        host_lps.copy_(logprobs, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host_tokens, host_lps, ready

    def _record_inflight(self) -> None:
        """Record the step in flight, if any (waiting for its outputs): its requests' tokens, and stops."""
        step, self._inflight = self._inflight, None
        if step is None:
            return
        if step.ready is not None:
            step.ready.synchronize()
        recorded = self._record(step.active, step.tokens, step.logprobs)
        now = time.perf_counter()
        # steady state: the time between two recorded steps (the device ran the next one meanwhile)
        self.stats.decoded(recorded, now - max(step.launched, self._last_decoded), len(step.active) - recorded)
        self._last_decoded = now

    # ------------------------------------------------------------------ dynamic-cache decoding

    def _left_padded(self, joining: list[GenRequest]):
        """Token ids, attention mask and positions of `joining`'s prompts, left-padded to the longest."""
        dev = self.device
        max_len = max(len(r.prompt) for r in joining)
        ids = torch.zeros(len(joining), max_len, dtype=torch.long)
        mask = torch.zeros(len(joining), max_len, dtype=torch.long)
        for i, r in enumerate(joining):
            ids[i, max_len - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, max_len - len(r.prompt):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)

    def _prefill(self, joining: list[GenRequest], batch: "_Batch | None") -> "_Batch":
        """Prefill `joining` (left-padded), sample their first token, and append them to `batch`."""
        from transformers import DynamicCache

        t0 = time.perf_counter()
        ids, mask, pos = self._left_padded(joining)
        cache = DynamicCache(config=self.model.config)
        tokens = self._forward_and_sample(joining, ids, mask, pos, cache)
        self.stats.prefilled(joining, time.perf_counter() - t0, ids.shape[1])
        new = _Batch(cache=cache, mask=mask, step_ids=tokens.view(-1, 1), step_pos=pos[:, -1:] + 1,
                     active=list(joining))
        if batch is None or not batch.active:
            return new
        batch.append(new)
        return batch

    def _decode_step(self, batch: "_Batch") -> None:
        t0 = time.perf_counter()
        mask = torch.cat([batch.mask, torch.ones(len(batch.active), 1, dtype=batch.mask.dtype,
                                                 device=batch.mask.device)], dim=1)
        tokens = self._forward_and_sample(batch.active, batch.step_ids, mask, batch.step_pos, batch.cache)
        batch.mask, batch.step_ids, batch.step_pos = mask, tokens.view(-1, 1), batch.step_pos + 1
        self.stats.decoded(len(batch.active), time.perf_counter() - t0)

    def _forward_and_sample(self, active: list[GenRequest], ids, mask, pos, cache) -> torch.Tensor:
        """One forward over `active` (prefill or a decode step); records each request's new token."""
        with self._model_lock:
            if "weights" in self._released:
                raise EngineStateError("weights were released during generation")
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
        return self._sample_and_record(active, out.logits[:, -1, :])

    def _sample_and_record(self, active: list[GenRequest], logits: torch.Tensor) -> torch.Tensor:
        """Sample each row's next token (its own seed, its token index), record it and finish stopped requests."""
        uniforms = request_uniforms(seed_tensor([r.seed for r in active], logits.device),
                                    torch.tensor([len(r.tokens) for r in active], device=logits.device))
        tokens, lps = sample(logits.float(), [r.sampling for r in active], uniforms)
        self._record(active, tokens, lps)
        return tokens

    def _record(self, active: list[GenRequest], tokens: torch.Tensor, lps: torch.Tensor) -> int:
        """Append each row's token and logprob to its request (one device sync) and finish stopped requests; how
        many rows were recorded (a row of a request that has finished already is not)."""
        tokens_l, lps_l = tokens.tolist(), lps.tolist()
        recorded = 0
        with self._cv:
            for r, t, lp in zip(active, tokens_l, lps_l):
                if r.finish is not None:
                    continue
                recorded += 1
                r.tokens.append(int(t))
                r.logprobs.append(float(lp))
                reason = self._stop_reason(r, int(t))
                if reason is not None:
                    self._finish(r, reason)
        return recorded

    def _stop_reason(self, r: GenRequest, t: int) -> dict | None:
        if not r.sampling.ignore_eos and t in self.eos_ids:
            return {"type": "stop", "matched": t}
        if t in r.sampling.stop_token_ids:
            return {"type": "stop", "matched": t}
        if r.sampling.stop_strings and self.tokenizer is not None:
            tail = self.tokenizer.decode(r.tokens[-64:])
            for s in r.sampling.stop_strings:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if len(r.tokens) >= r.sampling.max_new_tokens:
            return {"type": "length", "length": r.sampling.max_new_tokens}
        if len(r.prompt) + len(r.tokens) >= self.context_length:
            return {"type": "length", "length": len(r.tokens)}
        return None

    def _finish(self, r: GenRequest, reason: dict) -> None:
        if r.finish is not None:
            return
        r.finish = reason
        meta: dict[str, Any] = {
            "id": r.rid, "finish_reason": reason, "prompt_tokens": len(r.prompt),
            "completion_tokens": len(r.tokens), "cached_tokens": 0, "weight_version": self._weight_version,
            "e2e_latency": time.monotonic() - r.started,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.tokens)]
        text = ""
        if self.tokenizer is not None:
            try:
                text = self.tokenizer.decode(r.tokens)
            except Exception:
                text = ""
        try:
            r.on_done({"text": text, "output_ids": list(r.tokens), "meta_info": meta})
        except Exception:
            log.exception("request %s completion callback failed", r.rid)


def _eos_ids(model) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return frozenset(ids)


def check_tags(tags: Iterable[str] | None) -> list[str]:
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be null or a list of strings from {list(MEMORY_TAGS)}, got {tags!r}")
    tags = list(tags)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tag(s) {bad}; known: {list(MEMORY_TAGS)}")
    return tags


def _parse_staged(staged: dict | None) -> tuple[str, bool, int | None]:
    if staged is None:
        return uuid.uuid4().hex, True, None
    if not isinstance(staged, dict) or not isinstance(staged.get("update_id"), str) or not staged["update_id"]:
        raise WeightUpdateError(f"'staged' must be {{'update_id': str, 'final': bool, 'total_tensors': int}}, got {staged!r}")
    total = staged.get("total_tensors")
    if total is not None and (not isinstance(total, int) or total < 0):
        raise WeightUpdateError(f"staged.total_tensors must be a non-negative int, got {total!r}")
    return staged["update_id"], bool(staged.get("final", True)), total


@dataclasses.dataclass
class _Batch:
    """The requests decoding together and their shared state: an HF cache left-padded to a common length,
    the attention mask (1 = a real token), each row's last sampled token and next position."""

    cache: Any
    mask: torch.Tensor
    step_ids: torch.Tensor
    step_pos: torch.Tensor
    active: list[GenRequest]

    def drop_finished(self) -> bool:
        """Remove finished rows (and the padding columns no row needs any more); False when none are left."""
        keep = [i for i, r in enumerate(self.active) if r.finish is None]
        if not keep:
            self.active = []
            return False
        if len(keep) < len(self.active):
            idx = torch.tensor(keep, device=self.mask.device)
            # reorder_cache selects along the batch in every kind of cache layer, the GDN layers' conv and
            # recurrent states included (batch_select_indices only knows attention K/V)
            self.cache.reorder_cache(idx)
            self.mask, self.step_ids, self.step_pos = self.mask[idx], self.step_ids[idx], self.step_pos[idx]
            self.active = [self.active[i] for i in keep]
            used = self.mask.any(dim=0).nonzero()
            first = int(used[0]) if used.numel() else 0
            if first > 0:   # columns that only finished rows needed
                self.mask = self.mask[:, first:]
                _crop_left(self.cache, first)
        return True

    def append(self, other: "_Batch") -> None:
        """Append `other`'s rows: both left-padded to the longer length, caches concatenated along the batch."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        _concat_caches(self.cache, other.cache, self.mask.shape[1], other.mask.shape[1], length)
        self.mask = torch.cat([_pad_left(self.mask, length, -1), _pad_left(other.mask, length, -1)])
        self.step_ids = torch.cat([self.step_ids, other.step_ids])
        self.step_pos = torch.cat([self.step_pos, other.step_pos])
        self.active = self.active + other.active


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _concat_caches(a, b, a_len: int, b_len: int, length: int) -> None:
    """Rows of cache `b` appended to cache `a` in place. Attention layers hold K/V ``[batch, heads, len, dim]``
    (left-padded to `length`; the mask hides the padding), linear-attention (GDN) layers a fixed-size conv
    and recurrent state per row."""
    for la, lb in zip(a.layers, b.layers):
        for name, old_len in (("keys", a_len), ("values", a_len)):
            ta, tb = getattr(la, name, None), getattr(lb, name, None)
            if torch.is_tensor(ta) and torch.is_tensor(tb):
                setattr(la, name, torch.cat([_pad_left(ta, length, -2), _pad_left(tb, length, -2)]))
        for name in ("conv_states", "recurrent_states"):
            da, db = getattr(la, name, None), getattr(lb, name, None)
            if isinstance(da, dict) and isinstance(db, dict):
                for i in db:
                    if torch.is_tensor(da.get(i)) and torch.is_tensor(db[i]):
                        da[i] = torch.cat([da[i], db[i]])


def _crop_left(cache, n: int) -> None:
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if torch.is_tensor(t) and t.dim() == 4:
                setattr(layer, name, t[:, :, n:, :])


def supports_joining(cache) -> bool:
    """Whether `_concat_caches` knows every layer of this cache (dynamic attention and linear attention)."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    return all(isinstance(layer, (DynamicLayer, LinearAttentionCacheLayerMixin))
               and not getattr(layer, "is_sliding", False) for layer in cache.layers)

