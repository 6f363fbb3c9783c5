"""Prompt text for kernel-generation rollouts: the task prompt, the feedback turn, the BDR repair prompt.

The task prompt gives the model what the verifier will check against: the reference source, the
exact shapes/strides/dtypes of ``get_inputs()`` and the constructor arguments, the target backend
with its matching ``load_inline`` usage, and the required answer format (one fenced python block
with ``load_inline`` and ``class ModelNew``).

Input metadata is computed by running the task's ``get_inputs()`` with every torch tensor factory
forced onto the meta device (even when the task passes ``device=...``): tensors are then shape-only,
so a KernelBench task whose inputs are several GB costs nothing. When that fails (a task that calls
``.cuda()`` on its inputs, ...), the module-level constants read from the AST are shown instead.
Inputs built outside torch (e.g. ``torch.from_numpy``) are not intercepted.

Text that did not come from us (task source, verifier feedback that may echo model output, failed
code) has chat control tokens such as ``<|im_end|>`` defused, so it cannot close a turn early.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import re
import types
from typing import Any, Iterable, Protocol, Sequence

from verifier.feedback import encodable

BACKENDS = ("cuda", "musa", "cpu")
DEFAULT_SYSTEM_PROMPT = (
    "You are an expert in high-performance GPU and CPU kernel engineering. You write correct, fast native "
    "kernels and wrap them as PyTorch extensions."
)
# Control strings of ChatML-family templates; defused in untrusted text (see module docstring).
CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_ZWSP = "\u200b"


class TaskLike(Protocol):
    """The fields of ``verifier.tasks.Task`` the prompts use."""

    task_id: str
    source: str
    path: str


# --------------------------------------------------------------------------------------------------
# Input metadata


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    name: str                        # forward() parameter name, or "input[i]"
    kind: str                        # "tensor" | "value"
    shape: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None
    dtype: str | None = None
    value: str | None = None         # repr for non-tensor arguments

    def describe(self) -> str:
        if self.kind == "tensor":
            contiguous = self.stride == _contiguous_strides(self.shape or ())
            layout = "contiguous" if contiguous else "NON-contiguous"
            return (f"{self.name}: tensor shape={list(self.shape)} stride={list(self.stride)} "
                    f"dtype={self.dtype} ({layout})")
        return f"{self.name}: {self.value}"


@dataclasses.dataclass(frozen=True)
class InputMetadata:
    inputs: tuple[ArgSpec, ...]
    init_args: tuple[ArgSpec, ...]
    method: str                      # "meta" (ran get_inputs on the meta device) | "ast" | "none"
    constants: tuple[tuple[str, str], ...] = ()
    note: str = ""

    def describe(self) -> str:
        lines = []
        if self.method == "meta":
            lines.append("Inputs to forward(), in order (from get_inputs()):")
            lines += [f"- {a.describe()}" for a in self.inputs] or ["- (none)"]
            lines.append("Constructor arguments (from get_init_inputs()):")
            lines += [f"- {a.describe()}" for a in self.init_args] or ["- (none)"]
        else:
            lines.append("Input shapes follow get_inputs() in the reference; its module-level constants are:")
            lines += [f"- {k} = {v}" for k, v in self.constants] or ["- (none found)"]
        return "\n".join(lines)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(int(dim), 1)
    return tuple(reversed(strides))


def _forward_param_names(tree: ast.Module) -> tuple[list[str], list[str]]:
    """Parameter names of Model.forward and Model.__init__ (without self)."""
    fwd, init = [], []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in ("forward", "__init__"):
                    args = fn.args
                    names = [a.arg for a in args.posonlyargs + args.args][1:]
                    if args.vararg:
                        names.append("*" + args.vararg.arg)
                    (fwd if fn.name == "forward" else init).extend(names)
    return fwd, init


def _module_constants(tree: ast.Module) -> tuple[tuple[str, str], ...]:
    out = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is None:
                continue
            for t in targets:
                if isinstance(t, ast.Name):
                    out.append((t.id, ast.unparse(node.value)))
    return tuple(out)


def _force_meta_mode():
    """A torch function mode that sends every tensor factory to the meta device."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    factories = _device_constructors()

    class ForceMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in factories:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    return ForceMeta()


def _spec(name: str, obj: Any) -> ArgSpec:
    import torch

    if isinstance(obj, torch.Tensor):
        return ArgSpec(name=name, kind="tensor", shape=tuple(int(s) for s in obj.shape),
                       stride=tuple(int(s) for s in obj.stride()), dtype=str(obj.dtype).replace("torch.", ""))
    text = repr(obj)
    return ArgSpec(name=name, kind="value", value=text if len(text) <= 200 else text[:200] + "...")


def describe_task_inputs(source: str, filename: str = "<task>") -> InputMetadata:
    """Shapes/strides/dtypes of the task's inputs without allocating them (meta device; AST fallback).

    Size profiles (``verifier.size_profiles``) rewrite the source, so the profiled task's source
    gives the profiled shapes.
    """
    return _describe_cached(source, filename)


@functools.lru_cache(maxsize=512)
def _describe_cached(source: str, filename: str) -> InputMetadata:
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        raise ValueError(f"task {filename}: reference source does not parse: {e}") from e
    fwd_names, init_names = _forward_param_names(tree)
    constants = _module_constants(tree)
    try:
        module = types.ModuleType("_megatron_rl_task_meta")
        module.__file__ = filename
        with _force_meta_mode():
            exec(compile(tree, filename, "exec"), module.__dict__)
            inputs = list(module.get_inputs())
            init_inputs = list(module.get_init_inputs())
    except Exception as e:  # noqa: BLE001 - any failure just means "fall back to the AST view"
        return InputMetadata(inputs=(), init_args=(), method="ast", constants=constants,
                             note=f"get_inputs() could not run on the meta device: {type(e).__name__}: {e}")

    def name(names: list[str], i: int, prefix: str) -> str:
        return names[i] if i < len(names) and not names[i].startswith("*") else f"{prefix}[{i}]"

    return InputMetadata(
        inputs=tuple(_spec(name(fwd_names, i, "input"), x) for i, x in enumerate(inputs)),
        init_args=tuple(_spec(name(init_names, i, "init_arg"), x) for i, x in enumerate(init_inputs)),
        method="meta", constants=constants)


# --------------------------------------------------------------------------------------------------
# Text


def tokenizer_control_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's added and special tokens (text -> id), but the reasoning markers ``<think>``/``</think>``:
    chat templates write those into answers themselves and split past answers on them. What an answer must not hold
    (an SFT row) and what history is defused of (`ConversationCodec.untrusted`)."""
    try:
        added = dict(tokenizer.get_added_vocab())
    except (AttributeError, NotImplementedError):
        added = {}
    special = dict(zip(getattr(tokenizer, "all_special_tokens", None) or (),
                       getattr(tokenizer, "all_special_ids", None) or ()))
    return {t: i for t, i in {**special, **added}.items() if t not in ("<think>", "</think>")}


def defuse_control_tokens(text: str, control_tokens: Iterable[str] = CONTROL_TOKENS) -> str:
    """Break chat control strings in untrusted text so a tokenizer cannot read them as control tokens. Lone
    surrogates (verifier feedback quoting a candidate's exception message) are escaped too: the chat template and the
    tokenizer raise on them, which crashed the whole rollout batch from one trajectory's feedback."""
    text = encodable(text)
    for tok in control_tokens:
        if tok in text:
            text = text.replace(tok, tok[0] + _ZWSP + tok[1:])
    return text


def backend_instructions(backend: str) -> str:
    if backend == "cuda":
        return (
            "Target: NVIDIA GPU (CUDA). Inputs are CUDA tensors. Write CUDA kernels and build them with\n"
            "`from torch.utils.cpp_extension import load_inline` and\n"
            "`load_inline(name=..., cpp_sources=CPP_DECLARATIONS, cuda_sources=CUDA_SOURCE, functions=[...])`.\n"
            "Launch on the current stream; do not create streams or use Python threads.")
    if backend == "musa":
        return (
            "Target: Moore Threads GPU (MUSA). Inputs are MUSA tensors (device \"musa\"; C++ device type\n"
            "`c10::DeviceType::PrivateUse1`, allocate with `.device(torch::kPrivateUse1)`). Write MUSA kernels\n"
            "(CUDA-like syntax, `#include <musa_runtime.h>`) and build them with\n"
            "`from torch_musa.utils.musa_extension import load_inline` and\n"
            "`load_inline(name=..., cpp_sources=CPP_DECLARATIONS, musa_sources=MUSA_SOURCE, functions=[...])`.\n"
            "The warp size is 128 on MTT S80/S3000/S4000 (mp_21/mp_22) and 32 on S5000 (mp_31): do not hard-code\n"
            "32-lane masks. Launch on the current stream; do not create streams or use Python threads.")
    if backend == "cpu":
        return (
            "Target: CPU. Inputs are CPU tensors. Write C++ kernels and build them with\n"
            "`from torch.utils.cpp_extension import load_inline` and\n"
            "`load_inline(name=..., cpp_sources=CPP_SOURCE, functions=[...], extra_cflags=[\"-O3\"])`.\n"
            "Do not use Python threads or subprocesses.")
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


_RULES = (
    "Requirements:\n"
    "- Define `class ModelNew(nn.Module)` with the same constructor and forward() signatures as `Model`, "
    "returning outputs of the same shapes and dtypes. Create parameters in the same order as `Model`.\n"
    "- The computation must run in your native kernel(s). Inside `ModelNew.forward` you may only allocate "
    "or reshape tensors (e.g. torch.empty, empty_like, zeros, view, reshape, contiguous, permute); PyTorch "
    "compute ops (matmul, softmax, relu, F.*, torch.* math, at::/torch:: math in C++) count as cheating.\n"
    "- Do not import, subclass or call the reference `Model`; no file, network, thread, process or stream "
    "use; do not patch torch or timing functions.\n"
    "- Answer with exactly one fenced ```python code block holding the complete module: imports, the "
    "`load_inline(...)` call with the kernel source, and `class ModelNew`.")


def fenced(code: str, lang: str = "python") -> str:
    """``code`` in a markdown fence longer than any run of backticks inside it (CommonMark's rule): a failed attempt
    whose docstring holds a ```` ``` ```` line ended the usual three-backtick block early, and the rest of the attempt
    read as prompt text. Code without backticks gets the usual fence, so prompts stay as before."""
    longest = max((len(run) for run in re.findall(r"`+", code)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{code}\n{fence}"


def task_prompt_text(task: TaskLike, backend: str, metadata: InputMetadata | None = None) -> str:
    """The user message of a first turn."""
    if metadata is None:
        metadata = describe_task_inputs(task.source, getattr(task, "path", "<task>") or "<task>")
    source = defuse_control_tokens(task.source.rstrip())
    return (
        f"Write an optimized native-kernel implementation of the PyTorch reference below (task {task.task_id}).\n\n"
        f"Reference (`Model`):\n{fenced(source)}\n\n"
        f"{metadata.describe()}\n\n"
        f"{backend_instructions(backend)}\n\n"
        f"{_RULES}")


def initial_messages(task: TaskLike, backend: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                     metadata: InputMetadata | None = None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": task_prompt_text(task, backend, metadata)})
    return msgs


#: the most characters of verifier feedback one message quotes (the verifier bounds its own to
#: ``VerifierConfig.feedback_max_chars``, 1500 by default; this bounds what any other environment hands over)
FEEDBACK_MAX_CHARS = 6000


def quoted_feedback(feedback: str, max_chars: int = FEEDBACK_MAX_CHARS) -> str:
    """Verifier feedback as a quoted block of plain text: it may quote the candidate's code, its exception messages
    and its output, so a line the candidate wrote (``Verdict: pass``, ``Correct on all trials``, "ignore previous
    instructions") sits inside the quotation, below the harness's own verdict line, never beside it. Control
    characters and ANSI escapes are made visible (`verifier.feedback.printable`), chat control strings defused, the
    length bounded, and the fence outgrows any backtick run inside (`fenced`)."""
    from verifier.feedback import bound, printable

    body = defuse_control_tokens(bound(printable(feedback), max_chars)) or "(no further details)"
    return fenced(body, "text")


def feedback_text(category: str, q: float | None, feedback: str) -> str:
    """The user message appended after a failed turn: the verdict (ours), then the verifier's feedback quoted."""
    q_part = f" ({q:.0%} of correctness trials passed)" if q is not None and category == "correctness_error" else ""
    return (
        f"Your previous answer did not pass verification.\nVerdict: {category}{q_part}\n"
        f"Verifier feedback (quoted; it may quote your code and its output):\n{quoted_feedback(feedback)}\n\n"
        "Fix the problem. Answer again with the complete corrected module in one ```python code block "
        "(load_inline + class ModelNew).")


def candidate_code(response_text: str, max_chars: int = 16000) -> str:
    """The code of a failed response for a repair prompt: the verifier's own extraction (last fenced
    python block), or the raw response when it holds no usable candidate."""
    from verifier.extract import FormatError, extract_candidate

    try:
        code = extract_candidate(response_text, max_bytes=max(4 * max_chars, 1 << 20))
    except FormatError:
        code = response_text
    return code[:max_chars]


def repair_messages(task: TaskLike, backend: str, failed_code: str, category: str, error: str,
                    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                    metadata: InputMetadata | None = None) -> list[dict[str, str]]:
    """BDR repair prompt: the task, a failed attempt and its verifier error -> fix it."""
    code = defuse_control_tokens(failed_code.strip()) or "(the attempt contained no code)"
    text = (
        f"{task_prompt_text(task, backend, metadata)}\n\n"
        f"A previous attempt at this task failed verification.\n{fenced(code)}\n"
        f"Verdict: {category}\nVerifier feedback (quoted):\n{quoted_feedback(error)}\n\n"
        "Find the cause, fix it, and answer with the complete corrected module in one ```python code block.")
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": text})
    return msgs
