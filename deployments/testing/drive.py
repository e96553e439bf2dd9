"""Driving a route by hand, for benchmarks and tests: hold it as a rollout does (its
concurrency slot and its lease, renewed) and have its router serve a config of your own
meanwhile (a shadow, a canary share, testers), then put the router back as it was; or leave
its router as a rollout that died mid-stage left it.

Needs this process connected to the route's Ray cluster, Serve's controller started, and a
Prefect API (the route's concurrency limit)."""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["held", "leave_record", "rolling_out", "router_pids"]


@contextlib.contextmanager
def rolling_out(**rollout: Any) -> Iterator[Future]:
    """serve_rollout(**rollout) in a thread running a copy of this context (Prefect's
    settings live in context variables); yields its future."""
    from prefect_ray_lifecycle.flows.rollout import serve_rollout

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(contextvars.copy_context().run, serve_rollout, **rollout)


def router_pids(route: str) -> dict[str, int]:
    """{replica id: pid} of the route's router replicas Serve reports RUNNING."""
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.workloads.constants import ROUTER_DEPLOYMENT

    app = serve_control.details()["applications"][serve_control.router_app_name(route)]
    replicas = app["deployments"][ROUTER_DEPLOYMENT]["replicas"]
    return {r["replica_id"]: r["pid"] for r in replicas if str(r["state"]).endswith("RUNNING")}


@contextlib.contextmanager
def held(route: str, lease_s: float = 10.0, **fields: Any) -> Iterator[Any]:
    """The route held under a fresh holder, its router serving its current config with
    `fields` replaced (`rollout=` may name the stage: {"stage": "shadow"}; the holder and the
    candidate's version are filled in). Yields the config served; restores the one before."""
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.tasks.rollout.claim import hold_route

    good, runtime_env, options = _router(route)
    holder = str(uuid.uuid4())
    with hold_route(route, holder, lease_s):
        try:
            yield serve_control.write_router(
                route, _with_record(good, holder, fields), runtime_env, options
            )
        finally:
            serve_control.write_router(route, good, runtime_env, options)


def leave_record(route: str, stage: str) -> str:
    """The route's router left as a rollout that died at `stage` leaves it: its current
    config under the record of a holder that no longer runs (none holds the route). Returns
    that holder."""
    from prefect_ray_lifecycle.control import serve_control

    good, runtime_env, options = _router(route)
    holder = str(uuid.uuid4())
    fields = {"rollout": {"stage": stage}}
    serve_control.write_router(route, _with_record(good, holder, fields), runtime_env, options)
    return holder


def _router(route: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The route's router config as served, with the runtime_env and options to write it."""
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.workloads.constants import ROUTER_DEPLOYMENT

    good = serve_control.current_router(route)
    if good is None or good.live is None:
        raise RuntimeError(f"route {route} serves nothing to hold")
    config = serve_control.app_configs()[serve_control.router_app_name(route)]
    (deployment,) = [d for d in config["deployments"] if d["name"] == ROUTER_DEPLOYMENT]
    actor = deployment.get("ray_actor_options") or {}
    options = {
        "num_replicas": deployment.get("num_replicas", 1),
        "num_cpus": actor.get("num_cpus", 0.25),
        **({"num_gpus": actor["num_gpus"]} if actor.get("num_gpus") else {}),
    }
    return good, config.get("runtime_env") or {}, options


def _with_record(good: Any, holder: str, fields: dict[str, Any]) -> Any:
    """`good` with `fields` replaced and a rollout record of `holder`."""
    from prefect_ray_lifecycle.workloads.serve.router_config import RolloutRecord, RouterConfig

    fields = dict(fields)
    stage = dict(fields.pop("rollout", None) or {"stage": "canary"})
    candidate = fields.get("candidate", good.candidate)
    record = RolloutRecord(holder, stage["stage"], (candidate or good.live).version)
    return RouterConfig.parse({**good.as_dict(), **_plain(fields), "rollout": record.as_dict()})


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    """Config fields as RouterConfig.parse takes them (targets and parts as dicts)."""
    return {k: v.as_dict() if hasattr(v, "as_dict") else v for k, v in fields.items()}
