"""One free TCP port for a server this process is about to start (a rendezvous store, an engine, a weight group).

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, which every outgoing connection on the
host draws from too: between this check and the server's own bind, another process's connection can take it
(``EADDRINUSE`` in torch.distributed's store under a parallel test run). Ports are drawn at random below that range
instead, where only servers that ask for a port by number go.
"""
from __future__ import annotations

import random
import socket

_LOWEST = 10000   # above the registered services most hosts run


def ephemeral_floor() -> int:
    """The lowest port of the host's ephemeral range (Linux's ``ip_local_port_range``; the IANA 49152 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port ``host`` can bind now, drawn below the ephemeral range (the kernel's choice when none is free there)."""
    top = ephemeral_floor()
    if top - _LOWEST >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_LOWEST, top)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
