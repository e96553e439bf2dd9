"""Finishing a rollout that stopped while it held the route (its holder died), for reconcile:
a candidate still in its shadow or canary is withdrawn; one that was waiting for a person's
approval is asked again (its canary share restored under the new claim), then goes on as the
rollout would have, or is withdrawn on an abort; a version that had swapped is baked again
under the new claim, then its predecessor is retired or it is rolled back. Tagged, announced
and published as such, through the same rollout object as any rollout."""

from __future__ import annotations

import time

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import serve_control
from prefect_ray_lifecycle.control.canary import GateFailed
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
    """Withdraw, ask again or re-bake the rollout `router`'s record names; its result."""
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
    rollout.timeline.kind = live.kind if live else "policy"
    rollout.add("found", interrupted.stage, why, {"generation": router.generation})
    if interrupted.approval is not None and router.candidate is not None:
        return _ask_again(rollout, router, gates)
    if interrupted.stage in ("shadow", "canary"):
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
            verdict={"verdict": "interrupted", "stage": interrupted.stage, "reason": reason},
            event=("recovered", {"stage": interrupted.stage, "action": "withdrawn"}),
        )
    if router.previous is None:
        # A bake record with nothing to roll back to (an earlier first rollout left one):
        # the version keeps the route, and the record goes.
        ctx.write(ctx.config(live=live, inline_live=router.inline_live))
        reason = f"{why}; no earlier version to fall back to: v{live.version} keeps /{route}"
        rollout.add("bake", "cleared", reason)
        return rollout.finish(
            "rebaked",
            reason,
            reason,
            verdict={"verdict": "interrupted", "stage": interrupted.stage, "reason": reason},
            event=("recovered", {"stage": interrupted.stage, "action": "kept"}),
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


def _ask_again(rollout: Rollout, router: RouterConfig, gates: Gates) -> RolloutResult:
    """The interrupted rollout's approval, asked again with its canary share restored; then
    its remaining canary steps, the swap and the bake, as the rollout would have gone on. An
    abort (or a timeout to abort) withdraws the candidate: never an unapproved swap."""
    waiting = router.rollout.approval
    live, candidate = router.live, router.candidate
    rollout.candidate = candidate
    rollout.inline_live = bool(router.inline_live and rollout.ctx.hosts(live))
    try:
        rollout.approve(waiting.weight, waiting.point)
        later = [w for w in gates.canary_steps if w > waiting.weight]
        rollout.gate_traffic(later, asked=waiting.point == "before_swap")
    except GateFailed as failure:
        withdraw(rollout.ctx, live, candidate.app)
        emit(
            "recovered",
            rollout.model_name,
            rollout.version,
            rollout.route,
            {"stage": "approval", "action": "withdrawn"},
        )
        rollout.fail(failure, "rejected", live)
    settled = rollout.swap_then_bake()
    emit(
        "recovered",
        rollout.model_name,
        rollout.version,
        rollout.route,
        {"stage": "approval", "action": "promoted"},
    )
    return settled
