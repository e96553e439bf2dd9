"""Prefect tasks of a Serve rollout: its settings (config), the route claim (claim), the
route as a rollout writes it (apps), the gates (gates), the router writes (changes), what it
records (record, chart), the rollout object with its one way to finish (rollout), and the
recovery of an interrupted rollout (recovery).

`rollout_stage` and `StageResult`, shared by the stage modules, live here."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

__all__ = ["StageResult", "rollout_stage"]

# Rollout stages talk to a live cluster: never served from a cache.
rollout_stage = task(cache_policy=NO_CACHE)


@dataclass(frozen=True, kw_only=True)
class StageResult:
    """What a stage reports when it passes: why, and its figures for the timeline."""

    reason: str = ""

    # Fields kept in the result but not shown as the timeline's figures.
    HIDDEN = frozenset({"reason", "at", "timeline"})

    def figures(self) -> dict[str, Any]:
        """The fields a person reads in the timeline (empty ones left out)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in self.HIDDEN and getattr(self, f.name) is not None
        }
