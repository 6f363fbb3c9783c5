"""The compact offline teacher: short, fixed-template C++ answers a tiny model can learn in minutes on a CPU.

The full teacher (``data_synth.teacher``) writes a plan and a fused, dtype-dispatched kernel whose text depends on
the task's shapes and names: right for a real model, far too varied for a 64-wide model trained for a few minutes.
This one answers a chain of unary elementwise ops on one float32 input (stage 1 single ops and stage 2
compositions) with one small extension per distinct op, in the order the reference applies them:

    src1 = \"\"\" torch::Tensor run(torch::Tensor x) { ... q[i] = std::tanh(v); ... } \"\"\"
    ext1 = load_inline(name="tanh_ext", cpp_sources=src1, functions=["run"], extra_cflags=["-O3"])
    class ModelNew(nn.Module):
        def forward(self, x):
            x = ext1.run(x.contiguous())
            ...

The answer opens with a short plan that restates the reference's ``forward`` lines, one per op, with the
extension each maps to (MusaCoder's stage-2 "semantic decomposition" step in one line each): the op names then
sit a few tokens before the code that uses them, so a tiny model learns to copy them from its own plan instead of
retrieving them from several hundred tokens back in the prompt (without it, a 64-wide model trained for a few
minutes wrote a correct template around a random op). Python names are positional (``src1``/``ext1`` for the
first distinct op): with op-named variables, a tiny model mixing two ops in one answer referred to names it never
bound (101 of 128 held-out samples refused), while now the op shows only in the plan, the extension's name string
and the kernel's expression, and a name cannot dangle.

Why this shape: every line of the answer follows from one line of the reference's ``forward`` (a composition is
the single-op answers' blocks and calls in sequence), so what is learned on single ops carries over to unseen
compositions; and an op's extension source is the same text in every answer, so the verifier's build cache
compiles it once for the whole run (a C++ build costs tens of seconds on two cores) however many tasks, samples,
compositions and stages use it. Two loop styles (an indexed loop and a pointer walk) give RFT distinct
implementations to cluster; the style is drawn per (task, op) from the seed.
"""
from __future__ import annotations

import ast
import random
import zlib
from typing import Sequence

from .generate import GeneratedTask
from .ops import Unary, get_op
from .teacher import TeacherAnswer, Unsupported

STYLES = ("index", "pointer")

_LOOP = {
    "index": ("  for (int64_t i = 0; i < x.numel(); i++) {{\n"
              "    float v = p[i];\n"
              "    q[i] = {expr};\n"
              "  }}"),
    "pointer": ("  for (float* e = q + x.numel(); q < e; p++, q++) {{\n"
                "    float v = *p;\n"
                "    *q = {expr};\n"
                "  }}"),
}


def supported_op(name: str) -> bool:
    """Unary elementwise ops with a C++ expression and no hyper-parameters."""
    op = get_op(name)
    return isinstance(op, Unary) and bool(op.cpp) and not op.scalars


def supported_ops() -> list[str]:
    from .ops import REGISTRY

    return sorted(n for n in REGISTRY if supported_op(n))


def supports(task: GeneratedTask, backend: str = "cpu") -> str | None:
    """None when the compact teacher can answer ``task``, else why not."""
    if backend != "cpu":
        return f"the compact teacher writes C++ for the cpu backend only, not {backend}"
    g = task.graph
    if g is None:
        return "no generator graph (a template or foreign task)"
    if len(g.inputs) != 1 or g.params:
        return "not a single-input task without parameters"
    if g.inputs[0].spec.dtype != "float32":
        return f"input dtype {g.inputs[0].spec.dtype}: the compact kernels are float32"
    for k, node in enumerate(g.nodes):
        if not supported_op(node.op):
            return f"op {node.op} is not a unary elementwise op without hyper-parameters"
        want = ("input", 0) if k == 0 else ("node", k - 1)
        if len(node.args) != 1 or (node.args[0].kind, node.args[0].index) != want:
            return "not a chain (an op reads something other than the previous value)"
    return None


def op_source(op: str, style: str) -> str:
    """One op's C++ source: the same text in every answer, so one build serves them all."""
    return ("torch::Tensor run(torch::Tensor x) {\n"
            "  auto y = torch::empty_like(x);\n"
            "  float* p = x.data_ptr<float>();\n"
            "  float* q = y.data_ptr<float>();\n"
            f"{_LOOP[style].format(expr=get_op(op).cpp)}\n"
            "  return y;\n"
            "}\n")


#: the first line of every compact answer; the plan's lines follow it (``bench/recipe_probe.py`` probes after it)
PLAN_HEADER = "Plan: one C++ extension per op, applied in order:\n"


def op_block(op: str, style: str, k: int) -> str:
    """The source and the load_inline line of an answer's ``k``-th distinct op (extension ``ext{k}``)."""
    return (f'src{k} = """\n{op_source(op, style)}"""\n'
            f'ext{k} = load_inline(name="{op}_ext", cpp_sources=src{k}, functions=["run"], extra_cflags=["-O3"])\n')


def style_for(task_id: str, op: str, seed: int, styles: Sequence[str] = STYLES) -> str:
    return random.Random(zlib.crc32(f"{seed}/{task_id}/{op}".encode())).choice(list(styles))


def compact_answer(task: GeneratedTask, backend: str = "cpu", seed: int = 0,
                   styles: Sequence[str] = STYLES) -> TeacherAnswer:
    """The answer for ``task``, each op's loop style drawn from ``styles`` by ``(seed, task, op)``."""
    bad = [s for s in styles if s not in STYLES] or ([] if styles else ["(none)"])
    if bad:
        raise ValueError(f"compact styles {bad}: use some of {', '.join(STYLES)}")
    reason = supports(task, backend)
    if reason is not None:
        raise Unsupported(reason)
    ops = [n.op for n in task.graph.nodes]
    distinct = list(dict.fromkeys(ops))
    chosen = {op: style_for(task.task_id, op, seed, styles) for op in distinct}
    ext = {op: k for k, op in enumerate(distinct, 1)}
    plan = "".join(f"{k}. {line} -> ext{ext[op]}\n"
                   for k, (line, op) in enumerate(zip(forward_lines(task.source), ops), 1))
    blocks = "\n".join(op_block(op, chosen[op], ext[op]) for op in distinct)
    calls = "".join(f"        x = ext{ext[op]}.run(x.contiguous())\n" for op in ops)
    code = ("import torch\n"
            "import torch.nn as nn\n"
            "from torch.utils.cpp_extension import load_inline\n\n"
            f"{blocks}\n\n"
            "class ModelNew(nn.Module):\n"
            "    def forward(self, x):\n"
            f"{calls}"
            "        return x\n")
    recipe = "compact:" + "+".join(f"{op}/{chosen[op]}" for op in distinct)
    response = f"{PLAN_HEADER}{plan}\n```python\n{code}```"
    return TeacherAnswer(task_id=task.task_id, backend=backend, recipe=recipe, response=response, code=code)


def forward_lines(source: str) -> list[str]:
    """The statements of the reference's ``Model.forward`` before its return, as source lines."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
                    return [ast.unparse(st) for st in fn.body if not isinstance(st, (ast.Return, ast.Expr))]
    return []
