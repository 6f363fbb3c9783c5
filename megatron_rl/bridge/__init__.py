"""HF <-> Megatron parameter maps: the single source of truth for names and layouts.

Used by checkpoint conversion (`ckpt_tools`), the actor's HF initialisation and live weight sync.
Pure: no Ray, no engines; only torch.distributed collectives inside `export_hf`.
"""
from __future__ import annotations

from .base import Bridge, BridgeError, ParamMapping
from .hf_state import HFCheckpointError, LazyHFState
from .registry import bridge_names, get_bridge
from .transforms import (ColumnParallel, GatedMLP, LayoutError, QKVInterleave, Replicated, RowParallel,
                         Transform, VocabParallel)
from . import qwen3  # noqa: F401  (registers Qwen3Bridge)

__all__ = [
    "Bridge", "BridgeError", "ColumnParallel", "GatedMLP", "HFCheckpointError", "LayoutError",
    "LazyHFState", "ParamMapping", "QKVInterleave", "Replicated", "RowParallel", "Transform",
    "VocabParallel", "bridge_names", "get_bridge",
]
