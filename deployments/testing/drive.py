"""Driving a route by hand, for benchmarks and tests: hold it as a rollout does (its
concurrency slot and its lease, renewed) and have its router serve a config of your own
meanwhile (a shadow, a canary share, testers), then put the router back as it was.

Needs this process connected to the route's Ray cluster, Serve's controller started, and a
Prefect API (the route's concurrency limit)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = ["held"]


@contextlib.contextmanager
def held(route: str, lease_s: float = 10.0, **fields: Any) -> Iterator[Any]:
    """The route held under a fresh holder, its router serving its current config with
    `fields` replaced (`rollout=` may name the stage: {"stage": "shadow"}; the holder and the
    candidate's version are filled in). Yields the config served; restores the one before."""
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.tasks.rollout.claim import hold_route
    from prefect_ray_lifecycle.workloads.constants import ROUTER_DEPLOYMENT
    from prefect_ray_lifecycle.workloads.serve.router_config import RolloutRecord, RouterConfig

    good = serve_control.current_router(route)
    if good is None or good.live is None:
        raise RuntimeError(f"route {route} serves nothing to hold")
    app = serve_control.router_app_name(route)
    config = serve_control.app_configs()[app]
    runtime_env = config.get("runtime_env") or {}
    (deployment,) = [d for d in config["deployments"] if d["name"] == ROUTER_DEPLOYMENT]
    actor = deployment.get("ray_actor_options") or {}
    options = {
        "num_replicas": deployment.get("num_replicas", 1),
        "num_cpus": actor.get("num_cpus", 0.25),
        **({"num_gpus": actor["num_gpus"]} if actor.get("num_gpus") else {}),
    }
    holder = str(uuid.uuid4())
    with hold_route(route, holder, lease_s):
        stage = dict(fields.pop("rollout", None) or {"stage": "canary"})
        candidate = fields.get("candidate", good.candidate)
        version = (candidate or good.live).version
        record = RolloutRecord(holder, stage["stage"], version)
        served = RouterConfig.parse(
            {**good.as_dict(), **_plain(fields), "rollout": record.as_dict()}
        )
        try:
            yield serve_control.write_router(route, served, runtime_env, options)
        finally:
            serve_control.write_router(route, good, runtime_env, options)


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    """Config fields as RouterConfig.parse takes them (targets and parts as dicts)."""
    return {k: v.as_dict() if hasattr(v, "as_dict") else v for k, v in fields.items()}
