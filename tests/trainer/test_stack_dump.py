"""`kill -USR1` on a long run prints every thread's stack and the run goes on; a host without a real stderr
(pytest's capture) still starts."""
from __future__ import annotations

import io
import signal
import subprocess
import sys
import time

from megatron_rl.config import REPO_ROOT
from megatron_rl.observability import dump_stacks_on_sigusr1

CHILD = """
import sys, threading, time
from megatron_rl.observability import dump_stacks_on_sigusr1
assert dump_stacks_on_sigusr1()
def waits_in_a_worker(): time.sleep(30)
threading.Thread(target=waits_in_a_worker, daemon=True).start()
print("armed", flush=True)
for _ in range(100):
    time.sleep(0.02)
print("still running", flush=True)
"""


def test_sigusr1_dumps_every_thread_and_the_process_goes_on():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "armed"
    time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "still running" in out
    assert "waits_in_a_worker" in err          # the worker thread's stack, not only the main one
    assert "Current thread" in err or "Thread 0x" in err


def test_a_stderr_without_a_descriptor_arms_nothing_and_does_not_raise(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert dump_stacks_on_sigusr1() is False
