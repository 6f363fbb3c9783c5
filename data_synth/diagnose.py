"""Op-family prior diagnosis (MusaCoder §3 "prior-diagnosis data mixing"; research note §2.4).

Each task's reference runs once under ``torch.profiler``; its outermost ``aten::`` ops are mapped to families
(an explicit table for GEMM, conv, norms, pooling, indexing, ...; aten's own ``pointwise``/``reduction`` tags
for the rest; a pointwise op whose operands have different shapes is ``broadcast``). Every scored verdict of
an evaluation counts for each family its task's reference uses; per family the pass rate is measured and the
sampling weight of the next generation round is

    w_f = clip((1 - pass_rate_f + floor) ** alpha / mean over families, min_weight, max_weight)

so families the model fails on are upsampled and the ones it has mastered downsampled.
``python -m data_synth generate --weights WEIGHTS.json`` reads the result.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from verifier import inputs as vinputs
from verifier.size_profiles import run_reference_on_meta
from verifier.tasks import load_task_module
from verifier.types import Category

from .generate import GeneratedTask
from .ops import FAMILIES
from .taskset import read_task_set, verifier_task
from .util import DataSynthError, atomic_write_json, read_json, read_jsonl

log = logging.getLogger("data_synth")
WEIGHTS_FORMAT = "data_synth.weights/1"

_TABLE: dict[str, str] = {}
for _fam, _names in {
    "gemm": "mm addmm bmm baddbmm matmul linear addmv mv dot einsum addbmm _addmm_activation",
    "conv": "convolution _convolution conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d "
            "mkldnn_convolution _slow_conv2d_forward slow_conv_transpose2d slow_conv3d _convolution_mode "
            "cudnn_convolution cudnn_convolution_transpose",
    "softmax": "_softmax softmax _log_softmax log_softmax logsumexp",
    "normalization": "native_batch_norm batch_norm _batch_norm_impl_index native_layer_norm layer_norm "
                     "native_group_norm group_norm instance_norm rms_norm _fused_rms_norm "
                     "_native_batch_norm_legit _native_batch_norm_legit_no_training _batch_norm_with_update "
                     "normalize",
    "pooling": "max_pool1d max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices avg_pool1d "
               "avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d "
               "_adaptive_avg_pool2d adaptive_max_pool2d max_pool1d_with_indices",
    "indexing": "gather index_select embedding index index_put index_put_ scatter scatter_add scatter_reduce take "
                "take_along_dim masked_select embedding_bag _embedding_bag index_add",
    "scan": "cumsum cumprod logcumsumexp cummax cummin _logcumsumexp",
    "loss": "mse_loss l1_loss smooth_l1_loss huber_loss kl_div cross_entropy_loss nll_loss nll_loss_nd "
            "nll_loss2d binary_cross_entropy binary_cross_entropy_with_logits cosine_similarity "
            "triplet_margin_loss hinge_embedding_loss margin_ranking_loss",
    "attention": "scaled_dot_product_attention _scaled_dot_product_flash_attention "
                 "_scaled_dot_product_efficient_attention _scaled_dot_product_attention_math "
                 "_scaled_dot_product_flash_attention_for_cpu",
    "layout": "cat flip roll pad constant_pad_nd reflection_pad2d replicate_pad2d repeat stack tile",
}.items():
    for _n in _names.split():
        _TABLE[_n] = _fam

# ops that only allocate, view or move: no family
_IGNORED = set("""empty empty_like empty_strided zeros zeros_like ones ones_like full full_like new_empty new_zeros
new_ones fill_ zero_ view reshape _reshape_alias _unsafe_view as_strided expand expand_as t transpose permute select
slice unsqueeze squeeze flatten unflatten contiguous clone copy_ to _to_copy detach detach_ alias lift_fresh
resize_ result_type size stride numel dim item _local_scalar_dense split chunk unbind narrow view_as reshape_as
set_ is_nonzero resolve_conj resolve_neg random_ uniform_ normal_ rand randn randint arange""".split())


def aten_family(name: str, input_shapes: Sequence[Sequence[int]] = ()) -> str | None:
    """The family of one aten op (``aten::`` prefix and overload optional); None for data-movement ops."""
    base = name.split("::")[-1].split(".")[0]
    if base in _IGNORED:
        return None
    if base in _TABLE:
        return _TABLE[base]
    packet = getattr(torch.ops.aten, base, None)
    tags: set = set()
    if packet is not None:
        for ov in packet.overloads():
            tags |= set(getattr(packet, ov).tags)
    if torch.Tag.pointwise in tags:
        shapes = [tuple(s) for s in input_shapes if s]
        return "broadcast" if len(set(shapes)) > 1 else "elementwise"
    if torch.Tag.reduction in tags or base in ("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std",
                                                "argmax", "argmin", "norm", "linalg_vector_norm", "var_mean",
                                                "std_mean", "all", "any"):
        return "reduction"
    return "elementwise" if base.endswith("_") and hasattr(torch.ops.aten, base[:-1]) else None


#: the family that names a task using several (a table that counts each task once): its heaviest kind of op
FAMILY_DOMINANCE = ("attention", "conv", "gemm", "normalization", "softmax", "loss", "pooling", "scan", "indexing",
                    "reduction", "layout", "broadcast", "elementwise")


class _TorchCallRecorder(TorchFunctionMode):
    """The torch functions and tensor methods one call makes (``F.conv2d``, ``Tensor.sum``, ``x + y``), with their
    tensor operands' shapes: what the reference's own code calls, above aten's decompositions. (The time limit is
    kept below, in `_DispatchDeadline`: every torch call reaches it.)"""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "").strip("_")
        shapes = [tuple(a.shape) for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        self.calls.append((name, shapes))
        return func(*args, **(kwargs or {}))


class _EnoughCalls(Exception):
    """The recording's time is up: the calls so far name the families."""


class _DispatchDeadline(TorchDispatchMode):
    """Raises `_EnoughCalls` past ``deadline``, below the torch functions: an LSTM's meta kernel decomposes into aten
    calls per time step (10-20 s for KernelBench's) without calling a torch function."""

    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if time.monotonic() > self.deadline:
            raise _EnoughCalls
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def reference_families(task: Any, precision: str = "float32", seconds: float = 2.0) -> list[str]:
    """The op families one call of ``task``'s reference uses, dominant first (`FAMILY_DOMINANCE`), for tasks that
    carry none (KernelBench's): read from a run on meta tensors, so nothing is computed or allocated at any size,
    and cut after ``seconds`` (the calls so far count). [] when the reference does not run on meta tensors
    (data-dependent code)."""
    recorder, deadline = _TorchCallRecorder(), _DispatchDeadline(time.monotonic() + seconds)
    try:
        run_reference_on_meta(task, precision, _both(recorder, deadline))   # entered around the call only
    except _EnoughCalls:
        pass
    except Exception:   # noqa: BLE001 - the task's own failure: no families, the caller says "unknown"
        return []
    found = {f for name, shapes in recorder.calls if name and (f := _torch_call_family(name, shapes)) is not None}
    return sorted(found, key=lambda f: FAMILY_DOMINANCE.index(f) if f in FAMILY_DOMINANCE else len(FAMILY_DOMINANCE))


#: activations aten does not tag pointwise
_ACTIVATIONS = set("""leaky_relu leaky_relu_ elu elu_ selu selu_ celu celu_ gelu silu mish softplus softsign hardtanh
hardtanh_ hardswish hardsigmoid relu6 rrelu prelu threshold logsigmoid tanhshrink softshrink hardshrink glu""".split())


def _torch_call_family(name: str, shapes: Sequence[Sequence[int]]) -> str | None:
    """`aten_family` of a torch-level call name: ``F.scaled_dot_product_attention`` and the nn.functional names
    that are not aten ops of the same name (``multi_head_attention_forward``, ``cross_entropy``)."""
    if "attention" in name:
        return "attention"
    if name in _ACTIVATIONS:
        return "elementwise"
    if name in ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"):
        return "gemm"   # their time is the gate GEMMs
    if name in ("cross_entropy", "nll_loss", "binary_cross_entropy", "kl_div", "mse_loss", "l1_loss",
                "smooth_l1_loss", "huber_loss", "triplet_margin_loss", "margin_ranking_loss",
                "hinge_embedding_loss", "cosine_embedding_loss"):
        return "loss"
    try:
        return aten_family(name, shapes)
    except Exception:   # noqa: BLE001 - a name aten does not know
        return None


def profile_families(task: GeneratedTask, seed: int = 0) -> tuple[list[str], dict[str, int]]:
    """(families, outermost aten op counts) of one forward of the reference at its cpu sizes."""
    module = load_task_module(verifier_task(task), module_name=f"data_synth_diag_{abs(hash(task.task_id))}")
    init = vinputs.make_init_inputs(module, seed, "cpu")
    model = vinputs.build_model(module.Model, init, seed, torch.device("cpu"), "float32")
    args = vinputs.make_inputs(module, seed, "cpu", "float32")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(*args)
    counts: dict[str, int] = {}
    fams: list[str] = []
    for evt in prof.events():
        if not evt.name.startswith("aten::"):
            continue
        parent = evt.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is not None:
            continue
        counts[evt.name] = counts.get(evt.name, 0) + 1
        fam = aten_family(evt.name, evt.input_shapes or ())
        if fam is not None and fam not in fams:
            fams.append(fam)
    return fams, counts


@dataclasses.dataclass
class FamilyStats:
    samples: int = 0
    tasks: int = 0
    passed: int = 0
    compiled: int = 0
    fast: int = 0                      # passed with speedup > 1.1
    categories: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def pass_rate(self) -> float:
        return self.passed / self.samples if self.samples else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "pass_rate": round(self.pass_rate, 4)}


@dataclasses.dataclass
class DiagnoseConfig:
    alpha: float = 1.0
    floor: float = 0.05
    min_weight: float = 0.25
    max_weight: float = 4.0
    profile: bool = True               # profile references (else use the manifest's families)

    def __post_init__(self) -> None:
        if not (self.alpha > 0 and 0 < self.min_weight <= 1 <= self.max_weight and 0 < self.floor < 1):
            raise DataSynthError("diagnose needs alpha > 0, 0 < min_weight <= 1 <= max_weight and 0 < floor < 1")


@dataclasses.dataclass
class DiagnoseReport:
    weights: dict[str, float]
    families: dict[str, FamilyStats]
    samples: int
    infra: int
    task_families: dict[str, list[str]]
    config: DiagnoseConfig
    sources: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"format": WEIGHTS_FORMAT, "weights": self.weights,
                "families": {f: s.to_dict() for f, s in self.families.items()}, "samples": self.samples,
                "infra_excluded": self.infra, "task_families": self.task_families,
                "config": dataclasses.asdict(self.config), "sources": self.sources}


def family_weights(stats: dict[str, FamilyStats], cfg: DiagnoseConfig) -> dict[str, float]:
    raw = {f: (1.0 - s.pass_rate + cfg.floor) ** cfg.alpha for f, s in stats.items() if s.samples}
    if not raw:
        return {}
    mean = sum(raw.values()) / len(raw)
    return {f: round(min(cfg.max_weight, max(cfg.min_weight, w / mean)), 4) for f, w in sorted(raw.items())}


def _check_row(row: dict[str, Any], where: str) -> tuple[str, str, float | None]:
    tid = row.get("task_id")
    if not isinstance(tid, str) or not tid:
        raise DataSynthError(f"{where}: missing 'task_id' string")
    cat = row.get("category")
    try:
        Category(cat)
    except ValueError:
        raise DataSynthError(f"{where}: 'category' must be one of {[c.value for c in Category]}, got {cat!r}") \
            from None
    sp = row.get("speedup")
    if sp is not None and not isinstance(sp, (int, float)):
        raise DataSynthError(f"{where}: 'speedup' must be a number or null, got {sp!r}")
    return tid, cat, sp


def diagnose(results: Sequence[str], task_specs: Sequence[str], cfg: DiagnoseConfig | None = None,
             progress: bool = True) -> DiagnoseReport:
    cfg = cfg or DiagnoseConfig()
    tasks: dict[str, GeneratedTask] = {}
    for spec in task_specs:
        for t in read_task_set(spec):
            tasks.setdefault(t.task_id, t)
    rows: list[tuple[str, str, float | None]] = []
    for path in results:
        for i, row in enumerate(read_jsonl(path, "results"), 1):
            rows.append(_check_row(row, f"{path}: row {i}"))
    if not rows:
        raise DataSynthError(f"no verdict rows in {', '.join(results)}")
    unknown = sorted({tid for tid, _, _ in rows if tid not in tasks})
    if unknown:
        raise DataSynthError(f"results name tasks that are not in {', '.join(task_specs)}: "
                             f"{', '.join(unknown[:10])}{' ...' if len(unknown) > 10 else ''}")
    used = sorted({tid for tid, _, _ in rows})
    fam_of: dict[str, list[str]] = {}
    for tid in tqdm(used, desc="profile references", unit="task", file=sys.stderr, disable=not progress or
                    not cfg.profile, dynamic_ncols=True):
        t = tasks[tid]
        fams = [f for f in t.families if f in FAMILIES] or [t.primary_family]
        if cfg.profile:
            try:
                fams = profile_families(t)[0] or fams
            except Exception as e:  # noqa: BLE001 - a reference that will not run keeps its declared families
                log.warning("task %s: profiling failed (%s: %s); using its declared families %s", tid,
                            type(e).__name__, e, fams)
        fam_of[tid] = fams
    stats: dict[str, FamilyStats] = {}
    seen_tasks: dict[str, set[str]] = {}
    infra = 0
    for tid, cat, sp in rows:
        if cat == Category.INFRA.value:
            infra += 1
            continue
        for f in fam_of[tid]:
            s = stats.setdefault(f, FamilyStats())
            s.samples += 1
            seen_tasks.setdefault(f, set()).add(tid)
            s.categories[cat] = s.categories.get(cat, 0) + 1
            if cat not in (Category.FORMAT_ERROR.value, Category.COMPILE_ERROR.value):
                s.compiled += 1
            if cat == Category.PASS.value:
                s.passed += 1
                if sp is not None and math.isfinite(sp) and sp > 1.1:
                    s.fast += 1
    for f, s in stats.items():
        s.tasks = len(seen_tasks[f])
    return DiagnoseReport(family_weights(stats, cfg), dict(sorted(stats.items())), len(rows) - infra, infra, fam_of,
                          cfg, [os.path.abspath(p) for p in results])


def write_weights(path: str, report: DiagnoseReport) -> None:
    atomic_write_json(path, report.to_json())


def read_weights(path: str) -> dict[str, float]:
    """Family weights from ``diagnose``'s output (or a plain ``{family: weight}`` object)."""
    doc = read_json(path, "weights")
    weights = doc.get("weights") if isinstance(doc, dict) and "weights" in doc else doc
    if not isinstance(weights, dict):
        raise DataSynthError(f"{path}: expected {{'format': '{WEIGHTS_FORMAT}', 'weights': {{...}}}} or a "
                             f"{{family: weight}} object")
    out = {}
    for f, w in weights.items():
        if f not in FAMILIES:
            raise DataSynthError(f"{path}: unknown family {f!r}; known: {', '.join(FAMILIES)}")
        if not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0 or not math.isfinite(w):
            raise DataSynthError(f"{path}: weight of {f!r} must be a finite number >= 0, got {w!r}")
        out[f] = float(w)
    return out
