"""The RL driver: rollout -> train -> checkpoint -> weight sync, one step after another.

    python -m megatron_rl.train --config configs/quickstart.yaml [key=value ...] [--resume | --auto-resume]

Each step the rollout side generates `data.prompts_per_step` groups of `agent.group_size` multi-turn
trajectories (verdicts and scores from the environment, PrimeEcho over turns, dynamic sampling in
submission order) and turns them into GRPO-advantaged training samples; the train ranks compute the
old-policy (and reference) logprobs their loss needs and take `actor.mini_batches` PPO optimizer steps;
then the run checkpoints and pushes the new weights into the engines. The samples go from the rollout
side to the train ranks by object reference: this loop only moves references and small metrics. The
last stdout line is a JSON summary.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger("megatron_rl.train")


class InjectedFault(RuntimeError):
    """`train.kill_at_step` fired: the run stops as if killed (nothing after the last checkpoint kept)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML preset (configs/*.yaml)")
    add_resume_args(p)
    p.add_argument("--model", help="HF checkpoint dir (same as model.path=...)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5 actor.tp=2")
    return p.parse_args(argv)


def add_resume_args(p: argparse.ArgumentParser) -> None:
    """``--resume`` and ``--auto-resume`` (one or the other), as `megatron_rl.train` and `megatron_rl.sft` take them;
    `resolve_resume` says what they mean for a run."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="continue from the last checkpoint in train.ckpt_dir")
    g.add_argument("--auto-resume", action="store_true",
                   help="continue from the last checkpoint in train.ckpt_dir if there is one, else start fresh (what "
                        "a requeued job wants: launch/slurm_train.sbatch passes it on a restart)")


def resolve_resume(ckpt_root: Path, resume: bool, auto_resume: bool, prog: str = "run") -> tuple[bool, str | None]:
    """Whether a run continues from `ckpt_root`, and why it cannot (a usage error, reported before anything is
    started or written). ``--auto-resume`` continues when the root holds a latest-checkpoint pointer (the one a fresh
    run in a used dir drops), else starts fresh; an unreadable pointer is then reported, not silently started over."""
    from megatron_rl.checkpoint import LATEST_FILE, resume_problem

    if auto_resume and not resume and (Path(ckpt_root) / LATEST_FILE).exists():
        resume = True
        print(f"[{prog}] --auto-resume: continuing from {ckpt_root}", file=sys.stderr, flush=True)
    return resume, (resume_problem(ckpt_root) if resume else None)


def cli_path(p: str) -> str:
    """A path given as a command-line flag, absolute: relative to the working dir, as the shell means it (config
    keys' relative paths are from the repository root, `megatron_rl.config.abs_path`)."""
    return os.path.abspath(os.path.expanduser(p))


TINY_SPEC_FILE = "tiny_spec.json"   # what a run dir's tiny random model was built from


def prepare_model(cfg, environment_tokenizer: bool = True) -> tuple[str, str]:
    """The HF model dir and tokenizer dir every role loads. The environment's own tokenizer (the toy's)
    wins over the model's (`environment_tokenizer=False`: the config has no environment, e.g. SFT). A missing
    `model.path` means a tiny random model of `model.tiny.arch` (the Qwen3.5 hybrid by default), built once per
    run dir (deterministic from `model.tiny.init_seed`), with the tokenizer's files beside its weights so its
    checkpoints and exports carry them."""
    from megatron_rl.config import abs_path   # (megatron-core: imported once a run is starting)
    from megatron_rl.fsutil import publish_dir, rebuild_dir
    from megatron_rl.rollout.environment import environment_class

    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = run_dir / "tokenizer"
    tok = environment_class(cfg.data.environment).own_tokenizer() if environment_tokenizer else None
    if tok is None and cfg.model.tokenizer == "qwen3-offline":
        from megatron_rl.tokenizer import load_tokenizer

        tok = load_tokenizer("qwen3-offline")
    if tok is None:
        tokenizer_path = str(abs_path(cfg.model.tokenizer).resolve())   # where validation looked for it
    else:
        if not (tok_dir / "tokenizer.json").is_file():
            publish_dir(tok.save_pretrained, tok_dir)
        tokenizer_path = str(tok_dir)
    if cfg.model.path:
        return str(abs_path(cfg.model.path).resolve()), tokenizer_path
    model_dir = run_dir / "model"
    t = cfg.model.tiny
    # the tiny model is rebuilt when what it is built from changes (another tokenizer or shape in a reused run dir);
    # the same spec gives the same weights, so a resumed run finds the model its checkpoints were trained from
    tok_files = sorted(Path(tokenizer_path).glob("tokenizer*.json"))
    spec = json.dumps({"tiny": dataclasses.asdict(t), "dtype": cfg.actor.params_dtype,
                       "tokenizer": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in tok_files}},
                      sort_keys=True)
    spec_file = model_dir / TINY_SPEC_FILE
    if not (spec_file.is_file() and spec_file.read_text() == spec and (model_dir / "config.json").is_file()):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf_cfg = t.hf_config(t.vocab_size or len(AutoTokenizer.from_pretrained(tokenizer_path)))
        torch.manual_seed(t.init_seed)
        gpu = torch.cuda.is_available() and cfg.cluster.use_gpu is not False
        dtype = torch.bfloat16 if cfg.actor.params_dtype == "bfloat16" else torch.float32
        with torch.device("cuda" if gpu else "cpu"):  # an 8B random init takes minutes on the host
            model = AutoModelForCausalLM.from_config(hf_cfg).to(dtype)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

        def save(d: str) -> None:
            model.save_pretrained(d, safe_serialization=True)
            tokenizer.save_pretrained(d)
            (Path(d) / TINY_SPEC_FILE).write_text(spec)

        rebuild_dir(save, model_dir)
        del model
    return str(model_dir), tokenizer_path


def begin_fresh_run(run_dir: Path, ckpt_root: Path) -> None:
    """A run without ``--resume`` in a dir that holds an earlier run: that run's latest-checkpoint pointer is removed
    (its ``iter_*`` dirs stay), so a fresh run killed before its first save is not resumed from the earlier run's
    weights, and its ``metrics.jsonl`` moves to (the end of) ``metrics.prev.jsonl``, so the report does not mix the runs."""
    from megatron_rl.checkpoint import LATEST_FILE
    from megatron_rl.fsutil import fsync_dir

    latest = Path(ckpt_root) / LATEST_FILE
    if latest.is_file():
        log.warning("%s: a fresh run (no --resume) in a dir holding checkpoints: --resume now continues this run, "
                    "not iteration %s of the earlier one", ckpt_root, latest.read_text().strip()[:40])
        latest.unlink()
        fsync_dir(ckpt_root)
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.is_file():   # appended: a third run keeps both earlier runs' rows, in order
        with open(metrics.with_name("metrics.prev.jsonl"), "a") as f:
            f.write(metrics.read_text())
        metrics.unlink()


#: how long a requeued job (SLURM_RESTART_COUNT > 0) waits for its outputs' locks: NFSv4's default lease is 90 s
REQUEUE_LOCK_WAIT_S = 180.0


@contextlib.contextmanager
def lock_outputs(what: str, *paths: Path) -> Iterator[None]:
    """`fsutil.output_lock` on each of a run's outputs (its run dir, its checkpoint root, an export dir), for the
    run's lifetime: a second run that shares any of them is refused (`OutputBusyError`) before it touches one. Two
    runs in one dir once dropped each other's resume pointer and metrics and crashed on each other's checkpoint
    temp dirs."""
    from megatron_rl.fsutil import output_lock

    # a requeued slurm job may find its dead predecessor's lock on a shared filesystem until the lease ends
    wait_s = REQUEUE_LOCK_WAIT_S if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0 else 0.0
    with contextlib.ExitStack() as stack:
        for p in sorted({Path(p).resolve() for p in paths}):
            stack.enter_context(output_lock(p, what, wait_s=wait_s))
        yield


def run(cfg, resume: bool = False) -> dict:
    from megatron_rl.checkpoint import resume_problem

    t_start = time.perf_counter()
    problem = resume_problem(cfg.ckpt_root) if resume else None
    if problem:   # before the run dir (and its config.yaml) is written
        raise SystemExit(problem)
    with lock_outputs("training run", cfg.run_dir, cfg.ckpt_root):   # before an earlier run's pointer is touched
        return _run(cfg, resume, t_start)


def _run(cfg, resume: bool, t_start: float) -> dict:
    from megatron_rl.cluster import Cluster
    from megatron_rl.config import to_yaml
    from megatron_rl.fsutil import write_text_atomic
    from megatron_rl.observability import PhaseTimer, RunLogger

    if not resume:
        begin_fresh_run(cfg.run_dir, cfg.ckpt_root)
    logger = RunLogger(cfg.run_dir, dump_samples=False)  # the rollout side writes samples/ itself
    write_text_atomic(cfg.run_dir / "config.yaml", to_yaml(cfg))
    print(f"[run] logs, samples and TensorBoard in {cfg.run_dir}", flush=True)
    cluster = Cluster(cfg, *prepare_model(cfg))
    steps_done, failed = 0, 0
    try:
        start, history = cluster.start(resume)
        print(f"[run] ready in {time.perf_counter() - t_start:.1f}s, from step {start}", flush=True)
        for step in range(start, cfg.train.steps):
            if step == cfg.train.kill_at_step and not resume:
                raise InjectedFault(f"train.kill_at_step={step}")
            timer = PhaseTimer()
            rollout = cluster.rollout(step, timer)
            train = {}
            if not rollout.empty:
                with timer("train"):
                    train = cluster.train.train(rollout.samples, cfg.loss)
            failed = failed + 1 if rollout.empty or train["skipped"] else 0
            _report_failure(step, failed, cfg.train.max_failed_steps, rollout.empty)
            if rollout.empty:
                continue
            history["reward"].append(rollout.metrics["reward/mean"])
            if _save_due(cfg.train, step + 1):
                with timer("save"):
                    cluster.save(step + 1, history)
            if cfg.cluster.async_rollout:
                with timer("rollout_wait"):   # the next rollout's time that training did not hide
                    cluster.finish_pending_rollout()
            with timer("sync"):
                sync = cluster.sync_weights(step + 1)
            logger.log_step(step, {**rollout.metrics, **{f"train/{k}": v for k, v in train.items()},
                                   "sync/seconds": sync.get("seconds"), "sync/gbps": sync.get("gbps"),
                                   "perf/tokens_per_s": rollout.metrics["rollout/tokens"] / sum(timer.seconds.values())},
                            timer.seconds, cfg.train.steps)
            steps_done += 1
    finally:
        cluster.shutdown()
        logger.close()
    summary = _summary(history["reward"], steps_done, t_start, cfg)
    logger.write_summary(summary)
    return summary


def _save_due(t, iteration: int) -> bool:
    return (iteration == t.steps and t.save_final) or bool(t.save_interval and iteration % t.save_interval == 0)


def _report_failure(step: int, failed: int, limit: int, empty: bool) -> None:
    if not failed:
        return
    print(f"[step {step + 1}] " + ("no scored groups: step skipped" if empty else
                                   "non-finite loss or grad norm: update skipped, weights unchanged"), flush=True)
    if failed >= limit:
        raise RuntimeError(f"{failed} steps in a row were skipped (no scored groups or NaN/inf)")


def _summary(rewards: list, steps_done: int, t_start: float, cfg) -> dict:
    return {"steps": len(rewards), "steps_this_run": steps_done,
            "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
            "reward_max": max(rewards) if rewards else None,
            "wall_seconds": round(time.perf_counter() - t_start, 2), "log_dir": str(cfg.run_dir),
            "checkpoint": str(cfg.ckpt_root) if cfg.train.save_final or cfg.train.save_interval else None}


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.observability import dump_stacks_on_sigusr1, print_summary

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Models and tokenizers come from local dirs; a task module that reaches for the Hub (KernelBench
    # level 4) must fail fast rather than retry for minutes while prompts are built.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dump_stacks_on_sigusr1()
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.model:   # a flag's path is the shell's: from the working dir (key=value paths: from the repository root)
        overrides.append(f"model.path={cli_path(args.model)}")
    if args.resume:
        overrides.append("train.resume=true")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg.train.resume, problem = resolve_resume(cfg.ckpt_root, cfg.train.resume, args.auto_resume)
    problem = problem or output_problem("train.ckpt_dir", cfg.ckpt_root)
    if problem:   # a usage error like a bad key: exit 2 before anything is started or written
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        summary = run(cfg, resume=cfg.train.resume)
    except InjectedFault as e:
        print(f"[run] stopped by fault injection: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:   # the engines and ranks were shut down on the way out
        print(interrupted_message(cfg.ckpt_root), file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - only another run's lock and write failures; the rest re-raised
        return run_failure(e)
    print_summary(summary)
    return 0


def output_problem(key: str, path: Path) -> str | None:
    """A config key's output folder that cannot be made (`fsutil.dir_problem`), as a usage error: a checkpoint dir
    under a file failed at the first save, after a step's work."""
    from megatron_rl.fsutil import dir_problem

    problem = dir_problem(path)
    return f"{key}: {problem}" if problem else None


def run_failure(e: Exception) -> int:
    """Exit status and one stderr line for a run stopped by another run holding its outputs (2: nothing was touched)
    or by a failed write (1: a full disk, a read-only or vanished folder; the message names the path, and a failed
    save the checkpoint ``--resume`` continues from). Anything else is re-raised with its traceback. A Ray worker's
    error arrives wrapped (`RayTaskError`): its cause is reported."""
    from megatron_rl.checkpoint import CheckpointError
    from megatron_rl.fsutil import OutputBusyError, describe_os_error

    cause = getattr(e, "cause", None) if type(e).__name__.startswith("RayTaskError") else None
    err = cause if isinstance(cause, BaseException) else e
    if isinstance(err, OutputBusyError):
        print(f"error: {err}", file=sys.stderr)
        return 2
    if isinstance(err, OSError):
        print(f"error: {describe_os_error(err)}", file=sys.stderr)
        return 1
    if isinstance(err, CheckpointError):
        print(f"error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    raise e


def interrupted_message(ckpt_root: Path) -> str:
    """What Ctrl-C left (the last saved checkpoint, if any) and how to continue, in one line."""
    from megatron_rl.checkpoint import LATEST_FILE

    latest = Path(ckpt_root) / LATEST_FILE
    if latest.is_file():
        return (f"interrupted: the last checkpoint (iteration {latest.read_text().strip()[:20]}) is in {ckpt_root}; "
                f"the same command with --resume (or --auto-resume) continues from it")
    return f"interrupted before the first checkpoint was saved in {ckpt_root}; nothing to resume"


if __name__ == "__main__":
    sys.exit(main())
