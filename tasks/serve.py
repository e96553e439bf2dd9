"""Prefect tasks for Serve rollouts: one task per rollout stage. They run in the flow process,
which is a Ray driver connected through the RayCluster block; Serve is driven with
declarative app configs (workloads.serve_control), the router's traffic and version by its
user_config, and every decision reads the router's own per-version request figures."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.events import emit_event
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.runtime import flow_run

from blocks import MLflowServer
from tasks.register import mlflow_task
from tasks.serve_config import Gates, Serving
from workloads import registry, serve_control
from workloads.canary import GateFailed, Judgement, early_failure, judge, judge_llm
from workloads.constants import POLICY_DEPLOYMENT
from workloads.router import RouterConfig, Target

LIVE = registry.LIVE
# Rollout stages talk to a live cluster: never served from a cache.
rollout_stage = task(cache_policy=NO_CACHE)


@rollout_stage
def deploy_candidate(
    config: dict[str, Any], target: Target, health_period_s: float, gates: Gates
) -> dict[str, Any]:
    """Gate 1: deploy the version's app; RUNNING, every replica healthy, and staying so."""
    app = target.app
    serve_control.apply({app: config})
    # The window spans at least three of Serve's health checks: one look is not health.
    window_s = max(gates.stability_window_s, 3 * health_period_s)
    report = serve_control.wait_stable(
        app, target.deployment, timeout_s=gates.health_timeout_s, window_s=window_s, probe=True
    )
    figures = {
        "seconds": round(report.seconds, 1),
        "replicas": report.replicas,
        "checks": report.checks,
        "timeline": report.timeline,
    }
    if not report.healthy:
        raise GateFailed("health", report.reason, figures)
    get_run_logger().info("health gate passed for %s: %s", app, report.reason)
    return {**figures, "reason": report.reason}


@rollout_stage
def smoke(target: Target, gates: Gates) -> dict[str, Any]:
    """Gate 2: golden observations through the candidate's handle: valid actions, fast (an
    LLM version: a real completion, not empty, inside the latency bound)."""
    if target.kind == "llm":
        return _smoke_llm(target, gates)
    handle = serve_control.handle(target.app, target.deployment)
    describe = handle.describe.remote().result(timeout_s=30)
    shape = describe["observation_shape"]
    observations = gates.smoke_observations
    if not observations:
        observations = np.random.default_rng(0).uniform(-0.5, 0.5, (8, *shape)).tolist()
    latencies = []
    try:
        for observation in observations:
            started = time.perf_counter()
            answer = handle.predict.remote([observation]).result(timeout_s=30)
            latencies.append((time.perf_counter() - started) * 1000)
            if len(answer["actions"]) != 1:
                raise RuntimeError(f"expected one action, got {answer['actions']!r}")
    except Exception as error:
        raise GateFailed("smoke", f"{type(error).__name__}: {str(error)[-300:]}") from None
    slowest = max(latencies)
    figures = {
        "observations": len(observations),
        "max_ms": round(slowest, 1),
        "p50_ms": round(sorted(latencies)[len(latencies) // 2], 1),
    }
    if slowest > gates.smoke_max_latency_ms:
        raise GateFailed(
            "smoke",
            f"slowest answer {slowest:.0f} ms is above {gates.smoke_max_latency_ms:g} ms",
            figures,
        )
    return {**figures, "reason": f"{len(observations)} valid actions, slowest {slowest:.1f} ms"}


def _smoke_llm(target: Target, gates: Gates) -> dict[str, Any]:
    handle = serve_control.handle(target.app, target.deployment)
    body = {"prompt": gates.smoke_prompt, "max_tokens": gates.smoke_max_tokens, "temperature": 0}
    started = time.perf_counter()
    try:
        answer = handle.handle_http.remote(
            {
                "method": "POST",
                "path": "/v1/completions",
                "query": "",
                "headers": {"content-type": "application/json"},
                "body": json.dumps(body).encode(),
            }
        ).result(timeout_s=120)
    except Exception as error:
        raise GateFailed("smoke", f"{type(error).__name__}: {str(error)[-300:]}") from None
    elapsed = (time.perf_counter() - started) * 1000
    try:
        payload = json.loads(answer["body"])
        text = payload["choices"][0]["text"]
        tokens = payload["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise GateFailed(
            "smoke", f"completion answered {answer['status']}: {answer['body'][:300]!r}"
        ) from None
    figures = {
        "status": answer["status"],
        "completion_tokens": tokens,
        "latency_ms": round(elapsed, 1),
    }
    if answer["status"] != 200 or not tokens:
        raise GateFailed(
            "smoke", f"completion answered {answer['status']} with {tokens} tokens", figures
        )
    if elapsed > gates.smoke_max_latency_ms:
        raise GateFailed(
            "smoke",
            f"completion took {elapsed:.0f} ms, above {gates.smoke_max_latency_ms:g} ms",
            figures,
        )
    return {**figures, "reason": f"{tokens} tokens ({text[:40]!r}) in {elapsed:.0f} ms"}


def _llm_stats(target: Target, reset: bool = False) -> dict[str, Any] | None:
    """An LLM app's own figures (one replica's: tokens/s and time to first token)."""
    try:
        stats = (
            serve_control.handle(target.app, target.deployment)
            .stats.remote(reset)
            .result(timeout_s=30)
        )
    except Exception:
        return None
    return {
        "ttft_p99_ms": stats["ttft_ms"]["p99"],
        "tokens_per_s_p50": stats["tokens_per_s"]["p50"],
        "completion_tokens": stats["completion_tokens"],
    }


@rollout_stage
def canary_step(
    route: str,
    weight: float,
    live: Target,
    candidate: Target,
    gates: Gates,
    runtime_env: dict[str, Any],
    serving: Serving,
    inline_live: bool,
) -> dict[str, Any]:
    """Gate 3 (one step): send `weight` of the traffic to the candidate, hold, judge. Live
    traffic stays where it was (in the router's replicas when `inline_live`)."""
    config = RouterConfig(
        live=live,
        candidate=candidate,
        candidate_weight=weight,
        inline_live=inline_live,
        timeout_s=gates.request_timeout_s,
    )
    started = time.time()
    llm = candidate.kind == "llm"
    if llm:
        _llm_stats(candidate, reset=True)
        _llm_stats(live, reset=True)
    serve_control.write_router(route, config, runtime_env, serving.router_options())
    thresholds = gates.thresholds
    deadline = started + gates.canary_max_wait_s
    while True:
        time.sleep(0.5)
        stats = serve_control.route_stats(route, started)
        candidate_figures = stats.get(candidate.version)
        early = early_failure(candidate_figures, thresholds)
        if early is not None:
            raise GateFailed(
                "canary",
                f"at {weight:.0%}: {early.reason}",
                {"weight": weight, "candidate": candidate_figures, "live": stats.get(live.version)},
            )
        held = time.time() - started
        enough = (candidate_figures or {}).get("requests", 0) >= thresholds.min_requests
        if held >= gates.canary_hold_s and enough:
            break
        if time.time() > deadline:
            raise GateFailed(
                "canary",
                f"at {weight:.0%}: only {(candidate_figures or {}).get('requests', 0)} "
                f"requests in {held:.0f} s, fewer than the "
                f"{thresholds.min_requests} needed",
                {"weight": weight},
            )
    verdict: Judgement = judge(candidate_figures, stats.get(live.version), thresholds)
    figures = {
        "weight": weight,
        "held_s": round(time.time() - started, 1),
        "candidate": candidate_figures,
        "live": stats.get(live.version),
    }
    if verdict.ok is False:
        raise GateFailed("canary", f"at {weight:.0%}: {verdict.reason}", figures)
    if llm:
        figures["candidate_llm"] = _llm_stats(candidate)
        figures["live_llm"] = _llm_stats(live)
        slow = judge_llm(
            figures["candidate_llm"],
            figures["live_llm"],
            gates.max_ttft_ms,
            gates.min_tokens_per_s_ratio,
        )
        if slow:
            raise GateFailed("canary", f"at {weight:.0%}: {slow}", figures)
    get_run_logger().info("canary %.0f%% passed: %s", weight * 100, verdict.reason)
    return {
        **figures,
        "reason": verdict.reason
        if verdict.ok
        else f"inconclusive, passed on time: {verdict.reason}",
    }


@rollout_stage
def swap(
    route: str,
    candidate: Target,
    gates: Gates,
    runtime_env: dict[str, Any],
    serving: Serving,
    inline: bool,
) -> dict[str, Any]:
    """Gate 4: the router sends all traffic to the candidate (its own app until the bake
    ends; in the router's replicas at once when `inline`, as on a first rollout)."""
    started = time.time()
    config = serve_control.write_router(
        route,
        RouterConfig(live=candidate, inline_live=inline, timeout_s=gates.request_timeout_s),
        runtime_env,
        serving.router_options(),
        wait_s=120 if inline else 60,
        inline_version=candidate.version if inline else None,
    )
    return {
        "generation": config.generation,
        "seconds": round(time.time() - started, 2),
        "at": started,
    }


@rollout_stage
def inject(app: str, faults: dict[str, Any]) -> None:
    """A drill's faults, applied to one version's app in place."""
    config = serve_control.app_configs()[app]
    serve_control.apply(
        {app: serve_control.with_user_config(config, POLICY_DEPLOYMENT, {"faults": faults})}
    )


@rollout_stage
def bake(route: str, live: Target, gates: Gates, since: float) -> dict[str, Any]:
    """Gate 5: watch the new live version for the bake period over a sliding window."""
    thresholds = replace(gates.thresholds, min_requests=max(gates.canary_min_requests, 10))
    started = time.time()
    while time.time() - started < gates.bake_s:
        time.sleep(0.5)
        now = time.time()
        stats = serve_control.route_stats(route, max(since, now - gates.bake_window_s), now)
        verdict = judge(stats.get(live.version), None, thresholds)
        if verdict.ok is False:
            raise GateFailed(
                "bake",
                f"{verdict.reason} {now - since:.1f} s after the swap",
                {"window": stats.get(live.version), "detected_at": now},
            )
    total = serve_control.route_stats(route, since).get(live.version)
    return {
        "seconds": round(time.time() - started, 1),
        "figures": total,
        "reason": f"stable for {gates.bake_s:g} s",
    }


@rollout_stage
def retire(
    route: str,
    live: Target,
    previous_app: str | None,
    gates: Gates,
    runtime_env: dict[str, Any],
    serving: Serving,
) -> dict[str, Any]:
    """After the bake: the router hosts the live version in process (no extra hop), then the
    previous version's app is deleted."""
    logger = get_run_logger()
    inline_ok = live.kind == "policy"  # an LLM version is always reached through its app
    try:
        if inline_ok:
            serve_control.write_router(
                route,
                RouterConfig(live=live, inline_live=True, timeout_s=gates.request_timeout_s),
                runtime_env,
                serving.router_options(),
                wait_s=120,
                inline_version=live.version,
            )
    except RuntimeError as error:  # keep forwarding to the live app; serving is unaffected
        inline_ok = False
        logger.warning("router %s still forwards to v%s: %s", route, live.version, error)
    if previous_app and previous_app != live.app:
        serve_control.apply(deletes={previous_app})
    return {"inline": inline_ok, "deleted": previous_app}


@rollout_stage
def rollback(
    route: str,
    previous: Target,
    candidate_app: str,
    gates: Gates,
    runtime_env: dict[str, Any],
    serving: Serving,
) -> dict[str, Any]:
    """Route everything back to the previous version, then delete the candidate's app."""
    started = time.time()
    serve_control.write_router(
        route,
        RouterConfig(
            live=previous, inline_live=previous.kind == "policy", timeout_s=gates.request_timeout_s
        ),
        runtime_env,
        serving.router_options(),
    )
    seconds = time.time() - started
    serve_control.apply(deletes={candidate_app})
    return {"seconds": round(seconds, 2)}


@rollout_stage
def withdraw(
    route: str,
    live: Target | None,
    candidate_app: str,
    gates: Gates,
    runtime_env: dict[str, Any],
    serving: Serving,
) -> dict[str, Any]:
    """After a failed gate: the router serves only the live version again (untouched when it
    never saw the candidate), then the candidate's app is deleted."""
    current = serve_control.current_router(route)
    if (
        current is not None
        and live is not None
        and (current.candidate is not None or current.live != live)
    ):
        serve_control.write_router(
            route,
            RouterConfig(
                live=live,
                inline_live=current.inline_live and current.live == live,
                timeout_s=gates.request_timeout_s,
            ),
            runtime_env,
            serving.router_options(),
        )
    if candidate_app != (live.app if live else None):
        serve_control.apply(deletes={candidate_app})
    return {"deleted": candidate_app}


@mlflow_task
def record(
    mlflow_server: MLflowServer,
    model_name: str,
    version: str,
    verdict: dict[str, Any],
    move_live_to: str | None = None,
    reason: str = "",
) -> str | None:
    """Tag the version with the rollout's verdict; move `live` when asked (with history).
    Returns the previous `live` version when it moved."""
    actor = f"prefect flow run {flow_run.id}"
    with mlflow_server.session() as client:
        registry.tag_verdict(
            client,
            model_name,
            version,
            "rollout",
            {**verdict, "flow_run_id": str(flow_run.id or ""), "by": actor},
        )
        if move_live_to is not None:
            current = registry.resolve_alias(client, model_name, LIVE)
            if current is None or current.version != str(move_live_to):
                return registry.move_alias(
                    client, model_name, LIVE, str(move_live_to), reason=reason, actor=actor
                )
    return None


def emit(outcome: str, model_name: str, version: str, route: str, payload: dict[str, Any]) -> None:
    """A Prefect event for automations: ray-lifecycle.rollout.<outcome>."""
    emit_event(
        event=f"ray-lifecycle.rollout.{outcome}",
        resource={
            "prefect.resource.id": f"mlflow.model-version.{model_name}.{version}",
            "prefect.resource.name": f"{model_name} v{version}",
            "ray-lifecycle.route": route,
        },
        payload=payload,
    )


def ensure_rollout_limit(route: str) -> str:
    """The global concurrency limit that keeps rollouts on one route from overlapping
    (deployments/ creates it too); returns its name."""
    name = f"serve-rollout-{route}"
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1)
                )
            except ObjectAlreadyExists:
                pass
    return name
