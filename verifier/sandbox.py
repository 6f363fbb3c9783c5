"""Process sandbox for everything that executes candidate code (compiles, imports, runs).

Every evaluation step is a fresh ``python -I -B verifier/_child.py`` (fork+exec via ``subprocess``, so no
GPU context is ever inherited), in a new session so a timeout kills the whole process group. The parent
builds a scrubbed environment (allowlist + private HOME/TMPDIR/cache dirs + device pinning), and the child
confines itself with ``apply_isolation`` as its very first action, before torch or any candidate code is
loaded:

- network: a new network namespace (``os.unshare(CLONE_NEWNET)``; for unprivileged users
  ``CLONE_NEWUSER|CLONE_NEWNET`` with an identity uid map, which is what the ``unshare -rn`` binary does),
  plus Landlock's TCP bind/connect deny where the kernel has it (ABI >= 4);
- files: Landlock (ABI >= 1) lets the child write only below its private dirs, ``cfg.extra_writable``
  (``/proc/self``: the CUDA driver writes there at init; ``/dev/shm``) and device nodes under /dev; it also
  blocks ptrace of, and (ABI >= 6) signals to, processes outside the sandbox;
- rlimits: CPU time, memory (RLIMIT_AS on cpu; RLIMIT_DATA on GPU backends, whose drivers reserve huge
  virtual ranges), file size, processes (headroom over what the user already runs; the kernel ignores
  RLIMIT_NPROC for uid 0), open files, no core dumps;
- privileges: ``no_new_privs``; a root child drops every capability (bounding, effective, permitted);
- syscalls: a seccomp filter (``syscall_filter``) refuses tracing, other processes' memory, kernel
  observation, new namespaces and mounts, userfaultfd and io_uring, and turns ``flock`` into a no-op (so a
  candidate cannot hold the device lock, whatever it does to the lock file's mode);
- memory pressure: ``oom_score_adj`` 1000, so the kernel's OOM killer takes the child, never the verifier.

What was applied, and what each step fell back to, is reported in the first message the child sends
(before any candidate code exists) and lands in ``VerifyResult.details["isolation"]``.

Messages: parent -> child as JSON lines on stdin; child -> parent as JSON lines on a dedicated pipe fd. A run
child's outputs travel in memfds sealed with ``OUTPUT_SEALS``, which the parent opens through /proc.
stdout/stderr are drained by the parent into bounded tails (output spam cannot exhaust its memory).
"""
from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from . import syscall_filter

# seals of the memfd a run child hands its outputs over in (verifier.evaluate checks them): no writes, no
# resizing, no further seal changes
OUTPUT_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
MAX_MESSAGE_BYTES = 8 << 20

# --------------------------------------------------------------------------------------------------
# child side (runs first thing in _child.py; stdlib only)
# --------------------------------------------------------------------------------------------------
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LL_FS_WRITE_FILE, _LL_FS_REMOVE_DIR, _LL_FS_REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_LL_FS_MAKE = sum(1 << b for b in range(6, 13))  # CHAR, DIR, REG, SOCK, FIFO, BLOCK, SYM
_LL_FS_REFER, _LL_FS_TRUNCATE = 1 << 13, 1 << 14
_LL_NET_BIND_TCP, _LL_NET_CONNECT_TCP = 1 << 0, 1 << 1
_LL_SCOPE_ABSTRACT_UNIX, _LL_SCOPE_SIGNAL = 1 << 0, 1 << 1
_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi(libc=None) -> int:
    """The kernel's Landlock ABI version (0: none, errno says why); what a child confining itself gets."""
    try:
        abi = (libc or _libc()).syscall(_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


def _landlock(libc, writable: list[str], device_dirs: list[str], deny_tcp: bool) -> dict[str, Any]:
    abi = landlock_abi(libc)
    if abi < 1:
        return {"applied": False, "reason": f"landlock unavailable ({os.strerror(ctypes.get_errno())})"}
    fs = _LL_FS_WRITE_FILE | _LL_FS_REMOVE_DIR | _LL_FS_REMOVE_FILE | _LL_FS_MAKE
    if abi >= 2:
        fs |= _LL_FS_REFER
    if abi >= 3:
        fs |= _LL_FS_TRUNCATE
    attr = _RulesetAttr(fs, 0, 0)
    size = 8
    net = deny_tcp and abi >= 4
    if net:
        attr.handled_access_net = _LL_NET_BIND_TCP | _LL_NET_CONNECT_TCP
        size = 16
    if abi >= 6:
        attr.scoped = _LL_SCOPE_ABSTRACT_UNIX | _LL_SCOPE_SIGNAL
        size = 24
    rfd = libc.syscall(_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if rfd < 0:
        return {"applied": False, "abi": abi, "reason": f"create_ruleset: {os.strerror(ctypes.get_errno())}"}
    try:
        rules = [(d, fs) for d in writable] + [(d, _LL_FS_WRITE_FILE | (_LL_FS_TRUNCATE if abi >= 3 else 0))
                                              for d in device_dirs]
        for path, access in rules:
            if not os.path.exists(path):
                continue
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(access, fd)
                if libc.syscall(_LANDLOCK_ADD_RULE, rfd, 1, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    return {"applied": False, "abi": abi, "reason": f"add_rule {path}: "
                                                                    f"{os.strerror(ctypes.get_errno())}"}
            finally:
                os.close(fd)
        if libc.syscall(_LANDLOCK_RESTRICT_SELF, rfd, ctypes.c_uint32(0)) != 0:
            return {"applied": False, "abi": abi, "reason": f"restrict_self: {os.strerror(ctypes.get_errno())}"}
    finally:
        os.close(rfd)
    return {"applied": True, "abi": abi, "writable": writable, "tcp_denied": net, "scoped": abi >= 6}


def _new_netns() -> str:
    try:
        os.unshare(os.CLONE_NEWNET)
        return "netns"
    except (OSError, AttributeError) as e:
        first = str(e)
    try:
        uid, gid = os.getuid(), os.getgid()
        os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET)
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
        return "userns+netns"
    except (OSError, AttributeError) as e:
        return f"none (netns: {first}; userns: {e})"


def _user_tasks(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
        except (OSError, ValueError, KeyError):
            continue
    return n


def _rlimits(policy: dict[str, Any]) -> dict[str, Any]:
    import resource

    applied: dict[str, Any] = {}

    def lim(name: str, value: int, hard_extra: int = 0) -> None:
        res = getattr(resource, name)
        soft, hard = resource.getrlimit(res)
        new_hard = value + hard_extra if hard == resource.RLIM_INFINITY else min(hard, value + hard_extra)
        new_soft = min(value, new_hard)
        try:
            resource.setrlimit(res, (new_soft, new_hard))
            applied[name] = new_soft
        except (ValueError, OSError) as e:
            applied[name] = f"failed: {e}"

    lim("RLIMIT_CORE", 0)
    lim("RLIMIT_CPU", int(policy["cpu_time_s"]), 5)
    lim("RLIMIT_FSIZE", int(policy["file_size_bytes"]))
    lim("RLIMIT_NOFILE", int(policy["open_files"]))
    lim(policy["memory_kind"], int(policy["memory_bytes"]))
    uid = os.getuid()
    lim("RLIMIT_NPROC", _user_tasks(uid) + int(policy["max_processes"]))
    if uid == 0:
        applied["RLIMIT_NPROC_note"] = "not enforced by the kernel for uid 0"
    return applied


def _drop_capabilities(libc) -> str:
    if os.getuid() != 0 and os.geteuid() != 0:
        return "not root"
    try:
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
    except OSError:
        last = 40
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(last + 1):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            return f"failed: PR_CAPBSET_DROP {cap}: {os.strerror(ctypes.get_errno())}"

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)
    data = (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        return f"failed: capset: {os.strerror(ctypes.get_errno())}"
    return "dropped"


def apply_isolation(policy: dict[str, Any]) -> dict[str, Any]:
    """Confine the current (child) process. Returns what was applied; never raises for a missing feature."""
    report: dict[str, Any] = {"uid": os.getuid()}
    if policy.get("network", True):
        report["network"] = _new_netns()
    else:
        report["network"] = "not requested"
    report["rlimits"] = _rlimits(policy)
    if policy.get("niceness"):   # inherited by the compilers it runs
        try:
            report["niceness"] = os.nice(int(policy["niceness"]))
        except OSError as e:
            report["niceness"] = f"failed: {e}"
    report["oom_score_adj"] = _prefer_oom_kill()   # before Landlock, which may not allow /proc/self writes
    libc = _libc()
    report["no_new_privs"] = libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    if policy.get("landlock", True):
        report["landlock"] = _landlock(libc, policy["writable"], ["/dev"],
                                       deny_tcp=policy.get("network", True))
    else:
        report["landlock"] = {"applied": False, "reason": "not requested"}
    report["capabilities"] = _drop_capabilities(libc) if policy.get("drop_capabilities", True) else "kept"
    if policy.get("syscall_filter", True):   # last: the steps above use some of the syscalls it refuses
        report["syscall_filter"] = syscall_filter.install(libc)
    else:
        report["syscall_filter"] = {"applied": False, "reason": "not requested"}
    return report


def _prefer_oom_kill() -> bool:
    """Make this process the kernel's first choice when memory runs out: a candidate that allocates up to its
    rlimit on a host with less memory must take itself down, not the verifier (raising it needs no privilege)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------------
class ChildFailed(Exception):
    """The child exited or closed its channel before answering (crash, exit, killed)."""


class ChildTimeout(Exception):
    """The child did not answer before the deadline."""


class ProtocolError(Exception):
    """The child sent something that is not a well-formed message."""


@dataclasses.dataclass
class ChildExit:
    returncode: int | None
    signal: str | None
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    stdout_bytes: int
    stderr_bytes: int
    wall_s: float

    def describe(self) -> str:
        if self.timed_out:
            return "killed after the time limit"
        if self.signal:
            return f"killed by {self.signal}"
        return f"exited with status {self.returncode}"


def policy_for(cfg, writable: list[str], mode: str = "run") -> dict[str, Any]:
    return {
        # builds yield the CPU to device-stage children, whose timed calls are sensitive to scheduling
        "niceness": int(getattr(cfg, "build_niceness", 0)) if mode in ("build", "compile", "pch") else 0,
        "network": bool(cfg.network_isolation),
        "landlock": bool(cfg.landlock),
        "drop_capabilities": bool(cfg.drop_capabilities),
        "syscall_filter": bool(getattr(cfg, "syscall_filter", True)),
        "writable": [os.path.abspath(w) for w in list(writable) + list(cfg.extra_writable)],
        "cpu_time_s": float(cfg.cpu_time_limit_s),
        "memory_bytes": int(cfg.memory_limit_bytes),
        "memory_kind": "RLIMIT_AS" if cfg.backend == "cpu" else "RLIMIT_DATA",
        "file_size_bytes": int(cfg.file_size_limit_bytes),
        "max_processes": int(cfg.max_processes),
        "open_files": int(cfg.max_open_files),
    }


def child_env(cfg, backend, device_index: int | None, workdir: str, extra: dict[str, str] | None = None) -> dict:
    """Scrubbed environment: allowlisted variables, private dirs, pinning, build settings."""
    env = {k: os.environ[k] for k in cfg.env_allowlist if k in os.environ}
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([bindir] + [p for p in env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(
        os.pathsep) if p and p != bindir])
    home = os.path.join(workdir, "home")
    tmp = os.path.join(workdir, "tmp")
    for d in (home, tmp):
        os.makedirs(d, exist_ok=True)
    env.update({
        "HOME": home, "TMPDIR": tmp, "TMP": tmp, "TEMP": tmp, "XDG_CACHE_HOME": os.path.join(home, ".cache"),
        "TORCH_EXTENSIONS_DIR": os.path.join(workdir, "torch_extensions"),
        "TRITON_CACHE_DIR": os.path.join(workdir, "triton"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(workdir, "inductor"),
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "KINETO_LOG_LEVEL": "5",
        "TORCH_CPP_LOG_LEVEL": "ERROR", "TORCHINDUCTOR_COMPILE_THREADS": "1",  # no compile worker pool
        # the child has no network: a task module that reaches for the Hub (KernelBench level 4) fails at once
        # instead of retrying for ~25 s of the check's time
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    })
    if cfg.backend == "cpu":
        env.update({"OMP_NUM_THREADS": str(cfg.cpu_threads), "MKL_NUM_THREADS": str(cfg.cpu_threads)})
    env.update({k: v for k, v in backend.pinning_env(device_index).items() if v is not None})
    if backend.is_gpu:
        env["TEARDOWN_CUPTI"] = "1" if cfg.cupti_teardown else "0"
    if backend.arch_env_var and cfg.arch_list():
        env[backend.arch_env_var] = cfg.arch_list()
    if cfg.max_jobs:
        env["MAX_JOBS"] = str(cfg.max_jobs)
    env.update(extra or {})
    return env


class _Drain(threading.Thread):
    """Read a stream to EOF keeping only the last ``keep`` bytes."""

    def __init__(self, stream, keep: int):
        super().__init__(daemon=True)
        self.stream, self.keep = stream, keep
        self.buf = bytearray()
        self.total = 0

    def run(self) -> None:
        try:
            while True:
                chunk = self.stream.read1(1 << 16) if hasattr(self.stream, "read1") else self.stream.read(1 << 16)
                if not chunk:
                    break
                self.total += len(chunk)
                self.buf += chunk
                if len(self.buf) > 2 * self.keep:
                    del self.buf[:len(self.buf) - self.keep]
        except (OSError, ValueError):
            pass

    def tail(self) -> str:
        return bytes(self.buf[-self.keep:]).decode("utf-8", errors="replace")


class SandboxedChild:
    """One sandboxed ``_child.py`` process and its message channel."""

    def __init__(self, mode: str, job: dict[str, Any], cfg, backend, workdir: str, writable: list[str],
                 device_index: int | None = None, env_extra: dict[str, str] | None = None):
        self.mode, self.cfg, self.workdir = mode, cfg, workdir
        self.job = dict(job, mode=mode, isolation=policy_for(cfg, [workdir] + list(writable), mode))
        self.env = child_env(cfg, backend, device_index, workdir, env_extra)
        self._poll = select.poll()
        self.proc: subprocess.Popen | None = None
        self._rfd: int | None = None
        self._buf = bytearray()
        self._drains: list[_Drain] = []
        self._t0 = 0.0
        self.timed_out = False
        self.exit: ChildExit | None = None

    def start(self) -> None:
        job_path = os.path.join(self.workdir, f"job-{self.mode}.json")
        with open(job_path + ".tmp", "w") as f:
            json.dump(self.job, f)
        os.replace(job_path + ".tmp", job_path)
        rfd, wfd = os.pipe()
        argv = [sys.executable, "-I", "-B", CHILD_SCRIPT, job_path, str(wfd)]
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         cwd=self.workdir, env=self.env, pass_fds=(wfd,), start_new_session=True,
                                         close_fds=True)
        finally:
            os.close(wfd)
        self._rfd = rfd
        self._poll.register(rfd, select.POLLIN)
        self._t0 = time.monotonic()
        keep = int(self.cfg.max_output_tail_bytes)
        self._drains = [_Drain(self.proc.stdout, keep), _Drain(self.proc.stderr, keep)]
        for d in self._drains:
            d.start()

    @property
    def started_at(self) -> float:
        """``time.monotonic()`` when the process was started."""
        return self._t0

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise ChildFailed("the child stopped reading its requests") from None

    def recv(self, deadline: float) -> dict[str, Any]:
        """Next message; ``deadline`` is a ``time.monotonic()`` value."""
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[:nl + 1]
                try:
                    msg = json.loads(line)
                except (ValueError, RecursionError, MemoryError):   # bad JSON, deep nesting, huge ints
                    raise ProtocolError(f"malformed message from the child: {line[:200]!r}") from None
                if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                    raise ProtocolError(f"message without an op from the child: {line[:200]!r}")
                return msg
            if len(self._buf) > MAX_MESSAGE_BYTES:
                raise ProtocolError("oversized message from the child")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChildTimeout()
            if not self._poll.poll(min(remaining, 1.0) * 1000):  # poll, not select: fds may exceed 1024
                continue
            chunk = os.read(self._rfd, 1 << 20)
            if not chunk:
                raise ChildFailed("the child closed its result channel")
            self._buf += chunk

    def request(self, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        self.send(msg)
        return self.recv(deadline)

    def exited(self) -> bool:
        """Whether the child has exited, without reaping it (a zombie keeps its pid and process group
        reserved, so a later killpg can never hit a recycled group)."""
        if self.proc is None or self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def kill(self) -> None:
        """SIGKILL the child's whole process group (only while the child is not yet reaped)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self, grace_s: float = 5.0, timed_out: bool = False) -> ChildExit:
        """Wait briefly for a clean exit, kill whatever is left of the process group, reap, collect tails."""
        if self.exit is not None:
            return self.exit
        self.timed_out = self.timed_out or timed_out
        assert self.proc is not None
        deadline = time.monotonic() + (0.0 if timed_out else grace_s)
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.kill()  # the leader if still running, and stragglers it left in the group
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in the kernel (e.g. a wedged driver call)
            pass
        for stream in (self.proc.stdin,):
            try:
                stream.close()
            except (OSError, ValueError, BrokenPipeError):
                pass
        for d in self._drains:
            d.join(timeout=5.0)
        if self._rfd is not None:
            os.close(self._rfd)
            self._rfd = None
        rc = self.proc.returncode
        sig = None
        if rc is not None and rc < 0:
            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = f"signal {-rc}"
        out, err = self._drains
        self.exit = ChildExit(rc, sig, self.timed_out, out.tail(), err.tail(), out.total, err.total,
                              time.monotonic() - self._t0)
        return self.exit

    def __enter__(self) -> "SandboxedChild":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close(grace_s=0.5 if exc[0] else 5.0, timed_out=exc[0] is ChildTimeout)


@dataclasses.dataclass
class OneShot:
    """What a one-request child (compile, pch) came back with."""
    hello: dict[str, Any] | None   # its isolation report
    reply: dict[str, Any] | None   # None: it crashed, broke the protocol or timed out
    timed_out: bool
    exit: ChildExit
    # whether the child said ``started_op`` (``run_one_shot``): from then on it ran work the candidate shapes (a
    # compile child dlopens the candidate's library, whose static initializers run there), so a death or a message
    # out of protocol after it is the candidate's, and only a reply before it can be the harness's word
    started: bool = False


def run_one_shot(mode: str, job: dict[str, Any], cfg, backend, writable: list[str], deadline: float,
                 prefix: str, started_op: str | None = None) -> OneShot:
    """Run a sandboxed child that sends its hello and one reply, in a private work dir removed afterwards. With
    ``started_op``, the child may send that message between them, when it starts the work that is not the
    harness's alone (``OneShot.started``)."""
    workdir = tempfile.mkdtemp(prefix=prefix, dir=cfg.work_dir)
    child = SandboxedChild(mode, job, cfg, backend, workdir, writable=writable)
    hello = reply = None
    timed_out = started = False
    try:
        child.start()
        hello = child.recv(deadline)
        reply = child.recv(deadline)
        if started_op is not None and reply.get("op") == started_op:
            started = True
            reply = child.recv(deadline)
    except ChildTimeout:
        timed_out = True
    except (ChildFailed, ProtocolError):
        reply = None
    finally:
        exit_info = child.close(grace_s=2.0, timed_out=timed_out)
        shutil.rmtree(workdir, ignore_errors=True)
    return OneShot(hello, reply, timed_out, exit_info, started)
