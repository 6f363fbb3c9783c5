"""HF <-> Megatron parameter maps: the single source of truth for names and layouts.

Used by checkpoint conversion (`ckpt_tools`), the actor's HF initialisation and live weight sync.
Pure: no Ray, no engines; only torch.distributed collectives inside `export_hf`. The per-architecture
tables live with each architecture (`megatron_rl/models/<arch>/bridge.py`); this package is the
architecture-independent plumbing (transforms, TP/PP gather and scatter, lazy HF reading).
"""
from __future__ import annotations

from .base import Bridge, BridgeError, ParamMapping
from .hf_state import HFCheckpointError, LazyHFState
from .registry import bridge_names, get_bridge

import megatron_rl.models  # noqa: E402,F401  (registers every architecture and its bridge)
from .transforms import (ColumnParallel, GatedMLP, LayoutError, QKVInterleave, Replicated, RowParallel,
                         Transform, VocabParallel)

__all__ = [
    "Bridge", "BridgeError", "ColumnParallel", "GatedMLP", "HFCheckpointError", "LayoutError",
    "LazyHFState", "ParamMapping", "QKVInterleave", "Replicated", "RowParallel", "Transform",
    "VocabParallel", "bridge_names", "get_bridge",
]
