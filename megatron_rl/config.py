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
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_rl.actor.actor import ActorConfig
from megatron_rl.algorithms import AdvantageConfig, BDRConfig, PolicyLossConfig
from megatron_rl.rollout.agent import AgentConfig
from verifier.config import VerifierConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """Configuration problems, reported before the run starts; `problems` lists each, naming its key."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else [p for p in problems if p]
        if len(self.problems) == 1 and not isinstance(problems, list):
            super().__init__(self.problems[0])
        else:
            super().__init__("invalid config:\n  - " + "\n  - ".join(self.problems))


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
    max_position_embeddings: int = 32768

    def hf_config(self, vocab_size: int):
        """The Qwen3Config of this model; `validate` checks it at the actor's TP/PP before it is built."""
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


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
    device_workers: int | None = None    # None: workers_per_device per GPU / cpu_device_workers on CPU
    workers_per_device: int = 3          # device workers sharing a GPU; they take turns to time
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
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            preset = OmegaConf.load(p)
        except Exception as e:  # noqa: BLE001 - YAML syntax errors are not OmegaConf's own type
            raise ConfigError(f"{path}: not a valid YAML config ({str(e).splitlines()[0]})") from None
        if not isinstance(preset, DictConfig):
            raise ConfigError(f"{path}: a config preset must be a mapping of sections, got a list")
        layers.append(preset)
    overrides = list(overrides or [])
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    try:
        merged = OmegaConf.merge(*layers, *([OmegaConf.from_dotlist(overrides)] if overrides else []))
        OmegaConf.resolve(merged)
        problems: list[str] = []
    except Exception:  # noqa: BLE001 - OmegaConf's errors, and YAML's for an override value such as '[1,'
        merged, problems = _merge_each(layers, overrides)
    if merged is not None:  # report what the good overrides still get wrong too: a run fails once, not per typo
        try:
            _apply_kernel_backend(merged)
        except ConfigError as e:
            problems += e.problems
        except OmegaConfBaseException as e:
            problems.append(_omegaconf_problem(e))
        section = _section_problems(merged)
        problems += section
        if not section:
            cfg: RLConfig = OmegaConf.to_object(merged)
            try:
                validate(cfg)
            except ConfigError as e:
                problems += e.problems
    if problems:
        raise ConfigError(problems)
    return cfg


def _omegaconf_problem(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    return f"{f'at {key!r}: ' if key else ''}{str(e).splitlines()[0]}"


def _merge_each(base: list, overrides: list[str]):
    """(merged config without the bad overrides, one problem per bad key). OmegaConf stops at the first
    bad key, so the preset and then each override are merged one by one to find all of them."""
    try:
        merged = OmegaConf.merge(*base)
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as e:
        return None, [_omegaconf_problem(e)]
    problems = []
    for o in overrides:
        try:
            candidate = OmegaConf.merge(merged, OmegaConf.from_dotlist([o]))
            OmegaConf.resolve(candidate)
        except OmegaConfBaseException as e:
            problems.append(f"{_omegaconf_problem(e)} (override {o!r})")
        except Exception as e:  # noqa: BLE001 - a YAML syntax error in the value
            problems.append(f"override {o!r}: cannot parse the value ({str(e).splitlines()[0]})")
        else:
            merged = candidate
    return merged, problems or ["the overrides do not merge with the preset"]


def _section_problems(merged) -> list[str]:
    """Build each section on its own: a section's own checks (``__post_init__``) then report one
    problem per section, prefixed with the section's key, instead of the first one found. (`validate`'s
    cross-section checks need every section built, so they run once these pass.)"""
    problems = []
    for f in dataclasses.fields(RLConfig):
        node = merged.get(f.name)
        if not isinstance(node, DictConfig):
            continue
        try:
            OmegaConf.to_object(node)
        except OmegaConfBaseException as e:
            problems.append(_omegaconf_problem(e))
        except (TypeError, ValueError) as e:
            problems += _named(f.name, str(e), node.keys())
    return problems


def _named(section: str, message: str, fields) -> list[str]:
    """A section's error message with the dotted key of the field it names ('max_turns must be >= 1'
    in `agent` -> 'agent.max_turns must be >= 1'); an aggregate 'invalid X: a; b' becomes one line per part."""
    body, n = re.subn(r"^invalid [\w ]+: ", "", message)
    parts = body.split("; ") if n else [body]
    out = []
    for part in parts:
        part = re.sub(r"^[A-Z]\w*Config\.", "", part)  # 'VerifierConfig.num_trials ...' names the field too
        head = re.match(r"[a-z_]\w*", part)
        out.append(f"{section}.{part}" if head and head.group(0) in fields else f"{section}: {part}")
    return out


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


# Lower bounds of the integer knobs (None passes: those fields are optional).
_AT_LEAST = {
    "train.steps": 1, "train.save_interval": 0, "train.max_failed_steps": 1, "train.max_oversample_rounds": 0,
    "train.kill_at_step": 0, "cluster.actor_world_size": 1, "cluster.rollout_gpus": 0, "cluster.num_cpus": 1,
    "rollout.num_engines": 1, "rollout.gpus_per_engine": 1, "rollout.sync_bucket_mb": 1,
    "farm.compile_workers": 1, "farm.device_workers": 1, "farm.workers_per_device": 1, "farm.cpu_device_workers": 1,
    "farm.max_in_flight": 1,
    "farm.max_retries": 0, "data.prompts_per_step": 1, "agent.max_prompt_tokens": 1, "agent.max_context_tokens": 2,
}


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def hf_model_config(path: str | os.PathLike, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                    sequence_parallel: bool = False):
    """The HF config of checkpoint dir `path`, checked against the Megatron spec at these parallel sizes
    (config.json readable, a supported model_type, heads / KV heads / FFN divisible by TP, layers by
    PP x VPP). Raises ValueError naming the field: a shape the actor cannot shard must fail before any
    process starts, not inside a rank. Reads config.json only (`check_sync` also checks the weights)."""
    from megatron_rl.bridge.hf_dir import load_hf_config
    from megatron_rl.bridge import get_bridge
    from megatron_rl.models import ParallelSizes

    hf = load_hf_config(path)
    get_bridge(hf).validate(ParallelSizes(tp, pp, vpp, sequence_parallel))
    return hf


def validate(cfg: RLConfig) -> None:
    """Every check that needs no running process; raises one ConfigError listing all problems."""
    from megatron_rl.models import ConfigMismatchError
    from megatron_rl.rollout.sampling import RequestSampling, SamplingParamError

    problems: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    a, c, r, d = cfg.actor, cfg.cluster, cfg.rollout, cfg.data
    for key, lo in _AT_LEAST.items():
        v = _get(cfg, key)
        need(v is None or v >= lo, f"{key} must be >= {lo}, got {v}")
    need(r.startup_timeout_s > 0, f"rollout.startup_timeout_s must be > 0, got {r.startup_timeout_s}")
    need(c.placement in ("colocated", "disaggregated"),
         f"cluster.placement must be 'colocated' or 'disaggregated', got {c.placement!r}")
    need(not (c.async_rollout and c.placement != "disaggregated"),
         "cluster.async_rollout needs cluster.placement=disaggregated (colocated phases cannot overlap)")
    need(c.backend in ("auto", "ray", "local"), f"cluster.backend must be auto|ray|local, got {c.backend!r}")
    need(not (c.backend == "local" and c.actor_world_size != 1),
         "cluster.backend=local runs one train rank in-process: set cluster.actor_world_size=1")
    if c.use_gpu and c.ray_address is None:
        import torch

        need(torch.cuda.is_available(), "cluster.use_gpu=true but no CUDA device is visible on this machine")
    par_ok = a.tp >= 1 and a.pp >= 1
    need(par_ok, f"actor.tp and actor.pp must be >= 1, got tp={a.tp} pp={a.pp}")
    if par_ok:
        need(c.actor_world_size % (a.tp * a.pp) == 0,
             f"cluster.actor_world_size={c.actor_world_size} is not divisible by actor.tp*actor.pp={a.tp * a.pp}")
        try:  # the actor's own checks (dtypes, batching, optimizer) would otherwise fire inside a Ray actor
            a.validate()
        except ValueError as e:
            problems += _named("actor", str(e), {f.name for f in dataclasses.fields(a)})
    try:  # the engine's own rules: a bad value here would fail every generate request of the run
        RequestSampling.from_sglang(cfg.agent.sampling.to_sglang())
        need(cfg.agent.sampling.max_new_tokens >= 1,
             f"agent.sampling.max_new_tokens must be >= 1, got {cfg.agent.sampling.max_new_tokens}")
    except SamplingParamError as e:
        problems.append(str(e).replace("sampling_params.", "agent.sampling.", 1))
    from megatron.core.transformer.transformer_config import TransformerConfig

    unknown = sorted(set(a.megatron) - {f.name for f in dataclasses.fields(TransformerConfig)})
    need(not unknown, f"actor.megatron: {unknown} are not megatron TransformerConfig fields")
    need(r.engine in ("embedded", "sglang"), f"rollout.engine must be 'embedded' or 'sglang', got {r.engine!r}")
    need(r.engine_dtype in ("float32", "bfloat16", "float16"),
         f"rollout.engine_dtype must be float32|bfloat16|float16, got {r.engine_dtype!r}")
    need(cfg.farm.backend in ("process", "ray"), f"farm.backend must be process|ray, got {cfg.farm.backend!r}")
    need(not (r.use_router and r.engine != "sglang"), "rollout.use_router needs rollout.engine=sglang")
    if cfg.advantage.group_size is not None:
        need(cfg.advantage.group_size == cfg.agent.group_size,
             f"advantage.group_size={cfg.advantage.group_size} differs from agent.group_size={cfg.agent.group_size}")
    need(cfg.agent.backend == cfg.verifier.backend,
         f"agent.backend={cfg.agent.backend!r} (what the prompt asks for) differs from "
         f"verifier.backend={cfg.verifier.backend!r} (what checks it)")

    hf, where = None, "model.tiny"
    par = f"actor.tp={a.tp}, actor.pp={a.pp}" + (f", actor.vpp={a.vpp}" if a.vpp else "")
    if cfg.model.path is not None:
        where = "model.path"
        mp = _abs(cfg.model.path)
        need(mp.is_dir(), f"model.path: {mp} is not a directory")
        if mp.is_dir():
            need((mp / "config.json").is_file(), f"model.path: {mp} has no config.json")
            need(any(mp.glob("*.safetensors")), f"model.path: {mp} has no *.safetensors weights")
            if (mp / "config.json").is_file() and par_ok:
                try:
                    hf = hf_model_config(mp, tp=a.tp, pp=a.pp, vpp=a.vpp, sequence_parallel=a.sequence_parallel)
                except ConfigMismatchError as e:
                    problems.append(f"model.path: {mp}: {e} ({par})")
                except ValueError as e:  # config.json unreadable, unsupported model_type
                    problems.append(f"model.path: {e}")
    elif par_ok:
        tm = cfg.model.tiny
        try:
            hf = tm.hf_config(tm.vocab_size if tm.vocab_size is not None else 1)
            from megatron_rl.bridge import get_bridge
            from megatron_rl.models import ParallelSizes

            get_bridge(hf).validate(ParallelSizes(a.tp, a.pp, a.vpp, a.sequence_parallel))
        except (ConfigMismatchError, ValueError, TypeError) as e:
            problems.append(f"model.tiny: the tiny model cannot be built at {par}: {e}")
            hf = None
    if cfg.model.tokenizer == "auto":
        cfg.model.tokenizer = cfg.model.path if cfg.model.path else "qwen3-offline"
    if cfg.model.tokenizer != "qwen3-offline":
        tp = _abs(cfg.model.tokenizer)
        need(tp.is_dir(), f"model.tokenizer: {tp} is not a directory (or use 'qwen3-offline')")
        if tp.is_dir():
            need(any((tp / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")),
                 f"model.tokenizer: {tp} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                 f"set model.tokenizer=qwen3-offline or point it at a tokenizer dir")
    elif d.tasks != "toy" and hf is not None and (cfg.model.path or cfg.model.tiny.vocab_size is not None):
        from megatron_rl.tokenizer import QWEN3_ADDED_TOKENS

        n_tok = QWEN3_ADDED_TOKENS[-1][0] + 1
        key = "model.path (config.json vocab_size)" if cfg.model.path else "model.tiny.vocab_size"
        need(hf.vocab_size >= n_tok, f"{key}={hf.vocab_size} is smaller than the qwen3-offline tokenizer's "
                                     f"{n_tok} tokens: prompts would hold ids the model has no embedding for")
    if hf is not None:
        ctx = int(r.sglang.get("context_length") or hf.max_position_embeddings)
        src = "rollout.sglang.context_length" if r.sglang.get("context_length") else f"{where} max_position_embeddings"
        ag = cfg.agent
        # SGLang refuses a request whose prompt + max_new_tokens reaches the context length, so the agent
        # bounds every turn one token below it
        need(ag.max_context_tokens is None or ag.max_context_tokens < ctx,
             f"agent.max_context_tokens={ag.max_context_tokens} must be < the engines' context length {ctx} ({src})")
        need(ag.max_prompt_tokens is None or ag.max_prompt_tokens < ctx - 1,
             f"agent.max_prompt_tokens={ag.max_prompt_tokens} leaves no room for a response within the engines' "
             f"context length {ctx} ({src})")
        if ag.max_context_tokens is None and not problems:
            ag.max_context_tokens = ctx - 1
    run_dir = cfg.run_dir
    existing = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    need(existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK),
         f"train.log_dir: cannot create {run_dir} ({existing} is not a writable directory)")
    if d.tasks != "toy":
        tasks = _abs(d.tasks)
        need(tasks.exists(), f"data.tasks: {tasks} does not exist")
        if tasks.exists():
            problems += _task_problems(tasks, d.levels)
    if cfg.agent.reward_fn not in (None, "eq2"):
        try:
            from megatron_rl.algorithms import load_callable
            load_callable(cfg.agent.reward_fn)
        except Exception as e:  # noqa: BLE001 - reported as a config problem
            problems.append(f"agent.reward_fn: {e}")
    if problems:
        raise ConfigError(problems)


def _task_problems(tasks: Path, levels: list[int]) -> list[str]:
    """The task set loads (it takes a tenth of a second) and holds tasks of the requested levels."""
    from verifier.tasks import load_task_set

    try:
        found = load_task_set(str(tasks))
    except Exception as e:  # noqa: BLE001 - TaskError, OSError, SyntaxError in a task file
        return [f"data.tasks: {tasks}: {e}"]
    have = sorted({t.level for t in found if t.level is not None})
    if not found:
        return [f"data.tasks: {tasks} holds no tasks"]
    if levels and not any(t.level in set(levels) for t in found):
        return [f"data.levels={list(levels)}: {tasks} has no task of those levels (it has levels {have})"]
    return []
