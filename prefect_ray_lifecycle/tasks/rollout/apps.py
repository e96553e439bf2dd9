"""The Serve apps of a rollout as built from the blocks: the apps' runtime_env from the
RayCluster block, a version's app config and router target from the MLflowServer block, and
the route a rollout holds. Plain helpers called by the rollout flow, not tasks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import ray

from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster
from prefect_ray_lifecycle.control import serve_control
from prefect_ray_lifecycle.tasks.rollout.claim import RouteClaim
from prefect_ray_lifecycle.tasks.rollout.config import LLMServing, Serving
from prefect_ray_lifecycle.workloads.llm import llm_app_config
from prefect_ray_lifecycle.workloads.serve.router_config import (
    RolloutRecord,
    RouterConfig,
    Target,
    Testers,
)
from prefect_ray_lifecycle.workloads.serve.traffic import token_digest

__all__ = ["RouteContext", "model_spec", "route_context", "serving_runtime_env", "version_app"]


def serving_runtime_env(cluster: RayCluster) -> dict[str, Any]:
    """The Serve apps' runtime_env: the Ray side of the job's uploaded package (plus any extra
    py_modules and the block's env_vars). Serve apps import nothing else, and a code change
    on the flow side then leaves the router's code version alone."""
    local = cluster.project_runtime_env()
    uploaded = list(ray.get_runtime_context().runtime_env.get("py_modules", []))
    if len(uploaded) != len(local["py_modules"]):
        raise RuntimeError(
            f"the job ships {len(uploaded)} py_modules, expected "
            f"{len(local['py_modules'])}: connect through the RayCluster block"
        )
    # project_runtime_env ships the Ray side first, then the driver side, then the extras.
    return {
        "py_modules": [uploaded[0], *uploaded[2:]],
        "env_vars": dict(local.get("env_vars", {})),
    }


def model_spec(mlflow_server: MLflowServer, model_name: str, version: str) -> dict[str, Any]:
    """The ModelSpec fields a policy replica (or the router, in process) loads the version by."""
    return {
        "name": model_name,
        "version": str(version),
        "tracking_uri": mlflow_server.tracking_uri,
        "registry_uri": mlflow_server.registry_uri or None,
    }


def version_app(
    kind: Literal["policy", "llm"],
    mlflow_server: MLflowServer,
    model_name: str,
    version: str,
    serving: Serving,
    llm: LLMServing,
    faults: dict[str, Any],
    runtime_env: dict[str, Any],
) -> tuple[dict[str, Any], Target, float]:
    """The version's Serve app config, the router's target for it, and its health period."""
    app = serve_control.version_app_name(model_name, version)
    if kind == "policy":
        spec = model_spec(mlflow_server, model_name, version)
        config = serve_control.version_app_config(
            app, spec, serving.version_options(), faults, runtime_env
        )
        return config, Target(spec["version"], app, "policy", spec), serving.health_check_period_s
    args = llm.app_args(mlflow_server, model_name, version)
    config = llm_app_config(app, args, runtime_env, faults)
    # The args travel in the target too: the router builds the same engine from them to host
    # the version once it is live.
    target = Target(str(version), app, "llm", args.model_dump(mode="json"))
    return config, target, llm.health_check_period_s


@dataclass(frozen=True)
class RouteContext:
    """The route a rollout changes while it holds it: how its router is written (runtime_env,
    router options, per-request timeout, fallback), which versions it may host in process,
    and the claim each write is made under. `runtime_env` is the version apps'; the router's
    differs on an LLM route whose router hosts the live version (the LLM venv)."""

    route: str
    runtime_env: dict[str, Any]
    router_runtime_env: dict[str, Any]
    router_options: dict[str, Any]
    timeout_s: float
    fallback: bool
    claim: RouteClaim
    host_llm: bool = False  # whether the router hosts a live LLM version
    testers: Testers = Testers()  # who may reach the candidate with X-Canary

    def hosts(self, target: Target) -> bool:
        """Whether the router hosts `target` in its replicas once it is live."""
        return target.model is not None and (target.kind == "policy" or self.host_llm)

    def record(
        self, stage: Literal["shadow", "canary", "bake"], version: str, **extra: Any
    ) -> RolloutRecord:
        """The router's record that this rollout holds the route, and at which stage."""
        return RolloutRecord(self.claim.holder, stage, str(version), time.time(), **extra)

    def config(self, **fields: Any) -> RouterConfig:
        return RouterConfig(
            timeout_s=self.timeout_s, fallback=self.fallback, testers=self.testers, **fields
        )

    def write(self, config: RouterConfig, **wait: Any) -> RouterConfig:
        """Apply `config` (a new generation) and wait until the router answers with it; only
        while this rollout still holds the route."""
        self.claim.check()
        return serve_control.write_router(
            self.route, config, self.router_runtime_env, self.router_options, **wait
        )


def route_context(
    route: str,
    cluster: RayCluster,
    serving: Serving,
    gates: Any,
    claim: RouteClaim,
    kind: Literal["policy", "llm"] = "policy",
    llm: LLMServing | None = None,
) -> RouteContext:
    """The route as a rollout holding `claim` writes it (`gates` gives the router's request
    timeout and fallback). An LLM route's router runs in the LLM venv when it hosts the live
    version (`llm.host_in_router`)."""
    runtime_env = serving_runtime_env(cluster)
    llm = llm or LLMServing()
    options = serving.router_options(
        serve_control.alive_nodes(), hosts_engine=kind == "llm" and llm.host_in_router
    )
    router_env, host_llm = runtime_env, False
    if kind == "llm":
        router_env, options = llm.router_serving(runtime_env, options)
        host_llm = llm.host_in_router
    return RouteContext(
        route=route,
        runtime_env=runtime_env,
        router_runtime_env=router_env,
        router_options=options,
        timeout_s=gates.request_timeout_s,
        fallback=gates.fallback,
        claim=claim,
        host_llm=host_llm,
        testers=testers(gates.tester_header, gates.tester_token_secret),
    )


def testers(mode: str, secret_name: str | None) -> Testers:
    """Who the router lets reach the candidate with X-Canary: the token's SHA-256 from the
    Prefect Secret block `secret_name` in token mode (the token itself never leaves Prefect)."""
    if mode != "token":
        return Testers(mode)  # type: ignore[arg-type]
    from prefect.blocks.system import Secret

    token = Secret.load(secret_name).get()
    if not isinstance(token, str) or not token:
        raise ValueError(f"Secret block {secret_name!r} must hold the testers' token as a string")
    return Testers("token", token_digest(token))
