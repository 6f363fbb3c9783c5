"""Progressive task generation (MusaCoder §3 stage 1 task expansion; research note §2.2):

* stage 1: one registry op on fresh inputs, with shape (power-of-two or odd sizes), stride (contiguous,
  transposed, channels-last views) and dtype variants;
* stage 2: compositions of 2-5 ops as random valid graphs: an anchor op (GEMM/conv, as every KernelBench
  level-2 task, or any op) followed by an epilogue chain whose operands may be new inputs, broadcast
  parameters or earlier values (residuals); shapes are inferred node by node in both size profiles and an
  op whose constraints fail is redrawn (NNSmith-style, without a solver: each op samples only valid
  parameters for the shapes it is given);
* stage 3: module-level templates (``data_synth.templates``).

Candidate ``i`` of a run depends only on ``(seed, stage, i)``, so a run is reproducible and a longer run
extends a shorter one. Family sampling weights come from ``data_synth.diagnose`` (``--weights``).
"""
from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Sequence

from .ir import FLOAT_DTYPES, Dim, Graph, InputSpec, Node, ParamSpec, Ref, TensorSpec
from .ops import FAMILIES, REGISTRY, Binary, Op, get_op, ops_in
from .render import RenderError, render_graph
from .sizes import SizeSampler
from .templates import TEMPLATES
from .util import DataSynthError, sub_rng

GENERATOR_VERSION = "data_synth/1"
STAGES = (1, 2, 3)
ANCHOR_FAMILIES = ("gemm", "conv")
EPILOGUE_FAMILIES = ("elementwise", "broadcast", "reduction", "softmax", "normalization", "pooling")


@dataclasses.dataclass
class GenConfig:
    """What to generate. ``weights``: family -> sampling weight (missing families weigh 1; 0 excludes)."""

    stage: int = 1
    n: int = 16
    seed: int = 0
    families: tuple[str, ...] | None = None
    weights: dict[str, float] | None = None
    dtypes: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"float32": 0.7, "float16": 0.15, "bfloat16": 0.15})
    noncontiguous: float = 0.25        # probability of a strided (transposed / channels-last) input
    odd_shapes: float = 0.5            # probability of non-power-of-two sizes
    min_ops: int = 2
    max_ops: int = 5
    teacher_only: bool = False         # only ops the offline teacher can write (CPU recipe)
    ops: tuple[str, ...] | None = None # only these registry ops (targeted basic-operator variants)
    templates: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise DataSynthError(f"stage must be one of {STAGES}, got {self.stage!r}")
        if self.n < 1:
            raise DataSynthError(f"n must be >= 1, got {self.n}")
        for f in (self.families or ()):
            if f not in FAMILIES:
                raise DataSynthError(f"unknown family {f!r}; known: {', '.join(FAMILIES)}")
        for f, w in (self.weights or {}).items():
            if f not in FAMILIES:
                raise DataSynthError(f"weights: unknown family {f!r}; known: {', '.join(FAMILIES)}")
            if not isinstance(w, (int, float)) or w < 0:
                raise DataSynthError(f"weights: family {f!r} needs a non-negative number, got {w!r}")
        for d, w in self.dtypes.items():
            if d not in FLOAT_DTYPES or w < 0:
                raise DataSynthError(f"dtypes: {d!r} must be one of {FLOAT_DTYPES} with a weight >= 0")
        if not any(w > 0 for w in self.dtypes.values()):
            raise DataSynthError("dtypes: at least one dtype needs a positive weight")
        for name in ("noncontiguous", "odd_shapes"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v <= 1):
                raise DataSynthError(f"--{name.replace('_', '-')} is a probability in [0, 1], got {v!r}")
        if not 2 <= self.min_ops <= self.max_ops <= 5:
            raise DataSynthError(f"stage-2 op counts need 2 <= min_ops <= max_ops <= 5, got "
                                 f"{self.min_ops}..{self.max_ops}")
        unknown = [o for o in (self.ops or ()) if o not in REGISTRY]
        if unknown:
            raise DataSynthError(f"ops: unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted(REGISTRY))}")
        if self.ops is not None and not self.ops:
            raise DataSynthError("ops: give at least one op name (or leave it unset for all)")
        for t in (self.templates or ()):
            if t not in TEMPLATES:
                raise DataSynthError(f"unknown template {t!r}; known: {', '.join(TEMPLATES)}")

    def family_weight(self, family: str) -> float:
        if self.families is not None and family not in self.families:
            return 0.0
        return float((self.weights or {}).get(family, 1.0))


@dataclasses.dataclass
class GeneratedTask:
    """One generated problem: its source and everything the manifest records about it."""

    task_id: str
    stage: int
    index: int
    source: str
    description: str
    families: list[str]
    primary_family: str
    ops: list[str]
    sizes: dict[str, dict[str, Any]]
    precisions: list[str]
    graph: Graph | None = None
    template: str | None = None
    seed: int = 0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    path: str | None = None           # where the file is, once written or read

    @property
    def relpath(self) -> str:
        return f"level{self.stage}/{self.task_id}.py"

    def manifest_entry(self) -> dict[str, Any]:
        return {"path": self.relpath, "task_id": self.task_id, "level": self.stage, "op_family": self.primary_family,
                "backend": "any", "precisions": self.precisions, "sizes": self.sizes, "stage": self.stage,
                "families": self.families, "ops": self.ops, "description": self.description,
                "generator": GENERATOR_VERSION, "seed": self.seed, "index": self.index, "template": self.template,
                "graph": None if self.graph is None else self.graph.to_json(), **self.meta}

    @classmethod
    def from_manifest(cls, entry: dict[str, Any], source: str, path: str | None = None) -> "GeneratedTask":
        known = {"path", "task_id", "level", "op_family", "backend", "precisions", "sizes", "stage", "families", "ops",
                 "description", "generator", "seed", "index", "template", "graph"}
        return cls(task_id=entry["task_id"], stage=int(entry.get("stage") or entry.get("level") or 1),
                   index=int(entry.get("index", -1)), source=source, description=entry.get("description", ""),
                   families=list(entry.get("families") or [entry.get("op_family") or "unknown"]),
                   primary_family=entry.get("op_family") or "unknown", ops=list(entry.get("ops") or []),
                   sizes=entry.get("sizes") or {}, precisions=list(entry.get("precisions") or ["float32"]),
                   graph=Graph.from_json(entry["graph"]) if entry.get("graph") else None,
                   template=entry.get("template"), seed=int(entry.get("seed", 0)),
                   meta={k: v for k, v in entry.items() if k not in known}, path=path)


class SampleFailed(Exception):
    """No valid op/shape combination was found for this draw (the caller redraws with the next attempt)."""


def weighted_choice(rng: random.Random, items: Sequence[str], weight) -> str:
    ws = [max(0.0, float(weight(i))) for i in items]
    if not any(ws):
        raise SampleFailed("every candidate has weight 0")
    return rng.choices(list(items), weights=ws, k=1)[0]


def _title(op_name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in op_name.split("_"))


def _teacher_ok(op: Op) -> bool:
    return op.teacher is not None


def _allowed(op: Op, cfg: GenConfig) -> bool:
    """The op passes the run's op restrictions (``teacher_only``, ``ops``)."""
    return (not cfg.teacher_only or _teacher_ok(op)) and (cfg.ops is None or op.name in cfg.ops)


def stage1_ops(family: str, cfg: GenConfig) -> list[Op]:
    ops = [op for op in REGISTRY.values() if op.stage1 and (
        op.family == family or (family == "broadcast" and isinstance(op, Binary)))]
    return [op for op in ops if _allowed(op, cfg)]


def _draw_dtype(rng: random.Random, cfg: GenConfig, op: Op) -> str:
    d = rng.choices(list(cfg.dtypes), weights=list(cfg.dtypes.values()), k=1)[0]
    return d if d in op.dtypes else "float32"


def _draw_layout(rng: random.Random, cfg: GenConfig) -> str:
    if rng.random() >= cfg.noncontiguous:
        return "contiguous"
    return "channels_last" if rng.random() < 0.3 else "transposed"


def _fix_layout(inputs: list[InputSpec]) -> list[InputSpec]:
    out = []
    for i in inputs:
        layout = i.layout
        if layout == "channels_last" and i.spec.rank != 4:
            layout = "transposed"
        if i.spec.rank < 2 or i.spec.domain == "index":
            layout = "contiguous"
        out.append(dataclasses.replace(i, layout=layout))
    return out


def _stage1(rng: random.Random, cfg: GenConfig, sizes: SizeSampler) -> tuple[Graph, str]:
    families = [f for f in FAMILIES if stage1_ops(f, cfg)]
    family = weighted_choice(rng, families, cfg.family_weight)
    op = rng.choice(stage1_ops(family, cfg))
    inputs = _fix_layout(op.stage1_inputs(rng, sizes, _draw_dtype(rng, cfg, op), _draw_layout(rng, cfg)))
    specs = [i.spec for i in inputs]
    params = op.sample(rng, specs, sizes)
    if params is None:
        raise SampleFailed(f"{op.name}: no valid parameters for {[s.sizes('cpu') for s in specs]}")
    node_family = op.node_family(specs, params)
    if family == "broadcast" and node_family != "broadcast":
        raise SampleFailed("wanted a broadcasting operand")
    node = Node(op.name, tuple(Ref("input", i) for i in range(len(inputs))), params, op.infer(specs, params))
    return Graph(tuple(inputs), (node,)), family


def _named(d: Dim, sizes: SizeSampler, base: str) -> Dim:
    return d if d.name is not None or (d.cpu == 1 and d.gpu == 1) else Dim(d.cpu, d.gpu, sizes.names.take(base))


def _stage2(rng: random.Random, cfg: GenConfig, sizes: SizeSampler) -> tuple[Graph, str]:
    # anchor: a GEMM/conv (KernelBench level 2's shape) or, less often, any single op of a weighted family
    anchor_fams = [f for f in FAMILIES if cfg.family_weight(f) > 0 and any(
        op.anchor or f not in ANCHOR_FAMILIES for op in stage1_ops(f, cfg))]
    bias = {f: (3.0 if f in ANCHOR_FAMILIES else 0.5) * cfg.family_weight(f) for f in anchor_fams}
    family = weighted_choice(rng, anchor_fams, lambda f: bias[f])
    choices = [op for op in stage1_ops(family, cfg) if op.anchor or family not in ANCHOR_FAMILIES]
    choices = [op for op in choices if not isinstance(op, Binary) and op.epilogue or op.anchor]
    if not choices:
        raise SampleFailed(f"no anchor op in family {family}")
    anchor = rng.choice(choices)
    dtype = _draw_dtype(rng, cfg, anchor)
    inputs = _fix_layout(anchor.stage1_inputs(rng, sizes, dtype, _draw_layout(rng, cfg)))
    specs = [i.spec for i in inputs]
    p0 = anchor.sample(rng, specs, sizes)
    if p0 is None:
        raise SampleFailed(f"anchor {anchor.name} has no valid parameters")
    nodes = [Node(anchor.name, tuple(Ref("input", i) for i in range(len(inputs))), p0, anchor.infer(specs, p0))]
    params: list[ParamSpec] = []
    inputs = list(inputs)
    target = rng.choices(range(cfg.min_ops, cfg.max_ops + 1),
                         weights=[(0.55 ** k) for k in range(cfg.max_ops - cfg.min_ops + 1)], k=1)[0]
    failures = 0
    while len(nodes) < target:
        if failures > 40:
            raise SampleFailed("no valid epilogue op after 40 draws")
        cur = Ref("node", len(nodes) - 1)
        cur_spec = nodes[-1].out
        if not cur_spec.is_float or cur_spec.rank == 0:
            break
        fam = weighted_choice(rng, EPILOGUE_FAMILIES, cfg.family_weight)
        if fam in ("broadcast", "elementwise") and (fam == "broadcast" or rng.random() < 0.3):
            node = _binary_epilogue(rng, fam, cur, cur_spec, nodes, inputs, params, sizes, cfg)
        else:
            cands = [op for op in ops_in(fam) if op.epilogue and op.arity == 1 and _allowed(op, cfg)]
            node = None
            if cands:
                op = rng.choice(cands)
                p = op.sample(rng, [cur_spec], sizes)
                if p is not None:
                    node = Node(op.name, (cur,), p, op.infer([cur_spec], p))
        if node is None:
            failures += 1
            continue
        nodes.append(node)
    if len(nodes) < 2:
        raise SampleFailed("the composition has a single op")
    return Graph(tuple(inputs), tuple(nodes), tuple(params)), family


def _binary_epilogue(rng, fam, cur, cur_spec, nodes, inputs, params, sizes, cfg) -> Node | None:
    ops = [op for op in REGISTRY.values() if isinstance(op, Binary) and _allowed(op, cfg)]
    if not ops:
        return None
    op = rng.choice(ops)
    positive = op.requires_second == "positive"
    if fam == "elementwise":
        # same shape: an earlier value (a residual) or a new input
        earlier = [Ref("node", j) for j, n in enumerate(nodes[:-1]) if n.out.is_float and
                   n.out.rank == cur_spec.rank and all(a.same_size(b) for a, b in zip(n.out.shape, cur_spec.shape))
                   and (not positive or n.out.domain == "positive")]
        if earlier and rng.random() < 0.6:
            other = rng.choice(earlier)
            other_spec = nodes[other.index].out
        else:
            shape = tuple(_named(d, sizes, "out_dim") for d in cur_spec.shape)
            name = "residual" if "residual" not in [i.name for i in inputs] else f"y{len(inputs)}"
            spec = TensorSpec(shape, cur_spec.dtype, "positive" if positive else "real")
            inputs.append(InputSpec(name, spec))
            other, other_spec = Ref("input", len(inputs) - 1), spec
    else:
        r = cur_spec.rank
        one = Dim(1, 1)
        if r >= 3 and rng.random() < 0.7:
            shape = (_named(cur_spec.shape[1], sizes, "channels"),) + (one,) * (r - 2)
        else:
            shape = (_named(cur_spec.shape[-1], sizes, "features"),)
        base = {"add": "bias", "sub": "bias", "mul": "scale", "div": "divisor"}.get(op.name, "bound")
        taken = {p.name for p in params}
        name = base if base not in taken else f"{base}{len(params)}"
        spec = TensorSpec(shape, cur_spec.dtype, "positive" if positive else "real")
        params.append(ParamSpec(name, spec, "positive" if positive else "randn"))
        other, other_spec = Ref("param", len(params) - 1), spec
    p = op.sample(rng, [cur_spec, other_spec], sizes)
    if p is None:
        if other.kind == "param":
            params.pop()
        elif other.kind == "input":
            inputs.pop()
        return None
    return Node(op.name, (cur, other), p, op.infer([cur_spec, other_spec], p))


def generate_candidate(cfg: GenConfig, index: int, max_attempts: int = 64) -> GeneratedTask:
    """Candidate ``index`` of a run (not yet validated or decontaminated)."""
    last: Exception | None = None
    for attempt in range(max_attempts):
        rng = sub_rng(cfg.seed, "stage", cfg.stage, "task", index, "attempt", attempt)
        sizes = SizeSampler(rng, "odd" if rng.random() < cfg.odd_shapes else "nice")
        try:
            if cfg.stage == 3:
                return _from_template(rng, cfg, sizes, index)
            graph, family = (_stage1 if cfg.stage == 1 else _stage2)(rng, cfg, sizes)
            rendered = render_graph(graph, sizes.names)
        except (SampleFailed, RenderError) as e:
            last = e
            continue
        fams = []
        for n in graph.nodes:
            op = get_op(n.op)
            f = op.node_family([graph.spec_of(a) for a in n.args], n.params)
            if f not in fams:
                fams.append(f)
        primary = fams[0]
        name = "_".join(_title(n.op) for n in graph.nodes)
        dtypes = sorted({i.spec.dtype for i in graph.inputs if i.spec.is_float}) or ["float32"]
        return GeneratedTask(task_id=f"{index + 1}_{name}", stage=cfg.stage, index=index, source=rendered.source,
                             description=rendered.description, families=fams, primary_family=primary,
                             ops=graph.op_names(), sizes=rendered.sizes, precisions=dtypes, graph=graph,
                             seed=cfg.seed, meta={"bindings": rendered.bindings})
    raise DataSynthError(f"candidate {index}: no valid task in {max_attempts} draws (last: {last}); "
                         f"the family/op restrictions may leave nothing to compose")


@functools.cache
def template_families() -> dict[str, tuple[str, ...]]:
    """The families each stage-3 template declares (rendered once with throwaway sizes)."""
    return {name: tuple(fn(random.Random(0), SizeSampler(random.Random(0)), "float32").families)
            for name, fn in TEMPLATES.items()}


def _from_template(rng: random.Random, cfg: GenConfig, sizes: SizeSampler, index: int) -> GeneratedTask:
    names = list(cfg.templates or TEMPLATES)
    fams = template_families()
    weight = {n: sum(cfg.family_weight(f) for f in fams[n]) / len(fams[n]) for n in names}
    tmpl_name = weighted_choice(rng, names, weight.__getitem__)
    dtype = rng.choices(list(cfg.dtypes), weights=list(cfg.dtypes.values()), k=1)[0]
    t = TEMPLATES[tmpl_name](rng, sizes, dtype)
    if cfg.families is not None and not set(t.families) & set(cfg.families):
        raise SampleFailed(f"template {tmpl_name} has none of the requested families")
    if not any(cfg.family_weight(f) > 0 for f in t.families):
        raise SampleFailed(f"template {tmpl_name}: all its families have weight 0")
    return GeneratedTask(task_id=f"{index + 1}_{t.name}", stage=3, index=index, source=t.rendered.source,
                         description=t.rendered.description, families=t.families, primary_family=t.families[0],
                         ops=t.ops, sizes=t.rendered.sizes, precisions=[dtype], template=tmpl_name, seed=cfg.seed)
