"""serve_rollout: a registered version reaches a stable Serve route only through gates.

candidate app -> healthy and staying healthy -> smoke -> shadow (its answers compared with
live's, no user gets one) -> canary steps through the router (sessions stay on one version)
-> [a person's approval in the Prefect UI] -> swap (MLflow alias `live` moves) -> bake ->
retire the previous version, or roll back.
A failed gate leaves the live version serving, tags the candidate with the reason, deletes
its app and fails the flow run with that reason. Rollouts on one route never overlap.
The stages are tasks (tasks.rollout.gates, tasks.rollout.changes); the rollout object
(tasks.rollout.rollout) carries what they share and ends the rollout one way.
"""

from __future__ import annotations

from prefect import flow

from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.control.canary import GateFailed
from prefect_ray_lifecycle.flows.register import DEFAULT_MODEL_NAME
from prefect_ray_lifecycle.tasks import lineage
from prefect_ray_lifecycle.tasks.params import ModelVersion, Text
from prefect_ray_lifecycle.tasks.register import record_place
from prefect_ray_lifecycle.tasks.rollout.apps import route_context
from prefect_ray_lifecycle.tasks.rollout.changes import swap, withdraw
from prefect_ray_lifecycle.tasks.rollout.claim import hold_route, route_holder
from prefect_ray_lifecycle.tasks.rollout.config import Drill, Gates, LLMServing, Serving
from prefect_ray_lifecycle.tasks.rollout.gates import deploy_candidate, smoke
from prefect_ray_lifecycle.tasks.rollout.record import heartbeat
from prefect_ray_lifecycle.tasks.rollout.rollout import (
    LiveNotRecorded,
    Rollout,
    RolloutFailed,
    RolloutResult,
    best_effort,
    resolve_version,
)
from prefect_ray_lifecycle.workloads.serve.router_config import TargetKind

__all__ = ["LiveNotRecorded", "RolloutFailed", "RolloutResult", "serve_rollout"]


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
    """Roll a registered version out to a Serve route through health, smoke and
    canary gates, swap it in, bake it, and roll back on degradation.

    Args:
        model_name: Registered model in MLflow.
        version: The version to roll out (a number: 3); empty: the version the alias
            points at.
        alias: Alias resolved (once, at the start) when no version is given.
        route: The stable route (URL prefix /<route>) whose router serves the model.
        gates: Health, smoke, shadow, canary, approval and bake settings.
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
    drill.check_kind(kind)
    server, cluster = mlflow_server or MLflowServer(), ray_cluster or RayCluster()
    serve_control.validate_route(route)
    serving.version_options()
    if cluster.is_embedded:
        raise ValueError(
            "serve_rollout needs a Ray cluster that outlives the flow run: set "
            "the RayCluster block's address (an embedded Ray stops with the run)"
        )
    version = resolve_version(server, model_name, version, alias)
    with cluster.connect() as joined:
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            with hold_route(route, route_holder(), gates.lease_s) as claim:
                ctx = route_context(route, cluster, serving, gates, claim, kind, llm)
                rollout = Rollout.begin(
                    ctx,
                    gates,
                    server,
                    model_name,
                    version,
                    f"{cluster.serve_url}/{route}",
                    kind=kind,
                    serving=serving,
                    llm=llm,
                    faults=drill.faults,
                )
                result = _roll_out(rollout, drill)
            heartbeat(route, model_name, kind, version)  # the route serves it: watch it
        finally:
            if joined is not None:  # this flow started the Ray connection: leave no handles
                serve_control.release()
    settings = {"serving": serving.model_dump(mode="json")}
    if kind == "llm":
        settings["llm"] = llm.model_dump(mode="json")
    record_place(server, model_name, route, kind, settings)
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


def _roll_out(rollout: Rollout, drill: Drill) -> RolloutResult:
    """The gates in order; every ending leaves through the rollout object."""
    r, route, version = rollout, rollout.route, rollout.version
    candidate, live = r.candidate, r.live
    if r.already_live:
        r.add("check", "already live", f"v{version} already serves /{route}")
        return r.finish(
            "already_live",
            "already live",
            "nothing to do",
            verdict={"app": candidate.app},
            move_live_to=version,
            live_reason=f"already served on /{route}",
            chart=False,
        )
    try:
        r.add(
            "health",
            "passed",
            deploy_candidate(
                r.app_config, candidate, r.health_period_s, r.gates, first=live is None
            ),
        )
        r.add("smoke", "passed", smoke(candidate, r.gates))
        if live is None:
            swapped = swap(r.ctx, candidate, None)
            r.add("router", "created", f"/{route} serves v{version}", swapped.figures())
            reason = "first rollout: health and smoke gates passed"
            r.move_live("promoted", reason)
            return r.finish(
                "first_rollout",
                "first rollout",
                f"v{version} serves /{route} (first rollout)",
                verdict={"verdict": "promoted", "app": candidate.app, "reason": reason},
                event=("promoted", {"first": True, "url": r.url}),
            )
        r.shadow()
        r.gate_traffic(r.gates.canary_steps)
    except GateFailed as failure:
        withdraw(r.ctx, live, candidate.app)
        r.fail(failure, "rejected", live)
    except LiveNotRecorded:  # the swap undid itself
        raise
    except BaseException:
        best_effort(withdraw, r.ctx, live, candidate.app)
        raise

    return r.swap_then_bake(drill.after_swap)
