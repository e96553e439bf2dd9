"""serve_rollout: a registered policy version reaches a stable Serve route only through gates.

candidate app -> healthy and staying healthy -> smoke -> canary steps through the router
-> swap (MLflow alias `live` moves) -> bake -> retire the previous version, or roll back.
A failed gate leaves the live version serving, tags the candidate with the reason, deletes
its app and fails the flow run with that reason. Rollouts on one route never overlap.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.control.canary import GateFailed
from prefect_ray_lifecycle.flows.register import DEFAULT_MODEL_NAME
from prefect_ray_lifecycle.tasks import lineage
from prefect_ray_lifecycle.tasks.params import ModelVersion, Text
from prefect_ray_lifecycle.tasks.rollout.apps import RouteContext, route_context, version_app
from prefect_ray_lifecycle.tasks.rollout.changes import inject, retire, rollback, swap, withdraw
from prefect_ray_lifecycle.tasks.rollout.claim import hold_route
from prefect_ray_lifecycle.tasks.rollout.config import Drill, Gates, LLMServing, Serving
from prefect_ray_lifecycle.tasks.rollout.gates import bake, canary_step, deploy_candidate, smoke
from prefect_ray_lifecycle.tasks.rollout.record import Timeline, emit, record
from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig, Target, TargetKind


class RolloutFailed(RuntimeError):
    """The candidate was rejected or rolled back; the live version kept serving."""


class RolloutResult(BaseModel):
    model_name: str
    version: str
    route: str
    outcome: str = Field(
        description="promoted, first_rollout, already_live, or for a recovered rollout: "
        "withdrawn or rebaked."
    )
    reason: str
    url: str = Field(description="The route's URL.")
    previous_version: str | None = None
    timeline: list[dict[str, Any]] = Field(default_factory=list)
    chart_url: str | None = Field(
        None, description="The rollout's chart (a PNG on the version's MLflow run)."
    )


@flow(name="serve-rollout", log_prints=True)
def serve_rollout(
    model_name: Text = DEFAULT_MODEL_NAME,
    version: ModelVersion | None = None,
    alias: Text = registry.CHAMPION,
    route: Text = "policy",
    gates: Gates | None = None,
    serving: Serving | None = None,
    drill: Drill | None = None,
    ray_cluster: RayCluster | None = None,
    mlflow_server: MLflowServer | None = None,
    kind: TargetKind = "policy",
    llm: LLMServing | None = None,
) -> RolloutResult:
    """Roll a registered policy version out to a Serve route through health, smoke and
    canary gates, swap it in, bake it, and roll back on degradation.

    Args:
        model_name: Registered model in MLflow.
        version: The version to roll out (a number: 3); empty: the version the alias
            points at.
        alias: Alias resolved (once, at the start) when no version is given.
        route: The stable route (URL prefix /<route>) whose router serves the model.
        gates: Health, smoke, canary and bake settings.
        serving: Replicas, CPUs/GPUs and health checks of the version's Serve app.
        drill: Faults injected into the candidate to rehearse the gates; empty for none.
        ray_cluster: A Ray cluster that outlives the flow run (Serve keeps serving on it).
        mlflow_server: The MLflow server; the local one (http://127.0.0.1:5000) when empty.
        kind: "policy" (an RLlib policy registered by this project) or "llm" (a Hugging Face
            model folder served by vLLM from the LLM venv).
        llm: Engine, replicas and venv of an LLM version's app (kind "llm").
    """
    gates, serving, drill = gates or Gates(), serving or Serving(), drill or Drill()
    llm = llm or LLMServing()
    if kind == "llm" and (drill.faults or drill.after_swap):
        raise ValueError("drills inject faults into policy versions only")
    server, cluster = mlflow_server or MLflowServer(), ray_cluster or RayCluster()
    serve_control.validate_route(route)
    serving.version_options()
    if cluster.is_embedded:
        raise ValueError(
            "serve_rollout needs a Ray cluster that outlives the flow run: set "
            "the RayCluster block's address (an embedded Ray stops with the run)"
        )
    version = _resolve(server, model_name, version, alias)
    with cluster.connect() as joined:
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            with hold_route(route, route_holder(), gates.lease_s) as claim:
                ctx = route_context(route, cluster, serving, gates, claim, kind, llm)
                result = _rollout(
                    ctx, model_name, version, gates, serving, drill, cluster, server, kind, llm
                )
        finally:
            if joined is not None:  # this flow started the Ray connection: leave no handles
                serve_control.release()
    if result.outcome != "already_live":
        lineage.record_serving(
            cluster,
            server,
            model_name,
            version,
            app=serve_control.version_app_name(model_name, version),
            route=route,
            metadata={"outcome": result.outcome, "previous_version": result.previous_version},
        )
    return result


def route_holder() -> str:
    """Who holds a route: this flow run (a fresh id outside one)."""
    return str(flow_run.id or uuid.uuid4())


def _resolve(server: MLflowServer, model_name: str, version: str | None, alias: str) -> str:
    with server.session() as client:
        if version is not None:
            found = client.get_model_version(model_name, str(version))
        else:
            found = registry.resolve_alias(client, model_name, alias)
            if found is None:
                raise ValueError(
                    f"{model_name} has no version with alias {alias!r}; pass a "
                    f"version or set the alias"
                )
    if found.status != "READY":
        raise ValueError(f"{model_name} v{found.version} is {found.status}, not READY")
    return str(found.version)


def _rollout(
    ctx: RouteContext,
    model_name: str,
    version: str,
    gates: Gates,
    serving: Serving,
    drill: Drill,
    cluster: RayCluster,
    server: MLflowServer,
    kind: TargetKind,
    llm: LLMServing,
) -> RolloutResult:
    route = ctx.route
    timeline = Timeline(
        f"Rollout of {model_name} v{version} on /{route}",
        model_name=model_name,
        version=version,
        route=route,
        server=server,
        gates=gates,
    )
    app_config, candidate, health_period_s = version_app(
        kind, server, model_name, version, serving, llm, drill.faults, ctx.runtime_env
    )
    router = serve_control.current_router(route)
    live = router.live if router else None
    timeline.live = live.version if live else None
    url = f"{cluster.serve_url}/{route}"
    result = dict(
        model_name=model_name,
        version=version,
        route=route,
        url=url,
        previous_version=live.version if live else None,
    )

    if live is not None and live.version == version and live.app == candidate.app:
        record(
            server,
            model_name,
            version,
            {"route": route, "app": candidate.app},
            move_live_to=version,
            reason=f"already served on /{route}",
        )
        timeline.add("check", "already live", f"v{version} already serves /{route}")
        timeline.publish("nothing to do", chart=False)
        return RolloutResult(
            outcome="already_live",
            reason="already live",
            timeline=timeline.entries,
            chart_url=timeline.chart_url,
            **result,
        )

    try:
        health = deploy_candidate(app_config, candidate, health_period_s, gates)
        timeline.add("health", "passed", health["reason"], health)
        smoked = smoke(candidate, gates)
        timeline.add("smoke", "passed", smoked["reason"], smoked)
        if live is None:
            swapped = swap(ctx, candidate, None)
            record(
                server,
                model_name,
                version,
                {
                    "verdict": "promoted",
                    "route": route,
                    "app": candidate.app,
                    "reason": "first rollout: health and smoke gates passed",
                },
                move_live_to=version,
                reason=f"first rollout on /{route}",
            )
            timeline.add("router", "created", f"/{route} serves v{version}", swapped)
            emit("promoted", model_name, version, route, {"first": True, "url": url})
            timeline.publish(f"v{version} serves /{route} (first rollout)")
            return RolloutResult(
                outcome="first_rollout",
                reason="first rollout",
                timeline=timeline.entries,
                chart_url=timeline.chart_url,
                **result,
            )
        inline_live = router.inline_live and ctx.hosts(live)
        for weight in gates.canary_steps:
            step = canary_step(ctx, gates, weight, live, candidate, inline_live)
            timeline.add(f"canary {weight:.0%}", "passed", step["reason"], step)
    except GateFailed as failure:
        withdraw(ctx, live, candidate.app)
        return _reject(failure, "rejected", timeline, server, result, live)
    except BaseException:
        _best_effort(withdraw, ctx, live, candidate.app)
        raise

    swapped = swap(ctx, candidate, live)
    record(
        server,
        model_name,
        version,
        {"verdict": "swapped", "route": route, "app": candidate.app},
        move_live_to=version,
        reason="passed health, smoke and canary gates",
    )
    timeline.add(
        "swap", "done", f"/{route} -> v{version}; alias live moved", {"seconds": swapped["seconds"]}
    )
    if drill.after_swap:
        inject(candidate.app, drill.after_swap)
        timeline.add("drill", "injected", f"after the swap: {drill.after_swap}")
    return _bake_then_settle(
        ctx, gates, server, candidate, live, swapped["at"], timeline, result, "promoted"
    )


def _bake_then_settle(
    ctx: RouteContext,
    gates: Gates,
    server: MLflowServer,
    new: Target,
    previous: Target,
    since: float,
    timeline: Timeline,
    result: dict[str, Any],
    outcome: str,
) -> RolloutResult:
    """Bake the swapped-in version, then retire the previous one, or roll back to it."""
    model_name, version, route = result["model_name"], new.version, ctx.route
    try:
        baked = bake(ctx, gates, new, since)
    except GateFailed as failure:
        undone = rollback(ctx, previous, new.app)
        detected = failure.figures.get("detected_at")
        figures = {
            "seconds_to_rollback": round(time.time() - detected, 2) if detected else None,
            **undone,
        }
        timeline.add("rollback", "done", f"/{route} -> v{previous.version}", figures)
        return _reject(failure, "rolled_back", timeline, server, result, previous)
    except BaseException:
        _best_effort(rollback, ctx, previous, new.app)
        raise
    timeline.add("bake", "passed", baked["reason"], baked.get("figures") or {})
    retired = retire(ctx, new, previous.app)
    timeline.add(
        "retire",
        "done",
        f"v{previous.version}'s app deleted; router hosts v{version} "
        f"{'in process' if retired['inline'] else 'through its app'}",
        retired,
    )
    record(
        server,
        model_name,
        version,
        {"verdict": "promoted", "route": route, "app": new.app, "reason": baked["reason"]},
    )
    emit(
        "promoted", model_name, version, route, {"previous": previous.version, "url": result["url"]}
    )
    timeline.publish(f"v{version} replaced v{previous.version} on /{route}")
    return RolloutResult(
        outcome=outcome,
        reason=baked["reason"],
        timeline=timeline.entries,
        chart_url=timeline.chart_url,
        **result,
    )


def finish_interrupted(
    ctx: RouteContext,
    router: RouterConfig,
    model_name: str,
    gates: Gates,
    server: MLflowServer,
    url: str,
) -> RolloutResult:
    """Finish a rollout that stopped while it held the route (its holder died): a candidate
    still in its canary is withdrawn; a version that had swapped is baked again, then its
    predecessor is retired or it is rolled back. Tagged, announced and published as such."""
    interrupted = router.rollout
    version, route = interrupted.version, ctx.route
    why = f"rollout {interrupted.holder} stopped during its {interrupted.stage}"
    timeline = Timeline(
        f"Recovery of {model_name} v{version} on /{route}",
        model_name=model_name,
        version=version,
        route=route,
        server=server,
        gates=gates,
    )
    timeline.add("found", interrupted.stage, why, {"generation": router.generation})
    live = router.live
    # The version the chart calls live: the one serving before the interrupted rollout.
    timeline.live = (router.previous or live).version if live else None
    result = dict(
        model_name=model_name,
        version=version,
        route=route,
        url=url,
        previous_version=(router.previous or live).version if live else None,
    )
    if interrupted.stage == "canary":
        app = (
            router.candidate.app
            if router.candidate
            else serve_control.version_app_name(model_name, version)
        )
        withdrawn = withdraw(ctx, live, app)
        reason = f"{why}; withdrawn, v{live.version} serves /{route}"
        record(
            server,
            model_name,
            version,
            {"verdict": "interrupted", "stage": "canary", "reason": reason, "route": route},
        )
        timeline.add("withdraw", "done", reason, withdrawn)
        emit("recovered", model_name, version, route, {"stage": "canary", "action": "withdrawn"})
        timeline.publish(reason)
        return RolloutResult(
            outcome="withdrawn",
            reason=reason,
            timeline=timeline.entries,
            chart_url=timeline.chart_url,
            **result,
        )
    # Baked again from now, under this claim: the route's record names the new holder.
    since = time.time()
    ctx.write(ctx.config(live=live, previous=router.previous, rollout=ctx.record("bake", version)))
    timeline.add("bake", "restarted", f"{why}; baking v{version} again")
    try:
        settled = _bake_then_settle(
            ctx, gates, server, live, router.previous, since, timeline, result, "rebaked"
        )
    except RolloutFailed:
        emit("recovered", model_name, version, route, {"stage": "bake", "action": "rolled_back"})
        raise
    emit("recovered", model_name, version, route, {"stage": "bake", "action": "promoted"})
    return settled


def _reject(
    failure: GateFailed,
    verdict: str,
    timeline: Timeline,
    server: MLflowServer,
    result: dict[str, Any],
    live,
) -> RolloutResult:
    model_name, version, route = result["model_name"], result["version"], result["route"]
    timeline.add(failure.stage, "failed", failure.reason, failure.figures)
    record(
        server,
        model_name,
        version,
        {"verdict": verdict, "stage": failure.stage, "reason": failure.reason, "route": route},
        move_live_to=live.version if verdict == "rolled_back" else None,
        reason=f"rollback: v{version} {failure.reason}",
    )
    emit(
        verdict.replace("_", "-"),
        model_name,
        version,
        route,
        {"stage": failure.stage, "reason": failure.reason, "live": live and live.version},
    )
    decision = (
        f"v{version} {'rolled back' if verdict == 'rolled_back' else 'rejected'} at "
        f"{failure.stage}: {failure.reason}; v{live.version if live else '?'} serves "
        f"/{route}"
    )
    timeline.publish(decision)
    raise RolloutFailed(decision)


def _best_effort(stage: Any, *args: Any) -> None:
    try:
        stage(*args)
    except Exception as error:  # the original error matters more
        get_run_logger().error("cleanup %s failed: %r", stage.name, error)
