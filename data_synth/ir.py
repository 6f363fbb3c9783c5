"""The task IR: a small dataflow graph of registry ops over tensors whose sizes exist in two profiles.

A task is generated once and rendered twice in effect: its module constants carry the ``cpu`` sizes
(milliseconds on a CPU, what tests and the CPU recipe run) and its manifest entry the ``gpu`` sizes
(``verifier.size_profiles`` rewrites the constants). So every size is a :class:`Dim` holding both values,
and shape inference and op constraints are checked in both profiles at once.

The graph is kept in the manifest next to the rendered source, so later stages (the offline teacher,
diagnosis) read the structure instead of re-parsing Python.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

PROFILES = ("cpu", "gpu")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
DOMAINS = ("real", "positive", "near_one", "index")


@dataclasses.dataclass(frozen=True)
class Dim:
    """One size in both profiles; ``name`` is its module constant (None for a derived size)."""

    cpu: int
    gpu: int
    name: str | None = None

    def value(self, profile: str) -> int:
        return self.cpu if profile == "cpu" else self.gpu

    def map(self, fn: Callable[[int], int]) -> "Dim":
        return Dim(fn(self.cpu), fn(self.gpu))

    def same_size(self, other: "Dim") -> bool:
        return self.cpu == other.cpu and self.gpu == other.gpu

    def to_json(self) -> list:
        return [self.cpu, self.gpu, self.name]

    @classmethod
    def from_json(cls, v: Any) -> "Dim":
        return cls(int(v[0]), int(v[1]), v[2])


ONE = Dim(1, 1)


def numel(shape: Iterable[Dim], profile: str) -> int:
    n = 1
    for d in shape:
        n *= d.value(profile)
    return n


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[Dim, ...]
    dtype: str = "float32"            # float32 | float16 | bfloat16 | int64 | bool
    domain: str = "real"              # real | positive | near_one | index (what values it holds)
    high: Dim | None = None           # index values lie in [0, high)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def sizes(self, profile: str) -> tuple[int, ...]:
        return tuple(d.value(profile) for d in self.shape)

    def with_(self, **kw) -> "TensorSpec":
        return dataclasses.replace(self, **kw)

    def to_json(self) -> dict:
        return {"shape": [d.to_json() for d in self.shape], "dtype": self.dtype, "domain": self.domain,
                "high": None if self.high is None else self.high.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        return cls(tuple(Dim.from_json(x) for x in d["shape"]), d["dtype"], d["domain"],
                   None if d.get("high") is None else Dim.from_json(d["high"]))


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A forward() argument. ``layout``: how get_inputs() makes it (contiguous, or a transposed/permuted view
    of a contiguous buffer, so the candidate sees non-unit strides)."""

    name: str
    spec: TensorSpec
    layout: str = "contiguous"        # contiguous | transposed | channels_last

    def to_json(self) -> dict:
        return {"name": self.name, "spec": self.spec.to_json(), "layout": self.layout}

    @classmethod
    def from_json(cls, d: dict) -> "InputSpec":
        return cls(d["name"], TensorSpec.from_json(d["spec"]), d.get("layout", "contiguous"))


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """An ``nn.Parameter`` the reference creates itself (a broadcast operand: bias, scale)."""

    name: str
    spec: TensorSpec
    init: str = "randn"               # randn | ones | zeros

    def to_json(self) -> dict:
        return {"name": self.name, "spec": self.spec.to_json(), "init": self.init}

    @classmethod
    def from_json(cls, d: dict) -> "ParamSpec":
        return cls(d["name"], TensorSpec.from_json(d["spec"]), d.get("init", "randn"))


@dataclasses.dataclass(frozen=True)
class Ref:
    """An operand: graph input i, node output i, or parameter i."""

    kind: str                         # input | node | param
    index: int

    def to_json(self) -> list:
        return [self.kind, self.index]

    @classmethod
    def from_json(cls, v: Any) -> "Ref":
        return cls(str(v[0]), int(v[1]))


def _param_to_json(v: Any) -> Any:
    if isinstance(v, Dim):
        return {"dim": v.to_json()}
    if isinstance(v, tuple):
        return {"tuple": [_param_to_json(x) for x in v]}
    return v


def _param_from_json(v: Any) -> Any:
    if isinstance(v, dict) and "dim" in v:
        return Dim.from_json(v["dim"])
    if isinstance(v, dict) and "tuple" in v:
        return tuple(_param_from_json(x) for x in v["tuple"])
    return v


@dataclasses.dataclass(frozen=True)
class Node:
    op: str                           # registry name
    args: tuple[Ref, ...]
    params: dict[str, Any]            # ints/floats/bools/str, Dims (sizes), tuples of those
    out: TensorSpec

    def to_json(self) -> dict:
        return {"op": self.op, "args": [a.to_json() for a in self.args],
                "params": {k: _param_to_json(v) for k, v in self.params.items()}, "out": self.out.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> "Node":
        return cls(d["op"], tuple(Ref.from_json(a) for a in d["args"]),
                   {k: _param_from_json(v) for k, v in d["params"].items()}, TensorSpec.from_json(d["out"]))


@dataclasses.dataclass(frozen=True)
class Graph:
    inputs: tuple[InputSpec, ...]
    nodes: tuple[Node, ...]
    params: tuple[ParamSpec, ...] = ()
    output: int = -1                  # node index of the returned value (-1: the last node)

    @property
    def out_node(self) -> int:
        return self.output if self.output >= 0 else len(self.nodes) - 1

    def spec_of(self, ref: Ref) -> TensorSpec:
        if ref.kind == "input":
            return self.inputs[ref.index].spec
        if ref.kind == "param":
            return self.params[ref.index].spec
        return self.nodes[ref.index].out

    def op_names(self) -> list[str]:
        return [n.op for n in self.nodes]

    def users(self, node_index: int) -> list[int]:
        return [j for j, n in enumerate(self.nodes) if Ref("node", node_index) in n.args]

    def to_json(self) -> dict:
        return {"inputs": [i.to_json() for i in self.inputs], "nodes": [n.to_json() for n in self.nodes],
                "params": [p.to_json() for p in self.params], "output": self.output}

    @classmethod
    def from_json(cls, d: dict) -> "Graph":
        return cls(tuple(InputSpec.from_json(x) for x in d["inputs"]), tuple(Node.from_json(x) for x in d["nodes"]),
                   tuple(ParamSpec.from_json(x) for x in d.get("params", [])), int(d.get("output", -1)))
