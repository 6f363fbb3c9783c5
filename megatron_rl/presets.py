"""Reading a preset YAML file, and the error every config problem raises. Kept apart from `megatron_rl.config`
(which imports the actor, hence megatron-core) so that the planner (`megatron_rl.plan`), which runs on login nodes,
reads presets the same way without those imports."""
from __future__ import annotations

import os
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """Configuration problems, reported before the run starts; `problems` lists each, naming its key."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else [p for p in problems if p]
        if len(self.problems) == 1 and not isinstance(problems, list):
            super().__init__(self.problems[0])
        else:
            super().__init__("invalid config:\n  - " + "\n  - ".join(self.problems))


def load_preset(path: str | os.PathLike) -> DictConfig:
    """A YAML preset file: a mapping of sections (a `ConfigError` naming the file otherwise). Every launcher's
    config (RL, SFT, recipe, plan) is read through this."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} is a folder, not a YAML file" if p.is_dir()
                          else f"config file not found: {path}")
    try:
        document = yaml.safe_load(p.read_text())
        preset = OmegaConf.load(p)
    except Exception as e:  # noqa: BLE001 - YAML syntax errors are not OmegaConf's own type
        raise ConfigError(f"{path}: not a valid YAML config ({str(e).splitlines()[0]})") from None
    # OmegaConf reads a bare word as a key with no value ('foo' -> {foo: None}): ask YAML what the file holds
    # (an empty or all-comment file is an empty preset: the defaults)
    if document is not None and not isinstance(document, dict) or not isinstance(preset, DictConfig):
        raise ConfigError(f"{path}: a config preset must be a mapping of sections, got a "
                          f"{type(document).__name__} ({str(document)[:40]!r})")
    return preset
