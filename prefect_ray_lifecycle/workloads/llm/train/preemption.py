"""When to take the just-in-time checkpoint of a preempted run, decided from the deadline Ray
reports, the measured cost of a step and of a checkpoint, and a margin.

Ray Train 2.60 only signals a preemption (ray.train.get_preemption_info); the training loop
takes the checkpoint. It then holds, without training, until Ray Train restarts the run at
the deadline on the nodes left: a step trained after the checkpoint would be lost. Training
on until the last safe moment keeps the wait short.

Asking is not free: `get_preemption_info` is a barrier through Ray Train's synchronization
actor (a Ray actor call per rank, 18 ms a step on the 2-core test machine, against 3 ms for a
gloo all-reduce). Ray Train's watcher only learns of a drain once per poll, so until one is
seen the loop asks about once per poll interval (`steps_between_checks`), and every step
after."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from prefect_ray_lifecycle.compat.ray_internals import train_preemption_fallback_deadline_s

__all__ = ["JitVerdict", "effective_deadline_s", "jit_verdict", "steps_between_checks"]

JitKind = Literal["train_on", "checkpoint_now"]


@dataclass(frozen=True)
class JitVerdict:
    kind: JitKind
    reason: str


def effective_deadline_s(deadline_ms: int | None, detected_at_s: float) -> float:
    """The moment Ray Train restarts the run (UNIX seconds): the drain's deadline, or, when the
    drain gave none, its fallback window after the preemption was first seen."""
    if deadline_ms:
        return deadline_ms / 1000
    return detected_at_s + train_preemption_fallback_deadline_s()


def jit_verdict(
    now_s: float, deadline_s: float, step_s: float, checkpoint_s: float, margin_s: float
) -> JitVerdict:
    """Checkpoint now when another step would leave less than a checkpoint and the margin
    before the deadline; else train on."""
    left = deadline_s - now_s
    needed = step_s + checkpoint_s + margin_s
    if left <= needed:
        return JitVerdict(
            "checkpoint_now",
            f"{left:.1f} s to the deadline, a step and a checkpoint take {needed:.1f} s "
            "with the margin",
        )
    return JitVerdict("train_on", f"{left:.1f} s to the deadline, {needed:.1f} s needed")


def steps_between_checks(poll_s: float, step_s: float | None) -> int:
    """How many steps until the loop next asks Ray Train about a preemption: about one poll
    interval of the watcher's (asking more often learns nothing new), at least 1. `step_s` is
    the ranks' mean step time, so every rank gets the same answer; None (no step measured
    yet) asks at the next step."""
    if step_s is None or step_s <= 0 or not math.isfinite(step_s):
        return 1
    return max(1, math.floor(poll_s / step_s))
