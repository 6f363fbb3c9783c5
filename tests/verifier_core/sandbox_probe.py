"""A sandboxed probe child: runs a snippet after isolation is applied (no torch), so tests take seconds."""
import time

from verifier.config import VerifierConfig
from verifier.devices import get_backend
from verifier.sandbox import ChildFailed, SandboxedChild


def probe(tmp_path, code, cfg=None, timeout=30.0, isolation=None):
    """Run ``code`` (it has ``chan`` to send messages) in a probe child; ``isolation`` overrides entries of
    its isolation policy. Returns the hello message, the other messages by op, and the exit info."""
    cfg = cfg or VerifierConfig()
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    child = SandboxedChild("probe", {"code": code}, cfg, get_backend("cpu"), str(workdir), [])
    child.job["isolation"].update(isolation or {})
    child.start()
    msgs = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            msgs.append(child.recv(deadline))
    except ChildFailed:
        pass
    exit_info = child.close()
    hello, rest = msgs[0], {m["op"]: m for m in msgs[1:]}
    return hello, rest, exit_info
