"""The RL run's configuration: OmegaConf structured dataclasses, YAML presets, dotted overrides.

`load_config(path, overrides)` merges a preset from `configs/` with ``key=value`` overrides onto the
typed schema below, then `validate()` checks everything that can be checked before any process
starts (files exist, parallel sizes fit, options are coherent). Every problem is reported at once,
each naming its key, so a bad launch fails in a second instead of after Ray is up.

Sections reuse the owning modules' dataclasses (actor, agent, algorithms, verifier) so a knob is
defined exactly once. `megatron:` (under `actor`) and `rollout.sglang` are passthrough dicts: extra
TransformerConfig fields and SGLang server arguments.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_rl.actor.actor import ActorConfig
from megatron_rl.algorithms import AdvantageConfig, BDRConfig, PolicyLossConfig
from megatron_rl.rollout.agent import AgentConfig
from verifier.config import VerifierConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A configuration problem, reported before the run starts."""


@dataclasses.dataclass
class TinyModelConfig:
    """A random Qwen3-architecture model built at start when `model.path` is unset."""

    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    init_seed: int = 0
    vocab_size: int | None = None  # None: the tokenizer's vocabulary


@dataclasses.dataclass
class ModelConfig:
    path: str | None = None              # HF checkpoint dir (config.json + safetensors); None -> tiny
    tokenizer: str = "auto"              # HF tokenizer dir | "qwen3-offline" (bundled Qwen3 BPE) |
                                         # "auto": model.path's tokenizer, else qwen3-offline
    tiny: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)


@dataclasses.dataclass
class ClusterConfig:
    backend: str = "auto"                # auto: Ray when importable | ray | local (one rank, in-process)
    placement: str = "colocated"         # colocated: train and rollout share GPUs | disaggregated
    async_rollout: bool = False          # one-step off-policy (disaggregated only)
    actor_world_size: int = 1            # train ranks = tp * pp * dp
    rollout_gpus: int = 0                # disaggregated: GPUs for engines (0 on CPU)
    use_gpu: bool | None = None          # None: use GPUs when CUDA is available
    ray_address: str | None = None       # None: start a local Ray cluster
    num_cpus: int | None = None          # local Ray cluster size (None: all cores)


@dataclasses.dataclass
class RolloutConfig:
    engine: str = "embedded"             # embedded | sglang
    num_engines: int = 1
    gpus_per_engine: int = 1
    engine_dtype: str = "float32"        # embedded engine weights (match the actor for exact logprobs)
    use_router: bool = False             # SGLang router in front of the engines (sglang only)
    router_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # router passthrough
    sglang: dict[str, Any] = dataclasses.field(default_factory=dict)  # server-arg passthrough
    startup_timeout_s: float = 600.0
    sync_bucket_mb: int = 512


@dataclasses.dataclass
class FarmSection:
    """Layout of the verifier farm (see verifier.farm.FarmConfig); the verdict is `verifier:`."""

    backend: str = "process"             # process: pools inside the rollout manager | ray: Ray actors
    compile_workers: int | None = None   # None: all cores
    device_workers: int | None = None    # None: one per GPU / cpu_device_workers on CPU
    cpu_device_workers: int = 1
    max_in_flight: int = 512
    max_retries: int = 2                 # infra retries
    size_profile: str | None = None      # e.g. "gpu": realistic task shapes from the manifest
    result_cache_path: str | None = None


@dataclasses.dataclass
class DataConfig:
    tasks: str = "verifier/tasks"        # task folder, manifest or list file; or "toy"
    levels: list[int] = dataclasses.field(default_factory=list)  # empty: all levels
    prompts_per_step: int = 8            # groups per step (batch = prompts_per_step * group_size)
    shuffle_seed: int = 0


@dataclasses.dataclass
class TrainConfig:
    steps: int = 10
    save_interval: int = 0               # 0: save only at the end
    log_dir: str = "runs/${name}"
    ckpt_dir: str | None = None          # None: <log_dir>/ckpt
    resume: bool = False
    dump_samples: bool = True
    max_failed_steps: int = 3            # consecutive skipped (NaN / failed) steps before giving up
    dynamic_sampling: bool = False       # drop zero-variance groups, oversample to fill the batch
    max_oversample_rounds: int = 4
    kill_at_step: int | None = None      # fault injection for resume tests: stop hard when this step starts


@dataclasses.dataclass
class RLConfig:
    name: str = "run"
    seed: int = 1234
    # Sets both agent.backend (what the prompt asks for) and verifier.backend (what checks it):
    # cpu | cuda | musa | auto (cuda when a GPU is visible, else cpu). None: set them separately.
    kernel_backend: str | None = None
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    loss: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    bdr: BDRConfig = dataclasses.field(default_factory=BDRConfig)
    verifier: VerifierConfig = dataclasses.field(default_factory=VerifierConfig)
    farm: FarmSection = dataclasses.field(default_factory=FarmSection)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    @property
    def run_dir(self) -> Path:
        return _abs(self.train.log_dir)

    @property
    def ckpt_root(self) -> Path:
        return _abs(self.train.ckpt_dir) if self.train.ckpt_dir else self.run_dir / "ckpt"


def _abs(p: str) -> Path:
    path = Path(os.path.expanduser(p))
    return path if path.is_absolute() else REPO_ROOT / path


def load_config(path: str | None, overrides: list[str] | None = None) -> RLConfig:
    """Preset YAML (optional) + dotted overrides -> a validated `RLConfig`."""
    schema = OmegaConf.structured(RLConfig)
    layers = [schema]
    try:
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {path}")
            layers.append(OmegaConf.load(p))
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"overrides must look like key=value, got {bad}")
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        OmegaConf.resolve(merged)
        _apply_kernel_backend(merged)
        cfg: RLConfig = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"invalid config{f' at {key!r}' if key else ''}: {str(e).splitlines()[0]}") from e
    except (TypeError, ValueError) as e:  # raised by a section's own __post_init__ checks
        raise ConfigError(f"invalid config: {e}") from e
    validate(cfg)
    return cfg


def _apply_kernel_backend(merged) -> None:
    kb = merged.get("kernel_backend")
    if kb is None:
        return
    if kb not in ("auto", "cpu", "cuda", "musa"):
        raise ConfigError(f"kernel_backend must be auto|cpu|cuda|musa, got {kb!r}")
    if kb == "auto":
        import torch

        kb = "cuda" if torch.cuda.is_available() else "cpu"
    merged.kernel_backend = kb
    merged.agent.backend = kb
    merged.verifier.backend = kb


def to_yaml(cfg: RLConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def validate(cfg: RLConfig) -> None:
    """Every check that needs no running process; raises one ConfigError listing all problems."""
    problems: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    a, c, r, d, t = cfg.actor, cfg.cluster, cfg.rollout, cfg.data, cfg.train
    need(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    need(t.save_interval >= 0, f"train.save_interval must be >= 0, got {t.save_interval}")
    need(c.placement in ("colocated", "disaggregated"),
         f"cluster.placement must be 'colocated' or 'disaggregated', got {c.placement!r}")
    need(not (c.async_rollout and c.placement != "disaggregated"),
         "cluster.async_rollout needs cluster.placement=disaggregated (colocated phases cannot overlap)")
    need(c.backend in ("auto", "ray", "local"), f"cluster.backend must be auto|ray|local, got {c.backend!r}")
    need(not (c.backend == "local" and c.actor_world_size != 1),
         "cluster.backend=local runs one train rank in-process: set cluster.actor_world_size=1")
    need(c.actor_world_size >= 1, f"cluster.actor_world_size must be >= 1, got {c.actor_world_size}")
    need(a.tp >= 1 and a.pp >= 1, f"actor.tp and actor.pp must be >= 1, got tp={a.tp} pp={a.pp}")
    if a.tp >= 1 and a.pp >= 1:
        need(c.actor_world_size % (a.tp * a.pp) == 0,
             f"cluster.actor_world_size={c.actor_world_size} is not divisible by actor.tp*actor.pp={a.tp * a.pp}")
    need(r.engine in ("embedded", "sglang"), f"rollout.engine must be 'embedded' or 'sglang', got {r.engine!r}")
    need(r.num_engines >= 1, f"rollout.num_engines must be >= 1, got {r.num_engines}")
    need(r.gpus_per_engine >= 1, f"rollout.gpus_per_engine must be >= 1, got {r.gpus_per_engine}")
    need(r.engine_dtype in ("float32", "bfloat16", "float16"),
         f"rollout.engine_dtype must be float32|bfloat16|float16, got {r.engine_dtype!r}")
    need(cfg.farm.backend in ("process", "ray"), f"farm.backend must be process|ray, got {cfg.farm.backend!r}")
    need(not (r.use_router and r.engine != "sglang"), "rollout.use_router needs rollout.engine=sglang")
    need(d.prompts_per_step >= 1, f"data.prompts_per_step must be >= 1, got {d.prompts_per_step}")
    if cfg.advantage.group_size is not None:
        need(cfg.advantage.group_size == cfg.agent.group_size,
             f"advantage.group_size={cfg.advantage.group_size} differs from agent.group_size={cfg.agent.group_size}")
    need(cfg.agent.backend == cfg.verifier.backend,
         f"agent.backend={cfg.agent.backend!r} (what the prompt asks for) differs from "
         f"verifier.backend={cfg.verifier.backend!r} (what checks it)")
    if cfg.model.path is not None:
        mp = _abs(cfg.model.path)
        need(mp.is_dir(), f"model.path: {mp} is not a directory")
        if mp.is_dir():
            need((mp / "config.json").is_file(), f"model.path: {mp} has no config.json")
            need(any(mp.glob("*.safetensors")), f"model.path: {mp} has no *.safetensors weights")
    if cfg.model.tokenizer == "auto":
        cfg.model.tokenizer = cfg.model.path if cfg.model.path else "qwen3-offline"
    if cfg.model.tokenizer != "qwen3-offline":
        tp = _abs(cfg.model.tokenizer)
        need(tp.is_dir(), f"model.tokenizer: {tp} is not a directory (or use 'qwen3-offline')")
        if tp.is_dir():
            need(any((tp / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")),
                 f"model.tokenizer: {tp} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                 f"set model.tokenizer=qwen3-offline or point it at a tokenizer dir")
    if d.tasks != "toy":
        tasks = _abs(d.tasks)
        need(tasks.exists(), f"data.tasks: {tasks} does not exist")
    if cfg.agent.reward_fn not in (None, "eq2"):
        try:
            from megatron_rl.algorithms import load_callable
            load_callable(cfg.agent.reward_fn)
        except Exception as e:  # noqa: BLE001 - reported as a config problem
            problems.append(f"agent.reward_fn: {e}")
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(p for p in problems if p))
