"""Building and deploying the LLM app: `serve.run(build_llm_app({...}), name=...)`, or Serve's
declarative config (`import_path`: IMPORT_PATH, `args: {...}`), whose entry `llm_app_config`
writes. Only Ray Serve and pydantic are needed here, so a flow process builds
and deploys the app while its replicas run vLLM in the LLM venv."""

from __future__ import annotations

from typing import Any

from ray import serve

from prefect_ray_lifecycle.workloads.constants import LLM_DEPLOYMENT
from prefect_ray_lifecycle.workloads.llm.config import LLMAppArgs, LLMFaults
from prefect_ray_lifecycle.workloads.llm.server import LLMServer

__all__ = ["IMPORT_PATH", "build_llm_app", "deploy_llm_app", "llm_app_config"]

IMPORT_PATH = "prefect_ray_lifecycle.workloads.llm:build_llm_app"


def _spec(args: dict | LLMAppArgs) -> LLMAppArgs:
    return args if isinstance(args, LLMAppArgs) else LLMAppArgs.model_validate(args)


def build_llm_app(args: dict | LLMAppArgs) -> serve.Application:
    """Serve application builder: `serve.run(build_llm_app({...}))`, or Serve's declarative
    config with `import_path` IMPORT_PATH and these `args`."""
    spec = _spec(args)
    actor_options = {
        **spec.ray_actor_options,
        "runtime_env": {
            **spec.ray_actor_options.get("runtime_env", {}),
            **spec.replica_runtime_env(),
        },
    }
    scaling = spec.autoscaling
    deployment = LLMServer.options(
        ray_actor_options=actor_options,
        autoscaling_config={
            "min_replicas": scaling.min_replicas,
            "initial_replicas": max(scaling.min_replicas, 1),
            "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
        },
        max_ongoing_requests=spec.max_ongoing_requests,
        health_check_period_s=spec.health_check_period_s,
        health_check_timeout_s=spec.health_check_timeout_s,
    )
    return deployment.bind(spec.model_dump(mode="json"))


def deploy_llm_app(args: dict | LLMAppArgs, name: str, *, blocking: bool = False):
    """`serve.run` the app under `name` at its route_prefix (None: no HTTP route); returns its
    DeploymentHandle once the replicas are healthy (warm-up done)."""
    spec = _spec(args)
    return serve.run(
        build_llm_app(spec), name=name, route_prefix=spec.route_prefix, blocking=blocking
    )


def llm_app_config(
    name: str,
    args: dict | LLMAppArgs,
    runtime_env: dict[str, Any] | None = None,
    faults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One `applications:` entry of a Serve config (REST / `serve deploy`) for this app.
    `runtime_env` is the app's own (e.g. py_modules or working_dir holding `workloads`);
    `faults` a drill's (LLMFaults), sent as the server's user_config."""
    spec = _spec(args)
    user_config = {"faults": LLMFaults.parse(faults).model_dump()}
    entry: dict[str, Any] = {
        "name": name,
        "import_path": IMPORT_PATH,
        "route_prefix": spec.route_prefix,
        "args": spec.model_dump(mode="json"),
        "deployments": [{"name": LLM_DEPLOYMENT, "user_config": user_config}],
    }
    if runtime_env:
        entry["runtime_env"] = runtime_env
    return entry
