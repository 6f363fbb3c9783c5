"""Size sampling for both profiles: module constants that make a task run in milliseconds on a CPU, and
manifest ``gpu`` sizes in the range KernelBench uses (where a speedup on a GPU is measurable).

A task's shape *style* is drawn once: ``nice`` sizes are powers of two (block-aligned), ``odd`` sizes are
not (the boundary-handling case kernels most often get wrong, research note §2.2 tier T1).
"""
from __future__ import annotations

import dataclasses
import math
import random

from .ir import Dim

# total elements of a task's main tensor, per profile (log2 bounds)
ELEMS_LOG2 = {"cpu": (15, 19), "gpu": (22, 26)}


@dataclasses.dataclass
class Names:
    """Unique module-constant names within one task (``dim``, ``dim_2``, ...)."""

    used: set[str] = dataclasses.field(default_factory=set)

    def take(self, base: str) -> str:
        name, k = base, 2
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name


@dataclasses.dataclass
class SizeSampler:
    rng: random.Random
    style: str = "nice"               # nice | odd
    names: Names = dataclasses.field(default_factory=Names)

    def _value(self, lo: int, hi: int) -> int:
        """One size in [lo, hi]: a power of two for ``nice``, a non-power of two for ``odd``."""
        lo, hi = max(1, lo), max(lo, hi)
        if self.style == "nice":
            a, b = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
            if a <= b:
                return 1 << self.rng.randint(a, b)
        for _ in range(20):
            v = self.rng.randint(lo, hi)
            if v & (v - 1) or hi - lo < 2:
                return v
        return lo

    def dim(self, base: str, cpu: tuple[int, int], gpu: tuple[int, int], named: bool = True) -> Dim:
        """A new size; ``cpu``/``gpu`` are inclusive ranges."""
        return Dim(self._value(*cpu), self._value(*gpu), self.names.take(base) if named else None)

    def fixed(self, base: str, value: int) -> Dim:
        """A size equal in both profiles (a kernel size, a head count)."""
        return Dim(value, value, self.names.take(base))

    def split(self, bases: list[str], mins: list[int] | None = None, total_log2: dict | None = None) -> list[Dim]:
        """Sizes whose product lands in the profile's element budget (the first gets what is left over)."""
        bounds = total_log2 or ELEMS_LOG2
        mins = mins or [1] * len(bases)
        per = {}
        for prof in ("cpu", "gpu"):
            lo, hi = bounds[prof]
            total = self.rng.uniform(lo, hi)
            k = len(bases)
            # split log2(total) into k random shares, each at least log2(min)
            cuts = sorted(self.rng.uniform(0, 1) for _ in range(k - 1))
            shares = [b - a for a, b in zip([0.0, *cuts], [*cuts, 1.0])]
            vals = []
            for share, m in zip(shares, mins):
                v = max(m, int(round(2 ** (share * total))))
                vals.append(v)
            per[prof] = [self._round(v, m) for v, m in zip(vals, mins)]
        return [Dim(c, g, self.names.take(b)) for b, c, g in zip(bases, per["cpu"], per["gpu"])]

    def _round(self, v: int, minimum: int) -> int:
        v = max(v, minimum)
        if self.style == "nice":
            return max(minimum, 1 << max(0, round(math.log2(v))))
        if v > 8 and not v & (v - 1):
            v += self.rng.choice((-3, -1, 1, 3, 5))
        return max(minimum, v)
