"""The reduced CPU recipe end to end (configs/recipe_cpu_ci.yaml): generated tasks -> compact teacher data -> SFT of
the tiny Qwen3.5 hybrid -> RFT -> RL -> every stage evaluated on held-out tasks with the real CPU verifier.

It asserts the stage ordering of the issue (Pass@8 0 at random init, >= 0.5 after SFT, RFT not lower) and the
hand-offs: the final model is an HF export with its tokenizer and chat template that `megatron_rl.evaluate` loads,
every evaluation wrote its JSON, markdown and HTML reports, and RFT reported its clusters."""
import json
import os
import subprocess
import sys

import pytest

from megatron_rl.config import REPO_ROOT


@pytest.mark.slow
def test_reduced_recipe_orders_the_stages(tmp_path):
    work = tmp_path / "recipe"
    # the stages run one after another, so each may use every core (tests/run.sh sets OMP_NUM_THREADS=1)
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    r = subprocess.run([sys.executable, "-m", "megatron_rl.recipe", "--config", "configs/recipe_cpu_ci.yaml",
                        f"workdir={work}"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    st = result["stages"]
    assert list(st) == ["init", "sft", "rft", "rl"] and result["heldout_tasks"] == 2
    assert st["init"]["pass_at_8"] == 0.0
    assert st["sft"]["pass_at_8"] >= 0.5, st
    assert st["rft"]["pass_at_8"] >= st["sft"]["pass_at_8"], st
    assert st["rl"]["pass_at_8"] is not None
    final = result["model"]
    assert final == str(work / "final_hf")
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(final))
    for stage in st:
        out = work / "eval" / stage
        assert {"summary.json", "report.md", "report.html", "results.jsonl"} <= set(os.listdir(out)), stage
    # the RL stage ran the quickstart preset: its step dumped every trajectory with its verdicts
    rl_samples = (work / "rl" / "samples" / "step_000000.jsonl").read_text().splitlines()
    assert len(rl_samples) == 2 * 2 and all(json.loads(s)["turns"][0]["category"] for s in rl_samples)
    rl_eval = json.loads((work / "eval" / "rl" / "summary.json").read_text())
    assert rl_eval["model"] == final and rl_eval["scored_tasks"] == 2
    rft = result["rft"]
    assert rft["targets"] >= 1 and rft["clusters_per_prompt_before"] >= rft["clusters_per_prompt_after"] >= 1
    # each prompt variant repeats a verified teacher answer, and SFT trained on them with the teacher's rows
    variants = result["prompt_variants"]
    assert variants["rows"] >= 1 and variants["rows"] + sum(variants["skipped"].values()) == variants["tasks"]
    teacher_answers = {json.loads(r)["sample_id"] for r in (work / "data" / "sft.jsonl").read_text().splitlines()}
    assert all(json.loads(r)["verified_on"] in teacher_answers
               for r in (work / "data" / "variants.jsonl").read_text().splitlines())
    sft_files = json.loads((work / "sft" / "summary.json").read_text())["data"]["files"]
    assert sft_files == {str(work / "data" / "sft.jsonl"): 6, str(work / "data" / "variants.jsonl"): variants["rows"]}
    # RFT replays the SFT run's whole mix beside its own targets
    rft_files = json.loads((work / "rft" / "summary.json").read_text())["data"]["files"]
    assert rft_files == {**sft_files, str(work / "data" / "rft.jsonl"): rft["targets"]}
    table = (work / "recipe.md").read_text()
    assert all(f"| {s} | L1 |" in table for s in st)


def test_recipe_config_names_a_bad_tokenizer_setting():
    from megatron_rl.config import ConfigError
    from megatron_rl.recipe import load_recipe_config

    assert load_recipe_config(None, ["tokenizer_vocab=2048"]).tokenizer_merge_within == "lines"
    with pytest.raises(ConfigError, match="tokenizer_vocab must be 0"):
        load_recipe_config(None, ["tokenizer_vocab=100"])
    with pytest.raises(ConfigError, match="tokenizer_merge_within"):
        load_recipe_config(None, ["tokenizer_vocab=2048", "tokenizer_merge_within=sentences"])
    with pytest.raises(ConfigError, match="prompt_variants must be >= 0"):
        load_recipe_config(None, ["prompt_variants=-1"])
