"""The RL driver: rollout -> advantages -> logprobs -> train -> checkpoint -> weight sync.

    python -m megatron_rl.train --config configs/quickstart.yaml [key=value ...] [--resume]

Each step generates `data.prompts_per_step` groups of `agent.group_size` multi-turn trajectories
(rewards from the verifier farm, PrimeEcho over turns), turns them into GRPO-advantaged training
samples, recomputes the old-policy logprobs, takes one optimizer step with the PPO-clip /
MirrorPop loss, checkpoints, and pushes the new weights into the engines. Everything the step
did is logged (TensorBoard, console line, JSONL samples); the last stdout line is a JSON summary.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("megatron_rl.train")


class InjectedFault(RuntimeError):
    """`train.kill_at_step` fired: the run stops as if killed (nothing after the last checkpoint kept)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML preset (configs/*.yaml)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in train.ckpt_dir")
    p.add_argument("--model", help="HF checkpoint dir (same as model.path=...)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5 actor.tp=2")
    return p.parse_args(argv)


def prepare_model(cfg) -> tuple[str, str]:
    """The HF model dir and tokenizer dir every role loads. A missing `model.path` means a tiny random
    Qwen3-architecture model, built once per run dir (deterministic from `model.tiny.init_seed`)."""
    from megatron_rl.fsutil import publish_dir

    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = run_dir / "tokenizer"
    if cfg.data.tasks == "toy":
        from megatron_rl.toy import save_tokenizer

        save_tokenizer(tok_dir)
        tokenizer_path = str(tok_dir)
    elif cfg.model.tokenizer == "qwen3-offline":
        if not (tok_dir / "tokenizer.json").is_file():
            from megatron_rl.tokenizer import load_tokenizer

            publish_dir(load_tokenizer("qwen3-offline").save_pretrained, tok_dir)
        tokenizer_path = str(tok_dir)
    else:
        tokenizer_path = str(Path(cfg.model.tokenizer).resolve())
    if cfg.model.path:
        return str(Path(cfg.model.path).resolve()), tokenizer_path
    model_dir = run_dir / "model"
    if not (model_dir / "config.json").is_file():
        import torch
        from transformers import AutoTokenizer, Qwen3ForCausalLM

        t = cfg.model.tiny
        hf_cfg = t.hf_config(t.vocab_size or len(AutoTokenizer.from_pretrained(tokenizer_path)))
        torch.manual_seed(t.init_seed)
        gpu = torch.cuda.is_available() and cfg.cluster.use_gpu is not False
        dtype = torch.bfloat16 if cfg.actor.params_dtype == "bfloat16" else torch.float32
        with torch.device("cuda" if gpu else "cpu"):  # an 8B random init takes minutes on the host
            model = Qwen3ForCausalLM(hf_cfg).to(dtype)
        publish_dir(lambda d: model.save_pretrained(d, safe_serialization=True), model_dir)
        del model
    return str(model_dir), tokenizer_path


def _attach(samples, name: str, values: list[list[float]]) -> None:
    for s, v in zip(samples, values):
        s.fields[name] = [float(x) for x in v]


def run(cfg, resume: bool = False) -> dict:
    from megatron_rl.checkpoint import latest_iteration
    from megatron_rl.cluster import Cluster
    from megatron_rl.config import to_yaml
    from megatron_rl.observability import PhaseTimer, RunLogger
    from megatron_rl.rl_batch import build_train_batch, rollout_metrics

    t_start = time.perf_counter()
    logger = RunLogger(cfg.run_dir, dump_samples=cfg.train.dump_samples)
    (cfg.run_dir / "config.yaml").write_text(to_yaml(cfg))
    print(f"[run] logs, samples and TensorBoard in {cfg.run_dir}", flush=True)
    startup = PhaseTimer()
    with startup("model"):
        model_dir, tokenizer_path = prepare_model(cfg)
    ckpt_root = str(cfg.ckpt_root)
    if resume and latest_iteration(ckpt_root) is None:
        raise SystemExit(f"--resume: no checkpoint under {ckpt_root}")

    with startup("cluster"):
        cluster = Cluster(cfg, model_dir, tokenizer_path)
    history: dict[str, list] = {"reward": []}
    steps_done = 0
    try:
        with startup("load"):
            if resume:
                extra = cluster.train.load(ckpt_root)
                start = int(extra["step"])
                cluster.load_rollout_state(extra["rollout"])
                history = extra.get("history", history)
                print(f"[run] resumed at step {start} from {ckpt_root}", flush=True)
            else:
                cluster.train.load_hf()
                start = 0
            if cfg.loss.kl_loss_coef > 0:
                cluster.train.snapshot_ref()  # the KL reference is the starting policy
        with startup("first sync"):
            cluster.sync_weights(start)
        print("[run] ready in " + ", ".join(f"{k} {v:.1f}s" for k, v in startup.seconds.items()), flush=True)

        pending = cluster.rollout_async(start) if cfg.cluster.async_rollout else None
        failed_in_a_row = 0
        for step in range(start, cfg.train.steps):
            if cfg.train.kill_at_step is not None and step == cfg.train.kill_at_step and not resume:
                raise InjectedFault(f"train.kill_at_step={step}")
            timer = PhaseTimer()
            with timer("rollout"):
                if pending is not None:
                    out = pending.result()
                    pending = cluster.rollout_async(step + 1) if step + 1 < cfg.train.steps else None
                else:
                    out = cluster.rollout(step)
            if not out.groups:
                failed_in_a_row += 1
                print(f"[step {step + 1}] no scored groups ({out.stats.get('groups_unscored')}); step skipped",
                      flush=True)
                if failed_in_a_row >= cfg.train.max_failed_steps:
                    raise RuntimeError(f"{failed_in_a_row} steps in a row produced no trainable groups")
                continue
            with timer("advantages"):
                samples, trajectories = build_train_batch(out.groups, cfg.advantage)
            with timer("logprobs"):
                # the losses read π_old and π_ref on trained tokens only: no output layer over the prompts
                _attach(samples, "old_logprobs", cluster.train.compute_logprobs(samples, trained_only=True))
                if cfg.loss.kl_loss_coef > 0:
                    _attach(samples, "ref_logprobs", cluster.train.compute_ref_logprobs(samples, trained_only=True))
            with timer("train"):
                train_metrics = cluster.train.train_step(samples, cfg.loss)
            skipped = bool(train_metrics.get("skipped"))
            failed_in_a_row = failed_in_a_row + 1 if skipped else 0
            if skipped:
                print(f"[step {step + 1}] non-finite loss or grad norm: update skipped, weights unchanged", flush=True)
                if failed_in_a_row >= cfg.train.max_failed_steps:
                    raise RuntimeError(f"{failed_in_a_row} steps in a row were skipped (NaN/inf)")
            if pending is not None:
                # one-step off-policy: the in-flight rollout finishes on the old weights before the sync
                pending.result()
            iteration = step + 1
            metrics = rollout_metrics(trajectories)
            history["reward"].append(metrics["reward/mean"])
            save_now = iteration == cfg.train.steps or (cfg.train.save_interval and iteration % cfg.train.save_interval == 0)
            if save_now:
                with timer("save"):
                    cluster.train.save(ckpt_root, iteration, {
                        "step": iteration, "rollout": cluster.rollout_state(), "history": history})
            with timer("sync"):
                sync_report = cluster.sync_weights(iteration)
            n_tokens = sum(len(s.tokens) for s in samples)
            scalars = {**metrics, **{f"train/{k}": v for k, v in train_metrics.items()},
                       "sync/seconds": sync_report.get("seconds"), "sync/gbps": sync_report.get("gbps"),
                       "perf/tokens_per_s": n_tokens / max(sum(timer.seconds.values()), 1e-9),
                       "rollout/groups_unscored": sum((out.stats.get("groups_unscored") or {}).values()),
                       "bdr/size": out.stats.get("bdr_size")}
            logger.log_step(step, scalars, timer.seconds, cfg.train.steps)
            logger.dump_samples(step, trajectories)
            steps_done += 1
    finally:
        cluster.shutdown()
        logger.close()
    rewards = history["reward"]
    summary = {
        "steps": len(rewards), "steps_this_run": steps_done,
        "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
        "reward_max": max(rewards) if rewards else None,
        "wall_seconds": round(time.perf_counter() - t_start, 2), "log_dir": str(cfg.run_dir),
        "checkpoint": ckpt_root,
    }
    logger.write_summary(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.observability import print_summary

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Models and tokenizers come from local dirs; a task module that reaches for the Hub (KernelBench
    # level 4) must fail fast rather than retry for minutes while prompts are built.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.resume:
        overrides.append("train.resume=true")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run(cfg, resume=cfg.train.resume)
    except InjectedFault as e:
        print(f"[run] stopped by fault injection: {e}", file=sys.stderr)
        return 3
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
