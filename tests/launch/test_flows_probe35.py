"""Flow probe 35: chaining and resuming the stages. A resumed run's LR schedule follows its config (a longer run
decays over its own horizon); a fresh run in a run dir that holds an earlier run's checkpoint never lets --resume
continue that earlier run, nor mixes its metrics into the report; a task set killed while it was written is not
loaded from its parent folder; outputs handed to the next stage get the umask's mode, not mkdtemp's 0700/0600."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROW = {"messages": [{"role": "user", "content": "write relu"}, {"role": "assistant", "content": "x = relu(x)"}]}


# ------------------------------------------------------------------------------------------ LR schedule on resume


def test_resumed_lr_schedule_follows_the_config():
    """SFT's cosine horizon is its step count: resumed with more steps, megatron's default kept the checkpoint's
    horizon and the LR sat at min_lr from the old end on (seen: lr 1e-3 from step 7 of 12 after a 4-step run)."""
    from megatron_rl.actor.optim import OptimSettings, build_scheduler

    def scheduler(decay_steps: int):
        opt = SimpleNamespace(param_groups=[{"params": []}])
        return build_scheduler(opt, OptimSettings(lr=1e-2, min_lr=1e-3, lr_warmup_init=1e-3, lr_warmup_steps=5,
                                                  lr_decay_steps=decay_steps, lr_decay_style="cosine")), opt

    short, _ = scheduler(6)
    short.step(increment=4)
    saved = short.state_dict()
    resumed, opt = scheduler(12)          # the same run resumed with train.steps=12
    resumed.load_state_dict(saved)
    fresh, fresh_opt = scheduler(12)
    fresh.step(increment=4)
    assert resumed.lr_decay_steps == 12 and resumed.num_steps == 4
    for _ in range(4):                    # steps 5..8: past the checkpoint's horizon of 6
        resumed.step(increment=1)
        fresh.step(increment=1)
        assert opt.param_groups[0]["lr"] == pytest.approx(fresh_opt.param_groups[0]["lr"])
    assert opt.param_groups[0]["lr"] > 1e-3 * 1.5


def _resume_with_other_lr(root: str) -> None:
    import torch

    from megatron_rl.actor import ActorConfig, MegatronActor, SFTLoss
    from megatron_rl.parallel import init_parallel
    from megatron_rl.types import TrainSample
    from tests.bridge.tiny_qwen3 import hf_tensors, tiny_config, tiny_model

    init_parallel(1, 1)
    cfg = tiny_config()
    g = torch.Generator().manual_seed(0)
    samples = [TrainSample(torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist(), [0] + [1] * 19)
               for _ in range(2)]
    first = MegatronActor(ActorConfig(lr=1e-3, weight_decay=0.0, lr_warmup_steps=0), cfg)
    first.load_hf(hf_tensors(tiny_model(cfg, seed=1)))
    first.train_step(samples, SFTLoss())
    first.save(root, 1)
    resumed = MegatronActor(ActorConfig(lr=5e-3, weight_decay=0.1, lr_warmup_steps=0), cfg)
    resumed.load(root, 1)
    metrics = resumed.train_step(samples, SFTLoss())
    groups = [g for o in resumed.optimizer.chained_optimizers for g in o.optimizer.param_groups]
    assert metrics["lr"] == pytest.approx(5e-3) and {g["lr"] for g in groups} == {5e-3}
    assert {g["max_lr"] for g in groups} == {5e-3}
    assert {g["weight_decay"] for g in groups} == {0.0, 0.1}   # norms and biases keep none (wd_mult 0)


def test_a_run_resumes_with_another_lr_and_weight_decay(tmp_path):
    """megatron's distributed optimizer pairs saved param groups with the current ones by their LR and weight-decay
    fields too: a resume with another actor.lr stopped with KeyError: (None, 0.005, ...). The config's values win,
    in the groups as in the scheduler."""
    from megatron_rl.parallel import spawn

    spawn(_resume_with_other_lr, 1, str(tmp_path))


# ------------------------------------------------------------------------------------------ fresh run in a used dir


class _Stop(RuntimeError):
    pass


def _earlier_run(run_dir: Path) -> Path:
    """A run dir as an earlier finished run leaves it: a checkpoint at iteration 10 and ten metrics rows."""
    from megatron_rl.checkpoint import LATEST_FILE

    ckpt = run_dir / "ckpt"
    (ckpt / "iter_0000010").mkdir(parents=True)
    (ckpt / "iter_0000010" / "metadata.json").write_text("{}")
    (ckpt / LATEST_FILE).write_text("10")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": -1.0}) + "\n"
                                                   for s in range(10)))
    return ckpt


def _check_fresh_start(run_dir: Path, ckpt: Path) -> None:
    from megatron_rl.checkpoint import resume_problem

    # killed before its first save: --resume must not continue the earlier run's iteration 10
    assert resume_problem(ckpt) is not None
    assert (ckpt / "iter_0000010").is_dir()                     # the earlier run's weights stay on disk
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text()
    assert len((run_dir / "metrics.prev.jsonl").read_text().splitlines()) == 10


def test_fresh_rl_run_in_a_used_run_dir_is_not_resumed_from_the_earlier_run(tmp_path, monkeypatch):
    import megatron_rl.cluster
    import megatron_rl.train as train
    from megatron_rl.config import load_config

    run_dir = tmp_path / "run"
    ckpt = _earlier_run(run_dir)
    cfg = load_config(str(ROOT / "configs/quickstart.yaml"), [f"train.log_dir={run_dir}", "cluster.backend=local"])

    def stop(*_a, **_k):
        raise _Stop("killed before the first checkpoint")

    monkeypatch.setattr(train, "prepare_model", stop)
    monkeypatch.setattr(megatron_rl.cluster, "Cluster", stop)
    with pytest.raises(_Stop):
        train.run(cfg, resume=False)
    _check_fresh_start(run_dir, ckpt)
    # a third fresh run after the second wrote rows: both earlier runs' rows stay, in order
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    with pytest.raises(_Stop):
        train.run(cfg, resume=False)
    rows = [json.loads(x) for x in (run_dir / "metrics.prev.jsonl").read_text().splitlines()]
    assert [r["reward/mean"] for r in rows] == [-1.0] * 10 + [0.5]


@pytest.mark.parametrize("resume", [False, True])
def test_an_sft_run_in_a_used_run_dir_resumes_only_when_asked(tmp_path, monkeypatch, resume):
    """Fresh: the earlier run's pointer and metrics are set aside. --resume touches neither (it continues iteration
    10 and appends to its metrics)."""
    import megatron_rl.sft as sft
    from megatron_rl.checkpoint import resume_problem
    from megatron_rl.sft import load_sft_config, run

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    run_dir = tmp_path / "sft"
    ckpt = _earlier_run(run_dir)
    cfg = load_sft_config(str(ROOT / "configs/sft_tiny.yaml"), [f"train.log_dir={run_dir}", f"data.files=['{data}']",
                                                                "model.tiny.hidden_size=32",
                                                                "model.tiny.intermediate_size=64"])

    def stop(*_a, **_k):
        raise _Stop("killed before the first checkpoint")

    monkeypatch.setattr(sft, "_start_ranks", stop)   # the data is read and the run set up by then
    with pytest.raises(_Stop):
        run(cfg, resume=resume)
    if not resume:
        _check_fresh_start(run_dir, ckpt)
    else:
        assert resume_problem(ckpt) is None
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 10


# ------------------------------------------------------------------------------------------ data_synth outputs


def test_task_set_killed_while_written_is_not_loaded_from_its_parent_folder(tmp_path):
    """`generate --out tasks/s2` killed while writing: `evaluate --tasks tasks` (a parent folder walk) loaded the
    half-written temp folder's tasks beside the complete set."""
    from verifier.tasks import load_task_set

    task = (ROOT / "verifier/tasks/level1/19_ReLU.py")
    if not task.is_file():
        task = next((ROOT / "verifier/tasks/level1").glob("*.py"))
    tasks = tmp_path / "tasks"
    (tasks / "s1").mkdir(parents=True)
    (tasks / "s1" / "1_relu.py").write_text(task.read_text())
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from data_synth.util import atomic_dir\n"
            "with atomic_dir(sys.argv[2]) as tmp:\n"
            "    open(os.path.join(tmp, '1_half.py'), 'w').write(open(sys.argv[3]).read())\n"
            "    os._exit(9)\n")
    rc = subprocess.run([sys.executable, "-c", code, str(ROOT), str(tasks / "s2"), str(task)]).returncode
    assert rc == 9 and not (tasks / "s2").exists()
    assert [t.task_id for t in load_task_set(str(tasks))] == ["s1/1_relu"]


def test_data_synth_outputs_and_exports_get_the_umask_mode(tmp_path):
    """mkstemp/mkdtemp make 0600 files and 0700 dirs: an SFT export, a task set or SFT rows renamed into place
    with that mode are unreadable to the next stage's job run by another user (a shared cluster, a container)."""
    from data_synth.util import atomic_dir, atomic_write_jsonl
    from megatron_rl.fsutil import publish_dir, rebuild_dir

    old = os.umask(0o022)
    try:
        atomic_write_jsonl(str(tmp_path / "rows.jsonl"), [ROW])
        with atomic_dir(str(tmp_path / "taskset")) as d:
            Path(d, "t.py").write_text("x = 1\n")
        rebuild_dir(lambda d: Path(d, "config.json").write_text("{}"), tmp_path / "hf")
        publish_dir(lambda d: Path(d, "tokenizer.json").write_text("{}"), tmp_path / "tokenizer")
    finally:
        os.umask(old)

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(tmp_path / "rows.jsonl") == 0o644
    for d in ("taskset", "hf", "tokenizer"):
        assert mode(tmp_path / d) == 0o755, d


def test_resuming_rl_from_an_sft_checkpoint_names_the_mixup(tmp_path):
    """An SFT checkpoint has weights but no rollout state: `--resume` into it stops with what to do instead (it
    raised KeyError: 'rollout' once the engines were up)."""
    from megatron_rl.cluster import Cluster

    class _SFTWeights:
        def init_weights(self, ckpt_root, with_reference):
            assert ckpt_root == str(tmp_path)
            return {"step": 4, "losses": [1.0, 0.9, 0.8, 0.7]}   # what `megatron_rl.sft` saves as extra

    cluster = Cluster.__new__(Cluster)
    cluster.cfg = SimpleNamespace(ckpt_root=tmp_path, loss=SimpleNamespace(kl_loss_coef=0.0))
    cluster.train = _SFTWeights()
    with pytest.raises(SystemExit, match=r"holds no RL run state .*--model SFT_RUN_DIR/hf"):
        cluster.start(resume=True)


def test_auto_resume_continues_a_run_with_a_checkpoint_and_starts_one_without(tmp_path, monkeypatch):
    """--auto-resume (what a requeued slurm job passes): resume when train.ckpt_dir holds a checkpoint, else start
    fresh; a fresh start in a used dir would have dropped that checkpoint from --resume's reach."""
    import megatron_rl.train as train

    seen = []
    monkeypatch.setattr(train, "run", lambda cfg, resume=False: seen.append(resume) or {})
    monkeypatch.setattr("megatron_rl.observability.print_summary", lambda summary: None)
    monkeypatch.setattr("megatron_rl.observability.dump_stacks_on_sigusr1", lambda: None)
    args = ["--config", str(ROOT / "configs/quickstart.yaml"), "--auto-resume", f"train.log_dir={tmp_path / 'run'}"]
    assert train.main(args) == 0
    _earlier_run(tmp_path / "run")
    assert train.main(args) == 0
    (tmp_path / "run" / "ckpt" / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert train.main(args) == 2   # an unreadable pointer is reported, not silently started over
    assert seen == [False, True]


def test_a_requeued_slurm_job_passes_auto_resume(tmp_path):
    """launch/slurm_train.sbatch (RL, or SFT with --sft) on a restart (SLURM_RESTART_COUNT > 0) adds --auto-resume unless --resume is
    given; the first run passes the arguments as they are. The Ray cluster functions are stubbed."""
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "slurm_train.sbatch").write_text((ROOT / "launch" / "slurm_train.sbatch").read_text())
    (tmp_path / "launch" / "ray_cluster.sh").write_text(
        "PY=python\nray_cluster_setup() { :; }\nray_cluster_up() { :; }\nray_cluster_down() { :; }\n"
        "ray_job_submit() { echo \"ARGS: $*\"; }\n")

    def submitted(restarts: str, *args: str) -> str:
        env = {**os.environ, "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": restarts}
        # slurm starts the batch script in the submit dir (no --chdir)
        out = subprocess.run(["bash", str(tmp_path / "launch" / "slurm_train.sbatch"), *args], env=env,
                             cwd=tmp_path, capture_output=True, text=True, check=True).stdout
        return next(line for line in out.splitlines() if line.startswith("ARGS: "))

    assert submitted("0", "--config", "c.yaml") == "ARGS: python -m megatron_rl.train --config c.yaml"
    assert submitted("1", "--config", "c.yaml") == "ARGS: python -m megatron_rl.train --auto-resume --config c.yaml"
    assert submitted("2", "--resume", "x=1") == "ARGS: python -m megatron_rl.train --resume x=1"
    # `--sft` submits `python -m megatron_rl.sft` instead, and the same for a requeue
    assert submitted("0", "--sft", "--config", "c.yaml") == "ARGS: python -m megatron_rl.sft --config c.yaml"
    assert submitted("1", "--sft", "--config", "c.yaml") == \
        "ARGS: python -m megatron_rl.sft --auto-resume --config c.yaml"
    assert submitted("1", "--sft", "--resume") == "ARGS: python -m megatron_rl.sft --resume"
