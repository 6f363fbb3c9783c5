"""Rendering a task graph (or a stage-3 template) as a KernelBench problem file.

The layout is KernelBench's, and the bundled tasks': imports, ``class Model(nn.Module)``, module-level
size constants (the ``cpu`` profile), ``get_inputs()`` and ``get_init_inputs()``. Sizes and scalar
hyper-parameters the constructor needs are its arguments, returned by ``get_init_inputs()``, so
``verifier.size_profiles`` can switch profiles by rewriting constants alone.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from .ir import Dim, Graph, InputSpec, ParamSpec, Ref
from .ops import get_op
from .sizes import Names

_TORCH_DTYPE = {"float32": None, "float16": "torch.float16", "bfloat16": "torch.bfloat16", "int64": "torch.long"}
_ATTR_BASE = {"linear": "linear", "layer_norm": "norm", "rms_norm": "norm", "batch_norm1d": "bn",
              "batch_norm2d": "bn", "group_norm": "group_norm", "instance_norm": "instance_norm",
              "embedding": "embedding", "conv2d": "conv", "conv1d": "conv", "conv2d_depthwise": "conv",
              "conv_transpose2d": "conv_transpose"}


class RenderError(ValueError):
    """The graph cannot be written as a task (a generator bug: an unnamed size where a constant is needed)."""


@dataclasses.dataclass
class Rendered:
    source: str
    sizes: dict[str, dict[str, Any]]       # profile -> {constant: value} (sizes and scalars)
    init_args: list[str]
    description: str
    # which module constant holds each constructor scalar ("<node>.<param>" -> name) and which attribute holds
    # each node's nn.Module ("<node>" -> attr): the offline teacher binds its kernel arguments through them
    bindings: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


def _dim_ref(d: Dim) -> str:
    if d.cpu == 1 and d.gpu == 1 and d.name is None:
        return "1"
    if d.name is None:
        raise RenderError(f"size {d.cpu}/{d.gpu} has no constant name")
    return d.name


def factory(inp: InputSpec) -> str:
    """The get_inputs() expression that creates ``inp`` (its values' domain, dtype and memory layout)."""
    spec = inp.spec
    dims = [_dim_ref(d) for d in spec.shape]
    if spec.domain == "index":
        if spec.high is None:
            raise RenderError(f"index input {inp.name} has no upper bound")
        return f"torch.randint(0, {_dim_ref(spec.high)}, ({', '.join(dims)}{',' if len(dims) == 1 else ''}))"
    perm = ""
    if inp.layout == "transposed" and len(dims) >= 2:
        dims[-1], dims[-2] = dims[-2], dims[-1]
        perm = ".transpose(-2, -1)"
    elif inp.layout == "channels_last" and len(dims) == 4:
        dims = [dims[0], dims[2], dims[3], dims[1]]
        perm = ".permute(0, 3, 1, 2)"
    dt = _TORCH_DTYPE.get(spec.dtype)
    kw = f", dtype={dt}" if dt else ""
    args = ", ".join(dims) or "()"
    if spec.domain == "positive":
        base = f"(torch.rand({args}{kw}) + 0.5)"
    elif spec.domain == "near_one":
        base = f"(torch.rand({args}{kw}) * 0.2 + 0.9)"
    else:
        base = f"torch.randn({args}{kw})"
    if perm:
        return base + perm
    return base[1:-1] if base.startswith("(") else base


def _param_init(p: ParamSpec) -> str:
    shape = ", ".join(_dim_ref(d) for d in p.spec.shape) or "1"
    if p.init == "positive" or p.spec.domain == "positive":
        return f"nn.Parameter(torch.rand({shape}) + 0.5)"
    if p.init == "ones":
        return f"nn.Parameter(torch.ones({shape}))"
    return f"nn.Parameter(torch.randn({shape}) * 0.5)"


def _collect_dims(graph: Graph) -> list[Dim]:
    """Named sizes in order of first appearance (inputs first, then parameters, then op parameters)."""
    seen: dict[str, Dim] = {}

    def visit(d: Any) -> None:
        if isinstance(d, Dim) and d.name is not None:
            prev = seen.setdefault(d.name, d)
            if not prev.same_size(d):
                raise RenderError(f"constant {d.name} has two values: {prev} and {d}")
        elif isinstance(d, tuple):
            for x in d:
                visit(x)

    for inp in graph.inputs:
        for d in inp.spec.shape:
            visit(d)
        visit(inp.spec.high)
    for p in graph.params:
        for d in p.spec.shape:
            visit(d)
    for n in graph.nodes:
        for v in n.params.values():
            visit(v)
    return list(seen.values())


def _is_chain(graph: Graph) -> bool:
    for i, n in enumerate(graph.nodes):
        if i and n.args[0] != Ref("node", i - 1):
            return False
        users = graph.users(i)
        if i < len(graph.nodes) - 1 and users != [i + 1]:
            return False
        if any(a.kind == "node" and a.index != i - 1 for a in n.args):
            return False
    return True


def describe_graph(graph: Graph) -> str:
    parts = []
    for n in graph.nodes:
        op = get_op(n.op)
        parts.append(op.describe(n.params))
    if len(parts) == 1:
        return parts[0][:1].upper() + parts[0][1:] + "."
    return (parts[0][:1].upper() + parts[0][1:] + ", then " + ", then ".join(parts[1:]) + ".")


def render_graph(graph: Graph, names: Names | None = None) -> Rendered:
    """KernelBench source for ``graph``; ``names`` holds the constant names already taken (sizes)."""
    dims = _collect_dims(graph)
    names = names or Names()
    names.used.update(d.name for d in dims if d.name)
    names.used.update(i.name for i in graph.inputs)

    # scalar hyper-parameters: module constants + constructor arguments
    scalar_consts: list[tuple[str, Any]] = []
    scalar_name: dict[tuple[int, str], str] = {}
    module_attr: dict[int, str] = {}
    attr_names = Names(set(names.used))
    init_dims: list[Dim] = []

    def need(d: Any) -> None:
        if isinstance(d, Dim) and d.name is not None and all(x.name != d.name for x in init_dims):
            init_dims.append(d)

    def dim_name(d: Dim) -> str:
        ref = _dim_ref(d)
        need(d)
        return ref

    module_lines: list[str] = []
    for i, n in enumerate(graph.nodes):
        op = get_op(n.op)
        for s in op.ctor_scalars(n.params):
            nm = names.take(op.const_name(s))
            scalar_name[(i, s)] = nm
            scalar_consts.append((nm, n.params[s]))
        ctor = op.module(n.params, dim_name)
        if ctor is not None:
            attr = attr_names.take(_ATTR_BASE.get(n.op, n.op))
            module_attr[i] = attr
            module_lines.append(f"        self.{attr} = {ctor}")
    param_lines = []
    for p in graph.params:
        for d in p.spec.shape:
            need(d)
        param_lines.append(f"        self.{p.name} = {_param_init(p)}")

    init_args = [d.name for d in init_dims if d.name] + [nm for nm, _ in scalar_consts]
    init_body = ["        super().__init__()"]
    init_body += [f"        self.{nm} = {nm}" for nm, _ in scalar_consts]
    init_body += module_lines + param_lines

    # forward
    chain = _is_chain(graph)
    input_names = [i.name for i in graph.inputs]
    if chain:
        var = "x" if input_names[0] == "x" or "x" not in input_names else "out"
        value_names = [var] * len(graph.nodes)
    else:
        value_names = [f"v{i}" for i in range(len(graph.nodes))]

    def arg_text(r: Ref) -> str:
        if r.kind == "input":
            return input_names[r.index]
        if r.kind == "param":
            return f"self.{graph.params[r.index].name}"
        return value_names[r.index]

    fwd = []
    for i, n in enumerate(graph.nodes):
        op = get_op(n.op)
        args = [arg_text(a) for a in n.args]
        if i in module_attr:
            expr = f"self.{module_attr[i]}({args[0]})"
        else:
            expr = op.render(args, n.params, lambda s, i=i: f"self.{scalar_name[(i, s)]}")
        fwd.append(f"        {value_names[i]} = {expr}")
    fwd.append(f"        return {value_names[graph.out_node]}")

    description = describe_graph(graph)
    sig = ", ".join(f"{nm}: torch.Tensor" for nm in input_names)
    init_sig = ", ".join(init_args)
    lines = [
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        "",
        "",
        "class Model(nn.Module):",
        f'    """{description}"""',
        "",
        f"    def __init__(self{', ' + init_sig if init_sig else ''}):",
        *init_body,
        "",
        f"    def forward(self, {sig}) -> torch.Tensor:",
        *fwd,
        "",
        "",
    ]
    lines += [f"{d.name} = {d.cpu}" for d in dims if d.name]
    lines += [f"{nm} = {v!r}" for nm, v in scalar_consts]
    lines += ["", "", "def get_inputs():"]
    lines += [f"    {i.name} = {factory(i)}" for i in graph.inputs]
    lines += [f"    return [{', '.join(input_names)}]", "", "", "def get_init_inputs():",
              f"    return [{', '.join(init_args)}]", ""]
    sizes = {"cpu": {d.name: d.cpu for d in dims if d.name}, "gpu": {d.name: d.gpu for d in dims if d.name}}
    bindings = {"scalars": {f"{i}.{k}": v for (i, k), v in scalar_name.items()},
                "modules": {str(i): a for i, a in module_attr.items()}}
    return Rendered(source="\n".join(lines), sizes=sizes, init_args=init_args, description=description,
                    bindings=bindings)


def render_module(doc: str, init_args: Sequence[str], init_body: Sequence[str], forward_args: Sequence[str],
                  forward_body: Sequence[str], dims: Sequence[Dim], scalars: Sequence[tuple[str, Any]],
                  inputs: Sequence[InputSpec], extra_imports: Sequence[str] = ()) -> Rendered:
    """KernelBench source for a stage-3 template: its class body is given, the rest is generated."""
    sig = ", ".join(f"{a}: torch.Tensor" for a in forward_args)
    imports = (["import math"] if "math." in "\n".join(forward_body) else []) + list(extra_imports)
    lines = [*imports, "import torch", "import torch.nn as nn", "import torch.nn.functional as F", "", "",
             "class Model(nn.Module):", f'    """{doc}"""', "",
             f"    def __init__(self{', ' + ', '.join(init_args) if init_args else ''}):",
             "        super().__init__()", *[f"        {ln}" for ln in init_body], "",
             f"    def forward(self, {sig}) -> torch.Tensor:", *[f"        {ln}" for ln in forward_body], "", ""]
    lines += [f"{d.name} = {d.cpu}" for d in dims if d.name]
    lines += [f"{nm} = {v!r}" for nm, v in scalars]
    lines += ["", "", "def get_inputs():"]
    lines += [f"    {i.name} = {factory(i)}" for i in inputs]
    lines += [f"    return [{', '.join(i.name for i in inputs)}]", "", "", "def get_init_inputs():",
              f"    return [{', '.join(init_args)}]", ""]
    sizes = {"cpu": {d.name: d.cpu for d in dims if d.name}, "gpu": {d.name: d.gpu for d in dims if d.name}}
    return Rendered(source="\n".join(lines), sizes=sizes, init_args=list(init_args), description=doc)
