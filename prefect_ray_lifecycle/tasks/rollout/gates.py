"""The rollout's gates as Prefect tasks: the candidate's health, a smoke test, a shadow
stage (its answers compared with live's), canary steps and the bake. They run in the flow
process, a Ray driver connected through the RayCluster block, and every judgement reads the
router's own figures (workloads.serve.route_state). The stages that change what the route
serves are in tasks.rollout.changes."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from prefect import get_run_logger

from prefect_ray_lifecycle.control import serve_control
from prefect_ray_lifecycle.control.canary import (
    GateFailed,
    Judgement,
    early_failure,
    early_shadow_failure,
    judge,
    judge_llm,
    judge_shadow,
)
from prefect_ray_lifecycle.tasks.rollout import StageResult, rollout_stage
from prefect_ray_lifecycle.tasks.rollout.apps import RouteContext
from prefect_ray_lifecycle.tasks.rollout.config import Gates
from prefect_ray_lifecycle.workloads.constants import ROUTER_DEPLOYMENT
from prefect_ray_lifecycle.workloads.serve.route_state import route_figures, route_shadow
from prefect_ray_lifecycle.workloads.serve.router_config import Shadow, Target

__all__ = [
    "BakeResult",
    "CanaryResult",
    "HealthResult",
    "ShadowResult",
    "SmokeResult",
    "bake",
    "canary_step",
    "deploy_candidate",
    "shadow",
    "shadow_tags",
    "smoke",
]


@dataclass(frozen=True, kw_only=True)
class HealthResult(StageResult):
    seconds: float
    replicas: int
    checks: int
    timeline: list[str]


@dataclass(frozen=True, kw_only=True)
class SmokeResult(StageResult):
    observations: int | None = None  # a policy: golden observations answered
    max_ms: float | None = None
    p50_ms: float | None = None
    status: int | None = None  # an LLM version: the completion's status and tokens
    completion_tokens: int | None = None
    latency_ms: float | None = None


@dataclass(frozen=True, kw_only=True)
class ShadowResult(StageResult):
    share: float
    applied_s: float  # from the stage's start until every router replica made copies
    held_s: float  # since then
    candidate: dict[str, Any] | None  # the shadow's figures of the candidate's copies
    noise_floor: dict[str, Any] | None = None  # live's own app against live, the same way
    inconclusive: bool = False


def shadow_tags(figures: dict[str, Any]) -> dict[str, Any]:
    """What the version's MLflow tags keep of a shadow stage's figures (passed or failed):
    `lifecycle.rollout.shadow_*`."""
    ours, floor = figures.get("candidate") or {}, figures.get("noise_floor") or {}
    tags = {
        "shadow_agreement": ours.get("agreement"),
        "shadow_copies": ours.get("copies", 0),
        "shadow_errors": ours.get("errors", 0),
        "shadow_dropped": ours.get("dropped", 0),
        "shadow_tvd": ours.get("tvd"),
        "shadow_token_prefix": ours.get("token_prefix"),
        "shadow_noise_floor": floor.get("agreement"),
    }
    return {k: v for k, v in tags.items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class CanaryResult(StageResult):
    weight: float
    applied_s: float  # from the step's start until every router replica served its share
    held_s: float  # since then
    candidate: dict[str, Any] | None  # the router's figures of each version in the step
    live: dict[str, Any] | None
    candidate_llm: dict[str, Any] | None = None  # an LLM version's own tokens/s and TTFT
    live_llm: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class BakeResult(StageResult):
    seconds: float
    totals: dict[str, Any] | None  # the new version's figures over the whole bake

    def figures(self) -> dict[str, Any]:
        return dict(self.totals or {})


@rollout_stage
def deploy_candidate(
    config: dict[str, Any],
    target: Target,
    health_period_s: float,
    gates: Gates,
    *,
    first: bool = False,
) -> HealthResult:
    """Gate 1: deploy the version's app; RUNNING, every replica healthy, and staying so.

    A `first` rollout (nothing serves the route yet) needs no stability window: every replica
    RUNNING and answering its health probe twice, 0.5 s apart, and the smoke gate after it;
    there is no live version whose users a flapping candidate could take, so the window would
    only keep the route dark longer (Argo Rollouts and Flagger skip their analysis on a first
    deploy too). Every later rollout holds the window."""
    app = target.app
    serve_control.apply({app: config})
    # The window spans at least three of Serve's health checks: one look is not health.
    window_s = 0.0 if first else max(gates.stability_window_s, 3 * health_period_s)
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
    return HealthResult(**figures, reason=report.reason)


@rollout_stage
def smoke(target: Target, gates: Gates) -> SmokeResult:
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
    return SmokeResult(
        **figures, reason=f"{len(observations)} valid actions, slowest {slowest:.1f} ms"
    )


def _smoke_llm(target: Target, gates: Gates) -> SmokeResult:
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
    return SmokeResult(**figures, reason=f"{tokens} tokens ({text[:40]!r}) in {elapsed:.0f} ms")


def _llm_stats(route: str, target: Target, reset: bool = False) -> dict[str, Any] | None:
    """An LLM version's own figures (one replica's: tokens/s and time to first token): the
    router's when it hosts the version (its app then sees no traffic), else its app's."""
    try:
        router = serve_control.handle(serve_control.router_app_name(route), ROUTER_DEPLOYMENT)
        stats = router.llm_stats.remote(target.version, reset).result(timeout_s=30)
    except Exception:  # a router that hosts nothing it can report on
        stats = None
    try:
        if stats is None:
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
def shadow(
    ctx: RouteContext, gates: Gates, live: Target, candidate: Target, inline_live: bool
) -> ShadowResult:
    """Gate 3: users keep getting live's answers while the router copies `shadow_share` of
    their requests to the candidate (sent off their path, by each replica's mirror) and
    compares each pair; hold, then judge agreement, errors and p99 against live's on the same
    requests. The copies flow only while this rollout holds the route's lease."""
    noise_floor = gates.noise_floor(candidate.kind)
    config = ctx.config(
        live=live,
        candidate=candidate,
        inline_live=inline_live,
        shadow=Shadow(gates.shadow_share, gates.shadow_max_per_s, noise_floor),
        rollout=ctx.record("shadow", candidate.version),
    )
    started = time.time()
    ctx.write(config)
    applied_s = round(time.time() - started, 2)
    thresholds = gates.shadow_thresholds(candidate.kind)
    deadline = started + gates.shadow_max_wait_s

    def figures() -> dict[str, Any]:
        seen = route_shadow(ctx.route, started)
        return {
            "share": gates.shadow_share,
            "applied_s": applied_s,
            # Held from when every router replica made copies, not from the write.
            "held_s": round(time.time() - started - applied_s, 1),
            "candidate": seen["candidate"].get(candidate.version),
            "noise_floor": seen["noise_floor"].get(live.version) if noise_floor else None,
        }

    while True:
        time.sleep(0.5)
        ctx.claim.check()
        seen = figures()
        early = early_shadow_failure(seen["candidate"], thresholds)
        if early is not None:
            raise GateFailed("shadow", early.reason, seen)
        copies = (seen["candidate"] or {}).get("copies", 0)
        if seen["held_s"] >= gates.shadow_hold_s and copies >= thresholds.min_requests:
            break
        if time.time() > deadline:
            reason = (
                f"only {copies} shadow copies in {seen['held_s']:.0f} s, fewer than the "
                f"{thresholds.min_requests} needed"
            )
            if gates.shadow_too_few == "reject":
                raise GateFailed("shadow", reason, seen)
            return ShadowResult(**seen, inconclusive=True, reason=f"inconclusive: {reason}")
    seen = figures()
    verdict = judge_shadow(seen["candidate"], thresholds, seen["noise_floor"])
    if verdict.ok is False:
        raise GateFailed("shadow", verdict.reason, seen)
    get_run_logger().info("shadow passed: %s", verdict.reason)
    return ShadowResult(**seen, reason=verdict.reason)


@rollout_stage
def canary_step(
    ctx: RouteContext,
    gates: Gates,
    weight: float,
    live: Target,
    candidate: Target,
    inline_live: bool,
) -> CanaryResult:
    """Gate 3 (one step): send `weight` of the traffic to the candidate, hold, judge. Live
    traffic stays where it was (in the router's replicas when `inline_live`). The share is
    served only while this rollout holds the route's lease."""
    config = ctx.config(
        live=live,
        candidate=candidate,
        candidate_weight=weight,
        inline_live=inline_live,
        rollout=ctx.record("canary", candidate.version),
    )
    started = time.time()
    llm = candidate.kind == "llm"
    if llm:
        _llm_stats(ctx.route, candidate, reset=True)
        _llm_stats(ctx.route, live, reset=True)
    ctx.write(config)
    applied_s = round(time.time() - started, 2)
    thresholds = gates.thresholds
    deadline = started + gates.canary_max_wait_s
    while True:
        time.sleep(0.5)
        ctx.claim.check()
        stats = route_figures(ctx.route, started)
        candidate_figures = stats.get(candidate.version)
        early = early_failure(candidate_figures, thresholds)
        if early is not None:
            raise GateFailed(
                "canary",
                f"at {weight:.0%}: {early.reason}",
                {"weight": weight, "candidate": candidate_figures, "live": stats.get(live.version)},
            )
        held = time.time() - started - applied_s  # since every router replica serves it
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
        "applied_s": applied_s,
        "held_s": round(time.time() - started - applied_s, 1),
        "candidate": candidate_figures,
        "live": stats.get(live.version),
    }
    if verdict.ok is False:
        raise GateFailed("canary", f"at {weight:.0%}: {verdict.reason}", figures)
    if llm:
        figures["candidate_llm"] = _llm_stats(ctx.route, candidate)
        figures["live_llm"] = _llm_stats(ctx.route, live)
        slow = judge_llm(
            figures["candidate_llm"],
            figures["live_llm"],
            gates.max_ttft_ms,
            gates.min_tokens_per_s_ratio,
        )
        if slow:
            raise GateFailed("canary", f"at {weight:.0%}: {slow}", figures)
    get_run_logger().info("canary %.0f%% passed: %s", weight * 100, verdict.reason)
    reason = verdict.reason if verdict.ok else f"inconclusive, passed on time: {verdict.reason}"
    return CanaryResult(**figures, reason=reason)


@rollout_stage
def bake(ctx: RouteContext, gates: Gates, live: Target, since: float) -> BakeResult:
    """Gate 5: watch the new live version for the bake period over a sliding window."""
    thresholds = replace(gates.thresholds, min_requests=max(gates.canary_min_requests, 10))
    started = time.time()
    while time.time() - started < gates.bake_s:
        time.sleep(0.5)
        ctx.claim.check()
        now = time.time()
        stats = route_figures(ctx.route, max(since, now - gates.bake_window_s), now)
        verdict = judge(stats.get(live.version), None, thresholds)
        if verdict.ok is False:
            raise GateFailed(
                "bake",
                f"{verdict.reason} {now - since:.1f} s after the swap",
                {"window": stats.get(live.version), "detected_at": now},
            )
    return BakeResult(
        seconds=round(time.time() - started, 1),
        totals=route_figures(ctx.route, since).get(live.version),
        reason=f"stable for {gates.bake_s:g} s",
    )
