"""`megatron_rl.ports.free_port` and `parallel.spawn`: a rendezvous port lost between the check and rank 0's bind
(EADDRINUSE under a parallel test run) costs a retry on a fresh port, not the run."""
from __future__ import annotations

import socket

import pytest

from megatron_rl import parallel
from megatron_rl.ports import ephemeral_floor, free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < ephemeral_floor() for p in ports), ports
    assert len(ports) > 1      # drawn at random, not one fixed port that two runs would share
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))


def _rendezvous(path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    with open(path, "a") as f:
        f.write(f"{dist.get_rank()}\n")
    dist.destroy_process_group()


@pytest.mark.slow
def test_spawn_takes_a_fresh_port_when_the_rendezvous_port_was_taken(tmp_path, monkeypatch):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    handed = []

    def ports():
        handed.append(taken.getsockname()[1] if not handed else free_port())
        return handed[-1]

    try:
        monkeypatch.setattr(parallel, "free_port", ports)
        parallel.spawn(_rendezvous, 2, str(tmp_path / "ranks"))
    finally:
        taken.close()
    assert len(handed) == 2 and sorted((tmp_path / "ranks").read_text().split()) == ["0", "1"]


def test_spawn_does_not_retry_other_failures(monkeypatch):
    calls = []
    monkeypatch.setattr(parallel, "free_port", lambda: calls.append(1) or 1)
    with pytest.raises(Exception, match="boom"):
        parallel.spawn(_fail, 1)
    assert len(calls) == 1


def _fail() -> None:
    raise RuntimeError("boom")
