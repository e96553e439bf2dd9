"""Watching a deployment environment from outside, as an operator would: a deployment's flow
runs, a route's own status, and the process behind a flow run (to kill it in a drill)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "FAST_POLL_S",
    "actors_gone",
    "deployment_runs",
    "explain_on_failure",
    "kill_flow_run",
    "route_status",
    "sessions_per_step",
    "stage_windows",
    "started_run",
    "wait_for",
]

T = TypeVar("T")

# Once a second by default: a typical look (a deployment's runs, a flow run, an MLflow alias)
# costs 60-80 ms of CPU across the Prefect server, MLflow and the looking process, so four a
# second kept a fifth of a core busy while a test waited (measured 2026-12-07). A look that
# must catch a short stage (to kill or stop something in it), and every wait of the
# benchmarks (their figures stay comparable with earlier runs), pass FAST_POLL_S.
POLL_S = 1.0
FAST_POLL_S = 0.25


def wait_for(what: str, check: Callable[[], T], timeout: float = 180.0, every: float = POLL_S) -> T:
    """`check()` once it is truthy; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def actors_gone(dashboard_url: str, token: str, class_name: str, timeout: float = 120.0) -> None:
    """Wait until the cluster has no alive actor of `class_name`: after a kill, the barrier
    past which no such actor can still train or record anything (Ray ends a dead driver's
    actors after it, not with it)."""
    from deployments.worker_node import alive_actors

    wait_for(
        f"the {class_name} actors end",
        lambda: not alive_actors(dashboard_url, token, class_name),
        timeout,
    )


def deployment_runs(client: Any, name: str, after: float = 0.0) -> list[Any]:
    """The flow runs of deployment `name` ("flow/deployment") created after `after`
    (time.time()), oldest first."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deployment = client.read_deployment_by_name(name)
    found = client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
    )
    return sorted((r for r in found if r.created.timestamp() >= after), key=lambda r: r.created)


def started_run(
    client: Any, name: str, after: float, skip: tuple = (), timeout: float = 180.0
) -> Any:
    """The first run of deployment `name` created after `after` (and not in `skip`), once it
    is Running."""

    def running() -> Any:
        fresh = [r for r in deployment_runs(client, name, after) if r.id not in skip]
        return fresh[0] if fresh and fresh[0].state.is_running() else None

    return wait_for(f"a {name} run starts", running, timeout)


@contextlib.contextmanager
def explain_on_failure(client: Any, name: str, state_dir: Path) -> Iterator[None]:
    """On a failure inside, print what an operator reads first: the runs of deployment
    `name` that left Scheduled (what started each, how each ended), then the tails of the
    worker's log (the flow runs' own output) and the receiver's (the route watch)."""
    try:
        yield
    except BaseException:
        for run in deployment_runs(client, name):
            if run.state.name != "Scheduled":
                print(
                    f"{name} run",
                    run.name,
                    run.created,
                    run.state.name,
                    "auto-scheduled" if run.auto_scheduled else "",
                    dict(run.parameters),
                    (run.state.message or "")[:120],
                )
        for log, keep in (("worker.log", 300), ("receiver.log", 40)):
            path = state_dir / "logs" / log
            if path.exists():
                print(f"---- {log} (tail) ----")
                lines = path.read_text(errors="replace").splitlines()
                lines = [x for x in lines if "Serve" not in x and "Pydantic" not in x]
                print("\n".join(lines[-keep:]))
        raise


def kill_flow_run(client: Any, run_id: Any) -> float:
    """kill -9 the process running a flow run (as the OOM killer would); returns when. The
    process worker records it as the run's infrastructure_pid ("host:pid")."""
    pid = int(client.read_flow_run(run_id).infrastructure_pid.rsplit(":", 1)[-1])
    os.kill(pid, signal.SIGKILL)
    return time.time()


def route_status(port: int, route: str, host: str = "127.0.0.1") -> dict[str, Any]:
    """The router's own `GET /<route>/-/status`."""
    with urllib.request.urlopen(f"http://{host}:{port}/{route}/-/status", timeout=10) as answer:
        return json.loads(answer.read())


def stage_windows(
    timeline: list[dict[str, Any]], stages: list[str], margin_s: float = 1.0
) -> dict[str, tuple[float, float]]:
    """When each of a rollout's traffic `stages` (timeline entries with `applied_s`: a
    shadow, canary steps) had its config on every router replica, until it ended, `margin_s`
    inside both ends (time.time())."""
    entries = {e["stage"]: e for e in timeline}
    order = [e["stage"] for e in timeline]
    windows = {}
    for name in stages:
        previous = entries[order[order.index(name) - 1]]
        start = previous["at"] + entries[name]["figures"]["applied_s"] + margin_s
        windows[name] = (start, entries[name]["at"] - margin_s)
    return windows


def sessions_per_step(
    answers: list[Any], windows: dict[str, tuple[float, float]], session_of: Callable[[Any], str]
) -> tuple[dict[str, dict[str, set[str]]], int]:
    """Per window, each session's set of versions that answered it (`session_of(answer)`),
    and how many fallback answers were left out (the one exception, and they say so)."""
    seen: dict[str, dict[str, set[str]]] = {name: {} for name in windows}
    fallbacks = 0
    for answer in answers:
        for name, (start, end) in windows.items():
            if start < answer.at < end:
                if answer.fallback_from:
                    fallbacks += 1
                else:
                    seen[name].setdefault(session_of(answer), set()).add(answer.version)
    return seen, fallbacks
