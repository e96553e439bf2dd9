"""reconcile: make what the route actually serves follow what is wanted.

`champion` is the version people (or the promotion policy) want served; `live` is what the
route serves. reconcile holds the route (no rollout runs meanwhile), observes the router
itself as well as the aliases, and takes one step at a time until they agree
(control.convergence): it finishes a rollout whose flow died holding the route, restores a
route that lost its router (a restarted Ray head), re-rolls `live` onto a router serving
something else, then rolls the champion out unless it already failed a rollout.

A rollout that died waiting for a person's approval is asked again, under this run: an
unapproved candidate is never swapped in.

It runs when `champion` moves (MLflow webhook -> Prefect event -> trigger), when a rollout or
reconcile run crashes (an automation on its Crashed event), and on its interval schedule as
the safety net for a lost event.
"""

from __future__ import annotations

from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.control.convergence import Observed, Step, next_step, router_kept
from prefect_ray_lifecycle.flows.register import DEFAULT_MODEL_NAME
from prefect_ray_lifecycle.flows.rollout import RolloutResult, serve_rollout
from prefect_ray_lifecycle.tasks._base import mlflow_task
from prefect_ray_lifecycle.tasks.params import Text
from prefect_ray_lifecycle.tasks.rollout.apps import route_context
from prefect_ray_lifecycle.tasks.rollout.claim import hold_route, mark_crashed, route_holder
from prefect_ray_lifecycle.tasks.rollout.config import Gates, LLMServing, Serving
from prefect_ray_lifecycle.tasks.rollout.recovery import finish_interrupted
from prefect_ray_lifecycle.workloads.constants import ROUTER_DEPLOYMENT
from prefect_ray_lifecycle.workloads.serve.router_config import TargetKind

MAX_STEPS = 4  # recover, restore or realign, then roll the champion out: never more
ACTIONS = {
    "withdraw": "recovered",
    "reapprove": "recovered",
    "rebake": "recovered",
    "restore": "restored",
    "realign": "realigned",
    "rollout": "rolled_out",
}


class ReconcileResult(BaseModel):
    action: str = Field(
        description="What it did first: recovered, restored, realigned or rolled_out; or, "
        "when nothing needed doing: in_sync, no_champion or skipped_failed."
    )
    reason: str
    champion: str | None = None
    live: str | None = Field(None, description="The version the route serves at the end.")
    found: dict[str, Any] = Field(default_factory=dict, description="What it observed first.")
    steps: list[dict[str, Any]] = Field(default_factory=list)
    rollout: RolloutResult | None = Field(None, description="The last rollout it ran.")


@task(cache_policy=NO_CACHE)
def observe(route: str, model_name: str, server: MLflowServer, holder: str) -> Observed:
    """The route as its router serves it, and the aliases as MLflow has them."""
    try:
        router = serve_control.current_router(route)
    except ValueError:  # a config no router of this version accepts
        router, healthy = None, False
    else:
        state = serve_control.deployment_state(
            serve_control.router_app_name(route), ROUTER_DEPLOYMENT
        )
        healthy = router is not None and router_kept(state["status"])
    with server.session() as client:
        champion = registry.resolve_alias(client, model_name, registry.CHAMPION)
        live = registry.resolve_alias(client, model_name, registry.LIVE)
    tags = champion.tags if champion else {}
    return Observed(
        router=router,
        router_healthy=healthy,
        holder=holder,
        champion=champion.version if champion else None,
        live=live.version if live else None,
        champion_verdict=tags.get(f"{registry.TAG}.rollout.verdict"),
        champion_reason=tags.get(f"{registry.TAG}.rollout.reason", ""),
    )


@mlflow_task
def served_where(server: MLflowServer, model_name: str) -> dict[str, Any]:
    """Where the model is served, as recorded with it (route, kind, serving settings)."""
    with server.session() as client:
        return registry.serving_tags(client, model_name)


@flow(name="reconcile")
def reconcile(
    model_name: Text = DEFAULT_MODEL_NAME,
    route: Text | None = None,
    gates: Gates | None = None,
    serving: Serving | None = None,
    ray_cluster: RayCluster | None = None,
    mlflow_server: MLflowServer | None = None,
    kind: TargetKind | None = None,
    llm: LLMServing | None = None,
    wait_for_ray_s: Annotated[float, Field(ge=0, le=3600)] = 600.0,
) -> ReconcileResult:
    """Bring the route to what is wanted: finish an interrupted rollout, restore a lost or
    unhealthy route through the gates, then roll `champion` out when it differs from what is
    served, unless it already failed a rollout (move `champion` to another version, or delete
    the version's `lifecycle.rollout.verdict` tag, to try again).

    Args:
        model_name: Registered model in MLflow.
        route: The Serve route that serves the model; empty: the one the model was
            registered or last rolled out with (its `lifecycle.serving.route` tag), else
            "policy". A `champion` move names only the model, so this is how it finds its
            route.
        gates: Gate settings for any rollout or recovery it runs.
        serving: Serving settings for any rollout it runs; empty: the model's recorded
            ones, else the defaults.
        ray_cluster: The Ray cluster that serves the route.
        mlflow_server: The MLflow server; the local one (http://127.0.0.1:5000) when empty.
        kind: What the route serves: "policy" or "llm"; empty: the model's recorded kind,
            else "policy".
        llm: Engine, replicas and venv of an LLM version's app (kind "llm"); empty: the
            model's recorded ones, else the defaults.
        wait_for_ray_s: How long to wait for a Ray head that does not take connections yet
            (a restarting one, whose lost route started this run) before failing.
    """
    logger = get_run_logger()
    server, cluster = mlflow_server or MLflowServer(), ray_cluster or RayCluster()
    gates = gates or Gates()
    place = served_where(server, model_name)
    route = route or place["route"] or "policy"
    kind = kind or place["kind"] or "policy"
    recorded = place["settings"] or {}
    serving = serving or Serving.model_validate(recorded.get("serving") or {})
    llm = llm or LLMServing.model_validate(recorded.get("llm") or {})
    serve_control.validate_route(route)
    if cluster.is_embedded:
        raise ValueError("reconcile needs the Ray cluster that serves the route: set its address")
    url = f"{cluster.serve_url}/{route}"
    waited = cluster.wait_reachable(wait_for_ray_s)
    if waited > 1:
        logger.info("Ray at %s took connections again after %.0f s", cluster.address, waited)
    holder = route_holder()
    steps: list[Step] = []
    found: Observed | None = None
    rollout: RolloutResult | None = None
    with cluster.connect() as joined:
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            with hold_route(route, holder, gates.lease_s) as claim:
                if claim.took_over:
                    marked = mark_crashed(claim.took_over, holder)
                    logger.warning(
                        "took route %s over from %s, whose lease lapsed; marked Crashed: %s",
                        route,
                        claim.took_over,
                        marked or "none left running",
                    )
                for _ in range(MAX_STEPS):
                    seen = observe(route, model_name, server, holder)
                    found = found or seen
                    step = next_step(seen)
                    steps.append(step)
                    logger.info("%s: %s", step.kind, step.reason)
                    if step.kind not in ACTIONS:
                        break
                    if step.kind in ("withdraw", "rebake", "reapprove"):
                        ctx = route_context(route, cluster, serving, gates, claim, kind, llm)
                        rollout = finish_interrupted(
                            ctx, seen.router, model_name, gates, server, url
                        )
                        continue
                    if step.kind == "restore" and seen.router is not None:
                        # An unhealthy or unreadable router: build the route afresh.
                        serve_control.apply(deletes={serve_control.router_app_name(route)})
                    rollout = serve_rollout(
                        model_name=model_name,
                        version=step.version,
                        route=route,
                        gates=gates,
                        serving=serving,
                        ray_cluster=cluster,
                        mlflow_server=server,
                        kind=kind,
                        llm=llm,
                    )
        finally:
            if joined is not None:
                serve_control.release()
    acted = next((s for s in steps if s.kind in ACTIONS), None)
    last = steps[-1]
    return ReconcileResult(
        action=ACTIONS[acted.kind] if acted else last.kind,
        reason="; ".join(s.reason for s in steps),
        champion=found.champion if found else None,
        live=_served(last, rollout, found),
        found=_describe(found),
        steps=[{"kind": s.kind, "reason": s.reason, "version": s.version} for s in steps],
        rollout=rollout,
    )


def _served(last: Step, rollout: RolloutResult | None, found: Observed | None) -> str | None:
    if last.kind == "in_sync":
        return last.version
    if rollout is not None and rollout.outcome != "withdrawn":
        return rollout.version
    router = found.router if found else None
    return router.live.version if router is not None and router.live is not None else None


def _describe(seen: Observed | None) -> dict[str, Any]:
    if seen is None:
        return {}
    router = seen.router
    return {
        "router": "missing"
        if router is None
        else "healthy"
        if seen.router_healthy
        else "unhealthy",
        "serves": router.live.version if router is not None and router.live else None,
        "interrupted": router.rollout.as_dict() if router is not None and router.rollout else None,
        "champion": seen.champion,
        "live": seen.live,
    }
