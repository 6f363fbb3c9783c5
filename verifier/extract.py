"""Pull the candidate source out of a model response.

Contract (ARCHITECTURE.md): the candidate is the last fenced Python block of a markdown response
(```python, ```py, ```python3, or an untagged fence whose content parses as Python), or the whole
response when it is plain Python source. Blank blocks are skipped (a stray closing fence at the end
opens one), and a last block that parses but defines no ``ModelNew`` (a usage example after the
answer) gives way to the last block that defines it. Info strings are read for their language
(```python:model.py, ```{python}); an indented fence (in a list item) has its content dedented as CommonMark
does; plain source that defines ModelNew is taken whole (fences in its docstrings are no markdown). In a response
with reasoning markers only the answer, what follows the last ``</think>`` (the part a chat template keeps of the turn:
Qwen3's drops everything before it, so a draft judged there would get feedback on code the model no longer sees),
supplies the candidate; a response that ends inside its reasoning, or holds code only before the last ``</think>``,
is a format error saying so. A response whose only code blocks are empty (plain source followed by a stray
closing fence) is taken as that source where it defines ModelNew. Anything else is a ``format_error`` with a message
the model can act on.

Normalisation before any parsing: a leading BOM is dropped and CRLF/CR line ends become LF (a correct
candidate must not fail on its line endings). Source too deeply nested for the parser is a format error,
never an exception out of here (which the caller would report as infra).
"""
from __future__ import annotations

import ast
import bisect
import re

PY_TAGS = {"python", "py", "python3", "py3"}
# an opening fence may be indented (a list item's code: "1. Do this:" then "   ```python"); its content loses up to
# as much indentation, as CommonMark has it, and its closing fence may be indented up to 3 columns more
_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
# the language of an info string: "python", "python title=x.py", "python:model_new.py", "{python}", "{.python}"
_INFO_TAG = re.compile(r"\{?\.?([\w+-]*)")
_THINK, _THINK_END = "<think>", "</think>"
_MAX_FENCE_RETRIES = 8   # later closing fences tried, over the whole response, for ```python blocks that do not
                         # parse at their first one (each try parses; bounded so a response of fences stays cheap)


class FormatError(ValueError):
    """The response holds no usable candidate; the message says why (shown to the model)."""


def _decode(response: str | bytes, max_bytes: int) -> str:
    if isinstance(response, (bytes, bytearray, memoryview)):
        raw = bytes(response)
        if len(raw) > max_bytes:
            raise FormatError(f"response is {len(raw)} bytes, over the {max_bytes}-byte limit")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"response is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    if not isinstance(response, str):
        raise FormatError(f"response must be text, got {type(response).__name__}")
    try:
        size = len(response.encode("utf-8"))
    except UnicodeEncodeError:
        raise FormatError("response contains unencodable characters (lone surrogates)") from None
    if size > max_bytes:
        raise FormatError(f"response is {size} bytes, over the {max_bytes}-byte limit")
    return response


def _normalise(text: str) -> str:
    """Drop a leading BOM and turn CRLF / lone CR line ends into LF."""
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _fenced_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(info tag, content, closed) for each fenced block, in order (`_fenced_spans` without the line numbers)."""
    return [(tag, content, closed) for tag, content, closed, _, _ in _fenced_spans(text)]


def _fenced_spans(text: str) -> list[tuple[str, str, bool, int, int]]:
    """(info tag, content, closed, opening line, closing line) for each fenced block, in order (0-based line numbers;
    an unclosed last fence runs to the end, its closing line one past the last).

    A ```python block that does not parse up to its first closing fence may contain fence lines of its own
    (inside a string); it then extends to the first of the next few closing fences at which it parses."""
    lines = text.split("\n")
    blocks = []
    i = 0
    tries = 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        tag = _INFO_TAG.match(m.group("info").strip()).group(1).lower()
        close = re.compile(r"^[ \t]{0,%d}" % (indent + 3) + re.escape(fence[0]) + "{" + str(len(fence))
                           + r",}[ \t]*$")
        body = lambda end, start=i + 1, n=indent: "\n".join(_dedent(x, n) for x in lines[start:end])  # noqa: E731
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if tag in PY_TAGS and j < len(lines) and tries < _MAX_FENCE_RETRIES and not _parses(body(j)):
            k = j + 1
            while k < len(lines) and tries < _MAX_FENCE_RETRIES:
                if close.match(lines[k]):
                    tries += 1
                    if _parses(body(k)):
                        j = k
                        break
                k += 1
        blocks.append((tag, body(j), j < len(lines), i, j))
        i = j + 1
    return blocks


def _dedent(line: str, n: int) -> str:
    """``line`` without up to ``n`` columns of leading blanks (the indentation of its block's opening fence)."""
    k = 0
    while k < n and k < len(line) and line[k] in " \t":
        k += 1
    return line[k:]


def _parses(src: str) -> bool:
    try:
        ast.parse(src)
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def _defines_model_new(src: str) -> bool:
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body)


def _select(text: str) -> str:
    """The candidate: plain Python source that defines ModelNew as it is (fences inside its strings are no markdown);
    else the code of the response's answer (`_answer_part`): the part a chat template keeps of an assistant turn
    (Qwen3's keeps what follows the last ``</think>``), so that feedback is never on code the model no longer sees in
    the next turn; a fence the reasoning opened and never closed cannot swallow the answer's own."""
    if _defines_model_new(text):
        return text
    answer, cut_off = _answer_part(text)
    if answer is None:
        return _select_blocks(text)
    try:
        code = _select_blocks(answer)
        if code.strip():
            return code
        reason = "no code: the answer after the reasoning section is empty"
    except FormatError as e:
        reason = str(e)
    if cut_off:
        raise FormatError("the response ended inside its reasoning section (a <think> with no </think>: cut off at "
                          "the token limit?); the answer after </think> must hold the complete ```python block")
    if _has_code(text):
        raise FormatError("code was found only before the last </think> (inside the reasoning), which the "
                          "conversation does not keep and is never the answer; put the complete ```python block "
                          "after the last </think>")
    raise FormatError(reason)


def _answer_part(text: str) -> tuple[str | None, bool]:
    """(the response's answer, whether a reasoning section after it is never closed), or (None, False) when the
    response has no reasoning markers. The answer is what follows the last ``</think>``, as a chat template keeps it
    in the conversation (a ``</think>`` with no ``<think>`` before it closes the section that the generation prompt
    opened), up to a ``<think>`` that opens again and never closes; with no ``</think>`` at all, what precedes the
    first ``<think>``."""
    opens, closes = _reasoning_markers(text, _THINK), _reasoning_markers(text, _THINK_END)
    if not opens and not closes:
        return None, False
    start = closes[-1] + len(_THINK_END) if closes else 0
    k = bisect.bisect_left(opens, start)
    if k < len(opens):   # a section opened after the answer began, never closed: the answer ends there
        return text[start:opens[k]], True
    return text[start:], False


def _reasoning_markers(text: str, marker: str) -> list[int]:
    """Offsets of ``marker`` in ``text`` (ascending) but those inside a closed code block that parses (a candidate
    may hold ``'<think>'`` in a string: its code is no reasoning section)."""
    found = [m.start() for m in re.finditer(re.escape(marker), text)]
    if not found:
        return []
    code = [(a, b) for tag, content, closed, a, b in _fenced_spans(text)
            if closed and (tag in PY_TAGS or tag == "") and content.strip() and _parses(content)]
    if not code:
        return found
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
    inside = [False] * len(line_starts)
    for a, b in code:
        inside[a + 1:b] = [True] * (b - a - 1)
    return [p for p in found if not inside[bisect.bisect_right(line_starts, p) - 1]]


def _has_code(text: str) -> bool:
    """Whether ``text`` holds any non-blank ```python block or untagged block that parses."""
    return any(content.strip() and (tag in PY_TAGS or (tag == "" and _parses(content)))
               for tag, content, _ in _fenced_blocks(text))


def _select_blocks(text: str) -> str:
    blocks = _fenced_blocks(text)
    code = [(content, closed) for tag, content, closed in blocks
            if tag in PY_TAGS or (tag == "" and _parses(content))]
    if code:
        # the last block with any code; where that one parses but defines no ModelNew (a usage example after the
        # answer), the last block that does. A stray closing fence at the end (it opens an empty untagged block) or
        # a usage example was chosen over the answer and rejected a correct kernel as a format error. A last block
        # that does not parse stays the candidate (its syntax error is the feedback; no earlier draft stands in)
        if not any(b[0].strip() for b in code):
            # every code block is blank: a stray fence (a closing ``` whose opening one the model left out, after plain
            # source) opened one. The source without its fence lines is the answer where it defines ModelNew
            bare = "\n".join(line for line in text.split("\n") if not _FENCE_OPEN.match(line))
            if _defines_model_new(bare):
                return bare
            raise FormatError("no code: every ```python block of the response is empty (a closing ``` with no "
                              "opening ```python before the code?)")
        code = [b for b in code if b[0].strip()]
        content, closed = code[-1]
        if _parses(content) and not _defines_model_new(content):
            content, closed = ([b for b in code if _defines_model_new(b[0])] or [code[-1]])[-1]
        if not closed and not _parses(content):
            raise FormatError("the last ```python block is never closed and does not parse "
                              "(was the response cut off?)")
        return content
    if blocks:
        tags = sorted({t or "untagged" for t, _, _ in blocks})
        if not _parses(text):
            raise FormatError(f"no ```python code block found (fenced blocks: {', '.join(tags)}); put the "
                              f"complete candidate in one ```python block")
    elif text.strip():
        try:
            ast.parse(text)
        except SyntaxError as e:
            raise FormatError(f"no ```python code block found, and the response is not Python source either "
                              f"(line {e.lineno}: {e.msg})") from None
        except (ValueError, RecursionError, MemoryError):
            raise FormatError("no ```python code block found, and the response is not Python source either")
    return text  # plain Python source


def extract_candidate(response: str | bytes, max_bytes: int) -> str:
    """Return the candidate source; raise FormatError(message) when there is none."""
    text = _normalise(_decode(response, max_bytes))
    if "\x00" in text:
        raise FormatError("response contains NUL bytes")
    code = _select(text)
    if not code.strip():
        raise FormatError("no code: the response (or its last ```python block) is empty")
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        line = (e.text or "").strip()
        raise FormatError(f"candidate code does not parse: line {e.lineno}: {e.msg}"
                          + (f": {line[:120]}" if line else "")) from None
    except ValueError as e:
        raise FormatError(f"candidate code does not parse: {e}") from None
    except (RecursionError, MemoryError):
        raise FormatError("candidate code is too deeply nested to parse") from None
    if not any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body):
        raise FormatError("no `class ModelNew(nn.Module)` defined at module level of the candidate code")
    return code if code.endswith("\n") else code + "\n"
