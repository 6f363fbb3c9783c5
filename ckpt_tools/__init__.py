"""HF <-> Megatron distributed-checkpoint tools: conversion with TP/PP resharding, HF release export,
logit-parity verification. Reuses the `megatron_rl.bridge` maps; needs no Ray and no engines.
"""
from __future__ import annotations

from .convert import HFToMcore, McoreToHF, hf_to_mcore, mcore_to_hf
from .ranks import ToolError
from .verify import VerifyJob, VerifyReport, verify

__all__ = ["HFToMcore", "McoreToHF", "ToolError", "VerifyJob", "VerifyReport", "hf_to_mcore",
           "mcore_to_hf", "verify"]
