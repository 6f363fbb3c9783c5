"""The verdict every other part trusts: categories, the per-candidate result, reward parameters.

`VerifyResult` is what the farm returns for every submitted sample (exactly one each), what the
CLI prints with ``--json``, and what the RL rewards are computed from.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any


class Category(str, enum.Enum):
    PASS = "pass"
    FORMAT_ERROR = "format_error"
    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"
    CORRECTNESS_ERROR = "correctness_error"
    CHEATING = "cheating"
    TIMEOUT = "timeout"
    INFRA = "infra"  # the farm failed, not the model: retried, never scored


# Rules of ``infra`` verdicts that are the task's own fault on this machine, never the moment's: a retry gives the same
# verdict, so neither the farm nor its callers retry them (``verifier.farm.TASK_FAULT_RULES``).
REFERENCE_NOT_REPEATABLE = "reference_not_repeatable"   # two reference calls on the same inputs differ
REFERENCE_INSENSITIVE = "reference_insensitive"         # the reference gives the same output for every input
TASK_TOO_LARGE = "task_too_large"         # one check needs more memory than the device/host has in all (or a limit)
TASK_LOAD_FAILED = "task_load_failed"     # the task module fails to execute (a missing package, a bug in the file)
REFERENCE_FAILED = "reference_failed"     # get_init_inputs()/Model(...) raises, again on meta tensors in the parent
#: infra verdicts that are the task's own fault: a retry would give the same verdict, so none is made (the farm, the agent
#: loop and ``data_synth distill``). A task too large for the device's or host's whole memory is here
#: (``task_too_large``); one that does not fit what is free right now has no rule and is retried.
TASK_FAULT_RULES = frozenset({REFERENCE_NOT_REPEATABLE, REFERENCE_INSENSITIVE, TASK_TOO_LARGE, TASK_LOAD_FAILED,
                              REFERENCE_FAILED})


@dataclasses.dataclass(frozen=True)
class RewardParams:
    """MusaCoder eq. 2. λ and ν_max are not published; 0.5 / 4 follow the paper's figure."""

    lam: float = 0.5
    nu_max: float = 4.0


def reward_eq2(category: Category, q: float, speedup: float | None, p: RewardParams = RewardParams()) -> float:
    """s(c): -1 on any failure or q=0; -0.5+0.5q for partial; 1+λ·min(max(ν-1,0),ν_max) when correct."""
    if category == Category.INFRA:
        raise ValueError("infra verdicts have no reward: retry them")
    if category in (Category.FORMAT_ERROR, Category.COMPILE_ERROR, Category.RUNTIME_ERROR,
                    Category.CHEATING, Category.TIMEOUT):
        return -1.0
    if not (0.0 <= q <= 1.0) or math.isnan(q):
        raise ValueError(f"q must be in [0, 1], got {q}")
    if q == 0.0:
        return -1.0
    if q < 1.0:
        return -0.5 + 0.5 * q
    if category != Category.PASS:
        # fully correct numerically but judged otherwise (e.g. timing failed) is not a pass
        return -0.5 + 0.5 * q
    nu = 1.0 if speedup is None or not math.isfinite(speedup) else float(speedup)
    return 1.0 + p.lam * min(max(nu - 1.0, 0.0), p.nu_max)


@dataclasses.dataclass
class VerifyResult:
    task_id: str
    category: Category
    q: float = 0.0                      # fraction of correctness trials passed
    speedup: float | None = None        # t_ref / t_cand vs eager; None unless correct and legal
    reward: float | None = None         # eq. 2; None only for infra
    feedback: str = ""                  # bounded text the model sees next turn
    backend: str = "cpu"
    device_name: str | None = None
    code_hash: str = ""
    t_ref_ms: float | None = None
    t_cand_ms: float | None = None
    speedup_compile: float | None = None  # vs torch.compile reference, when asked
    rule: str | None = None             # the static/runtime rule that fired, for cheating
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    cached: bool = False
    attempts: int = 1

    @property
    def passed(self) -> bool:
        return self.category == Category.PASS

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["category"] = self.category.value
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=str)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VerifyResult":
        d = dict(d)
        d["category"] = Category(d["category"])
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})
