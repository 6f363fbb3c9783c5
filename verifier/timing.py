"""Timing protocol: a timer captured before candidate code exists (child side) and plausibility checks on
what the child reports (parent side).

Child side. ``CapturedTimer`` takes ``time.perf_counter`` and the backend's event class, ``record``,
``elapsed_time`` and ``synchronize`` when the harness starts, before the candidate is imported; patching
those names later changes nothing the timer calls. A timed call is: L2 flush (a separate step, buffer
>= 2x the L2 size; a modest buffer on cpu), full device sync, start event, the call, full device sync
(captures work on any stream), end event. On cpu the host clock brackets the call.

Parent side. The parent drives every timed call as its own request/response round trip and measures
the wall time of each. A reported time larger than the parent-observed wall time is impossible, and a
candidate whose reported times leave systematically more unexplained wall time than the reference's (same
harness path) is understating its time. Speedups above ``speedup_cap`` are implausible.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

_PERF_COUNTER = time.perf_counter  # captured at import: the harness imports this before any candidate code


class CapturedTimer:
    def __init__(self, backend) -> None:
        self._perf = _PERF_COUNTER
        self._sync = backend.synchronize_fn()
        api = backend.event_api()
        self._event_cls, self._record, self._elapsed = api if api else (None, None, None)
        self._names = self._current_refs(backend)

    @staticmethod
    def _current_refs(backend) -> dict[str, Any]:
        refs: dict[str, Any] = {"time.perf_counter": time.perf_counter}
        api = backend.event_api()
        if api:
            refs.update({"Event": api[0], "Event.record": api[1], "Event.elapsed_time": api[2],
                         "synchronize": backend.synchronize_fn()})
        return refs

    def patched(self, backend) -> list[str]:
        """Names whose current object differs from the one captured at start (child-reported, advisory)."""
        now = self._current_refs(backend)
        return sorted(k for k, v in self._names.items() if now.get(k) is not v)

    def now(self) -> float:
        return self._perf()

    def synchronize(self) -> None:
        self._sync()

    def time_call(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """(result, device-or-host milliseconds, host milliseconds) of one call, device synchronised."""
        if self._event_cls is None:
            t0 = self._perf()
            out = fn()
            t1 = self._perf()
            return out, (t1 - t0) * 1e3, (t1 - t0) * 1e3
        start = self._event_cls(enable_timing=True)
        end = self._event_cls(enable_timing=True)
        self._sync()
        h0 = self._perf()
        self._record(start)
        out = fn()
        self._sync()          # device-wide: side-stream work is inside the interval
        self._record(end)
        self._sync()
        h1 = self._perf()
        return out, float(self._elapsed(start, end)), (h1 - h0) * 1e3


class CacheFlusher:
    """Overwrite a buffer larger than the cache before each timed call (cold-cache timing)."""

    def __init__(self, device, nbytes: int) -> None:
        import torch
        self.nbytes = int(nbytes)
        self.buf = torch.empty(max(self.nbytes // 4, 1), dtype=torch.int32, device=device) if nbytes > 0 else None

    def flush(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def flush_bytes(backend, cfg, index: int = 0) -> int:
    if not backend.is_gpu:
        return int(cfg.cpu_flush_bytes)
    l2 = backend.l2_cache_bytes(index)
    return 2 * l2 if l2 else 256 << 20


# ------------------------------------------------------------------------------------------ parent side
@dataclasses.dataclass
class TimedCall:
    runner: str          # "ref" | "cand" | "ref_compile"
    reported_ms: float   # what the child says the call took
    wall_ms: float       # parent-observed round trip of the request


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "mean": statistics.fmean(values),
            "std": statistics.pstdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values)}


def implausible_timing(calls: list[TimedCall]) -> str | None:
    """Why the reported times cannot be right, or None. Only the parent's own clock is trusted here."""
    for c in calls:
        if not math.isfinite(c.reported_ms) or c.reported_ms < 0:
            return f"{c.runner} call reported a time of {c.reported_ms!r} ms"
        if c.reported_ms > c.wall_ms * 1.01 + 0.1:
            return (f"{c.runner} call reported {c.reported_ms:.3f} ms but the whole request took "
                    f"{c.wall_ms:.3f} ms of the parent's wall clock")
    by = {r: [c for c in calls if c.runner == r] for r in ("ref", "cand")}
    if len(by["ref"]) >= 3 and len(by["cand"]) >= 3:
        # Scheduling noise only ever adds unexplained time, so compare minima: an honest candidate has some
        # calls whose overhead matches the reference's best; one that under-reports has none.
        unexplained = {r: min(c.wall_ms - c.reported_ms for c in v) for r, v in by.items()}
        fastest = min(by["cand"], key=lambda c: c.wall_ms)
        if unexplained["cand"] - unexplained["ref"] > max(0.5, 0.25 * fastest.wall_ms):
            return (f"every candidate call took far more wall time than it reported (best: {fastest.wall_ms:.3f} "
                    f"ms of wall time, {fastest.reported_ms:.3f} ms reported); the reference's harness overhead "
                    f"is {unexplained['ref']:.3f} ms")
    return None
