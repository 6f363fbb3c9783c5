"""The RL run's configuration: OmegaConf structured dataclasses, YAML presets, dotted overrides.

`load_config(path, overrides)` merges a preset from `configs/` with ``key=value`` overrides onto the
typed schema below, then `validate()` checks everything that can be checked before any process
starts (files exist, parallel sizes fit, options are coherent). Every problem is reported at once,
each naming its key, so a bad launch fails in a second instead of after Ray is up.

Sections reuse the owning modules' dataclasses (actor, agent, algorithms, verifier; `farm:` is built
from verifier.farm.FarmConfig's own fields) so every value has one owner: the group size is
``agent.group_size``, the eq. 2 reward parameters ``verifier.reward``, the kernel backend (what prompts ask
for and what the verifier checks) ``kernel_backend``, dynamic sampling ``agent.dynamic_sampling``.
`megatron:` (under `actor`) and `rollout.sglang` are passthrough dicts: extra TransformerConfig fields
and SGLang server arguments.
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_rl.actor.actor import ActorConfig
from megatron_rl.algorithms import AdvantageConfig, BDRConfig, PolicyLossConfig
from megatron_rl.presets import ConfigError, load_preset  # noqa: F401 - every launcher imports them from here
from megatron_rl.rollout.agent import AgentConfig
from verifier.config import VerifierConfig
from verifier.farm import FarmConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class TinyModelConfig:
    """A random model built at start when `model.path` is unset: the Qwen3.5 hybrid (`arch: qwen3_5`, Gated
    DeltaNet layers with a gated-attention layer every `full_attention_interval`-th) or dense Qwen3."""

    arch: str = "qwen3_5"                  # qwen3_5 (hybrid) | qwen3 (dense)
    hidden_size: int = 64
    num_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    init_seed: int = 0
    vocab_size: int | None = None  # None: the tokenizer's vocabulary
    max_position_embeddings: int = 32768
    # Gated DeltaNet (qwen3_5 only)
    full_attention_interval: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4

    def hf_config(self, vocab_size: int):
        """The HF config of this model; `validate` checks it at the actor's TP/PP before it is built."""
        from transformers import Qwen3_5TextConfig, Qwen3Config

        common = dict(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings)
        if self.arch == "qwen3":
            return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        if self.arch != "qwen3_5":
            raise ValueError(f"model.tiny.arch={self.arch!r}: use qwen3_5 (the hybrid) or qwen3 (dense)")
        if self.full_attention_interval < 1:
            raise ValueError(f"model.tiny.full_attention_interval={self.full_attention_interval} must be >= 1")
        layer_types = ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                       for i in range(self.num_layers)]
        return Qwen3_5TextConfig(
            **common, layer_types=layer_types, linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads, linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim, linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})


@dataclasses.dataclass
class ModelConfig:
    path: str | None = None              # HF checkpoint dir (config.json + safetensors); None -> tiny
    tokenizer: str = "auto"              # HF tokenizer dir | "qwen3-offline" (bundled Qwen3 BPE) |
                                         # "auto": model.path's tokenizer, else qwen3-offline
    tiny: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)
    path_required: bool = False          # a preset for a real model: no model.path is an error, not the tiny model


@dataclasses.dataclass
class ClusterConfig:
    backend: str = "auto"                # auto: Ray when importable | ray | local (one rank, in-process)
    placement: str = "colocated"         # colocated: train and rollout share GPUs | disaggregated
    # one-step off-policy: the next step's rollout runs while this step trains. Colocated, the engines and the
    # actor then stay resident together (no offload; the engines' cache is released only around weight syncs)
    async_rollout: bool = False
    # colocated: move the actor's params, grads and optimizer state to pinned host memory while the engines
    # generate (and the engines' weights to the host while it trains). None (auto): only when the engines' cache
    # for a step's requests would not fit beside them; true also when training needs the engines' weight room
    offload_actor: bool | None = None
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


# FarmConfig fields that are not `farm:` keys: size_profile is `data.size_profile` (the prompts must show
# the shapes the farm runs, so the environment applies it to the tasks); the agent needs a blocking submit.
_FARM_FIELDS_NOT_IN_CONFIG = ("size_profile", "block_when_full")


def _farm_section() -> type:
    """The `farm:` section: every plain-valued field of verifier.farm.FarmConfig (same names, defaults and
    checks, so a farm setting has one owner) plus ``backend``, where the farm runs."""
    hints = typing.get_type_hints(FarmConfig)
    fields = []
    for f in dataclasses.fields(FarmConfig):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if f.name in _FARM_FIELDS_NOT_IN_CONFIG or len(args) != 1 or args[0] not in (int, float, str, bool):
            continue
        optional = type(None) in typing.get_args(hints[f.name])
        fields.append((f.name, typing.Optional[args[0]] if optional else args[0], dataclasses.field(default=f.default)))
    # process: pools inside the rollout manager | ray: compile and device workers as Ray actors
    fields.append(("backend", str, dataclasses.field(default="process")))

    def farm_config_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "backend"}

    def validate(self) -> None:
        if self.backend not in ("process", "ray"):
            raise ValueError(f"backend must be process|ray, got {self.backend!r}")
        FarmConfig(**self.farm_config_kwargs()).validate()

    return dataclasses.make_dataclass("FarmSection", fields, namespace={
        "farm_config_kwargs": farm_config_kwargs, "validate": validate,
        "__doc__": "Layout of the verifier farm: verifier.farm.FarmConfig's fields + backend."})


FarmSection = _farm_section()


@dataclasses.dataclass
class DataConfig:
    environment: str = "kernel"          # kernel | toy | pkg.module:Class (see megatron_rl.rollout.environment)
    tasks: str = "verifier/tasks"        # kernel tasks: folder, manifest or list file
    levels: list[int] = dataclasses.field(default_factory=list)  # empty: all levels
    size_profile: str | None = None      # e.g. "gpu": realistic task shapes from the manifest; fit[:MiB[:GFLOP]]
    prompts_per_step: int = 8            # groups per step (batch = prompts_per_step * agent.group_size)
    shuffle_seed: int = 0


@dataclasses.dataclass
class TrainConfig:
    steps: int = 10
    save_interval: int = 0               # every this many steps (0: none before the end)
    save_final: bool = True              # false: not even at the end (benchmarks; the run cannot be resumed)
    log_dir: str = "runs/${name}"
    ckpt_dir: str | None = None          # None: <log_dir>/ckpt
    resume: bool = False
    dump_samples: bool = True
    max_failed_steps: int = 3            # consecutive skipped (NaN / failed) steps before giving up
    kill_at_step: int | None = None      # fault injection for resume tests: stop hard when this step starts


@dataclasses.dataclass
class RLConfig:
    name: str = "run"
    seed: int = 1234
    # What the prompts ask for and what the verifier checks (it sets verifier.backend):
    # cpu | cuda | musa | auto (cuda when a GPU is visible, else cpu)
    kernel_backend: str = "auto"
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
        return abs_path(self.train.log_dir)

    @property
    def ckpt_root(self) -> Path:
        return abs_path(self.train.ckpt_dir) if self.train.ckpt_dir else self.run_dir / "ckpt"


def abs_path(p: str) -> Path:
    """A config path: ~ expanded, relative ones from the repository root."""
    path = Path(os.path.expanduser(p))
    return path if path.is_absolute() else REPO_ROOT / path


def load_config(path: str | None, overrides: list[str] | None = None) -> RLConfig:
    """Preset YAML (optional) + dotted overrides -> a validated `RLConfig`."""
    schema = OmegaConf.structured(RLConfig)
    layers = [schema]
    if path is not None:
        layers.append(load_preset(path))
    overrides = list(overrides or [])
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    try:
        merged = OmegaConf.merge(*layers, *([OmegaConf.from_dotlist(overrides)] if overrides else []))
        OmegaConf.resolve(merged)
        problems: list[str] = []
    except Exception:  # noqa: BLE001 - OmegaConf's errors, and YAML's for an override value such as '[1,'
        merged, problems = _merge_each(layers, overrides, source=path)
    if merged is not None:  # report what the good overrides still get wrong too: a run fails once, not per typo
        try:
            _apply_kernel_backend(merged, _sets_verifier_backend(layers[1:], overrides))
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


def _merge_each(base: list, overrides: list[str], source: str | os.PathLike | None = None):
    """(merged config without the bad overrides, one problem per bad key). OmegaConf stops at the first
    bad key, so the preset and then each override are merged one by one to find all of them. A problem of
    the preset names its file (``source``)."""
    try:
        merged = OmegaConf.merge(*base)
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as e:
        return None, [f"{f'{source}: ' if source else ''}{_omegaconf_problem(e)}"]
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


def _sets_verifier_backend(presets: list, overrides: list[str]) -> bool:
    return any(OmegaConf.select(p, "verifier.backend") is not None for p in presets) or \
        any(o.split("=", 1)[0].strip() == "verifier.backend" for o in overrides)


def _apply_kernel_backend(merged, verifier_backend_set: bool) -> None:
    """``kernel_backend`` is the one owner of the backend: it sets ``verifier.backend``."""
    if verifier_backend_set:
        raise ConfigError("verifier.backend: set kernel_backend instead (it is both what the prompts ask for "
                          "and what the verifier checks)")
    kb = merged.get("kernel_backend")
    if kb not in ("auto", "cpu", "cuda", "musa"):
        raise ConfigError(f"kernel_backend must be auto|cpu|cuda|musa, got {kb!r}")
    if kb == "auto":
        import torch

        kb = "cuda" if torch.cuda.is_available() else "cpu"
    merged.kernel_backend = kb
    merged.verifier.backend = kb


def to_yaml(cfg: RLConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# Lower bounds of the integer knobs (None passes: those fields are optional).
_AT_LEAST = {
    "train.steps": 1, "train.save_interval": 0, "train.max_failed_steps": 1,
    "train.kill_at_step": 0, "cluster.actor_world_size": 1, "cluster.rollout_gpus": 0, "cluster.num_cpus": 1,
    "rollout.num_engines": 1, "rollout.gpus_per_engine": 1, "rollout.sync_bucket_mb": 1,
    "farm.cpu_device_workers": 1, "farm.recycle_after": 1, "data.prompts_per_step": 1, "agent.max_prompt_tokens": 1, "agent.max_context_tokens": 2,
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


def model_problems(model: ModelConfig, a, par_ok: bool) -> tuple[list[str], Any, str]:
    """(problems, the HF config or None, which key it came from) of the model a run trains, checked against the
    actor's TP/PP (``par_ok``: those are valid numbers): `model.path` must be an HF dir with weights whose shape the
    actor can shard; without it, `model.tiny` must be buildable at that TP/PP, and a preset for a real model
    (`model.path_required`) refuses to fall back to it. RL (`validate`) and SFT (`sft.validate_sft`) check alike."""
    from megatron_rl.models import ConfigMismatchError

    problems: list[str] = []
    hf, where = None, "model.tiny"
    par = f"actor.tp={a.tp}, actor.pp={a.pp}" + (f", actor.vpp={a.vpp}" if a.vpp else "")
    if model.path is not None:
        where = "model.path"
        mp = abs_path(model.path)
        if not mp.is_dir():
            problems.append(f"model.path: {mp} is not a directory")
        else:
            if not (mp / "config.json").is_file():
                problems.append(f"model.path: {mp} has no config.json")
            if not any(mp.glob("*.safetensors")):
                problems.append(f"model.path: {mp} has no *.safetensors weights")
            if (mp / "config.json").is_file() and par_ok:
                try:
                    hf = hf_model_config(mp, tp=a.tp, pp=a.pp, vpp=a.vpp, sequence_parallel=a.sequence_parallel)
                except ConfigMismatchError as e:
                    problems.append(f"model.path: {mp}: {e} ({par})")
                except ValueError as e:  # config.json unreadable, unsupported model_type
                    problems.append(f"model.path: {e}")
    elif model.path_required:
        problems.append("model.path: this preset trains a real checkpoint: give it with --model HF_DIR (or "
                        "model.path=...); without one it would train the tiny random model")
    elif par_ok:
        tm = model.tiny
        try:
            hf = tm.hf_config(tm.vocab_size if tm.vocab_size is not None else 1)
            from megatron_rl.bridge import get_bridge
            from megatron_rl.models import ParallelSizes

            get_bridge(hf).validate(ParallelSizes(a.tp, a.pp, a.vpp, a.sequence_parallel))
        except (ConfigMismatchError, ValueError, TypeError) as e:
            problems.append(f"model.tiny: the tiny model cannot be built at {par}: {e}")
            hf = None
    return problems, hf, where


def validate(cfg: RLConfig) -> None:
    """Every check that needs no running process; raises one ConfigError listing all problems."""
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
    need(not (c.async_rollout and c.placement == "colocated" and c.offload_actor),
         "cluster.async_rollout=true with cluster.placement=colocated keeps the actor on its GPUs while the next "
         "rollout runs beside training: cluster.offload_actor cannot be true")
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
    need(not (r.use_router and r.engine != "sglang"), "rollout.use_router needs rollout.engine=sglang")
    need(isinstance(a.fp32_lm_head, bool), f"actor.fp32_lm_head must be true or false, got {a.fp32_lm_head!r}")
    fp32_head = {k: v for k, v in r.sglang.items() if k.replace("-", "_") == "enable_fp32_lm_head"}
    need(all(isinstance(v, bool) and v == a.fp32_lm_head for v in fp32_head.values()),
         f"rollout.sglang sets {fp32_head} but actor.fp32_lm_head={a.fp32_lm_head}: the engines get the actor's "
         f"setting (both sides must round logits alike); set actor.fp32_lm_head instead")
    try:  # the farm's own checks (FarmConfig.validate)
        cfg.farm.validate()
    except ValueError as e:
        problems += _named("farm", str(e), {f.name for f in dataclasses.fields(cfg.farm)})
    if d.size_profile:
        from verifier.size_profiles import parse_fit_profile

        try:
            parse_fit_profile(d.size_profile)
        except ValueError as e:
            problems.append(f"data.size_profile: {e}")
    env_cls = None
    try:
        from megatron_rl.rollout.environment import environment_class

        env_cls = environment_class(d.environment)
    except Exception as e:  # noqa: BLE001 - an import path that does not resolve
        problems.append(f"data.environment: {e}")

    model_errors, hf, where = model_problems(cfg.model, a, par_ok)
    problems += model_errors
    if hf is not None:
        from megatron_rl.models import spec_for, text_config

        need(not (a.attention_backend == "local" and spec_for(hf).needs_thd_packing),
             f"actor.attention_backend=local packs samples with a block mask, which cannot keep them apart in "
             f"{where}'s recurrent (Gated DeltaNet) layers: use sdpa, te or auto")
        hf = text_config(hf)  # vocab and context of the language model (a multimodal config holds them inside)
    if cfg.model.tokenizer == "auto":
        cfg.model.tokenizer = cfg.model.path if cfg.model.path else "qwen3-offline"
    if cfg.model.tokenizer != "qwen3-offline":
        tp = abs_path(cfg.model.tokenizer)
        need(tp.is_dir(), f"model.tokenizer: {tp} is not a directory (or use 'qwen3-offline')")
        if tp.is_dir():
            need(any((tp / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")),
                 f"model.tokenizer: {tp} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                 f"set model.tokenizer=qwen3-offline or point it at a tokenizer dir")
    elif env_cls is not None and env_cls.own_tokenizer() is None and hf is not None and \
            (cfg.model.path or cfg.model.tiny.vocab_size is not None):
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
    if env_cls is not None:
        problems += env_cls.config_problems(cfg)
    if cfg.agent.reward_fn is not None:
        try:
            from megatron_rl.algorithms import load_callable
            load_callable(cfg.agent.reward_fn)
        except Exception as e:  # noqa: BLE001 - reported as a config problem
            problems.append(f"agent.reward_fn: {e}")
    if problems:
        raise ConfigError(problems)

