"""The training-sample type shared by the RL algorithms, the SFT pipeline and the Megatron actor."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


class SampleError(ValueError):
    """A `TrainSample` is malformed; the message names the sample index and the field."""


@dataclass
class TrainSample:
    """One training sequence.

    ``loss_mask[i] == 1`` means the logprob ``log p(tokens[i] | tokens[:i])`` enters the loss, so
    ``loss_mask[0]`` is always 0 (the first token has no context). ``fields`` holds optional
    per-token floats aligned with ``tokens`` (``advantages``, ``old_logprobs``,
    ``rollout_logprobs``, ``ref_logprobs``, ...); the value at index ``i`` belongs to token ``i``.
    ``weight`` scales the sample's contribution to the loss (0 drops it, e.g. MirrorPop).
    """

    tokens: list[int]
    loss_mask: list[int]
    fields: dict[str, list[float]] = field(default_factory=dict)
    weight: float = 1.0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_trained_tokens(self) -> int:
        return int(sum(1 for m in self.loss_mask if m))

    def validate(self, index: int = 0, vocab_size: int | None = None) -> None:
        """Raise `SampleError` naming ``index`` and the offending field."""
        where = f"sample {index}"
        n = len(self.tokens)
        if n == 0:
            raise SampleError(f"{where}: tokens is empty")
        if len(self.loss_mask) != n:
            raise SampleError(f"{where}: loss_mask has length {len(self.loss_mask)}, tokens has {n}")
        toks = np.asarray(self.tokens)
        if toks.dtype.kind not in "iu":
            raise SampleError(f"{where}: tokens must be ints, got dtype {toks.dtype}")
        bad = np.flatnonzero((toks < 0) | (toks >= vocab_size if vocab_size is not None else False))
        if bad.size:
            i = int(bad[0])
            raise SampleError(f"{where}: tokens[{i}]={int(toks[i])} is outside the vocabulary"
                              + (f" (size {vocab_size})" if vocab_size is not None else ""))
        mask = np.asarray(self.loss_mask)
        bad = np.flatnonzero((mask != 0) & (mask != 1))
        if bad.size:
            i = int(bad[0])
            raise SampleError(f"{where}: loss_mask[{i}]={self.loss_mask[i]!r} must be 0 or 1")
        if self.loss_mask[0]:
            raise SampleError(f"{where}: loss_mask[0] must be 0 (the first token has no context)")
        if not isinstance(self.fields, dict):
            raise SampleError(f"{where}: fields must be a dict of per-token lists")
        for name, values in self.fields.items():
            if len(values) != n:
                raise SampleError(f"{where}: field {name!r} has length {len(values)}, tokens has {n}")
            try:
                trained = np.asarray(values, dtype=np.float64)[mask == 1]
            except (TypeError, ValueError) as e:
                raise SampleError(f"{where}: field {name!r} must be a list of numbers ({e})") from None
            if not np.isfinite(trained).all():
                i = int(np.flatnonzero(mask == 1)[np.flatnonzero(~np.isfinite(trained))[0]])
                raise SampleError(f"{where}: field {name!r} is not finite at trained token {i} ({values[i]!r})")
        w = self.weight
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
            raise SampleError(f"{where}: weight={w!r} must be a finite number >= 0")


def validate_samples(samples: Sequence[TrainSample], vocab_size: int | None = None,
                     required_fields: Sequence[str] = ()) -> None:
    """Validate a batch; every sample must carry the same field names (they are packed together)."""
    if not samples:
        raise SampleError("empty batch: no samples")
    names = None
    for i, s in enumerate(samples):
        if not isinstance(s, TrainSample):
            raise SampleError(f"sample {i}: expected TrainSample, got {type(s).__name__}")
        s.validate(i, vocab_size)
        for f in required_fields:
            if f not in s.fields:
                raise SampleError(f"sample {i}: required field {f!r} is missing")
        if names is None:
            names = set(s.fields)
        elif set(s.fields) != names:
            raise SampleError(
                f"sample {i}: fields {sorted(s.fields)} differ from sample 0's {sorted(names)}")
