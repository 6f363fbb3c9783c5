"""The RL driver end to end on a CPU: learning and the on-policy invariant through Ray, resume after a kill,
the async (one-step off-policy) mode in both placements. (The quickstart preset trains in
tests/sft/test_recipe.py's RL stage.)

Each test runs `python -m megatron_rl.train` as users do (a subprocess), on the toy task or the
bundled kernel tasks, and reads what the run leaves behind (metrics.jsonl, summary.json, checkpoints).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import REPO_ROOT

LOCAL_TP1 = ["cluster.backend=local", "cluster.actor_world_size=1", "actor.tp=1"]


def train(tmp_path: Path, name: str, *overrides: str, config="configs/toy_learn.yaml", resume=False,
          timeout=900) -> tuple[subprocess.CompletedProcess, Path]:
    log_dir = tmp_path / name
    cmd = [sys.executable, "-m", "megatron_rl.train", "--config", config, f"train.log_dir={log_dir}", *overrides]
    if resume:
        cmd.append("--resume")
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    return r, log_dir


def metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def ok(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_toy_learns_through_ray_and_starts_on_policy(tmp_path):
    """configs/toy_learn.yaml as shipped (Ray, two train ranks at TP=2, the engine over HTTP, weights synced
    every step): step 1's rollout and train logprobs come from the same weights (PPO-KL ~ 0), the reward rises,
    and the rollout side writes every trajectory to samples/."""
    r, log_dir = train(tmp_path, "ray", "train.steps=20", "agent.seed=11", "train.dump_samples=true", timeout=1200)
    summary = ok(r)
    rows = metrics(log_dir)
    rewards = [m["reward/mean"] for m in rows]
    assert summary["steps"] == 20 and len(rewards) == 20
    assert abs(rows[0]["train/ppo_kl"]) < 1e-4, rows[0]
    assert rows[0]["train/train_rollout_abs_logratio"] < 1e-3, rows[0]
    assert all(m["sync/seconds"] is not None for m in rows)
    assert summary["reward_first"] <= 0.3
    assert sum(rewards[-3:]) / 3 >= 0.6, rewards
    assert (log_dir / "tb").is_dir() and len(list((log_dir / "samples").iterdir())) == 20


@pytest.mark.slow
def test_resume_after_kill_continues_identically(tmp_path):
    """A run killed after its step-2 checkpoint and resumed equals an uninterrupted one, step for step, with
    every part of the loss on: the KL reference is the starting policy after the resume too (KL to it grows
    step by step; a reference taken at the resume would restart it near 0), PPO mini-batches (the clip acts),
    MirrorPop, TIS and dynamic sampling (decided in submission order, so the batch does not depend on timing)."""
    common = [*LOCAL_TP1, "train.steps=4", "train.save_interval=1", "agent.seed=3", "loss.kl_loss_coef=0.05",
              "actor.mini_batches=2", "loss.mirrorpop_delta=0.5", "loss.use_tis=true", "agent.dynamic_sampling=true"]
    r, killed = train(tmp_path, "killed", *common, "train.kill_at_step=2")
    assert r.returncode == 3, r.stderr[-3000:]
    assert (killed / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert [m["step"] for m in metrics(killed)] == [0, 1]

    summary = ok(train(tmp_path, "killed", *common, resume=True)[0])
    assert summary["steps"] == 4 and summary["steps_this_run"] == 2

    full = ok(train(tmp_path, "full", *common)[0])
    got, want = metrics(killed), metrics(tmp_path / "full")
    assert [m["step"] for m in got] == [0, 1, 2, 3]
    for a, b in zip(got, want):  # same weights, reference, data position and RNG after the resume: same run
        assert a["reward/mean"] == b["reward/mean"], (a, b)  # identical samples => identical weights
        for k in ("train/loss", "train/kl_loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (k, a, b)
    assert full["reward_last"] == summary["reward_last"]
    kl = [r["train/kl_loss"] for r in want]
    assert 0 < kl[0] < kl[1] < kl[2] < kl[3], kl
    assert all(r["train/mini_batches"] == 2 for r in want) and max(r["train/pg_clipfrac"] for r in want) > 0


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_async_is_one_step_off_policy(tmp_path, placement):
    """The async overlap: the weights reach the engine over the distributed transport (gloo here) or, colocated,
    the shared-memory one (the engine generating the next step beside the training actor, as on one GPU). Step 1
    is on-policy (colocated, steps 1 and 2: the first step runs synchronously so the room is measured after a train
    step), later steps train on rollouts from the previous weights."""
    # a checkpoint at step 2 is taken while step 3's rollout is in flight (it saves the state before that draw)
    summary = ok(train(tmp_path, "async", *LOCAL_TP1, f"cluster.placement={placement}", "cluster.async_rollout=true",
                       "train.steps=4", "agent.seed=3", "train.save_interval=2")[0])
    rows = metrics(tmp_path / "async")
    assert summary["steps"] == 4
    drift = [r["train/train_rollout_abs_logratio"] for r in rows]
    on_policy = 2 if placement == "colocated" else 1
    assert max(drift[:on_policy]) < 1e-3, drift         # first rollout(s): same weights as the trainer
    assert min(drift[on_policy:]) > 1e-3, drift         # then one optimizer step behind
    assert all(r["sync/seconds"] is not None for r in rows)
