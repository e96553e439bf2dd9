"""Prefect tasks for Serve rollouts: one task per rollout stage. They run in the flow process,
which is a Ray driver connected through the RayCluster block; Serve is driven with
declarative app configs (workloads.serve_control), the router's traffic and version by its
user_config, and every decision reads the router's own per-version request figures."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import BaseModel, Field, model_validator

from blocks import MLflowServer, RayCluster
from blocks.ray_cluster import PROJECT_PACKAGES
from tasks.register import mlflow_task
from workloads import registry
from workloads import serve_control as sc
from workloads.canary import Judgement, Thresholds, early_failure, judge
from workloads.router import RouterConfig, Target
from workloads.serving import Faults, serving_options

LIVE = registry.LIVE
LLM_DEPLOYMENT = "LLMServer"
# Stages talk to a live cluster: never served from a cache.
stage = task(cache_policy=NO_CACHE)


class GateFailed(RuntimeError):
    """A rollout gate said no; `stage` names the gate and the message the reason."""

    def __init__(self, stage: str, reason: str, figures: dict[str, Any] | None = None):
        super().__init__(f"{stage}: {reason}")
        self.stage = stage
        self.reason = reason
        self.figures = figures or {}

    def __reduce__(self):
        return (GateFailed, (self.stage, self.reason, self.figures))


class Gates(BaseModel):
    """How a candidate must behave to replace the live version."""

    health_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for the candidate's "
        "replicas to be RUNNING and healthy (Serve has no limit).",
    )
    stability_window_s: float = Field(
        10.0,
        ge=0,
        description="How long every replica must stay "
        "healthy, unreplaced, before the health gate passes.",
    )
    smoke_observations: list[list[float]] = Field(
        default_factory=list,
        description="Golden observations for the smoke gate; empty: "
        "observations sampled inside the model's observation space.",
    )
    smoke_max_latency_ms: float = Field(2000.0, gt=0, description="Slowest smoke answer allowed.")
    canary_steps: list[float] = Field(
        default_factory=lambda: [0.1, 0.5],
        description="Traffic shares sent to the candidate, in order, each a fraction in (0, 1).",
    )
    canary_hold_s: float = Field(20.0, ge=0, description="How long each canary step is held.")
    canary_min_requests: int = Field(
        0,
        ge=0,
        description="Requests the candidate must answer "
        "in a step before it is judged; 0 judges whatever came.",
    )
    canary_max_wait_s: float = Field(
        300.0,
        gt=0,
        description="Longest a step waits for its minimum requests before the rollout is aborted.",
    )
    max_error_rate: float = Field(0.01, ge=0, le=1, description="Highest share of 5xx answers.")
    max_p99_ms: float = Field(1000.0, gt=0, description="Highest p99 latency through the router.")
    max_p99_ratio: float = Field(
        3.0,
        ge=1,
        description="Highest candidate p99 as a multiple of "
        "the live version's, in the same window.",
    )
    p99_slack_ms: float = Field(
        50.0,
        ge=0,
        description="Added to max_p99_ratio x live p99 "
        "before a candidate is judged slower than live.",
    )
    bake_s: float = Field(
        30.0,
        ge=0,
        description="How long the new live version is watched "
        "after the swap; the previous version stays up until it ends.",
    )
    bake_window_s: float = Field(5.0, gt=0, description="Sliding window judged during the bake.")
    request_timeout_s: float = Field(
        10.0, gt=0, description="The router's per-request timeout (504 after it)."
    )
    smoke_prompt: str = Field(
        "Hello",
        min_length=1,
        description="LLM versions: the smoke "
        "gate's completion prompt (the answer must not be empty).",
    )
    smoke_max_tokens: int = Field(8, ge=1, description="LLM versions: tokens the smoke asks for.")
    max_ttft_ms: float = Field(
        5000.0, gt=0, description="LLM versions: highest p99 time to first token in a canary step."
    )
    min_tokens_per_s_ratio: float = Field(
        0.5, ge=0, description="LLM versions: lowest candidate tokens/s (p50) as a share of live's."
    )

    @model_validator(mode="after")
    def _check(self) -> Gates:
        if any(not 0 < s < 1 for s in self.canary_steps):
            raise ValueError(f"canary_steps must be fractions in (0, 1), got {self.canary_steps}")
        if self.canary_steps != sorted(self.canary_steps):
            raise ValueError(f"canary_steps must increase, got {self.canary_steps}")
        for observation in self.smoke_observations:
            if not observation:
                raise ValueError("smoke_observations must not hold an empty observation")
        return self

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(
            self.max_error_rate,
            self.max_p99_ms,
            self.max_p99_ratio,
            self.canary_min_requests,
            self.p99_slack_ms,
        )


class Serving(BaseModel):
    """How a version's Serve application runs (each version is its own app)."""

    num_replicas: int = Field(1, ge=1, description="Replicas when autoscaling is empty.")
    autoscaling: dict[str, Any] | None = Field(
        None,
        description="Serve autoscaling_config "
        "(min_replicas, max_replicas, "
        "target_ongoing_requests, ...).",
    )
    num_cpus: float = Field(0.25, ge=0, description="CPUs per replica (fractions allowed).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (fractions allowed).")
    health_check_period_s: float = Field(2.0, gt=0, description="Serve health-check period.")
    health_check_timeout_s: float = Field(10.0, gt=0, description="Serve health-check timeout.")
    max_ongoing_requests: int = Field(32, ge=1, description="Concurrent requests per replica.")
    router_replicas: int = Field(1, ge=1, description="Replicas of the route's router.")
    router_num_cpus: float = Field(0.25, ge=0, description="CPUs per router replica.")

    def version_options(self) -> dict[str, Any]:
        options = self.model_dump(exclude={"router_replicas", "router_num_cpus"}, exclude_none=True)
        if not options.get("num_gpus"):
            options.pop("num_gpus", None)
        serving_options(options)  # raises ValueError naming a bad option
        return options

    def router_options(self) -> dict[str, Any]:
        return {"num_replicas": self.router_replicas, "num_cpus": self.router_num_cpus}


class LLMServing(BaseModel):
    """How an LLM version's Serve application runs (vLLM in the LLM venv's replicas)."""

    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM engine settings: "
        "max_model_len, gpu_memory_utilization, tensor_parallel_size, "
        "enforce_eager, kv_cache_memory_bytes, dtype, extra.",
    )
    num_cpus: float = Field(1.0, ge=0, description="CPUs per replica (fractions allowed).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (fractions allowed).")
    min_replicas: int = Field(1, ge=0, description="Autoscaling floor.")
    max_replicas: int = Field(1, ge=1, description="Autoscaling ceiling.")
    target_ongoing_requests: float = Field(16, gt=0, description="Autoscaling target per replica.")
    python: str | None = Field(
        None,
        description="The LLM venv's python on every node; empty: "
        "$RLT_LLM_PYTHON, else this checkout's .venv-llm/bin/python.",
    )
    health_check_period_s: float = Field(10.0, gt=0, description="Serve health-check period.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="Serve health-check timeout.")

    def app_args(self, mlflow_server: MLflowServer, model_name: str, version: str):
        import os

        from workloads.llm import LLMAppArgs
        from workloads.tiny_llm import DEFAULT_LLM_PYTHON

        actor = {
            "num_cpus": self.num_cpus,
            **({"num_gpus": self.num_gpus} if self.num_gpus else {}),
        }
        return LLMAppArgs(
            mlflow={
                "tracking_uri": mlflow_server.tracking_uri,
                "model_name": model_name,
                "version": str(version),
            },
            served_model_name=model_name,
            version_label=str(version),
            engine=self.engine,
            autoscaling={
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            },
            ray_actor_options=actor,
            # Resolved here: the app is built from a shipped copy of workloads, elsewhere.
            python=self.python or os.environ.get("RLT_LLM_PYTHON") or str(DEFAULT_LLM_PYTHON),
            health_check_period_s=self.health_check_period_s,
            health_check_timeout_s=self.health_check_timeout_s,
        )


class Drill(BaseModel):
    """Faults injected into the candidate to rehearse the gates (a game day)."""

    faults: dict[str, Any] = Field(
        default_factory=dict,
        description="From deployment: error_rate, fail_health_after_s, latency_ms.",
    )
    after_swap: dict[str, Any] = Field(
        default_factory=dict,
        description="Applied to the new live version right after the swap (rehearses rollback).",
    )

    @model_validator(mode="after")
    def _check(self) -> Drill:
        Faults.parse(self.faults)
        Faults.parse(self.after_swap)
        return self


# ---- helpers ----------------------------------------------------------------------------
def serving_runtime_env(cluster: RayCluster) -> dict[str, Any]:
    """The Serve apps' runtime_env: only the job's uploaded `workloads` package (plus any
    extra py_modules and the block's env_vars). Serve apps import nothing else, and a code
    change elsewhere in the project then leaves the router's code version alone."""
    import ray

    local = cluster.project_runtime_env()
    uploaded = list(ray.get_runtime_context().runtime_env.get("py_modules", []))
    if len(uploaded) != len(local["py_modules"]):
        raise RuntimeError(
            f"the job ships {len(uploaded)} py_modules, expected "
            f"{len(local['py_modules'])}: connect through the RayCluster block"
        )
    skip = {
        str(cluster_dir)
        for cluster_dir in local["py_modules"][: len(PROJECT_PACKAGES)]
        if not str(cluster_dir).endswith("/workloads")
    }
    modules = [
        uri
        for path, uri in zip(local["py_modules"], uploaded, strict=True)
        if str(path) not in skip
    ]
    return {"py_modules": modules, "env_vars": dict(local.get("env_vars", {}))}


def model_spec(mlflow_server: MLflowServer, model_name: str, version: str) -> dict[str, Any]:
    return {
        "name": model_name,
        "version": str(version),
        "tracking_uri": mlflow_server.tracking_uri,
        "registry_uri": mlflow_server.registry_uri or None,
    }


def target_for(app: str, spec: dict[str, Any]) -> Target:
    return Target(spec["version"], app, sc.POLICY_DEPLOYMENT, spec)


def version_app(
    kind: str,
    mlflow_server: MLflowServer,
    model_name: str,
    version: str,
    serving: Serving,
    llm: LLMServing,
    faults: dict[str, Any],
    runtime_env: dict[str, Any],
) -> tuple[dict[str, Any], Target, float]:
    """The version's Serve app config, the router's target for it, and its health period."""
    app = sc.version_app_name(model_name, version)
    if kind == "policy":
        spec = model_spec(mlflow_server, model_name, version)
        config = sc.version_app_config(app, spec, serving.version_options(), faults, runtime_env)
        return config, target_for(app, spec), serving.health_check_period_s
    from workloads.llm import llm_app_config

    config = llm_app_config(app, llm.app_args(mlflow_server, model_name, version), runtime_env)
    return config, Target(str(version), app, LLM_DEPLOYMENT, None), llm.health_check_period_s


def is_llm(target: Target) -> bool:
    return target.deployment == LLM_DEPLOYMENT


def current_router(route: str) -> RouterConfig | None:
    """The router's config as deployed (what it serves), or None when there is no router."""
    config = sc.app_configs().get(sc.router_app_name(route))
    if config is None:
        return None
    for entry in config.get("deployments", []):
        if entry.get("name") == "Router":
            return RouterConfig.parse(entry.get("user_config"))
    return RouterConfig()


def write_router(
    route: str,
    config: RouterConfig,
    runtime_env: dict[str, Any],
    serving: Serving,
    wait_s: float = 60.0,
    inline_version: str | None = None,
) -> RouterConfig:
    """Apply a router config (validated first; a new generation) and wait until the router
    answers with it. Only user_config changes, so running replicas reconfigure in place."""
    existing = sc.app_names()
    for target in (config.live, config.candidate):
        if target is not None and target.app not in existing:
            raise RuntimeError(f"router {route}: target app {target.app} does not exist")
    previous = current_router(route)
    config = RouterConfig.parse(
        {**config.as_dict(), "generation": (previous.generation if previous else 0) + 1}
    )
    app = sc.router_app_config(route, config, runtime_env, serving.router_options())
    sc.apply({app["name"]: app})
    if previous is None:
        report = sc.wait_stable(app["name"], "Router", timeout_s=120, window_s=0)
        if not report.healthy:
            raise RuntimeError(f"router {route} did not start: {report.reason}")
    sc.wait_router(route, config.generation, timeout_s=wait_s, inline_version=inline_version)
    return config


# ---- stages -----------------------------------------------------------------------------
@stage
def deploy_candidate(
    config: dict[str, Any], target: Target, health_period_s: float, gates: Gates
) -> dict[str, Any]:
    """Gate 1: deploy the version's app; RUNNING, every replica healthy, and staying so."""
    app = target.app
    sc.apply({app: config})
    # The window spans at least three of Serve's health checks: one look is not health.
    window_s = max(gates.stability_window_s, 3 * health_period_s)
    report = sc.wait_stable(
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


@stage
def smoke(target: Target, gates: Gates) -> dict[str, Any]:
    """Gate 2: golden observations through the candidate's handle: valid actions, fast (an
    LLM version: a real completion, not empty, inside the latency bound)."""
    if is_llm(target):
        return _smoke_llm(target, gates)
    handle = sc.handle(target.app, sc.POLICY_DEPLOYMENT)
    describe = handle.describe.remote().result(timeout_s=30)
    shape = describe["observation_shape"]
    observations = gates.smoke_observations
    if not observations:
        import numpy as np

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
    import json

    handle = sc.handle(target.app, LLM_DEPLOYMENT)
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
        stats = sc.handle(target.app, LLM_DEPLOYMENT).stats.remote(reset).result(timeout_s=30)
    except Exception:
        return None
    return {
        "ttft_p99_ms": stats["ttft_ms"]["p99"],
        "tokens_per_s_p50": stats["tokens_per_s"]["p50"],
        "completion_tokens": stats["completion_tokens"],
    }


def judge_llm(
    candidate: dict[str, Any] | None, live: dict[str, Any] | None, gates: Gates
) -> str | None:
    """Why an LLM candidate fails on time to first token or tokens/s, or None."""
    if not candidate or candidate["ttft_p99_ms"] is None:
        return None
    if candidate["ttft_p99_ms"] > gates.max_ttft_ms:
        return (
            f"time to first token p99 {candidate['ttft_p99_ms']:.0f} ms is above "
            f"{gates.max_ttft_ms:g} ms"
        )
    ours, theirs = candidate["tokens_per_s_p50"], (live or {}).get("tokens_per_s_p50")
    if ours is not None and theirs and ours < gates.min_tokens_per_s_ratio * theirs:
        return f"{ours:.0f} tokens/s is below {gates.min_tokens_per_s_ratio:g}x live's {theirs:.0f}"
    return None


@stage
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
    llm = is_llm(candidate)
    if llm:
        _llm_stats(candidate, reset=True)
        _llm_stats(live, reset=True)
    write_router(route, config, runtime_env, serving)
    thresholds = gates.thresholds
    deadline = started + gates.canary_max_wait_s
    while True:
        time.sleep(0.5)
        stats = sc.route_stats(route, started)
        cand = stats.get(candidate.version)
        early = early_failure(cand, thresholds)
        if early is not None:
            raise GateFailed(
                "canary",
                f"at {weight:.0%}: {early.reason}",
                {"weight": weight, "candidate": cand, "live": stats.get(live.version)},
            )
        held = time.time() - started
        enough = (cand or {}).get("requests", 0) >= thresholds.min_requests
        if held >= gates.canary_hold_s and enough:
            break
        if time.time() > deadline:
            raise GateFailed(
                "canary",
                f"at {weight:.0%}: only {(cand or {}).get('requests', 0)} "
                f"requests in {held:.0f} s, fewer than the "
                f"{thresholds.min_requests} needed",
                {"weight": weight},
            )
    verdict: Judgement = judge(cand, stats.get(live.version), thresholds)
    figures = {
        "weight": weight,
        "held_s": round(time.time() - started, 1),
        "candidate": cand,
        "live": stats.get(live.version),
    }
    if verdict.ok is False:
        raise GateFailed("canary", f"at {weight:.0%}: {verdict.reason}", figures)
    if llm:
        figures["candidate_llm"] = _llm_stats(candidate)
        figures["live_llm"] = _llm_stats(live)
        slow = judge_llm(figures["candidate_llm"], figures["live_llm"], gates)
        if slow:
            raise GateFailed("canary", f"at {weight:.0%}: {slow}", figures)
    get_run_logger().info("canary %.0f%% passed: %s", weight * 100, verdict.reason)
    return {
        **figures,
        "reason": verdict.reason
        if verdict.ok
        else f"inconclusive, passed on time: {verdict.reason}",
    }


@stage
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
    config = write_router(
        route,
        RouterConfig(live=candidate, inline_live=inline, timeout_s=gates.request_timeout_s),
        runtime_env,
        serving,
        wait_s=120 if inline else 60,
        inline_version=candidate.version if inline else None,
    )
    return {
        "generation": config.generation,
        "seconds": round(time.time() - started, 2),
        "at": started,
    }


@stage
def inject(app: str, faults: dict[str, Any]) -> None:
    """A drill's faults, applied to one version's app in place."""
    config = sc.app_configs()[app]
    sc.apply({app: sc.with_user_config(config, sc.POLICY_DEPLOYMENT, {"faults": faults})})


@stage
def bake(route: str, live: Target, gates: Gates, since: float) -> dict[str, Any]:
    """Gate 5: watch the new live version for the bake period over a sliding window."""
    thresholds = replace(gates.thresholds, min_requests=max(gates.canary_min_requests, 10))
    started = time.time()
    windows = 0
    while time.time() - started < gates.bake_s:
        time.sleep(0.5)
        now = time.time()
        stats = sc.route_stats(route, max(since, now - gates.bake_window_s), now)
        verdict = judge(stats.get(live.version), None, thresholds)
        windows += 1
        if verdict.ok is False:
            raise GateFailed(
                "bake",
                f"{verdict.reason} {now - since:.1f} s after the swap",
                {"window": stats.get(live.version), "detected_at": now},
            )
    total = sc.route_stats(route, since).get(live.version)
    return {
        "seconds": round(time.time() - started, 1),
        "figures": total,
        "reason": f"stable for {gates.bake_s:g} s",
    }


@stage
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
    inline_ok = live.model is not None  # an LLM version is always reached through its app
    try:
        if inline_ok:
            write_router(
                route,
                RouterConfig(live=live, inline_live=True, timeout_s=gates.request_timeout_s),
                runtime_env,
                serving,
                wait_s=120,
                inline_version=live.version,
            )
    except RuntimeError as error:  # keep forwarding to the live app; serving is unaffected
        inline_ok = False
        logger.warning("router %s still forwards to v%s: %s", route, live.version, error)
    if previous_app and previous_app != live.app:
        sc.apply(deletes={previous_app})
    return {"inline": inline_ok, "deleted": previous_app}


@stage
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
    write_router(
        route,
        RouterConfig(
            live=previous, inline_live=previous.model is not None, timeout_s=gates.request_timeout_s
        ),
        runtime_env,
        serving,
    )
    seconds = time.time() - started
    sc.apply(deletes={candidate_app})
    return {"seconds": round(seconds, 2)}


@stage
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
    current = current_router(route)
    if (
        current is not None
        and live is not None
        and (current.candidate is not None or current.live != live)
    ):
        write_router(
            route,
            RouterConfig(
                live=live,
                inline_live=current.inline_live and current.live == live,
                timeout_s=gates.request_timeout_s,
            ),
            runtime_env,
            serving,
        )
    if candidate_app != (live.app if live else None):
        sc.apply(deletes={candidate_app})
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
    from prefect.events import emit_event

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
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

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
