"""The whole MusaCoder recipe on one CPU machine, each stage through its own command line:

    generate stage-1 tasks and stage-2 compositions -> teacher data (offline compact teacher, verified)
    -> [a small BPE fitted to the teacher data] -> SFT a tiny model -> RFT (sample, verify, cluster, draw; SFT
    again) -> RL a few steps -> evaluate every stage on held-out generated tasks (unseen shapes and compositions),
    CPU verifier

    python -m megatron_rl.recipe --config configs/recipe_cpu.yaml [key=value ...]     (launch/recipe_cpu.sh)

Task generation runs in this process (``data_synth`` library: the same code as ``python -m data_synth generate``);
every other stage is a subprocess of the project's CLI (``data_synth distill`` / ``rft``, ``megatron_rl.tokenizer
train``, ``megatron_rl.sft``, ``megatron_rl.train``, ``ckpt_tools mcore-to-hf``, ``megatron_rl.evaluate``), so the
recipe exercises the same contracts a user runs. The stages share one verifier build cache and one verdict cache:
an extension source is compiled once for the whole recipe, and the same code for the same task is verified once.

Held-out tasks come from another seed and are decontaminated against the training tasks; a held-out task whose ops
never occur in training is reported (the model could not know them). Outputs under ``workdir``: ``tasks/``,
``data/``, ``sft/``, ``rft/``, ``rl/``, ``eval/<stage>/`` (each evaluation's JSON, markdown and HTML report),
``recipe.json`` and ``recipe.md`` (every stage side by side). The last stdout line is ``recipe.json``:
``{"stages": {"init": {"pass_at_8": ...}, "sft": ..., "rft": ..., "rl": ...}, "heldout_tasks": N,
"wall_seconds": ..., "model": "<HF export of the final model>", ...}``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from data_synth.compact import STYLES, compact_answer, supported_ops
from data_synth.decontam import Decontaminator, Reference
from data_synth.generate import GenConfig
from data_synth.pipeline import generate_task_set
from data_synth.taskset import read_task_set, write_task_set
from data_synth.teacher import Unsupported
from data_synth.util import atomic_write_jsonl, read_jsonl
from data_synth.variants import variant_rows
from data_synth.validate import ValidationConfig
from megatron_rl.config import REPO_ROOT, ConfigError, abs_path, load_preset
from megatron_rl.evaluate import table_rows
from megatron_rl.tokenizer import MERGE_WITHIN, MIN_BPE_VOCAB

STAGES = ("init", "sft", "rft", "rl")


@dataclasses.dataclass
class RecipeConfig:
    workdir: str = "runs/recipe_cpu"
    seed: int = 0
    # the op vocabulary of the tasks (unary elementwise ops the compact teacher writes)
    ops: list[str] = dataclasses.field(default_factory=lambda: ["relu", "tanh", "sigmoid", "neg", "square", "abs"])
    compact_styles: list[str] = dataclasses.field(default_factory=lambda: ["index", "pointer"])
    train_single: int = 24             # stage-1 training tasks
    train_compositions: int = 32       # stage-2 training tasks (2-op chains)
    heldout_single: int = 8            # held-out stage-1 tasks (unseen shapes)
    heldout_compositions: int = 8      # held-out stage-2 tasks (compositions not in training)
    heldout_seed: int = 1000
    # > 0: about this many more tasks per training task, each of an op sequence training has at other shapes, and
    # an SFT row for each that repeats the verified answer of its op sequence (data_synth.variants): with one
    # prompt per answer the tiny model memorises the prompts instead of reading the op (recipe_cpu.md, session 32)
    prompt_variants: int = 0
    variant_seed: int = 7919
    validate: bool = True              # run every reference (torch.compile check off: compile_fraction 0)
    # stages
    sft_config: str = "configs/sft_tiny.yaml"
    sft: list[str] = dataclasses.field(default_factory=list)          # overrides of the SFT run
    # > 0: fit a byte-level BPE of at most this many tokens to the teacher data and train the SFT model with it
    # (its output layer then costs a few thousand logits per token, not Qwen3's 151k); 0: the SFT preset's tokenizer
    tokenizer_vocab: int = 0
    tokenizer_merge_within: str = "lines"   # words | lines (megatron_rl.tokenizer.train_bpe)
    rft_samples: int = 4               # responses per training prompt from the SFT model
    rft_targets: int = 2               # targets per prompt, drawn across clusters
    rft_prompts: int | None = None     # None: every training prompt
    rft_temperature: float = 1.0
    # RFT fine-tunes on its drawn targets together with the SFT run's data, teacher rows and prompt variants
    # (replay): on its targets alone (17 rows of 12 prompts in the 2026-12-04 run) the SFT model drifted toward
    # those prompts and lost a held-out task
    rft_replay: bool = True
    rft: list[str] = dataclasses.field(default_factory=list)          # overrides of the RFT SFT run
    rl_config: str = "configs/recipe_cpu_rl.yaml"
    rl: list[str] = dataclasses.field(default_factory=list)           # overrides of the RL run
    # evaluation
    eval_samples: int = 8
    eval_turns: int = 1
    eval_temperature: float = 0.7
    max_new_tokens: int = 400
    verifier_trials: int = 3
    verifier_timing_trials: int = 10
    # the teacher's rows need a verified pass; their speedup is recorded but not trained on, so fewer timed trials
    # (None: verifier_timing_trials)
    teacher_timing_trials: int | None = None
    compile_workers: int = 2
    # verifier execution workers of the teacher and RFT stages (None: the farm's default, one on a CPU; two on two
    # cores finish the teacher's checks ~30% sooner, one's child starting while the other's runs)
    device_workers: int | None = None
    engine_threads: int | None = None
    stop_after: str | None = None      # a stage name: stop once it is evaluated (debugging)
    cache_dir: str | None = None       # verifier build + verdict caches (None: <workdir>/cache; share it across
                                       # runs to skip compiles, but a timed run starts cold)

    @property
    def root(self) -> Path:
        return abs_path(self.workdir)


def load_recipe_config(path: str | None, overrides: list[str]) -> RecipeConfig:
    layers: list[Any] = [OmegaConf.structured(RecipeConfig)]
    if path:
        layers.append(load_preset(path))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    try:
        merged = OmegaConf.merge(*layers, OmegaConf.from_dotlist(overrides))
        cfg: RecipeConfig = OmegaConf.to_object(merged)
    except Exception as e:  # noqa: BLE001 - OmegaConf's validation errors name the key
        raise ConfigError(str(e).splitlines()[0]) from None
    problems = []
    known = set(supported_ops())
    problems += [f"ops: {o} is not an op the compact teacher writes" for o in cfg.ops if o not in known]
    problems += [f"compact_styles: {s} is not one of {STYLES}" for s in cfg.compact_styles if s not in STYLES]
    if cfg.stop_after is not None and cfg.stop_after not in STAGES:
        problems.append(f"stop_after must be one of {STAGES}, got {cfg.stop_after!r}")
    if cfg.teacher_timing_trials is not None and cfg.teacher_timing_trials < 1:
        problems.append(f"teacher_timing_trials must be >= 1 or null, got {cfg.teacher_timing_trials}")
    for name in ("train_single", "heldout_single", "eval_samples", "rft_samples", "rft_targets"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.device_workers is not None and cfg.device_workers < 1:
        problems.append(f"device_workers must be >= 1 or null, got {cfg.device_workers}")
    if cfg.prompt_variants < 0:
        problems.append(f"prompt_variants must be >= 0, got {cfg.prompt_variants}")
    if cfg.tokenizer_merge_within not in MERGE_WITHIN:
        problems.append(f"tokenizer_merge_within must be one of {MERGE_WITHIN}, got {cfg.tokenizer_merge_within!r}")
    if cfg.tokenizer_vocab and cfg.tokenizer_vocab < MIN_BPE_VOCAB:
        problems.append(f"tokenizer_vocab must be 0 (the SFT preset's tokenizer) or >= {MIN_BPE_VOCAB}, "
                        f"got {cfg.tokenizer_vocab}")
    if problems:
        raise ConfigError(problems)
    return cfg


class StageFailed(RuntimeError):
    pass


class Recipe:
    def __init__(self, cfg: RecipeConfig):
        self.cfg = cfg
        self.root = cfg.root
        cache = abs_path(cfg.cache_dir) if cfg.cache_dir else self.root / "cache"
        self.cache = cache / "builds"
        self.verdicts = cache / "verdicts.sqlite"
        self.seconds: dict[str, float] = {}
        self.logs = self.root / "logs"

    # ---- helpers
    def run(self, name: str, args: list[str], timeout: float = 3600) -> dict[str, Any]:
        """One CLI stage as a subprocess: its output goes to logs/<name>.log, its last stdout line is its JSON."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{name}.log"
        cmd = [sys.executable, *args]
        print(f"[recipe] {name}: {' '.join(args[:3])} ... (log {log_path})", flush=True)
        t0 = time.perf_counter()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            p = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                               timeout=timeout)
            log.write(p.stdout)
        self.seconds[name] = round(time.perf_counter() - t0, 1)
        lines = [ln for ln in p.stdout.strip().splitlines() if ln.strip()]
        if p.returncode != 0 or not lines:
            tail = log_path.read_text()[-3000:]
            raise StageFailed(f"stage {name} failed (exit {p.returncode}); log {log_path}:\n{tail}")
        print(f"[recipe] {name} done in {self.seconds[name]:.0f}s", flush=True)
        return json.loads(lines[-1])

    def verifier_args(self, timing_trials: int | None = None, device_workers: bool = False) -> list[str]:
        c = self.cfg
        workers = ["--device-workers", str(c.device_workers)] if device_workers and c.device_workers else []
        return ["--cache", str(self.cache), "--trials", str(c.verifier_trials), "--timing-trials",
                str(timing_trials or c.verifier_timing_trials), "--compile-workers", str(c.compile_workers), *workers]

    # ---- stages
    def tasks(self) -> tuple[Path, Path, Path | None, dict[str, Any]]:
        """Training tasks (stage 1 + stage-2 compositions), held-out tasks (another seed, decontaminated against
        the training set and KernelBench), each merged into one task set, and the prompt variants' task set (None
        without ``prompt_variants``)."""
        c = self.cfg
        t0 = time.perf_counter()
        kb = Reference.load_index()
        validation = ValidationConfig(compile_fraction=0.0) if c.validate else None
        common = dict(families=("elementwise",), dtypes={"float32": 1.0}, ops=tuple(c.ops), min_ops=2, max_ops=2)

        def gen(stage: int, n: int, seed: int, refs: list, validate: bool = True) -> list:
            if n <= 0:
                return []
            tasks, records = generate_task_set(GenConfig(stage=stage, n=n, seed=seed, **common),
                                               validation=validation if validate else None,
                                               decontam=Decontaminator(refs), progress=False)
            skipped = [r for r in records if r.status == "skipped"]
            for r in skipped:
                print(f"[recipe] generate stage {stage}: skipped {r.task_id}: {r.check}: {r.reason}", flush=True)
            return tasks

        train = gen(1, c.train_single, c.seed, [kb])
        train += gen(2, c.train_compositions, c.seed, [kb, Reference.from_sources("train", [(t.task_id, t.source)
                                                                                            for t in train])])
        train_ref = Reference.from_sources("train", [(t.task_id, t.source) for t in train])
        seen_chains = {tuple(t.ops) for t in train}
        held = gen(1, c.heldout_single, c.heldout_seed, [kb, train_ref])
        comps: list = []
        extra = 0
        while len(comps) < c.heldout_compositions and extra < 8:
            # compositions whose op sequence training never showed; draw more until enough are unseen
            batch = gen(2, c.heldout_compositions * (2 + extra), c.heldout_seed + extra, [kb, train_ref])
            comps += [t for t in batch if tuple(t.ops) not in seen_chains
                      and tuple(t.ops) not in {tuple(x.ops) for x in comps}]
            extra += 1
        held += comps[:c.heldout_compositions]
        train_ops = {o for t in train for o in t.ops}
        unknown = sorted({o for t in held for o in t.ops} - train_ops)
        tdir = write_task_set(train, str(self.root / "tasks" / "train"), force=True,
                              info={"command": "recipe", "part": "train", "ops": c.ops})
        hdir = write_task_set(held, str(self.root / "tasks" / "heldout"), force=True,
                              info={"command": "recipe", "part": "heldout", "ops": c.ops})
        variants: list = []
        if c.prompt_variants:
            # other tasks of the training op sequences (so never a held-out composition), none a copy of a
            # training or held-out task; not validated: no reference of theirs is ever run, they are prompts for
            # answers verified on the training tasks
            refs = [kb, train_ref, Reference.from_sources("heldout", [(t.task_id, t.source) for t in held])]
            for stage, n in ((1, c.train_single), (2, c.train_compositions)):
                variants += [t for t in gen(stage, c.prompt_variants * n, c.variant_seed + stage, refs, False)
                             if tuple(t.ops) in seen_chains]
        vdir = write_task_set(variants, str(self.root / "tasks" / "variants"), force=True,
                              info={"command": "recipe", "part": "prompt variants"}) if variants else None
        self.seconds["tasks"] = round(time.perf_counter() - t0, 1)
        info = {"train": len(train), "train_single": sum(t.stage == 1 for t in train),
                "train_compositions": sum(t.stage == 2 for t in train), "heldout": len(held),
                "heldout_single": sum(t.stage == 1 for t in held), "heldout_compositions": sum(t.stage == 2 for t in held),
                "heldout_ops_unseen_in_training": unknown, "prompt_variants": len(variants)}
        if unknown:
            print(f"[recipe] warning: held-out ops never seen in training: {unknown}", flush=True)
        print(f"[recipe] tasks: {info}", flush=True)
        return Path(tdir), Path(hdir), Path(vdir) if vdir else None, info

    def variant_rows(self, teacher_rows: Path, variants: Path, out: Path) -> dict[str, Any]:
        """SFT rows of the prompt variants, each repeating the verified teacher answer of its op sequence."""
        c = self.cfg

        def answer(task) -> str | None:
            try:
                return compact_answer(task, "cpu", c.seed, c.compact_styles).response
            except Unsupported:
                return None

        tasks = read_task_set(str(variants))
        made, skipped = variant_rows(read_jsonl(str(teacher_rows), "teacher rows"), tasks, answer, "cpu")
        atomic_write_jsonl(str(out), made)
        info = {"tasks": len(tasks), "rows": len(made), "skipped": skipped}
        print(f"[recipe] prompt variants: {info}", flush=True)
        return info

    def evaluate(self, stage: str, model: str, heldout: Path) -> dict[str, Any]:
        c = self.cfg
        out = self.root / "eval" / stage
        if out.exists():
            shutil.rmtree(out)
        args = ["-m", "megatron_rl.evaluate", "--model", model, "--tasks", str(heldout), "--out", str(out),
                "--samples", str(c.eval_samples), "--turns", str(c.eval_turns), "--backend", "cpu",
                "--temperature", str(c.eval_temperature), "--max-new-tokens", str(c.max_new_tokens),
                "--result-cache", str(self.verdicts), "--seed", str(c.seed), "--label", stage, "--no-progress",
                *self.verifier_args()]
        if c.engine_threads:
            args += ["--engine-threads", str(c.engine_threads)]
        self.run(f"eval_{stage}", args)
        return json.loads((out / "summary.json").read_text())

    def sft(self, name: str, data: list[Path], model: str | None, overrides: list[str]) -> str:
        args = ["-m", "megatron_rl.sft", "--config", self.cfg.sft_config, f"train.log_dir={self.root / name}",
                *[a for d in data for a in ("--data", str(d))], *overrides]
        if model:
            args += ["--model", model]
        summary = self.run(name, args)
        print(f"[recipe] {name}: loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} over "
              f"{summary['steps']} steps", flush=True)
        return summary["hf_export"]


def _children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return round(ru.ru_utime + ru.ru_stime + me.ru_utime + me.ru_stime, 1)


def stage_row(summary: dict[str, Any], n: int) -> dict[str, Any]:
    o = summary["overall"]
    row = {f"pass_at_{n}": o.get(f"pass_at_{n}"), "pass_at_1": o.get("pass_at_1"), f"avg_at_{n}": o.get("avg_at_n"),
           "faster_eager": o.get("faster_eager"), "speedup_median": o.get("speedup_median"),
           "levels": {lv: {f"pass_at_{n}": t.get(f"pass_at_{n}"), f"avg_at_{n}": t.get("avg_at_n")}
                      for lv, t in summary["levels"].items()}}
    return row


def markdown(result: dict[str, Any], summaries: dict[str, dict]) -> str:
    n = result["eval_samples"]
    lines = [f"# The recipe on a CPU: every stage on {result['heldout_tasks']} held-out tasks", "",
             f"Held-out: {result['tasks']['heldout_single']} stage-1 tasks (ops seen in training, unseen shapes) and "
             f"{result['tasks']['heldout_compositions']} stage-2 compositions whose op sequence training never showed. "
             f"{n} samples per task at T={result['eval_temperature']}, {result['eval_turns']} turn(s), CPU verifier. "
             f"Percentages; Pass@k is the unbiased estimator.", ""]
    head = None
    body = []
    for stage, s in summaries.items():
        h, rows = table_rows(s)
        head = ["stage"] + h
        body += [[stage] + r for r in rows]
    if head:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    lines += ["", f"Wall time {result['wall_seconds']:.0f} s (CPU time of all processes {result['cpu_seconds']:.0f} s); "
                  f"per stage: {result['stage_seconds']}", f"Final model: `{result['model']}`", ""]
    if result.get("rft"):
        r = result["rft"]
        lines += [f"RFT: {r.get('verified')} verified of {r.get('samples')} samples; distinct clusters per prompt "
                  f"{r.get('clusters_per_prompt_before')} in the verified pool, {r.get('clusters_per_prompt_after')} "
                  f"among the drawn targets (best-of-k RFT keeps 1).", ""]
    return "\n".join(lines)


def run_recipe(cfg: RecipeConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    rc = Recipe(cfg)
    root = rc.root
    root.mkdir(parents=True, exist_ok=True)
    (root / "recipe_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    train, heldout, variants, tasks_info = rc.tasks()
    data = root / "data"
    data.mkdir(exist_ok=True)
    teacher = rc.run("teacher", ["-m", "data_synth", "--no-progress", "distill", "--tasks", str(train), "--offline",
                                 "--style", "compact", "--compact-styles", ",".join(cfg.compact_styles),
                                 "--backend", "cpu", "--out", str(data / "sft.jsonl"),
                                 "--verdicts", str(data / "teacher_verdicts.jsonl"), "--seed", str(cfg.seed),
                                 *rc.verifier_args(cfg.teacher_timing_trials, device_workers=True)])
    if teacher["rows_written"] == 0:
        raise StageFailed(f"the teacher wrote no verified row: {teacher}")
    summaries: dict[str, dict] = {}
    exports: dict[str, str] = {}
    sft_data = [data / "sft.jsonl"]
    variants_info = None
    if variants is not None:
        variants_info = rc.variant_rows(data / "sft.jsonl", variants, data / "variants.jsonl")
        sft_data.append(data / "variants.jsonl")
    sft_overrides = list(cfg.sft)
    tokenizer_info = None
    if cfg.tokenizer_vocab:
        tokenizer_info = rc.run("tokenizer", ["-m", "megatron_rl.tokenizer", "train",
                                              *[a for d in sft_data for a in ("--data", str(d))],
                                              "--vocab-size", str(cfg.tokenizer_vocab), "--merge-within",
                                              cfg.tokenizer_merge_within, "--out", str(root / "tokenizer")])
        sft_overrides.insert(0, f"model.tokenizer={tokenizer_info['tokenizer']}")
    exports["sft"] = rc.sft("sft", sft_data, None, sft_overrides)
    exports["init"] = str(root / "sft" / "model")    # the random init the SFT run started from
    summaries["init"] = rc.evaluate("init", exports["init"], heldout)
    summaries["sft"] = rc.evaluate("sft", exports["sft"], heldout)
    rft_info = None
    if cfg.stop_after not in ("init", "sft"):
        rft_tasks = train
        if cfg.rft_prompts is not None:
            rft_tasks = Path(write_task_set(read_task_set(str(train))[:cfg.rft_prompts], str(root / "tasks" / "rft"),
                                            force=True, info={"command": "recipe", "part": "rft"}))
        rft_info = rc.run("rft_sample", ["-m", "data_synth", "--no-progress", "rft", "--tasks", str(rft_tasks),
                                         "--model", exports["sft"], "--samples", str(cfg.rft_samples), "--targets",
                                         str(cfg.rft_targets), "--temperature", str(cfg.rft_temperature),
                                         "--max-new-tokens", str(cfg.max_new_tokens), "--out", str(data / "rft.jsonl"),
                                         "--result-cache", str(rc.verdicts), "--seed", str(cfg.seed),
                                         *rc.verifier_args(device_workers=True)])
        if rft_info["targets"] == 0:
            raise StageFailed(f"RFT drew no target (no verified sample): {rft_info}")
        # replay is the SFT run's whole data mix (its prompt variants too: they are what taught the model to read
        # the op; without them one RFT epoch at the SFT's floor lr cost a held-out chain task, session 42)
        rft_data = sft_data + [data / "rft.jsonl"] if cfg.rft_replay else [data / "rft.jsonl"]
        exports["rft"] = rc.sft("rft", rft_data, exports["sft"], list(cfg.rft))
        summaries["rft"] = rc.evaluate("rft", exports["rft"], heldout)
    if cfg.stop_after not in ("init", "sft", "rft"):
        rl_dir = root / "rl"
        if rl_dir.exists():
            shutil.rmtree(rl_dir)
        rl = rc.run("rl", ["-m", "megatron_rl.train", "--config", cfg.rl_config, "--model", exports["rft"],
                           f"data.tasks={train}", f"train.log_dir={rl_dir}", f"verifier.build_cache_dir={rc.cache}",
                           f"farm.result_cache_path={rc.verdicts}", f"farm.compile_workers={cfg.compile_workers}",
                           f"agent.sampling.max_new_tokens={cfg.max_new_tokens}", *cfg.rl,
                           "train.save_final=true"])   # the export below reads the final checkpoint
        final = root / "final_hf"
        if final.exists():
            shutil.rmtree(final)
        rc.run("export", ["-m", "ckpt_tools", "mcore-to-hf", "--ckpt", rl["checkpoint"], "--out", str(final),
                          "--no-progress"])
        exports["rl"] = str(final)
        summaries["rl"] = rc.evaluate("rl", exports["rl"], heldout)
    n = cfg.eval_samples
    last = [s for s in STAGES if s in exports and s in summaries][-1]
    result = {"stages": {s: stage_row(summaries[s], n) for s in STAGES if s in summaries},
              "heldout_tasks": tasks_info["heldout"], "wall_seconds": round(time.perf_counter() - t0, 1),
              "model": exports[last], "cpu_seconds": _children_cpu_seconds(), "stage_seconds": rc.seconds,
              "tasks": tasks_info, "eval_samples": n, "eval_turns": cfg.eval_turns,
              "eval_temperature": cfg.eval_temperature, "tokenizer": tokenizer_info, "teacher": {k: teacher.get(k) for k in
                                                                   ("tasks", "rows_written", "categories")},
              "prompt_variants": variants_info,
              "rft": rft_info and {k: rft_info.get(k) for k in ("samples", "verified", "targets",
                                                                 "clusters_per_prompt_before",
                                                                 "clusters_per_prompt_after")},
              "exports": exports, "workdir": str(root)}
    (root / "recipe.json").write_text(json.dumps(result, indent=2) + "\n")
    (root / "recipe.md").write_text(markdown(result, summaries))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/recipe_cpu.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. workdir=runs/r1 train_single=8")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = load_recipe_config(a.config, a.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_recipe(cfg)
    except StageFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
