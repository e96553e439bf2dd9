"""Prefect tasks that change what a route serves, each one router write (in place, no
replica restart) plus the Serve apps it frees: the swap, the retirement of the previous
version after the bake, a rollback, and the withdrawal of a candidate."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from prefect import get_run_logger

from prefect_ray_lifecycle.control import serve_control
from prefect_ray_lifecycle.tasks.rollout import StageResult, rollout_stage
from prefect_ray_lifecycle.tasks.rollout.apps import RouteContext
from prefect_ray_lifecycle.workloads.constants import POLICY_DEPLOYMENT
from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig, Target

__all__ = [
    "RetireResult",
    "RollbackResult",
    "SwapResult",
    "WithdrawResult",
    "inject",
    "retire",
    "rollback",
    "swap",
    "take_back",
    "withdraw",
]


@dataclass(frozen=True, kw_only=True)
class SwapResult(StageResult):
    generation: int  # the router config's generation that made the swap
    seconds: float
    at: float  # epoch seconds: where the bake's figures start
    inline: bool  # whether the router hosts the new version in its replicas


@dataclass(frozen=True, kw_only=True)
class RetireResult(StageResult):
    inline: bool
    deleted: str | None  # the previous version's app


@dataclass(frozen=True, kw_only=True)
class RollbackResult(StageResult):
    seconds: float


@dataclass(frozen=True, kw_only=True)
class WithdrawResult(StageResult):
    deleted: str  # the candidate's app


@rollout_stage
def swap(ctx: RouteContext, candidate: Target, previous: Target | None) -> SwapResult:
    """Gate 4: the router sends all traffic to the candidate. After a canary it is reached
    through its own app while it bakes, with the previous version kept as its fallback; a first
    rollout (no previous version) is hosted in the router's replicas at once."""
    started = time.time()
    if previous is None and ctx.hosts(candidate):
        written, hosted = _host(ctx, ctx.config(live=candidate, inline_live=True), candidate)
    elif previous is None:
        # A first rollout the router does not host (an LLM with host_in_router off): nothing
        # to bake against, so no bake record. One left here named its holder after the
        # rollout ended, and the next reconcile took it for a rollout that died mid-bake.
        written, hosted = ctx.write(ctx.config(live=candidate)), False
    else:
        config = ctx.config(
            live=candidate, previous=previous, rollout=ctx.record("bake", candidate.version)
        )
        written, hosted = ctx.write(config), False
    return SwapResult(
        generation=written.generation,
        seconds=round(time.time() - started, 2),
        at=started,
        inline=hosted,
    )


def _host(ctx: RouteContext, config: RouterConfig, live: Target) -> tuple[RouterConfig, bool]:
    """Write `config`, which hosts `live` in the router's replicas, and wait until every
    replica does. One that cannot (a model that will not load there, an engine that does not
    fit) keeps forwarding to the version's app, so serving is unaffected: the router is then
    written to forward only, and the second value says False."""
    try:
        return ctx.write(config, wait_s=120, inline_version=live.version), True
    except RuntimeError as error:
        get_run_logger().warning(
            "router %s still forwards to v%s: %s", ctx.route, live.version, error
        )
        return ctx.write(replace(config, inline_live=False)), False


@rollout_stage
def inject(app: str, faults: dict[str, Any]) -> None:
    """A drill's faults, applied to one version's app in place."""
    config = serve_control.app_configs()[app]
    serve_control.apply(
        {app: serve_control.with_user_config(config, POLICY_DEPLOYMENT, {"faults": faults})}
    )


@rollout_stage
def retire(ctx: RouteContext, live: Target, previous_app: str | None) -> RetireResult:
    """After the bake: the router hosts the live version in process (no extra hop), the
    route is no longer held by a rollout, then the previous version's app is deleted."""
    if ctx.hosts(live):
        _, inline_ok = _host(ctx, ctx.config(live=live, inline_live=True), live)
    else:
        ctx.write(ctx.config(live=live))
        inline_ok = False
    if previous_app and previous_app != live.app:
        serve_control.apply(deletes={previous_app})
    return RetireResult(inline=inline_ok, deleted=previous_app)


@rollout_stage
def rollback(ctx: RouteContext, previous: Target, candidate_app: str) -> RollbackResult:
    """Route everything back to the previous version, then delete the candidate's app."""
    started = time.time()
    ctx.write(ctx.config(live=previous, inline_live=ctx.hosts(previous)))
    seconds = time.time() - started
    serve_control.apply(deletes={candidate_app})
    return RollbackResult(seconds=round(seconds, 2))


@rollout_stage
def take_back(ctx: RouteContext, candidate_app: str) -> WithdrawResult:
    """A first rollout undone after its swap: the route's router and the version's app go,
    and the route serves nothing, as before it (its state actor, which this rollout's claim
    lives in, stays)."""
    serve_control.apply(deletes={serve_control.router_app_name(ctx.route), candidate_app})
    return WithdrawResult(deleted=candidate_app)


@rollout_stage
def withdraw(ctx: RouteContext, live: Target | None, candidate_app: str) -> WithdrawResult:
    """After a failed gate (or a rollout that died in its canary): the router serves only
    the live version again (untouched when it never saw the candidate), then the candidate's
    app is deleted."""
    current = serve_control.current_router(ctx.route)
    if (
        current is not None
        and live is not None
        and (current.candidate is not None or current.rollout is not None or current.live != live)
    ):
        keep_inline = current.inline_live and current.live == live
        ctx.write(ctx.config(live=live, inline_live=keep_inline))
    if candidate_app != (live.app if live else None):
        serve_control.apply(deletes={candidate_app})
    return WithdrawResult(deleted=candidate_app)
