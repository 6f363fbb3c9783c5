"""``python -m verifier check|eval|port-musa``: the verifier's command-line contract (ARCHITECTURE.md).

Exit codes: 0 whenever a verdict was produced and printed, whatever it is, ``infra`` included (the JSON
says what went wrong; for ``eval``, when every sample has its row); 2 for usage errors (missing or
malformed task/candidate/samples files, unknown task ids); 3 when no verdict could be made (``eval``:
the farm did not start, or rows are missing); 130 when interrupted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import threading
from typing import Any, Sequence

EXIT_OK, EXIT_USAGE, EXIT_NO_VERDICT, EXIT_INTERRUPTED = 0, 2, 3, 130


class UsageError(Exception):
    """Bad command-line input; printed as ``error: ...`` with exit code 2."""


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("cpu", "cuda", "musa"), default="cpu")
    p.add_argument("--trials", type=int, default=None, help="correctness trials per candidate (default: config's)")
    p.add_argument("--timing-trials", type=int, default=None,
                   help="timed trials per candidate, median over them (default: config's)")
    p.add_argument("--precision", default=None, help="dtype inputs are cast to: float32 | float16 | bfloat16")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="extension build cache folder, shared across runs (default: a temporary folder)")
    p.add_argument("--compare-compile", action="store_true", help="also time a torch.compile reference")
    p.add_argument("--size-profile", default=None, metavar="NAME",
                   help="apply a manifest size profile to bundled tasks (e.g. 'gpu' for realistic shapes), or "
                        "fit[:MiB[:GFLOP]] to shrink any task (KernelBench's GPU sizes on a CPU) to that budget")
    p.add_argument("--compile-timeout", type=float, default=None, metavar="S")
    p.add_argument("--run-timeout", type=float, default=None, metavar="S")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m verifier",
                                 description="Compile, check and time model-written kernels against PyTorch references.")
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="verify one candidate against one task")
    c.add_argument("--task", required=True, metavar="TASK.py", help="KernelBench-format task file")
    c.add_argument("--candidate", required=True, metavar="RESPONSE_OR_PY",
                   help="raw model response (last fenced python block is used) or plain Python source")
    c.add_argument("--json", action="store_true", help="print one JSON object (VerifyResult.to_dict())")
    c.add_argument("--device", type=int, default=None, help="device index (GPU backends)")
    _add_common(c)

    e = sub.add_parser("eval", help="verify a samples JSONL file against a task set")
    e.add_argument("--tasks", required=True, nargs="+", metavar="DIR_OR_LIST",
                   help="task folder(s), manifest(s), or text file(s) listing task paths")
    e.add_argument("--samples", required=True, metavar="SAMPLES.jsonl")
    e.add_argument("--out", required=True, metavar="RESULTS.jsonl")
    e.add_argument("--num-workers", type=int, default=None,
                   help="execution workers in all (default: --workers-per-device per GPU; 1 on the cpu backend)")
    e.add_argument("--workers-per-device", type=int, default=3,
                   help="execution workers sharing each GPU; they take turns to time (default 3; 1: one per GPU)")
    e.add_argument("--compile-workers", type=int, default=None, help="compile processes (default: CPU count)")
    e.add_argument("--k", type=int, nargs="+", default=[1], help="k values for Pass@k / Avg@k")
    e.add_argument("--result-cache", default=None, metavar="PATH.sqlite",
                   help="persist verdicts here; identical (task, code, backend, device) pairs are not re-run")
    e.add_argument("--max-retries", type=int, default=2, help="retries of infra failures")
    e.add_argument("--summary-json", default=None, metavar="PATH", help="also write the per-level summary as JSON")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_common(e)

    m = sub.add_parser("port-musa", help="port a folder of CUDA tasks or candidates to MUSA (rule table, "
                                         "structural only: nothing is compiled or run)")
    m.add_argument("--src", required=True, metavar="DIR", help="folder of .py files (tasks or candidates)")
    m.add_argument("--out", required=True, metavar="DIR", help="where the ported copies and port_manifest.json go")
    return ap


def cmd_port_musa(args: argparse.Namespace) -> int:
    """Port every .py file below --src into --out (same relative paths) and write port_manifest.json with
    each file's changes and flags."""
    from .musa_port import port_source
    if not os.path.isdir(args.src):
        raise UsageError(f"--src is not a folder: {args.src}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out is a file, not a folder: {args.out}")
    src, out = os.path.realpath(args.src), os.path.realpath(args.out)
    if os.path.commonpath([src, out]) == src:   # a later port would read the ported copies as sources
        raise UsageError(f"--out {args.out} is inside --src {args.src}: write the ported copies elsewhere")
    files: dict[str, Any] = {}
    code: dict[str, str] = {}
    for root, dirs, names in os.walk(args.src):   # every source is read and ported before anything is written
        dirs.sort()
        for name in sorted(n for n in names if n.endswith(".py")):
            rel = os.path.relpath(os.path.join(root, name), args.src)
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    ported = port_source(f.read())
            except UnicodeDecodeError as e:
                raise UsageError(f"{rel}: not UTF-8 text ({e})") from e
            except OSError as e:
                raise UsageError(f"cannot read {os.path.join(root, name)}: {e.strerror or e}") from e
            code[rel] = ported.code
            files[rel] = {"changes": ported.changes, "flags": ported.flags}
    for rel, text in code.items():
        try:
            _write_atomic(os.path.join(args.out, rel), text)
        except OSError as e:
            raise UsageError(f"--out {args.out}: cannot write {rel}: {e.strerror or e}") from e
    manifest = {"note": "CUDA -> MUSA source port by rule table (verifier.musa_port); structural only, not run on "
                        "MUSA hardware", "files": files}
    _write_atomic(os.path.join(args.out, "port_manifest.json"), json.dumps(manifest, indent=1) + "\n")
    print(json.dumps({"ported": len(files), "flagged": sum(bool(v["flags"]) for v in files.values()),
                      "out": os.path.abspath(args.out)}))
    return EXIT_OK


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _make_config(args: argparse.Namespace) -> Any:
    from .config import VerifierConfig
    overrides: dict[str, Any] = {"backend": args.backend}
    if getattr(args, "size_profile", None):
        from .size_profiles import parse_fit_profile
        try:
            parse_fit_profile(args.size_profile)
        except ValueError as e:
            raise UsageError(f"--size-profile: {e}") from None
    if args.trials is not None:
        if args.trials < 1:
            raise UsageError("--trials must be >= 1")
        overrides["num_correct_trials"] = args.trials
    if args.timing_trials is not None:
        if args.timing_trials < 1:
            raise UsageError("--timing-trials must be >= 1")
        overrides["num_timing_trials"] = args.timing_trials
    if args.precision is not None:
        overrides["precision"] = args.precision
    if args.cache is not None:
        os.makedirs(args.cache, exist_ok=True)
        overrides["build_cache_dir"] = os.path.abspath(args.cache)
    if args.compare_compile:
        overrides["compare_torch_compile"] = True
    if args.compile_timeout is not None:
        overrides["compile_timeout_s"] = args.compile_timeout
    if args.run_timeout is not None:
        overrides["run_timeout_s"] = args.run_timeout
    try:
        cfg = VerifierConfig(**overrides)
        validate = getattr(cfg, "validate", None)
        if callable(validate):
            validate()
    except (TypeError, ValueError) as e:
        raise UsageError(f"invalid verifier configuration: {e}") from e
    return cfg


def _load_one_task(path: str) -> Any:
    from .tasks import load_task
    if not os.path.exists(path):
        raise UsageError(f"task file not found: {path}")
    if not os.path.isfile(path):
        raise UsageError(f"task path is not a file: {path}")
    try:
        return load_task(path)
    except (ValueError, SyntaxError, OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot load task {path}: {e}") from e


def _task_level(task: Any) -> int | None:
    """The task's level: from the task, its manifest entry, or a ``levelN`` folder name."""
    if getattr(task, "level", None) is not None:
        return task.level
    from .size_profiles import ManifestError, find_manifest_entry
    try:
        entry = find_manifest_entry(task.path)
    except ManifestError:
        entry = None
    if entry is not None and entry.level is not None:
        return entry.level
    m = re.search(r"level[_-]?(\d+)", os.path.basename(os.path.dirname(os.path.abspath(task.path))), re.I)
    return int(m.group(1)) if m else None


def _with_level(task: Any) -> Any:
    level = _task_level(task)
    if level != getattr(task, "level", None) and dataclasses.is_dataclass(task):
        return dataclasses.replace(task, level=level)
    return task


def _print_human(result: Any, task: Any, out: Any = sys.stdout) -> None:
    sp = f"{result.speedup:.2f}x" if result.speedup is not None else "n/a"
    rw = f"{result.reward:.3f}" if result.reward is not None else "n/a"
    print(f"task:     {task.task_id} ({task.path})", file=out)
    print(f"verdict:  {result.category.value}" + (f"  [rule: {result.rule}]" if result.rule else ""), file=out)
    print(f"q={result.q:.2f}  speedup={sp}  reward={rw}  backend={result.backend}"
          + (f"  device={result.device_name}" if result.device_name else ""), file=out)
    if result.t_ref_ms is not None and result.t_cand_ms is not None:
        print(f"time:     reference {result.t_ref_ms:.4g} ms, candidate {result.t_cand_ms:.4g} ms", file=out)
    if result.speedup_compile is not None:
        print(f"vs torch.compile: {result.speedup_compile:.2f}x", file=out)
    if result.feedback:
        print("feedback:", file=out)
        for line in result.feedback.splitlines():
            print(f"  {line}", file=out)


def cmd_check(args: argparse.Namespace) -> int:
    from .size_profiles import apply_size_profile

    task = _with_level(_load_one_task(args.task))
    if not os.path.exists(args.candidate):
        raise UsageError(f"candidate file not found: {args.candidate}")
    try:
        with open(args.candidate, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UsageError(f"cannot read candidate {args.candidate}: {e}") from e
    try:
        response: Any = raw.decode("utf-8")
    except UnicodeDecodeError:
        response = raw  # the verifier reports undecodable bytes as a format_error verdict
    cfg = _make_config(args)
    task = apply_size_profile(task, args.size_profile)
    from .evaluate import verify  # imports torch: only once the arguments are known to be good
    result = verify(task, response, cfg, device_index=args.device)
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        _print_human(result, task)
    return EXIT_OK


def _load_tasks(specs: Sequence[str]) -> list[Any]:
    from .size_profiles import load_tasks
    tasks: list[Any] = []
    seen: set[str] = set()
    for spec in specs:
        if not os.path.exists(spec):
            raise UsageError(f"task set not found: {spec}")
        try:
            loaded = load_tasks(spec)
        except (ValueError, SyntaxError, OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot load task set {spec}: {e}") from e
        for t in loaded:
            p = os.path.abspath(t.path)
            if p not in seen:
                seen.add(p)
                tasks.append(_with_level(t))
    if not tasks:
        raise UsageError(f"no tasks found in {' '.join(specs)}")
    return tasks


def cmd_eval(args: argparse.Namespace) -> int:
    from .farm import FarmConfig, VerifierFarm
    from .metrics import format_table, summarize
    from .samples import ResultsWriter, SamplesError, match_samples, output_file_problem, read_samples, result_row

    if any(k < 1 for k in args.k):
        raise UsageError("--k values must be >= 1")
    for flag, path in (("--out", args.out), ("--summary-json", args.summary_json)):   # before any verdict is made
        problem = output_file_problem(path) if path else None
        if problem:
            raise UsageError(f"{flag} {path}: {problem}")
        if path and os.path.isfile(path) and os.path.isfile(args.samples) and os.path.samefile(path, args.samples):
            raise UsageError(f"{flag} {path} is the --samples file: it would be replaced by the results")
    tasks = _load_tasks(args.tasks)
    try:
        samples = read_samples(args.samples)
        first = args.tasks[0]
        matched = match_samples(samples, tasks, root=first if os.path.isdir(first) else os.path.dirname(first))
    except SamplesError as e:
        raise UsageError(str(e)) from e
    if not samples:
        raise UsageError(f"no samples in {args.samples}")
    cfg = _make_config(args)
    if args.num_workers is not None and args.num_workers < 1:
        raise UsageError("--num-workers must be >= 1")
    if args.workers_per_device < 1:
        raise UsageError("--workers-per-device must be >= 1")
    fc = FarmConfig(compile_workers=args.compile_workers, max_retries=args.max_retries,
                    size_profile=args.size_profile, result_cache_path=args.result_cache,
                    workers_per_device=args.workers_per_device)
    if args.backend == "cpu":
        fc.cpu_device_workers = args.num_workers or 1
    else:
        fc.device_workers = args.num_workers

    try:
        farm = VerifierFarm(cfg, fc)
    except (RuntimeError, ValueError, ImportError) as e:  # e.g. no GPU visible for --backend cuda
        print(f"error: cannot start the verifier farm: {e}", file=sys.stderr)
        return EXIT_NO_VERDICT
    writer = ResultsWriter(args.out)
    rows: list[dict[str, Any] | None] = [None] * len(samples)
    lock = threading.Lock()
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(samples), desc="verify", unit="sample", file=sys.stderr, dynamic_ncols=True)

    def on_done(i: int, fut: Any) -> None:
        row = result_row(samples[i], matched[i], fut.result())
        with lock:
            rows[i] = row
            writer.append(row)
            if bar is not None:
                bar.update(1)

    finished = False
    try:
        futs = []
        for i, (s, t) in enumerate(zip(samples, matched)):
            f = farm.submit(t, s.response, block=True)
            f.add_done_callback(lambda fut, i=i: on_done(i, fut))
            futs.append(f)
        for f in futs:
            f.result()
        stats = farm.stats()
        finished = True
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished rows are in {writer.partial_path}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        farm.close(drain=finished)
        if bar is not None:
            bar.close()
        if not finished:
            writer.close()
    done_rows = [r for r in rows if r is not None]
    if len(done_rows) != len(samples):  # cannot happen: every future resolves to one verdict
        writer.close()
        print(f"error: {len(samples) - len(done_rows)} samples have no row; partial results in "
              f"{writer.partial_path}", file=sys.stderr)
        return EXIT_NO_VERDICT
    writer.finish(done_rows)
    summary = summarize(done_rows, ks=args.k)
    print(format_table(summary, with_compile=args.compare_compile))
    dev = stats["device"]
    print(f"\n{len(done_rows)} rows -> {args.out}  (cache hits {stats['cache_hits'] + stats['dedup_hits']}, "
          f"retries {stats['retries']}, infra {stats['infra_final']}, device busy {100 * dev['busy_fraction']:.0f}%)")
    if args.summary_json:
        tmp = args.summary_json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"levels": {k: v.to_dict() for k, v in summary.items()}, "farm": stats}, fh, indent=1,
                      default=str)
        os.replace(tmp, args.summary_json)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # a task module that reaches for the Hub (KernelBench level 4) fails at once instead of retrying for ~25 s
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.command == "check":
            return cmd_check(args)
        if args.command == "port-musa":
            return cmd_port_musa(args)
        return cmd_eval(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
