"""The local stack stopped while a reconcile rolls a version out, and started again, as the
README says (`deployments.setup --worker stop`, `deployments.local down --ray`, then `up` and
`--worker start`): the runs that died with it are marked Crashed when the worker starts, their
concurrency slots are free (Prefect's leases are kept on disk), and the next champion move
rolls out with nobody acting. Before, the dead runs stayed Running and every later reconcile
waited for a slot forever."""

from __future__ import annotations

import time

import pytest
from mlflow import MlflowClient

from deployments import local
from deployments.testing.fast import FAST_SERVING, ONE_STEP_CANARY
from deployments.testing.load import LOAD_PAUSE_S, ClosedLoop
from deployments.testing.stack import deployed, start_all, stop_all
from deployments.testing.watch import (
    FAST_POLL_S,
    deployment_runs,
    explain_on_failure,
    route_status,
    started_run,
    wait_for,
)
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.reconcile import reconcile
from prefect_ray_lifecycle.tasks.rollout.claim import run_and_subflows

MODEL = "cartpole-ppo"  # the model prefect.yaml's reconcile trigger watches
ROUTE = "policy"
GATES = ONE_STEP_CANARY
SERVING = FAST_SERVING
FAST = {"gates": GATES, "serving": SERVING}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lifecycle(stack, checkpoints, prefect_client):
    """Three versions of the model the triggers watch, the deployments a user runs, and v1
    live on the route; everything removed at the end."""
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(3):
        registry.register_checkpoint(
            client,
            name=MODEL,
            checkpoint=checkpoints["good"],
            experiment_name="restart-tests",
            trial_key_value=f"restart-{trial}",
            observation_size=4,
        )
    parameters = {"reconcile/reconcile": FAST, "serve-rollout/serve-rollout": FAST}
    try:
        with deployed(stack, routes=(ROUTE,), parameters=parameters):
            moved = time.time()
            client.set_registered_model_alias(MODEL, registry.CHAMPION, "1")
            first = started_run(prefect_client, "reconcile/reconcile", moved, timeout=240)
            wait_for(
                "v1 goes live",
                lambda: prefect_client.read_flow_run(first.id).state.is_completed(),
                timeout=240,
            )
            yield client, first
            _remove_route(stack)
    finally:
        client.delete_registered_model(MODEL)


def _remove_route(stack) -> None:
    cluster = stack.ray_cluster()
    with cluster.connect():
        serve_control.start(cluster.serve_host, cluster.serve_port)
        serve_control.delete_route(ROUTE, MODEL)


def heartbeats(prefect_client, since, version: str) -> list:
    """The route watch's heartbeats for the route serving `version`, recorded since `since`:
    what arms the trigger that restores a lost route."""
    from prefect.events.filters import (
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
        EventResourceFilter,
    )

    flt = EventFilter(
        occurred=EventOccurredFilter(since=since),
        event=EventNameFilter(name=["ray-lifecycle.route.healthy"]),
        resource=EventResourceFilter(id=[f"ray-lifecycle.route.{ROUTE}"]),
    )
    found = prefect_client.read_events(filter=flt, limit=50).events
    return [e for e in found if e.resource.get("ray-lifecycle.live") == version]


def answers(port: int) -> str | None:
    """The version the route answers with, or None while nothing answers."""
    try:
        return route_status(port, ROUTE)["config"]["live"]["version"]
    except Exception:
        return None


def test_a_restarted_ray_head_gets_its_route_back_with_nobody_acting(
    stack, lifecycle, prefect_client, task_runs
):
    """The route's heartbeats stop with the head; the trigger's reconcile waits for the new
    head and restores the route from MLflow's `live`, through health and smoke."""
    with explain_on_failure(prefect_client, "reconcile/reconcile", stack.state_dir):
        restarted_head_restored(stack, lifecycle, prefect_client, task_runs)


def restarted_head_restored(stack, lifecycle, prefect_client, task_runs):
    client, first = lifecycle
    port = stack.serve_port
    assert answers(port) == "1"
    # The trigger restores a route whose heartbeats stop after it had some (its `after`). The
    # rollout that put v1 live sent the route's first beat itself, so the head is stopped as
    # soon as that beat is recorded, whatever the watch (every 10 s) has sent by then: a head
    # lost seconds after a first rollout is restored too.
    (rollout,) = _children(prefect_client, first.id)
    wait_for(
        "the rollout's own heartbeat of the live route",
        lambda: [
            e
            for e in heartbeats(prefect_client, rollout.start_time, "1")
            if f"prefect.flow-run.{rollout.id}" in {r.id for r in e.related}
        ],
        timeout=60,
    )
    head = stack.service("ray")
    local.stop(head)
    stopped = time.time()
    local.start(head)  # same address and token, no Serve state
    restored_at = wait_for(
        "the route serves v1 again", lambda: answers(port) == "1" and time.time(), timeout=300
    )
    (run,) = [
        r
        for r in deployment_runs(prefect_client, "reconcile/reconcile", stopped)
        if r.parameters.get("route") == ROUTE
    ]
    wait_for("its reconcile ends", lambda: prefect_client.read_flow_run(run.id).state.is_final())
    run = prefect_client.read_flow_run(run.id)
    assert run.state.is_completed(), run.state.message
    # Started by the route watch's trigger (the lost route's model and kind), not a schedule.
    assert run.parameters == {**run.parameters, "model_name": MODEL, "kind": "policy"}
    assert not run.auto_scheduled
    assert registry.resolve_alias(client, MODEL, registry.LIVE).version == "1"
    # Restored through the gates: its serve-rollout subflow deployed v1 and smoke-tested it.
    (rollout,) = [r for r in run_and_subflows(prefect_client, run.id) if r.id != run.id]
    assert prefect_client.read_flow(rollout.flow_id).name == "serve-rollout"
    assert rollout.state.is_completed(), rollout.state.message

    def gated(runs):
        done = {t.name.split("-")[0] for t in runs if t.state.is_completed()}
        return {"deploy_candidate", "smoke"} <= done

    stages = {t.name.split("-")[0]: t.state.type.value for t in task_runs(rollout.id, gated)}
    assert stages["deploy_candidate"] == stages["smoke"] == "COMPLETED", stages
    # Then what is served is what MLflow wants: nothing more to do.
    cluster = stack.ray_cluster()
    again = reconcile(
        model_name=MODEL,
        route=ROUTE,
        ray_cluster=cluster,
        mlflow_server=MLflowServer(tracking_uri=stack.mlflow_uri),
        **FAST,
    )
    assert again.action == "in_sync", again
    print(f"route restored {restored_at - stopped:.0f} s after the head stopped")


def test_a_stack_stopped_mid_rollout_comes_back_unwedged(stack, lifecycle, prefect_client):
    with explain_on_failure(prefect_client, "reconcile/reconcile", stack.state_dir):
        stack_comes_back_unwedged(stack, lifecycle, prefect_client)


def stack_comes_back_unwedged(stack, lifecycle, prefect_client):
    client, first = lifecycle
    port = stack.serve_port
    # v2's rollout is in its canary when the whole stack goes down.
    moved = time.time()
    client.set_registered_model_alias(MODEL, registry.CHAMPION, "2")
    rolling = started_run(
        prefect_client, "reconcile/reconcile", moved, skip=(first.id,), timeout=240
    )
    wait_for(
        "the canary gives v2 a share",
        lambda: route_status(port, ROUTE)["candidate_share"] > 0,
        timeout=240,
        every=FAST_POLL_S,  # stopped in the canary
    )
    subflow = _children(prefect_client, rolling.id)
    assert [prefect_client.read_flow(r.flow_id).name for r in subflow] == ["serve-rollout"]
    stop_all(stack)
    restarted = time.time()
    swept = start_all(stack)

    # The worker's start found both dead runs and marked them Crashed.
    for run in (rolling, *subflow):
        state = prefect_client.read_flow_run(run.id).state
        assert state.is_crashed(), (run.name, state.name, swept)
    assert any(str(rolling.id) in line for line in swept), swept

    # Nothing is wedged: the next champion move is rolled out with nobody acting (whatever
    # reconcile the Crashed runs or the lost route started may run first; none waits forever).
    client.set_registered_model_alias(MODEL, registry.CHAMPION, "3")

    def v3_serves() -> bool:
        live = registry.resolve_alias(client, MODEL, registry.LIVE)
        return live is not None and live.version == "3" and answers(port) == "3"

    with ClosedLoop(port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S):  # what the canaries judge
        wait_for("v3 is rolled out after the restart", _quietly(v3_serves), timeout=420)
    # Every reconcile started since the restart ends Completed: none is left waiting.
    since = wait_for(
        "the reconciles since the restart end",
        lambda: (
            (runs := deployment_runs(prefect_client, "reconcile/reconcile", restarted))
            and all(r.state.is_final() for r in runs)
            and runs
        ),
        timeout=240,
    )
    assert [r.state.name for r in since] == ["Completed"] * len(since)


def _children(prefect_client, flow_run_id) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return prefect_client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])
        )
    )


def _quietly(check):
    """A check that counts a route or service still coming up as not yet."""

    def run():
        try:
            return check()
        except Exception:
            return False

    return run
