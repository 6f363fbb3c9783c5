"""Pull the candidate source out of a model response.

Contract (ARCHITECTURE.md): the candidate is the last fenced Python block of a markdown response
(```python, ```py, ```python3, or an untagged fence whose content parses as Python), or the whole
response when it is plain Python source. Blank blocks are skipped (a stray closing fence at the end
opens one), and a last block that parses but defines no ``ModelNew`` (a usage example after the
answer) gives way to the last block that defines it. Anything else is a ``format_error`` with a
message the model can act on.

Normalisation before any parsing: a leading BOM is dropped and CRLF/CR line ends become LF (a correct
candidate must not fail on its line endings). Source too deeply nested for the parser is a format error,
never an exception out of here (which the caller would report as infra).
"""
from __future__ import annotations

import ast
import re

PY_TAGS = {"python", "py", "python3", "py3"}
_FENCE_OPEN = re.compile(r"^[ \t]{0,3}(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
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
    """(info tag, content, closed) for each fenced block, in order. An unclosed last fence runs to the end.

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
        fence, info = m.group("fence"), m.group("info").strip().split()
        tag = info[0].lower() if info else ""
        close = re.compile(r"^[ \t]{0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if tag in PY_TAGS and j < len(lines) and tries < _MAX_FENCE_RETRIES and not _parses("\n".join(lines[i + 1:j])):
            k = j + 1
            while k < len(lines) and tries < _MAX_FENCE_RETRIES:
                if close.match(lines[k]):
                    tries += 1
                    if _parses("\n".join(lines[i + 1:k])):
                        j = k
                        break
                k += 1
        blocks.append((tag, "\n".join(lines[i + 1:j]), j < len(lines)))
        i = j + 1
    return blocks


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
    blocks = _fenced_blocks(text)
    code = [(content, closed) for tag, content, closed in blocks
            if tag in PY_TAGS or (tag == "" and _parses(content))]
    if code:
        # the last block with any code; where that one parses but defines no ModelNew (a usage example after the
        # answer), the last block that does. A stray closing fence at the end (it opens an empty untagged block) or
        # a usage example was chosen over the answer and rejected a correct kernel as a format error. A last block
        # that does not parse stays the candidate (its syntax error is the feedback; no earlier draft stands in)
        code = [b for b in code if b[0].strip()] or code
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
