"""A seccomp-BPF syscall filter for the sandboxed children, built in pure Python (stdlib + ctypes).

Landlock confines writes and rlimits bound resources, but a native candidate can still issue any syscall
directly. This filter, installed right after the other isolation steps (``no_new_privs`` is already set),
refuses the syscalls no kernel build, import or timed call needs and that would let a candidate reach
outside its process or past the harness:

- tracing and other processes' memory: ``ptrace``, ``process_vm_readv`` / ``process_vm_writev``;
- kernel observation and code: ``perf_event_open``, ``bpf``, module loading, ``kexec_*``, ``syslog``;
- namespaces and mounts: ``unshare`` / ``clone`` with a ``CLONE_NEW*`` flag, ``setns``, ``mount`` and the
  new mount API, ``pivot_root``, ``chroot`` (``clone3`` answers ENOSYS, so libc falls back to ``clone``,
  whose flags the filter can read);
- lazy or side-channel memory: ``userfaultfd`` (outputs materialised only when read), ``io_uring_*``
  (whose operations bypass this filter), keyrings, ``open_by_handle_at``;
- ``flock`` becomes a no-op that succeeds: the device-stage workers serialise timing with ``flock`` on
  per-device lock files (``verifier.device_lock``). A candidate may chmod those files (Landlock does not
  cover chmod) and open them, but it can no longer hold the device's lock. Nothing a child runs needs a
  working ``flock`` across processes: its caches are private to its own directory.

Refused syscalls fail with ENOSYS (a code none of them returns on a kernel that has them), so a test can
tell the filter's answer from the kernel's own refusal. x32 syscall numbers on x86_64 are refused. The
filter covers x86_64 and aarch64; elsewhere it reports that it was not applied.
"""
from __future__ import annotations

import ctypes
import errno
import platform
import struct
from typing import Any

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_RET_KILL_PROCESS, _SECCOMP_RET_ERRNO, _SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000
# BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
# offsets in struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]} (little endian)
_NR, _ARCH, _ARG0_LO, _ARG0_HI = 0, 4, 16, 20

CLONE_NEW_FLAGS = (0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
                   | 0x40000000)   # NEWTIME NEWNS NEWCGROUP NEWUTS NEWIPC NEWUSER NEWPID NEWNET

# syscall class -> names refused outright (what each class protects is in the module docstring)
DENIED_CLASSES: dict[str, tuple[str, ...]] = {
    "tracing": ("ptrace", "process_vm_readv", "process_vm_writev"),
    "kernel": ("perf_event_open", "bpf", "init_module", "finit_module", "delete_module", "kexec_load",
               "kexec_file_load", "syslog", "iopl", "ioperm", "reboot", "swapon", "swapoff", "acct", "quotactl",
               "lookup_dcookie"),
    "namespaces": ("setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
                   "move_mount", "open_tree", "mount_setattr"),
    "memory_tricks": ("userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key",
                      "request_key", "open_by_handle_at", "name_to_handle_at"),
}
_NUMBERS = {
    "x86_64": {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "perf_event_open": 298, "bpf": 321,
               "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246,
               "kexec_file_load": 320, "syslog": 103, "iopl": 172, "ioperm": 173, "reboot": 169, "swapon": 167,
               "swapoff": 168, "acct": 163, "quotactl": 179, "lookup_dcookie": 212, "setns": 308, "mount": 165,
               "umount2": 166, "pivot_root": 155, "chroot": 161, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
               "fspick": 433, "move_mount": 429, "open_tree": 428, "mount_setattr": 442, "userfaultfd": 323,
               "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 250,
               "add_key": 248, "request_key": 249, "open_by_handle_at": 304, "name_to_handle_at": 303,
               "unshare": 272, "clone": 56, "clone3": 435, "flock": 73, "fork": 57, "vfork": 58, "seccomp": 317,
               "execve": 59, "execveat": 322},
    "aarch64": {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "perf_event_open": 241, "bpf": 280,
                "init_module": 105, "finit_module": 273, "delete_module": 106, "kexec_load": 104,
                "kexec_file_load": 294, "syslog": 116, "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89,
                "quotactl": 60, "lookup_dcookie": 18, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41,
                "chroot": 51, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429,
                "open_tree": 428, "mount_setattr": 442, "userfaultfd": 282, "io_uring_setup": 425,
                "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 219, "add_key": 217, "request_key": 218,
                "open_by_handle_at": 265, "name_to_handle_at": 264, "unshare": 97, "clone": 220, "clone3": 435,
                "flock": 32, "seccomp": 277, "execve": 221, "execveat": 281},
}


def syscall_numbers(machine: str | None = None) -> dict[str, int]:
    """Syscall numbers of this (or ``machine``'s) architecture; empty when the filter does not cover it."""
    return dict(_NUMBERS.get(machine or platform.machine(), {}))


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k & 0xFFFFFFFF)


def build_program(machine: str) -> bytes:
    """The filter as raw ``struct sock_filter`` instructions (see the module docstring for what it does)."""
    nums = _NUMBERS[machine]
    deny = sorted({nums[n] for names in DENIED_CLASSES.values() for n in names if n in nums})
    enosys = _SECCOMP_RET_ERRNO | errno.ENOSYS
    prog: list[bytes] = []
    # wrong architecture: kill (a syscall of another ABI would bypass every rule below)
    prog += [_insn(_LD_W_ABS, 0, 0, _ARCH), _insn(_JEQ_K, 1, 0, _AUDIT_ARCH[machine]),
             _insn(_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS), _insn(_LD_W_ABS, 0, 0, _NR)]
    if machine == "x86_64":   # x32 numbers: refused
        prog += [_insn(_JGE_K, 0, 1, _X32_BIT), _insn(_RET_K, 0, 0, enosys)]
    for nr in deny:           # each: if nr == k return ENOSYS
        prog += [_insn(_JEQ_K, 0, 1, nr), _insn(_RET_K, 0, 0, enosys)]
    prog += [_insn(_JEQ_K, 0, 1, nums["clone3"]), _insn(_RET_K, 0, 0, enosys),
             _insn(_JEQ_K, 0, 1, nums["flock"]), _insn(_RET_K, 0, 0, _SECCOMP_RET_ERRNO | 0)]
    # unshare / clone with a namespace flag in the low word of arg0: ENOSYS
    prog += [_insn(_JEQ_K, 1, 0, nums["unshare"]), _insn(_JEQ_K, 0, 3, nums["clone"]),
             _insn(_LD_W_ABS, 0, 0, _ARG0_LO), _insn(_JSET_K, 0, 1, CLONE_NEW_FLAGS),
             _insn(_RET_K, 0, 0, enosys)]
    prog.append(_insn(_RET_K, 0, 0, _SECCOMP_RET_ALLOW))
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


CLONE_THREAD = 0x00010000


def no_processes_program(machine: str) -> bytes:
    """A second filter for a run child that needs no process of its own (``install_no_processes``): ``fork``,
    ``vfork``, ``clone3`` and a ``clone`` without ``CLONE_THREAD`` answer ENOSYS; threads are still created.
    ``execve`` and ``execveat`` answer ENOSYS too: an exec keeps the pid, the descriptors (the result channel) and
    the sandbox, so a program of the candidate's choice took the harness's place and answered the parent itself
    (the timed reference slowed at will); with no fork, nothing honest here has a use for exec."""
    nums = _NUMBERS[machine]
    enosys = _SECCOMP_RET_ERRNO | errno.ENOSYS
    prog = [_insn(_LD_W_ABS, 0, 0, _ARCH), _insn(_JEQ_K, 1, 0, _AUDIT_ARCH[machine]),
            _insn(_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS), _insn(_LD_W_ABS, 0, 0, _NR)]
    if machine == "x86_64":
        prog += [_insn(_JGE_K, 0, 1, _X32_BIT), _insn(_RET_K, 0, 0, enosys)]
    for name in ("fork", "vfork", "clone3", "execve", "execveat"):
        if name in nums:
            prog += [_insn(_JEQ_K, 0, 1, nums[name]), _insn(_RET_K, 0, 0, enosys)]
    # clone: allowed only with CLONE_THREAD in the low word of arg0 (its flags on both architectures)
    prog += [_insn(_JEQ_K, 0, 3, nums["clone"]), _insn(_LD_W_ABS, 0, 0, _ARG0_LO),
             _insn(_JSET_K, 1, 0, CLONE_THREAD), _insn(_RET_K, 0, 0, enosys),
             _insn(_RET_K, 0, 0, _SECCOMP_RET_ALLOW)]
    return b"".join(prog)


def _fprog(code: bytes) -> tuple[ctypes.Array, _SockFprog]:
    """A BPF program as the kernel takes it: the instruction buffer (keep it alive until the filter is installed)
    and the ``sock_fprog`` pointing at it."""
    buf = ctypes.create_string_buffer(code, len(code))
    return buf, _SockFprog(len(code) // 8, ctypes.addressof(buf))


def install_no_processes(libc=None) -> dict[str, Any]:
    """Refuse new processes and exec to every thread of the calling process from now on (``no_processes_program``; a
    filter cannot be lifted). For a cpu run or build child, right before its candidate is imported: work done in a
    process of its own (forked, sharing memory through ``shmat``) is neither this process's CPU time nor inside
    any timed span, so the background-work check could not see it; a program exec'd in the child's place speaks
    for it. Never raises."""
    machine = platform.machine()
    if machine not in _NUMBERS:
        return {"applied": False, "reason": f"no filter for architecture {machine!r}"}
    code = no_processes_program(machine)
    buf, prog = _fprog(code)
    libc = libc or ctypes.CDLL(None, use_errno=True)
    # SECCOMP_SET_MODE_FILTER with SECCOMP_FILTER_FLAG_TSYNC: threads already running (pools) get it too
    rc = libc.syscall(ctypes.c_long(_NUMBERS[machine]["seccomp"]), ctypes.c_long(1), ctypes.c_long(1),
                      ctypes.byref(prog))
    if rc != 0:
        return {"applied": False, "reason": f"seccomp: {errno.errorcode.get(ctypes.get_errno(), rc)}"}
    return {"applied": True, "arch": machine, "instructions": len(code) // 8}


def install(libc=None) -> dict[str, Any]:
    """Install the filter on the calling thread and everything it starts afterwards (needs ``no_new_privs``
    or CAP_SYS_ADMIN). Returns what was done; never raises for an unsupported platform or kernel."""
    machine = platform.machine()
    if machine not in _NUMBERS:
        return {"applied": False, "reason": f"no filter for architecture {machine!r}"}
    code = build_program(machine)
    buf, prog = _fprog(code)
    libc = libc or ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        return {"applied": False, "reason": f"prctl(PR_SET_SECCOMP): {errno.errorcode.get(ctypes.get_errno())}"}
    return {"applied": True, "arch": machine, "instructions": len(code) // 8,
            "classes": sorted(DENIED_CLASSES) + ["clone_namespaces", "flock_noop"]}
