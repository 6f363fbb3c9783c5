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


def compile_error(log: str, limit: int = 1200) -> str:
    """The log's beginning and its end. The log is ``build.compiler_excerpt``'s, which starts at the compiler's
    first error: its tail alone (an ambiguous call's candidate notes and include chains run to kilobytes) left the
    model only ``In file included from ...`` lines and never the error."""
    text = log.strip()
    if not text:
        return "Compilation failed:\n(no compiler output)"
    if len(text) > limit:
        head = text[:limit * 2 // 3]
        text = head + "\n[...]\n" + text[-(limit - len(head)):]
    return "Compilation failed:\n" + text


def runtime_error(where: str, error: str, traceback: str = "", limit: int = 1200) -> str:
    """The exception line first (what went wrong), then the end of the traceback (where)."""
    text = f"Runtime error ({where}):\n{error.strip()[:limit]}"
    room = limit - len(error.strip()[:limit])
    tb = traceback.strip()
    if tb and room > 200:
        tail = tb[-room:]
        cut = tail.find("\n")
        text += "\nTraceback (end):\n" + (tail[cut + 1:] if 0 <= cut < 200 and len(tb) > room else tail)
    return text


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


def infra(message: str) -> str:
    return f"Verifier infrastructure error (not your fault; will be retried): {message}"


TRAIN_MODE_NOTE = ("the reference runs in training mode (KernelBench semantics): BatchNorm/InstanceNorm use "
                   "batch statistics and dropout is active.")
