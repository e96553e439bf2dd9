"""Faults while a rollout is in its canary, on a route whose router runs on two replicas
(#26); the flows run in this process, on the session's services:

- a router replica killed (kill -9): only the requests it held at that instant may fail,
  none sent after; both replicas agree on the lease, the share and the figures, Serve
  replaces the dead one and the rollout still swaps;
- the Prefect server down for 30 s: the route's lease lives in Ray and is still renewed, so
  the candidate keeps its share under a living holder; no user's answer fails; once Prefect
  is back the rollout goes on (Prefect's client retries a call for about a minute) and its
  flow run ends Completed, as it really ended;
- the Prefect server down for longer than its client retries a call (the retries cut to
  two, about 6 s, so that the outage lasts 75 s instead of 3 minutes): the rollout swaps and
  bakes in the outage, then waits for Prefect to record its ending: Completed, with its
  timeline.
The session's server is stopped and started again on the same state folder and port, as
`deployments.local` restarts it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import uuid
from typing import Any

import numpy as np
import pytest
import requests
from mlflow import MlflowClient

from deployments import local
from deployments.testing import drive
from deployments.testing.fast import FAST_SERVING
from deployments.testing.load import LOAD_PAUSE_S, ClosedLoop
from deployments.testing.watch import FAST_POLL_S, route_status, wait_for
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.rollout import serve_rollout
from prefect_ray_lifecycle.tasks.rollout.config import Gates, Serving
from prefect_ray_lifecycle.tasks.rollout.record import PREFECT_WAIT_S
from prefect_ray_lifecycle.workloads.serve.route_state import route_figures

pytestmark = pytest.mark.slow

ROUTE = "outage"
OUTAGE_S = 30
SERVING = Serving(**FAST_SERVING, router_replicas=2)
GATES = Gates(
    health_timeout_s=120,
    stability_window_s=2,
    canary_steps=[0.5],
    canary_hold_s=6,
    canary_max_wait_s=120,
    bake_s=3,
    bake_window_s=2,
    max_error_rate=0.05,
    max_p99_ms=5000,
    p99_slack_ms=3000,
    lease_s=5.0,
)


@pytest.fixture(scope="module")
def route(stack, checkpoints):
    """v1 live on the route, three more versions of the same policy to roll out."""
    name = f"outage-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(4):
        registry.register_checkpoint(
            client,
            name=name,
            checkpoint=checkpoints["good"],
            experiment_name="outage-tests",
            trial_key_value=f"{name}-{trial}",
            observation_size=4,
        )
    cluster = stack.ray_cluster()
    common = dict(
        model_name=name,
        route=ROUTE,
        serving=SERVING,
        ray_cluster=cluster,
        mlflow_server=MLflowServer(tracking_uri=stack.mlflow_uri),
    )
    with cluster.connect():
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            assert serve_rollout(version="1", gates=GATES, **common).outcome == "first_rollout"
            yield {
                "client": client,
                "name": name,
                "common": common,
                "port": cluster.serve_port,
                "url": f"http://127.0.0.1:{cluster.serve_port}/{ROUTE}",
            }
        finally:
            serve_control.release()
            serve_control.delete_route(ROUTE, name)
            client.delete_registered_model(name)


def observations(n: int) -> tuple[bytes, dict[str, str]]:
    """The n-th request: varied CartPole observations."""
    rng = np.random.default_rng(n)
    return json.dumps({"observations": rng.uniform(-0.5, 0.5, (4, 4)).tolist()}).encode(), {}


def rolling_out(route, version: str, gates: Gates):
    return drive.rolling_out(version=version, gates=gates, **route["common"])


def replica_statuses(route, count: int = 2, window_s: int | None = None) -> dict[str, dict]:
    """`-/status` as each of `count` router replicas answers it, by replica id (the proxy
    picks the replica: ask until each has answered)."""
    found: dict[str, dict] = {}
    url = f"{route['url']}/-/status" + (f"?window_s={window_s}" if window_s else "")

    def all_answered():
        status = requests.get(url, timeout=30).json()
        found[status["replica"]] = status
        return len(found) >= count

    wait_for(f"{count} router replicas answer -/status", all_answered, 60, every=0.05)
    return found


def test_a_router_replica_killed_in_a_canary_fails_only_what_it_held_and_both_agree(route):
    users = ClosedLoop(route["port"], f"/{ROUTE}", threads=4, pause_s=0.05, requests=observations)
    canary = GATES.model_copy(update={"canary_min_requests": 60})
    started = time.time()
    with users, rolling_out(route, "2", canary) as running:

        def both_in_the_canary():
            assert not running.done(), running.result()
            seen = replica_statuses(route)
            return all(s["candidate_share"] == 0.5 for s in seen.values()) and seen

        seen = wait_for("both replicas give v2 half", both_in_the_canary, 240, every=0.2)
        # The same rollout, lease and configuration on both.
        assert len({s["lease"]["holder"] for s in seen.values()}) == 1
        assert all(s["lease"]["held"] and s["serving"] == "as configured" for s in seen.values())
        assert len({json.dumps(s["config"], sort_keys=True) for s in seen.values()}) == 1

        # Serve's listing can lag the replicas that answer (one listed in another state for
        # a moment, CI saw it once): kill one it lists RUNNING.
        def both_running():
            assert not running.done(), running.result()
            pids = drive.router_pids(ROUTE)
            return set(pids) == set(seen) and pids

        before = wait_for("Serve lists both replicas RUNNING", both_running, 60, every=0.1)
        victim = sorted(before)[0]
        figures_until = time.time() - 2  # reports of both replicas flushed by then
        os.kill(before[victim], signal.SIGKILL)
        killed = time.time()
        result = running.result(timeout=300)
        time.sleep(1)
    assert result.outcome == "promoted", result
    # Only requests the killed replica held at the kill may have failed: each failure was
    # sent before it and answered after it; nothing sent after the kill failed.
    held_at_kill = [a for a in users.answers if a.at - a.latency_ms / 1000 < killed <= a.at]
    assert all(a in held_at_kill for a in users.failed()), (users.failed()[:3], killed)
    after = [a for a in users.answers if a.at - a.latency_ms / 1000 > killed]
    assert after and all(a.status == 200 for a in after)
    assert {a.version for a in after} >= {"2"}
    print(f"killed router replica: {len(users.failed())} failed of {len(held_at_kill)} in flight")
    # The route's figures hold both replicas' reports: about every answer users got, not the
    # half that one replica gave.
    answered = [a for a in users.answers if started <= a.at <= figures_until]
    counted = sum(f["requests"] for f in route_figures(ROUTE, started, figures_until).values())
    assert 0.8 * len(answered) <= counted <= 1.1 * len(answered), (counted, len(answered))
    # Serve replaced the killed replica; both replicas serve v2 alone, with the same figures.
    now = replica_statuses(route, window_s=60)
    assert victim not in now, (victim, now)

    def listed():
        return set(now) == set(drive.router_pids(ROUTE))

    wait_for("Serve lists the answering replicas RUNNING", listed, 60)
    for status in now.values():
        assert status["config"]["live"]["version"] == "2" and status["config"]["rollout"] is None
        assert status["candidate_share"] == 0.0
    versions = [set(s["figures"]["versions"]) for s in now.values()]
    assert versions[0] == versions[1] and "2" in versions[0], versions


@dataclasses.dataclass
class Outage:
    """A rollout through a Prefect outage: its result, the users' traffic, the route's share
    and lease sampled each second while Prefect was down, and when it went and came back."""

    result: Any
    traffic: ClosedLoop
    seen: list[dict]
    stopped: float
    back: float


def prefect_down_in_a_canary(stack, route, version: str, gates: Gates, outage_s: float):
    """Roll `version` out under closed-loop load; stop the session's Prefect server as soon
    as the candidate has its share, for `outage_s`, then start it again on the same state
    folder and port; wait for the rollout's result."""
    port, prefect = route["port"], stack.service("prefect")
    seen: list[dict] = []
    with (
        ClosedLoop(port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S) as traffic,
        rolling_out(route, version, gates) as running,
    ):

        def in_canary():
            assert not running.done(), running.result()
            return route_status(port, ROUTE)["candidate_share"] > 0

        wait_for(f"the canary gives v{version} a share", in_canary, 240, every=FAST_POLL_S)
        local.stop(prefect)
        stopped = time.time()
        try:
            until = time.monotonic() + outage_s
            while time.monotonic() < until:
                status = route_status(port, ROUTE)
                seen.append(
                    {"at": time.time(), "share": status["candidate_share"], **status["lease"]}
                )
                time.sleep(1)
        finally:
            assert local.start(prefect).startswith("started")
        back = time.time()
        result = running.result(timeout=PREFECT_WAIT_S)
        time.sleep(1)
    return Outage(result, traffic, seen, stopped, back)


def test_prefect_down_for_30_s_mid_canary_costs_no_answer_and_the_run_ends_true(
    stack, route, prefect_client, task_runs
):
    # The canary step outlasts the outage: Prefect is stopped as soon as the candidate has
    # its share, so the step still runs when Prefect comes back.
    gates = GATES.model_copy(
        update={"canary_hold_s": OUTAGE_S + 15, "canary_max_wait_s": OUTAGE_S + 120}
    )
    outage = prefect_down_in_a_canary(stack, route, "3", gates, OUTAGE_S)
    result, traffic, seen = outage.result, outage.traffic, outage.seen
    # Prefect was down: the route's lease is renewed in Ray all along, so the share stayed,
    # under a holder that is alive (whichever router replica answered).
    assert len(seen) >= OUTAGE_S // 2
    off = [s for s in seen if not (s["share"] == 0.5 and s["held"] and not s["lapsed"])]
    assert not off, (off, seen[0]["at"], result.timeline)
    assert result.outcome == "promoted", result
    assert traffic.failed() == [], traffic.failed()[:3]
    assert traffic.versions() == {"2", "3"}
    assert registry.resolve_alias(route["client"], route["name"], registry.LIVE).version == "3"
    # Prefect's record is true once it is back: the run Completed, and so did its canary.
    run = prefect_client.read_flow_run(uuid.UUID(result.flow_run_id))
    assert run.state.is_completed(), run.state

    def canary_steps(runs):
        return [t for t in runs if t.name.startswith("canary_step")]

    def all_completed(runs):
        return all(t.state.is_completed() for t in runs)

    def recorded(runs):
        steps = canary_steps(runs)
        return steps and all_completed(steps)

    canary = canary_steps(task_runs(run.id, recorded))
    assert canary and all_completed(canary), canary


# Prefect's client retries a call 5 times by default, 2, 4, 8, 16 and 32 s apart: a call made
# in an outage fails for good about a minute later. Cut to 2 retries (2 + 4 s) for this test,
# an outage of 75 s outlasts them by far, as 3 minutes outlast the default: the canary ends
# about 20 s in, the rollout about 10 s later, and a call it made to Prefect then (its timeline
# artifact, as before record.wait_for_prefect) would have failed about 40 s before Prefect
# came back.
LONG_OUTAGE_S = 75
SHORT_CLIENT_RETRIES = 2


def test_prefect_down_past_its_clients_retries_mid_canary_costs_no_answer_and_the_run_ends_true(
    stack, route, prefect_client
):
    """Longer than Prefect's client retries a call: the canary step ends while Prefect is
    down and the rollout goes on (its gates need Ray and MLflow only): it swaps and bakes in
    the outage, with no user's answer failed and never a candidate share without a living
    holder. Then it waits for Prefect (record.wait_for_prefect) and records its timeline, so
    the run's final state in Prefect is Completed, as it really ended. Before, it failed on its
    timeline artifact after it had promoted v4, and the run's end never reached Prefect."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    gates = GATES.model_copy(update={"canary_hold_s": 20, "canary_max_wait_s": 120})
    # The rollout runs in a copy of this context (drive.rolling_out): its client retries less.
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: SHORT_CLIENT_RETRIES}):
        outage = prefect_down_in_a_canary(stack, route, "4", gates, LONG_OUTAGE_S)
    result, traffic, seen = outage.result, outage.traffic, outage.seen
    stopped, back, port = outage.stopped, outage.back, route["port"]
    # The gates went on in the outage: v4 was swapped in while Prefect was down.
    swapped = [e["at"] for e in result.timeline if e["stage"] == "swap"]
    assert swapped and stopped < swapped[0] < back, (stopped, back, result.timeline)
    assert result.outcome == "promoted", result
    unheld = [s for s in seen if s["share"] > 0 and not (s["held"] and not s["lapsed"])]
    assert not unheld, unheld
    assert any(s["share"] > 0 for s in seen) and seen[-1]["share"] == 0, (seen[0], seen[-1])
    assert traffic.failed() == [], traffic.failed()[:3]
    assert registry.resolve_alias(route["client"], route["name"], registry.LIVE).version == "4"
    status = route_status(port, ROUTE)
    assert status["config"]["live"]["version"] == "4" and status["candidate_share"] == 0
    # Prefect's record, made once it was back: the run Completed, with its timeline.
    run = prefect_client.read_flow_run(uuid.UUID(result.flow_run_id))
    assert run.state.is_completed(), run.state
    artifacts = prefect_client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
    )
    timelines = [str(a.data) for a in artifacts if a.type == "markdown"]
    assert any("**Decision: v4 replaced v" in t for t in timelines), timelines
