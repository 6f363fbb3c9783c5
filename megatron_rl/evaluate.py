"""Evaluate a model on KernelBench-format tasks and write the paper's table (MusaCoder §2.1), per level.

    python -m megatron_rl.evaluate --model MODEL --tasks DIR --samples 8 --turns 3 --backend cpu|cuda|musa --out DIR

``MODEL`` is an HF model dir, or any checkpoint this project writes, converted on the fly (``ckpt_tools
mcore-to-hf`` into ``OUT/model_hf``): an SFT/RFT/RL run dir (its ``hf/`` export if there is one and no checkpoint was
saved after it, else its latest checkpoint in ``ckpt/``), a checkpoint root (``latest_checkpointed_iteration.txt``) or one ``iter_*`` dir. The tokenizer and chat
template come from the model dir (``--tokenizer`` overrides; qwen3-offline when it has none). A conversion already in
``OUT`` is reused only when it was made from the same checkpoint (``model_hf_iter*.source.json``).

``--tasks`` takes KernelBench's own layouts unchanged: the folder holding ``level1`` .. ``level4`` (the level of a task
is its ``levelN`` folder), one level folder, one task file, a manifest or a list file. Every input is checked before
the model is loaded or ``OUT`` is written: a bad flag, a missing or malformed task set, a ``--backend`` whose device
this host lacks, a ``--model`` that is no model end the run with one ``error:`` line and exit status 2. A run in which
no task could be scored writes its reports and exits with status 3.

``--size-profile`` picks a manifest's size profile (``gpu``: realistic shapes), or ``fit[:MiB[:GFLOP]]``, which
shrinks any task, KernelBench's own included, until one reference call moves at most 64 MiB and does at most 2
GFLOP (``verifier.size_profiles.fit_sizes``): KernelBench's GPU sizes do not fit a CPU. The prompt shows the
resized source; ``summary.json`` lists each resized task's constants.

The embedded engine serves the model; each task gets ``--samples`` trajectories of at most ``--turns`` responses,
with the verifier's feedback as the next user turn after a failure, exactly as the RL agent runs them
(`megatron_rl.rollout.agent.AgentLoop`, the RL prompts, the verifier farm). A sample passes when any of its turns
passes. Per level and overall (weighted by task count, as the paper's "Overall"):

* ``pass_at_k``: the unbiased estimator 1 - C(n-c, k) / C(n, k), averaged over tasks (n samples, c passing);
* ``avg_at_n``: the mean fraction of passing samples (the paper's Avg@8 at n = 8);
* ``faster_eager`` / ``faster_compile``: the fraction of all samples that are correct, legal and more than 1.1x
  faster than PyTorch eager / ``torch.compile`` (the latter only with ``--compare-compile``);
* ``speedup_mean`` / ``speedup_median`` over passing samples; ``first_turn`` the same pass figures for turn 1 alone.

Outputs in ``--out``: ``results.jsonl`` (one row per sample, every turn's verdict), ``summary.json``, ``report.md``
(the table per level and per op family), ``report.html`` with two plots (speedup distribution per level, pass rate
per op family). A task whose group could not be scored (persistent infra verdicts, a prompt over the context) is
listed with its reason and left out of the figures, never counted as a failure. With ``--backend cpu`` the verifier's
memory gate is run on every task before the model is loaded: a task too large for this host at its sizes (KernelBench's
full sizes: a 6 GiB ReLU input) is listed as ``too_large`` with the sizes it needs, and nothing is generated for it
(each of its samples would get the same ``infra`` verdict after its generation, retried to no end). The last stdout line
is a JSON summary.

A stopped run (Ctrl-C, a crash, a kill) keeps its finished tasks: each task's rows are appended to
``OUT/results.partial.jsonl`` as its group finishes (one fsynced line per task; a kill loses at most the task being
written), and the same command with the same ``--out`` continues with the tasks not done yet. The file's first line is
a fingerprint of what decides the results (the model and its weight files, the task source, the sampling, verifier and
task-selection flags, the seed, the backend, the tokenizer); a run whose flags differ from it is refused (exit 2,
naming the fields) and the file is left as it was: ``--fresh`` moves it aside (``results.partial-<time>.jsonl``) and
starts over, or pick another ``--out``. A finished task is reused only while it is still selected and its source (as
resized) and precision are unchanged; a task that could not be scored counts as finished. Once every task is done the
reports are written from the kept and the new rows alike and the progress file is removed, so a finished ``OUT``
looks as it always did, and the same command on it starts a new evaluation. Resumed tasks are not sampled again: their
samples are those an uninterrupted run draws, because every request's sampling seed is derived from ``--seed``, the
task, the sample and the turn (``AgentConfig.seed``), never from what else ran, up to the floating-point differences
another batch composition can make in the logits; timings (speedups) are measurements and vary between any two runs.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import html
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.fsutil import OutputBusyError, describe_os_error, output_lock

log = logging.getLogger("megatron_rl.evaluate")

FASTER = 1.1


# ------------------------------------------------------------------------------------------ metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of the n samples, drawn without replacement, hold a
    correct one, when c of n are correct. Computed as a product, so large n stays exact in floats."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@dataclasses.dataclass
class SampleOutcome:
    task_id: str
    level: int | None
    family: str
    passed: bool
    first_turn_passed: bool
    speedup: float | None           # of the passing turn
    speedup_compile: float | None
    turns: int
    category: str                   # the last turn's verdict


def table(outcomes: Sequence[SampleOutcome], ks: Sequence[int]) -> dict[str, Any]:
    """The paper's figures over ``outcomes`` (every task with the same number of samples)."""
    by_task: dict[str, list[SampleOutcome]] = {}
    for o in outcomes:
        by_task.setdefault(o.task_id, []).append(o)
    if not by_task:
        return {"tasks": 0, "samples": 0}
    out: dict[str, Any] = {"tasks": len(by_task), "samples": len(outcomes)}
    for label, key in (("", "passed"), ("first_turn_", "first_turn_passed")):
        for k in ks:
            vals = [pass_at_k(len(s), sum(getattr(o, key) for o in s), k) for s in by_task.values() if k <= len(s)]
            out[f"{label}pass_at_{k}"] = sum(vals) / len(vals) if vals else None
        out[f"{label}avg_at_n"] = sum(sum(getattr(o, key) for o in s) / len(s) for s in by_task.values()) / len(by_task)
    out["faster_eager"] = sum(o.passed and (o.speedup or 0) > FASTER for o in outcomes) / len(outcomes)
    measured = [o for o in outcomes if not o.passed or o.speedup_compile is not None]
    out["faster_compile"] = (sum(o.passed and (o.speedup_compile or 0) > FASTER for o in outcomes) / len(outcomes)
                             if any(o.speedup_compile is not None for o in outcomes) and len(measured) == len(outcomes)
                             else None)
    speedups = [o.speedup for o in outcomes if o.passed and o.speedup is not None]
    out["speedup_mean"] = sum(speedups) / len(speedups) if speedups else None
    out["speedup_median"] = statistics.median(speedups) if speedups else None
    cats: dict[str, int] = {}
    for o in outcomes:
        cats[o.category] = cats.get(o.category, 0) + 1
    out["categories"] = dict(sorted(cats.items()))
    return out


def summarize(outcomes: Sequence[SampleOutcome], ks: Sequence[int]) -> dict[str, Any]:
    levels = sorted({o.level for o in outcomes}, key=lambda v: (v is None, v or 0))
    fams = sorted({o.family for o in outcomes})
    return {"overall": table(outcomes, ks),
            "levels": {str(lv): table([o for o in outcomes if o.level == lv], ks) for lv in levels},
            "families": {f: table([o for o in outcomes if o.family == f], ks) for f in fams}}


# ------------------------------------------------------------------------------------------ model


class ModelError(ValueError):
    """--model is not something this tool can load; the message says what it found."""


def _is_hf_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def _checkpoint_newer_than_export(run_dir: Path) -> str | None:
    """The name of a run dir's latest checkpoint if it was saved after the run's ``hf/`` export, else None (an export
    is written after the final save, so a newer checkpoint means the run went on without exporting)."""
    from megatron_rl.checkpoint import META_FILE, CheckpointError, resolve_checkpoint

    if not (run_dir / "ckpt").is_dir():
        return None
    try:
        _, ckpt = resolve_checkpoint(run_dir / "ckpt", None)
        newer = (ckpt / META_FILE).stat().st_mtime_ns > (run_dir / "hf" / "config.json").stat().st_mtime_ns
    except (CheckpointError, OSError):
        return None
    return ckpt.name if newer else None


def _locate_model(spec: str) -> tuple[Path | None, Path | None, int | None]:
    """What ``spec`` is, read without loading or converting anything: ``(hf_dir, None, None)`` for an HF model dir
    (itself or a run's ``hf/`` export), ``(None, checkpoint_root, iteration)`` for a checkpoint (iteration None: the
    latest). Raises ModelError naming what it found."""
    from megatron_rl.checkpoint import DIST_CKPT_MARKER, LATEST_FILE, META_FILE, CheckpointError, resolve_checkpoint

    p = Path(spec).expanduser().resolve()
    if not p.exists():
        raise ModelError(f"--model {spec}: not found")
    if _is_hf_dir(p):
        return p, None, None
    if (p / "hf").is_dir() and _is_hf_dir(p / "hf"):           # an SFT / RFT run dir
        newer = _checkpoint_newer_than_export(p)
        if newer is None:
            return p / "hf", None, None
        print(f"[evaluate] {p}: its latest checkpoint ({newer}) was saved after its hf/ export (a resumed run that "
              f"did not export again): evaluating the checkpoint", file=sys.stderr, flush=True)
    if (p / LATEST_FILE).is_file():
        root, iteration = p, None
    elif (p / "ckpt" / LATEST_FILE).is_file():                # an RL / SFT run dir
        root, iteration = p / "ckpt", None
    elif (p / META_FILE).is_file() and (p / DIST_CKPT_MARKER).is_file():   # one iter_* dir
        number = p.name.removeprefix("iter_")
        if p.name != "release" and not number.isdigit():
            raise ModelError(f"--model {spec}: a checkpoint dir, but its name is not iter_NNNNNNN or release")
        root, iteration = p.parent, 0 if p.name == "release" else int(number)
    else:
        raise ModelError(f"--model {spec}: neither an HF model dir (config.json + *.safetensors) nor a checkpoint "
                         f"({LATEST_FILE} or an iter_* dir with {META_FILE})")
    try:
        resolve_checkpoint(root, iteration)
    except CheckpointError as e:
        raise ModelError(f"--model {spec}: {e}") from None
    return None, root, iteration


def resolve_model(spec: str, out_dir: Path, progress: bool = True) -> str:
    """An HF model dir for ``spec``: itself, a run's export, or a converted mcore checkpoint."""
    import shutil

    from megatron_rl.checkpoint import META_FILE, CheckpointError, resolve_checkpoint
    from megatron_rl.fsutil import write_text_atomic

    hf_dir, root, iteration = _locate_model(spec)
    if hf_dir is not None:
        return str(hf_dir)
    try:
        it, ckpt = resolve_checkpoint(root, iteration)
        # which checkpoint a conversion in --out came from: an --out that held another run's evaluation may hold a
        # model_hf_iter* of the same iteration number converted from another checkpoint
        source = json.dumps({"checkpoint": str(ckpt.resolve()), "meta_mtime_ns": (ckpt / META_FILE).stat().st_mtime_ns})
    except (CheckpointError, OSError) as e:
        raise ModelError(f"--model {spec}: {e}") from None
    dest = out_dir / f"model_hf_iter{it:07d}"
    marker = out_dir / f"{dest.name}.source.json"
    if _is_hf_dir(dest) and marker.is_file() and marker.read_text() == source:
        return str(dest)
    if dest.exists():                      # another checkpoint's conversion, or an interrupted one
        shutil.rmtree(dest)
    marker.unlink(missing_ok=True)
    from ckpt_tools.convert import McoreToHF, mcore_to_hf
    from ckpt_tools.ranks import ToolError

    print(f"[evaluate] converting checkpoint {root} (iteration {it}) to HF: {dest}", file=sys.stderr, flush=True)
    try:
        mcore_to_hf(McoreToHF(str(root), str(dest), iteration=it, progress=progress))
    except (ToolError, CheckpointError) as e:
        raise ModelError(f"--model {spec}: cannot convert the checkpoint to HF: {str(e).splitlines()[0]}") from None
    write_text_atomic(marker, source)
    return str(dest)


# ------------------------------------------------------------------------------------------ the run


@dataclasses.dataclass
class EvalConfig:
    model: str
    tasks: str
    out: str
    samples: int = 8
    turns: int = 3
    backend: str = "cpu"
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 4096
    max_context_tokens: int | None = None
    levels: tuple[int, ...] = ()
    limit: int | None = None
    tokenizer: str | None = None
    pass_k: tuple[int, ...] = (1,)
    compare_compile: bool = False
    trials: int | None = None
    timing_trials: int | None = None
    precision: str = "auto"
    cache: str | None = None
    result_cache: str | None = None
    compile_workers: int | None = None
    device: str = "auto"
    size_profile: str | None = None
    seed: int = 0
    concurrency: int = 64
    engine_threads: int | None = None
    label: str | None = None
    progress: bool = True
    fresh: bool = False
    too_large: dict[str, str] = dataclasses.field(default_factory=dict)   # set by `_preflight`: task_id -> why

    def validate(self) -> None:
        """Every flag's range, before anything is loaded; a bad value raises ValueError naming the flag."""
        from verifier.config import PRECISIONS

        if self.samples < 1 or self.turns < 1:
            raise ValueError(f"--samples and --turns must be >= 1, got {self.samples} and {self.turns}")
        if self.backend not in ("cpu", "cuda", "musa"):
            raise ValueError(f"--backend must be cpu, cuda or musa, got {self.backend!r}")
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"--pass-k {bad}: each k must be in 1..--samples ({self.samples})")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        # a flag at 0 would not fail: every prompt would be "unscored", or a task dropped without a word
        for flag, v in (("--max-new-tokens", self.max_new_tokens), ("--max-context-tokens", self.max_context_tokens),
                        ("--limit", self.limit), ("--concurrency", self.concurrency), ("--trials", self.trials),
                        ("--timing-trials", self.timing_trials), ("--compile-workers", self.compile_workers),
                        ("--engine-threads", self.engine_threads)):
            if v is not None and v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        if self.precision != "auto" and self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be auto or one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.size_profile:
            from verifier.size_profiles import parse_fit_profile

            try:
                parse_fit_profile(self.size_profile)
            except ValueError as e:
                raise ValueError(f"--size-profile: {e}") from None
        dev = self.device
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {dev!r}")


def _tasks(cfg: EvalConfig) -> list:
    from tqdm import tqdm

    from verifier.size_profiles import apply_size_profile, find_manifest_entry, parse_fit_profile
    from verifier.tasks import TaskError, load_task_set

    try:
        loaded = load_task_set(cfg.tasks)
    except TaskError as e:
        root = Path(cfg.tasks).expanduser()
        hint = ""
        if root.is_dir() and any((root / "KernelBench").glob("level*")):   # KernelBench's repository root
            hint = f" (KernelBench's tasks are in {root / 'KernelBench'}: pass that folder or one of its levels)"
        raise ValueError(f"--tasks: {e}{hint}") from None
    tasks, seen = [], set()
    for t in loaded:                       # a list file may name one task twice: it is evaluated once
        if t.task_id in seen:
            log.warning("task %s (%s) is listed more than once: evaluated once", t.task_id, t.path)
            continue
        seen.add(t.task_id)
        tasks.append(t)
    if cfg.levels:
        have = sorted({t.level for t in tasks if t.level is not None})
        tasks = [t for t in tasks if t.level in set(cfg.levels)]
        if not tasks:
            raise ValueError(f"--tasks {cfg.tasks}: no task of --levels {','.join(map(str, cfg.levels))} (its tasks "
                             f"have levels {have}" + ("" if have else ": a task's level comes from a levelN folder "
                                                      "or its manifest entry") + ")")
    if cfg.limit is not None:
        tasks = tasks[:cfg.limit]
    if cfg.size_profile:
        fit = parse_fit_profile(cfg.size_profile) is not None
        if not fit:   # a manifest profile: some task must have it
            entries = [find_manifest_entry(t.path) for t in tasks]
            if not any(e is not None and cfg.size_profile in e.sizes for e in entries):
                have = sorted({p for e in entries if e is not None for p in e.sizes})
                raise ValueError(f"--size-profile {cfg.size_profile}: no task of --tasks has this profile in a "
                                 f"manifest (profiles there: {', '.join(have) or 'none'}); fit, fit:<MiB> or "
                                 f"fit:<MiB>:<GFLOP> shrinks any KernelBench task to a budget")
        # fitting sizes each task on meta tensors: milliseconds for most, up to a minute for a long RNN
        tasks = [apply_size_profile(t, cfg.size_profile) for t in tqdm(
            tasks, desc=f"size profile {cfg.size_profile}", unit="task", file=sys.stderr, dynamic_ncols=True,
            disable=not cfg.progress or not fit, leave=False)]
        for t in tasks:
            if t.meta.get("resized"):
                log.info("task %s resized for --size-profile %s: %s", t.task_id, cfg.size_profile,
                         ", ".join(f"{k} {a} -> {b}" for k, (a, b) in t.meta["resized"].items()))
    if not tasks:
        raise ValueError(f"--tasks {cfg.tasks}: no task left (levels {list(cfg.levels) or 'all'})")
    return tasks


def _preflight(cfg: EvalConfig) -> tuple[dict[str, list], dict, tuple]:
    """Everything that can be checked before the model is loaded (or converted) and ``--out`` is written: the
    flags, ``--out``, the task set, the verifier's settings per precision and the backend's device. Returns the
    tasks grouped by the precision the verifier checks them at, each group's VerifierConfig and what
    `_locate_model` found."""
    from verifier.config import VerifierConfig
    from verifier.devices import DeviceUnavailable, get_backend

    cfg.validate()
    located = _locate_model(cfg.model)
    out = Path(cfg.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {cfg.out}: exists and is not a folder")
    if cfg.result_cache and Path(cfg.result_cache).expanduser().is_dir():
        raise ValueError(f"--result-cache {cfg.result_cache}: is a folder (it names an SQLite file)")
    if cfg.cache and Path(cfg.cache).expanduser().exists() and not Path(cfg.cache).expanduser().is_dir():
        raise ValueError(f"--cache {cfg.cache}: exists and is not a folder")
    tasks = _tasks(cfg)
    groups: dict[str, list] = {}
    for t in tasks:
        groups.setdefault(_precision(t, cfg.precision), []).append(t)
    vcfgs = {}
    for precision in groups:
        vkw: dict[str, Any] = {"backend": cfg.backend, "precision": precision,
                               "compare_torch_compile": cfg.compare_compile}
        if cfg.trials is not None:
            vkw["num_correct_trials"] = cfg.trials
        if cfg.timing_trials is not None:
            vkw["num_timing_trials"] = cfg.timing_trials
        if cfg.cache:
            vkw["build_cache_dir"] = cfg.cache
        vcfgs[precision] = VerifierConfig(**vkw)
    try:
        get_backend(cfg.backend).ensure_available(0)
    except DeviceUnavailable as e:
        raise ValueError(f"--backend {cfg.backend}: {e}") from None
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {cfg.device}: torch sees no CUDA device here")
    cfg.too_large = _too_large_for_host(cfg, groups, vcfgs)
    return groups, vcfgs, located


def _too_large_for_host(cfg: EvalConfig, groups: dict[str, list], vcfgs: dict) -> dict[str, str]:
    """task_id -> why it cannot be verified on this host, for ``--backend cpu``: the verifier's own memory gate
    (``verifier.evaluate.memory_problem``: inputs, outputs, parameters and the reference's working memory, sized on meta
    tensors, nothing allocated) run once per task before anything is generated. Each of its samples would be generated
    and then get that same ``infra`` verdict, retried by the farm and the agent, its trajectory generated again (3x the
    generation per sample for nothing): KernelBench's full sizes put 47 of level 1's 100 tasks here on a 24 GB host.
    A task that does not load here (a missing package) is left to the verifier and named in a warning."""
    if cfg.backend != "cpu":
        return {}
    from verifier.devices import get_backend
    from verifier.evaluate import memory_problem
    from verifier.inputs import task_footprint

    from tqdm import tqdm

    backend = get_backend("cpu")
    found, failed = {}, {}
    # milliseconds a task, up to ~15 s for KernelBench's long RNNs (their meta-tensor run): a bar after 2 s
    bar = tqdm(total=sum(map(len, groups.values())), desc="memory check", unit="task", file=sys.stderr,
               dynamic_ncols=True, disable=not cfg.progress, leave=False, delay=2)
    for precision, tasks in groups.items():
        for t in tasks:
            bar.update(1)
            try:
                # the machine's whole memory, not what is free at this moment (a busy host drops no task for the run)
                problem = memory_problem(task_footprint(t, precision), vcfgs[precision], backend, 0, {},
                                         task_only=True)
            except Exception as e:  # noqa: BLE001 - the task's own import or code; the verifier names it per sample
                failed[t.task_id] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            if problem:
                found[t.task_id] = (f"too large for this host at its sizes: {problem}"
                                    + ("" if cfg.size_profile else "; --size-profile fit shrinks it to fit"))
    bar.close()
    if failed:
        log.warning("%d tasks do not load here (their samples will be infra verdicts): %s", len(failed),
                    "; ".join(f"{k}: {v}" for k, v in list(failed.items())[:3]) + (" ..." if len(failed) > 3 else ""))
    if found:
        print(f"[evaluate] {len(found)} of {sum(map(len, groups.values()))} tasks need more memory than this host has "
              f"at their sizes: not generated for, listed as not scored (too_large) in the reports"
              + ("" if cfg.size_profile else "; --size-profile fit shrinks KernelBench's GPU sizes to fit a CPU")
              + f" (first: {next(iter(found))})", file=sys.stderr, flush=True)
    return found


def _precision(task, mode: str) -> str:
    from verifier.config import PRECISIONS

    if mode != "auto":
        return mode
    p = (task.meta.get("precisions") or ["float32"])[0]
    return p if p in PRECISIONS else "float32"


def _named_family(task) -> str | None:
    """The op family the task's manifest or generator named, if any."""
    return task.op_family or (task.meta.get("families") or [None])[0]


def _family(task) -> str:
    """The task's op family: as its manifest or generator named it, else the dominant family of the ops its reference
    calls (KernelBench's tasks name none; `data_synth.diagnose.reference_families`), else "unknown"."""
    from data_synth.diagnose import reference_families

    return _named_family(task) or next(iter(reference_families(task)), "unknown")


# ------------------------------------------------------------------------------------------ progress (resume)

PROGRESS_FILE = "results.partial.jsonl"
#: unscored groups a resumed run evaluates again (`GroupResult.status`)
RETRIED_STATUSES = ("infra", "aborted", "too_large")   # too_large: checked again in a moment, nothing generated
#: how a stopped run is continued (with --fresh the same command would move the kept tasks aside again)
CONTINUE_HINT = "run the same command (without --fresh) to continue"
PROGRESS_FORMAT = 1


class ResumeError(ValueError):
    """``--out`` holds an unfinished evaluation this run must not continue; the message says why and what to do."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after the progress file was set up: ``kept`` finished tasks are in ``path``."""

    def __init__(self, kept: int, path: Path):
        super().__init__(f"{kept} finished tasks kept in {path}")
        self.kept = kept
        self.path = path


def _model_identity(located: tuple) -> tuple[str, Any]:
    """The model `_locate_model` found and a cheap identity of its weights (file names, sizes and mtimes of an HF
    dir; a checkpoint's meta file mtime, as `resolve_model`'s conversion marker): weights rewritten in place (a
    re-export, a newer checkpoint) are another model, without hashing gigabytes."""
    from megatron_rl.checkpoint import META_FILE, resolve_checkpoint

    hf_dir, root, iteration = located
    if hf_dir is not None:
        files = sorted(p for p in hf_dir.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
        return str(hf_dir), [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    _, ckpt = resolve_checkpoint(root, iteration)
    return str(ckpt.resolve()), {"meta_mtime_ns": (ckpt / META_FILE).stat().st_mtime_ns}


def _fingerprint(cfg: EvalConfig, located: tuple) -> dict[str, Any]:
    """Everything a task's rows depend on, as JSON reads it back. Left out: how the run is run (--concurrency,
    --device, --engine-threads, caches, --compile-workers) and what only the reports use (--pass-k, --label)."""
    model, weights = _model_identity(located)
    tok = cfg.tokenizer
    if tok is not None and Path(tok).expanduser().exists():
        tok = str(Path(tok).expanduser().resolve())
    fp = {"model": model, "weights": weights, "tasks": str(Path(cfg.tasks).expanduser().resolve()),
          "samples": cfg.samples, "turns": cfg.turns, "temperature": cfg.temperature, "top_p": cfg.top_p,
          "max_new_tokens": cfg.max_new_tokens, "max_context_tokens": cfg.max_context_tokens,
          "levels": list(cfg.levels), "limit": cfg.limit, "precision": cfg.precision, "trials": cfg.trials,
          "timing_trials": cfg.timing_trials, "compare_compile": cfg.compare_compile,
          "size_profile": cfg.size_profile, "seed": cfg.seed, "backend": cfg.backend, "tokenizer": tok}
    return json.loads(json.dumps(fp, default=str))


def _task_key(task, precision: str) -> str:
    """A finished task is reused only for the same source (as resized: what the prompt showed and the verifier ran)
    at the same precision: a task file edited between the runs is evaluated again."""
    return hashlib.sha256(json.dumps([task.source, precision]).encode()).hexdigest()[:16]


def _aside(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = path.with_name(f"results.partial-{stamp}.jsonl"), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"results.partial-{stamp}-{n}.jsonl")
    return dest


def _read_progress(path: Path) -> tuple[dict | None, list[dict], bool, bytes]:
    """A progress file's header, records, whether its last line was torn (a kill mid-write: no newline yet) and its
    complete lines. A damaged line before the last is no kill's doing: ResumeError."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    parsed = []
    for i, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
        try:
            parsed.append(json.loads(raw))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ResumeError(f"{path}: line {i} is damaged (not JSON); --fresh moves the file aside and starts "
                              f"over") from None
    if not parsed:
        return None, [], end < len(data), data[:end]
    header, records = parsed[0], parsed[1:]
    if not (isinstance(header, dict) and header.get("evaluate_progress") == PROGRESS_FORMAT
            and isinstance(header.get("fingerprint"), dict)):
        raise ResumeError(f"{path}: not a progress file of this version of megatron_rl.evaluate; --fresh moves it "
                          f"aside and starts over")
    for i, r in enumerate(records, 2):
        if not (isinstance(r, dict) and isinstance(r.get("task_id"), str) and isinstance(r.get("rows"), list)):
            raise ResumeError(f"{path}: line {i} is not a finished task; --fresh moves the file aside and starts over")
    return header, records, end < len(data), data[:end]


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


class Progress:
    """``OUT/results.partial.jsonl``: a header line (the run's `_fingerprint`), then one line per finished task (its
    results.jsonl rows, its op family, or why it was not scored), each flushed and fsynced, so a kill loses at most
    the task being written. One line per task, not per sample: a task is resumed whole or sampled again, as Pass@k
    needs all of its samples."""

    def __init__(self, path: Path, fingerprint: dict[str, Any], records: dict[str, dict] | None = None):
        self.path = path
        self.fingerprint = fingerprint
        self.records: dict[str, dict] = dict(records or {})   # task_id -> record, of the tasks selected now
        self.resumed = len(self.records)
        self._append = bool(records)    # else the first record starts the file anew
        self._log = None

    @classmethod
    def load(cls, out: Path, fingerprint: dict[str, Any], keys: dict[str, str], fresh: bool) -> "Progress":
        """The finished tasks an earlier, stopped run left in ``out`` for the selected tasks (``keys``: task_id ->
        `_task_key`). Raises ResumeError, the file untouched, when it was made with other settings; ``fresh`` moves
        it aside instead. Reads (or renames) only: nothing is written before the first task finishes."""
        path = out / PROGRESS_FILE
        if not path.is_file():
            return cls(path, fingerprint)
        if fresh:
            dest = _aside(path)
            os.replace(path, dest)
            print(f"[evaluate] --fresh: moved the unfinished evaluation's {path} aside to {dest}", file=sys.stderr,
                  flush=True)
            return cls(path, fingerprint)
        header, records, torn, complete = _read_progress(path)
        if torn:
            log.warning("%s: its last line was cut off (the run was killed while writing it): ignored, that task "
                        "is evaluated again", path)
        if not records:    # nothing finished in it (killed before a task ended): nothing to keep or refuse for
            return cls(path, fingerprint)
        old = header["fingerprint"]
        differ = [k for k in sorted({*old, *fingerprint}) if old.get(k) != fingerprint.get(k)]
        if differ:
            what = "; ".join("weights: the model's files changed" if k == "weights" else
                             f"{k}: {_short(old.get(k))} then, {_short(fingerprint.get(k))} now" for k in differ)
            raise ResumeError(f"--out {out} holds an unfinished evaluation made with other settings ({len(records)} "
                              f"tasks done in {path}; differing: {what}): run it with its own settings to continue, "
                              f"pass --fresh to move it aside and start over, or choose another --out")
        latest = {r["task_id"]: r for r in records}    # a task evaluated again after an edit: its last line
        # a group lost to the run's own trouble (persistent infra verdicts, an aborted generation: the farm or the
        # engine dying as the run did) is no result: evaluated again; one the task itself decided is kept
        kept = {tid: r for tid, r in latest.items() if keys.get(tid) == r.get("key")
                and (r.get("unscored") or "").split(":")[0] not in RETRIED_STATUSES}
        changed = [tid for tid in latest if tid in keys and tid not in kept and keys[tid] != latest[tid].get("key")]
        gone = [tid for tid in latest if tid not in keys]
        if changed:
            log.warning("%s: %d finished tasks changed since (their source or precision), evaluated again: %s", path,
                        len(changed), ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else ""))
        if gone:
            log.warning("%s: %d finished tasks are no longer in --tasks, left out of the reports: %s", path,
                        len(gone), ", ".join(gone[:5]) + (" ..." if len(gone) > 5 else ""))
        if torn:     # appending after a torn line would glue the next record to it: keep the complete lines only
            from megatron_rl.fsutil import write_text_atomic

            write_text_atomic(path, complete.decode())
        print(f"[evaluate] resuming: {len(kept)} of {len(keys)} tasks already done in {path}", file=sys.stderr,
              flush=True)
        progress = cls(path, fingerprint, kept)
        progress._append = True
        return progress

    def add(self, record: dict[str, Any]) -> None:
        """Append one finished task's record, whole and fsynced (`fsutil.LineLog`: a full disk that took half a line,
        then another task's line, left a damaged line before the last, which `load` refuses: every finished task lost
        to ``--fresh``). A new file starts with the fingerprint line."""
        from megatron_rl.fsutil import LineLog, fsync_dir

        first = self._log is None
        if first:
            header = json.dumps({"evaluate_progress": PROGRESS_FORMAT, "fingerprint": self.fingerprint}, default=str)
            self._log = LineLog(self.path, fresh=not self._append, header=header, fsync=True)
        self._log.write(json.dumps(record, default=str))
        if first:
            fsync_dir(self.path.parent)   # the file's own entry in its folder, once
        self.records[record["task_id"]] = record

    def note(self) -> str:
        """What a stopped run keeps, for its error message."""
        if not self.records:
            return ""
        return f"; {len(self.records)} finished tasks are kept in {self.path}: {CONTINUE_HINT}"

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def finish(self) -> None:
        """The reports hold every row now: the progress file goes, so a finished OUT looks as it always did."""
        from megatron_rl.fsutil import fsync_dir

        self.close()
        self.path.unlink(missing_ok=True)
        fsync_dir(self.path.parent)


def _group_record(task, g, key: str = "", family: str | None = None) -> dict[str, Any]:
    """One finished task as `Progress` keeps it and `_write` reads it: its results.jsonl rows (as JSON reads them
    back, so a resumed row and a new one are written alike), its op family, or why it was not scored."""
    if not g.ok:
        return {"task_id": task.task_id, "key": key, "family": None, "unscored": f"{g.status}: {g.error[:1000]}",
                "rows": []}
    family = family or _family(task)    # KernelBench's tasks are classified by a meta-tensor run: once each
    rows = []
    for tr in g.trajectories:
        win = next((t for t in tr.turns if t.verdict.passed), None)
        last = tr.turns[-1]
        o = SampleOutcome(task_id=task.task_id, level=task.level, family=family, passed=win is not None,
                          first_turn_passed=tr.turns[0].verdict.passed,
                          speedup=win.verdict.speedup if win else None,
                          speedup_compile=win.verdict.speedup_compile if win else None,
                          turns=len(tr.turns), category=(win or last).verdict.category.value)
        rows.append({
            **dataclasses.asdict(o), "sample_index": tr.sample_index,
            "turn_verdicts": [{"turn": t.turn, "category": t.verdict.category.value, "q": t.verdict.q,
                               "speedup": t.verdict.speedup, "speedup_compile": t.verdict.speedup_compile,
                               "feedback": t.verdict.feedback[:500], "response_tokens": len(t.response_ids),
                               "finish_reason": t.finish_reason} for t in tr.turns],
            "response": win.response_text if win else last.response_text})
    return json.loads(json.dumps({"task_id": task.task_id, "key": key, "family": family, "unscored": None,
                                  "rows": rows}, default=str))


_OUTCOME_FIELDS = tuple(f.name for f in dataclasses.fields(SampleOutcome))


def _outcome(row: dict[str, Any]) -> SampleOutcome:
    return SampleOutcome(**{k: row[k] for k in _OUTCOME_FIELDS})


async def _run_groups(agent, tasks, groups_in_flight: int, bar, on_group=None) -> list:
    """Each task's group, ``on_group(task, group)`` called as each finishes (to keep it before the rest are done)."""
    from megatron_rl.rollout.agent import RolloutRequest

    sem = asyncio.Semaphore(groups_in_flight)

    async def one(task):
        async with sem:
            g = await agent.run_group(RolloutRequest(task=task, group_id=task.task_id))
        if on_group is not None:
            on_group(task, g)
        bar.update(1)
        return g

    return await asyncio.gather(*(one(t) for t in tasks))


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """Check the inputs, continue an unfinished run in ``--out`` (`Progress`), run the rest, write the reports. Ctrl-C
    once the progress file is set up raises `Interrupted`, which says how many finished tasks it keeps."""
    t0 = time.perf_counter()
    groups_by_precision, vcfgs, located = _preflight(cfg)   # nothing loaded or written before the inputs are checked
    tasks = [t for group in groups_by_precision.values() for t in group]
    out = Path(cfg.out).expanduser()
    keys = {t.task_id: _task_key(t, precision) for precision, group in groups_by_precision.items() for t in group}
    with contextlib.ExitStack() as lock:
        # one run per --out (`fsutil.output_lock`): a second one resumed from the first's progress file, appended to it
        # beside the first, and lost its rows when the first finished and removed the file
        try:
            lock.enter_context(output_lock(out, "evaluation"))
        except OSError as e:
            raise ValueError(f"--out {cfg.out}: cannot create the folder: {e.strerror or e}") from None
        # an unfinished run's file in --out made with other settings is refused here, before anything is written
        progress = Progress.load(out, _fingerprint(cfg, located), keys, cfg.fresh)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out {cfg.out}: cannot create the folder: {e.strerror or e}") from None
        try:
            return _evaluate(cfg, out, tasks, groups_by_precision, vcfgs, keys, progress, t0)
        except KeyboardInterrupt:
            raise Interrupted(len(progress.records), progress.path) from None
        finally:
            progress.close()


def _evaluate(cfg: EvalConfig, out: Path, tasks: list, groups_by_precision: dict[str, list], vcfgs: dict,
              keys: dict[str, str], progress: Progress, t0: float) -> dict[str, Any]:
    """The run proper: the tasks ``progress`` does not hold yet, then the reports from every task's record."""
    import torch
    from tqdm import tqdm

    from megatron_rl.rollout.agent import AgentConfig, AgentLoop
    from megatron_rl.rollout.client import EngineError
    from megatron_rl.rollout.engine import EngineManager, HttpEngine
    from megatron_rl.rollout.environment import KernelEnvironment, farm_verify_fn
    from megatron_rl.rollout.local_engine import serve_embedded
    from megatron_rl.rollout.protocol import SamplingParams
    from megatron_rl.rollout.sglang_engine import ServerLaunchError
    from megatron_rl.tokenizer import load_tokenizer
    from verifier.farm import FarmConfig, VerifierFarm

    model_dir = resolve_model(cfg.model, out, cfg.progress)
    hf_cfg = _model_config(model_dir)
    tok_path = cfg.tokenizer or (model_dir if (Path(model_dir) / "tokenizer.json").is_file() else "qwen3-offline")
    if tok_path == "qwen3-offline" and cfg.tokenizer is None:
        log.warning("%s has no tokenizer: using qwen3-offline and its chat template", model_dir)
    tokenizer = load_tokenizer(tok_path)
    vocab = hf_cfg.get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise ModelError(f"--model {model_dir}: vocab_size {vocab} is smaller than the {len(tokenizer)} tokens of "
                         f"the tokenizer {tok_path} (pass the model's own with --tokenizer)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    ctx = int(hf_cfg.get("max_position_embeddings") or 32768)
    max_ctx = min(cfg.max_context_tokens or ctx - 1, ctx - 1)
    max_batch = max(8, min(cfg.samples * len(tasks), 128))
    for t in tasks:   # nothing to generate for: the verifier could not run any sample of it here
        if t.task_id in cfg.too_large and t.task_id not in progress.records:
            progress.add({"task_id": t.task_id, "key": keys[t.task_id], "family": None,
                          "unscored": f"too_large: {cfg.too_large[t.task_id]}", "rows": []})
    todo = {precision: [t for t in group if t.task_id not in progress.records]
            for precision, group in groups_by_precision.items()}
    todo = {precision: group for precision, group in todo.items() if group}

    # a task that names no op family (KernelBench's) is classified by a meta-tensor run of its reference (up to ~2 s
    # for the long RNNs): done ahead in a thread while the groups run, not in the event loop that feeds the engine
    # and the farm as each group ends
    classify = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="op-family")
    families = {t.task_id: classify.submit(_family, t) for group in todo.values() for t in group
                if not _named_family(t)}

    def keep(task, g) -> None:
        ahead = families.get(task.task_id)
        family = ahead.result() if ahead is not None and g.ok else None
        progress.add(_group_record(task, g, keys[task.task_id], family))

    async def run_all(url: str, bar) -> None:
        engines = EngineManager([HttpEngine(url, name="engine-0")])
        try:
            for precision, group in todo.items():   # the farm verifies at one precision
                vcfg = vcfgs[precision]
                farm = VerifierFarm(vcfg, FarmConfig(compile_workers=cfg.compile_workers,
                                                     result_cache_path=cfg.result_cache))
                done = False
                try:
                    env = KernelEnvironment(group, cfg.backend, farm_verify_fn(farm), vcfg.reward)
                    agent = AgentLoop(tokenizer, engines.generate, env, AgentConfig(
                        max_turns=cfg.turns, group_size=cfg.samples, max_concurrency=cfg.concurrency,
                        sampling=SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                                max_new_tokens=cfg.max_new_tokens),
                        max_prompt_tokens=None, max_context_tokens=max_ctx, seed=cfg.seed))
                    await _run_groups(agent, group, max(1, cfg.concurrency // cfg.samples), bar, keep)
                    done = True
                finally:
                    farm.close(drain=done)
        finally:
            await engines.close()

    log_dir = out / "engine_logs"
    if todo:    # a run stopped after its last task (while writing the reports) needs no engine
        with contextlib.ExitStack() as stack:
            stack.callback(classify.shutdown, wait=False, cancel_futures=True)   # a stopped run waits for none
            try:
                url = stack.enter_context(serve_embedded(model_dir, device=device, seed=cfg.seed,
                                                         max_batch_size=max_batch, threads=cfg.engine_threads,
                                                         log_dir=str(log_dir)))
            except ServerLaunchError as e:
                raise EvalError(f"--model {model_dir}: the inference engine did not start: {_launch_problem(e)} "
                                f"(log: {log_dir}){progress.note()}") from None
            bar = tqdm(total=len(tasks), initial=len(progress.records), desc="evaluate", unit="task", file=sys.stderr,
                       disable=not cfg.progress, dynamic_ncols=True)
            try:
                asyncio.run(run_all(url, bar))
            except EngineError as e:
                raise EvalError(f"the inference engine failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                f" (log: {log_dir}){progress.note()}") from None
            finally:
                bar.close()
    summary = _write(cfg, out, tasks, [], model_dir, tok_path, time.perf_counter() - t0, records=progress.records,
                     resumed=progress.resumed)
    progress.finish()
    return summary


class EvalError(RuntimeError):
    """The run could not go on (the engine did not start or failed); the message is one line."""


def _launch_problem(e: Exception) -> str:
    """One line from a ServerLaunchError: what went wrong and the last line of the server's log."""
    lines = str(e).splitlines()
    head = lines[0].split(" (http")[0] if lines else type(e).__name__
    last = next((ln.strip() for ln in reversed(lines[1:]) if ln.strip() and not ln.startswith("---")), "")
    return f"{head}; {last}" if last else head


def _model_config(model_dir: str) -> dict[str, Any]:
    """The text model's HF config (``text_config`` of a multimodal one); ModelError when it cannot be read."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"--model {model_dir}: cannot read {path.name}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelError(f"--model {model_dir}: {path.name} is not a JSON object")
    text = raw.get("text_config")
    return text if isinstance(text, dict) else raw


def _write(cfg: EvalConfig, out: Path, tasks, groups, model_dir: str, tok_path: str, seconds: float,
           records: dict[str, dict] | None = None, resumed: int = 0) -> dict:
    """The reports from finished ``groups`` and `Progress` ``records`` (task_id -> `_group_record`), in task order;
    ``resumed`` of them came from an earlier, stopped run."""
    from megatron_rl.fsutil import write_text_atomic

    by_id = {t.task_id: t for t in tasks}
    records = dict(records or {})
    for g in groups:
        task = by_id[g.request.task.task_id]
        records[task.task_id] = _group_record(task, g)
    outcomes: list[SampleOutcome] = []
    rows: list[str] = []
    unscored = {}
    for task in tasks:
        r = records.get(task.task_id)
        if r is None:
            continue
        if r["unscored"] is not None:
            unscored[task.task_id] = r["unscored"]
            log.warning("task %s not scored: %s", task.task_id, unscored[task.task_id])
            continue
        for row in r["rows"]:
            outcomes.append(_outcome(row))
            rows.append(json.dumps(row, default=str))
    ks = sorted({*cfg.pass_k, cfg.samples})
    summary = {"model": model_dir, "label": cfg.label, "tokenizer": tok_path, "tasks_dir": cfg.tasks,
               "backend": cfg.backend, "samples": cfg.samples, "turns": cfg.turns, "temperature": cfg.temperature,
               "pass_k": ks, "tasks": len(tasks), "scored_tasks": len(tasks) - len(unscored), "unscored": unscored,
               "size_profile": cfg.size_profile,
               "resized": {t.task_id: t.meta["resized"] for t in tasks if t.meta.get("resized")},
               **summarize(outcomes, ks), "wall_seconds": round(seconds, 2), "resumed_tasks": resumed}
    write_text_atomic(out / "results.jsonl", "\n".join(rows) + ("\n" if rows else ""))
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    write_text_atomic(out / "report.md", markdown_report(summary))
    plots = _plots(out, outcomes)
    for stale in [*out.glob("speedup_level*.png"), out / "pass_rate_by_family.png"]:   # a previous run's plots
        if stale.name not in plots:
            stale.unlink(missing_ok=True)
    write_text_atomic(out / "report.html", html_report(summary, plots))
    return summary


# ------------------------------------------------------------------------------------------ reports


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _x(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}x"


def table_rows(summary: dict[str, Any], label_col: str = "level") -> tuple[list[str], list[list[str]]]:
    """The paper's columns, one row per level and the overall (weighted by task count)."""
    n = summary["samples"]
    ks = [k for k in summary["pass_k"] if k != n]
    head = [label_col, "tasks", *[f"Pass@{k}" for k in ks], f"Pass@{n}", f"Avg@{n}", "Faster vs eager (>1.1x)",
            "Faster vs compile (>1.1x)", "speedup mean", "speedup median"]
    body = []
    items = [(f"L{lv}" if lv != "None" else "-", t) for lv, t in summary["levels"].items()] + \
            [("Overall", summary["overall"])]
    for name, t in items:
        if not t.get("tasks"):
            continue
        body.append([name, str(t["tasks"]), *[_pct(t.get(f"pass_at_{k}")) for k in ks], _pct(t.get(f"pass_at_{n}")),
                     _pct(t.get("avg_at_n")), _pct(t.get("faster_eager")), _pct(t.get("faster_compile")),
                     _x(t.get("speedup_mean")), _x(t.get("speedup_median"))])
    return head, body


def _md(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def markdown_report(s: dict[str, Any]) -> str:
    head, body = table_rows(s)
    n = s["samples"]
    fam_head = ["op family", "tasks", f"Pass@{n}", f"Avg@{n}", "Faster vs eager"]
    fam_body = [[f, str(t["tasks"]), _pct(t.get(f"pass_at_{n}")), _pct(t.get("avg_at_n")), _pct(t.get("faster_eager"))]
                for f, t in s["families"].items()]
    parts = [f"# Evaluation: {s.get('label') or s['model']}", "",
             f"Model `{s['model']}` on `{s['tasks_dir']}` ({s['scored_tasks']} of {s['tasks']} tasks scored), backend "
             f"{s['backend']}, {n} samples per task at T={s['temperature']}, up to {s['turns']} turns with verifier "
             f"feedback (a sample passes when any turn passes). Percentages; Pass@k is the unbiased estimator.", "",
             _md(head, body), "", "Per op family:", "", _md(fam_head, fam_body), ""]
    first = s["overall"]
    if first.get("tasks"):
        parts += [f"First turn alone: Pass@{n} {_pct(first.get(f'first_turn_pass_at_{n}'))}, Avg@{n} "
                  f"{_pct(first.get('first_turn_avg_at_n'))}. Verdicts: {first.get('categories')}.", ""]
    if s["unscored"]:
        parts += ["Not scored (left out of every figure):", ""] + [f"- {k}: {v}" for k, v in s["unscored"].items()] + [""]
    if s.get("resized"):
        parts += [f"Resized for size profile `{s.get('size_profile')}` (the prompts showed these sizes):", ""] + [
            f"- {k}: " + ", ".join(f"{name} {a} -> {b}" for name, (a, b) in v.items()) for k, v in s["resized"].items()
        ] + [""]
    return "\n".join(parts)


def _plots(out: Path, outcomes: Sequence[SampleOutcome]) -> list[str]:
    """PNG plots (pillow, through megatron_rl.report's canvas): speedup distribution per level, pass rate per op
    family. Returns the file names written."""
    from megatron_rl.report import stacked_bars

    written = []
    levels = sorted({o.level for o in outcomes}, key=lambda v: (v is None, v or 0))
    edges = [0.0, 0.25, 0.5, 0.75, 0.9, 1.1, 1.5, 2.0, 3.0, math.inf]
    labels = ["<.25", ".25-.5", ".5-.75", ".75-.9", ".9-1.1", "1.1-1.5", "1.5-2", "2-3", ">3"]
    for lv in levels:
        sp = [o.speedup for o in outcomes if o.level == lv and o.passed and o.speedup is not None]
        counts = [sum(lo <= v < hi for v in sp) for lo, hi in zip(edges, edges[1:])]
        name = f"speedup_level{lv}.png"
        if stacked_bars(out / name, f"Speedup over eager, level {lv} ({len(sp)} passing samples)", "samples",
                        labels, {"passing samples": counts}, xlabel="speedup"):
            written.append(name)
    fams = sorted({o.family for o in outcomes})
    rates = [sum(o.passed for o in outcomes if o.family == f) / max(1, sum(o.family == f for o in outcomes))
             for f in fams]
    if fams and stacked_bars(out / "pass_rate_by_family.png", "Pass rate per op family (all samples)", "pass rate",
                             [f[:10] for f in fams], {"pass rate": rates}, xlabel="op family"):
        written.append("pass_rate_by_family.png")
    return written


def html_report(s: dict[str, Any], plots: Sequence[str]) -> str:
    def tab(head, body):
        h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
        b = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
        return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"

    head, body = table_rows(s)
    n = s["samples"]
    fam = [[f, str(t["tasks"]), _pct(t.get(f"pass_at_{n}")), _pct(t.get("avg_at_n")), _pct(t.get("faster_eager"))]
           for f, t in s["families"].items()]
    imgs = "".join(f'<p><img src="{html.escape(p)}" alt="{html.escape(p)}"></p>' for p in plots)
    unscored = "".join(f"<li>{html.escape(k)}: {html.escape(v)}</li>" for k, v in s["unscored"].items())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Evaluation</title><style>"
            f"body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}"
            f"td,th{{border:1px solid #bbb;padding:4px 8px;text-align:right}}</style></head><body>"
            f"<h1>Evaluation: {html.escape(str(s.get('label') or s['model']))}</h1>"
            f"<p>{html.escape(s['tasks_dir'])}: {s['scored_tasks']} of {s['tasks']} tasks scored; {n} samples per "
            f"task at T={s['temperature']}, up to {s['turns']} turns; backend {html.escape(s['backend'])}. "
            f"Percentages; Pass@k is the unbiased estimator.</p>"
            f"{tab(head, body)}<h2>Per op family</h2>"
            f"{tab(['op family', 'tasks', f'Pass@{n}', f'Avg@{n}', 'Faster vs eager'], fam)}"
            f"<h2>Plots</h2>{imgs}" + (f"<h2>Not scored</h2><ul>{unscored}</ul>" if unscored else "") +
            "</body></html>\n")


# ------------------------------------------------------------------------------------------ CLI


def _ints(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def parse_args(argv: list[str] | None) -> EvalConfig:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF dir, run dir, checkpoint root or iter_* dir")
    p.add_argument("--tasks", required=True, help="KernelBench-format folder, manifest or list file")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "musa"))
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--max-context-tokens", type=int, default=None)
    p.add_argument("--levels", type=_ints, default=(), help="e.g. 1,2 (default: all)")
    p.add_argument("--limit", type=int, default=None, help="first N tasks only")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir or qwen3-offline (default: the model's)")
    p.add_argument("--pass-k", type=_ints, default=(1,), help="k values besides --samples (default 1)")
    p.add_argument("--compare-compile", action="store_true", help="also time torch.compile (Faster vs compile)")
    p.add_argument("--trials", type=int, default=None, help="verifier correctness trials")
    p.add_argument("--timing-trials", type=int, default=None)
    p.add_argument("--precision", default="auto", help="auto (each task's manifest dtype) or float32|float16|bfloat16")
    p.add_argument("--cache", default=None, metavar="DIR", help="verifier build cache")
    p.add_argument("--result-cache", default=None, metavar="FILE", help="verifier verdict cache (SQLite)")
    p.add_argument("--compile-workers", type=int, default=None)
    p.add_argument("--device", default="auto", help="engine device: auto | cpu | cuda")
    p.add_argument("--size-profile", default=None,
                   help="a manifest size profile (e.g. gpu), or fit[:MiB[:GFLOP]] to shrink any task to a budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=64, help="trajectories in flight")
    p.add_argument("--engine-threads", type=int, default=None, help="torch threads of the engine on a CPU")
    p.add_argument("--label", default=None, help="name of the model in the reports")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--fresh", action="store_true",
                   help=f"start over: move an unfinished run's OUT/{PROGRESS_FILE} aside instead of continuing it "
                        f"(without it the same command continues; other settings are refused)")
    a = p.parse_args(argv)
    return EvalConfig(model=a.model, tasks=a.tasks, out=a.out, samples=a.samples, turns=a.turns, backend=a.backend,
                      temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens,
                      max_context_tokens=a.max_context_tokens, levels=a.levels, limit=a.limit, tokenizer=a.tokenizer,
                      pass_k=a.pass_k, compare_compile=a.compare_compile, trials=a.trials,
                      timing_trials=a.timing_trials, precision=a.precision, cache=a.cache,
                      result_cache=a.result_cache, compile_workers=a.compile_workers, device=a.device,
                      size_profile=a.size_profile, seed=a.seed, concurrency=a.concurrency,
                      engine_threads=a.engine_threads, label=a.label, progress=not a.no_progress,
                      fresh=a.fresh)


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.observability import print_summary

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = parse_args(argv)
    try:
        summary = evaluate(cfg)
    except (ModelError, ValueError, FileNotFoundError, EvalError, OutputBusyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # a full disk or a read-only folder: the finished tasks stay in the progress file
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    except Interrupted as e:    # the reports are written at the end, whole; finished tasks are in the progress file
        if e.kept:
            print(f"interrupted: {e.kept} tasks finished are kept in {e.path}; {CONTINUE_HINT} "
                  f"(the reports are written when every task is done)", file=sys.stderr)
        else:
            print(f"interrupted: nothing written to {cfg.out}'s results or reports (a previous run's are as they "
                  f"were): no task had finished", file=sys.stderr)
        return 130
    except KeyboardInterrupt:   # before --out was touched
        print(f"interrupted: nothing written to {cfg.out}'s results or reports (a previous run's are as they were)",
              file=sys.stderr)
        return 130
    o = summary["overall"]
    n = summary["samples"]
    print_summary({"model": summary["model"], "tasks": summary["tasks"], "scored_tasks": summary["scored_tasks"],
                   **{f"pass_at_{k}": o.get(f"pass_at_{k}") for k in summary["pass_k"]},
                   f"avg_at_{n}": o.get("avg_at_n"), "faster_eager": o.get("faster_eager"),
                   "faster_compile": o.get("faster_compile"), "speedup_median": o.get("speedup_median"),
                   "out": cfg.out, "wall_seconds": summary["wall_seconds"]})
    if summary["scored_tasks"] == 0:   # the reports are written (they list why), but there is no figure to use
        first = next(iter(summary["unscored"].items()), ("", ""))
        print(f"error: no task could be scored ({len(summary['unscored'])} unscored; {first[0]}: {first[1][:200]}); "
              f"every reason is in {Path(cfg.out) / 'report.md'}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
