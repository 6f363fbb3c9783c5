"""Decode over preallocated per-request cache slots, one CUDA graph per batch size (the embedded engine's fast path).

Why: HF's dynamic cache grows by concatenation, masks are rebuilt and every one of a decode step's ~10 kernels per
layer is launched from Python, so an 8B decode step cost ~100 ms on an H200 whose weights read in ~3.4 ms. Here:

* every request owns one *slot* of preallocated buffers: attention K/V ``[slots, max_len, kv_heads, head_dim]``
  (token-major, so each slot is one packed ``[len, heads, dim]`` block as flash attention's varlen API reads it)
  and, for Gated DeltaNet layers, the fixed conv and recurrent state. The running requests always sit in slots
  ``0..n-1`` (a finished request's slot is refilled by moving the last one into it), so a decode step over ``n``
  requests reads the leading ``n`` rows of every buffer: static addresses, static shapes;
* a decode step is transformers' own model forward (any architecture whose layers are full attention or linear
  attention) with :class:`SlotCache` as its cache: K/V are written at each row's own position, the mask admits
  each row's own length, the GDN layers read and update their slot state in place;
* on CUDA, the step for each batch bucket (1, 2, 4, 8, 16, 24, ... padded rows are harmless) is captured once in a
  CUDA graph and replayed: the forward, then sampling for requests without top-k/top-p/min-p filters (each slot's
  temperature, seed and token index live in device buffers; `sampling.sample_unfiltered`), then the next step's
  inputs. A batch holding a filtered request samples again outside the graph from the same logits;
* prefill still runs transformers' forward with a ``DynamicCache`` (left-padded, batched, in chunks of at most
  ``max_prefill_tokens``); its K/V and states are then copied into the new requests' slots.

Attention during decode goes through :func:`grouped_decode_sdpa`, registered with transformers' attention interface.
On a GPU in bf16/fp16 it is flash attention's varlen forward over the slots with ``seqused_k``: each row reads only
its own length of K/V (not the buffer's whole width), GQA natively. Elsewhere (CPU, fp32) it is SDPA under a
boolean mask, a one-token query folding its GQA groups into the query length so K/V are never repeated.

Library vs ours: the model forward, its GDN kernels (fla when installed) and SDPA are the libraries'; the slot
buffers, the graph capture and the bookkeeping here are ours (transformers' own continuous-batching manager has
no linear-attention state, per-request seeds or SGLang's logprob semantics).
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, LinearAttentionCacheLayerMixin, \
    LinearAttentionLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .sampling import request_uniforms, sample_unfiltered

log = logging.getLogger(__name__)

#: the attention implementation name the engine gives models it serves (decode-friendly SDPA)
ATTN_IMPL = "megatron_rl_sdpa"
#: layer types a SlotCache can hold
SLOT_LAYER_TYPES = frozenset({"full_attention", "linear_attention"})
#: K/V length granularity: a buffer grows in steps of this many tokens
LENGTH_QUANTUM = 256
#: per-slot step inputs, all on the device so that a graph replay needs nothing from the host: the token to feed,
#: its position, 1 for an occupied slot (padding rows never advance), and the slot's sampling state
_STEP_BUFFERS = {"ids": torch.long, "pos": torch.long, "live": torch.long, "seed": torch.long, "step_idx": torch.long,
                 "temperature": torch.float32}


def grouped_decode_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except for a one-token query over the slot cache:

    * under a *varlen mask* (int32 ``[3, n + 1]``: used K/V length per row, then the query and key offsets; see
      ``SlotDecoder.varlen``) it is flash attention's varlen forward, each row reading its own length;
    * under a boolean mask with grouped KV heads, the ``groups`` query heads sharing a KV head become ``groups``
      query positions of that head: the same arithmetic without materialising repeated K/V (HF repeats them
      whenever a mask is given: at 64 requests x 1k tokens that is a GB per layer per step)."""
    if attention_mask is not None and attention_mask.dtype == torch.int32:
        return _varlen_slot_decode(query, key, value, attention_mask, scaling), None
    groups = getattr(module, "num_key_value_groups", 1)
    if (query.shape[2] != 1 or groups == 1 or attention_mask is None or kwargs.get("position_bias") is not None
            or attention_mask.shape[2] != 1 or attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, h, _, d = query.shape
    q = query.reshape(b, key.shape[1], groups, d)          # head kv * groups + g, as repeat_kv orders them
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling)
    return out.reshape(b, h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _varlen_slot_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, varlen: torch.Tensor,
                        scaling: float | None) -> torch.Tensor:
    """One query token per row against the slot buffers (``key``/``value`` are ``[n, heads, len, dim]`` views of
    ``[slots, len, heads, dim]``): rows packed as flash varlen sequences, K/V of row i at ``i * len``, of which
    ``varlen[0, i]`` are used. Returns ``[n, 1, q_heads, dim]`` as transformers' attention functions do."""
    if query.shape[2] != 1:
        raise RuntimeError(f"a varlen slot mask serves one-token queries, got {tuple(query.shape)}")
    n, hq, _, d = query.shape
    length = key.shape[2]
    q = query.transpose(1, 2).reshape(n, hq, d)
    k = key.transpose(1, 2).reshape(n * length, key.shape[1], d)            # views of the slot buffers
    v = value.transpose(1, 2).reshape(n * length, value.shape[1], value.shape[-1])
    out = varlen_attention(q, k, v, cu_seq_q=varlen[1], cu_seq_k=varlen[2], max_k=length, seqused_k=varlen[0, :n],
                           scale=scaling)
    return out.reshape(n, 1, hq, value.shape[-1])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_k: int, seqused_k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Flash attention's varlen forward (PyTorch's own FA2 build), non-causal, one query per sequence."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seq_q, cu_seq_k, 1, max_k, 0.0, False, False,
                                                   scale=scale, seqused_k=seqused_k)[0]


def flash_decode_reason(model: torch.nn.Module) -> str | None:
    """None when decode attention can be flash varlen on this model's device and dtype, else why not."""
    p = next(model.parameters())
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if getattr(cfg, "_attn_implementation", None) != ATTN_IMPL:
        return f"attention implementation {getattr(cfg, '_attn_implementation', None)!r} (not the engine's SDPA)"
    if p.device.type != "cuda":
        return "not on a CUDA device"
    if getattr(torch.version, "hip", None):
        return "ROCm (seqused_k in PyTorch's flash varlen build is unverified there)"
    if p.dtype not in (torch.float16, torch.bfloat16):
        return f"{p.dtype} (flash attention runs fp16/bf16)"
    if torch.cuda.get_device_capability(p.device) < (8, 0):
        return "compute capability below 8.0"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim}"
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash SDPA disabled in torch.backends.cuda"
    return None


AttentionInterface.register(ATTN_IMPL, grouped_decode_sdpa)
AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


def use_decode_attention(model: torch.nn.Module) -> None:
    """Serve `model` with :func:`grouped_decode_sdpa` where it would use plain SDPA (eager and flash choices stay)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ATTN_IMPL)


#: transformers block classes (by name suffix) whose forward `compile_blocks` compiles: each is a chain of small
#: elementwise kernels (an RMSNorm launches 7 kernels eager, 1 compiled; an MLP's SiLU and product fuse) and reads
#: no cache or layer index, so one compiled graph per class serves every layer
COMPILED_BLOCK_SUFFIXES = ("RMSNorm", "MLP")
#: module-level functions of transformers' modeling files that `compile_blocks` compiles where they are defined:
#: attention forwards look them up there at each call. RoPE's rotate-and-add is ~10 small kernels per layer eager
#: (two slices, a negation, a cat, two products and a sum, for q and for k), a couple compiled
COMPILED_FUNCTIONS = ("apply_rotary_pos_emb",)
#: (modeling module, function name) -> the function `compile_blocks` replaced there, for `uncompile_blocks`
_replaced_functions: dict[tuple[str, str], Callable] = {}


def compile_blocks(model: torch.nn.Module, backend: str | Callable = "inductor") -> int:
    """torch.compile the forward of `model`'s norm and MLP blocks, one compiled function per block class shared by
    all its instances (compiling takes seconds, against minutes for the whole step with `compile_decode`), and the
    `COMPILED_FUNCTIONS` of its modeling modules. An MLP whose projections `grouped_projections` fused is compiled
    with its grouped forward. Returns how many modules and functions now run compiled; `uncompile_blocks` undoes it.

    The functions are replaced in transformers' module, so every model of those classes in this process uses the
    compiled one until `uncompile_blocks` (same numbers up to rounding; the engine is the only user in its process).
    """
    # every layer's instance shares one graph per shape; decode, prefill and batch 1 (specialised) add variants
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 32))
    compiled: dict[tuple[type, Callable], Callable] = {}
    count = 0
    modeling_modules = set()
    for module in model.modules():
        cls = type(module)
        if not cls.__module__.startswith("transformers.models."):
            continue
        modeling_modules.add(cls.__module__)
        if not cls.__name__.endswith(COMPILED_BLOCK_SUFFIXES):
            continue
        base = module.__dict__.get("_megatron_rl_base_forward")   # a grouped MLP's forward (grouped_projections)
        if "forward" in module.__dict__ and not (module.__dict__.get("_megatron_rl_compiled") or base):
            continue   # someone else's forward on the instance (an accelerate hook): left as it is
        fn = base or cls.forward
        if (cls, fn) not in compiled:
            compiled[cls, fn] = torch.compile(fn, dynamic=True, backend=backend)
        module.forward = types.MethodType(compiled[cls, fn], module)
        module._megatron_rl_compiled = True
        count += 1
    for name in sorted(modeling_modules):
        namespace = sys.modules[name]
        for fname in COMPILED_FUNCTIONS:
            fn = getattr(namespace, fname, None)
            if (name, fname) not in _replaced_functions:
                if not isinstance(fn, types.FunctionType) or fn.__module__ != name:
                    continue   # absent, or imported from another module (compiled there, if at all)
                _replaced_functions[name, fname] = fn
                setattr(namespace, fname, torch.compile(fn, dynamic=True, backend=backend))
            count += 1
    return count


def uncompile_blocks(model: torch.nn.Module) -> None:
    """Give every block `compile_blocks` compiled its own forward back (a grouped MLP its grouped forward), and
    `model`'s modeling modules their functions."""
    for module in model.modules():
        if module.__dict__.pop("_megatron_rl_compiled", False):
            base = module.__dict__.get("_megatron_rl_base_forward")
            if base is not None:
                module.forward = types.MethodType(base, module)
            else:
                module.__dict__.pop("forward", None)
        name = type(module).__module__
        for fname in COMPILED_FUNCTIONS:
            original = _replaced_functions.pop((name, fname), None)
            if original is not None:
                setattr(sys.modules[name], fname, original)


def supports_slots(model: torch.nn.Module) -> str | None:
    """None when slot decoding can serve `model`, else the reason it cannot."""
    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None)
    types = set(layer_types or ["full_attention"])
    if not types <= SLOT_LAYER_TYPES:
        return f"layer types {sorted(types - SLOT_LAYER_TYPES)} are not full or linear attention"
    # transformers windows the layers ``layer_types`` marks sliding (checked above), whatever ``use_sliding_window``
    # says (Qwen3 configs set it with ``max_window_layers`` covering every layer); without the list it is the flag
    if layer_types is None and getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    return None


class _SlotAttention(CacheLayerMixin):
    """One attention layer's K/V slots ``[slots, len, heads, dim]``. `bind` selects the rows and positions of the
    next step; `update` hands the model ``[n, heads, len, dim]`` views, the layout transformers' attention expects."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.rows: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist from the start
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[2] != 1:
            raise RuntimeError(f"the slot cache decodes one token per row, got K of shape {tuple(key_states.shape)}")
        self.keys[self.rows, self.pos] = key_states[:, :, 0]
        self.values[self.rows, self.pos] = value_states[:, :, 0]
        n = key_states.shape[0]   # the bound rows (a shape: symbolic under torch.compile)
        return self.keys[:n].transpose(1, 2), self.values[:n].transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[1], 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.keys.shape[1]


class _SlotLinear(LinearAttentionLayer):
    """One Gated DeltaNet layer's conv and recurrent state slots; the model updates the bound rows in place."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        super().__init__(number_of_states=1)
        self.conv_buf, self.recurrent_buf = conv, recurrent
        self.conv_kernel_size[0] = conv.shape[-1]
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
        self.has_previous_state[0] = True
        self.device, self.dtype = conv.device, conv.dtype

    def bind(self, n: int) -> None:
        self.conv_states[0] = self.conv_buf[:n]
        self.recurrent_states[0] = self.recurrent_buf[:n]


class SlotCache(Cache):
    """A transformers Cache over slot buffers; one decode step at a time, for the leading `n` slots."""

    def __init__(self, layers: list[CacheLayerMixin | LinearAttentionCacheLayerMixin]):
        super().__init__(layers=layers)

    def bind(self, n: int, rows: torch.Tensor, pos: torch.Tensor) -> None:
        for layer in self.layers:
            if isinstance(layer, _SlotAttention):
                layer.rows, layer.pos = rows[:n], pos[:n]
            else:
                layer.bind(n)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def batch_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes with a graph each: 1, 2, 4, 8, then every 8 to 64, every 32 to 256, every 64 after."""
    out, b = [], 1
    while b < 8:
        out.append(b)
        b *= 2
    while b <= max_batch:
        out.append(b)
        b += 8 if b < 64 else 32 if b < 256 else 64
    out = [x for x in out if x < max_batch]
    return out + [max_batch]


@dataclasses.dataclass
class SlotStats:
    graphs_captured: int = 0
    graph_capture_s: float = 0.0
    graph_failures: int = 0
    resizes: int = 0
    slots: int = 0
    max_len: int = 0
    cache_bytes: int = 0


class SlotDecoder:
    """The slot buffers of one engine, the requests occupying them, and the decode step (graphed on CUDA).

    The engine calls it under its model lock (the scheduler thread, and `free` from a memory release). Requests
    are opaque here except for `tokens`/`prompt` (their cache length) and `sampling`; the engine decides when a
    request leaves."""

    def __init__(self, model: torch.nn.Module, *, max_batch: int, context_length: int, cuda_graphs: bool,
                 memory_fraction: float, compile_decode: bool = False, cpu_budget_bytes: int = 2 << 30):
        self.model = model
        self.max_batch = max_batch
        self.context_length = context_length
        self.device = next(model.parameters()).device
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.memory_fraction = memory_fraction
        self.cpu_budget_bytes = cpu_budget_bytes
        self.layer_types = list(getattr(model.config, "layer_types", None) or
                                ["full_attention"] * model.config.num_hidden_layers)
        self._mask_types = tuple(sorted(set(self.layer_types)))   # the layer types that get an attention mask
        self.active: list[Any] = []          # active[i] occupies slot i
        self.stats = SlotStats()
        self._cache: SlotCache | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._eager_only: set[int] = set()
        self._pool = None
        self._buckets = batch_buckets(max_batch)
        self._layout: tuple[int, int, list] | None = None   # (bytes per token, state bytes per slot, layer specs)
        # torch.compile fuses the step's ~50 small elementwise kernels per layer (norms, RoPE, SiLU) that otherwise
        # take as long as the weights' GEMMs at small batches. Dynamic shapes, with the buffers' fixed dims marked
        # static (`_allocate`) and the masks cut inside the compiled call: on a CPU one compile serves every batch
        # above 1 and a reallocation (dynamo specialises 1; with CUDA graphs one row runs in the batch-2 graph).
        # Without the marks, dynamo's duck sizing ties a batch equal to a buffer dim at the first compile (the
        # test model's 2 KV heads) to that dim, and the next batch compiles again: 100-150 s each for the
        # 36-layer 8B step on the H200, where one recompile (batch 16) remains, its cause not yet found
        self.compile_decode = compile_decode
        self._model_call = torch.compile(_call_model, dynamic=True) if compile_decode else _call_model
        self._min_bucket = 2 if compile_decode and self.cuda_graphs and max_batch >= 2 else 1
        #: decode attention through flash varlen (see `grouped_decode_sdpa`); None when it can, else why not
        self.flash_reason = flash_decode_reason(model)
        self.flash = self.flash_reason is None

    # ------------------------------------------------------------------ buffers

    @property
    def allocated(self) -> bool:
        return self._cache is not None

    @property
    def slots(self) -> int:
        return self.stats.slots

    @property
    def max_len(self) -> int:
        return self.stats.max_len

    def need(self, req) -> int:
        """Cache length `req` may reach: its prompt plus everything it may generate, within the context."""
        return min(len(req.prompt) + req.sampling.max_new_tokens, self.context_length)

    def ensure(self, template: Callable[[], Any], need_len: int, min_slots: int = 1) -> bool:
        """Buffers holding `need_len` tokens per slot, shaped like the layers of `template()` (a prefilled
        DynamicCache; called once). Reallocates, keeping the active rows, when the length grows. False, with the
        buffers as they were, when the memory budget cannot hold `min_slots` slots (at least the active requests)
        or the allocation fails."""
        if self.allocated and need_len <= self.max_len:
            return True
        length = -(-max(need_len, self.max_len) // LENGTH_QUANTUM) * LENGTH_QUANTUM
        length = min(length, max(self.context_length, need_len))
        if self._layout is None:
            self._layout = _layout(template(), self.layer_types)
            if self.flash and any(spec[0] == "attn" and spec[1][1] != spec[1][2] for spec in self._layout[2]):
                self.flash, self.flash_reason = False, "K and V head dims differ"
        per_token, per_slot_state, specs = self._layout
        slot_bytes = length * per_token + per_slot_state
        # with active rows the old buffers stay alive while the new ones are filled: only free memory counts;
        # without, the old buffers are freed first and their memory counts too
        reclaim = self.stats.cache_bytes if self.allocated and not self.active else 0
        slots = min(self.max_batch, self._budget_bytes(reclaim) // max(slot_bytes, 1))
        if slots < max(len(self.active), min_slots, 1):
            return False
        if reclaim:
            self.free()
        old = self._cache
        self.drop_graphs()
        try:
            self._allocate(specs, old, slots, length)
        except torch.OutOfMemoryError:
            log.warning("slot cache: %d slots x %d tokens do not fit in device memory", slots, length)
            self._cache = old
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return False
        self.stats.resizes += int(old is not None)
        self.stats.slots, self.stats.max_len, self.stats.cache_bytes = slots, length, slots * slot_bytes
        log.info("slot cache: %d slots x %d tokens, %.2f GB", slots, length, slots * slot_bytes / 1e9)
        return True

    def _allocate(self, specs: list, old: "SlotCache | None", slots: int, length: int) -> None:
        """New buffers of `slots` x `length`, the active rows copied from `old`; assigned only when all exist."""
        layers = []
        for li, spec in enumerate(specs):
            if spec[0] == "attn":
                _, (h, dk, dv), dtype = spec
                k = torch.zeros(slots, length, h, dk, dtype=dtype, device=self.device)
                v = torch.zeros(slots, length, h, dv, dtype=dtype, device=self.device)
                if old is not None:
                    ol = old.layers[li]
                    k[: len(self.active), : ol.keys.shape[1]] = ol.keys[: len(self.active)]
                    v[: len(self.active), : ol.values.shape[1]] = ol.values[: len(self.active)]
                layers.append(_SlotAttention(k, v))
            else:
                _, (conv_shape, rec_shape), (conv_dtype, rec_dtype) = spec
                conv = torch.zeros(slots, *conv_shape, dtype=conv_dtype, device=self.device)
                rec = torch.zeros(slots, *rec_shape, dtype=rec_dtype, device=self.device)
                if old is not None:
                    ol = old.layers[li]
                    conv[: len(self.active)] = ol.conv_buf[: len(self.active)]
                    rec[: len(self.active)] = ol.recurrent_buf[: len(self.active)]
                layers.append(_SlotLinear(conv, rec))
        buffers = {}
        n = len(self.active)
        for name, dtype in _STEP_BUFFERS.items():
            buf = torch.zeros(slots, dtype=dtype, device=self.device)
            before = getattr(self, name, None)
            if before is not None and n:
                buf[:n] = before[:n]
            buffers[name] = buf
        rows, columns = torch.arange(slots, device=self.device), torch.arange(length, device=self.device)
        # flash decode's mask: used K/V length per row (set each step), query offsets 0..slots, key offsets
        # 0, length, 2 length, ...; the leading n + 1 columns serve a step over n rows
        offsets = torch.arange(slots + 1, dtype=torch.int32, device=self.device)
        varlen = torch.stack([torch.ones_like(offsets), offsets, offsets * length])
        if self.compile_decode:   # the dims no reallocation changes (KV heads, head dims) are constants
            for layer in layers:   # attention only: the engine refuses compile_decode for Gated DeltaNet models
                for buf in (layer.keys, layer.values):
                    torch._dynamo.mark_static(buf, 2)
                    torch._dynamo.mark_static(buf, 3)
            torch._dynamo.mark_static(varlen, 0)
        for name, buf in buffers.items():
            setattr(self, name, buf)
        self._cache, self.rows, self.columns, self.varlen = SlotCache(layers), rows, columns, varlen

    def _budget_bytes(self, reclaim: int = 0) -> int:
        """Bytes the slot buffers may take: a share of the device memory free now plus `reclaim` bytes about to
        be freed (CUDA), or a fixed budget (CPU)."""
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int((free + reclaim) * self.memory_fraction)
        return self.cpu_budget_bytes

    def free(self) -> None:
        """Release the buffers and graphs (memory release, tag kv_cache); the next wave reallocates. Requests that
        finished but were not yet dropped by the scheduler leave now (the caller holds the engine's model lock,
        as the scheduler does around its own drops)."""
        if self._cache is not None:
            self.drop_finished(lambda r: r.finish is not None)
        else:
            self.active = [r for r in self.active if r.finish is None]
        if self.active:
            raise RuntimeError("cannot free the slot cache while requests occupy it")
        self.drop_graphs()
        self._cache = None
        self.stats.slots = self.stats.max_len = self.stats.cache_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_graphs(self) -> None:
        """Forget the captured graphs (their addresses die with the buffers or the weights they read)."""
        self._graphs.clear()
        self._eager_only.clear()
        self._pool = None

    # ------------------------------------------------------------------ requests

    def add(self, req, prefill_cache, row: int, pad: int, first_token: torch.Tensor, seed_bits: torch.Tensor) -> None:
        """Move row `row` of a prefilled DynamicCache (left-padded by `pad`) into the next free slot; the request
        has sampled its first token (index 0) and draws token 1 next."""
        slot = len(self.active)
        length = len(req.prompt)
        for li, (src, dst) in enumerate(zip(prefill_cache.layers, self._cache.layers)):
            if isinstance(dst, _SlotAttention):
                dst.keys[slot, :length] = src.keys[row, :, pad:].transpose(0, 1)
                dst.values[slot, :length] = src.values[row, :, pad:].transpose(0, 1)
            else:
                dst.conv_buf[slot] = src.conv_states[0][row]
                dst.recurrent_buf[slot] = src.recurrent_states[0][row]
        self.ids[slot] = first_token
        self.pos[slot] = length
        self.live[slot] = 1
        self.seed[slot] = seed_bits
        self.step_idx[slot] = len(req.tokens)
        self.temperature[slot] = req.sampling.temperature
        self.active.append(req)

    def drop_finished(self, finished: Callable[[Any], bool]) -> None:
        """Remove finished requests, moving the last active slot into each hole (cache rows included)."""
        if self._cache is None:   # nothing holds them any more (a failed allocation): forget them
            self.active = [r for r in self.active if not finished(r)]
            return
        i = 0
        while i < len(self.active):
            if not finished(self.active[i]):
                i += 1
                continue
            last = len(self.active) - 1
            if i != last:
                # one position more than the recorded tokens account for: an overlapped step may have written it
                self._move(last, i, min(self.cache_len(self.active[last]) + 1, self.max_len))
                self.active[i] = self.active[last]
            for buf in self._step_buffers():
                buf[last] = 0
            self.active.pop()

    @staticmethod
    def cache_len(req) -> int:
        """Tokens of `req` held in its slot: the prompt and every sampled token but the last (fed next step)."""
        return len(req.prompt) + len(req.tokens) - 1

    def _move(self, src: int, dst: int, length: int) -> None:
        for layer in self._cache.layers:
            if isinstance(layer, _SlotAttention):
                layer.keys[dst, :length] = layer.keys[src, :length]
                layer.values[dst, :length] = layer.values[src, :length]
            else:
                layer.conv_buf[dst] = layer.conv_buf[src]
                layer.recurrent_buf[dst] = layer.recurrent_buf[src]
        for buf in self._step_buffers():
            buf[dst] = buf[src]

    def _step_buffers(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in _STEP_BUFFERS]

    # ------------------------------------------------------------------ the step

    def bucket(self, n: int) -> int:
        """The graphed batch size that serves `n` rows (`n` itself without CUDA graphs)."""
        return next(b for b in self._buckets if b >= max(n, self._min_bucket)) if self.cuda_graphs else n

    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step over the active slots: (logits, tokens, logprobs) of the ``n`` active rows, the tokens
        drawn without filters (`sample_unfiltered`) and already fed to the next step. A caller that samples
        differently (filters) writes its own tokens into ``ids[:n]``."""
        n = len(self.active)
        b = min(self.bucket(n), self.slots)
        outputs = None
        if self.cuda_graphs and b not in self._eager_only:
            entry = self._graphs.get(b) or self._capture(b)
            if entry is not None:
                graph, outputs = entry
                graph.replay()
        if outputs is None:
            outputs = self._decode(b)
        return tuple(t[:n] for t in outputs)

    def _decode(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward `b` rows, sample them, and set up the next step; everything on the device (graph-capturable)."""
        logits = self._forward(b)
        uniforms = request_uniforms(self.seed[:b], self.step_idx[:b])
        tokens, logprobs = sample_unfiltered(logits.float(), self.temperature[:b], uniforms)
        live = self.live[:b]
        self.ids[:b] = tokens
        self.pos[:b] += live
        self.step_idx[:b] += live
        return logits, tokens, logprobs

    def _forward(self, n: int) -> torch.Tensor:
        if self.flash:
            self.varlen[0, :n] = self.pos[:n] + 1
        self._cache.bind(n, self.rows, self.pos)
        return self._model_call(self.model, self.ids[:n].view(n, 1), self.pos[:n].view(n, 1), self._cache,
                                self._mask_types, self.varlen if self.flash else None,
                                self.columns)

    def _capture(self, b: int):
        """Capture the step for `b` rows. The warm-up runs really execute: K/V they write at each row's position
        are rewritten identically by the real step, but GDN states and the step inputs would advance, so they are
        saved and restored."""
        t0 = time.perf_counter()
        n = len(self.active)
        saved = [(layer.conv_buf[:n].clone(), layer.recurrent_buf[:n].clone())
                 for layer in self._cache.layers if isinstance(layer, _SlotLinear)]
        inputs = [(buf, buf.clone()) for buf in (self.ids, self.pos, self.step_idx)]
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._decode(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: weight updates stage tensors on other threads meanwhile (their allocations and
            # copies must not invalidate this capture, nor this capture fail them)
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = self._decode(b)
            entry = (graph, outputs)
            self._graphs[b] = entry
            self.stats.graphs_captured += 1
        except Exception:
            log.exception("CUDA graph capture for batch %d failed; that batch size decodes eagerly", b)
            self._eager_only.add(b)
            self.stats.graph_failures += 1
            entry = None
        finally:
            torch.cuda.synchronize(self.device)   # a failed warm-up may leave side-stream work writing the state
            linear = [layer for layer in self._cache.layers if isinstance(layer, _SlotLinear)]
            for layer, (conv, rec) in zip(linear, saved):
                layer.conv_buf[:n] = conv
                layer.recurrent_buf[:n] = rec
            for buf, before in inputs:
                buf.copy_(before)
            torch.cuda.synchronize(self.device)
        self.stats.graph_capture_s += time.perf_counter() - t0
        return entry

    def info(self) -> dict:
        return {"slots": self.slots, "max_len": self.max_len, "cache_gb": round(self.stats.cache_bytes / 1e9, 3),
                "cuda_graphs": self.cuda_graphs, "compiled": self.compile_decode,
                "decode_attention": "flash varlen" if self.flash else f"sdpa + mask ({self.flash_reason})",
                "graphs_captured": self.stats.graphs_captured,
                "graph_capture_s": round(self.stats.graph_capture_s, 2), "graph_failures": self.stats.graph_failures,
                "resizes": self.stats.resizes}


def _call_model(model, ids: torch.Tensor, pos: torch.Tensor, cache: SlotCache, layer_types: tuple[str, ...],
                varlen: torch.Tensor | None, columns: torch.Tensor) -> torch.Tensor:
    """The decode forward: one token per row at per-row positions; last logits. The attention mask is cut from the
    slot buffers here, inside what torch.compile traces, so that its sizes are expressions of the batch (a mask
    sliced outside is an input with size symbols of its own, which duck sizing may tie to an unrelated dim)."""
    n = ids.shape[0]
    if varlen is not None:
        mask = varlen[:, : n + 1]
    else:
        mask = (columns.view(1, -1) <= pos.view(n, 1)).view(n, 1, 1, -1)
    masks = {t: (mask if t == "full_attention" else None) for t in layer_types}
    out = model(input_ids=ids, position_ids=pos, attention_mask=masks, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1, :]


def _layout(cache, layer_types: list[str]) -> tuple[int, int, list]:
    """Per-layer buffer shapes of a prefilled DynamicCache: K/V bytes per token and GDN state bytes per slot."""
    per_token, per_slot, specs = 0, 0, []
    for li, layer in enumerate(cache.layers):
        if layer_types[li] == "linear_attention":
            conv, rec = layer.conv_states[0], layer.recurrent_states[0]
            specs.append(("linear", (tuple(conv.shape[1:]), tuple(rec.shape[1:])), (conv.dtype, rec.dtype)))
            per_slot += conv[0].numel() * conv.element_size() + rec[0].numel() * rec.element_size()
        else:
            k, v = layer.keys, layer.values     # [batch, heads, len, dim]
            specs.append(("attn", (k.shape[1], k.shape[3], v.shape[3]), k.dtype))
            per_token += k.shape[1] * (k.shape[3] + v.shape[3]) * k.element_size()
    return per_token, per_slot, specs


def slot_compatible(cache) -> bool:
    """Whether a prefilled DynamicCache has only layers `SlotDecoder.add` can copy."""
    return all((isinstance(layer, DynamicLayer) and not getattr(layer, "is_sliding", False))
               or isinstance(layer, LinearAttentionLayer) for layer in cache.layers)
