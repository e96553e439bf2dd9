"""A person's approval of a rollout, on the deployments a user runs (`deployments.setup`,
`prefect --no-prompt deploy --all`, a process worker, serve-rollout's concurrency limit), with
load through the router: a deployed serve-rollout run waits for approval longer than its
deployment slot's initial lease and is still Paused (its deployment run still Running, its
slot held and renewable), then an approval swaps it in; an abort and a timeout reject it at
`approval`; kill -9 while it waits drops the candidate within the route lease, and the
reconcile that the Crashed run starts asks again (and swaps only once approved).

Its own Prefect server, started with the shortest initial deployment lease Prefect allows
(PREFECT_SERVER_CONCURRENCY_INITIAL_DEPLOYMENT_LEASE_DURATION=30), so that "longer than the
slot's lease" takes half a minute. The session's Ray head and MLflow serve the rest."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from deployments import approve, local, ports
from deployments.testing.fast import FAST_SERVING
from deployments.testing.load import LOAD_PAUSE_S, ClosedLoop
from deployments.testing.stack import SCHEDULER_ENV, deployed, environ, pointed_at
from deployments.testing.watch import (
    FAST_POLL_S,
    deployment_runs,
    kill_flow_run,
    route_status,
    started_run,
    wait_for,
)
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.tasks.rollout.approval import APPROVAL_FLOW

pytestmark = pytest.mark.slow

MODEL = "cartpole-ppo"  # the model the deployments' reconcile rolls out by default
ROUTE = "policy"
LEASE_S = 5.0
SLOT_LEASE_S = 30  # the server's initial deployment lease here (Prefect's minimum)
GATES = {
    "health_timeout_s": 120,
    "stability_window_s": 2,
    "canary_steps": [0.3],
    "canary_hold_s": 2,
    "canary_max_wait_s": 60,
    "bake_s": 2,
    "bake_window_s": 2,
    "max_error_rate": 0.05,
    "max_p99_ms": 5000,
    "p99_slack_ms": 3000,
    "lease_s": LEASE_S,
    "approval": "before_swap",
    "approval_timeout_s": 900,
}
SERVING = FAST_SERVING


@pytest.fixture(scope="module")
def approvals(stack, checkpoints):
    """The session's Ray head and MLflow, this module's own Prefect server, the deployments
    and a worker on it; five versions of the model, the first one live."""
    state = Path(tempfile.mkdtemp(prefix="rlt-approval-", dir="/tmp"))
    (port,) = ports.free_ports(1)
    prefect = dataclasses.replace(
        local.Service("prefect", port, state),
        extra_env=(
            *SCHEDULER_ENV,
            ("PREFECT_SERVER_CONCURRENCY_INITIAL_DEPLOYMENT_LEASE_DURATION", str(SLOT_LEASE_S)),
        ),
    )
    outcome = local.start(prefect)
    assert outcome.startswith("started"), outcome
    ours = dataclasses.replace(stack, prefect_api_url=f"{prefect.url}/api")
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(5):
        registry.register_checkpoint(
            client,
            name=MODEL,
            checkpoint=checkpoints["good"],
            experiment_name="approval-tests",
            trial_key_value=f"approval-{trial}",
            observation_size=4,
        )
    fast = {"gates": GATES, "serving": SERVING}
    parameters = {"serve-rollout/serve-rollout": fast, "reconcile/reconcile": fast}
    # Heartbeats every 30 s (Prefect's minimum), as deployments.setup's worker sends them.
    try:
        with pointed_at(ours), environ({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}):
            with deployed(ours, routes=(ROUTE,), parameters=parameters, webhook=False):
                from prefect.client.orchestration import get_client

                with get_client(sync_client=True) as prefect_client:
                    yield {"client": client, "prefect": prefect_client, "port": stack.serve_port}
                    for run in deployment_runs(prefect_client, "reconcile/reconcile"):
                        if not run.state.is_final():
                            prefect_client.delete_flow_run(run.id)
    finally:
        cluster = stack.ray_cluster()
        with cluster.connect():
            serve_control.start(cluster.serve_host, cluster.serve_port)
            serve_control.delete_route(ROUTE, MODEL)
            serve_control.release()
        client.delete_registered_model(MODEL)
        local.stop(prefect)
        shutil.rmtree(state, ignore_errors=True)


def roll_out(approvals, version: int, **gates):
    """Start a deployed serve-rollout run of `version` (through the worker); its flow run."""
    from prefect.deployments import run_deployment

    return run_deployment(
        "serve-rollout/serve-rollout",
        parameters={"version": str(version), "gates": {**GATES, **gates}},
        timeout=0,
    )


def paused(approvals, run_id, timeout: float = 240):
    """The rollout-approval subflow under `run_id` once it waits with its form stored."""
    prefect = approvals["prefect"]
    return wait_for(
        f"the approval of {run_id} waits", lambda: approve.waiting_run(prefect, run_id), timeout
    )


def finished(approvals, run_id, timeout: float = 240):
    prefect = approvals["prefect"]
    return wait_for(
        f"flow run {run_id} ends",
        lambda: (run := prefect.read_flow_run(run_id)).state.is_final() and run,
        timeout,
    )


def tags(approvals, version) -> dict[str, str]:
    found = approvals["client"].get_model_version(MODEL, str(version)).tags
    prefix = f"{registry.TAG}.rollout."
    return {k.removeprefix(prefix): v for k, v in found.items() if k.startswith(prefix)}


def live(approvals) -> str | None:
    found = registry.resolve_alias(approvals["client"], MODEL, registry.LIVE)
    return found.version if found else None


def heartbeats(prefect, run_id, since: float) -> int:
    from datetime import UTC, datetime

    from prefect.events.filters import (
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
        EventResourceFilter,
    )

    flt = EventFilter(
        event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{run_id}"]),
        occurred=EventOccurredFilter(since=datetime.fromtimestamp(since, UTC)),
    )
    return len(prefect.read_events(filter=flt, limit=50).events)


def test_approval_through_the_prefect_api_survives_the_slots_lease_then_swaps(approvals):
    prefect, port = approvals["prefect"], approvals["port"]
    first = finished(approvals, roll_out(approvals, 1, approval="none").id)
    assert first.state.is_completed() and live(approvals) == "1"
    with ClosedLoop(port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S) as traffic:
        run = roll_out(approvals, 2)
        waiting = paused(approvals, run.id)
        since = time.time()
        assert waiting.name.startswith("approve v2 on /policy before the swap")
        # A subflow waits: the deployment run stays Running and keeps its slot while it does.
        deployment = prefect.read_deployment_by_name("serve-rollout/serve-rollout")
        wait_for(
            "the pause outlasts the slot's initial lease",
            lambda: time.time() - since > SLOT_LEASE_S + 5,
            SLOT_LEASE_S + 30,
        )
        rollout_run = prefect.read_flow_run(run.id)
        assert rollout_run.state.is_running(), rollout_run.state
        assert prefect.read_flow_run(waiting.id).state.is_paused()
        lease_id = rollout_run.state.state_details.deployment_concurrency_lease_id
        assert lease_id is not None  # still its own: no Paused transition revoked it
        prefect.renew_concurrency_lease(lease_id, 300)  # what the engine's next renewal does
        limit = prefect.read_deployment(deployment.id).global_concurrency_limit
        assert limit.active_slots == 1
        # The candidate keeps its share while a person looks, under a lease still renewed.
        status = route_status(port, ROUTE)
        assert status["candidate_share"] == 0.3 and status["lease"]["held"]
        assert status["config"]["rollout"]["approval"]["point"] == "before_swap"
        # Both runs keep sending heartbeats: no silent-run automation marks them Crashed.
        for beating in (run.id, waiting.id):
            wait_for(
                "a heartbeat while paused", lambda b=beating: heartbeats(prefect, b, since), 45
            )
        assert live(approvals) == "1"
        code = approve.main(
            [str(run.id), "--approve", "--reason", "canary looks right", "--name", "Grace"]
        )
        assert code == 0
        done = finished(approvals, run.id)
    assert done.state.is_completed(), done.state
    assert live(approvals) == "2"
    assert traffic.failed() == [] and traffic.versions() == {"1", "2"}
    found = tags(approvals, 2)
    assert found["verdict"] == "promoted" and found["approved_by"] == "Grace"
    assert "canary looks right" in found["approval_reason"]
    assert prefect.read_flow_run(waiting.id).state.is_completed()


def test_an_abort_or_a_timeout_rejects_at_approval_with_the_reason_and_name(approvals):
    from prefect.flow_runs import resume_flow_run

    prefect, port = approvals["prefect"], approvals["port"]
    with ClosedLoop(port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S) as traffic:
        run = roll_out(
            approvals, 3, canary_steps=[0.3, 0.6], approval="after_step", approval_step=0.3
        )
        waiting = paused(approvals, run.id)
        assert route_status(port, ROUTE)["candidate_share"] == 0.3
        answer = {"decision": "abort", "reason": "p99 looks off", "name": "Ada"}
        resume_flow_run(waiting.id, run_input=answer)
        aborted = finished(approvals, run.id)
        timed = finished(approvals, roll_out(approvals, 4, approval_timeout_s=3).id)
    assert aborted.state.is_failed() and "approval" in aborted.state.message
    found = tags(approvals, 3)
    assert (found["verdict"], found["stage"]) == ("rejected", "approval")
    assert found["reason"] == "aborted by Ada: p99 looks off" and found["approval_by"] == "Ada"
    # The flow decided the timeout itself: the approval ended true (Completed, not Failed by
    # Prefect's pause expiry), and the rollout was rejected for it.
    assert timed.state.is_failed() and "timed out" in timed.state.message
    found = tags(approvals, 4)
    assert (found["verdict"], found["stage"]) == ("rejected", "approval")
    assert "no decision within 3 s" in found["reason"]
    (approval_run,) = [r for r in prefect.read_flow_runs() if r.name.startswith("approve v4")]
    assert approval_run.state.is_completed()
    assert live(approvals) == "2" and traffic.failed() == []
    status = route_status(port, ROUTE)
    assert status["config"]["candidate"] is None and status["config"]["live"]["version"] == "2"


def test_a_killed_waiting_rollout_leaves_live_only_and_the_reconcile_asks_again(approvals):
    prefect, port = approvals["prefect"], approvals["port"]
    with ClosedLoop(port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S) as traffic:
        run = roll_out(approvals, 5)
        first_ask = paused(approvals, run.id)
        assert route_status(port, ROUTE)["candidate_share"] > 0
        killed = kill_flow_run(prefect, run.id)
        dropped = wait_for(
            "the candidate share drops to 0",
            lambda: route_status(port, ROUTE)["candidate_share"] == 0 and time.time(),
            timeout=LEASE_S + 10,
            every=FAST_POLL_S,  # timed against the lease below
        )
        assert dropped - killed <= LEASE_S + 2
        # The Crashed run starts a reconcile; it takes the route over and asks again.
        reconcile = started_run(prefect, "reconcile/reconcile", killed, timeout=240)
        second_ask = paused(approvals, reconcile.id)
        assert second_ask.id != first_ask.id
        assert route_status(port, ROUTE)["candidate_share"] == 0.3  # restored, under its claim
        assert live(approvals) == "2"  # never an unapproved swap
        assert prefect.read_flow_run(first_ask.id).state.is_crashed()
        argv = [str(reconcile.id), "--approve", "--reason", "again", "--name", "Lin"]
        assert approve.main(argv) == 0
        done = finished(approvals, reconcile.id)
    assert prefect.read_flow_run(run.id).state.is_crashed()
    assert done.state.is_completed(), done.state
    found = tags(approvals, 5)
    assert live(approvals) == "5" and (found["verdict"], found["approved_by"]) == (
        "promoted",
        "Lin",
    )
    assert traffic.failed() == []


def test_the_approve_command_says_when_nothing_waits(approvals):
    done = deployment_runs(approvals["prefect"], "serve-rollout/serve-rollout")[0]
    argv = [str(done.id), "--abort", "--reason", "x", "--name", "y", "--wait", "0"]
    assert approve.main(argv) == approve.NOT_WAITING
    assert APPROVAL_FLOW == "rollout-approval"
