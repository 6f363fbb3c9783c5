"""Supervised fine-tuning of the Megatron actor on chat transcripts (the recipe's SFT and RFT stages).

    python -m megatron_rl.sft --config configs/sft_tiny.yaml [key=value ...] [--model HF_DIR] [--data F.jsonl]
    python -m megatron_rl.sft --config configs/sft_tiny.yaml --resume          # or --auto-resume: resume if a
                                                                            # checkpoint exists, else start fresh

Rows (``data_synth.sft/1`` from ``data_synth distill`` / ``rft``, or any ``{"messages": [...]}``) are rendered by
the tokenizer's chat template with the loss on the final assistant turn only (`megatron_rl.sft_data`). Each step
trains one global batch of ``train.global_batch_size`` rows with `MegatronActor.train_step` and `SFTLoss`: the
actor splits it over DP ranks and packs each share into micro-batches of ``actor.max_tokens_per_gpu`` tokens
(sequence packing; the loss is the same packed or not), over TP/PP as configured. Ranks run as Ray actors, or
in-process with ``cluster.backend=local``, exactly as the RL trainer's.

The epoch order is a seeded shuffle, so a step number fixes the batch and ``--resume`` continues from the last
checkpoint (weights, optimizer, LR schedule, RNG) with the batch that would have come next. Checkpoints carry the
model's config and the training tokenizer with its chat template as HF assets; at the end the run writes an HF
export (``train.export_dir``, default ``<log_dir>/hf``) with them, which is what RL starts from
(``python -m megatron_rl.train --model <export>``) and what ``megatron_rl.evaluate`` loads. Logs: ``tb/``
(TensorBoard), ``metrics.jsonl``, ``summary.json``; the last stdout line is the JSON summary.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_rl.actor.actor import ActorConfig
from megatron_rl.checkpoint import copy_hf_asset_dirs, resume_problem
from megatron_rl.cluster.train_group import TrainWorker
from megatron_rl.config import (ClusterConfig, ConfigError, ModelConfig, _merge_each, _named,
                                _omegaconf_problem, abs_path, load_preset, model_problems)
from megatron_rl.fsutil import publish_dir, rebuild_dir, write_text_atomic
from megatron_rl.observability import RunLogger
from megatron_rl.train import output_problem

if TYPE_CHECKING:
    from megatron_rl.sft_data import LoadReport

log = logging.getLogger("megatron_rl.sft")


@dataclasses.dataclass
class SFTDataConfig:
    files: list[str] = dataclasses.field(default_factory=list)  # JSONL files of chat rows
    on_error: str = "raise"             # a malformed row: raise (naming file:line) | skip (logged, counted)
    require_passed: bool = True         # rows with "passed": false (distill --keep all) are skipped, logged
    max_seq_len: int | None = None      # longer rows are malformed (see on_error)
    enable_thinking: bool | None = None # forwarded to the chat template when set (as agent.enable_thinking)
    shuffle_seed: int = 0


@dataclasses.dataclass
class SFTTrainConfig:
    epochs: int = 1
    steps: int | None = None            # optimizer steps; None: epochs x ceil(rows / global_batch_size)
    global_batch_size: int = 32         # rows per optimizer step (split over DP ranks, packed per micro-batch)
    save_interval: int = 0              # 0: save only at the end
    log_dir: str = "runs/${name}"
    ckpt_dir: str | None = None         # None: <log_dir>/ckpt
    resume: bool = False
    export: bool = True                 # write the HF export at the end
    export_dir: str | None = None       # None: <log_dir>/hf
    kill_at_step: int | None = None     # fault injection for resume tests: stop hard when this step starts


def _sft_actor() -> ActorConfig:
    return ActorConfig(lr=1e-5, lr_warmup_steps=0, lr_decay_style="cosine", weight_decay=0.0)


@dataclasses.dataclass
class SFTConfig:
    name: str = "sft"
    seed: int = 1234
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    actor: ActorConfig = dataclasses.field(default_factory=_sft_actor)
    data: SFTDataConfig = dataclasses.field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = dataclasses.field(default_factory=SFTTrainConfig)

    @property
    def run_dir(self) -> Path:
        return abs_path(self.train.log_dir)

    @property
    def ckpt_root(self) -> Path:
        return abs_path(self.train.ckpt_dir) if self.train.ckpt_dir else self.run_dir / "ckpt"

    @property
    def export_root(self) -> Path:
        return abs_path(self.train.export_dir) if self.train.export_dir else self.run_dir / "hf"


# ------------------------------------------------------------------------------------------ config


def load_sft_config(path: str | None, overrides: list[str] | None = None) -> SFTConfig:
    """Preset YAML + dotted overrides -> a validated `SFTConfig` (every problem reported at once, by key)."""
    layers: list[Any] = [OmegaConf.structured(SFTConfig)]
    if path is not None:
        layers.append(load_preset(path))
    overrides = list(overrides or [])
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    merged, problems = _merge_each(layers, overrides, source=path)
    if merged is not None and problems == ["the overrides do not merge with the preset"]:
        problems = []
    if merged is None:
        raise ConfigError(problems)
    for f in dataclasses.fields(SFTConfig):
        node = merged.get(f.name)
        if isinstance(node, DictConfig):
            try:
                OmegaConf.to_object(node)
            except OmegaConfBaseException as e:
                problems.append(_omegaconf_problem(e))
            except (TypeError, ValueError) as e:
                problems += _named(f.name, str(e), node.keys())
    if problems:
        raise ConfigError(problems)
    cfg: SFTConfig = OmegaConf.to_object(merged)
    validate_sft(cfg)
    return cfg


def validate_sft(cfg: SFTConfig) -> None:
    """Everything checkable before a rank starts; raises one ConfigError listing every problem."""
    problems: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            problems.append(msg)

    a, c, d, t = cfg.actor, cfg.cluster, cfg.data, cfg.train
    need(bool(d.files), "data.files: give at least one SFT JSONL file (data.files=[a.jsonl] or --data a.jsonl)")
    for f in d.files:
        need(abs_path(f).is_file(), f"data.files: {abs_path(f)} "
             + ("is a folder (give JSONL files)" if abs_path(f).is_dir() else "does not exist"))
    need(d.on_error in ("raise", "skip"), f"data.on_error must be raise or skip, got {d.on_error!r}")
    need(d.max_seq_len is None or d.max_seq_len >= 2, f"data.max_seq_len={d.max_seq_len} must be >= 2")
    need(t.epochs >= 1, f"train.epochs must be >= 1, got {t.epochs}")
    need(t.steps is None or t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    need(t.global_batch_size >= 1, f"train.global_batch_size must be >= 1, got {t.global_batch_size}")
    need(t.save_interval >= 0, f"train.save_interval must be >= 0, got {t.save_interval}")
    need(c.actor_world_size >= 1, f"cluster.actor_world_size must be >= 1, got {c.actor_world_size}")
    need(c.num_cpus is None or c.num_cpus >= 1, f"cluster.num_cpus must be >= 1, got {c.num_cpus}")
    need(c.backend in ("auto", "ray", "local"), f"cluster.backend must be auto|ray|local, got {c.backend!r}")
    need(not (c.backend == "local" and c.actor_world_size != 1),
         "cluster.backend=local runs one train rank in-process: set cluster.actor_world_size=1")
    par_ok = a.tp >= 1 and a.pp >= 1
    need(par_ok, f"actor.tp and actor.pp must be >= 1, got tp={a.tp} pp={a.pp}")
    if par_ok:
        need(c.actor_world_size % (a.tp * a.pp) == 0,
             f"cluster.actor_world_size={c.actor_world_size} is not divisible by actor.tp*actor.pp={a.tp * a.pp}")
        try:
            a.validate()
        except ValueError as e:
            problems += _named("actor", str(e), {f.name for f in dataclasses.fields(a)})
    problems += model_problems(cfg.model, a, par_ok)[0]
    for key, path in (("train.log_dir", cfg.run_dir), ("train.ckpt_dir", cfg.ckpt_root),
                      ("train.export_dir", cfg.export_root)):
        problem = output_problem(key, path)   # as train's: a usage error, not a failure after the first step
        need(problem is None, str(problem))
    if cfg.model.tokenizer == "auto":
        cfg.model.tokenizer = cfg.model.path if cfg.model.path else "qwen3-offline"
    if cfg.model.tokenizer != "qwen3-offline":
        tp = abs_path(cfg.model.tokenizer)
        need(tp.is_dir(), f"model.tokenizer: {tp} is not a directory (or use 'qwen3-offline')")
        if tp.is_dir():   # as the RL config checks it (megatron_rl.config.validate)
            need(any((tp / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")),
                 f"model.tokenizer: {tp} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                 f"set model.tokenizer=qwen3-offline or point it at a tokenizer dir")
    if problems:
        raise ConfigError(problems)


# ------------------------------------------------------------------------------------------ ranks


class SFTWorker(TrainWorker):
    """One training rank of an SFT run: the RL rank (parallel init, actor, checkpoints) plus the SFT step and a
    live HF export."""

    def sft_step(self, samples) -> dict[str, float] | None:
        from megatron_rl.actor import SFTLoss

        metrics = self.actor.train_step(samples, SFTLoss())
        return metrics if self.rank == 0 else None

    def save_sft(self, ckpt_root: str, iteration: int, extra: dict, assets_dir: str) -> str:
        return self.actor.save(ckpt_root, iteration, extra, hf_assets_dir=assets_dir)

    def load_sft(self, ckpt_root: str) -> dict:
        self.actor.load_hf(self.model_dir)
        return self.actor.load(ckpt_root)

    def export_hf(self, out_dir: str, assets_dir: str) -> str | None:
        """The current weights as an HF model dir (safetensors, config.json, tokenizer and chat template from
        ``assets_dir``), written beside ``out_dir`` and renamed over it. Collective; rank 0 writes."""
        from ckpt_tools.hf_io import ShardedSafetensorsWriter, copy_assets, follow_weight_map, write_hf_config
        from megatron_rl.bridge import LazyHFState, get_bridge
        from megatron_rl.bridge.hf_dir import follow_source_dtypes, fp32_source_dtypes
        from megatron_rl.bridge.hf_state import SINGLE_NAME

        # the starting model's checkpoint decides the release's layout: the names it used (a multimodal
        # release's ``model.language_model.*``, a tied lm_head stored anyway), one file or shards, the tensors
        # the model does not hold (vision tower, MTP), as `ckpt_tools mcore-to-hf` reproduces them
        state = LazyHFState(self.model_dir)
        stream = self.actor.export_hf(hf_names=state.keys())
        if self.rank != 0:
            for _ in stream:   # the export is collective over the model-parallel group
                pass
            return None

        def build(d: str) -> None:
            bridge = get_bridge(self.actor.hf_config, hf_names=state.keys())
            passthrough = bridge.passthrough_hf_names(list(state.keys()))
            single = state.files == [SINGLE_NAME]
            # a sharded starting model's shard files and index, as `mcore-to-hf` writes them back
            weight_map = None if single else follow_weight_map(state.weight_map,
                                                               [*bridge.hf_param_names(), *passthrough])
            writer = ShardedSafetensorsWriter(d, single_file=single, weight_map=weight_map)
            # A_log/dt_bias back in the dtype the starting model stored them in, as `mcore-to-hf` writes them
            writer.add_all(follow_source_dtypes(stream, fp32_source_dtypes(bridge, state), self.actor.cfg.torch_dtype))
            # tensors the model does not hold (a vision tower), as they were
            writer.add_all((n, state.read(n)) for n in passthrough)
            writer.close()
            write_hf_config(d, self.actor.hf_config.to_dict(), self.actor.cfg.torch_dtype,
                            bridge.hf_architectures)
            copy_assets(assets_dir, d)

        return str(rebuild_dir(build, out_dir))


def stage_hf_assets(model_dir: str, tokenizer_dir: str, dest: Path) -> str:
    """A dir holding the model dir's files (linked) with the training tokenizer's files over them: what the
    checkpoints and the export carry as HF assets (config, weights for passthrough tensors, tokenizer, chat
    template, and the asset folders such as ``additional_chat_templates/``, the tokenizer's over the model's)."""
    def build(d: str) -> None:
        for f in Path(model_dir).iterdir():
            if f.is_file():
                os.symlink(f.resolve(), Path(d) / f.name)
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
                target = Path(d) / f.name
                if target.is_symlink() or target.exists():
                    target.unlink()
                shutil.copy2(f, target)
        copy_hf_asset_dirs(model_dir, d)
        if Path(tokenizer_dir).resolve() != Path(model_dir).resolve():
            copy_hf_asset_dirs(tokenizer_dir, d)   # the training tokenizer's named templates replace the model's

    shutil.rmtree(dest, ignore_errors=True)
    return str(publish_dir(build, dest))


# ------------------------------------------------------------------------------------------ the run


@dataclasses.dataclass
class Schedule:
    """Which rows each step trains: a seeded shuffle per epoch, consecutive slices of it."""

    num_rows: int
    batch: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_rows / self.batch)

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        order = list(range(self.num_rows))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order[k * self.batch:(k + 1) * self.batch]


class SFTLogger(RunLogger):
    @staticmethod
    def console_line(step: int, total: int, s: dict[str, Any], phases: dict[str, float]) -> str:
        phase = " ".join(f"{k}={v:.1f}s" for k, v in phases.items())
        return (f"[sft {step + 1}/{total}] loss={s.get('train/loss', float('nan')):.4f} "
                f"grad={s.get('train/grad_norm', float('nan')):.3f} lr={s.get('train/lr', float('nan')):.2e} "
                f"tokens={int(s.get('train/num_tokens', 0))} tok/s={s.get('perf/tokens_per_s', 0.0):.0f} | {phase}")


class InjectedFault(RuntimeError):
    """`train.kill_at_step` fired: the run stops as if killed."""


def _start_ranks(cfg: SFTConfig, model_dir: str):
    import torch

    from megatron_rl.cluster import ray_mode, start_ray
    from megatron_rl.cluster.train_group import TrainGroup

    c = cfg.cluster
    use_gpu = torch.cuda.is_available() if c.use_gpu is None else bool(c.use_gpu)
    placement = None
    use_ray = ray_mode(c)
    if use_ray:
        from megatron_rl.cluster.placement import create_placement

        start_ray(c)
        placement = create_placement(c.actor_world_size, use_gpu)
    return TrainGroup(cfg, model_dir, placement=placement, use_gpu=use_gpu, ray_mode=use_ray,
                      worker_cls=SFTWorker), use_ray


def run(cfg: SFTConfig, resume: bool = False) -> dict[str, Any]:
    from megatron_rl.sft_data import SFTDataError, read_samples
    from megatron_rl.train import lock_outputs

    t_start = time.perf_counter()
    run_dir = cfg.run_dir
    problem = resume_problem(cfg.ckpt_root) if resume else None
    if problem:   # before the run dir is made
        raise SystemExit(problem)
    # the rows are read, checked and encoded first: bad data stops the run before it changes anything (an earlier
    # run's --resume pointer and metrics in the same dir stay as they are)
    files = [abs_path(f) for f in cfg.data.files]
    parsed, report = read_samples(files, on_error=cfg.data.on_error, require_passed=cfg.data.require_passed)
    if not parsed:
        raise SFTDataError(f"no trainable rows in {', '.join(map(str, files))} ({report.to_dict()})")
    # before the run dir is made or an earlier run's pointer touched; an export dir elsewhere is the run's too
    with lock_outputs("SFT run", run_dir, cfg.ckpt_root, *([cfg.export_root] if cfg.train.export else [])):
        return _run(cfg, resume, t_start, files, parsed, report)


def _run(cfg: SFTConfig, resume: bool, t_start: float, files: list[Path], parsed: list,
         report: "LoadReport") -> dict[str, Any]:
    """The run proper, its outputs locked (`run`)."""
    from megatron_rl.observability import PhaseTimer
    from megatron_rl.sft_data import SFTDataError, encode_samples
    from megatron_rl.tokenizer import load_tokenizer
    from megatron_rl.train import begin_fresh_run, prepare_model

    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir, tok_path = prepare_model(cfg, environment_tokenizer=False)
    tokenizer = load_tokenizer(tok_path)
    from megatron_rl.bridge.hf_dir import load_hf_config
    from megatron_rl.models import text_config

    vocab = int(text_config(load_hf_config(model_dir)).vocab_size)
    kw = {} if cfg.data.enable_thinking is None else {"enable_thinking": cfg.data.enable_thinking}
    rows = encode_samples(parsed, report, tokenizer, on_error=cfg.data.on_error, max_seq_len=cfg.data.max_seq_len,
                          template_kwargs=kw, vocab_size=vocab)
    del parsed
    if not rows:
        raise SFTDataError(f"no trainable rows in {', '.join(map(str, files))} ({report.to_dict()})")
    if not resume:
        begin_fresh_run(run_dir, cfg.ckpt_root)
    sched = Schedule(len(rows), cfg.train.global_batch_size, cfg.data.shuffle_seed)
    total = cfg.train.steps or cfg.train.epochs * sched.steps_per_epoch
    a = cfg.actor
    if a.lr_decay_style != "constant" and a.lr_decay_steps is None:
        a.lr_decay_steps = max(total, a.lr_warmup_steps + 1)
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    print(f"[sft] {len(rows)} samples from {report.rows} rows ({len(report.skipped)} skipped), {total} steps of "
          f"{cfg.train.global_batch_size}; logs and TensorBoard in {run_dir}", flush=True)
    assets = stage_hf_assets(model_dir, tok_path, run_dir / "hf_assets_src")
    group, use_ray = _start_ranks(cfg, model_dir)
    logger = SFTLogger(run_dir, dump_samples=False)
    losses: list[float] = []
    start, ckpt, export = 0, None, None
    try:
        if resume:
            extra = group.call("load_sft", str(cfg.ckpt_root))
            start, losses = int(extra["step"]), list(extra.get("losses", []))
        else:
            group.init_weights(None, with_reference=False)
        print(f"[sft] ranks ready in {time.perf_counter() - t_start:.1f}s, from step {start}", flush=True)
        for step in range(start, total):
            if step == cfg.train.kill_at_step and not resume:
                raise InjectedFault(f"train.kill_at_step={step}")
            timer = PhaseTimer()
            batch = [rows[i].sample for i in sched.indices(step)]
            with timer("train"):
                payload = batch
                if use_ray:
                    import ray

                    payload = ray.put(batch)
                m = group.call("sft_step", payload)
            losses.append(m["loss"])
            tokens = sum(len(s) for s in batch)
            if step + 1 == total or (cfg.train.save_interval and (step + 1) % cfg.train.save_interval == 0):
                with timer("save"):
                    ckpt = group.call("save_sft", str(cfg.ckpt_root), step + 1,
                                      {"step": step + 1, "losses": losses}, assets)
            logger.log_step(step, {**{f"train/{k}": v for k, v in m.items()}, "train/epoch": step / sched.steps_per_epoch,
                                   "perf/tokens_per_s": tokens / sum(timer.seconds.values())},
                            timer.seconds, total)
        if cfg.train.export:
            export = group.call("export_hf", str(cfg.export_root), assets)
            print(f"[sft] HF export (tokenizer and chat template included): {export}", flush=True)
    finally:
        group.shutdown()
        logger.close()
        if use_ray:
            import ray

            if ray.is_initialized() and cfg.cluster.ray_address is None:
                ray.shutdown()
    summary = {"steps": len(losses), "steps_this_run": total - start, "loss_first": losses[0] if losses else None,
               "loss_last": losses[-1] if losses else None, "samples": len(rows), "data": report.to_dict(),
               "wall_seconds": round(time.perf_counter() - t_start, 2), "log_dir": str(run_dir),
               "checkpoint": str(cfg.ckpt_root), "hf_export": export}
    logger.write_summary(summary)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from megatron_rl.train import add_resume_args

    p = argparse.ArgumentParser(prog="python -m megatron_rl.sft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML preset (configs/sft_*.yaml)")
    add_resume_args(p)
    p.add_argument("--model", help="HF checkpoint dir to start from (same as model.path=...)")
    p.add_argument("--data", action="append", help="SFT JSONL file (repeatable; same as data.files=[...])")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=3 actor.lr=1e-5")
    return p.parse_intermixed_args(argv)   # overrides may come before and after --data


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.observability import print_summary
    from megatron_rl.sft_data import SFTDataError
    from megatron_rl.train import cli_path

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    overrides = list(args.overrides)
    # a flag's path is the shell's, from the working dir (a relative path in key=value is from the repository root)
    if args.model:
        overrides.append(f"model.path={cli_path(args.model)}")
    if args.data:
        overrides.append("data.files=[" + ",".join(f"'{cli_path(f)}'" for f in args.data) + "]")
    if args.resume:
        overrides.append("train.resume=true")
    try:
        cfg = load_sft_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from megatron_rl.train import resolve_resume

    cfg.train.resume, problem = resolve_resume(cfg.ckpt_root, cfg.train.resume, args.auto_resume, "sft")
    if problem:   # a usage error: exit 2 before anything is started or written
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        summary = run(cfg, resume=cfg.train.resume)
    except SFTDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except InjectedFault as e:
        print(f"[sft] stopped by fault injection: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        from megatron_rl.train import interrupted_message

        print(interrupted_message(cfg.ckpt_root), file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - only another run's lock and write failures; the rest re-raised
        from megatron_rl.train import run_failure

        return run_failure(e)
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
