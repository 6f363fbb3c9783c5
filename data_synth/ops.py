"""The op registry: every op a generated task may use, tagged by family, with its valid input ranks,
dtypes and value domains, its hyper-parameter choices, shape inference, and how it is written in PyTorch.

Families follow the research note's taxonomy (§2.3), which maps to aten ops, so diagnosis
(``data_synth.diagnose``) can attribute a verdict to the same family names from a profile of the reference.
An op's ``teacher`` names the offline-teacher recipe (``data_synth.teacher``) that can write a kernel for it;
ops without one are left to an LLM teacher.

Constraints are checked in both size profiles (``ir.Dim`` holds the cpu and gpu value), so a task valid at
CPU sizes is valid at GPU sizes too.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence

from .ir import FLOAT_DTYPES, Dim, InputSpec, TensorSpec
from .sizes import SizeSampler

FAMILIES = ("elementwise", "broadcast", "reduction", "softmax", "normalization", "gemm", "conv", "pooling",
            "indexing", "scan", "loss", "attention", "layout")
HALF_OK = FLOAT_DTYPES
F32 = ("float32",)


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A scalar hyper-parameter: drawn from ``choices``; ``ctor`` ones become constructor arguments
    (module constants returned by get_init_inputs, as KernelBench passes them), others are literals."""

    name: str
    choices: tuple
    ctor: bool = True


class Op:
    """Base: a unary, shape-preserving op. Subclasses override ``sample``/``infer``/``render``."""

    name: str = ""
    family: str = "elementwise"
    arity: int = 1
    ranks: tuple[int, ...] = (1, 2, 3, 4)
    dtypes: tuple[str, ...] = HALF_OK
    requires: str = "real"            # domain of the first operand: real (anything) | positive | near_one
    produces: str = "real"
    scalars: tuple[Scalar, ...] = ()
    py: str = ""                      # forward expression; {x}, {y}, {<scalar>}
    teacher: str | None = None        # offline-teacher recipe
    cpp: str | None = None            # teacher: C++ expression of float v (unary) or a, b (binary)
    epilogue: bool = True             # may follow an anchor in a stage-2 graph
    anchor: bool = False              # may start a stage-2 graph
    stage1: bool = True
    doc: str = ""

    def __init__(self, **kw: Any):
        for k, v in kw.items():
            if not hasattr(type(self), k) and k not in ("name",):
                raise TypeError(f"{type(self).__name__}: unknown field {k}")
            setattr(self, k, v)

    def __repr__(self) -> str:
        return f"<op {self.name} ({self.family})>"

    # --- applicability and parameters
    def accepts(self, specs: Sequence[TensorSpec]) -> bool:
        x = specs[0]
        if x.rank not in self.ranks or x.dtype not in self.dtypes:
            return False
        if self.requires == "positive" and x.domain not in ("positive", "near_one"):
            return False
        if self.requires == "near_one" and x.domain != "near_one":
            return False
        return x.domain != "index"

    def sample(self, rng: random.Random, specs: Sequence[TensorSpec], sizes: SizeSampler) -> dict | None:
        if not self.accepts(specs):
            return None
        return {s.name: rng.choice(s.choices) for s in self.scalars}

    def infer(self, specs: Sequence[TensorSpec], params: dict) -> TensorSpec:
        return specs[0].with_(domain=self.produces)

    def node_family(self, specs: Sequence[TensorSpec], params: dict) -> str:
        return self.family

    # --- rendering
    def ctor_scalars(self, params: dict) -> list[str]:
        return [s.name for s in self.scalars if s.ctor]

    def const_name(self, param: str) -> str:
        """Base name of the module constant holding ``param`` (renamed where it would read as a size)."""
        return param

    def render(self, args: Sequence[str], params: dict, ref: Callable[[str], str]) -> str:
        fields = {s.name: ref(s.name) if s.ctor else repr(params[s.name]) for s in self.scalars}
        return self.py.format(x=args[0], y=args[1] if len(args) > 1 else "", z=args[2] if len(args) > 2 else "",
                              **fields)

    def module(self, params: dict, dim_name: Callable[[Dim], str]) -> str | None:
        """Constructor expression of the nn.Module this op owns (None: a functional op)."""
        return None

    def describe(self, params: dict) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in params.items() if not isinstance(v, (Dim, tuple)))
        return f"{self.doc or self.name}" + (f" ({extra})" if extra else "")

    # --- stage 1: the op alone on fresh inputs
    def stage1_inputs(self, rng: random.Random, sizes: SizeSampler, dtype: str, layout: str) -> list[InputSpec]:
        """forward() arguments of a single-op task (shapes in both profiles, named module constants)."""
        rank = rng.choice(self.ranks)
        shape = tensor_shape(sizes, rank)
        return [InputSpec("x", TensorSpec(shape, dtype, self.requires), layout if rank >= 2 else "contiguous")]


_RANK_NAMES = {1: ["size"], 2: ["batch_size", "dim"], 3: ["batch_size", "seq_len", "dim"],
               4: ["batch_size", "channels", "height", "width"]}


def tensor_shape(sizes: SizeSampler, rank: int) -> tuple[Dim, ...]:
    """A generic tensor of ``rank`` within the element budget (every dim at least 2)."""
    return tuple(sizes.split(_RANK_NAMES[rank], [2] * rank))


def image_shape(sizes: SizeSampler, nd: int, channels: str = "channels",
                c_range: tuple = ((3, 16), (16, 64))) -> tuple[Dim, ...]:
    """(N, C, L) or (N, C, H, W) at conv/pool sizes."""
    n = sizes.dim("batch_size", (2, 8), (8, 32))
    c = sizes.dim(channels, *c_range)
    if nd == 1:
        return (n, c, sizes.dim("length", (64, 512), (1024, 16384)))
    return (n, c, sizes.dim("height", (16, 48), (64, 224)), sizes.dim("width", (16, 48), (64, 224)))


# ------------------------------------------------------------------------------------------ elementwise

class Unary(Op):
    teacher = "elementwise"


class Binary(Op):
    """Two same-shape or broadcastable operands (the second may be a new input, a parameter or an earlier
    value). Same-shape operands are the elementwise family, broadcasting ones the broadcast family."""

    arity = 2
    teacher = "elementwise"
    requires_second: str = "real"

    def accepts(self, specs: Sequence[TensorSpec]) -> bool:
        if not super().accepts(specs[:1]):
            return False
        if len(specs) > 1:
            y = specs[1]
            if y.domain == "index" or (self.requires_second == "positive" and y.domain not in ("positive", "near_one")):
                return False
            return broadcast_shape(specs[0].shape, y.shape) is not None
        return True

    def infer(self, specs: Sequence[TensorSpec], params: dict) -> TensorSpec:
        shape = broadcast_shape(specs[0].shape, specs[1].shape)
        assert shape is not None
        return specs[0].with_(shape=shape, domain=self.produces)

    def node_family(self, specs: Sequence[TensorSpec], params: dict) -> str:
        same = len(specs[0].shape) == len(specs[1].shape) and all(
            a.same_size(b) for a, b in zip(specs[0].shape, specs[1].shape))
        return "elementwise" if same else "broadcast"

    def stage1_inputs(self, rng, sizes, dtype, layout):
        rank = rng.choice((2, 3, 4))
        shape = tensor_shape(sizes, rank)
        x = InputSpec("x", TensorSpec(shape, dtype, self.requires), layout)
        mode = rng.choice(("same", "same", "row", "col", "channel" if rank >= 3 else "row"))
        one = Dim(1, 1)
        y_shape = {"same": shape, "row": shape[-1:], "col": (shape[0],) + (one,) * (rank - 1),
                   "channel": (shape[1],) + (one,) * (rank - 2)}[mode]
        y_layout = layout if mode == "same" else "contiguous"
        return [x, InputSpec("y", TensorSpec(y_shape, dtype, self.requires_second), y_layout)]


def broadcast_shape(a: Sequence[Dim], b: Sequence[Dim]) -> tuple[Dim, ...] | None:
    """numpy broadcasting of two Dim shapes, in both profiles; None when incompatible. The result never
    grows ``a``: the generator only broadcasts the second operand into the first."""
    if len(b) > len(a):
        return None
    out = list(a)
    for i in range(1, len(b) + 1):
        x, y = a[-i], b[-i]
        if y.cpu == 1 and y.gpu == 1:
            continue
        if not x.same_size(y):
            return None
    return tuple(out)


_UNARY = [
    dict(name="relu", py="torch.relu({x})", cpp="v > 0.f ? v : 0.f", doc="ReLU"),
    dict(name="leaky_relu", py="F.leaky_relu({x}, negative_slope={negative_slope})",
         scalars=(Scalar("negative_slope", (0.01, 0.05, 0.1, 0.2)),), cpp="v > 0.f ? v : v * negative_slope",
         doc="LeakyReLU"),
    dict(name="sigmoid", py="torch.sigmoid({x})", cpp="1.f / (1.f + std::exp(-v))", produces="positive",
         doc="Sigmoid"),
    dict(name="tanh", py="torch.tanh({x})", cpp="std::tanh(v)", doc="Tanh"),
    dict(name="gelu", py="F.gelu({x})", cpp="0.5f * v * (1.f + std::erf(v * 0.70710678118654752f))",
         doc="GELU (exact, erf form)"),
    dict(name="gelu_tanh", py="F.gelu({x}, approximate='tanh')",
         cpp="0.5f * v * (1.f + std::tanh(0.79788456080286535f * (v + 0.044715f * v * v * v)))",
         doc="GELU (tanh approximation)"),
    dict(name="silu", py="F.silu({x})", cpp="v / (1.f + std::exp(-v))", doc="SiLU / Swish"),
    dict(name="softplus", py="F.softplus({x}, beta={beta}, threshold=20.0)",
         scalars=(Scalar("beta", (1.0, 2.0, 0.5)),),
         cpp="(v * beta > 20.f) ? v : std::log1p(std::exp(v * beta)) / beta", produces="positive", doc="Softplus"),
    dict(name="elu", py="F.elu({x}, alpha={alpha})", scalars=(Scalar("alpha", (0.5, 1.0, 1.5)),),
         cpp="v > 0.f ? v : alpha * std::expm1(v)", doc="ELU"),
    dict(name="selu", py="torch.selu({x})",
         cpp="1.0507009873554805f * (v > 0.f ? v : 1.6732632423543772f * std::expm1(v))", doc="SELU"),
    dict(name="celu", py="F.celu({x}, alpha={alpha})", scalars=(Scalar("alpha", (0.5, 1.0, 2.0)),),
         cpp="v > 0.f ? v : alpha * std::expm1(v / alpha)", doc="CELU"),
    dict(name="hardtanh", py="F.hardtanh({x}, min_val={min_val}, max_val={max_val})",
         scalars=(Scalar("min_val", (-1.0, -2.0, -0.5)), Scalar("max_val", (1.0, 2.0, 0.5))),
         cpp="std::min(std::max(v, min_val), max_val)", doc="HardTanh"),
    dict(name="hardsigmoid", py="F.hardsigmoid({x})", cpp="std::min(std::max(v + 3.f, 0.f), 6.f) / 6.f",
         doc="HardSigmoid"),
    dict(name="hardswish", py="F.hardswish({x})", cpp="v * std::min(std::max(v + 3.f, 0.f), 6.f) / 6.f",
         doc="HardSwish"),
    dict(name="mish", py="F.mish({x})",
         cpp="v * std::tanh(v > 20.f ? v : std::log1p(std::exp(v)))", doc="Mish"),
    dict(name="relu6", py="F.relu6({x})", cpp="std::min(std::max(v, 0.f), 6.f)", doc="ReLU6"),
    dict(name="softsign", py="F.softsign({x})", cpp="v / (1.f + std::fabs(v))", doc="Softsign"),
    dict(name="tanhshrink", py="F.tanhshrink({x})", cpp="v - std::tanh(v)", doc="Tanhshrink"),
    dict(name="logsigmoid", py="F.logsigmoid({x})",
         cpp="v < 0.f ? v - std::log1p(std::exp(v)) : -std::log1p(std::exp(-v))", doc="LogSigmoid"),
    dict(name="hardshrink", py="F.hardshrink({x}, lambd={lambd})", scalars=(Scalar("lambd", (0.5, 0.25, 1.0)),),
         cpp="(v > lambd || v < -lambd) ? v : 0.f", doc="Hardshrink"),
    dict(name="softshrink", py="F.softshrink({x}, lambd={lambd})", scalars=(Scalar("lambd", (0.5, 0.25, 1.0)),),
         cpp="v > lambd ? v - lambd : (v < -lambd ? v + lambd : 0.f)", doc="Softshrink"),
    dict(name="abs", py="torch.abs({x})", cpp="std::fabs(v)", doc="absolute value"),
    dict(name="neg", py="torch.neg({x})", cpp="-v", doc="negation"),
    dict(name="exp", py="torch.exp({x})", cpp="std::exp(v)", produces="positive", doc="exponential"),
    dict(name="log", py="torch.log({x})", cpp="std::log(v)", requires="positive", doc="natural logarithm"),
    dict(name="sqrt", py="torch.sqrt({x})", cpp="std::sqrt(v)", requires="positive", produces="positive",
         doc="square root"),
    dict(name="rsqrt", py="torch.rsqrt({x})", cpp="1.f / std::sqrt(v)", requires="positive", produces="positive",
         doc="reciprocal square root"),
    dict(name="reciprocal", py="torch.reciprocal({x})", cpp="1.f / v", requires="positive", produces="positive",
         doc="reciprocal"),
    dict(name="square", py="torch.square({x})", cpp="v * v", doc="square"),
    dict(name="sin", py="torch.sin({x})", cpp="std::sin(v)", doc="sine"),
    dict(name="cos", py="torch.cos({x})", cpp="std::cos(v)", doc="cosine"),
    dict(name="erf", py="torch.erf({x})", cpp="std::erf(v)", doc="error function"),
    dict(name="clamp", py="torch.clamp({x}, min={clamp_min}, max={clamp_max})",
         scalars=(Scalar("clamp_min", (-0.5, -1.0, 0.0)), Scalar("clamp_max", (0.5, 1.0, 2.0))),
         cpp="std::min(std::max(v, clamp_min), clamp_max)", doc="clamp"),
    dict(name="scale", py="{x} * {scale_factor}", scalars=(Scalar("scale_factor", (0.5, 2.0, 1.5, 0.125, 3.0)),),
         cpp="v * scale_factor", doc="multiplication by a scalar"),
    dict(name="shift", py="{x} + {shift}", scalars=(Scalar("shift", (0.5, -1.0, 1.0, 0.25)),),
         cpp="v + shift", doc="addition of a scalar"),
    dict(name="pow_scalar", py="torch.pow({x}, {exponent})", scalars=(Scalar("exponent", (2.0, 3.0, 0.5, 1.5)),),
         cpp="std::pow(v, exponent)", requires="positive", produces="positive", doc="power by a scalar"),
]

_BINARY = [
    dict(name="add", py="{x} + {y}", cpp="a + b", doc="addition"),
    dict(name="sub", py="{x} - {y}", cpp="a - b", doc="subtraction"),
    dict(name="mul", py="{x} * {y}", cpp="a * b", doc="multiplication"),
    dict(name="div", py="{x} / {y}", cpp="a / b", requires_second="positive", doc="division"),
    dict(name="maximum", py="torch.maximum({x}, {y})", cpp="std::max(a, b)", doc="elementwise maximum"),
    dict(name="minimum", py="torch.minimum({x}, {y})", cpp="std::min(a, b)", doc="elementwise minimum"),
]


# ------------------------------------------------------------------------------------------ reductions

class DimOp(Op):
    """An op along one dimension (``dim`` is drawn among the input's dims, stored as given: 1 or -1)."""

    ranks = (2, 3, 4)
    keepdim: bool | None = None       # None: drawn; True/False fixed; reductions only
    reduces = True
    out_dtype: str | None = None
    max_extent: int | None = None     # cap on the reduced size (cumprod/prod stay finite)

    def sample(self, rng, specs, sizes):
        if not self.accepts(specs):
            return None
        x = specs[0]
        dims = [d for d in range(x.rank) if x.shape[d].cpu > 1 and x.shape[d].gpu > 1
                and (self.max_extent is None or x.shape[d].gpu <= self.max_extent)]
        if not dims:
            return None
        d = rng.choice(dims)
        p = {"dim": d if rng.random() < 0.7 or d == 0 else d - x.rank}
        if self.reduces:
            p["keepdim"] = rng.random() < 0.4 if self.keepdim is None else self.keepdim
        p.update({s.name: rng.choice(s.choices) for s in self.scalars})
        return p

    def infer(self, specs, params):
        x = specs[0]
        if not self.reduces:
            return x.with_(domain=self.produces)
        d = params["dim"] % x.rank
        shape = list(x.shape)
        if params["keepdim"]:
            shape[d] = Dim(1, 1)
        else:
            del shape[d]
        return TensorSpec(tuple(shape), self.out_dtype or x.dtype, self.produces)

    def accepts(self, specs):
        return super().accepts(specs) and specs[0].rank >= 2

    def render(self, args, params, ref):
        p = dict(params)
        kd = f", keepdim={p['keepdim']}" if self.reduces else ""
        return self.py.format(x=args[0], dim=ref("dim"), kd=kd)

    def ctor_scalars(self, params):
        return ["dim"]

    def const_name(self, param):
        return self.dim_const if param == "dim" else param

    dim_const = "reduce_dim"


class Reduce(DimOp):
    family = "reduction"
    teacher = "reduce"


class Softmax(DimOp):
    family = "softmax"
    teacher = "softmax"
    reduces = False
    dim_const = "softmax_dim"


class Scan(DimOp):
    family = "scan"
    teacher = "scan"
    reduces = False
    dim_const = "scan_dim"


_REDUCE = [
    dict(name="sum", py="torch.sum({x}, dim={dim}{kd})", doc="sum over a dimension"),
    dict(name="mean", py="torch.mean({x}, dim={dim}{kd})", doc="mean over a dimension"),
    dict(name="amax", py="torch.amax({x}, dim={dim}{kd})", doc="maximum over a dimension"),
    dict(name="amin", py="torch.amin({x}, dim={dim}{kd})", doc="minimum over a dimension"),
    dict(name="prod", py="torch.prod({x}, dim={dim}{kd})", requires="near_one", max_extent=512,
         doc="product over a dimension"),
    dict(name="argmax", py="torch.argmax({x}, dim={dim}{kd})", out_dtype="int64", epilogue=False,
         doc="argmax over a dimension"),
    dict(name="argmin", py="torch.argmin({x}, dim={dim}{kd})", out_dtype="int64", epilogue=False,
         doc="argmin over a dimension"),
    dict(name="var", py="torch.var({x}, dim={dim}{kd})", produces="positive", doc="unbiased variance"),
    dict(name="std", py="torch.std({x}, dim={dim}{kd})", produces="positive", doc="unbiased standard deviation"),
    dict(name="logsumexp", py="torch.logsumexp({x}, dim={dim}{kd})", doc="log-sum-exp over a dimension"),
    dict(name="l2norm", py="torch.linalg.vector_norm({x}, ord=2, dim={dim}{kd})", produces="positive",
         doc="L2 norm over a dimension"),
]
_SOFTMAX = [
    dict(name="softmax", py="torch.softmax({x}, dim={dim})", produces="positive", doc="softmax"),
    dict(name="log_softmax", py="torch.log_softmax({x}, dim={dim})", doc="log-softmax"),
]
_SCAN = [
    dict(name="cumsum", py="torch.cumsum({x}, dim={dim})", doc="cumulative sum"),
    dict(name="cumprod", py="torch.cumprod({x}, dim={dim})", requires="near_one", max_extent=512,
         doc="cumulative product"),
    dict(name="logcumsumexp", py="torch.logcumsumexp({x}, dim={dim})", doc="log-cumulative-sum-exp"),
]


# ------------------------------------------------------------------------------------------ normalization

class LastDimNorm(Op):
    """LayerNorm / RMSNorm over the last dimension, with the module's affine weights."""

    family = "normalization"
    ranks = (2, 3, 4)
    teacher = "norm"
    cls = "nn.LayerNorm"

    def sample(self, rng, specs, sizes):
        if not self.accepts(specs) or specs[0].shape[-1].name is None:
            return None
        return {"normalized": specs[0].shape[-1], "eps": rng.choice((1e-5, 1e-6))}

    def module(self, params, dim_name):
        return f"{self.cls}({dim_name(params['normalized'])}, eps={params['eps']!r})"


class L2Normalize(DimOp):
    family = "normalization"
    teacher = "softmax"               # same one-pass-per-row structure as softmax
    reduces = False
    py = "F.normalize({x}, p=2.0, dim={dim})"
    doc = "L2 normalization along a dimension"
    dim_const = "norm_dim"


class ChannelNorm(Op):
    """BatchNorm (training mode: batch statistics, as KernelBench never calls .eval()), GroupNorm, InstanceNorm
    over dim 1 of an (N, C, ...) tensor."""

    family = "normalization"
    ranks = (3, 4)
    kind = "batch"

    def sample(self, rng, specs, sizes):
        if not self.accepts(specs) or specs[0].shape[1].name is None:
            return None
        c = specs[0].shape[1]
        p: dict[str, Any] = {"channels": c}
        if self.kind == "group":
            groups = [g for g in (2, 4, 8, 16) if c.cpu % g == 0 and c.gpu % g == 0 and g < c.cpu]
            if not groups:
                return None
            p["num_groups"] = rng.choice(groups)
        if self.kind == "instance" and specs[0].rank != 4:
            return None
        return p

    def stage1_inputs(self, rng, sizes, dtype, layout):
        rank = rng.choice(self.ranks)
        return [InputSpec("x", TensorSpec(image_shape(sizes, rank - 2), dtype), layout)]

    def module(self, params, dim_name):
        c = dim_name(params["channels"])
        if self.kind == "group":
            return f"nn.GroupNorm({params['num_groups']}, {c})"
        if self.kind == "instance":
            return f"nn.InstanceNorm2d({c})"
        return f"nn.BatchNorm{'2d' if self._rank == 4 else '1d'}({c})"

    _rank = 4


class BatchNorm1d(ChannelNorm):
    kind = "batch"
    ranks = (3,)
    _rank = 3


class BatchNorm2d(ChannelNorm):
    kind = "batch"
    ranks = (4,)
    _rank = 4


# ------------------------------------------------------------------------------------------ GEMM

class Linear(Op):
    family = "gemm"
    ranks = (2, 3)
    teacher = "linear"
    anchor = True
    epilogue = False
    py = "{x}"                        # rendered through the module

    def sample(self, rng, specs, sizes):
        if not self.accepts(specs) or specs[0].shape[-1].name is None:
            return None
        return {"in_features": specs[0].shape[-1],
                "out_features": sizes.dim("out_features", (32, 256), (512, 4096)),
                "bias": rng.random() < 0.85}

    def infer(self, specs, params):
        return specs[0].with_(shape=specs[0].shape[:-1] + (params["out_features"],), domain="real")

    def stage1_inputs(self, rng, sizes, dtype, layout):
        shape = [sizes.dim("batch_size", (8, 64), (256, 2048))]
        if rng.random() < 0.3:
            shape.append(sizes.dim("seq_len", (4, 16), (16, 128)))
        shape.append(sizes.dim("in_features", (32, 256), (512, 4096)))
        return [InputSpec("x", TensorSpec(tuple(shape), dtype), layout)]

    def module(self, params, dim_name):
        bias = "" if params["bias"] else ", bias=False"
        return f"nn.Linear({dim_name(params['in_features'])}, {dim_name(params['out_features'])}{bias})"


class Matmul(Op):
    """Two-input products: (M,K)@(K,N), (B,M,K)@(B,K,N), and a right operand given transposed ((N,K), used
    as ``y.T``)."""

    family = "gemm"
    arity = 2
    ranks = (2, 3)
    teacher = "matmul"
    anchor = True
    epilogue = False
    transpose_b = False

    def accepts(self, specs):
        if not super().accepts(specs[:1]):
            return False
        if len(specs) < 2:
            return True
        a, b = specs[0], specs[1]
        if a.rank != b.rank or b.dtype != a.dtype:
            return False
        k_b = b.shape[-1] if self.transpose_b else b.shape[-2]
        if not a.shape[-1].same_size(k_b):
            return False
        return a.rank == 2 or a.shape[0].same_size(b.shape[0])

    def infer(self, specs, params):
        a, b = specs
        n = b.shape[-2] if self.transpose_b else b.shape[-1]
        return a.with_(shape=a.shape[:-1] + (n,), domain="real")

    def stage1_inputs(self, rng, sizes, dtype, layout):
        batched = rng.random() < 0.3
        lead = (sizes.dim("batch_size", (2, 8), (8, 64)),) if batched else ()
        hi = (256, 2048) if batched else (512, 4096)
        m, k, n = (sizes.dim(c, (32, 192), hi) for c in ("M", "K", "N"))
        b = (n, k) if self.transpose_b else (k, n)
        return [InputSpec("A", TensorSpec(lead + (m, k), dtype), layout),
                InputSpec("B", TensorSpec(lead + b, dtype), "contiguous")]

    def render(self, args, params, ref):
        x, y = args[0], args[1]
        if self.transpose_b:
            return f"torch.matmul({x}, {y}.transpose(-2, -1))"
        return f"torch.matmul({x}, {y})"


# ------------------------------------------------------------------------------------------ conv / pooling

def _conv_out(size: int, k: int, s: int, p: int, d: int = 1) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


class Conv(Op):
    family = "conv"
    anchor = True
    epilogue = False
    dtypes = F32
    nd = 2
    transposed = False
    depthwise = False

    @property
    def ranks(self):  # type: ignore[override]
        return (self.nd + 2,)

    def sample(self, rng, specs, sizes):
        if not self.accepts(specs) or specs[0].shape[1].name is None:
            return None
        x = specs[0]
        c_in = x.shape[1]
        if self.transposed:
            k, s, p = rng.choice((2, 3, 4)), rng.choice((1, 2)), rng.choice((0, 1))
        else:
            k = rng.choice((1, 3, 3, 5)) if self.nd == 2 else rng.choice((3, 5, 7))
            s = rng.choice((1, 1, 2))
            p = rng.choice((0, k // 2))
        d = 1 if self.transposed or k == 1 else rng.choice((1, 1, 2))
        if self.depthwise:
            c_out = Dim(c_in.cpu * 2, c_in.gpu * 2, sizes.names.take("out_channels")) if rng.random() < 0.3 else None
            groups = "channels"
        else:
            c_out = sizes.dim("out_channels", (8, 32), (32, 256))
            groups = 1
        spatial = x.shape[2:]
        for sp in spatial:
            for v in (sp.cpu, sp.gpu):
                out = (v - 1) * s - 2 * p + k if self.transposed else _conv_out(v, k, s, p, d)
                if out < 2:
                    return None
        return {"in_channels": c_in, "out_channels": c_out or c_in, "kernel_size": k, "stride": s, "padding": p,
                "dilation": d, "groups": groups, "bias": rng.random() < 0.7}

    def infer(self, specs, params):
        x = specs[0]
        k, s, p, d = params["kernel_size"], params["stride"], params["padding"], params["dilation"]
        if self.transposed:
            sp = tuple(dm.map(lambda v: (v - 1) * s - 2 * p + k) for dm in x.shape[2:])
        else:
            sp = tuple(dm.map(lambda v: _conv_out(v, k, s, p, d)) for dm in x.shape[2:])
        return x.with_(shape=(x.shape[0], params["out_channels"]) + sp, domain="real")

    def module(self, params, dim_name):
        cls = f"nn.Conv{'Transpose' if self.transposed else ''}{self.nd}d"
        extra = []
        if params["stride"] != 1:
            extra.append(f"stride={params['stride']}")
        if params["padding"]:
            extra.append(f"padding={params['padding']}")
        if params["dilation"] != 1:
            extra.append(f"dilation={params['dilation']}")
        if params["groups"] == "channels":
            extra.append(f"groups={dim_name(params['in_channels'])}")
        if not params["bias"]:
            extra.append("bias=False")
        tail = "".join(", " + e for e in extra)
        return (f"{cls}({dim_name(params['in_channels'])}, {dim_name(params['out_channels'])}, "
                f"{params['kernel_size']}{tail})")

    def stage1_inputs(self, rng, sizes, dtype, layout):
        c_range = ((8, 32), (32, 128)) if self.depthwise else ((3, 16), (16, 64))
        return [InputSpec("x", TensorSpec(image_shape(sizes, self.nd, "in_channels", c_range), dtype), layout)]

    def describe(self, params):
        return (f"{'transposed ' if self.transposed else ''}{'depthwise ' if self.depthwise else ''}{self.nd}D "
                f"convolution (kernel {params['kernel_size']}, stride {params['stride']}, padding "
                f"{params['padding']}, dilation {params['dilation']})")


class Pool(Op):
    family = "pooling"
    dtypes = F32
    nd = 2
    kind = "max"                      # max | avg | adaptive_avg
    py = ""

    @property
    def ranks(self):  # type: ignore[override]
        return (self.nd + 2,)

    def sample(self, rng, specs, sizes):
        if not self.accepts(specs):
            return None
        x = specs[0]
        if self.kind == "adaptive_avg":
            o = rng.choice((1, 2, 4))
            if any(min(d.cpu, d.gpu) < o for d in x.shape[2:]):
                return None
            return {"output_size": o}
        k = rng.choice((2, 3))
        s = rng.choice((k, 1, 2))
        p = rng.choice((0, 1)) if k == 3 else 0
        for dm in x.shape[2:]:
            if min(dm.cpu, dm.gpu) < k + 1 or _conv_out(min(dm.cpu, dm.gpu), k, s, p) < 1:
                return None
        return {"kernel_size": k, "stride": s, "padding": p}

    def infer(self, specs, params):
        x = specs[0]
        if self.kind == "adaptive_avg":
            o = params["output_size"]
            return x.with_(shape=x.shape[:2] + tuple(Dim(o, o) for _ in x.shape[2:]))
        k, s, p = params["kernel_size"], params["stride"], params["padding"]
        return x.with_(shape=x.shape[:2] + tuple(dm.map(lambda v: _conv_out(v, k, s, p)) for dm in x.shape[2:]))

    def stage1_inputs(self, rng, sizes, dtype, layout):
        return [InputSpec("x", TensorSpec(image_shape(sizes, self.nd, c_range=((4, 32), (32, 128))), dtype), layout)]

    def render(self, args, params, ref):
        if self.kind == "adaptive_avg":
            return f"F.adaptive_avg_pool{self.nd}d({args[0]}, {params['output_size']})"
        return (f"F.{self.kind}_pool{self.nd}d({args[0]}, kernel_size={params['kernel_size']}, "
                f"stride={params['stride']}, padding={params['padding']})")


# ------------------------------------------------------------------------------------------ indexing

class Gather(Op):
    """torch.gather along dim 1 of (B, D) with (B, K) indices below D."""

    family = "indexing"
    arity = 2
    ranks = (2,)
    epilogue = False

    def accepts(self, specs):
        return super().accepts(specs[:1]) and (len(specs) < 2 or specs[1].domain == "index")

    def sample(self, rng, specs, sizes):
        ok = self.accepts(specs) and specs[1].high is not None and specs[1].high.same_size(specs[0].shape[1])
        return {} if ok else None

    def infer(self, specs, params):
        return specs[0].with_(shape=specs[1].shape)

    def stage1_inputs(self, rng, sizes, dtype, layout):
        b = sizes.dim("batch_size", (16, 128), (1024, 8192))
        d = sizes.dim("dim", (256, 2048), (4096, 32768))
        k = sizes.dim("num_indices", (16, 256), (512, 4096))
        return [InputSpec("x", TensorSpec((b, d), dtype), layout),
                InputSpec("index", TensorSpec((b, k), "int64", "index", high=d))]

    def render(self, args, params, ref):
        return f"torch.gather({args[0]}, 1, {args[1]})"


class IndexSelect(Op):
    family = "indexing"
    arity = 2
    ranks = (2, 3)
    epilogue = False

    def accepts(self, specs):
        return super().accepts(specs[:1]) and (len(specs) < 2 or specs[1].domain == "index")

    def sample(self, rng, specs, sizes):
        ok = self.accepts(specs) and specs[1].high is not None and specs[1].high.same_size(specs[0].shape[0])
        return {"dim": 0} if ok else None

    def infer(self, specs, params):
        x = specs[0]
        shape = list(x.shape)
        shape[params["dim"]] = specs[1].shape[0]
        return x.with_(shape=tuple(shape))

    def stage1_inputs(self, rng, sizes, dtype, layout):
        rows = sizes.dim("num_rows", (256, 4096), (16384, 131072))
        d = sizes.dim("dim", (32, 256), (256, 2048))
        k = sizes.dim("num_indices", (64, 1024), (4096, 65536))
        return [InputSpec("x", TensorSpec((rows, d), dtype), layout),
                InputSpec("indices", TensorSpec((k,), "int64", "index", high=rows))]

    def render(self, args, params, ref):
        return f"torch.index_select({args[0]}, {params['dim']}, {args[1]})"


class Embedding(Op):
    family = "indexing"
    ranks = (1, 2)
    epilogue = False
    py = "{x}"

    def accepts(self, specs):
        return specs[0].domain == "index" and specs[0].rank in self.ranks and specs[0].high is not None

    def sample(self, rng, specs, sizes):
        if not self.accepts(specs):
            return None
        return {"num_embeddings": specs[0].high, "embedding_dim": sizes.dim("embedding_dim", (32, 128), (256, 1024))}

    def infer(self, specs, params):
        return TensorSpec(specs[0].shape + (params["embedding_dim"],), "float32", "real")

    def stage1_inputs(self, rng, sizes, dtype, layout):
        vocab = sizes.dim("num_embeddings", (500, 5000), (32000, 100000))
        shape = (sizes.dim("batch_size", (4, 16), (8, 32)), sizes.dim("seq_len", (16, 128), (256, 1024)))
        return [InputSpec("ids", TensorSpec(shape, "int64", "index", high=vocab))]

    def module(self, params, dim_name):
        return f"nn.Embedding({dim_name(params['num_embeddings'])}, {dim_name(params['embedding_dim'])})"


# ------------------------------------------------------------------------------------------ attention / loss / layout

class Attention(Op):
    """F.scaled_dot_product_attention on (B, H, S, D) query/key/value."""

    family = "attention"
    arity = 3
    ranks = (4,)
    dtypes = F32
    epilogue = False

    def accepts(self, specs):
        return super().accepts(specs[:1])

    def sample(self, rng, specs, sizes):
        return {"causal": rng.random() < 0.4} if self.accepts(specs) else None

    def infer(self, specs, params):
        return specs[0].with_(shape=specs[0].shape[:3] + (specs[2].shape[3],))

    def stage1_inputs(self, rng, sizes, dtype, layout):
        b = sizes.dim("batch_size", (1, 4), (4, 16))
        h = sizes.dim("num_heads", (2, 8), (8, 32))
        s_ = sizes.dim("seq_len", (32, 128), (512, 2048))
        d = Dim(rng.choice((16, 32, 64)), rng.choice((64, 128)), sizes.names.take("head_dim"))
        return [InputSpec(n, TensorSpec((b, h, s_, d), dtype)) for n in ("q", "k", "v")]

    def render(self, args, params, ref):
        causal = ", is_causal=True" if params.get("causal") else ""
        return f"F.scaled_dot_product_attention({args[0]}, {args[1]}, {args[2]}{causal})"


class Loss(Op):
    """Reductions of two same-shape operands to a scalar (mean reduction)."""

    family = "loss"
    arity = 2
    ranks = (2, 3)
    dtypes = F32
    epilogue = False
    teacher = "loss"

    def accepts(self, specs):
        if not super().accepts(specs[:1]):
            return False
        return len(specs) < 2 or (specs[1].rank == specs[0].rank
                                  and all(a.same_size(b) for a, b in zip(specs[0].shape, specs[1].shape)))

    def infer(self, specs, params):
        return TensorSpec((), specs[0].dtype, "positive")

    def stage1_inputs(self, rng, sizes, dtype, layout):
        shape = tensor_shape(sizes, rng.choice(self.ranks))
        return [InputSpec("predictions", TensorSpec(shape, dtype)), InputSpec("targets", TensorSpec(shape, dtype))]


class CrossEntropy(Op):
    family = "loss"
    arity = 2
    ranks = (2,)
    dtypes = F32
    epilogue = False

    def accepts(self, specs):
        return super().accepts(specs[:1]) and (len(specs) < 2 or specs[1].domain == "index")

    def infer(self, specs, params):
        return TensorSpec((), specs[0].dtype, "positive")

    def sample(self, rng, specs, sizes):
        return {} if self.accepts(specs) else None

    def stage1_inputs(self, rng, sizes, dtype, layout):
        b = sizes.dim("batch_size", (32, 512), (1024, 8192))
        c = sizes.dim("num_classes", (10, 1000), (1000, 32000))
        return [InputSpec("logits", TensorSpec((b, c), dtype)),
                InputSpec("targets", TensorSpec((b,), "int64", "index", high=c))]

    def render(self, args, params, ref):
        return f"F.cross_entropy({args[0]}, {args[1]})"


class Flip(DimOp):
    """torch.flip along one dimension (the dim is a literal, not a constructor argument)."""

    family = "layout"
    reduces = False
    epilogue = False
    py = "torch.flip({x}, dims=[{dim}])"

    def ctor_scalars(self, params):
        return []

    def render(self, args, params, ref):
        return self.py.format(x=args[0], dim=params["dim"])


class Transpose(Op):
    family = "layout"
    ranks = (2, 3, 4)
    epilogue = False

    def sample(self, rng, specs, sizes):
        if not self.accepts(specs):
            return None
        r = specs[0].rank
        a, b = sorted(rng.sample(range(r), 2))
        return {"dim0": a, "dim1": b}

    def infer(self, specs, params):
        shape = list(specs[0].shape)
        a, b = params["dim0"], params["dim1"]
        shape[a], shape[b] = shape[b], shape[a]
        return specs[0].with_(shape=tuple(shape))

    def render(self, args, params, ref):
        return f"{args[0]}.transpose({params['dim0']}, {params['dim1']}).contiguous()"


class Cat(Op):
    family = "layout"
    arity = 2
    ranks = (2, 3)
    epilogue = False

    def accepts(self, specs):
        if not super().accepts(specs[:1]):
            return False
        if len(specs) < 2:
            return True
        a, b = specs
        return a.rank == b.rank and b.dtype == a.dtype

    def sample(self, rng, specs, sizes):
        if not self.accepts(specs) or len(specs) < 2:
            return None
        a, b = specs
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if not x.same_size(y)]
        if len(diff) > 1:
            return None
        return {"dim": diff[0] if diff else rng.randrange(a.rank)}

    def stage1_inputs(self, rng, sizes, dtype, layout):
        rank = rng.choice(self.ranks)
        shape = list(tensor_shape(sizes, rank))
        d = rng.randrange(rank)
        other = list(shape)
        other[d] = Dim(max(2, shape[d].cpu // 2 + 1), max(2, shape[d].gpu // 2 + 3), sizes.names.take("dim_other"))
        return [InputSpec("x", TensorSpec(tuple(shape), dtype), layout),
                InputSpec("y", TensorSpec(tuple(other), dtype))]

    def infer(self, specs, params):
        a, b = specs
        d = params["dim"]
        shape = list(a.shape)
        shape[d] = Dim(a.shape[d].cpu + b.shape[d].cpu, a.shape[d].gpu + b.shape[d].gpu)
        return a.with_(shape=tuple(shape))

    def render(self, args, params, ref):
        return f"torch.cat([{args[0]}, {args[1]}], dim={params['dim']})"


# ------------------------------------------------------------------------------------------ the registry

def _build() -> dict[str, Op]:
    ops: dict[str, Op] = {}

    def add(op: Op) -> None:
        if op.name in ops:
            raise ValueError(f"duplicate op {op.name}")
        if op.family not in FAMILIES:
            raise ValueError(f"op {op.name}: unknown family {op.family}")
        ops[op.name] = op

    for d in _UNARY:
        add(Unary(**d))
    for d in _BINARY:
        add(Binary(**d))
    for d in _REDUCE:
        add(Reduce(**d))
    for d in _SOFTMAX:
        add(Softmax(**d))
    for d in _SCAN:
        add(Scan(**d))
    add(LastDimNorm(name="layer_norm", cls="nn.LayerNorm", doc="LayerNorm over the last dimension"))
    add(LastDimNorm(name="rms_norm", cls="nn.RMSNorm", doc="RMSNorm over the last dimension"))
    add(L2Normalize(name="l2_normalize"))
    add(BatchNorm1d(name="batch_norm1d", doc="BatchNorm1d in training mode (batch statistics)", epilogue=False))
    add(BatchNorm2d(name="batch_norm2d", doc="BatchNorm2d in training mode (batch statistics)"))
    add(ChannelNorm(name="group_norm", kind="group", doc="GroupNorm"))
    add(ChannelNorm(name="instance_norm", kind="instance", ranks=(4,), doc="InstanceNorm2d"))
    add(Linear(name="linear", doc="fully connected layer (nn.Linear)"))
    add(Matmul(name="matmul", doc="matrix multiplication"))
    add(Matmul(name="matmul_tb", transpose_b=True, doc="matrix multiplication with a transposed right operand"))
    add(Conv(name="conv2d", nd=2, teacher=None, doc="2D convolution"))
    add(Conv(name="conv1d", nd=1, doc="1D convolution"))
    add(Conv(name="conv2d_depthwise", nd=2, depthwise=True, doc="depthwise 2D convolution"))
    add(Conv(name="conv_transpose2d", nd=2, transposed=True, doc="transposed 2D convolution"))
    add(Pool(name="max_pool2d", nd=2, kind="max", doc="2D max pooling"))
    add(Pool(name="avg_pool2d", nd=2, kind="avg", doc="2D average pooling"))
    add(Pool(name="adaptive_avg_pool2d", nd=2, kind="adaptive_avg", doc="2D adaptive average pooling"))
    add(Pool(name="max_pool1d", nd=1, kind="max", doc="1D max pooling"))
    add(Pool(name="avg_pool1d", nd=1, kind="avg", doc="1D average pooling"))
    add(Gather(name="gather", doc="gather along dim 1"))
    add(IndexSelect(name="index_select", doc="index_select"))
    add(Embedding(name="embedding", doc="embedding lookup"))
    add(Attention(name="sdpa", doc="scaled dot-product attention"))
    for name, py, doc in (("mse_loss", "F.mse_loss({x}, {y})", "mean squared error"),
                          ("l1_loss", "F.l1_loss({x}, {y})", "mean absolute error"),
                          ("smooth_l1_loss", "F.smooth_l1_loss({x}, {y}, beta=1.0)", "smooth L1 loss"),
                          ("huber_loss", "F.huber_loss({x}, {y}, delta=1.0)", "Huber loss"),
                          ("kl_div_loss", "F.kl_div(torch.log_softmax({x}, dim=-1), torch.softmax({y}, dim=-1), "
                                          "reduction='batchmean')", "KL divergence of two softmax distributions"),
                          ("cosine_loss", "torch.mean(1 - F.cosine_similarity({x}, {y}, dim=-1))",
                           "cosine-similarity loss")):
        add(Loss(name=name, py=py, doc=doc, teacher="loss" if name in ("mse_loss", "l1_loss", "smooth_l1_loss",
                                                                         "huber_loss") else None))
    add(CrossEntropy(name="cross_entropy", doc="cross-entropy over class logits"))
    add(Transpose(name="transpose", doc="transpose to a contiguous copy"))
    add(Flip(name="flip", doc="flip along a dimension"))
    add(Cat(name="cat", doc="concatenation"))
    return ops


REGISTRY: dict[str, Op] = _build()


def get_op(name: str) -> Op:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


def ops_in(family: str) -> list[Op]:
    return [op for op in REGISTRY.values() if op.family == family]


def family_ops() -> dict[str, list[str]]:
    return {f: [op.name for op in ops_in(f)] for f in FAMILIES}
