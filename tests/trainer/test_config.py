"""Config validation: bad presets and overrides stop the run before anything starts, naming the key."""
import subprocess
import sys

import pytest

from megatron_rl.config import ConfigError, REPO_ROOT, load_config


def test_presets_load():
    for name in ("quickstart", "toy_learn"):
        cfg = load_config(str(REPO_ROOT / "configs" / f"{name}.yaml"))
        assert cfg.train.steps >= 1
    cfg = load_config(str(REPO_ROOT / "configs" / "toy_learn.yaml"), ["actor.tp=1", "cluster.actor_world_size=4"])
    assert cfg.actor.tp == 1 and cfg.cluster.actor_world_size == 4


@pytest.mark.parametrize("overrides,needle", [
    (["train.steps=0"], "train.steps"),
    (["actor.tp=2", "cluster.actor_world_size=3"], "actor_world_size=3"),
    (["rollout.engine=vllm"], "rollout.engine"),
    (["cluster.placement=mixed"], "cluster.placement"),
    (["cluster.async_rollout=true"], "async_rollout"),
    (["model.path=/nonexistent/model"], "model.path"),
    (["data.tasks=/nonexistent/tasks"], "data.tasks"),
    (["agent.reward_fn=no_such_module:fn"], "agent.reward_fn"),
    (["advantage.group_size=3"], "group_size"),
    (["actor.tp=abc"], "actor.tp"),
    (["trainn.steps=3"], "trainn"),
    (["train.steps"], "key=value"),
])
def test_bad_config_names_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"), overrides)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.yaml")


def test_cli_reports_config_error_before_starting():
    r = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--config", "configs/quickstart.yaml",
                        "cluster.placement=nowhere", "train.steps=-1"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "cluster.placement" in r.stderr and "train.steps" in r.stderr


def test_model_without_tokenizer_files_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="no tokenizer files"):
        load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"), [f"model.path={tmp_path}"])
    cfg = load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"),
                      [f"model.path={tmp_path}", "model.tokenizer=qwen3-offline"])
    assert cfg.model.tokenizer == "qwen3-offline"


def test_kernel_backend_sets_prompt_and_verifier_backend():
    cfg = load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"), ["kernel_backend=musa"])
    assert cfg.agent.backend == cfg.verifier.backend == "musa"
    with pytest.raises(ConfigError, match="kernel_backend"):
        load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"), ["kernel_backend=rocm"])
