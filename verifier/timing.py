"""Timing protocol: a timer captured before candidate code exists (child side) and plausibility checks on
what the child reports (parent side).

Child side. ``CapturedTimer`` takes ``time.perf_counter`` and the backend's event class, ``record``,
``elapsed_time`` and ``synchronize`` when the harness starts, before the candidate is imported; patching
those names later changes nothing the timer calls. A timed request runs a batch of calls back to back,
the way ``triton.testing.do_bench`` does, so that launch latency and synchronisation wake-ups stay out of
sub-millisecond timings: per call an L2 flush (max(2x the L2, 256 MB) on a GPU; a modest buffer on cpu) and the
call, each bracketed by events on the current stream, every call on its own fresh inputs. A full device
sync opens and closes the batch, and the device-wide span between them bounds the per-call figure from
below: work hidden on another stream or deferred past the call's end event still counts (see
``TimedCall.call_ms``). On cpu the host clock does the same.

Parent side. The parent drives every timed request as its own round trip and measures its wall time. A
reported span larger than the parent-observed wall time is impossible, per-call times that do not fit in
the span are impossible, and a candidate whose reported spans leave systematically more unexplained wall
time than the reference's (same harness path) is understating its time. Speedups above ``speedup_cap``
are implausible.
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
        self.last_enqueue_ms = 0.0
        if backend.name == "cuda":   # the device spin that hides dispatch (CacheFlusher), captured now too
            import torch
            self.spin = getattr(torch.cuda, "_sleep", None)
        else:
            self.spin = None

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
        self.last_enqueue_ms = (self._perf() - h0) * 1e3   # host time to dispatch it (before any wait)
        self._sync()          # device-wide: side-stream work is inside the interval
        self._record(end)
        self._sync()
        h1 = self._perf()
        return out, float(self._elapsed(start, end)), (h1 - h0) * 1e3

    def time_batch(self, calls: list[Callable[[], Any]], flusher: "CacheFlusher",
                   before_each: Callable[[], None] = lambda: None,
                   watch: dict[int, tuple[Callable[[], None], Callable[[Any], None]]] | None = None) -> BatchTiming:
        """Run ``calls`` back to back, each after ``flusher``'s flush (and spin); see the module docstring.
        ``before_each`` runs in each call's flush interval, outside the call's own time. ``watch`` {index: (start,
        stop)}: ``start()`` right before that call and ``stop(output)`` right after it, from this frame, so that the
        call runs at the depth of every other (hidden trials among a batch's calls; their times mean nothing)."""
        outputs: list[Any] = []
        watch = watch or {}
        if self._event_cls is None:
            rep_ms, flush_ms = [], 0.0
            a = self._perf()
            for i, fn in enumerate(calls):
                f0 = self._perf()
                flusher.flush()
                before_each()
                if i in watch:
                    watch[i][0]()
                s0 = self._perf()
                outputs.append(fn())
                e0 = self._perf()
                if i in watch:
                    watch[i][1](outputs[-1])
                rep_ms.append((e0 - s0) * 1e3)
                flush_ms += (s0 - f0) * 1e3
            return BatchTiming(outputs, rep_ms, flush_ms, (self._perf() - a) * 1e3)
        new = lambda: self._event_cls(enable_timing=True)  # noqa: E731
        n = len(calls)
        spin = flusher.spins()
        f_ev, s_ev, e_ev = [new() for _ in range(n)], [new() for _ in range(n)], [new() for _ in range(n)]
        z_ev = [new() for _ in range(n)] if spin else []
        a, b = new(), new()
        self._sync()
        self._record(a)
        for i, fn in enumerate(calls):
            self._record(f_ev[i])
            flusher.clear()
            before_each()
            if spin:
                self._record(z_ev[i])   # the spin gets its own interval: its length varies from call to call
                flusher.spin()
            if i in watch:
                watch[i][0]()   # after the spin: a profiler started here sees the call's kernels, not the harness's
            self._record(s_ev[i])
            outputs.append(fn())
            self._record(e_ev[i])
            if i in watch:
                watch[i][1](outputs[-1])
        self._sync()          # device-wide: work on any stream ends inside the span
        self._record(b)
        self._sync()
        rep_ms = [float(self._elapsed(s_ev[i], e_ev[i])) for i in range(n)]
        flush_ms = sum(float(self._elapsed(f_ev[i], s_ev[i])) for i in range(n))
        spin_ms = sum(float(self._elapsed(z_ev[i], s_ev[i])) for i in range(n)) if spin else 0.0
        return BatchTiming(outputs, rep_ms, flush_ms, float(self._elapsed(a, b)), spin_ms)


@dataclasses.dataclass
class BatchTiming:
    outputs: list[Any]
    rep_ms: list[float]      # each call's own interval (after its flush)
    flush_ms: float          # all flushes together
    span_ms: float           # the whole batch between full device syncs
    spin_ms: float = 0.0     # of flush_ms, the dispatch-hiding spins (timing_hide_dispatch)


class CacheFlusher:
    """Overwrite a buffer larger than the cache before each timed call (cold-cache timing). With
    ``hide_cycles`` (``VerifierConfig.timing_hide_dispatch``, CUDA only) the device then spins that many clock
    cycles, long enough for the host to enqueue the whole next call: the call's interval is its device time
    without gaps of host dispatch (KernelBench's timer gets this from its 256 MB fill; on a reference that is
    a chain of small ops it decides the speedup)."""

    def __init__(self, device, nbytes: int) -> None:
        import torch
        self.nbytes = int(nbytes)
        self.buf = torch.empty(max(self.nbytes // 4, 1), dtype=torch.int32, device=device) if nbytes > 0 else None
        self.hide_cycles = 0
        self._spin = None   # CapturedTimer.spin, set with hide_cycles

    def clear(self) -> None:
        if self.buf is not None:
            self.buf.zero_()

    def spins(self) -> bool:
        return bool(self.hide_cycles) and self._spin is not None

    def spin(self) -> None:
        if self.spins():
            self._spin(self.hide_cycles)

    def flush(self) -> None:
        self.clear()
        self.spin()


def floor_flush(ref: TimedCall, call: TimedCall, spin_bound_ms: float) -> float:
    """What ``call``'s span floor subtracts: the reference's cache clears of the same trial (never a figure the
    candidate's reply could inflate), plus ``call``'s own dispatch-hiding spins, each at most ``spin_bound_ms``.
    A spin's length varies by tens of microseconds from call to call; charged at the reference's mean, that
    jitter decided the time of a call of a few microseconds. A spin keeps one SM busy, so work hidden under it
    is hidden from the span either way."""
    clear = (ref.flush_ms - ref.spin_ms) / ref.reps
    if not math.isfinite(clear):
        return 0.0
    bound = spin_bound_ms * call.reps if math.isfinite(spin_bound_ms) and spin_bound_ms > 0 else 0.0
    spin = min(max(call.spin_ms, 0.0), bound) if math.isfinite(call.spin_ms) else 0.0
    return clear * call.reps + spin


def hide_cycles(enqueue_ms: float, clock_khz: float, cap_ms: float = 5.0) -> int:
    """Device clock cycles that cover ``enqueue_ms`` of host dispatch, with margin, at most ``cap_ms``."""
    ms = min(max(1.5 * enqueue_ms + 0.02, 0.0), cap_ms)
    return int(ms * clock_khz)


# The GPU flush writes at least this much, as triton.testing.do_bench and KernelBench's timer do: besides evicting
# the L2, the ~65 us it keeps an H200 busy lets the host enqueue the next call meanwhile, so a small call is not
# charged the device's idle wait for its launch (with 2x the L2, ~30 us, a 4 us kernel was timed at 30 us).
MIN_GPU_FLUSH_BYTES = 256 << 20


def flush_bytes(backend, cfg, index: int = 0) -> int:
    if not backend.is_gpu:
        return int(cfg.cpu_flush_bytes)
    l2 = backend.l2_cache_bytes(index) or 0
    return max(2 * l2, MIN_GPU_FLUSH_BYTES)


# ------------------------------------------------------------------------------------------ parent side
@dataclasses.dataclass
class TimedCall:
    """One timed request as the child reported it, plus the parent's own wall clock of the round trip."""
    runner: str          # "ref" | "cand" | "ref_compile"
    reported_ms: float   # the child's span of the whole request (all its calls and flushes)
    wall_ms: float       # parent-observed round trip of the request
    rep_ms: list[float] | None = None   # the child's per-call times (None: one call, reported_ms)
    flush_ms: float = 0.0                # the child's flush time of this request (spins included)
    floor_flush_ms: float | None = None  # flush time the span floor subtracts (the parent sets it)
    spin_ms: float = 0.0                 # of flush_ms, the dispatch-hiding spins (timing_hide_dispatch)

    @property
    def reps(self) -> int:
        return len(self.rep_ms) if self.rep_ms else 1

    @property
    def call_ms(self) -> float:
        """Time of one call: the median of the per-call intervals, but never less than the span's share
        per call once the flushes are taken out. For an honest kernel on the timed stream both agree
        (the span adds one sync wake-up over the whole batch); work moved to another stream or past
        the end event shows up only in the span."""
        if not self.rep_ms:
            return self.reported_ms
        flush = self.flush_ms if self.floor_flush_ms is None else self.floor_flush_ms
        return max(statistics.median(self.rep_ms), (self.reported_ms - flush) / len(self.rep_ms))


def choose_reps(est_ms: dict[str, float], input_bytes: int, output_bytes: dict[str, int], batch_ms: float,
                max_reps: int, memory_bytes: int, flush_ms: float = 0.0) -> int:
    """Calls per timed request: enough to fill ``batch_ms`` (calls and their flushes) for the slowest
    runner, within ``max_reps``, and few enough that every call's fresh inputs and kept-alive outputs fit
    in ``memory_bytes``."""
    slowest = max((v for v in est_ms.values() if math.isfinite(v) and v >= 0), default=math.inf)
    flush_ms = flush_ms if math.isfinite(flush_ms) and flush_ms > 0 else 0.0
    by_time = math.floor(batch_ms / max(slowest + flush_ms, 1e-3)) if math.isfinite(slowest) else 1
    per_rep = sum(max(int(input_bytes), 0) + max(int(output_bytes.get(r, 0)), 0) for r in est_ms)
    by_memory = memory_bytes // per_rep if per_rep > 0 else max_reps
    return int(max(1, min(max_reps, by_time, by_memory)))


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    if not all(math.isfinite(v) for v in values):   # child-reported garbage: judged by implausible_timing
        return {"n": len(values), "non_finite": sum(not math.isfinite(v) for v in values)}
    return {"n": len(values), "median": statistics.median(values), "mean": statistics.fmean(values),
            "std": statistics.pstdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values)}


def implausible_timing(calls: list[TimedCall]) -> str | None:
    """Why the reported times cannot be right, or None. Only the parent's own clock is trusted here."""
    return reported_time_problem(calls) or overhead_problem(calls)


# No timer the harness uses resolves less than this per call (CUDA events: 0.5 us; a call through Python
# takes microseconds): a smaller per-call time is a forged report (aggregator underflow: a speedup that is
# a division by almost nothing).
MIN_CALL_MS = 1e-3


def reported_time_problem(calls: list[TimedCall]) -> str | None:
    """Reports that contradict themselves or the parent's clock on a single call (never noise)."""
    for c in calls:
        if not math.isfinite(c.reported_ms) or c.reported_ms < 0:
            return f"{c.runner} call reported a time of {c.reported_ms!r} ms"
        parts = list(c.rep_ms or []) + [c.flush_ms]
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in parts):
            return f"{c.runner} call reported per-call times {c.rep_ms!r} / flush {c.flush_ms!r} ms"
        if c.rep_ms and sum(parts) > c.reported_ms * 1.01 + 0.01 * c.reps:
            return (f"{c.runner} call reported {sum(c.rep_ms):.3f} ms of calls and {c.flush_ms:.3f} ms of "
                    f"flushes inside a span of {c.reported_ms:.3f} ms")
        if c.call_ms < MIN_CALL_MS:
            return (f"{c.runner} call reported {c.call_ms:.3g} ms per call, below the resolution of any timer "
                    f"the verifier uses ({MIN_CALL_MS * 1e3:g} us)")
        if c.reported_ms > c.wall_ms * 1.01 + 0.1:
            return (f"{c.runner} call reported {c.reported_ms:.3f} ms but the whole request took "
                    f"{c.wall_ms:.3f} ms of the parent's wall clock")
    return None


def overhead_problem(calls: list[TimedCall]) -> str | None:
    """Candidate calls whose wall time exceeds their report by more than the reference's ever does: time
    spent outside the reported span. A statistical check: CPU scheduling delays on a loaded host add
    unexplained time too, so a stage that sees it times again before calling it cheating."""
    by = {r: [c for c in calls if c.runner == r] for r in ("ref", "cand")}
    if len(by["ref"]) >= 3 and len(by["cand"]) >= 3:
        # Scheduling noise only ever adds unexplained time, so compare minima: an honest candidate has some
        # calls whose overhead matches the reference's best; one that under-reports has none.
        unexplained = {r: min(c.wall_ms - c.reported_ms for c in v) for r, v in by.items()}
        fastest = min(by["cand"], key=lambda c: c.wall_ms)
        if unexplained["cand"] - unexplained["ref"] > max(0.5, 0.1 * fastest.wall_ms):
            return (f"every candidate call took far more wall time than it reported (best: {fastest.wall_ms:.3f} "
                    f"ms of wall time, {fastest.reported_ms:.3f} ms reported); the reference's harness overhead "
                    f"is {unexplained['ref']:.3f} ms")
    return None
