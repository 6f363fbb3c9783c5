"""The short text the model sees on its next turn, bounded to ``cfg.feedback_max_chars``.

One function per outcome; each says what happened and the most useful evidence (compiler error lines,
the first mismatching element, forbidden ops, timings). Notes (train-mode reference, MUSA warp size)
are appended when space allows; the main message is never dropped for them. The text is valid Unicode: a lone
surrogate (a candidate's ``raise RuntimeError("\\ud800")`` comes back from the child's JSON as one) is escaped,
as no tokenizer, chat template or UTF-8 writer takes it; and it is plain text (`printable`): a candidate's exception
message or output with ANSI escapes, NUL or BEL reaches neither the next prompt nor a terminal showing the verdict.
"""
from __future__ import annotations

import re
from typing import Iterable

from .types import TASK_FAULT_RULES


def bound(text: str, max_chars: int) -> str:
    text = text.strip()
    if len(text) <= max_chars:
        return text
    marker = "\n[...]\n"
    if max_chars < 3 * len(marker):   # no room for head, marker and tail: the marker alone overran the bound
        return text[:max_chars]
    head = max_chars * 2 // 3
    tail = max_chars - head - len(marker)
    return text[:head] + marker + (text[-tail:] if tail > 0 else "")


def encodable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes (the rest unchanged)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


# an ANSI escape sequence (CSI: colours, cursor moves, screen clears), and any other control character but tab and
# line feed (C0, DEL, C1)
_ANSI_CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` as plain text a model, a log or a terminal shows as written: ANSI escape sequences dropped (a
    compiler's colours, or a candidate's exception message clearing the screen of whoever reads the verdict), line
    ends made LF, other control characters (NUL, BEL, backspace, a lone ESC) written as ``\\xNN``, lone surrogates
    escaped (`encodable`)."""
    text = encodable(text)
    if not _CONTROL.search(text):
        return text
    text = _ANSI_CSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def compose(main: str, notes: Iterable[str], max_chars: int) -> str:
    notes = [printable(n) for n in notes if n]
    body = printable(main).strip()
    extra = "".join(f"\nNote: {n}" for n in notes)
    if len(body) + len(extra) <= max_chars:
        return body + extra
    room = max_chars - len(extra)
    if room >= max_chars // 2:
        return bound(body, room) + extra
    return bound(body + extra, max_chars)


def format_error(message: str) -> str:
    return f"Format error: {message}. Answer with one ```python block defining class ModelNew(nn.Module)."


def cheating(rule: str, message: str, ops: Iterable[str] = ()) -> str:
    ops = list(ops)
    text = f"Rejected ({rule}): {message}"
    if ops:
        text += "\nForbidden PyTorch ops in ModelNew.forward: " + ", ".join(f"aten::{o}" for o in ops[:30])
        text += ("\nOnly allocation/view ops may run outside your own kernels; implement the computation in "
                 "native code (no at::/torch:: compute calls inside the extension either).")
    return text


# Lines of a build log that say nothing about the candidate's code: ninja's steps, command lines and summary, torch's
# closing "Error building extension", glog-style warnings torch logs while building ("W1205 21:10:47.464000 7499
# .../cpp_extension.py:140] No CUDA runtime is found"). Whole lines only: a compiler's quote of the candidate's source
# starts with its line number ("    6 |   ..."), so no line of the candidate's is taken for one of these.
_BUILD_NOISE = re.compile(r"(?:ninja: build stopped|Error building extension |FAILED: |\[\d+/\d+\] "
                          r"|[WIEF]\d{4} [\d:.]+ +\d+ [^\]\n]*\] ).*")
# the directory of a build's generated sources (main.cpp, cuda.cu): temporary, and long; and an installed package's
_BUILD_DIR = re.compile(r"(?<![\w.])/[^\s:'\"()<>]*/(?=(?:main\.cpp|cuda\.cu)\b)")
_PACKAGES_DIR = re.compile(r"(?<![\w.])/[^\s:'\"()<>]*/(?:site|dist)-packages/")


def build_log(log: str) -> str:
    """A build log as the model reads it: ninja's and torch's lines dropped (`_BUILD_NOISE`), and blank lines; the
    build directory left out of the generated sources' paths (``main.cpp:6:3: error: ...``) and the install prefix
    out of a package's (``torch/include/ATen/...``). The compiler's lines are otherwise as it wrote them."""
    dirs = set(_BUILD_DIR.findall(log))
    lines = []
    for line in log.splitlines():
        if not line.strip() or _BUILD_NOISE.fullmatch(line):
            continue
        for d in dirs:
            line = line.replace(d, "")
        lines.append(_PACKAGES_DIR.sub("", line))
    return "\n".join(lines)


def compile_error(log: str, limit: int = 1200) -> str:
    """The log's beginning and its end, without the build's noise (`build_log`). The log is
    ``build.compiler_excerpt``'s, which starts at the compiler's first error: its tail alone (an ambiguous call's
    candidate notes and include chains run to kilobytes) left the model only ``In file included from ...`` lines and
    never the error."""
    text = build_log(log).strip() or log.strip()
    if not text:
        return "Compilation failed:\n(no compiler output)"
    if len(text) > limit:
        head = text[:limit * 2 // 3]
        text = head + "\n[...]\n" + text[-(limit - len(head)):]
    return "Compilation failed:\n" + text


def runtime_error(where: str, error: str, traceback: str = "", limit: int = 1200) -> str:
    """The exception (type and message, once) first: what went wrong; then where. ``traceback`` is the child's
    (``_child._frames_for_model``): a ``Traceback (...)`` header and the candidate's own frames, without the
    message and without the harness's frames. Where it does not fit, its header and its innermost frames are kept.
    Any other text is shown by its end, under ``Traceback (end):``."""
    error = error.strip()[:limit]
    text = f"Runtime error ({where}):\n{error}"
    room = limit - len(error)
    tb = traceback.strip()
    if not tb or room <= 200:
        return text
    head, body = "Traceback (end):", tb
    if tb.startswith("Traceback ("):
        head, _, body = tb.partition("\n")
        head = head[:120]   # room - 121 > 79 is left for the frames
    room -= len(head) + 1
    if len(body) > room:   # from a frame's first line ("  kernel_candidate, line 7, in f"), else a line's
        tail = body[-room + len("[...]\n"):]
        frame = re.search(r"\n(?=  \S)", tail)
        cut = frame.start() if frame else tail.find("\n")
        body = "[...]\n" + (tail[cut + 1:] if 0 <= cut < 400 else tail)
    return text + "\n" + head + ("\n" + body if body else "")


def timeout(stage: str, seconds: float) -> str:
    return f"Timeout: {stage} did not finish within {seconds:.0f} s (infinite loop or far too slow)."


def correctness(q: float, passed: int, total: int, first: str | None, max_abs: float | None,
                max_rel: float | None) -> str:
    text = f"Incorrect: {passed}/{total} random trials matched the reference (q={q:.2f})."
    if first:
        text += f"\nFirst mismatch: {first}"
    if max_abs is not None and max_rel is not None:
        text += f"\nmax abs diff {max_abs:.3g}, max diff relative to the reference scale {max_rel:.3g}"
    return text


def passed(t_ref_ms: float, t_cand_ms: float, speedup: float, speedup_compile: float | None) -> str:
    text = (f"Correct on all trials. Reference {t_ref_ms:.4g} ms, yours {t_cand_ms:.4g} ms "
            f"(median): speedup {speedup:.3g}x.")
    if speedup_compile is not None:
        text += f" Versus torch.compile: {speedup_compile:.3g}x."
    return text


def infra(message: str, rule: str | None = None) -> str:
    """An ``infra`` verdict's text: retried, unless its ``rule`` makes it the task's own fault (`TASK_FAULT_RULES`)."""
    if rule in TASK_FAULT_RULES:
        return f"Task error (not your fault: the task itself fails here, so it is not retried; {rule}): {message}"
    return f"Verifier infrastructure error (not your fault; will be retried): {message}"


TRAIN_MODE_NOTE = ("the reference runs in training mode (KernelBench semantics): BatchNorm/InstanceNorm use "
                   "batch statistics and dropout is active.")
