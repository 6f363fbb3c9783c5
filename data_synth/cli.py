"""``python -m data_synth generate|validate|decontaminate|diagnose|distill|rft``.

Every command is seeded, shows progress bars on stderr (``--no-progress`` turns them off), writes its outputs
beside their destination and renames them into place, and prints one JSON summary as its last stdout line.
Exit codes: 0 done; 2 bad input (the message names the file, row or value), or an output another run is writing;
3 the work could not run (e.g. the verifier farm did not start, or the disk is full).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any, Sequence

from megatron_rl.fsutil import OutputBusyError, describe_os_error, dir_problem, output_lock
from verifier.samples import output_file_problem

from .decontam import DEFAULT_THRESHOLD, Decontaminator
from .diagnose import DiagnoseConfig, diagnose, read_weights, write_weights
from .distill import DistillConfig, EndpointError, distill
from .generate import GenConfig
from .ops import FAMILIES
from .pipeline import decontaminate_tasks, generate_task_set, references, validate_tasks
from .taskset import read_task_set, write_task_set
from .util import DataSynthError, atomic_write_jsonl
from .validate import ValidationConfig

EXIT_OK, EXIT_USAGE, EXIT_FAILED = 0, 2, 3
log = logging.getLogger("data_synth")


def _csv(text: str | None) -> tuple[str, ...] | None:
    return None if not text else tuple(x.strip() for x in text.split(",") if x.strip())


_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _log_level(text: str) -> str:
    if text.lower() not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(_LOG_LEVELS)}, got {text!r}")
    return text.lower()


def _check_out_file(path: str | None, flag: str, inputs: Sequence[str] = ()) -> None:
    """Refuse an output file path before any work: an existing folder, a parent that is a file
    (`verifier.samples.output_file_problem`), or one of the command's input files (it would be replaced)."""
    if not path:
        return
    problem = output_file_problem(path)
    if problem:
        raise DataSynthError(f"{flag} {path}: {problem}")
    for spec in inputs:
        if spec and os.path.exists(path) and os.path.exists(spec) and os.path.samefile(path, spec):
            raise DataSynthError(f"{flag} {path}: is also an input ({spec}); write the output elsewhere")


def _dtypes(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, w = part.strip().partition(":")
        try:
            out[name] = float(w) if w else 1.0
        except ValueError:
            raise DataSynthError(f"--dtypes: weight of {name!r} is not a number: {w!r}") from None
    return out


def _add_validation(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="cpu", choices=("cpu", "gpu"), help="size profile the references run at")
    p.add_argument("--device", default="cpu", help="device the references run on (cpu, cuda)")
    p.add_argument("--min-ms", type=float, default=None, help="runtime band: fastest accepted eager forward")
    p.add_argument("--max-ms", type=float, default=None, help="runtime band: slowest accepted eager forward")
    p.add_argument("--compile-fraction", type=float, default=0.1,
                   help="share of tasks whose eager output is checked against torch.compile (default 0.1)")


def _validation_cfg(args: argparse.Namespace, seed: int) -> ValidationConfig:
    return ValidationConfig(profile=args.profile, device=args.device, min_ms=args.min_ms, max_ms=args.max_ms,
                            compile_fraction=args.compile_fraction, seed=seed)


def _add_refs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--against", action="append", default=[], metavar="TASKS",
                   help="also decontaminate against this task set (repeatable; e.g. a training set)")
    p.add_argument("--no-kernelbench", action="store_true", help="do not check against the KernelBench index")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="n-gram Jaccard drop threshold")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m data_synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--log-level", default="warning", type=_log_level, help=", ".join(_LOG_LEVELS))
    # the same options after the subcommand (SUPPRESS: an absent one does not reset the value given before it)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-progress", action="store_true", default=argparse.SUPPRESS, help="no progress bars")
    common.add_argument("--log-level", default=argparse.SUPPRESS, type=_log_level)
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", parents=[common], help="generate a KernelBench-format task set")
    g.add_argument("--stage", type=int, default=1, choices=(1, 2, 3))
    g.add_argument("--n", type=int, required=True, help="tasks to accept")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, metavar="DIR")
    g.add_argument("--force", action="store_true", help="replace DIR if it exists")
    g.add_argument("--families", default=None, help=f"comma list of families ({', '.join(FAMILIES)})")
    g.add_argument("--weights", default=None, metavar="WEIGHTS.json", help="family weights from `diagnose`")
    g.add_argument("--dtypes", default="float32:0.7,float16:0.15,bfloat16:0.15",
                   help="dtype:weight list (e.g. float32 for CPU-only work)")
    g.add_argument("--noncontiguous", type=float, default=0.25, help="probability of a strided input")
    g.add_argument("--odd-shapes", type=float, default=0.5, help="probability of non-power-of-two sizes")
    g.add_argument("--ops", default="2-5", help="stage 2: op count range, e.g. 2-3")
    g.add_argument("--templates", default=None, help="stage 3: comma list of template names")
    g.add_argument("--teacher-only", action="store_true", help="only ops the offline teacher can write")
    g.add_argument("--only-ops", default=None, metavar="OPS",
                   help="comma list of registry ops the tasks may use (e.g. relu,tanh,sigmoid)")
    g.add_argument("--max-candidates", type=int, default=None)
    g.add_argument("--no-validate", action="store_true", help="skip running the references")
    g.add_argument("--no-decontaminate", action="store_true")
    _add_validation(g)
    _add_refs(g)

    v = sub.add_parser("validate", parents=[common],
                       help="run every reference of a task set and report the ones that fail")
    v.add_argument("--tasks", required=True)
    v.add_argument("--report", default=None, metavar="REPORT.jsonl", help="one row per task")
    v.add_argument("--out", default=None, metavar="DIR", help="write the valid tasks as a new task set")
    v.add_argument("--force", action="store_true")
    v.add_argument("--seed", type=int, default=1234)
    _add_validation(v)

    d = sub.add_parser("decontaminate", parents=[common],
                       help="drop tasks that repeat KernelBench (or another set)")
    d.add_argument("--tasks", required=True)
    d.add_argument("--report", default=None, metavar="REPORT.jsonl", help="one row per task, with the reason")
    d.add_argument("--out", default=None, metavar="DIR", help="write the kept tasks as a new task set")
    d.add_argument("--force", action="store_true")
    _add_refs(d)

    q = sub.add_parser("diagnose", parents=[common],
                       help="per-family failure rates of an evaluation -> resampling weights")
    q.add_argument("--results", required=True, nargs="+", metavar="RESULTS.jsonl",
                   help="verdict rows (python -m verifier eval --out, or distill's --verdicts)")
    q.add_argument("--tasks", required=True, nargs="+", help="the task set(s) the results refer to")
    q.add_argument("--out", required=True, metavar="WEIGHTS.json")
    q.add_argument("--alpha", type=float, default=1.0, help="weight ~ (1 - pass rate + floor) ** alpha")
    q.add_argument("--min-weight", type=float, default=0.25)
    q.add_argument("--max-weight", type=float, default=4.0)
    q.add_argument("--no-profile", action="store_true",
                   help="take families from the manifest instead of profiling each reference")

    s = sub.add_parser("distill", parents=[common], help="teacher responses, verified, as SFT rows")
    s.add_argument("--tasks", required=True)
    s.add_argument("--out", required=True, metavar="ROWS.jsonl")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--endpoint", default=None, metavar="URL", help="OpenAI-compatible or SGLang server")
    src.add_argument("--offline", action="store_true", help="the template teacher (no LLM)")
    s.add_argument("--style", default="full", choices=("full", "compact"),
                   help="offline teacher: full (plan + fused kernel) or compact (short fixed-template C++ for "
                        "tiny models, data_synth.compact)")
    s.add_argument("--compact-styles", default="index,pointer",
                   help="compact: loop styles the answers are drawn from (index, pointer)")
    s.add_argument("--api", default="auto", choices=("auto", "sglang", "openai"))
    s.add_argument("--model", default=None, help="model name for OpenAI-compatible servers")
    s.add_argument("--tokenizer", default="qwen3-offline", help="chat template for SGLang /generate (HF dir)")
    s.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "musa"))
    s.add_argument("--samples", type=int, default=1, help="responses per task")
    s.add_argument("--turns", type=int, default=1, help="feedback turns per response (1: single turn)")
    s.add_argument("--temperature", type=float, default=0.7)
    s.add_argument("--max-new-tokens", type=int, default=4096)
    s.add_argument("--concurrency", type=int, default=8)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--keep", default="pass", choices=("pass", "all"), help="rows to write: passing ones or all")
    s.add_argument("--verdicts", default=None, metavar="VERDICTS.jsonl",
                   help="also write every verdict in the verifier's row format (input to diagnose)")
    s.add_argument("--cache", default=None, metavar="DIR", help="verifier build cache")
    s.add_argument("--compile-workers", type=int, default=None)
    s.add_argument("--device-workers", type=int, default=None, metavar="N", help=DEVICE_WORKERS_HELP)
    s.add_argument("--timing-trials", type=int, default=None)
    s.add_argument("--trials", type=int, default=None)
    s.add_argument("--size-profile", default=None, help="verify at this manifest size profile (e.g. gpu)")
    s.add_argument("--precision", default="auto",
                   help="auto (each task at its manifest dtype) or float32 | float16 | bfloat16")

    r = sub.add_parser("rft", parents=[common],
                       help="diversity-preserving RFT: sample the SFT model, verify, cluster, draw targets")
    r.add_argument("--tasks", required=True)
    r.add_argument("--out", required=True, metavar="ROWS.jsonl")
    rsrc = r.add_mutually_exclusive_group(required=True)
    rsrc.add_argument("--model", default=None, metavar="HF_DIR", help="serve this model with the embedded engine")
    rsrc.add_argument("--endpoint", default=None, metavar="URL", help="an SGLang / OpenAI-compatible server")
    r.add_argument("--tokenizer", default=None, help="chat template (default: --model's own, else qwen3-offline)")
    r.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "musa"))
    r.add_argument("--samples", type=int, default=8, help="responses per prompt")
    r.add_argument("--targets", type=int, default=2, help="SFT targets per prompt, drawn across clusters")
    r.add_argument("--jaccard", type=float, default=0.7, help="MinHash Jaccard that joins two answers of a bucket")
    r.add_argument("--turns", type=int, default=1)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--max-new-tokens", type=int, default=4096)
    r.add_argument("--concurrency", type=int, default=64)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--report", default=None, metavar="REPORT.json", help="default: OUT.report.json")
    r.add_argument("--pool", default=None, metavar="POOL.jsonl", help="every sampled row (default: OUT.pool.jsonl)")
    r.add_argument("--cache", default=None, metavar="DIR", help="verifier build cache")
    r.add_argument("--result-cache", default=None, metavar="FILE.sqlite", help="verifier verdict cache")
    r.add_argument("--compile-workers", type=int, default=None)
    r.add_argument("--device-workers", type=int, default=None, metavar="N", help=DEVICE_WORKERS_HELP)
    r.add_argument("--timing-trials", type=int, default=None)
    r.add_argument("--trials", type=int, default=None)
    r.add_argument("--engine-threads", type=int, default=None, help="torch threads of the embedded engine (CPU)")
    return ap


def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    lo, _, hi = args.ops.partition("-")
    try:
        min_ops, max_ops = int(lo), int(hi or lo)
    except ValueError:
        raise DataSynthError(f"--ops must look like 2-5, got {args.ops!r}") from None
    weights = read_weights(args.weights) if args.weights else None
    cfg = GenConfig(stage=args.stage, n=args.n, seed=args.seed, families=_csv(args.families), weights=weights,
                    dtypes=_dtypes(args.dtypes), noncontiguous=args.noncontiguous, odd_shapes=args.odd_shapes,
                    min_ops=min_ops, max_ops=max_ops, teacher_only=args.teacher_only, templates=_csv(args.templates),
                    ops=_csv(args.only_ops))
    if args.max_candidates is not None and args.max_candidates < 1:
        raise DataSynthError(f"--max-candidates must be >= 1, got {args.max_candidates}")
    if os.path.exists(args.out) and not args.force:
        raise DataSynthError(f"{args.out} already exists (pass --force to replace it)")
    refs = [] if args.no_decontaminate else references(not args.no_kernelbench, args.against)
    decontam = Decontaminator(refs, args.threshold)
    validation = None if args.no_validate else _validation_cfg(args, args.seed)
    tasks, records = generate_task_set(cfg, validation=validation, decontam=decontam,
                                       max_candidates=args.max_candidates, progress=not args.no_progress)
    skipped: dict[str, int] = {}
    for r in records:
        if r.status == "skipped":
            key = f"{r.check}:{(r.reason or '').split(':')[0]}"
            skipped[key] = skipped.get(key, 0) + 1
    if not tasks:   # an empty task set is no output: every later stage refuses it ("no task files")
        where = ""
        if records:   # each candidate's reason is what the user needs to fix the filters: keep it beside OUT
            report = os.path.abspath(args.out).rstrip(os.sep) + ".generation_report.jsonl"
            atomic_write_jsonl(report, [r.to_dict() for r in records])
            where = f"; each candidate's reason is in {report}"
        raise RuntimeError(f"no candidate was accepted ({len(records)} tried; skipped: {skipped or 'none'}); "
                           f"nothing written to {args.out}{where}")
    info = {"command": "generate", "stage": cfg.stage, "seed": cfg.seed, "requested": cfg.n, "accepted": len(tasks),
            "candidates": len(records), "skipped": skipped, "validated": validation is not None,
            "decontaminated_against": [r.name for r in refs], "weights": weights,
            "families": list(cfg.families or []), "dtypes": cfg.dtypes}
    out = write_task_set(tasks, args.out, force=args.force, info=info,
                         extra_files={"generation_report.jsonl":
                                      "".join(json.dumps(r.to_dict(), default=str) + "\n" for r in records)})
    fams: dict[str, int] = {}
    for t in tasks:
        fams[t.primary_family] = fams.get(t.primary_family, 0) + 1
    return {"out": out, "accepted": len(tasks), "requested": cfg.n, "candidates": len(records), "skipped": skipped,
            "families": fams}


def cmd_validate(args: argparse.Namespace) -> dict[str, Any]:
    _check_out_file(args.report, "--report", [args.tasks])
    tasks = read_task_set(args.tasks)
    if args.out and os.path.exists(args.out) and not args.force:
        raise DataSynthError(f"{args.out} already exists (pass --force to replace it)")
    ok, results = validate_tasks(tasks, _validation_cfg(args, args.seed), progress=not args.no_progress)
    if args.report:
        atomic_write_jsonl(args.report, [r.to_dict() for r in results])
    if args.out:
        write_task_set(ok, args.out, force=args.force, info={"command": "validate", "source": args.tasks})
    failed: dict[str, int] = {}
    for r in results:
        if not r.ok:
            k = (r.reason or "").split(":")[0]
            failed[k] = failed.get(k, 0) + 1
    return {"tasks": len(tasks), "valid": len(ok), "failed": failed,
            "compile_checked": sum(r.checks.get("compile_agrees") == "ok" for r in results)}


def cmd_decontaminate(args: argparse.Namespace) -> dict[str, Any]:
    _check_out_file(args.report, "--report", [args.tasks])
    tasks = read_task_set(args.tasks)
    if args.out and os.path.exists(args.out) and not args.force:
        raise DataSynthError(f"{args.out} already exists (pass --force to replace it)")
    refs = references(not args.no_kernelbench, args.against)
    if not refs:
        raise DataSynthError("nothing to decontaminate against (--no-kernelbench and no --against)")
    kept, verdicts = decontaminate_tasks(tasks, Decontaminator(refs, args.threshold), progress=not args.no_progress)
    if args.report:
        atomic_write_jsonl(args.report, [v.to_dict() for v in verdicts])
    if args.out:
        write_task_set(kept, args.out, force=args.force, info={"command": "decontaminate", "source": args.tasks,
                                                               "against": [r.name for r in refs]})
    by_layer: dict[str, int] = {}
    for v in verdicts:
        if v.dropped:
            by_layer[v.layer or "?"] = by_layer.get(v.layer or "?", 0) + 1
    return {"tasks": len(tasks), "kept": len(kept), "dropped": by_layer,
            "kb_op_overlap": sum("kb_op_overlap" in v.tags for v in verdicts)}


def cmd_diagnose(args: argparse.Namespace) -> dict[str, Any]:
    cfg = DiagnoseConfig(alpha=args.alpha, min_weight=args.min_weight, max_weight=args.max_weight,
                         profile=not args.no_profile)
    _check_out_file(args.out, "--out", [*args.results, *args.tasks])
    report = diagnose(args.results, args.tasks, cfg, progress=not args.no_progress)
    write_weights(args.out, report)
    return {"out": args.out, "weights": report.weights, "samples": report.samples,
            "families": {f: s.to_dict() for f, s in report.families.items()}}


DEVICE_WORKERS_HELP = ("verifier execution workers in all (default: one per GPU times the farm's workers_per_device; one "
                       "on the cpu backend, where two finish a batch of checks ~30%% sooner on two cores: one's "
                       "sandboxed child starts while the other's runs; timing still holds the device alone)")


def _device_workers(args: argparse.Namespace) -> dict[str, Any]:
    """FarmConfig fields from ``--device-workers``."""
    if args.device_workers is None:
        return {}
    if args.device_workers < 1:
        raise DataSynthError(f"--device-workers must be >= 1, got {args.device_workers}")
    return {"device_workers": args.device_workers}


def cmd_distill(args: argparse.Namespace) -> dict[str, Any]:
    cfg = DistillConfig(endpoint=args.endpoint, offline=args.offline, api=args.api, model=args.model,
                        tokenizer=args.tokenizer, backend=args.backend, samples=args.samples, turns=args.turns,
                        temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                        concurrency=args.concurrency, seed=args.seed, keep=args.keep, cache_dir=args.cache,
                        compile_workers=args.compile_workers, timing_trials=args.timing_trials,
                        trials=args.trials, size_profile=args.size_profile, precision=args.precision,
                        style=args.style, compact_styles=_csv(args.compact_styles) or (),
                        farm=_device_workers(args))
    _check_out_file(args.out, "--out", [args.tasks])
    _check_out_file(args.verdicts, "--verdicts", [args.tasks, args.out])
    summary = distill(read_task_set(args.tasks), args.out, cfg, verdicts_path=args.verdicts,
                      progress=not args.no_progress)
    return summary.to_dict()


def cmd_rft(args: argparse.Namespace) -> dict[str, Any]:
    from .rft import RFTConfig, run_rft

    _check_out_file(args.out, "--out", [args.tasks])
    _check_out_file(args.report, "--report", [args.tasks, args.out])
    _check_out_file(args.pool, "--pool", [args.tasks, args.out])
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = args.model if args.model and os.path.isfile(os.path.join(args.model, "tokenizer.json")) \
            else "qwen3-offline"
    extra = {"result_cache_path": args.result_cache} if args.result_cache else {}
    extra.update(_device_workers(args))
    # with --model the endpoint is the embedded engine's, known once it runs (run_rft sets it)
    dcfg = DistillConfig(endpoint=args.endpoint or "http://127.0.0.1:0", api="sglang" if args.model else "auto",
                         tokenizer=tokenizer, backend=args.backend, samples=args.samples, turns=args.turns,
                         temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                         concurrency=args.concurrency, seed=args.seed, keep="all", cache_dir=args.cache,
                         compile_workers=args.compile_workers, timing_trials=args.timing_trials, trials=args.trials,
                         farm=extra)
    cfg = RFTConfig(samples=args.samples, targets=args.targets, jaccard=args.jaccard, seed=args.seed)
    return run_rft(read_task_set(args.tasks), args.out, cfg, dcfg, model_dir=args.model, report_path=args.report,
                   pool_path=args.pool, progress=not args.no_progress, engine_threads=args.engine_threads)


COMMANDS = {"generate": cmd_generate, "validate": cmd_validate, "decontaminate": cmd_decontaminate,
            "diagnose": cmd_diagnose, "distill": cmd_distill, "rft": cmd_rft}


def _out_lock(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """The command's ``--out`` locked for its whole run (`megatron_rl.fsutil.output_lock`): a second command on the
    same output is refused before its work, not after it when both replace the folder. ``distill`` locks its own
    (it keeps a resumable ``OUT.partial`` beside it)."""
    out = getattr(args, "out", None)
    if not out or args.command == "distill":
        return contextlib.nullcontext()
    problem = dir_problem(os.path.dirname(os.path.abspath(out)))   # bad input, exit 2: not the lock file's OSError
    if problem:
        raise DataSynthError(f"--out {out}: {problem}")
    return output_lock(out, f"data_synth {args.command}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    t0 = time.time()
    try:
        with _out_lock(args):   # the commands' "already exists" checks run under it
            summary = COMMANDS[args.command](args)
    except (DataSynthError, EndpointError, OutputBusyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"interrupted: {args.command} stopped before its outputs were written"
              + ("; the finished samples stay in OUT.partial and the same command again reuses them"
                 if args.command == "distill" else ""), file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:   # a full disk or a read-only folder while writing: one line naming the file
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return EXIT_FAILED
    summary["command"] = args.command
    summary["wall_seconds"] = round(time.time() - t0, 2)
    print(json.dumps(summary, default=str))
    return EXIT_OK
