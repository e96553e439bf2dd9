"""Placement groups left on a stack's head after the work that made them ended: each holds
its CPUs for good, and later work that needs them waits forever. Read through the dashboard's
state API (no Ray connection unless one must be removed)."""

from __future__ import annotations

import time

from deployments.testing.stack import Stack

__all__ = ["live_groups", "remove_leftover_groups"]

# Tune and Train remove their groups as their runs end; the GCS may still be removing one.
SETTLE_S = 10.0


def live_groups(stack: Stack) -> list[dict]:
    """The head's placement groups that are not removed: id, state, bundles, creator job."""
    from ray.util.state.api import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource

    # The token by header: Ray reads its auth mode once per process, maybe before the stack.
    client = StateApiClient(
        stack.ray_dashboard_url, headers={"authorization": f"Bearer {stack.ray_token}"}
    )
    groups = client.list(
        StateResource.PLACEMENT_GROUPS,
        ListApiOptions(detail=True, limit=10_000),
        raise_on_missing_output=False,
    )
    return [
        {
            "id": g.placement_group_id,
            "state": g.state,
            "bundles": [b.get("unit_resources") for b in g.bundles or []],
            "creator_job_id": g.creator_job_id,
        }
        for g in groups
        if g.state != "REMOVED"
    ]


def remove_leftover_groups(stack: Stack, settle_s: float = SETTLE_S) -> list[dict]:
    """Remove the head's live placement groups that are still there after `settle_s`, and
    return what they were (none: an empty list)."""
    deadline = time.monotonic() + settle_s
    while (groups := live_groups(stack)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if groups:
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        with stack.ray_cluster().connect():
            for group in groups:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group["id"])))
    return groups
