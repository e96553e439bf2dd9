"""The control loop end to end, with nobody watching, on the deployments a user runs
(`deployments.setup`, `prefect deploy --all`, a real process worker), one deployment set and
one route shared by every test here, in order:

- `champion` moved with MlflowClient reaches the route through MLflow's webhook, the
  receiver's Prefect event and the reconcile deployment's trigger;
- a rollout whose flow process is killed (kill -9) in its canary is taken back by the route
  itself when its lease lapses, and a reconcile that the Crashed run starts (an automation)
  withdraws it and rolls the champion out again; killed again in its bake, the next reconcile
  bakes it again and finishes it; load runs through the router the whole time, and no answer
  may fail;
- a restarted Ray head gets its route back from MLflow's `live`, with nobody acting;
- the local stack stopped while a reconcile rolls a version out, and started again, as the
  README says (`deployments.setup --worker stop`, `deployments.local down --ray`, then `up`
  and `--worker start`): the runs that died with it are marked Crashed when the worker starts,
  their concurrency slots are free (Prefect's leases are kept on disk), and the next champion
  move rolls out with nobody acting. Before, the dead runs stayed Running and every later
  reconcile waited for a slot forever;
- with the receiver down, the interval reconcile still converges."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import pytest
from mlflow import MlflowClient

from deployments import local, setup
from deployments.testing.load import LOAD_PAUSE_S, ClosedLoop
from deployments.testing.stack import deployed
from deployments.testing.watch import (
    deployment_runs,
    kill_flow_run,
    route_status,
    started_run,
    wait_for,
)
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.reconcile import reconcile
from prefect_ray_lifecycle.tasks.rollout.claim import run_and_subflows

MODEL = "cartpole-ppo"  # the model prefect.yaml's reconcile trigger watches
ROUTE = "policy"  # the deployments' default route
VERSIONS = 5
LEASE_S = 5.0
GATES = {
    "health_timeout_s": 120,
    "stability_window_s": 3,
    "canary_steps": [0.5],
    "canary_hold_s": 8,
    # Without load a canary waits for its requests: the stack is stopped while it waits.
    "canary_min_requests": 5,
    "canary_max_wait_s": 120,
    "bake_s": 8,
    "bake_window_s": 2,
    "max_error_rate": 0.05,
    "max_p99_ms": 5000,
    "p99_slack_ms": 3000,
    "lease_s": LEASE_S,
}
SERVING = {
    "num_cpus": 0.1,
    "router_num_cpus": 0.1,
    "health_check_period_s": 1,
    "health_check_timeout_s": 5,
}
FAST = {"gates": GATES, "serving": SERVING}

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def worker_log_on_failure(stack):
    """On a failure, the worker's log (the flow runs' own output) is the first thing to read."""
    try:
        yield
    except BaseException:
        log = stack.state_dir / "logs" / "worker.log"
        if log.exists():
            print("---- worker log (tail) ----")
            lines = log.read_text(errors="replace").splitlines()
            keep = [x for x in lines if "Serve" not in x and "Pydantic" not in x]
            print("\n".join(keep[-300:]))
        raise


@pytest.fixture(scope="module")
def lifecycle(stack, checkpoints, prefect_client):
    """Five versions of the model the triggers watch, the deployments a user runs, and the
    first champion move: nothing serves the route yet, so v1 is restored to it (a first
    rollout through health and smoke). Everything removed at the end."""
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(VERSIONS):
        registry.register_checkpoint(
            client,
            name=MODEL,
            checkpoint=checkpoints["good"],
            experiment_name="recovery-tests",
            trial_key_value=f"recovery-{trial}",
            observation_size=4,
        )
    parameters = {"reconcile/reconcile": FAST, "serve-rollout/serve-rollout": FAST}
    try:
        with deployed(stack, routes=(ROUTE,), parameters=parameters):
            moved = time.time()
            client.set_registered_model_alias(MODEL, registry.CHAMPION, "1")
            first = started(prefect_client, moved)
            wait_for(
                "v1 goes live",
                lambda: prefect_client.read_flow_run(first.id).state.is_completed(),
                timeout=240,
            )
            try:
                yield {
                    "client": client,
                    "port": stack.serve_port,
                    "prefect": prefect_client,
                    "first": first,
                }
            finally:
                for run in runs(prefect_client):  # never leave a run for a later module's worker
                    if not run.state.is_final():
                        prefect_client.delete_flow_run(run.id)
                _remove_route(stack)
    finally:
        client.delete_registered_model(MODEL)


def _remove_route(stack) -> None:
    cluster = stack.ray_cluster()
    with cluster.connect():
        serve_control.start(cluster.serve_host, cluster.serve_port)
        serve_control.delete_route(ROUTE, MODEL)


def runs(prefect_client, after: float = 0.0) -> list:
    return deployment_runs(prefect_client, "reconcile/reconcile", after)


def started(prefect_client, after: float, skip: tuple = ()):
    return started_run(prefect_client, "reconcile/reconcile", after, skip, timeout=240)


def router_status(port: int) -> dict:
    return route_status(port, ROUTE)


def live(client) -> str | None:
    found = registry.resolve_alias(client, MODEL, registry.LIVE)
    return found.version if found else None


def answers(port: int) -> str | None:
    """The version the route answers with, or None while nothing answers."""
    try:
        return route_status(port, ROUTE)["config"]["live"]["version"]
    except Exception:
        return None


def recovered_events(prefect_client, version: str) -> list:
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    flt = EventFilter(
        event=EventNameFilter(name=["ray-lifecycle.rollout.recovered"]),
        resource=EventResourceFilter(id=[f"mlflow.model-version.{MODEL}.{version}"]),
    )
    return prefect_client.read_events(filter=flt, limit=20).events


def test_a_moved_champion_reaches_the_route_and_survives_killed_rollouts(stack, lifecycle):
    with worker_log_on_failure(stack):
        moved_champion_survives_killed_rollouts(lifecycle)


def moved_champion_survives_killed_rollouts(lifecycle):
    client, port, prefect = lifecycle["client"], lifecycle["port"], lifecycle["prefect"]
    # The fixture's champion move was the reconcile deployment's own run (its trigger's).
    first = lifecycle["first"]
    assert first.parameters["model_name"] == MODEL
    assert live(client) == "1" and router_status(port)["config"]["live"]["version"] == "1"

    with ClosedLoop(port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S) as traffic:
        # v2 becomes champion; its rollout is killed in the canary.
        moved = time.time()
        client.set_registered_model_alias(MODEL, registry.CHAMPION, "2")
        canary_run = started(prefect, moved)
        wait_for(
            "the canary sends v2 traffic",
            lambda: router_status(port)["candidate_share"] > 0,
            timeout=240,
        )
        killed = kill_flow_run(prefect, canary_run.id)
        # The route takes the canary back by itself once the dead run's lease lapses.
        safe = wait_for(
            "the candidate share drops to 0",
            lambda: router_status(port)["candidate_share"] == 0 and time.time(),
            timeout=LEASE_S + 10,
        )
        assert safe - killed <= LEASE_S + 2
        assert router_status(port)["lease"]["lapsed"] is True
        # The Crashed run starts a reconcile (an automation): it withdraws v2, then rolls the
        # champion out again. Killed in its bake, it is baked again by the next one.
        bake_run = started(prefect, killed, skip=(canary_run.id, first.id))
        wait_for(
            "the recovery's rollout reaches its bake",
            lambda: (router_status(port)["config"]["rollout"] or {}).get("stage") == "bake",
            timeout=240,
        )
        killed_in_bake = kill_flow_run(prefect, bake_run.id)
        final = started(prefect, killed_in_bake, skip=(canary_run.id, first.id, bake_run.id))
        wait_for(
            "the route converges on v2",
            lambda: prefect.read_flow_run(final.id).state.is_completed(),
            timeout=240,
        )
        time.sleep(1)
    assert live(client) == "2"
    status = router_status(port)
    assert status["config"]["live"]["version"] == "2" and status["config"]["rollout"] is None
    # No user saw any of it.
    assert traffic.failed() == [], traffic.failed()[:3]
    assert traffic.answers[-1].version == "2"
    for run in (canary_run, bake_run):
        assert prefect.read_flow_run(run.id).state.is_crashed()
    actions = {e.payload["action"] for e in recovered_events(prefect, "2")}
    assert actions == {"withdrawn", "promoted"}


def stop_the_stack(stack) -> None:
    """What the README says to run: the worker (and the flow runs it started), then every
    service, the Ray head too."""
    setup.stop_worker(stack.state_dir)
    for service in reversed(stack.services):
        local.stop(service)


def start_the_stack(stack) -> list[str]:
    for service in stack.services:
        assert local.start(service).startswith("started"), service.name
    return setup.start_worker(stack.state_dir, stack.client_env()).splitlines()


def test_a_restarted_ray_head_gets_its_route_back_with_nobody_acting(
    stack, lifecycle, prefect_client, task_runs
):
    """The route's heartbeats stop with the head; the trigger's reconcile waits for the new
    head and restores the route from MLflow's `live`, through health and smoke."""
    client, port = lifecycle["client"], lifecycle["port"]
    version = live(client)  # what the tests before left live
    assert version is not None and answers(port) == version
    head = stack.service("ray")
    local.stop(head)
    stopped = time.time()
    local.start(head)  # same address and token, no Serve state
    restored_at = wait_for(
        f"the route serves v{version} again",
        lambda: answers(port) == version and time.time(),
        timeout=300,
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
    assert live(client) == version
    # Restored through the gates: its serve-rollout subflow deployed it and smoke-tested it.
    (rollout,) = [r for r in run_and_subflows(prefect_client, run.id) if r.id != run.id]
    assert prefect_client.read_flow(rollout.flow_id).name == "serve-rollout"
    assert rollout.state.is_completed(), rollout.state.message
    stages = {t.name.split("-")[0]: t.state.type.value for t in task_runs(rollout.id)}
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
    client, port = lifecycle["client"], lifecycle["port"]
    # v3's rollout is in its canary when the whole stack goes down.
    moved = time.time()
    client.set_registered_model_alias(MODEL, registry.CHAMPION, "3")
    rolling = started(prefect_client, moved)
    wait_for(
        "the canary gives v3 a share",
        lambda: route_status(port, ROUTE)["candidate_share"] > 0,
        timeout=240,
    )
    subflow = _children(prefect_client, rolling.id)
    assert [prefect_client.read_flow(r.flow_id).name for r in subflow] == ["serve-rollout"]
    stop_the_stack(stack)
    restarted = time.time()
    swept = start_the_stack(stack)

    # The worker's start found both dead runs and marked them Crashed.
    for run in (rolling, *subflow):
        state = prefect_client.read_flow_run(run.id).state
        assert state.is_crashed(), (run.name, state.name, swept)
    assert any(str(rolling.id) in line for line in swept), swept

    # Nothing is wedged: the next champion move is rolled out with nobody acting (whatever
    # reconcile the Crashed runs or the lost route started may run first; none waits forever).
    client.set_registered_model_alias(MODEL, registry.CHAMPION, "4")

    def v4_serves() -> bool:
        return live(client) == "4" and answers(port) == "4"

    with ClosedLoop(port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S):  # what the canaries judge
        wait_for("v4 is rolled out after the restart", _quietly(v4_serves), timeout=420)
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


def test_with_the_receiver_down_the_interval_reconcile_still_converges(stack, lifecycle):
    from prefect.client.schemas.schedules import IntervalSchedule

    client, prefect = lifecycle["client"], lifecycle["prefect"]
    receiver = stack.service("receiver")
    deployment = prefect.read_deployment_by_name("reconcile/reconcile")
    (schedule,) = prefect.read_deployment_schedules(deployment.id)
    local.stop(receiver)
    try:
        client.set_registered_model_alias(MODEL, registry.CHAMPION, "5")  # delivery fails
        turned_on = time.time()
        prefect.update_deployment_schedule(
            deployment.id,
            schedule.id,
            active=True,
            schedule=IntervalSchedule(interval=timedelta(seconds=5)),
        )

        def converged():
            done = [r for r in runs(prefect, turned_on) if r.state.is_completed()]
            return live(client) == "5" and done

        done = wait_for("the interval reconcile rolls v5 out", converged, timeout=240)
        # The run that did it came from the schedule, not from an event.
        assert all(r.auto_scheduled and "model_name" not in r.parameters for r in done)
    finally:
        prefect.update_deployment_schedule(deployment.id, schedule.id, active=False)
        local.start(receiver)


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
