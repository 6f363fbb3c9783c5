"""Messages between the rollout side (agent loop, trainer) and the generation engines.

Both engines (SGLang and the embedded HF engine) are reached over the same HTTP API subset, by the
same client; these are the typed values that client takes and returns.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    seed: int | None = None
    min_p: float = 0.0
    ignore_eos: bool = False  # SGLang stops at the model's EOS ids unless this is set

    def to_sglang(self) -> dict[str, Any]:
        d = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens, "stop_token_ids": list(self.stop_token_ids),
            "min_p": self.min_p, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False,
        }
        if self.seed is not None:
            d["sampling_seed"] = int(self.seed)
        return d


@dataclasses.dataclass
class GenerateResult:
    token_ids: list[int]           # generated tokens only
    logprobs: list[float]          # rollout-policy logprob of each generated token
    finish_reason: str             # "stop" | "length" | "abort"
    weight_version: int | None = None
    prompt_tokens: int = 0
