"""What `reconcile` does next, decided from what it observed: a pure function over the
route (is its router there and healthy, what does it serve, did a rollout die holding it) and
the registry (which version is `champion`, which is `live`, did the champion fail before).

One step at a time: reconcile does the step, observes again, and asks again, so each step is
judged on the state the previous one left."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig

__all__ = ["FAILED_VERDICTS", "Observed", "Step", "next_step", "router_kept"]

FAILED_VERDICTS = ("rejected", "rolled_back")
# Serve's deployment statuses of a router that answered and is only changing: a new config
# being applied (UPDATING) or replicas added or removed. Rebuilding it then would cut its users
# off for nothing.
_KEPT_STATUSES = ("HEALTHY", "UPDATING", "UPSCALING", "DOWNSCALING")


def router_kept(status: object) -> bool:
    """Whether a router deployment in Serve `status` (e.g. "HEALTHY" or
    "DeploymentStatus.UPDATING") is one to keep; UNHEALTHY, DEPLOY_FAILED or none: rebuild.

    Before, any status ending in "HEALTHY" was kept: UNHEALTHY too, while a router taking a
    new config (UPDATING) was deleted and rolled out again as a first rollout."""
    return status is not None and str(status).rpartition(".")[2] in _KEPT_STATUSES


StepKind = Literal[
    "withdraw",  # a rollout died during its shadow or canary: take the candidate back
    "reapprove",  # a rollout died waiting for a person's approval: ask again
    "rebake",  # a rollout died during its bake: bake the new version again, then decide
    "restore",  # nothing healthy serves the route: deploy `version` through the gates
    "realign",  # the route serves something other than `live`: roll `live` out again
    "rollout",  # `champion` differs from `live`: roll it out
    "in_sync",
    "no_champion",
    "skipped_failed",
]


@dataclass(frozen=True)
class Observed:
    router: RouterConfig | None  # None: no router app on the route
    router_healthy: bool
    holder: str  # the reconcile that observes (it holds the route)
    champion: str | None
    live: str | None  # the `live` alias
    champion_verdict: str | None = None  # the champion's last rollout verdict tag
    champion_reason: str = ""


@dataclass(frozen=True)
class Step:
    kind: StepKind
    reason: str
    version: str | None = None


def next_step(seen: Observed) -> Step:
    router = seen.router
    record = router.rollout if router is not None else None
    if record is not None and record.holder != seen.holder:
        if record.approval is not None and router.candidate is not None:
            return Step(
                "reapprove",
                f"rollout {record.holder} of v{record.version} stopped waiting for approval at "
                f"{record.approval.weight:.0%}: asking again",
                record.version,
            )
        if record.stage in ("shadow", "canary"):
            return Step(
                "withdraw",
                f"rollout {record.holder} of v{record.version} stopped during its {record.stage}",
                record.version,
            )
        return Step(
            "rebake",
            f"rollout {record.holder} of v{record.version} stopped during its bake",
            record.version,
        )
    served = router.live.version if router is not None and router.live is not None else None
    if router is None or not seen.router_healthy or served is None:
        version = seen.live or seen.champion
        if version is None:
            return Step("no_champion", "nothing serves the route and no version is champion")
        what = "no router" if router is None else "an unhealthy router" if served else "no live"
        return Step("restore", f"the route has {what}: restoring v{version}", version)
    if seen.live is not None and served != seen.live:
        return Step(
            "realign",
            f"the route serves v{served} but live is v{seen.live}: rolling v{seen.live} out",
            seen.live,
        )
    if seen.champion is None:
        return Step("no_champion", f"no champion; v{served} keeps serving")
    if seen.champion == served:
        return Step("in_sync", f"champion v{served} is live", served)
    if seen.champion_verdict in FAILED_VERDICTS:
        return Step(
            "skipped_failed",
            f"champion v{seen.champion} already failed a rollout ({seen.champion_verdict}: "
            f"{seen.champion_reason}); v{served} keeps serving",
            seen.champion,
        )
    return Step(
        "rollout",
        f"champion v{seen.champion} differs from live v{served}: rolling it out",
        seen.champion,
    )
