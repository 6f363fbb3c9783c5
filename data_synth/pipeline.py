"""The task-set pipeline behind ``generate``, ``validate`` and ``decontaminate``: candidates are drawn in order,
decontaminated (against KernelBench, other reference sets and the tasks already accepted), validated by
running their reference, and accepted until the requested count is reached. Every candidate gets one
report row: accepted, or skipped with the check that rejected it and why.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Iterable, Sequence

from tqdm import tqdm

from megatron_rl.rollout.prompts import describe_task_inputs

from .decontam import Decontaminator, Reference, fingerprint
from .generate import GenConfig, GeneratedTask, generate_candidate
from .taskset import read_task_set
from .util import DataSynthError
from .validate import ValidationConfig, validate_task

log = logging.getLogger("data_synth")


@dataclasses.dataclass
class CandidateRecord:
    index: int
    task_id: str
    status: str                        # accepted | skipped
    check: str | None = None           # generate | decontaminate | validate (what skipped it)
    reason: str | None = None
    decontam: dict[str, Any] | None = None
    validation: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _prompt_inputs(task: GeneratedTask) -> list[dict[str, Any]]:
    meta = describe_task_inputs(task.source, task.path or f"<{task.task_id}>")
    return [{"name": a.name, "kind": a.kind, "shape": list(a.shape) if a.shape is not None else None,
             "stride": list(a.stride) if a.stride is not None else None, "dtype": a.dtype, "value": a.value}
            for a in meta.inputs]


def references(kernelbench: bool = True, against: Sequence[str] = ()) -> list[Reference]:
    """The committed KernelBench index plus any task sets given as paths."""
    refs = [Reference.load_index()] if kernelbench else []
    for spec in against:
        tasks = read_task_set(spec)
        refs.append(Reference.from_sources(spec, ((t.task_id, t.source) for t in tasks)))
    return refs


def generate_task_set(cfg: GenConfig, *, validation: ValidationConfig | None = None,
                      decontam: Decontaminator | None = None, max_candidates: int | None = None,
                      progress: bool = True,
                      band_margin: float = 2.0) -> tuple[list[GeneratedTask], list[CandidateRecord]]:
    """Accepted tasks (at most ``cfg.n``) and one record per candidate drawn. Candidates are drawn until
    ``cfg.n`` are accepted or ``max_candidates`` (default ``4n + 20``) were tried. The runtime band is narrowed
    by ``band_margin`` on both sides, so accepted tasks keep passing ``validate`` under timing noise."""
    decontam = decontam or Decontaminator([])
    if validation is not None and band_margin != validation.band_margin:
        validation = dataclasses.replace(validation, band_margin=band_margin)
    limit = max_candidates or cfg.n * 4 + 20
    tasks: list[GeneratedTask] = []
    records: list[CandidateRecord] = []
    bar = tqdm(total=cfg.n, desc=f"generate stage {cfg.stage}", unit="task", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    try:
        index = 0
        while len(tasks) < cfg.n and index < limit:
            rec = _one_candidate(cfg, index, validation, decontam, tasks)
            records.append(rec)
            index += 1
            bar.set_postfix(tried=index, skipped=index - len(tasks))
            if rec.status == "accepted":
                bar.update(1)
    finally:
        bar.close()
    if len(tasks) < cfg.n:
        log.warning("only %d of %d tasks accepted after %d candidates (see the report for the reasons)",
                    len(tasks), cfg.n, len(records))
    return tasks, records


def _one_candidate(cfg: GenConfig, index: int, validation: ValidationConfig | None, decontam: Decontaminator,
                   accepted: list[GeneratedTask]) -> CandidateRecord:
    try:
        task = generate_candidate(cfg, index)
    except DataSynthError as e:
        log.warning("skip candidate %d: %s", index, e)
        return CandidateRecord(index, f"{index + 1}_?", "skipped", "generate", str(e))
    fp = fingerprint(task.source)
    v = decontam.check(task.task_id, task.source, fp)
    dec = {"similarity": v.similarity, "nearest": v.nearest, "tags": v.tags}
    if v.dropped:
        log.warning("skip %s: decontamination: %s", task.task_id, v.reason)
        return CandidateRecord(index, task.task_id, "skipped", "decontaminate", v.reason, v.to_dict())
    vres = None
    if validation is not None:
        vres = validate_task(task, validation)
        if not vres.ok:
            return CandidateRecord(index, task.task_id, "skipped", "validate", vres.reason, dec, vres.to_dict())
        task.meta["validation"] = {"eager_ms": vres.eager_ms, "profile": validation.profile, "checks": vres.checks,
                                   "outputs": vres.outputs}
        task.meta["inputs"] = vres.inputs
    else:
        task.meta["inputs"] = _prompt_inputs(task)
    task.meta["decontam"] = dec
    decontam.remember(task.task_id, task.source, fp)
    accepted.append(task)
    return CandidateRecord(index, task.task_id, "accepted", None, None, dec, None if vres is None else vres.to_dict())


def validate_tasks(tasks: Iterable[GeneratedTask], cfg: ValidationConfig, progress: bool = True):
    """(valid tasks, one result per task)."""
    tasks = list(tasks)
    ok, results = [], []
    for t in tqdm(tasks, desc="validate", unit="task", file=sys.stderr, disable=not progress, dynamic_ncols=True):
        r = validate_task(t, cfg)
        results.append(r)
        if r.ok:
            t.meta["validation"] = {"eager_ms": r.eager_ms, "profile": cfg.profile, "checks": r.checks,
                                    "outputs": r.outputs}
            ok.append(t)
    return ok, results


def decontaminate_tasks(tasks: Iterable[GeneratedTask], decontam: Decontaminator, progress: bool = True):
    """(kept tasks, one verdict per task); duplicates within ``tasks`` are dropped too (first one kept)."""
    kept, verdicts = [], []
    for t in tqdm(list(tasks), desc="decontaminate", unit="task", file=sys.stderr, disable=not progress,
                  dynamic_ncols=True):
        try:
            fp = fingerprint(t.source)
        except SyntaxError as e:
            raise DataSynthError(f"task {t.task_id} ({t.path}) does not parse: {e}") from None
        v = decontam.check(t.task_id, t.source, fp)
        verdicts.append(v)
        if v.dropped:
            log.warning("drop %s: %s", t.task_id, v.reason)
            continue
        decontam.remember(t.task_id, t.source, fp)
        t.meta["decontam"] = {"similarity": v.similarity, "nearest": v.nearest, "tags": v.tags}
        kept.append(t)
    return kept, verdicts
