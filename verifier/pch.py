"""A precompiled ``torch/extension.h`` per compiler flag set, for the compile pool.

Every ``load_inline`` build compiles a ``main.cpp`` whose first line includes ``torch/extension.h``; parsing
that header is most of its CPU time (26.6 CPU-s without, 11.5 with a PCH on the 2-core dev machine). GCC
uses ``<dir>/torch/extension.h.gch`` in place of the header when ``-I<dir>`` is searched before torch's
``-isystem`` dirs and the ``.gch`` was made with compatible options. GCC checks the options itself and
falls back to the header when they differ (``-Winvalid-pch`` says so in the log), so a mismatched PCH
costs speed, never a verdict. GCC does not check the header's content, so the key includes the torch build.

- Key (``pch_key``): toolchain, backend, arch list and every ``load_inline`` argument that reaches the
  compiler command (not the sources, the extension name or the function list).
- The flags come from torch itself: an earlier build of the same key left them in its ``build.ninja``
  (``record_flags``), minus ``-DTORCH_EXTENSION_NAME``, which the header never reads.
- A key's PCH is built once it has been compiled ``cfg.pch_after_compiles`` times without one (it costs
  about four builds' worth of header parsing and 750 MB of disk). One sandboxed ``pch`` child builds it
  into a staging dir; only this process publishes it, by rename. Concurrent compiles of the same key do
  not wait for it: they build without.
- Only the C++ compile sees it (``extra_cflags``); ``nvcc`` never does.
- Trust: one PCH serves every candidate with the same flags, so PCHs are made and used only where Landlock
  keeps sandboxed children from writing the store (``writes_confined``); a recorded command must name a GCC
  C++ driver and carry no flag that adds more than torch's header or runs other programs (``_UNSAFE_FLAG``).
- Limits: at most ``MAX_ENTRIES`` PCHs and none on a disk with less than ``MIN_FREE_BYTES`` free; a build
  GCC rejects or that failed through one (and passed without) retires its key for good.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import time
import uuid
from typing import Any

from .config import VerifierConfig

TORCH_LOAD_INLINE = "torch.utils.cpp_extension.load_inline"
BUILD_TIMEOUT_S = 600.0   # one PCH build (~55 CPU-s); not charged to the candidate whose build triggered it
MAX_ENTRIES = 8           # published PCHs per store (~750 MB each); no new one beyond
MIN_FREE_BYTES = 8 << 30  # nor when the disk has less free space than this
_GCH = os.path.join("torch", "extension.h.gch")
# arguments that never reach the compiler command line of main.cpp
_NOT_FLAGS = ("name", "cpp_sources", "cuda_sources", "sycl_sources", "functions", "verbose", "build_directory",
              "keep_intermediates")
# GCC telling that it did not use the PCH, or failing on it
_PCH_TROUBLE = re.compile(r"extension\.h\.gch|precompiled header|\bPCH\b", re.IGNORECASE)
_NINJA_VAR = re.compile(r"^(cxx|cflags|post_cflags) = (.*)$", re.MULTILINE)
_GCC_NAME = re.compile(r"^([\w.]+-)*(g\+\+|c\+\+)(-\d+(\.\d+)*)?$")   # c++, g++-12, x86_64-linux-gnu-g++
# never in a PCH command: output or compile-only switches, and what would put more than torch's header into
# it (forced includes) or run other programs (wrappers, plugins, tool dirs, spec files)
_UNSAFE_FLAG = re.compile(r"-(c|o|E|S|include|imacros|wrapper|B|fplugin|specs|save-temps|x)($|=|\S)")


def pch_key(api: str, kwargs: dict[str, Any], cfg: VerifierConfig, toolchain: dict[str, Any]) -> str | None:
    """The flag set's key, or None where a PCH does not apply (another toolchain's load_inline, torch's own
    PCH, no implicit torch header, flags torch would reject anyway)."""
    if cfg.pch_after_compiles <= 0 or api != TORCH_LOAD_INLINE or not writes_confined(cfg):
        return None
    if kwargs.get("use_pch") or kwargs.get("no_implicit_headers"):
        return None
    extra = kwargs.get("extra_cflags")
    if extra is not None and not (isinstance(extra, list) and all(isinstance(f, str) for f in extra)):
        return None
    flags = {k: v for k, v in kwargs.items() if k not in _NOT_FLAGS}
    blob = json.dumps({"flags": flags, "has_cuda_sources": bool(kwargs.get("cuda_sources")),
                       "has_sycl_sources": bool(kwargs.get("sycl_sources")), "backend": cfg.backend,
                       "arch": cfg.arch_list(), "torch_include": torch_include_dir(), "header": _header_identity(),
                       **toolchain},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:40]


def writes_confined(cfg: VerifierConfig) -> bool:
    """PCHs are shared by every candidate with the same flags, so they are only made and used where no
    sandboxed child can write the PCH store (Landlock on and supported by the kernel)."""
    from .sandbox import landlock_abi
    return bool(cfg.landlock) and landlock_abi() >= 1


def torch_include_dir() -> str:
    import torch
    return os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "include")


def _header_identity() -> list[int]:
    """GCC does not check the header a PCH was made from: a reinstall of the same torch version must not
    reuse one (files written anew get new times)."""
    st = os.stat(os.path.join(torch_include_dir(), "torch", "extension.h"))
    return [st.st_mtime_ns, st.st_size, st.st_ino]


def with_pch(kwargs: dict[str, Any], pch_dir: str) -> dict[str, Any]:
    """``load_inline`` arguments whose C++ compile finds the PCH first (and says if it cannot use it)."""
    # torch joins the flags into a ninja command run by the shell: quote the path
    return dict(kwargs, extra_cflags=list(kwargs.get("extra_cflags") or [])
                + [shlex.quote(f"-I{pch_dir}"), "-Winvalid-pch"])


def may_have_failed_because_of_pch(log: str) -> bool:
    """Whether a failed build with the PCH must be tried again without it: the log mentions the PCH, or the
    C++ object (the only one that saw it) failed, or it does not say which step failed."""
    if _PCH_TROUBLE.search(log):
        return True
    failed = re.findall(r"^FAILED: (\S+)", log, re.MULTILINE)
    return not failed or any(os.path.basename(f).startswith("main.") for f in failed)


def pch_was_rejected(log: str) -> bool:
    """GCC found the PCH and did not use it (-Winvalid-pch): its options or compiler differ."""
    return bool(re.search(r"extension\.h\.gch: [^\n]*\[-Winvalid-pch\]|extension\.h\.gch: not used because"
                          r"|one or more PCH files were found, but they were invalid", log))


def parse_ninja_flags(text: str) -> dict[str, Any] | None:
    """``cxx``, ``cflags`` and ``post_cflags`` of a torch-written build.ninja (None if they are not there)."""
    found = {k: v.strip() for k, v in _NINJA_VAR.findall(text)}
    if "cxx" not in found or "cflags" not in found:
        return None
    try:
        split = lambda s: [t.replace("\1", "$").replace("\0", " ")  # noqa: E731
                           for t in shlex.split(s.replace("$$", "\1").replace("$ ", "\0").replace("$:", ":"))]
        cxx = split(found["cxx"])
        cflags = [f for f in split(found["cflags"]) if not f.startswith("-DTORCH_EXTENSION_NAME=")]
        post = split(found.get("post_cflags", ""))
    except ValueError:
        return None
    if len(cxx) != 1 or not _GCC_NAME.match(os.path.basename(cxx[0])):
        return None
    if any(_UNSAFE_FLAG.match(f) or "$" in f or "`" in f for f in cflags + post):
        return None
    return {"cxx": cxx[0], "cflags": cflags, "post_cflags": post}


class PchStore:
    """``<cache>/pch/``: per key a published ``<key>/torch/extension.h.gch``, the flags an earlier build
    used (``<key>.flags.json``) and how many builds went without (``<key>.count``, one byte each)."""

    def __init__(self, root: str, cfg: VerifierConfig, backend) -> None:
        self.dir = os.path.join(root, "pch")
        self.locks = os.path.join(root, "locks")
        self.cfg, self.backend = cfg, backend
        os.makedirs(self.dir, exist_ok=True)

    def _path(self, key: str, suffix: str = "") -> str:
        return os.path.join(self.dir, key + suffix)

    def published(self, key: str) -> str | None:
        d = self._path(key)
        return d if os.path.isfile(os.path.join(d, _GCH)) else None

    def prepare(self, key: str, deadline: float, build: bool = True) -> tuple[str | None, str | None]:
        """(PCH dir to compile with, or None; "built" when this call built it). Counts a build without;
        builds the PCH when ``build`` and the key has been compiled often enough."""
        d = self.published(key)
        if d:
            return d, None
        fd = os.open(self._path(key, ".count"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)
        flags = self._flags(key)
        if not build or flags is None or os.path.getsize(self._path(key, ".count")) <= self.cfg.pch_after_compiles:
            return None, None
        if not self._room():
            return None, None
        from .build import file_lock
        try:
            with file_lock(os.path.join(self.locks, f"pch-{key}.lock"), time.monotonic()):  # one try: no waiting
                d = self.published(key) or self._build(key, flags, deadline)
        except TimeoutError:   # another process is building it
            return None, None
        return (d, "built") if d else (None, None)

    def record_flags(self, key: str, build_dir: str) -> None:
        """Keep the compiler command torch wrote for a build of ``key`` (the PCH is built with it)."""
        if os.path.exists(self._path(key, ".flags.json")) or os.path.exists(self._path(key, ".failed")):
            return
        try:
            with open(os.path.join(build_dir, "build.ninja")) as f:
                flags = parse_ninja_flags(f.read(1 << 20))
        except OSError:
            return
        if flags:
            from .build import _write_json
            _write_json(self._path(key, ".flags.json"), flags)

    def discard(self, key: str, reason: str) -> None:
        """Stop using ``key``'s PCH (GCC rejected it or a build failed through it); never build it again."""
        from .build import _write_json
        _write_json(self._path(key, ".failed"), {"reason": reason[-2000:]})
        shutil.rmtree(self._path(key), ignore_errors=True)

    def _room(self) -> bool:
        """Room for one more PCH: fewer than MAX_ENTRIES and enough free disk. Sweeps staging dirs that a
        killed build left behind (older than two builds' time)."""
        now, published = time.time(), 0
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name.startswith(".tmp-"):
                try:
                    if now - os.path.getmtime(path) > 2 * BUILD_TIMEOUT_S:
                        shutil.rmtree(path, ignore_errors=True)
                except OSError:
                    pass
            elif os.path.isfile(os.path.join(path, _GCH)):
                published += 1
        return published < MAX_ENTRIES and shutil.disk_usage(self.dir).free >= MIN_FREE_BYTES

    def _flags(self, key: str) -> dict[str, Any] | None:
        if os.path.exists(self._path(key, ".failed")):
            return None
        try:
            with open(self._path(key, ".flags.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _build(self, key: str, flags: dict[str, Any], deadline: float) -> str | None:
        from .sandbox import run_one_shot
        staging = self._path(f".tmp-{key}-{uuid.uuid4().hex[:8]}")
        os.makedirs(os.path.join(staging, "torch"))
        header = os.path.join(torch_include_dir(), "torch", "extension.h")
        cmd = [flags["cxx"], *flags["cflags"], "-x", "c++-header", header, *flags["post_cflags"],
               "-o", os.path.join(staging, _GCH)]
        reply = run_one_shot("pch", {"cmd": cmd}, self.cfg, self.backend, [staging], deadline, "verifier-pch-").reply
        if not reply or reply.get("op") != "pch_built" or not os.path.isfile(os.path.join(staging, _GCH)):
            shutil.rmtree(staging, ignore_errors=True)
            if reply and reply.get("op") == "pch_failed":   # the compiler refused (not GCC, flags): not again
                self.discard(key, reply.get("log") or "")
            return None   # a timeout or a crashed child may be transient: a later build tries again
        try:
            os.rename(staging, self._path(key))
        except OSError:   # published meanwhile
            shutil.rmtree(staging, ignore_errors=True)
        return self.published(key)
