"""The Serve apps of a rollout as built from the blocks: the apps' runtime_env from the
RayCluster block, and a version's app config and router target from the MLflowServer block.
Plain helpers called by the rollout flow, not tasks."""

from __future__ import annotations

from typing import Any, Literal

import ray

from blocks import MLflowServer, RayCluster
from blocks.ray_cluster import PROJECT_PACKAGES
from tasks.serve_config import LLMServing, Serving
from workloads import serve_control
from workloads.llm import llm_app_config
from workloads.router import Target

__all__ = ["model_spec", "serving_runtime_env", "version_app"]


def serving_runtime_env(cluster: RayCluster) -> dict[str, Any]:
    """The Serve apps' runtime_env: only the job's uploaded `workloads` package (plus any
    extra py_modules and the block's env_vars). Serve apps import nothing else, and a code
    change elsewhere in the project then leaves the router's code version alone."""
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
    config = llm_app_config(app, llm.app_args(mlflow_server, model_name, version), runtime_env)
    return config, Target(str(version), app, "llm"), llm.health_check_period_s
