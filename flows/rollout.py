"""serve_rollout: a registered policy version reaches a stable Serve route only through gates.

candidate app -> healthy and staying healthy -> smoke -> canary steps through the router
-> swap (MLflow alias `live` moves) -> bake -> retire the previous version, or roll back.
A failed gate leaves the live version serving, tags the candidate with the reason, deletes
its app and fails the flow run with that reason. Rollouts on one route never overlap.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.concurrency.sync import concurrency
from pydantic import BaseModel, Field

from blocks import MLflowServer, RayCluster
from flows.register import DEFAULT_MODEL_NAME
from tasks import lineage
from tasks.serve import (
    bake,
    canary_step,
    deploy_candidate,
    emit,
    ensure_rollout_limit,
    inject,
    record,
    retire,
    rollback,
    smoke,
    swap,
    withdraw,
)
from tasks.serve_apps import serving_runtime_env, version_app
from tasks.serve_config import Drill, Gates, LLMServing, Serving
from workloads import registry, serve_control
from workloads.canary import GateFailed
from workloads.router import TargetKind


class RolloutFailed(RuntimeError):
    """The candidate was rejected or rolled back; the live version kept serving."""


class RolloutResult(BaseModel):
    model_name: str
    version: str
    route: str
    outcome: str = Field(description="promoted, first_rollout or already_live.")
    reason: str
    url: str = Field(description="The route's URL.")
    previous_version: str | None = None
    timeline: list[dict[str, Any]] = Field(default_factory=list)


class Timeline:
    def __init__(self, model_name: str, version: str, route: str):
        self.title = f"Rollout of {model_name} v{version} on /{route}"
        self.started = time.monotonic()
        self.entries: list[dict[str, Any]] = []

    def add(self, stage: str, outcome: str, detail: str, figures: dict | None = None) -> None:
        self.entries.append(
            {
                "at_s": round(time.monotonic() - self.started, 1),
                "stage": stage,
                "outcome": outcome,
                "detail": detail,
                "figures": {
                    k: v
                    for k, v in (figures or {}).items()
                    if k not in ("timeline", "reason", "at")
                },
            }
        )
        get_run_logger().info("%s: %s (%s)", stage, outcome, detail)

    def publish(self, decision: str) -> None:
        rows = "\n".join(
            f"| {e['at_s']:.1f} s | {e['stage']} | {e['outcome']} | {e['detail']} | "
            f"{_figures(e['figures'])} |"
            for e in self.entries
        )
        create_markdown_artifact(
            key="rollout",
            markdown=(
                f"## {self.title}\n\n**Decision: {decision}**\n\n"
                f"| at | stage | outcome | detail | figures |\n|---|---|---|---|---|\n"
                f"{rows}\n\n_{datetime.now(UTC).isoformat(timespec='seconds')}_"
            ),
            description=f"{self.title}: {decision}",
        )


def _figures(figures: dict[str, Any]) -> str:
    parts = []
    for key, value in figures.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={_round(v)}" for k, v in value.items())
            parts.append(f"{key}: {value}")
        elif value is not None:
            parts.append(f"{key}={_round(value)}")
    return "; ".join(parts).replace("|", "/")


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


@flow(name="serve-rollout", log_prints=True)
def serve_rollout(
    model_name: str = DEFAULT_MODEL_NAME,
    version: str | None = None,
    alias: str = registry.CHAMPION,
    route: str = "policy",
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
        version: The version to roll out; empty: the version the alias points at.
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
    with concurrency(ensure_rollout_limit(route), occupy=1), cluster.connect() as joined:
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            result = _rollout(
                model_name, version, route, gates, serving, drill, cluster, server, kind, llm
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
    model_name: str,
    version: str,
    route: str,
    gates: Gates,
    serving: Serving,
    drill: Drill,
    cluster: RayCluster,
    server: MLflowServer,
    kind: TargetKind,
    llm: LLMServing,
) -> RolloutResult:
    timeline = Timeline(model_name, version, route)
    env = serving_runtime_env(cluster)
    app_config, candidate, health_period_s = version_app(
        kind, server, model_name, version, serving, llm, drill.faults, env
    )
    router = serve_control.current_router(route)
    live = router.live if router else None
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
        timeline.publish("nothing to do")
        return RolloutResult(
            outcome="already_live", reason="already live", timeline=timeline.entries, **result
        )

    stage_figures: dict[str, Any] = {}
    try:
        health = deploy_candidate(app_config, candidate, health_period_s, gates)
        timeline.add("health", "passed", health["reason"], health)
        smoked = smoke(candidate, gates)
        timeline.add("smoke", "passed", smoked["reason"], smoked)
        if live is None:
            swapped = swap(route, candidate, gates, env, serving, inline=candidate.kind == "policy")
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
                outcome="first_rollout", reason="first rollout", timeline=timeline.entries, **result
            )
        for weight in gates.canary_steps:
            step = canary_step(
                route,
                weight,
                live,
                candidate,
                gates,
                env,
                serving,
                router.inline_live and live.kind == "policy",
            )
            timeline.add(f"canary {weight:.0%}", "passed", step["reason"], step)
    except GateFailed as failure:
        withdraw(route, live, candidate.app, gates, env, serving)
        return _reject(failure, "rejected", timeline, server, result, live)
    except BaseException:
        _best_effort(withdraw, route, live, candidate.app, gates, env, serving)
        raise

    swapped = swap(route, candidate, gates, env, serving, inline=False)
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
    try:
        baked = bake(route, candidate, gates, swapped["at"])
    except GateFailed as failure:
        undone = rollback(route, live, candidate.app, gates, env, serving)
        detected = failure.figures.get("detected_at")
        stage_figures = {
            "seconds_to_rollback": round(time.time() - detected, 2) if detected else None,
            **undone,
        }
        timeline.add("rollback", "done", f"/{route} -> v{live.version}", stage_figures)
        return _reject(failure, "rolled_back", timeline, server, result, live)
    except BaseException:
        _best_effort(rollback, route, live, candidate.app, gates, env, serving)
        raise
    timeline.add("bake", "passed", baked["reason"], baked.get("figures") or {})
    retired = retire(route, candidate, live.app, gates, env, serving)
    timeline.add(
        "retire",
        "done",
        f"v{live.version}'s app deleted; router hosts v{version} "
        f"{'in process' if retired['inline'] else 'through its app'}",
        retired,
    )
    record(
        server,
        model_name,
        version,
        {"verdict": "promoted", "route": route, "app": candidate.app, "reason": baked["reason"]},
    )
    emit("promoted", model_name, version, route, {"previous": live.version, "url": url})
    timeline.publish(f"v{version} replaced v{live.version} on /{route}")
    return RolloutResult(
        outcome="promoted", reason=baked["reason"], timeline=timeline.entries, **result
    )


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


def _best_effort(stage, *args) -> None:
    try:
        stage(*args)
    except Exception as error:  # the original error matters more
        get_run_logger().error("cleanup %s failed: %r", stage.name, error)
