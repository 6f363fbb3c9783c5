"""Config validation: bad presets and overrides stop the run before anything starts, naming the key."""
import pytest

from megatron_rl.algorithms.rewards import TurnOutcome
from megatron_rl.config import ConfigError, REPO_ROOT, load_config
from megatron_rl.rollout.environment import KernelEnvironment
from verifier.types import Category, VerifyResult

QUICKSTART = str(REPO_ROOT / "configs" / "quickstart.yaml")


def test_presets_load(tmp_path):
    for name in ("quickstart", "toy_learn"):
        cfg = load_config(str(REPO_ROOT / "configs" / f"{name}.yaml"))
        assert cfg.train.steps >= 1
    # the real presets: single-turn warmup, then multi-turn; several PPO mini-batches; dynamic sampling
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    for name in ("qwen3_8b", "qwen3_32b"):
        with pytest.raises(ConfigError) as ei:   # a stand-in model dir: only its own problems are reported
            load_config(str(REPO_ROOT / "configs" / f"{name}.yaml"), [f"model.path={tmp_path}"])
        assert all(p.startswith("model.") for p in ei.value.problems), ei.value.problems
    from omegaconf import OmegaConf
    for name in ("qwen3_8b", "qwen3_32b"):
        preset = OmegaConf.load(REPO_ROOT / "configs" / f"{name}.yaml")
        assert 0 < preset.agent.single_turn_steps < preset.train.steps and preset.agent.max_turns == 3
        assert preset.actor.mini_batches > 1 and preset.agent.dynamic_sampling and preset.kernel_backend == "cuda"
    cfg = load_config(str(REPO_ROOT / "configs" / "toy_learn.yaml"), ["actor.tp=1", "cluster.actor_world_size=4"])
    assert cfg.actor.tp == 1 and cfg.cluster.actor_world_size == 4


@pytest.mark.parametrize("name", ["qwen3_8b", "qwen3_32b", "qwen3_5_9b", "qwen3_6_27b"])
def test_a_real_model_preset_without_a_model_is_refused_not_run_on_the_tiny_model(name):
    """These presets sized TP/PP, batches and memory for a released checkpoint; without --model they trained the tiny
    random model quietly (qwen3_8b, qwen3_5_9b) or failed on its head counts (the TP=4 presets)."""
    with pytest.raises(ConfigError) as ei:
        load_config(str(REPO_ROOT / "configs" / f"{name}.yaml"))
    assert any(p.startswith("model.path: this preset trains a real checkpoint: give it with --model") for p in
               ei.value.problems), ei.value.problems
    assert not any(p.startswith("model.tiny") for p in ei.value.problems)


def test_sft_checks_the_tiny_model_against_tp_as_rl_does(tmp_path):
    """SFT's config check let a tiny model TP could not split through to the ranks (README's sbatch example)."""
    from megatron_rl.sft import load_sft_config

    data = tmp_path / "sft.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    with pytest.raises(ConfigError) as ei:
        load_sft_config(str(REPO_ROOT / "configs" / "sft_tiny.yaml"),
                        [f"data.files=[{data}]", f"train.log_dir={tmp_path / 'run'}", "actor.tp=8",
                         "cluster.actor_world_size=8"])
    assert any(p.startswith("model.tiny: the tiny model cannot be built at actor.tp=8") for p in ei.value.problems), \
        ei.value.problems


@pytest.mark.parametrize("overrides,needle", [
    (["train.steps=0"], "train.steps"),
    (["actor.tp=2", "cluster.actor_world_size=3"], "actor_world_size=3"),
    (["rollout.engine=vllm"], "rollout.engine"),
    (["cluster.placement=mixed"], "cluster.placement"),
    (["cluster.async_rollout=true", "cluster.offload_actor=true"], "offload_actor"),
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


def test_model_without_tokenizer_files_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="no tokenizer files"):
        load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"), [f"model.path={tmp_path}"])
    cfg = load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"),
                      [f"model.path={tmp_path}", "model.tokenizer=qwen3-offline"])
    assert cfg.model.tokenizer == "qwen3-offline"


def test_kernel_backend_sets_prompt_and_verifier_backend():
    cfg = load_config(QUICKSTART, ["kernel_backend=musa"])
    assert cfg.kernel_backend == cfg.verifier.backend == "musa"
    with pytest.raises(ConfigError, match="kernel_backend"):
        load_config(QUICKSTART, ["kernel_backend=rocm"])


@pytest.mark.parametrize("override,needle", [
    ("agent.reward_params.lam=1.0", "reward_params"),          # eq. 2 parameters: verifier.reward
    ("advantage.group_size=4", "group_size"),                   # agent.group_size
    ("agent.backend=cuda", "backend"),                          # kernel_backend
    ("verifier.backend=cuda", "set kernel_backend instead"),
    ("train.dynamic_sampling=true", "dynamic_sampling"),        # agent.dynamic_sampling
    ("farm.size_profile=gpu", "size_profile"),                  # data.size_profile
])
def test_one_owner_per_value(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(QUICKSTART, [override])


def test_trained_score_and_farm_layout_come_from_their_one_owner(monkeypatch):
    """The kernel environment scores with verifier.reward (the verdict's own parameters) and hands the
    farm: keys to FarmConfig unchanged."""
    import verifier.farm

    made = {}
    monkeypatch.setattr(verifier.farm, "VerifierFarm", lambda cfg, layout: made.setdefault("farm", (cfg, layout)))
    cfg = load_config(QUICKSTART, ["verifier.reward.lam=2.0", "farm.compile_mode=process", "farm.recycle_after=7",
                                   "agent.dynamic_sampling=true", "data.size_profile=gpu"])
    env = KernelEnvironment.from_config(cfg)
    vcfg, layout = made["farm"]
    assert (layout.compile_mode, layout.recycle_after, layout.size_profile) == ("process", 7, None)
    assert vcfg.reward.lam == 2.0 and env.backend == vcfg.backend
    verdict = VerifyResult(task_id="t", category=Category.PASS, q=1.0, speedup=3.0)
    assert env.score(TurnOutcome(task=None, turn=1, response_text="", verdict=verdict)) == 1.0 + 2.0 * 2
