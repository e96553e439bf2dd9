"""Driving Ray Serve from a Ray driver (the rollout flow's process): declarative app configs,
health with a stability window, the router's state and the route's request figures.

Apps are applied the way Serve's REST API applies them (`PUT /api/serve/applications/`),
through the controller, so a change that touches only a user_config reconfigures running
replicas in place, and `serve.run`'s new random code version (a replica restart) is avoided.
A declarative apply replaces the whole set of declarative apps, so every apply reads the
current set and changes only the named apps.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.schema import ServeDeploySchema

from prefect_ray_lifecycle.compat import ray_internals
from prefect_ray_lifecycle.workloads.constants import POLICY_DEPLOYMENT, ROUTER_DEPLOYMENT
from prefect_ray_lifecycle.workloads.serve.route_state import drop_route_state
from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig

POLICY_IMPORT = "prefect_ray_lifecycle.workloads.serve.policy:build_policy_app"
ROUTER_IMPORT = "prefect_ray_lifecycle.workloads.serve.router:build_router_app"
# glibc's malloc arenas for the router's process (the block's env_vars may set another). The
# router lives across every rollout, and each rollout runs new threads in it (a handle's
# router, a hosted version's load, timers); by default glibc gives threads up to 8 arenas per
# core, and each kept the small holes of what those threads freed: the soak's router grew
# about 2.8 MB a rollout, nearly all free memory inside arenas (malloc_trim could not give it
# back: no whole page free). With two arenas the holes are reused.
ROUTER_MALLOC_ARENA_MAX = "2"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class ServeControlError(RuntimeError):
    """Serve did not do what was asked (a router that never reached its config, a proxy on
    another port). Not a gate's verdict on a candidate: that is canary.GateFailed."""


def version_app_name(model_name: str, version: str) -> str:
    return f"{_SAFE.sub('-', model_name)}-v{version}"


def router_app_name(route: str) -> str:
    return f"router-{route}"


def delete_route(route: str, model_name: str) -> set[str]:
    """Take a route down: its router, the apps of `model_name`'s versions, and the route's
    state (figures and lease). Returns the apps deleted."""
    prefix = version_app_name(model_name, "")
    apps = {a for a in app_configs() if a.startswith(prefix) or a == router_app_name(route)}
    apply(deletes=apps)
    drop_route_state(route)
    return apps


def validate_route(route: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", route or ""):
        raise ValueError(
            f"route {route!r} must be lowercase letters, digits and '-' "
            f"(it becomes the URL prefix /{route})"
        )
    return route


def start(host: str = "127.0.0.1", port: int = 8000) -> Any:
    """Start Serve (or connect to it) with its HTTP proxy on host:port; returns the client.
    A running Serve keeps its own HTTP options: a different port is an error."""
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    client = ray_internals.serve_client()
    config = client.http_config
    if (config.host, config.port) != (host, port):
        raise ServeControlError(
            f"Serve on this cluster already listens on {config.host}:"
            f"{config.port}, not {host}:{port}"
        )
    return client


def release() -> None:
    """Before this driver leaves Ray: shut the handles `handle` kept down, so none keeps
    pushing metrics (RayCluster.connect() then drops Serve's own cache and client)."""
    for key in list(_HANDLES):
        try:
            _HANDLES.pop(key).shutdown()
        except Exception:  # a handle of a deleted app: nothing left to stop
            pass


def app_configs() -> dict[str, dict[str, Any]]:
    """Every declaratively deployed app's config, by name."""
    configs = ray_internals.serve_app_configs()
    return {name: c.model_dump(exclude_unset=True) for name, c in configs.items()}


def apply(
    upserts: dict[str, dict[str, Any]] | None = None,
    deletes: set[str] | frozenset[str] = frozenset(),
    wait_deleted_s: float = 60.0,
) -> None:
    """Apply app configs by name and delete apps, keeping every other declarative app.
    Deleted apps are waited for (their replicas gone), up to `wait_deleted_s`."""
    configs = app_configs()
    configs.update(upserts or {})
    for name in deletes:
        configs.pop(name, None)
    schema = ServeDeploySchema.model_validate({"applications": list(configs.values())})
    ray_internals.serve_client().deploy_apps(schema)
    deadline = time.monotonic() + wait_deleted_s
    while deletes and time.monotonic() < deadline:
        if not set(deletes) & set(details().get("applications", {})):
            return
        time.sleep(0.3)


def version_app_config(
    app: str,
    model: dict[str, Any],
    serving: dict[str, Any],
    faults: dict[str, Any] | None,
    runtime_env: dict[str, Any],
) -> dict:
    return {
        "name": app,
        "import_path": POLICY_IMPORT,
        "route_prefix": None,
        "runtime_env": runtime_env,
        "args": {"model": model, "serving": serving},
        "deployments": [{"name": POLICY_DEPLOYMENT, "user_config": {"faults": faults or {}}}],
    }


def router_app_config(
    route: str,
    config: RouterConfig,
    runtime_env: dict[str, Any],
    serving: dict[str, Any] | None = None,
) -> dict:
    return {
        "name": router_app_name(route),
        "import_path": ROUTER_IMPORT,
        "route_prefix": f"/{route}",
        "runtime_env": router_runtime_env(runtime_env),
        "args": {"route": route, "serving": serving or {}},
        "deployments": [{"name": ROUTER_DEPLOYMENT, "user_config": config.as_dict()}],
    }


def router_runtime_env(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """`runtime_env` with MALLOC_ARENA_MAX for the router's process, unless it sets one."""
    env_vars = {"MALLOC_ARENA_MAX": ROUTER_MALLOC_ARENA_MAX, **runtime_env.get("env_vars", {})}
    return {**runtime_env, "env_vars": env_vars}


def with_user_config(
    app_config: dict[str, Any], deployment: str, user_config: dict[str, Any]
) -> dict[str, Any]:
    """A copy of an app config whose deployment gets a new user_config (nothing else)."""
    deployments = [dict(d) for d in app_config.get("deployments", [])]
    for entry in deployments:
        if entry.get("name") == deployment:
            entry["user_config"] = user_config
            break
    else:
        deployments.append({"name": deployment, "user_config": user_config})
    return {**app_config, "deployments": deployments}


def alive_nodes() -> int:
    """How many nodes of the connected Ray cluster are alive."""
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def details() -> dict[str, Any]:
    return ray_internals.serve_client().get_serve_details()


def app_names() -> set[str]:
    return set(details().get("applications", {}))


def app_exists(app: str) -> bool:
    return app in app_names()


def deployment_state(app: str, deployment: str) -> dict[str, Any]:
    """{"app_status", "status", "message", "replicas": {id: state}, "target"} of one
    deployment; statuses are None while the app does not exist."""
    apps = details().get("applications", {})
    entry = apps.get(app)
    if entry is None:
        return {"app_status": None, "status": None, "message": "", "replicas": {}, "target": None}
    dep = entry.get("deployments", {}).get(deployment, {})
    replicas = {r["replica_id"]: str(r["state"]) for r in dep.get("replicas", [])}
    return {
        "app_status": str(entry.get("status")),
        "status": dep.get("status"),
        "message": dep.get("message") or entry.get("message") or "",
        "replicas": replicas,
        "target": dep.get("target_num_replicas"),
    }


@dataclass
class HealthReport:
    healthy: bool
    seconds: float
    reason: str
    replicas: int = 0
    checks: int = 0
    timeline: list[str] = field(default_factory=list)


def wait_stable(
    app: str,
    deployment: str,
    *,
    timeout_s: float,
    window_s: float,
    poll_s: float = 0.5,
    probe: bool = False,
) -> HealthReport:
    """Wait until the app is RUNNING with every replica RUNNING, then require it to stay so,
    with the same replicas, for `window_s`: a replica that is replaced or turns unhealthy
    inside the window fails the gate (Serve's own RUNNING is one look, not health).

    With `probe`, each poll inside the window also calls the deployment's own check_health
    through its handle: Serve marks a replica unhealthy only after three failed checks in a
    row, so a failure that starts inside the window would otherwise be seen too late."""
    started = time.monotonic()
    stable_since: float | None = None
    stable_replicas: set[str] = set()
    checks = 0
    timeline: list[str] = []
    last = ""
    while True:
        now = time.monotonic()
        state = deployment_state(app, deployment)
        status, app_status = str(state["status"]), str(state["app_status"])
        replicas = state["replicas"]
        summary = f"app {app_status}, deployment {status}, replicas " + (
            ", ".join(sorted(set(replicas.values()))) or "none"
        )
        if summary != last:
            timeline.append(f"{now - started:5.1f}s {summary}")
            last = summary
        if (
            app_status.endswith("DEPLOY_FAILED")
            or status.endswith("UNHEALTHY")
            or status.endswith("DEPLOY_FAILED")
        ):
            return HealthReport(
                False,
                now - started,
                f"{app} is {status}: {state['message'][:500]}",
                len(replicas),
                checks,
                timeline,
            )
        running = (
            app_status.endswith("RUNNING")
            and status.endswith("HEALTHY")
            and replicas
            and all(s.endswith("RUNNING") for s in replicas.values())
        )
        if running:
            checks += 1
            if probe and (failure := _probe(app, deployment)):
                return HealthReport(
                    False,
                    now - started,
                    f"{app}: check_health failed inside the stability window: {failure}",
                    len(replicas),
                    checks,
                    timeline,
                )
            if stable_since is None:
                stable_since, stable_replicas = now, set(replicas)
            elif set(replicas) != stable_replicas:
                return HealthReport(
                    False,
                    now - started,
                    f"{app}: replicas were replaced during the stability "
                    f"window ({sorted(stable_replicas)} -> {sorted(replicas)})",
                    len(replicas),
                    checks,
                    timeline,
                )
            elif now - stable_since >= window_s:
                return HealthReport(
                    True,
                    now - started,
                    f"{len(replicas)} replica(s) healthy for {window_s:g} s"
                    if window_s
                    else f"{len(replicas)} replica(s) RUNNING and healthy ({checks} probes)",
                    len(replicas),
                    checks,
                    timeline,
                )
        elif stable_since is not None:
            return HealthReport(
                False,
                now - started,
                f"{app} left RUNNING during the "
                f"stability window: {summary}; {state['message'][:300]}",
                len(replicas),
                checks,
                timeline,
            )
        if now - started > timeout_s:
            return HealthReport(
                False,
                now - started,
                f"{app} not healthy within {timeout_s:g} s: {summary}; {state['message'][:300]}",
                len(replicas),
                checks,
                timeline,
            )
        time.sleep(poll_s)


_HANDLES: dict[tuple[str, str], Any] = {}


def _probe(app: str, deployment: str, timeout_s: float = 30.0) -> str | None:
    """Call the deployment's check_health through its handle; the failure, or None."""
    try:
        handle(app, deployment).check_health.remote().result(timeout_s=timeout_s)
    except Exception as error:
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[-1][:300] if text else ''}"
    return None


def handle(app: str, deployment: str) -> Any:
    """A DeploymentHandle, kept for this driver's session (`release` shuts them down)."""
    key = (app, deployment)
    if key not in _HANDLES:
        _HANDLES[key] = serve.get_deployment_handle(deployment, app)
    return _HANDLES[key]


def router_status(route: str, samples: int = 6, timeout_s: float = 15.0) -> list[dict]:
    """The router replicas' own view of what they serve (a few calls through its handle)."""
    router = handle(router_app_name(route), ROUTER_DEPLOYMENT)
    return [router.status.remote().result(timeout_s=timeout_s) for _ in range(samples)]


def wait_router(
    route: str, generation: int, timeout_s: float = 60.0, inline_version: str | None = None
) -> dict[str, Any]:
    """Wait until the router answers with `generation` (and, if given, hosts
    `inline_version` in process); returns its status. Raises ServeControlError on timeout."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            statuses = router_status(route)
        except Exception as error:  # the router may be starting
            last = {"error": str(error)}
            time.sleep(0.3)
            continue
        last = statuses[-1]
        if all(s["config"]["generation"] == generation for s in statuses) and (
            inline_version is None or all(s["inline_version"] == inline_version for s in statuses)
        ):
            return last
        time.sleep(0.2)
    raise ServeControlError(
        f"router {route} did not reach generation {generation}"
        f"{f' hosting v{inline_version}' if inline_version else ''} within "
        f"{timeout_s:g} s; last status {last}"
    )


def current_router(route: str) -> RouterConfig | None:
    """The router's config as deployed (what it serves), or None when there is no router."""
    config = app_configs().get(router_app_name(route))
    if config is None:
        return None
    for entry in config.get("deployments", []):
        if entry.get("name") == ROUTER_DEPLOYMENT:
            return RouterConfig.parse(entry.get("user_config"))
    return RouterConfig()


def write_router(
    route: str,
    config: RouterConfig,
    runtime_env: dict[str, Any],
    router_options: dict[str, Any],
    wait_s: float = 60.0,
    inline_version: str | None = None,
) -> RouterConfig:
    """Apply a router config (validated first; a new generation) and wait until the router
    answers with it. Only user_config changes, so running replicas reconfigure in place.
    `router_options` are the router app's {num_replicas, num_cpus}."""
    existing = app_names()
    for target in (config.live, config.candidate):
        if target is not None and target.app not in existing:
            raise RuntimeError(f"router {route}: target app {target.app} does not exist")
    previous = current_router(route)
    config = RouterConfig.parse(
        {**config.as_dict(), "generation": (previous.generation if previous else 0) + 1}
    )
    app = router_app_config(route, config, runtime_env, router_options)
    apply({app["name"]: app})
    if previous is None:
        report = wait_stable(app["name"], ROUTER_DEPLOYMENT, timeout_s=120, window_s=0)
        if not report.healthy:
            raise RuntimeError(f"router {route} did not start: {report.reason}")
    wait_router(route, config.generation, timeout_s=wait_s, inline_version=inline_version)
    return config
