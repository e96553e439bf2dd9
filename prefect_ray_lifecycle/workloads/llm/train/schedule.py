"""The learning-rate schedule: a linear warm-up to the peak, then a cosine decay to a floor.
A picklable callable, so torch's LambdaLR keeps it in its state_dict and a resumed run
continues the same curve."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["WarmupCosine"]


@dataclass(frozen=True)
class WarmupCosine:
    """The share of the peak learning rate for the optimizer step after `step` steps."""

    warmup_steps: int
    total_steps: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
