"""The offline teacher: kernels written from parameterised templates, no LLM (research note §0.3).

For a generated task whose graph uses only families the templates cover, it writes a complete answer in the
format the verifier and the RL prompts expect: a short plan (MusaCoder stage 2's six steps: semantics, scalar
math, shapes, index mapping, boundaries, pitfalls) and one fenced python block with ``load_inline`` and
``class ModelNew``. Runs of elementwise ops (unary, binary, broadcast operands) are fused into one loop;
reductions, softmax-like passes, scans, last-dim norms, linear layers, matmuls and the simple losses get
their own loops over an (outer, reduced, inner) view of the tensor.

Backends: ``cpu`` (C++ through ``load_inline(cpp_sources=...)``, verified by the CPU verifier) and ``cuda``
(grid-stride elementwise kernels, block-per-row reductions with warp shuffles, tiled GEMM). Every answer goes
through the same verifier as a model's before it becomes a training row (``data_synth.distill``).

``ModelNew.__init__`` is the reference's ``__init__`` verbatim, so parameter names (and the state dict the
verifier copies) match; ``forward`` hands inputs, weights and hyper-parameters to the extension.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import re
import textwrap
from typing import Any

from .generate import GeneratedTask
from .ir import Node, Ref
from .ops import Binary, L2Normalize, LastDimNorm, Linear, Loss, Matmul, Reduce, Scan, Softmax, Unary, get_op

BACKENDS = ("cpu", "cuda")
_DISPATCH = "AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16"
_LOSS_EXPR = {"mse_loss": "d * d", "l1_loss": "std::fabs(d)",
              "smooth_l1_loss": "(std::fabs(d) < 1.f ? 0.5f * d * d : std::fabs(d) - 0.5f)",
              "huber_loss": "(std::fabs(d) <= 1.f ? 0.5f * d * d : std::fabs(d) - 0.5f)"}


class Unsupported(Exception):
    """The templates cannot write this task; the message says which op or structure."""


@dataclasses.dataclass
class TeacherAnswer:
    task_id: str
    backend: str
    recipe: str                        # e.g. "cpu:elementwise+reduce"
    response: str                      # the full answer (plan + fenced python block)
    code: str                          # the python block alone


def _kind(node: Node) -> str:
    op = get_op(node.op)
    if isinstance(op, (Unary, Binary)):
        return "elementwise"
    if isinstance(op, Reduce):
        return "reduce"
    if isinstance(op, (Softmax, L2Normalize)):
        return "softmax"
    if isinstance(op, Scan):
        return "scan"
    if isinstance(op, LastDimNorm):
        return "norm"
    if isinstance(op, Linear):
        return "linear"
    if isinstance(op, Matmul):
        return "matmul"
    if isinstance(op, Loss) and node.op in _LOSS_EXPR:
        return "loss"
    raise Unsupported(f"op {node.op} ({op.family}) has no template")


def supports(task: GeneratedTask) -> str | None:
    """None when the teacher can write ``task``, else the reason it cannot."""
    if task.graph is None:
        return "no generator graph (a template or foreign task)"
    if "bindings" not in task.meta:
        return "no constructor bindings in the manifest"
    try:
        for n in task.graph.nodes:
            _kind(n)
    except Unsupported as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------------------ C++ helpers (cpu)

_CPU_SPLIT = """
struct DimSplit { int64_t outer, R, inner; std::vector<int64_t> out_sizes; };

// View a contiguous tensor as (outer, R, inner) around dimension `dim`.
static DimSplit split_dim(const torch::Tensor& t, int64_t dim, bool keepdim) {
    const int64_t nd = t.dim();
    if (dim < 0) dim += nd;
    TORCH_CHECK(dim >= 0 && dim < nd, "dimension out of range");
    DimSplit s{1, t.size(dim), 1, {}};
    for (int64_t k = 0; k < nd; ++k) {
        if (k < dim) s.outer *= t.size(k);
        if (k > dim) s.inner *= t.size(k);
        if (k != dim) s.out_sizes.push_back(t.size(k));
        else if (keepdim) s.out_sizes.push_back(1);
    }
    return s;
}
"""

# composite references (F.normalize, logsumexp) store intermediates in the tensor dtype: mirror that rounding
_CPU_RND = """
// Round to the tensor dtype and back, as a reference that stores an intermediate tensor does.
template <typename scalar_t>
static inline double rnd(double v) { return static_cast<float>(static_cast<scalar_t>(static_cast<float>(v))); }
"""
_CUDA_RND = """
// Round to the tensor dtype and back, as a reference that stores an intermediate tensor does.
template <typename scalar_t>
__device__ __forceinline__ float rnd(float v) { return static_cast<float>(static_cast<scalar_t>(v)); }
"""

# reduction kinds: (init, update, finalize) over double accumulators acc/aux, float v, index r
_CPU_REDUCE = {
    "sum": ("0.0", "acc[i] += v;", "acc[i]"),
    "mean": ("0.0", "acc[i] += v;", "acc[i] / static_cast<double>(R)"),
    "amax": ("-INFINITY", "acc[i] = v > acc[i] ? v : acc[i];", "acc[i]"),
    "amin": ("INFINITY", "acc[i] = v < acc[i] ? v : acc[i];", "acc[i]"),
    "prod": ("1.0", "acc[i] *= v;", "acc[i]"),
    "l2norm": ("0.0", "acc[i] += static_cast<double>(v) * v;", "std::sqrt(acc[i])"),
    "argmax": ("-INFINITY", "if (v > acc[i]) { acc[i] = v; arg[i] = r; }", "arg[i]"),
    "argmin": ("INFINITY", "if (v < acc[i]) { acc[i] = v; arg[i] = r; }", "arg[i]"),
}


def _cpu_reduce_helper(kind: str) -> str:
    if kind in ("var", "std", "logsumexp"):
        first = "aux[i] += v;" if kind != "logsumexp" else "aux[i] = v > aux[i] ? v : aux[i];"
        init_aux = "0.0" if kind != "logsumexp" else "-INFINITY"
        second = ("{ const double dv = v - aux[i] / R; acc[i] += dv * dv; }" if kind != "logsumexp"
                  else "acc[i] += rnd<scalar_t>(std::exp(rnd<scalar_t>(v - aux[i])));")
        fin = {"var": "acc[i] / static_cast<double>(R - 1)", "std": "std::sqrt(acc[i] / static_cast<double>(R - 1))",
               "logsumexp": "aux[i] + rnd<scalar_t>(std::log(rnd<scalar_t>(acc[i])))"}[kind]
        return f"""
// {kind} over the middle axis of an (outer, R, inner) buffer: two passes per output element.
template <typename scalar_t, typename out_t>
static void reduce_{kind}(const scalar_t* src, out_t* dst, int64_t outer, int64_t R, int64_t inner) {{
    std::vector<double> acc(inner), aux(inner);
    for (int64_t o = 0; o < outer; ++o) {{
        const scalar_t* base = src + o * R * inner;
        std::fill(acc.begin(), acc.end(), 0.0);
        std::fill(aux.begin(), aux.end(), {init_aux});
        for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < inner; ++i) {{ const float v = static_cast<float>(base[r * inner + i]); {first} }}
        for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < inner; ++i) {{ const float v = static_cast<float>(base[r * inner + i]); {second} }}
        for (int64_t i = 0; i < inner; ++i) dst[o * inner + i] = static_cast<out_t>(static_cast<float>({fin}));
    }}
}}
"""
    init, upd, fin = _CPU_REDUCE[kind]
    if not kind.startswith("arg"):
        fin = f"static_cast<float>({fin})"
    return f"""
// {kind} over the middle axis of an (outer, R, inner) buffer; inner runs fastest, so reads are sequential.
template <typename scalar_t, typename out_t>
static void reduce_{kind}(const scalar_t* src, out_t* dst, int64_t outer, int64_t R, int64_t inner) {{
    std::vector<double> acc(inner);
    std::vector<int64_t> arg(inner);
    for (int64_t o = 0; o < outer; ++o) {{
        const scalar_t* base = src + o * R * inner;
        std::fill(acc.begin(), acc.end(), {init});
        std::fill(arg.begin(), arg.end(), 0);
        for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < inner; ++i) {{ const float v = static_cast<float>(base[r * inner + i]); {upd} }}
        for (int64_t i = 0; i < inner; ++i) dst[o * inner + i] = static_cast<out_t>({fin});
    }}
}}
"""


def _cpu_rowwise_helper(kind: str) -> str:
    """softmax / log_softmax / l2_normalize along the middle axis (three passes)."""
    if kind == "l2_normalize":
        p1, p2, write = ("", "acc[i] += static_cast<double>(v) * v;",
                         "v / std::max(rnd<scalar_t>(std::sqrt(acc[i])), 1e-12)")
        init_mx = "0.0"
    else:
        p1 = "mx[i] = v > mx[i] ? v : mx[i];"
        p2 = "acc[i] += std::exp(static_cast<double>(v) - mx[i]);"
        write = "std::exp(v - mx[i]) / acc[i]" if kind == "softmax" else "v - mx[i] - std::log(acc[i])"
        init_mx = "-INFINITY"
    return f"""
// {kind} along the middle axis of an (outer, R, inner) buffer.
template <typename scalar_t>
static void rowwise_{kind}(const scalar_t* src, scalar_t* dst, int64_t outer, int64_t R, int64_t inner) {{
    std::vector<double> mx(inner), acc(inner);
    for (int64_t o = 0; o < outer; ++o) {{
        const scalar_t* base = src + o * R * inner;
        scalar_t* out = dst + o * R * inner;
        std::fill(mx.begin(), mx.end(), {init_mx});
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < inner; ++i) {{ const double v = static_cast<float>(base[r * inner + i]); {p1} }}
        for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < inner; ++i) {{ const double v = static_cast<float>(base[r * inner + i]); {p2} }}
        for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < inner; ++i) {{
                const double v = static_cast<float>(base[r * inner + i]);
                out[r * inner + i] = static_cast<scalar_t>(static_cast<float>({write}));
            }}
    }}
}}
"""


_CPU_SCAN = {"cumsum": ("0.0", "acc[i] += v;"), "cumprod": ("1.0", "acc[i] *= v;"),
             "logcumsumexp": ("-INFINITY", "{ const double m = acc[i] > v ? acc[i] : v; "
                                           "acc[i] = std::isinf(m) && m < 0 ? m : m + std::log(std::exp(acc[i] - m) + "
                                           "std::exp(v - m)); }")}


def _cpu_scan_helper(kind: str) -> str:
    init, upd = _CPU_SCAN[kind]
    return f"""
// {kind} along the middle axis of an (outer, R, inner) buffer, running double accumulators.
template <typename scalar_t>
static void scan_{kind}(const scalar_t* src, scalar_t* dst, int64_t outer, int64_t R, int64_t inner) {{
    std::vector<double> acc(inner);
    for (int64_t o = 0; o < outer; ++o) {{
        std::fill(acc.begin(), acc.end(), {init});
        for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < inner; ++i) {{
                const int64_t at = (o * R + r) * inner + i;
                const double v = static_cast<float>(src[at]);
                {upd}
                dst[at] = static_cast<scalar_t>(static_cast<float>(acc[i]));
            }}
    }}
}}
"""


def _fmt_float(v: float) -> str:
    text = repr(float(v))
    return (text if "e" in text or "." in text else text + ".0") + "f"


# ------------------------------------------------------------------------------------------ code generation

class _Gen:
    """Graph -> one C++ (or CUDA) function ``forward_impl`` plus the Python arguments that feed it."""

    def __init__(self, task: GeneratedTask, backend: str):
        if backend not in BACKENDS:
            raise Unsupported(f"backend {backend!r}: the offline teacher writes {BACKENDS}")
        reason = supports(task)
        if reason:
            raise Unsupported(reason)
        self.task, self.g, self.backend = task, task.graph, backend
        assert self.g is not None
        self.binds = task.meta["bindings"]
        self.cpp_args: list[str] = []
        self.py_args: list[str] = []
        self.helpers: dict[str, str] = {}
        self.body: list[str] = []
        self.locals: list[str] = []
        self.names: dict[Ref, str] = {}
        self.kinds: list[str] = []
        self.plan: list[str] = []

    # --- arguments
    def _arg(self, cpp: str, py: str) -> str:
        name = cpp.split()[-1]
        if name not in [a.split()[-1] for a in self.cpp_args]:
            self.cpp_args.append(cpp)
            self.py_args.append(py)
        return name

    def value(self, ref: Ref) -> str:
        if ref.kind == "input":
            name = self.g.inputs[ref.index].name
            return self._arg(f"torch::Tensor {name}", name)
        if ref.kind == "param":
            name = self.g.params[ref.index].name
            return self._arg(f"torch::Tensor {name}", f"self.{name}")
        return self.names[ref]

    def scalar(self, i: int, key: str, value: Any) -> str:
        """A hyper-parameter: the constructor constant it is bound to (an argument), or a literal."""
        const = self.binds["scalars"].get(f"{i}.{key}")
        if const is None:
            if isinstance(value, bool):
                return "true" if value else "false"
            return str(value) if isinstance(value, int) else _fmt_float(value)
        if isinstance(value, bool):
            return self._arg(f"bool {const}", f"self.{const}")
        if isinstance(value, int):
            return self._arg(f"int64_t {const}", f"self.{const}")
        local = f"s_{const}"
        self._arg(f"double {const}", f"self.{const}")
        decl = f"    const float {local} = static_cast<float>({const});"
        if decl not in self.locals:
            self.locals.append(decl)
        return local

    def module_attr(self, i: int) -> str:
        attr = self.binds["modules"].get(str(i))
        if attr is None:
            raise Unsupported(f"node {i} ({self.g.nodes[i].op}) has no module binding")
        return attr

    # --- graph walk
    def build(self) -> None:
        g = self.g
        i = 0
        while i < len(g.nodes):
            kind = _kind(g.nodes[i])
            if kind == "elementwise":
                group = [i]
                while (i + 1 < len(g.nodes) and _kind(g.nodes[i + 1]) == "elementwise"
                       and g.nodes[i + 1].args[0] == Ref("node", i) and g.users(i) == [i + 1]
                       and i != g.out_node):
                    i += 1
                    group.append(i)
                self.elementwise(group)
            else:
                getattr(self, kind)(i)
            if kind not in self.kinds:
                self.kinds.append(kind)
            i += 1

    def expr(self, i: int, node: Node) -> str:
        op = get_op(node.op)
        text = op.cpp or ""
        for s in op.scalars:
            text = re.sub(rf"\b{s.name}\b", self.scalar(i, s.name, node.params[s.name]), text)
        return text

    # --- cpu emitters (cuda overrides)
    def elementwise(self, group: list[int]) -> None:
        g = self.g
        first, last = group[0], group[-1]
        main = self.value(g.nodes[first].args[0])
        m, out = f"m{first}", f"t{last}"
        lines = [f"    auto {m} = {main}.contiguous();"]
        extras: list[tuple[str, str]] = []
        steps = []
        for j in group:
            node = g.nodes[j]
            if len(node.args) > 1:
                e = f"e{j}"
                lines.append(f"    auto {e} = {self.value(node.args[1])}.expand({m}.sizes()).contiguous();")
                extras.append((e, f"p{e}"))
                steps.append(f"{{ const float a = v, b = static_cast<float>(p{e}[i]); v = {self.expr(j, node)}; }}")
            else:
                steps.append(f"v = {self.expr(j, node)};")
            if j != last:   # round to the tensor dtype between ops, as the op-by-op reference does (float32: no-op)
                steps.append("v = static_cast<float>(static_cast<scalar_t>(v));")
        lines += self._elementwise_loop(m, out, extras, steps, first)
        self.body += lines
        for j in group:
            self.names[Ref("node", j)] = out
        ops = ", ".join(g.nodes[j].op for j in group)
        self.plan.append(f"fuse {ops} into one pass over the {('broadcast-expanded ' if extras else '')}elements")

    def _elementwise_loop(self, m: str, out: str, extras, steps, tag: int) -> list[str]:
        ptrs = "".join(f"        const scalar_t* {p} = {e}.data_ptr<scalar_t>();\n" for e, p in extras)
        body = "\n".join(f"            {s}" for s in steps)
        return [f"    auto {out} = torch::empty_like({m});",
                f'    {_DISPATCH}, {m}.scalar_type(), "elementwise_{tag}", [&] {{',
                f"        const scalar_t* src = {m}.data_ptr<scalar_t>();",
                ptrs.rstrip("\n") if ptrs else "",
                f"        scalar_t* dst = {out}.data_ptr<scalar_t>();",
                f"        const int64_t n = {m}.numel();",
                "        for (int64_t i = 0; i < n; ++i) {",
                "            float v = static_cast<float>(src[i]);",
                body,
                "            dst[i] = static_cast<scalar_t>(v);",
                "        }",
                "    });"]

    def _split(self, i: int, keepdim: str) -> tuple[str, str]:
        node = self.g.nodes[i]
        src = self.value(node.args[0])
        inp, sp = f"in{i}", f"sp{i}"
        dim = self.scalar(i, "dim", node.params["dim"])
        self.helpers["split"] = _CPU_SPLIT if self.backend == "cpu" else self._cuda_split()
        self.body += [f"    auto {inp} = {src}.contiguous();",
                      f"    const DimSplit {sp} = split_dim({inp}, {dim}, {keepdim});"]
        return inp, sp

    def reduce(self, i: int) -> None:
        node = self.g.nodes[i]
        kind = node.op
        inp, sp = self._split(i, "true" if node.params["keepdim"] else "false")
        out = f"t{i}"
        arg = kind in ("argmax", "argmin")
        opts = f"{inp}.options().dtype(torch::kLong)" if arg else f"{inp}.options()"
        out_t = "int64_t" if arg else "scalar_t"
        self.helpers[f"reduce_{kind}"] = self._reduce_helper(kind)
        self.body += [f"    auto {out} = torch::empty({sp}.out_sizes, {opts});",
                      f'    {_DISPATCH}, {inp}.scalar_type(), "reduce_{i}", [&] {{',
                      *self._reduce_launch(kind, inp, out, sp, out_t),
                      "    });"]
        self.names[Ref("node", i)] = out
        self.plan.append(f"{kind} over one dimension: view the input as (outer, reduced, inner) and keep one "
                         f"accumulator per output element")

    def _reduce_helper(self, kind: str) -> str:
        if kind == "logsumexp":
            self.helpers["rnd"] = _CPU_RND
        return _cpu_reduce_helper(kind)

    def _reduce_launch(self, kind, inp, out, sp, out_t) -> list[str]:
        return [f"        reduce_{kind}<scalar_t, {out_t}>({inp}.data_ptr<scalar_t>(), {out}.data_ptr<{out_t}>(), "
                f"{sp}.outer, {sp}.R, {sp}.inner);"]

    def softmax(self, i: int) -> None:
        node = self.g.nodes[i]
        kind = node.op
        inp, sp = self._split(i, "true")
        out = f"t{i}"
        self.helpers[f"rowwise_{kind}"] = self._rowwise_helper(kind)
        self.body += [f"    auto {out} = torch::empty_like({inp});",
                      f'    {_DISPATCH}, {inp}.scalar_type(), "rowwise_{i}", [&] {{',
                      *self._rowwise_launch(kind, inp, out, sp),
                      "    });"]
        self.names[Ref("node", i)] = out
        self.plan.append(f"{kind}: per row a max (or sum of squares) pass, a sum pass, then a write pass, in "
                         f"double accumulators for stability")

    def _rowwise_helper(self, kind: str) -> str:
        if kind == "l2_normalize":
            self.helpers["rnd"] = _CPU_RND
        return _cpu_rowwise_helper(kind)

    def _rowwise_launch(self, kind, inp, out, sp) -> list[str]:
        return [f"        rowwise_{kind}<scalar_t>({inp}.data_ptr<scalar_t>(), {out}.data_ptr<scalar_t>(), "
                f"{sp}.outer, {sp}.R, {sp}.inner);"]

    def scan(self, i: int) -> None:
        node = self.g.nodes[i]
        kind = node.op
        inp, sp = self._split(i, "true")
        out = f"t{i}"
        self.helpers[f"scan_{kind}"] = self._scan_helper(kind)
        self.body += [f"    auto {out} = torch::empty_like({inp});",
                      f'    {_DISPATCH}, {inp}.scalar_type(), "scan_{i}", [&] {{',
                      *self._scan_launch(kind, inp, out, sp),
                      "    });"]
        self.names[Ref("node", i)] = out
        self.plan.append(f"{kind}: one running accumulator per (outer, inner) position along the scanned axis")

    def _scan_helper(self, kind: str) -> str:
        return _cpu_scan_helper(kind)

    def _scan_launch(self, kind, inp, out, sp) -> list[str]:
        return [f"        scan_{kind}<scalar_t>({inp}.data_ptr<scalar_t>(), {out}.data_ptr<scalar_t>(), "
                f"{sp}.outer, {sp}.R, {sp}.inner);"]

    def norm(self, i: int) -> None:
        node = self.g.nodes[i]
        attr = self.module_attr(i)
        src = self.value(node.args[0])
        w = self._arg(f"torch::Tensor {attr}_weight", f"self.{attr}.weight")
        has_bias = node.op == "layer_norm"
        b = self._arg(f"torch::Tensor {attr}_bias", f"self.{attr}.bias") if has_bias else None
        inp, out = f"in{i}", f"t{i}"
        eps = _fmt_float(node.params["eps"])
        self.helpers[f"norm_{node.op}"] = self._norm_helper(node.op)
        self.body += [f"    auto {inp} = {src}.contiguous();",
                      f"    auto {out} = torch::empty_like({inp});",
                      f"    const int64_t D{i} = {inp}.size(-1);",
                      f"    auto w{i} = {w}.contiguous();",
                      *([f"    auto b{i} = {b}.contiguous();"] if b else []),
                      f'    {_DISPATCH}, {inp}.scalar_type(), "norm_{i}", [&] {{',
                      *self._norm_launch(node.op, inp, out, f"D{i}", f"w{i}", f"b{i}" if b else None, eps),
                      "    });"]
        self.names[Ref("node", i)] = out
        self.plan.append(f"{node.op} over the last dimension: per row the statistics in double, then scale by "
                         f"the module's weight{' and add its bias' if b else ''}")

    def _norm_helper(self, op: str) -> str:
        stats = ("double mean = 0.0; for (int64_t k = 0; k < D; ++k) mean += static_cast<float>(x[k]); mean /= D;\n"
                 "        double var = 0.0; for (int64_t k = 0; k < D; ++k) { const double c = static_cast<float>(x[k]) "
                 "- mean; var += c * c; } var /= D;\n"
                 "        const double inv = 1.0 / std::sqrt(var + eps);") if op == "layer_norm" else (
                 "const double mean = 0.0;\n        double ms = 0.0; for (int64_t k = 0; k < D; ++k) { const double c = "
                 "static_cast<float>(x[k]); ms += c * c; } ms /= D;\n"
                 "        const double inv = 1.0 / std::sqrt(ms + eps);")
        bias = " + static_cast<float>(b[k])" if op == "layer_norm" else ""
        return f"""
// {op} over the last dimension of a contiguous (rows, D) buffer.
template <typename scalar_t>
static void norm_{op}(const scalar_t* src, scalar_t* dst, const scalar_t* w, const scalar_t* b, int64_t rows,
                      int64_t D, double eps) {{
    for (int64_t r = 0; r < rows; ++r) {{
        const scalar_t* x = src + r * D;
        scalar_t* y = dst + r * D;
        {stats}
        for (int64_t k = 0; k < D; ++k)
            y[k] = static_cast<scalar_t>(static_cast<float>((static_cast<float>(x[k]) - mean) * inv) * static_cast<float>(w[k]){bias});
    }}
}}
"""

    def _norm_launch(self, op, inp, out, D, w, b, eps) -> list[str]:
        bp = f"{b}.data_ptr<scalar_t>()" if b else "nullptr"
        return [f"        norm_{op}<scalar_t>({inp}.data_ptr<scalar_t>(), {out}.data_ptr<scalar_t>(), "
                f"{w}.data_ptr<scalar_t>(), {bp}, {inp}.numel() / {D}, {D}, {eps});"]

    def linear(self, i: int) -> None:
        node = self.g.nodes[i]
        attr = self.module_attr(i)
        src = self.value(node.args[0])
        w = self._arg(f"torch::Tensor {attr}_weight", f"self.{attr}.weight")
        b = self._arg(f"torch::Tensor {attr}_bias", f"self.{attr}.bias") if node.params["bias"] else None
        inp, out = f"in{i}", f"t{i}"
        self.helpers["linear"] = self._linear_helper()
        self.body += [f"    auto {inp} = {src}.contiguous();",
                      f"    auto w{i} = {w}.contiguous();",
                      *([f"    auto b{i} = {b}.contiguous();"] if b else []),
                      f"    const int64_t K{i} = {inp}.size(-1), N{i} = w{i}.size(0), M{i} = {inp}.numel() / K{i};",
                      f"    auto osz{i} = {inp}.sizes().vec();",
                      f"    osz{i}.back() = N{i};",
                      f"    auto {out} = torch::empty(osz{i}, {inp}.options());",
                      f'    {_DISPATCH}, {inp}.scalar_type(), "linear_{i}", [&] {{',
                      *self._linear_launch(inp, out, f"w{i}", f"b{i}" if b else None, f"M{i}", f"N{i}", f"K{i}"),
                      "    });"]
        self.names[Ref("node", i)] = out
        self.plan.append("linear layer: each output is a dot product of an input row with a weight row "
                         "(both contiguous along K), plus the bias")

    def _linear_helper(self) -> str:
        return """
// y[m, n] = sum_k x[m, k] * w[n, k] + b[n]; x and w rows are both contiguous along k.
template <typename scalar_t>
static void linear_rows(const scalar_t* x, const scalar_t* w, const scalar_t* b, scalar_t* y, int64_t M, int64_t N,
                        int64_t K) {
    std::vector<float> xr(K);
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t k = 0; k < K; ++k) xr[k] = static_cast<float>(x[m * K + k]);
        for (int64_t n = 0; n < N; ++n) {
            const scalar_t* wr = w + n * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; ++k) acc += xr[k] * static_cast<float>(wr[k]);
            if (b) acc += static_cast<float>(b[n]);
            y[m * N + n] = static_cast<scalar_t>(acc);
        }
    }
}
"""

    def _linear_launch(self, inp, out, w, b, M, N, K) -> list[str]:
        bp = f"{b}.data_ptr<scalar_t>()" if b else "nullptr"
        return [f"        linear_rows<scalar_t>({inp}.data_ptr<scalar_t>(), {w}.data_ptr<scalar_t>(), {bp}, "
                f"{out}.data_ptr<scalar_t>(), {M}, {N}, {K});"]

    def matmul(self, i: int) -> None:
        node = self.g.nodes[i]
        tb = node.op == "matmul_tb"
        a = self.value(node.args[0])
        bsrc = self.value(node.args[1])
        out = f"t{i}"
        self.helpers["matmul"] = self._matmul_helper()
        self.body += [f"    auto a{i} = {a}.contiguous();",
                      f"    auto b{i} = {bsrc}.contiguous();",
                      f"    const int64_t M{i} = a{i}.size(-2), K{i} = a{i}.size(-1);",
                      f"    const int64_t N{i} = b{i}.size({'-2' if tb else '-1'});",
                      f"    const int64_t batch{i} = a{i}.dim() == 3 ? a{i}.size(0) : 1;",
                      f"    auto osz{i} = a{i}.sizes().vec();",
                      f"    osz{i}.back() = N{i};",
                      f"    auto {out} = torch::empty(osz{i}, a{i}.options());",
                      f'    {_DISPATCH}, a{i}.scalar_type(), "matmul_{i}", [&] {{',
                      *self._matmul_launch(f"a{i}", f"b{i}", out, f"batch{i}", f"M{i}", f"N{i}", f"K{i}",
                                           "true" if tb else "false"),
                      "    });"]
        self.names[Ref("node", i)] = out
        self.plan.append("matrix product" + (" with B given as (N, K): dot products of contiguous rows" if tb else
                                              ": i-k-j loop order so the inner loop streams a row of B"))

    def _matmul_helper(self) -> str:
        return """
// C[b] = A[b] @ B[b] (B is (K, N), or (N, K) read transposed); float accumulation.
template <typename scalar_t>
static void matmul_batched(const scalar_t* A, const scalar_t* B, scalar_t* C, int64_t batch, int64_t M, int64_t N,
                           int64_t K, bool b_transposed) {
    std::vector<float> acc(N);
    for (int64_t bi = 0; bi < batch; ++bi) {
        const scalar_t* a = A + bi * M * K;
        const scalar_t* bm = B + bi * K * N;
        scalar_t* c = C + bi * M * N;
        for (int64_t m = 0; m < M; ++m) {
            std::fill(acc.begin(), acc.end(), 0.f);
            if (b_transposed) {
                for (int64_t n = 0; n < N; ++n) {
                    float s = 0.f;
                    for (int64_t k = 0; k < K; ++k) s += static_cast<float>(a[m * K + k]) * static_cast<float>(bm[n * K + k]);
                    acc[n] = s;
                }
            } else {
                for (int64_t k = 0; k < K; ++k) {
                    const float av = static_cast<float>(a[m * K + k]);
                    const scalar_t* brow = bm + k * N;
                    for (int64_t n = 0; n < N; ++n) acc[n] += av * static_cast<float>(brow[n]);
                }
            }
            for (int64_t n = 0; n < N; ++n) c[m * N + n] = static_cast<scalar_t>(acc[n]);
        }
    }
}
"""

    def _matmul_launch(self, a, b, out, batch, M, N, K, tb) -> list[str]:
        return [f"        matmul_batched<scalar_t>({a}.data_ptr<scalar_t>(), {b}.data_ptr<scalar_t>(), "
                f"{out}.data_ptr<scalar_t>(), {batch}, {M}, {N}, {K}, {tb});"]

    def loss(self, i: int) -> None:
        node = self.g.nodes[i]
        a = self.value(node.args[0])
        b = self.value(node.args[1])
        out = f"t{i}"
        self.helpers[f"loss_{node.op}"] = self._loss_helper(node.op)
        self.body += [f"    auto a{i} = {a}.contiguous();",
                      f"    auto b{i} = {b}.contiguous();",
                      f"    auto {out} = torch::empty(std::vector<int64_t>{{}}, a{i}.options());",
                      f'    {_DISPATCH}, a{i}.scalar_type(), "loss_{i}", [&] {{',
                      *self._loss_launch(node.op, f"a{i}", f"b{i}", out),
                      "    });"]
        self.names[Ref("node", i)] = out
        self.plan.append(f"{node.op}: one pass over both operands accumulating the per-element term in double, "
                         f"then divide by the element count")

    def _loss_helper(self, op: str) -> str:
        return f"""
// mean over all elements of the {op} term of d = a - b.
template <typename scalar_t>
static double loss_{op}(const scalar_t* a, const scalar_t* b, int64_t n) {{
    double acc = 0.0;
    for (int64_t i = 0; i < n; ++i) {{
        const float d = static_cast<float>(a[i]) - static_cast<float>(b[i]);
        acc += {_LOSS_EXPR[op]};
    }}
    return acc / static_cast<double>(n);
}}
"""

    def _loss_launch(self, op, a, b, out) -> list[str]:
        return [f"        {out}.data_ptr<scalar_t>()[0] = static_cast<scalar_t>((float)loss_{op}<scalar_t>("
                f"{a}.data_ptr<scalar_t>(), {b}.data_ptr<scalar_t>(), {a}.numel()));"]

    # --- assembly
    def source(self) -> str:
        self.build()
        out = self.names[Ref("node", self.g.out_node)]
        head = ["#include <torch/extension.h>", "#include <algorithm>", "#include <cmath>", "#include <vector>"]
        sig = ", ".join(self.cpp_args)
        fn = [f"torch::Tensor forward_impl({sig}) {{", *self.locals, *[ln for ln in self.body if ln],
              f"    return {out};", "}"]
        return "\n".join(head) + "\n" + "".join(self.helpers.values()) + "\n" + "\n".join(fn) + "\n"


# ------------------------------------------------------------------------------------------ the answer

def _init_source(source: str) -> str:
    """``Model.__init__`` of the reference, verbatim (indented for a class body)."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    seg = ast.get_source_segment(source, fn, padded=True)
                    if seg:
                        return textwrap.indent(textwrap.dedent(seg), "    ")
    raise Unsupported("the reference has no Model.__init__")


def _forward_args(source: str) -> list[str]:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
                    return [a.arg for a in fn.args.args[1:]]
    raise Unsupported("the reference has no Model.forward")


def _plan_text(task: GeneratedTask, gen: _Gen) -> str:
    g = task.graph
    assert g is not None
    shapes = "; ".join(f"{i.name}: {list(i.spec.sizes('cpu'))} {i.spec.dtype}"
                       + (" (non-contiguous)" if i.layout != "contiguous" else "") for i in g.inputs)
    out = g.nodes[g.out_node].out
    steps = [f"1. Semantics: {task.description}",
             "2. Scalar math: every element is computed in float (double for accumulations) and rounded to the "
             "tensor dtype after each op, as the op-by-op reference rounds.",
             f"3. Shapes: inputs {shapes}; output {list(out.sizes('cpu'))} {out.dtype}.",
             "4. Index mapping: " + "; ".join(gen.plan) + ".",
             "5. Boundaries: inputs are made contiguous first (strided views are copied once), broadcast operands "
             "are expanded to the full shape, and loops run to the exact sizes read at run time.",
             "6. Pitfalls: subtract the running maximum before exponentiating, keep accumulators in higher "
             "precision, and dispatch on float32/float16/bfloat16."]
    return "\n".join(steps)


def offline_answer(task: GeneratedTask, backend: str = "cpu") -> TeacherAnswer:
    """The template teacher's answer for ``task``; raises :class:`Unsupported` with the reason otherwise."""
    gen = _Gen(task, backend) if backend == "cpu" else _CudaGen(task, backend)
    kernel = gen.source()
    digest = hashlib.sha256(kernel.encode()).hexdigest()[:12]
    fwd_args = _forward_args(task.source)
    init = _init_source(task.source)
    if backend == "cpu":
        build = (f'ext = load_inline(name="ds_cpu_{digest}", cpp_sources=cpp_source, functions=["forward_impl"], '
                 f'extra_cflags=["-O3"], verbose=False)')
        src_decl = f'cpp_source = r"""\n{kernel}"""'
    else:
        build = (f'ext = load_inline(name="ds_cuda_{digest}", cpp_sources=cpp_decl, cuda_sources=cuda_source, '
                 f'functions=["forward_impl"], extra_cuda_cflags=["-O3"], verbose=False)')
        decl = kernel.split("torch::Tensor forward_impl(")[1].split(")", 1)[0]
        src_decl = (f'cuda_source = r"""\n{kernel}"""\n\n'
                    f'cpp_decl = "torch::Tensor forward_impl({decl});"')
    code = "\n".join([
        "import torch", "import torch.nn as nn", "from torch.utils.cpp_extension import load_inline", "", src_decl, "",
        build, "", "", "class ModelNew(nn.Module):", init.rstrip(), "",
        f"    def forward(self, {', '.join(fwd_args)}):",
        f"        return ext.forward_impl({', '.join(gen.py_args)})", ""])
    response = (f"Plan:\n{_plan_text(task, gen)}\n\n```python\n{code}```\n")
    return TeacherAnswer(task.task_id, backend, f"{backend}:" + "+".join(gen.kinds), response, code)


# ------------------------------------------------------------------------------------------ cuda

_CUDA_HEAD = """#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <vector>
"""

_CUDA_BLOCK_REDUCE = """
// Block-wide reduction: warp shuffles, then one value per warp through shared memory.
template <typename Op>
__device__ float block_reduce(float v, Op op) {
    // threads beyond the last warp contribute the operation's identity
    __shared__ float warp_vals[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, off));
    __syncthreads();
    if (lane == 0) warp_vals[warp] = v;
    __syncthreads();
    const int nwarps = (blockDim.x + 31) >> 5;
    v = threadIdx.x < nwarps ? warp_vals[threadIdx.x] : Op::identity();
    if (warp == 0)
        for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, off));
    __shared__ float result;
    if (threadIdx.x == 0) result = v;
    __syncthreads();
    return result;
}
struct SumOp { __device__ static float identity() { return 0.f; } __device__ float operator()(float a, float b) const { return a + b; } };
struct MaxOp { __device__ static float identity() { return -INFINITY; } __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct MinOp { __device__ static float identity() { return INFINITY; } __device__ float operator()(float a, float b) const { return fminf(a, b); } };
struct ProdOp { __device__ static float identity() { return 1.f; } __device__ float operator()(float a, float b) const { return a * b; } };
"""

_CUDA_SPLIT = _CPU_SPLIT


class _CudaGen(_Gen):
    """The same walk, with CUDA kernels: grid-stride elementwise loops, one block per reduced row when the
    reduced axis is innermost (warp-shuffle block reductions), one thread per output otherwise."""

    def _cuda_split(self) -> str:
        return _CUDA_SPLIT

    def _launch_cfg(self, n: str) -> list[str]:
        return [f"        const int threads = 256;",
                f"        const int blocks = static_cast<int>(std::min<int64_t>(({n} + threads - 1) / threads, 65535));",
                "        auto stream = c10::cuda::getCurrentCUDAStream();"]

    def _elementwise_loop(self, m, out, extras, steps, tag):
        params = "".join(f", const scalar_t* __restrict__ {p}" for _, p in extras)
        body = "\n".join(f"        {s}" for s in steps)
        scal = [a for a in self.locals]
        scal_params = "".join(f", float {ln.split()[2]}" for ln in scal)
        self.helpers[f"ew_{tag}"] = f"""
template <typename scalar_t>
__global__ void elementwise_{tag}(const scalar_t* __restrict__ src{params}, scalar_t* __restrict__ dst, int64_t n{scal_params}) {{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {{
        float v = static_cast<float>(src[i]);
{body}
        dst[i] = static_cast<scalar_t>(v);
    }}
}}
"""
        args = "".join(f", {e}.data_ptr<scalar_t>()" for e, _ in extras)
        sargs = "".join(f", {ln.split()[2]}" for ln in scal)
        return [f"    auto {out} = torch::empty_like({m});",
                f"    const int64_t n{tag} = {m}.numel();",
                f'    {_DISPATCH}, {m}.scalar_type(), "elementwise_{tag}", [&] {{',
                *self._launch_cfg(f"n{tag}"),
                f"        elementwise_{tag}<scalar_t><<<blocks, threads, 0, stream>>>({m}.data_ptr<scalar_t>(){args}, "
                f"{out}.data_ptr<scalar_t>(), n{tag}{sargs});",
                "    });",
                "    C10_CUDA_KERNEL_LAUNCH_CHECK();"]

    def _reduce_helper(self, kind: str) -> str:
        self.helpers["block_reduce"] = _CUDA_BLOCK_REDUCE
        self.helpers["rnd"] = _CUDA_RND
        one_pass = {"sum": ("0.f", "SumOp()", "acc", "acc += v;"), "mean": ("0.f", "SumOp()", "acc / R", "acc += v;"),
                    "amax": ("-INFINITY", "MaxOp()", "acc", "acc = fmaxf(acc, v);"),
                    "amin": ("INFINITY", "MinOp()", "acc", "acc = fminf(acc, v);"),
                    "prod": ("1.f", "ProdOp()", "acc", "acc *= v;"),
                    "l2norm": ("0.f", "SumOp()", "sqrtf(acc)", "acc += v * v;")}
        if kind in one_pass:
            init, op, fin, upd = one_pass[kind]
            row = f"""
    float acc = {init};
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) {{ const float v = static_cast<float>(base[r]); {upd} }}
    acc = block_reduce(acc, {op});
    if (threadIdx.x == 0) dst[row] = static_cast<out_t>({fin});"""
            col = f"""
        float acc = {init};
        for (int64_t r = 0; r < R; ++r) {{ const float v = static_cast<float>(base[r * inner]); {upd} }}
        dst[idx] = static_cast<out_t>({fin});"""
        elif kind in ("var", "std", "logsumexp"):
            if kind == "logsumexp":
                row = """
    float mx = -INFINITY;
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) mx = fmaxf(mx, static_cast<float>(base[r]));
    mx = block_reduce(mx, MaxOp());
    float s = 0.f;
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) s += rnd<scalar_t>(expf(rnd<scalar_t>(static_cast<float>(base[r]) - mx)));
    s = block_reduce(s, SumOp());
    if (threadIdx.x == 0) dst[row] = static_cast<out_t>(mx + rnd<scalar_t>(logf(rnd<scalar_t>(s))));"""
                col = """
        float mx = -INFINITY;
        for (int64_t r = 0; r < R; ++r) mx = fmaxf(mx, static_cast<float>(base[r * inner]));
        float s = 0.f;
        for (int64_t r = 0; r < R; ++r) s += rnd<scalar_t>(expf(rnd<scalar_t>(static_cast<float>(base[r * inner]) - mx)));
        dst[idx] = static_cast<out_t>(mx + rnd<scalar_t>(logf(rnd<scalar_t>(s))));"""
            else:
                fin = "sqrtf(ss / (R - 1))" if kind == "std" else "ss / (R - 1)"
                row = f"""
    float s = 0.f;
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) s += static_cast<float>(base[r]);
    const float mean = block_reduce(s, SumOp()) / R;
    float ss = 0.f;
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) {{ const float d = static_cast<float>(base[r]) - mean; ss += d * d; }}
    ss = block_reduce(ss, SumOp());
    if (threadIdx.x == 0) dst[row] = static_cast<out_t>({fin});"""
                col = f"""
        float s = 0.f;
        for (int64_t r = 0; r < R; ++r) s += static_cast<float>(base[r * inner]);
        const float mean = s / R;
        float ss = 0.f;
        for (int64_t r = 0; r < R; ++r) {{ const float d = static_cast<float>(base[r * inner]) - mean; ss += d * d; }}
        dst[idx] = static_cast<out_t>({fin});"""
        else:  # argmax / argmin: one thread per output element
            cmp = ">" if kind == "argmax" else "<"
            col = f"""
        float best = static_cast<float>(base[0]);
        int64_t arg = 0;
        for (int64_t r = 1; r < R; ++r) {{ const float v = static_cast<float>(base[r * inner]); if (v {cmp} best) {{ best = v; arg = r; }} }}
        dst[idx] = static_cast<out_t>(arg);"""
            row = None
        text = f"""
// {kind}: thread per output element, reading the reduced axis with stride `inner` (coalesced across threads).
template <typename scalar_t, typename out_t>
__global__ void reduce_{kind}_cols(const scalar_t* __restrict__ src, out_t* __restrict__ dst, int64_t outer, int64_t R, int64_t inner) {{
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < outer * inner; idx += (int64_t)gridDim.x * blockDim.x) {{
        const int64_t o = idx / inner, i = idx % inner;
        const scalar_t* base = src + o * R * inner + i;{col}
    }}
}}
"""
        if row:
            text += f"""
// {kind}: one block per row when the reduced axis is contiguous.
template <typename scalar_t, typename out_t>
__global__ void reduce_{kind}_rows(const scalar_t* __restrict__ src, out_t* __restrict__ dst, int64_t R) {{
    const int64_t row = blockIdx.x;
    const scalar_t* base = src + row * R;{row}
}}
"""
        return text

    def _reduce_launch(self, kind, inp, out, sp, out_t):
        rows = kind not in ("argmax", "argmin")
        lines = ["        auto stream = c10::cuda::getCurrentCUDAStream();"]
        if rows:
            lines += [f"        if ({sp}.inner == 1) {{",
                      f"            reduce_{kind}_rows<scalar_t, {out_t}><<<{sp}.outer, 256, 0, stream>>>("
                      f"{inp}.data_ptr<scalar_t>(), {out}.data_ptr<{out_t}>(), {sp}.R);",
                      "        } else {"]
        lines += [f"            const int64_t total = {sp}.outer * {sp}.inner;",
                  "            const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));",
                  f"            reduce_{kind}_cols<scalar_t, {out_t}><<<blocks, 256, 0, stream>>>({inp}.data_ptr<scalar_t>(), "
                  f"{out}.data_ptr<{out_t}>(), {sp}.outer, {sp}.R, {sp}.inner);"]
        if rows:
            lines.append("        }")
        lines.append("        C10_CUDA_KERNEL_LAUNCH_CHECK();")
        return lines

    def _rowwise_helper(self, kind: str) -> str:
        self.helpers["block_reduce"] = _CUDA_BLOCK_REDUCE
        self.helpers["rnd"] = _CUDA_RND
        if kind == "l2_normalize":
            row_stats = """
    float ss = 0.f;
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) { const float v = static_cast<float>(base[r]); ss += v * v; }
    const float nrm = fmaxf(rnd<scalar_t>(sqrtf(block_reduce(ss, SumOp()))), 1e-12f);"""
            row_write = "static_cast<float>(base[r]) / nrm"
            col_stats = """
        float ss = 0.f;
        for (int64_t r = 0; r < R; ++r) { const float v = static_cast<float>(base[r * inner]); ss += v * v; }
        const float nrm = fmaxf(rnd<scalar_t>(sqrtf(ss)), 1e-12f);"""
            col_write = "static_cast<float>(base[r * inner]) / nrm"
        else:
            row_stats = """
    float mx = -INFINITY;
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) mx = fmaxf(mx, static_cast<float>(base[r]));
    mx = block_reduce(mx, MaxOp());
    float s = 0.f;
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) s += expf(static_cast<float>(base[r]) - mx);
    s = block_reduce(s, SumOp());"""
            col_stats = """
        float mx = -INFINITY;
        for (int64_t r = 0; r < R; ++r) mx = fmaxf(mx, static_cast<float>(base[r * inner]));
        float s = 0.f;
        for (int64_t r = 0; r < R; ++r) s += expf(static_cast<float>(base[r * inner]) - mx);"""
            if kind == "softmax":
                row_write, col_write = ("expf(static_cast<float>(base[r]) - mx) / s",
                                        "expf(static_cast<float>(base[r * inner]) - mx) / s")
            else:
                row_write, col_write = ("static_cast<float>(base[r]) - mx - logf(s)",
                                        "static_cast<float>(base[r * inner]) - mx - logf(s)")
        return f"""
// {kind}: one block per row when the axis is contiguous (block reductions), else one thread per column.
template <typename scalar_t>
__global__ void rowwise_{kind}_rows(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst, int64_t R) {{
    const scalar_t* base = src + blockIdx.x * R;
    scalar_t* out = dst + blockIdx.x * R;{row_stats}
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) out[r] = static_cast<scalar_t>({row_write});
}}

template <typename scalar_t>
__global__ void rowwise_{kind}_cols(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst, int64_t outer, int64_t R, int64_t inner) {{
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < outer * inner; idx += (int64_t)gridDim.x * blockDim.x) {{
        const int64_t o = idx / inner, i = idx % inner;
        const scalar_t* base = src + o * R * inner + i;
        scalar_t* out = dst + o * R * inner + i;{col_stats}
        for (int64_t r = 0; r < R; ++r) out[r * inner] = static_cast<scalar_t>({col_write});
    }}
}}
"""

    def _rowwise_launch(self, kind, inp, out, sp):
        return ["        auto stream = c10::cuda::getCurrentCUDAStream();",
                f"        if ({sp}.inner == 1) {{",
                f"            rowwise_{kind}_rows<scalar_t><<<{sp}.outer, 256, 0, stream>>>({inp}.data_ptr<scalar_t>(), "
                f"{out}.data_ptr<scalar_t>(), {sp}.R);",
                "        } else {",
                f"            const int64_t total = {sp}.outer * {sp}.inner;",
                "            const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));",
                f"            rowwise_{kind}_cols<scalar_t><<<blocks, 256, 0, stream>>>({inp}.data_ptr<scalar_t>(), "
                f"{out}.data_ptr<scalar_t>(), {sp}.outer, {sp}.R, {sp}.inner);",
                "        }",
                "        C10_CUDA_KERNEL_LAUNCH_CHECK();"]

    def _scan_helper(self, kind: str) -> str:
        init, upd = {"cumsum": ("0.f", "acc += v;"), "cumprod": ("1.f", "acc *= v;"),
                     "logcumsumexp": ("-INFINITY", "{ const float m = fmaxf(acc, v); acc = isinf(m) && m < 0 ? m : "
                                                   "m + logf(expf(acc - m) + expf(v - m)); }")}[kind]
        return f"""
// {kind}: one thread per (outer, inner) position walks the scanned axis sequentially.
template <typename scalar_t>
__global__ void scan_{kind}(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst, int64_t outer, int64_t R, int64_t inner) {{
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < outer * inner; idx += (int64_t)gridDim.x * blockDim.x) {{
        const int64_t o = idx / inner, i = idx % inner;
        float acc = {init};
        for (int64_t r = 0; r < R; ++r) {{
            const int64_t at = (o * R + r) * inner + i;
            const float v = static_cast<float>(src[at]);
            {upd}
            dst[at] = static_cast<scalar_t>(acc);
        }}
    }}
}}
"""

    def _scan_launch(self, kind, inp, out, sp):
        return ["        auto stream = c10::cuda::getCurrentCUDAStream();",
                f"        const int64_t total = {sp}.outer * {sp}.inner;",
                "        const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));",
                f"        scan_{kind}<scalar_t><<<blocks, 256, 0, stream>>>({inp}.data_ptr<scalar_t>(), "
                f"{out}.data_ptr<scalar_t>(), {sp}.outer, {sp}.R, {sp}.inner);",
                "        C10_CUDA_KERNEL_LAUNCH_CHECK();"]

    def _norm_helper(self, op: str) -> str:
        self.helpers["block_reduce"] = _CUDA_BLOCK_REDUCE
        if op == "layer_norm":
            stats = """
    float s = 0.f;
    for (int64_t k = threadIdx.x; k < D; k += blockDim.x) s += static_cast<float>(x[k]);
    const float mean = block_reduce(s, SumOp()) / D;
    float ss = 0.f;
    for (int64_t k = threadIdx.x; k < D; k += blockDim.x) { const float c = static_cast<float>(x[k]) - mean; ss += c * c; }
    const float inv = rsqrtf(block_reduce(ss, SumOp()) / D + eps);"""
            bias = " + static_cast<float>(b[k])"
        else:
            stats = """
    const float mean = 0.f;
    float ss = 0.f;
    for (int64_t k = threadIdx.x; k < D; k += blockDim.x) { const float c = static_cast<float>(x[k]); ss += c * c; }
    const float inv = rsqrtf(block_reduce(ss, SumOp()) / D + eps);"""
            bias = ""
        return f"""
// {op}: one block per row; mean and variance by block reductions, then the affine write.
template <typename scalar_t>
__global__ void norm_{op}(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst, const scalar_t* __restrict__ w,
                          const scalar_t* __restrict__ b, int64_t D, float eps) {{
    const scalar_t* x = src + blockIdx.x * D;
    scalar_t* y = dst + blockIdx.x * D;{stats}
    for (int64_t k = threadIdx.x; k < D; k += blockDim.x)
        y[k] = static_cast<scalar_t>((static_cast<float>(x[k]) - mean) * inv * static_cast<float>(w[k]){bias});
}}
"""

    def _norm_launch(self, op, inp, out, D, w, b, eps):
        bp = f"{b}.data_ptr<scalar_t>()" if b else "nullptr"
        return ["        auto stream = c10::cuda::getCurrentCUDAStream();",
                f"        norm_{op}<scalar_t><<<{inp}.numel() / {D}, 256, 0, stream>>>({inp}.data_ptr<scalar_t>(), "
                f"{out}.data_ptr<scalar_t>(), {w}.data_ptr<scalar_t>(), {bp}, {D}, {eps});",
                "        C10_CUDA_KERNEL_LAUNCH_CHECK();"]

    _GEMM = """
// Tiled GEMM, 16x16 tiles in shared memory, float accumulation:
// C[b][m][n] = sum_k A[b][m][k] * B'(k, n) (+ bias[n]); B' reads B as (K, N) or, transposed, as (N, K).
template <typename scalar_t>
__global__ void gemm_tiled(const scalar_t* __restrict__ A, const scalar_t* __restrict__ B,
                           const scalar_t* __restrict__ bias, scalar_t* __restrict__ C, int64_t M, int64_t N,
                           int64_t K, bool b_transposed, int64_t strideA, int64_t strideB) {
    __shared__ float As[16][17];
    __shared__ float Bs[16][17];
    const int64_t bz = blockIdx.z;
    A += bz * strideA;
    B += bz * strideB;
    C += bz * M * N;
    const int64_t row = blockIdx.y * 16 + threadIdx.y, col = blockIdx.x * 16 + threadIdx.x;
    float acc = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        const int64_t ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
        As[threadIdx.y][threadIdx.x] = (row < M && ka < K) ? static_cast<float>(A[row * K + ka]) : 0.f;
        float bv = 0.f;
        if (col < N && kb < K) bv = static_cast<float>(b_transposed ? B[col * K + kb] : B[kb * N + col]);
        Bs[threadIdx.y][threadIdx.x] = bv;
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < 16; ++kk) acc += As[threadIdx.y][kk] * Bs[kk][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) {
        if (bias) acc += static_cast<float>(bias[col]);
        C[row * N + col] = static_cast<scalar_t>(acc);
    }
}
"""

    def _linear_helper(self) -> str:
        return self._GEMM

    def _linear_launch(self, inp, out, w, b, M, N, K):
        bp = f"{b}.data_ptr<scalar_t>()" if b else "nullptr"
        return ["        auto stream = c10::cuda::getCurrentCUDAStream();",
                f"        dim3 block(16, 16), grid(({N} + 15) / 16, ({M} + 15) / 16, 1);",
                f"        gemm_tiled<scalar_t><<<grid, block, 0, stream>>>({inp}.data_ptr<scalar_t>(), {w}.data_ptr<scalar_t>(), "
                f"{bp}, {out}.data_ptr<scalar_t>(), {M}, {N}, {K}, true, 0, 0);",
                "        C10_CUDA_KERNEL_LAUNCH_CHECK();"]

    def _matmul_helper(self) -> str:
        return self._GEMM

    def _matmul_launch(self, a, b, out, batch, M, N, K, tb):
        return ["        auto stream = c10::cuda::getCurrentCUDAStream();",
                f"        dim3 block(16, 16), grid(({N} + 15) / 16, ({M} + 15) / 16, {batch});",
                f"        gemm_tiled<scalar_t><<<grid, block, 0, stream>>>({a}.data_ptr<scalar_t>(), {b}.data_ptr<scalar_t>(), "
                f"nullptr, {out}.data_ptr<scalar_t>(), {M}, {N}, {K}, {tb}, {M} * {K}, {K} * {N});",
                "        C10_CUDA_KERNEL_LAUNCH_CHECK();"]

    def _loss_helper(self, op: str) -> str:
        expr = _LOSS_EXPR[op].replace("std::fabs", "fabsf")
        return f"""
// {op}: per-block partial sums of the per-element term (grid-stride), then one block adds the partials.
template <typename scalar_t>
__global__ void loss_{op}_partial(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, float* partial, int64_t n) {{
    __shared__ float sh[256];
    float acc = 0.f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {{
        const float d = static_cast<float>(a[i]) - static_cast<float>(b[i]);
        acc += {expr};
    }}
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {{ if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s]; __syncthreads(); }}
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}}

template <typename scalar_t>
__global__ void loss_{op}_final(const float* partial, int nparts, scalar_t* out, int64_t n) {{
    __shared__ float sh[256];
    float acc = 0.f;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x) acc += partial[i];
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {{ if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s]; __syncthreads(); }}
    if (threadIdx.x == 0) out[0] = static_cast<scalar_t>(sh[0] / static_cast<float>(n));
}}
"""

    def _loss_launch(self, op, a, b, out):
        return ["        auto stream = c10::cuda::getCurrentCUDAStream();",
                f"        const int64_t n = {a}.numel();",
                "        const int parts = static_cast<int>(std::min<int64_t>((n + 255) / 256, 1024));",
                f"        auto partial = torch::empty({{parts}}, {a}.options().dtype(torch::kFloat));",
                f"        loss_{op}_partial<scalar_t><<<parts, 256, 0, stream>>>({a}.data_ptr<scalar_t>(), "
                f"{b}.data_ptr<scalar_t>(), partial.data_ptr<float>(), n);",
                f"        loss_{op}_final<scalar_t><<<1, 256, 0, stream>>>(partial.data_ptr<float>(), parts, "
                f"{out}.data_ptr<scalar_t>(), n);",
                "        C10_CUDA_KERNEL_LAUNCH_CHECK();"]

    def source(self) -> str:
        self.build()
        out = self.names[Ref("node", self.g.out_node)]
        sig = ", ".join(self.cpp_args)
        fn = [f"torch::Tensor forward_impl({sig}) {{", *self.locals, *[ln for ln in self.body if ln],
              f"    return {out};", "}"]
        return _CUDA_HEAD + "".join(self.helpers.values()) + "\n" + "\n".join(fn) + "\n"
