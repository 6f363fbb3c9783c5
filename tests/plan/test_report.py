"""Throughput figures the trainer logs (observability.throughput_scalars / RunLogger) and the report built
from a run dir's metrics.jsonl (markdown + PNG plots)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from megatron_rl import plan as P
from megatron_rl.observability import RunFacts, RunLogger, throughput_scalars

ROOT = Path(__file__).resolve().parents[2]


def _row(step: int, tokens_per_s: float = 1000.0) -> dict:
    return {"step": step, "reward/mean": 0.1 * step, "pass_rate/any_turn": 0.05 * step, "perf/tokens_per_s": tokens_per_s,
            "response/len_mean": 100.0, "turns/mean": 2.0,
            "time/rollout": 2.0, "time/logprobs": 0.5, "time/train": 1.0, "time/sync": 0.5}


def test_throughput_in_nemo_rl_units():
    shape = P.known_shape("qwen3-8b")
    facts = RunFacts(train_gpus=2, rollout_gpus=2, trajectories_per_step=8, shape=shape, peak_tflops=989.0)
    out = throughput_scalars(_row(0), facts)
    assert out["perf/step_tokens"] == pytest.approx(4000)               # 1000 tokens/s over a 4 s step
    assert out["perf/e2e_tokens_per_s_per_gpu"] == pytest.approx(4000 / 4 / 2)
    assert out["perf/train_tokens_per_s_per_gpu"] == pytest.approx(4000 / 1.0 / 2)
    assert out["perf/logprob_tokens_per_s_per_gpu"] == pytest.approx(4000 / 0.5 / 2)
    assert out["perf/rollout_tokens_per_s_per_gpu"] == pytest.approx(100 * 2 * 8 / 2.0 / 2)
    flops = 4000 * shape.train_flops_per_token(4000 / 8)
    assert out["perf/mfu"] == pytest.approx(flops / 1.0 / 2 / 989e12)
    disagg = RunFacts(train_gpus=2, rollout_gpus=6, trajectories_per_step=8)
    out = throughput_scalars(_row(0), disagg)
    assert out["perf/e2e_tokens_per_s_per_gpu"] == pytest.approx(4000 / 4 / 8) and "perf/mfu" not in out
    assert throughput_scalars({"step": 0, "time/train": 1.0}, disagg) == {}
    exact = throughput_scalars({**_row(0), "rollout/tokens_generated": 1200.0}, disagg)
    assert exact["perf/rollout_tokens_per_s_per_gpu"] == pytest.approx(1200 / 2.0 / 6)
    # async: the rollout phase is only the wait training did not hide; the rollout's own seconds are the divisor
    hidden = throughput_scalars({**_row(0), "rollout/tokens_generated": 1200.0, "rollout/seconds": 1.5,
                                 "time/rollout": 1e-5}, disagg)
    assert hidden["perf/rollout_tokens_per_s_per_gpu"] == pytest.approx(1200 / 1.5 / 6)


def _run_dir(tmp_path: Path, rows: list[dict]) -> Path:
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("name: t\ncluster: {placement: colocated, actor_world_size: 2}\n"
                                     "data: {prompts_per_step: 2}\nagent: {group_size: 4}\nmodel: {path: null}\n")
    (run / "model" / "config.json").write_text(json.dumps({**P.KNOWN_SHAPES["qwen3.5-9b"], "num_hidden_layers": 4,
                                                           "layer_types": ["linear_attention"] * 3 + ["full_attention"]}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"steps": len(rows), "reward_first": 0.0, "reward_last": 0.5,
                                                  "wall_seconds": 12.0}))
    return run


def test_run_logger_writes_per_gpu_throughput(tmp_path):
    run = _run_dir(tmp_path, [])
    (run / "metrics.jsonl").unlink()
    logger = RunLogger(run, tensorboard=False, dump_samples=False)
    r = _row(0)
    logger.log_step(0, {k: v for k, v in r.items() if not k.startswith("time/") and k != "step"},
                    {k[5:]: v for k, v in r.items() if k.startswith("time/")}, 1)
    logger.close()
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["perf/train_tokens_per_s_per_gpu"] == pytest.approx(2000)
    assert logger.facts.shape.n_gdn == 3 and logger.facts.trajectories_per_step == 8


def test_report_markdown_and_plots(tmp_path):
    rows = [_row(i, 1000.0 + 100 * i) for i in range(6)]
    rows[3]["time/train"] = 3.0                                        # one slow step shows in p95
    rows[5]["time/save"] = 4.0                                         # a phase of one step only
    run = _run_dir(tmp_path, rows)
    p = subprocess.run([sys.executable, "-m", "megatron_rl.report", str(run)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    md = Path(out["report"]).read_text()
    assert out["steps"] == 6 and "steps 3-6, after 2 warm-up" in md
    assert "| train | 1.500 | 1.000 | 3.000 |" in md                     # mean/p50/p95 over steps 3-6
    assert "| rollout (generated) | 400.0 |" in md                      # 100 tokens x 2 turns x 8 / 2 s / 2 GPUs
    assert "| save | 1.000 | 0.000 | 4.000 | 18.2 % |" in md            # 0 s on the steps without it
    assert "qwen" not in md or "B params" in md
    names = sorted(Path(x).name for x in out["plots"])
    assert names == ["reward.png", "step_time.png", "throughput.png"]   # CPU run: no MFU plot
    for x in out["plots"]:
        img = Image.open(x)
        assert img.size == (900, 420) and len(set(img.convert("RGB").getdata())) > 10
    bars = Image.open(run / "report" / "step_time.png").convert("RGB")
    assert (31, 119, 180) in set(bars.getdata())                         # the first phase's colour is drawn


@pytest.mark.parametrize("content, message", [
    (None, "metrics.jsonl not found"),
    ("", "has no steps yet"),
    ('{"step": 0}\nnot json\n', "metrics.jsonl:2: not JSON"),
])
def test_report_bad_run_dirs_are_named(tmp_path, content, message):
    run = tmp_path / "r"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    p = subprocess.run([sys.executable, "-m", "megatron_rl.report", str(run)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "megatron_rl.report", str(tmp_path / "missing")], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "run dir not found" in p.stderr
