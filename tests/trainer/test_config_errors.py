"""Malformed trainer configs fail before Ray or any rank starts, naming every bad key at once.

Covers what the schema alone lets through: values out of range in every section (the sections' own
checks, the actor's, the engine's sampling rules), unknown passthrough fields, models the actor
cannot shard at the configured TP/PP (the tiny model and an HF checkpoint), tasks of missing levels,
and agent bounds that the engines' context length could never serve.
"""
import subprocess
import sys

import pytest

from megatron_rl.config import REPO_ROOT, ConfigError, load_config
from tests.bridge.tiny_qwen3 import tiny_config, tiny_model

QUICKSTART = str(REPO_ROOT / "configs" / "quickstart.yaml")


def _problems(overrides, preset=QUICKSTART):
    with pytest.raises(ConfigError) as ei:
        load_config(preset, overrides)
    return ei.value.problems


@pytest.mark.parametrize("override,needle", [
    ("train.max_failed_steps=0", "train.max_failed_steps must be >= 1"),
    ("train.kill_at_step=-1", "train.kill_at_step must be >= 0"),
    ("rollout.sync_bucket_mb=0", "rollout.sync_bucket_mb must be >= 1"),
    ("rollout.startup_timeout_s=-5", "rollout.startup_timeout_s must be > 0"),
    ("farm.max_retries=-1", "farm.max_retries must be >= 0"),
    ("farm.compile_workers=0", "farm.compile_workers must be >= 1"),
    ("cluster.num_cpus=0", "cluster.num_cpus must be >= 1"),
    ("agent.max_turns=0", "agent.max_turns must be >= 1"),
    ("agent.sampling.top_p=2", "agent.sampling.top_p must be in (0, 1]"),
    ("agent.sampling.temperature=-1", "agent.sampling.temperature must be a non-negative finite number"),
    ("agent.sampling.top_k=0", "agent.sampling.top_k must be -1 (disabled) or >= 1"),
    ("agent.sampling.max_new_tokens=0", "agent.sampling.max_new_tokens must be >= 1"),
    ("actor.lr=-1", "actor.lr=-1.0 must be > 0"),
    ("actor.max_tokens_per_gpu=0", "actor.max_tokens_per_gpu=0 must be >= 1"),
    ("actor.params_dtype=fp8", "actor.params_dtype='fp8'"),
    ("actor.megatron.no_such_field=1", "['no_such_field'] are not megatron TransformerConfig fields"),
    ("verifier.num_correct_trials=0", "verifier.num_correct_trials must be a positive integer"),
    ("bdr.capacity=-1", "bdr: BDR capacity must be >= 1"),
    ("data.levels=[9]", "data.levels=[9]"),
    ("agent.max_context_tokens=40000", "agent.max_context_tokens=40000 must be < the engines' context length 32768"),
    ("model.tiny.vocab_size=1000", "model.tiny.vocab_size=1000 is smaller than the qwen3-offline tokenizer"),
    ("actor.mini_batches=0", "actor.mini_batches=0 must be an int >= 1"),
    ("agent.single_turn_steps=-1", "agent.single_turn_steps must be >= 0"),
    ("agent.max_oversample_rounds=-1", "agent.max_oversample_rounds must be >= 0"),
    ("data.environment=no_such_module:Env", "data.environment"),
    ("farm.backend=k8s", "farm.backend must be process|ray"),
    ("data.size_profile=fit:0", "data.size_profile: size profile 'fit:0': the budget must be positive"),
])
def test_out_of_range_values_name_their_key(override, needle):
    problems = _problems([override])
    assert any(needle in p for p in problems), problems


def test_every_bad_key_is_reported_at_once():
    problems = _problems(["trainn.steps=3", "train.stepz=1", "train.steps=abc", "actor.lr=-1", "farm.max_retries=-1",
                          "actor.tp=3", "cluster.actor_world_size=3"])
    text = "\n".join(problems)
    for needle in ("'trainn'", "'train.stepz'", "'train.steps'", "actor.lr", "farm.max_retries", "tp=3"):
        assert needle in text, (needle, problems)
    # sections whose own checks fail are all named (the cross-section checks wait for them)
    text = "\n".join(_problems(["agent.max_turns=0", "bdr.capacity=0", "verifier.num_timing_trials=0"]))
    assert "agent.max_turns" in text and "bdr:" in text and "verifier.num_timing_trials" in text


@pytest.mark.parametrize("overrides,needle", [
    (["actor.tp=3", "cluster.actor_world_size=3"], "num_attention_heads=4 is not divisible by tp=3"),
    (["actor.pp=3", "cluster.actor_world_size=3"], "num_hidden_layers=4 is not divisible by pp=3"),
    (["actor.tp=4", "cluster.actor_world_size=4", "model.tiny.num_attention_heads=8",
      "model.tiny.num_key_value_heads=4"], "linear_num_key_heads=2 is not divisible by tp=4"),
    (["actor.attention_backend=local"], "cannot keep them apart"),
    (["actor.tp=2", "cluster.actor_world_size=2", "model.tiny.intermediate_size=127"],
     "intermediate_size=127 is not divisible by tp=2"),
    (["model.tiny.head_dim=15"], "head_dim=15: RoPE needs an even head_dim"),
])
def test_a_tiny_model_the_actor_cannot_shard_names_the_field(overrides, needle):
    problems = _problems(overrides)
    assert any(p.startswith(("model.tiny", "actor.attention_backend")) and needle in p for p in problems), problems


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "model"
    tiny_model(tiny_config(heads=4, kv_heads=1, vocab=250)).save_pretrained(path)
    return path


def test_a_checkpoint_the_actor_cannot_shard_names_the_field(hf_dir):
    problems = _problems([f"model.path={hf_dir}", "model.tokenizer=qwen3-offline", "actor.tp=8",
                          "cluster.actor_world_size=8"])
    assert any(p.startswith("model.path") and "num_attention_heads=4 is not divisible by tp=8" in p
               and "actor.tp=8" in p for p in problems), problems
    # at a TP it fits, what is left is named too: the tokenizer's ids and the preset's prompts do not fit it
    problems = _problems([f"model.path={hf_dir}", "model.tokenizer=qwen3-offline"])
    assert any("vocab_size)=250" in p for p in problems) and any("agent.max_prompt_tokens" in p for p in problems)


def test_an_unsupported_model_type_is_named(hf_dir, tmp_path):
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text((hf_dir / "config.json").read_text().replace('"qwen3"', '"llama"'))
    (other / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    problems = _problems([f"model.path={other}", "model.tokenizer=qwen3-offline"])
    assert any("model_type='llama' is not supported" in p for p in problems), problems


def test_bad_preset_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [1, 2\n")
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="not a valid YAML config"):
        load_config(str(broken))
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(str(listed))
    assert any("cannot parse the value" in p for p in _problems(["train.steps=[1,"]))
    bare = tmp_path / "bare.yaml"   # OmegaConf alone reads this as {'traine': None}: an unknown key, no file named
    bare.write_text("traine\n")
    with pytest.raises(ConfigError, match=f"{bare}: a config preset must be a mapping of sections, got a str"):
        load_config(str(bare))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("traine:\n  steps: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(unknown))
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith(f"{unknown}: at 'traine': Key 'traine' not in 'RLConfig'"), e.value.problems
    empty = tmp_path / "empty.yaml"   # all comments: the defaults
    empty.write_text("# nothing set yet\n")
    assert load_config(str(empty)) == load_config(None)


def test_agent_context_defaults_to_what_the_engines_serve():
    """SGLang refuses prompt + max_new_tokens >= context length: unset, the agent's bound is one below it."""
    cfg = load_config(QUICKSTART)
    assert cfg.agent.max_context_tokens == cfg.model.tiny.max_position_embeddings - 1
    cfg = load_config(QUICKSTART, ["rollout.sglang.context_length=16384"])
    assert cfg.agent.max_context_tokens == 16383


def _train(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl.train", "--config", "configs/quickstart.yaml", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_cli_fails_fast_on_bad_overrides(tmp_path):
    """`python -m megatron_rl.train` exits 2 before starting anything, naming every bad key (one subprocess:
    in-process checks of the same path are in test_main_fails_fast_...)."""
    log_dir = tmp_path / "run"
    r = _train("train.stepz=1", "train.steps=abc", "farm.max_retries=-1", "cluster.placement=nowhere",
               f"train.log_dir={log_dir}")
    assert r.returncode == 2, r.stderr[-2000:]
    for needle in ("train.stepz", "train.steps", "farm.max_retries", "cluster.placement"):
        assert needle in r.stderr
    assert "Traceback" not in r.stderr and "[run]" not in r.stdout and not log_dir.exists()


def test_main_fails_fast_on_a_missing_model_or_an_unshardable_shape(tmp_path, capsys, monkeypatch):
    from megatron_rl.train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    log_dir = tmp_path / "run"
    assert main(["--config", QUICKSTART, "--model", str(tmp_path / "no-such-model"), f"train.log_dir={log_dir}"]) == 2
    err = capsys.readouterr().err
    assert "model.path" in err and "is not a directory" in err
    assert main(["--config", QUICKSTART, "actor.tp=3", "cluster.actor_world_size=3", f"train.log_dir={log_dir}"]) == 2
    err = capsys.readouterr().err
    assert "model.tiny" in err and "not divisible by tp=3" in err
    assert not log_dir.exists()
