"""Finishing a rollout that stopped while it held the route (its holder died), for reconcile:
a candidate still in its canary is withdrawn; a version that had swapped is baked again under
the new claim, then its predecessor is retired or it is rolled back. Tagged, announced and
published as such, through the same rollout object as any rollout."""

from __future__ import annotations

import time

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import serve_control
from prefect_ray_lifecycle.tasks.rollout.apps import RouteContext
from prefect_ray_lifecycle.tasks.rollout.changes import withdraw
from prefect_ray_lifecycle.tasks.rollout.config import Gates
from prefect_ray_lifecycle.tasks.rollout.record import emit
from prefect_ray_lifecycle.tasks.rollout.rollout import Rollout, RolloutFailed, RolloutResult
from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig

__all__ = ["finish_interrupted"]


def finish_interrupted(
    ctx: RouteContext,
    router: RouterConfig,
    model_name: str,
    gates: Gates,
    server: MLflowServer,
    url: str,
) -> RolloutResult:
    """Withdraw or re-bake the rollout `router`'s record names; its result."""
    interrupted = router.rollout
    version, route, live = interrupted.version, ctx.route, router.live
    why = f"rollout {interrupted.holder} stopped during its {interrupted.stage}"
    # The version the chart calls live: the one serving before the interrupted rollout.
    before = (router.previous or live).version if live else None
    rollout = Rollout(
        ctx=ctx,
        gates=gates,
        server=server,
        model_name=model_name,
        version=version,
        url=url,
        timeline=Rollout.new_timeline(ctx, gates, server, model_name, version, "Recovery"),
        live=live,
        previous_version=before,
    )
    rollout.timeline.live = before
    rollout.add("found", interrupted.stage, why, {"generation": router.generation})
    if interrupted.stage == "canary":
        app = (
            router.candidate.app
            if router.candidate
            else serve_control.version_app_name(model_name, version)
        )
        withdrawn = withdraw(ctx, live, app)
        reason = f"{why}; withdrawn, v{live.version} serves /{route}"
        rollout.add("withdraw", "done", reason, withdrawn.figures())
        return rollout.finish(
            "withdrawn",
            reason,
            reason,
            verdict={"verdict": "interrupted", "stage": "canary", "reason": reason},
            event=("recovered", {"stage": "canary", "action": "withdrawn"}),
        )
    # Baked again from now, under this claim: the route's record names the new holder.
    since = time.time()
    ctx.write(ctx.config(live=live, previous=router.previous, rollout=ctx.record("bake", version)))
    rollout.add("bake", "restarted", f"{why}; baking v{version} again")
    try:
        settled = rollout.bake_then_settle(live, router.previous, since, "rebaked")
    except RolloutFailed:
        emit("recovered", model_name, version, route, {"stage": "bake", "action": "rolled_back"})
        raise
    emit("recovered", model_name, version, route, {"stage": "bake", "action": "promoted"})
    return settled
