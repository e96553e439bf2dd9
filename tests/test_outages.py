"""The Prefect server down for 30 s while a rollout is in its canary (#26): the route's lease
lives in Ray and is still renewed, so the candidate keeps its share under a living holder; no
user's answer fails; once Prefect is back the rollout goes on (Prefect's client retries its
calls for about a minute) and its flow run ends Completed, as it really ended.

The session's own Prefect server is stopped and started again on the same state folder and
port (as `deployments.local` restarts it); the flow runs in this process."""

from __future__ import annotations

import contextvars
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlflow import MlflowClient

from deployments import local
from deployments.testing.load import LOAD_PAUSE_S, ClosedLoop
from deployments.testing.watch import route_status, wait_for
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.rollout import serve_rollout
from prefect_ray_lifecycle.tasks.rollout.config import Gates, Serving

pytestmark = pytest.mark.slow

ROUTE = "outage"
OUTAGE_S = 30
LEASE_S = 5.0
SERVING = Serving(
    num_cpus=0.1, router_num_cpus=0.1, health_check_period_s=1, health_check_timeout_s=5
)
# The canary step outlasts the outage: Prefect is stopped as soon as the candidate has its
# share, so the step is still running when Prefect comes back.
GATES = Gates(
    health_timeout_s=120,
    stability_window_s=2,
    canary_steps=[0.5],
    canary_hold_s=OUTAGE_S + 15,
    canary_max_wait_s=OUTAGE_S + 120,
    bake_s=3,
    bake_window_s=2,
    max_error_rate=0.05,
    max_p99_ms=5000,
    p99_slack_ms=3000,
    lease_s=LEASE_S,
)


@pytest.fixture
def route(stack, checkpoints):
    name = f"outage-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(2):
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
        gates=GATES,
        serving=SERVING,
        ray_cluster=cluster,
        mlflow_server=MLflowServer(tracking_uri=stack.mlflow_uri),
    )
    with cluster.connect():
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            assert serve_rollout(version="1", **common).outcome == "first_rollout"
            yield {"client": client, "name": name, "common": common}
        finally:
            serve_control.release()
            serve_control.delete_route(ROUTE, name)
            client.delete_registered_model(name)


def test_prefect_down_for_30_s_mid_canary_costs_no_answer_and_the_run_ends_true(
    stack, route, prefect_client
):
    port, prefect = stack.serve_port, stack.service("prefect")
    seen: list[dict] = []
    with (
        ClosedLoop(port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S) as traffic,
        ThreadPoolExecutor(1) as pool,
    ):
        running = pool.submit(
            contextvars.copy_context().run, serve_rollout, version="2", **route["common"]
        )

        def in_canary():
            assert not running.done(), running.result()
            return route_status(port, ROUTE)["candidate_share"] > 0

        wait_for("the canary gives v2 a share", in_canary, 240)
        local.stop(prefect)
        try:
            # Prefect is down: the route's lease is renewed in Ray all along, so the share
            # stays, under a holder that is alive.
            until = time.monotonic() + OUTAGE_S
            while time.monotonic() < until:
                status = route_status(port, ROUTE)
                seen.append(
                    {"at": time.time(), "share": status["candidate_share"], **status["lease"]}
                )
                time.sleep(1)
        finally:
            assert local.start(prefect).startswith("started")
        result = running.result(timeout=300)
        time.sleep(1)
    assert len(seen) >= OUTAGE_S // 2
    off = [s for s in seen if not (s["share"] == 0.5 and s["held"] and not s["lapsed"])]
    assert not off, (off, seen[0]["at"], result.timeline)
    assert result.outcome == "promoted", result
    assert traffic.failed() == [], traffic.failed()[:3]
    assert traffic.versions() == {"1", "2"}
    assert registry.resolve_alias(route["client"], route["name"], registry.LIVE).version == "2"
    # Prefect's record is true once it is back: the run Completed, and so did its canary.
    run = prefect_client.read_flow_run(uuid.UUID(result.flow_run_id))
    assert run.state.is_completed(), run.state
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    tasks = prefect_client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
    )
    canary = [t for t in tasks if t.name.startswith("canary_step")]
    assert canary and all(t.state.is_completed() for t in canary), canary
