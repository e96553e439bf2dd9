"""Request figures: percentiles and the per-version summary the gates judge."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["percentile", "summarize"]


def percentile(values: Sequence[float], q: float, *, presorted: bool = False) -> float | None:
    """The nearest-rank `q` quantile (0..1) of `values`; None when there are none."""
    if not values:
        return None
    ordered = values if presorted else sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(requests: int, errors: int, latencies: Sequence[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "requests": requests,
        "errors": errors,
        "error_rate": errors / requests if requests else 0.0,
        "p50_ms": percentile(ordered, 0.50, presorted=True),
        "p99_ms": percentile(ordered, 0.99, presorted=True),
    }
