"""The sandbox itself: network, writes, environment, rlimits, process-group kill, crashes, output spam.

Probe children run a snippet after isolation is applied (no torch), so these tests take seconds."""
import os
import time

import pytest

from verifier.config import VerifierConfig
from verifier.devices import get_backend
from verifier.sandbox import ChildTimeout, SandboxedChild, child_env

from .sandbox_probe import probe




def test_gpu_children_detach_cupti_after_profiling_only_when_configured(tmp_path, monkeypatch):
    """``cupti_teardown`` sets the child's TEARDOWN_CUPTI; the parent's own value never leaks in."""
    monkeypatch.setenv("TEARDOWN_CUPTI", "1")
    cuda = get_backend("cuda")
    on = child_env(VerifierConfig(backend="cuda", cupti_teardown=True), cuda, 0, str(tmp_path))
    off = child_env(VerifierConfig(backend="cuda"), cuda, 0, str(tmp_path))
    cpu = child_env(VerifierConfig(backend="cpu"), get_backend("cpu"), None, str(tmp_path))
    assert on["TEARDOWN_CUPTI"] == "1" and off["TEARDOWN_CUPTI"] == "0" and "TEARDOWN_CUPTI" not in cpu


def test_children_reach_for_no_hub(tmp_path, monkeypatch):
    """The child has no network: a task module that loads from the Hub (KernelBench level 4) must fail at once, not
    retry for ~25 s of the check (an allowlisted HF_HUB_OFFLINE=0 of the parent does not turn that back on)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    env = child_env(VerifierConfig(backend="cpu", env_allowlist=("HF_HUB_OFFLINE", "PATH")), get_backend("cpu"),
                    None, str(tmp_path))
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"


def test_isolation_is_reported_and_network_is_gone(tmp_path):
    code = ("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=3)\n"
            "    chan.send({'op': 'net', 'ok': True})\nexcept OSError as e:\n"
            "    chan.send({'op': 'net', 'ok': False, 'error': str(e)})\n")
    hello, msgs, _ = probe(tmp_path, code)
    iso = hello["isolation"]
    assert iso["network"] in ("netns", "userns+netns") or iso["landlock"].get("tcp_denied"), iso
    assert iso["rlimits"]["RLIMIT_CORE"] == 0 and iso["no_new_privs"] is True
    assert msgs["net"]["ok"] is False


def test_writes_are_confined_to_the_private_dir(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    code = (f"import os\nres = {{}}\nfor p in ({str(outside / 'x')!r}, os.path.join(os.getcwd(), 'inside')):\n"
            "    try:\n        open(p, 'w').write('x')\n        res[p] = 'written'\n"
            "    except OSError as e:\n        res[p] = type(e).__name__\nchan.send({'op': 'w', 'res': res})\n")
    hello, msgs, _ = probe(tmp_path, code)
    if not hello["isolation"]["landlock"]["applied"]:
        pytest.skip(f"landlock unavailable: {hello['isolation']['landlock']}")
    res = msgs["w"]["res"]
    assert res[str(outside / "x")] == "PermissionError" and not (outside / "x").exists()
    assert list(res.values()).count("written") == 1


def test_environment_is_scrubbed(tmp_path, monkeypatch):
    monkeypatch.setenv("VERIFIER_TEST_SECRET_TOKEN", "s3cret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    _, msgs, _ = probe(tmp_path, "import os\nchan.send({'op': 'env', 'env': dict(os.environ)})\n")
    env = msgs["env"]["env"]
    assert "VERIFIER_TEST_SECRET_TOKEN" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["HOME"].startswith(str(tmp_path)) and env["TMPDIR"].startswith(str(tmp_path))
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["TORCH_EXTENSIONS_DIR"].startswith(str(tmp_path))


def test_timeout_kills_the_whole_process_group(tmp_path):
    code = ("import subprocess\np = subprocess.Popen(['sleep', '1000'])\n"
            "chan.send({'op': 'pid', 'pid': p.pid})\nwhile True:\n    pass\n")
    workdir = tmp_path / "work"
    workdir.mkdir()
    child = SandboxedChild("probe", {"code": code}, VerifierConfig(), get_backend("cpu"), str(workdir), [])
    child.start()
    child.recv(time.monotonic() + 30)  # hello
    pid = child.recv(time.monotonic() + 30)["pid"]
    with pytest.raises(ChildTimeout):
        child.recv(time.monotonic() + 1.0)
    exit_info = child.close(timed_out=True)
    assert exit_info.timed_out and exit_info.signal == "SIGKILL"
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/status") as f:
                if "State:\tZ" in f.read():
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {pid} survived the timeout kill")


def test_crash_is_reported_with_its_signal(tmp_path):
    _, _, exit_info = probe(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert exit_info.signal == "SIGSEGV"


def test_output_spam_is_drained_into_a_bounded_tail(tmp_path):
    cfg = VerifierConfig(max_output_tail_bytes=4096)
    code = "import sys\nfor _ in range(30):\n    sys.stdout.write('y' * 1_000_000)\nsys.stdout.write('END')\n"
    _, _, exit_info = probe(tmp_path, code, cfg)
    assert exit_info.stdout_bytes == 30_000_003
    assert len(exit_info.stdout_tail) <= 4096 and exit_info.stdout_tail.endswith("END")


def test_rlimits_bound_file_size_and_memory(tmp_path):
    cfg = VerifierConfig(file_size_limit_bytes=1 << 20, memory_limit_bytes=1 << 30)
    code = ("import os\nres = {}\ntry:\n    open(os.path.join(os.getcwd(), 'big'), 'wb').write(b'0' * (2 << 20))\n"
            "    res['file'] = 'written'\nexcept OSError as e:\n    res['file'] = e.errno\n"
            "try:\n    b = bytearray(2 << 30)\n    res['mem'] = 'allocated'\nexcept MemoryError:\n"
            "    res['mem'] = 'MemoryError'\nchan.send({'op': 'r', 'res': res})\n")
    _, msgs, _ = probe(tmp_path, code, cfg)
    import errno
    assert msgs["r"]["res"] == {"file": errno.EFBIG, "mem": "MemoryError"}


@pytest.mark.skipif(os.getuid() != 0, reason="capabilities are only dropped for root")
def test_root_child_has_no_capabilities(tmp_path):
    code = "chan.send({'op': 'caps', 'status': open('/proc/self/status').read()})\n"
    hello, msgs, _ = probe(tmp_path, code)
    assert hello["isolation"]["capabilities"] == "dropped"
    caps = dict(line.split(":\t") for line in msgs["caps"]["status"].splitlines() if line.startswith("Cap"))
    assert int(caps["CapEff"], 16) == 0 and int(caps["CapBnd"], 16) == 0


def test_builds_run_niced_so_device_children_go_first(tmp_path):
    from verifier.sandbox import policy_for
    cfg = VerifierConfig()
    assert policy_for(cfg, [], "compile")["niceness"] == policy_for(cfg, [], "build")["niceness"] == 10
    assert policy_for(cfg, [], "run")["niceness"] == 0
    base = os.nice(0)
    _, msgs, _ = probe(tmp_path, "import os\nchan.send({'op': 'nice', 'value': os.nice(0)})\n", cfg,
                       isolation={"niceness": 7})
    assert msgs["nice"]["value"] == min(19, base + 7)
    with pytest.raises(ValueError, match="build_niceness"):
        VerifierConfig(build_niceness=25)


# ------------------------------------------------------------------------------------------ syscall filter
# One syscall per class the filter refuses, called directly through libc (what native candidate code could
# do). Arguments are harmless: each call would succeed or fail with its own errno without the filter;
# with it every one answers ENOSYS.
_SYSCALL_PROBE = '''import ctypes, errno, os
from verifier.syscall_filter import syscall_numbers
libc = ctypes.CDLL(None, use_errno=True)
nr = syscall_numbers()
def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr[name], *[ctypes.c_long(a) for a in args])
    return errno.errorcode.get(ctypes.get_errno(), "OK") if r == -1 else "OK"
res = {
    "tracing/ptrace": call("ptrace", 16, os.getppid(), 0, 0),             # PTRACE_ATTACH to the verifier
    "tracing/process_vm_writev": call("process_vm_writev", os.getppid(), 0, 0, 0, 0, 0),
    "kernel/perf_event_open": call("perf_event_open", 0, 0, -1, -1, 0),
    "kernel/bpf": call("bpf", 0, 0, 0),
    "kernel/syslog": call("syslog", 10, 0, 0),                              # SYSLOG_ACTION_SIZE_BUFFER
    "namespaces/mount": call("mount", 0, 0, 0, 0, 0),
    "namespaces/unshare_user": call("unshare", 0x10000000),                # CLONE_NEWUSER
    "namespaces/unshare_mount": call("unshare", 0x00020000),               # CLONE_NEWNS
    "namespaces/clone_newpid": call("clone", 0x20000000 | 0x10000, 0, 0, 0, 0),  # NEWPID|THREAD: EINVAL
    "namespaces/clone3": call("clone3", 0, 0),
    "namespaces/setns": call("setns", -1, 0),
    "memory_tricks/userfaultfd": call("userfaultfd", 0),
    "memory_tricks/io_uring_setup": call("io_uring_setup", 1, 0),
    "memory_tricks/keyctl": call("keyctl", 0, 0, 0, 0, 0),
    "allowed/getpid": "OK" if libc.getpid() == os.getpid() else "changed",
    "allowed/unshare_nothing": call("unshare", 0),
}
pid = os.fork()                                                            # plain clone: still works
if pid == 0:
    os._exit(7)
res["allowed/fork"] = os.waitpid(pid, 0)[1] >> 8
chan.send({"op": "r", "res": res})
'''


def test_every_refused_syscall_class_answers_enosys(tmp_path):
    hello, msgs, _ = probe(tmp_path, _SYSCALL_PROBE)
    if not hello["isolation"]["syscall_filter"]["applied"]:
        pytest.skip(f"no syscall filter here: {hello['isolation']['syscall_filter']}")
    res = msgs["r"]["res"]
    refused = {k: v for k, v in res.items() if not k.startswith("allowed/")}
    assert refused and all(v == "ENOSYS" for v in refused.values()), res
    assert res["allowed/getpid"] == "OK" and res["allowed/unshare_nothing"] == "OK" and res["allowed/fork"] == 7


def test_without_the_filter_the_same_syscalls_reach_the_kernel(tmp_path):
    """The control for the test above: none of them answers ENOSYS on its own, so ENOSYS is the filter's."""
    hello, msgs, _ = probe(tmp_path, _SYSCALL_PROBE, isolation={"syscall_filter": False})
    assert hello["isolation"]["syscall_filter"]["applied"] is False
    res = msgs["r"]["res"]
    assert not [k for k, v in res.items() if v == "ENOSYS" and k != "namespaces/clone3"], res


def test_a_child_cannot_hold_the_device_lock_even_after_chmod(tmp_path):
    """Landlock does not cover chmod: a candidate can make the lock file readable and open it. Its flock is a
    no-op under the syscall filter, so the parent still gets the device at once."""
    from verifier.device_lock import DeviceLock
    lock = DeviceLock("cpu", None, str(tmp_path / "locks"))
    lock.shared(5).release()   # the files exist, write-only for their owner
    code = (f"import fcntl, os, time\nos.chmod({lock.path!r}, 0o600)\nfd = os.open({lock.path!r}, os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nchan.send({'op': 'holding'})\ntime.sleep(3)\n")
    workdir = tmp_path / "work"
    workdir.mkdir()
    cfg = VerifierConfig(extra_writable=("/proc/self", "/dev/shm", str(tmp_path / "locks")))
    child = SandboxedChild("probe", {"code": code}, cfg, get_backend("cpu"), str(workdir), [])
    child.start()
    try:
        hello = child.recv(time.monotonic() + 30)
        if not hello["isolation"]["syscall_filter"]["applied"]:
            pytest.skip("no syscall filter here")
        assert child.recv(time.monotonic() + 30)["op"] == "holding"
        use = lock.exclusive(1.0)   # DeviceLockTimeout without the filter
        assert use.waited_s < 1.0
        use.release()
    finally:
        child.close(grace_s=0.0, timed_out=True)
