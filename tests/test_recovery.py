"""The control loop end to end, with nobody watching, on the deployments a user runs
(`deployments.setup`, `prefect deploy --all`, a real process worker):

- `champion` moved with MlflowClient reaches the route through MLflow's webhook, the
  receiver's Prefect event and the reconcile deployment's trigger;
- a rollout whose flow process is killed (kill -9) in its canary is taken back by the route
  itself when its lease lapses, and a reconcile that the Crashed run starts (an automation)
  withdraws it and rolls the champion out again; killed again in its bake, the next reconcile
  bakes it again and finishes it;
- with the receiver down (the champion move's delivery lost), a run of the interval schedule
  rolls the champion out.
Load runs through the router in the first test, and no answer may fail."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from mlflow import MlflowClient

from deployments import local
from deployments.testing.fast import FAST_SERVING
from deployments.testing.load import LOAD_PAUSE_S, ClosedLoop
from deployments.testing.stack import deployed
from deployments.testing.watch import (
    FAST_POLL_S,
    deployment_runs,
    explain_on_failure,
    kill_flow_run,
    route_status,
    started_run,
    wait_for,
)
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.tasks.rollout.claim import run_and_subflows

MODEL = "cartpole-ppo"  # the model prefect.yaml's reconcile trigger watches
ROUTE = "policy"  # the deployments' default route
ROUTE_WATCH = "reconcile-a-route-that-stopped-answering"  # prefect.yaml's trigger
LEASE_S = 5.0
GATES = {
    "health_timeout_s": 120,
    "stability_window_s": 3,
    "canary_steps": [0.5],
    "canary_hold_s": 8,
    "canary_max_wait_s": 60,
    "bake_s": 8,
    "bake_window_s": 2,
    "max_error_rate": 0.05,
    "max_p99_ms": 5000,
    "p99_slack_ms": 3000,
    "lease_s": LEASE_S,
}
SERVING = FAST_SERVING
FAST = {"gates": GATES, "serving": SERVING}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lifecycle(stack, checkpoints, prefect_client):
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(3):
        registry.register_checkpoint(
            client,
            name=MODEL,
            checkpoint=checkpoints["good"],
            experiment_name="recovery-tests",
            trial_key_value=f"recovery-{trial}",
            observation_size=4,
        )
    parameters = {"reconcile/reconcile": FAST, "serve-rollout/serve-rollout": FAST}
    with deployed(stack, routes=(ROUTE,), parameters=parameters):
        cluster = stack.ray_cluster()
        try:
            yield {"client": client, "port": stack.serve_port, "prefect": prefect_client}
        finally:
            reconciles = runs(prefect_client)
            for run in reconciles:  # never leave a run for a later module's worker
                if not run.state.is_final():
                    prefect_client.delete_flow_run(run.id)
            with cluster.connect():
                serve_control.start(cluster.serve_host, cluster.serve_port)
                serve_control.delete_route(ROUTE, MODEL)
            client.delete_registered_model(MODEL)


def runs(prefect_client, after: float = 0.0) -> list:
    return deployment_runs(prefect_client, "reconcile/reconcile", after)


def started(prefect_client, after: float, skip: tuple = ()):
    return started_run(prefect_client, "reconcile/reconcile", after, skip, timeout=240)


def router_status(port: int) -> dict:
    return route_status(port, ROUTE)


def live(client) -> str | None:
    found = registry.resolve_alias(client, MODEL, registry.LIVE)
    return found.version if found else None


def recovered_events(prefect_client, version: str) -> list:
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    flt = EventFilter(
        event=EventNameFilter(name=["ray-lifecycle.rollout.recovered"]),
        resource=EventResourceFilter(id=[f"mlflow.model-version.{MODEL}.{version}"]),
    )
    return prefect_client.read_events(filter=flt, limit=20).events


def test_a_moved_champion_reaches_the_route_and_survives_killed_rollouts(stack, lifecycle):
    with explain_on_failure(lifecycle["prefect"], "reconcile/reconcile", stack.state_dir):
        moved_champion_survives_killed_rollouts(lifecycle)


def moved_champion_survives_killed_rollouts(lifecycle):
    client, port, prefect = lifecycle["client"], lifecycle["port"], lifecycle["prefect"]
    # A person sets `champion` in MLflow: nothing serves the route yet, so it is restored
    # (a first rollout through health and smoke) to that version.
    moved = time.time()
    client.set_registered_model_alias(MODEL, registry.CHAMPION, "1")
    first = started(prefect, moved)
    assert first.parameters["model_name"] == MODEL
    wait_for("v1 goes live", lambda: prefect.read_flow_run(first.id).state.is_completed())
    assert live(client) == "1" and router_status(port)["config"]["live"]["version"] == "1"

    with ClosedLoop(port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S) as traffic:
        # v2 becomes champion; its rollout is killed in the canary.
        moved = time.time()
        client.set_registered_model_alias(MODEL, registry.CHAMPION, "2")
        canary_run = started(prefect, moved)
        held = wait_for(
            "the canary sends v2 traffic",
            lambda: (status := router_status(port))["candidate_share"] > 0 and status,
            timeout=240,
            every=FAST_POLL_S,  # killed in the canary
        )
        assert held["serving"] == "as configured" and held["lease"]["held"], held["lease"]
        killed = kill_flow_run(prefect, canary_run.id)
        # The route takes the canary back by itself once the dead run's lease lapses: when
        # the share first reads 0, the router still has the canary's config (nobody has
        # reconfigured it: no reconcile has withdrawn v2 yet) and the lease has lapsed.
        lapsed = wait_for(
            "the candidate share drops to 0",
            lambda: (status := router_status(port))["candidate_share"] == 0 and status,
            timeout=LEASE_S + 60,
            every=FAST_POLL_S,  # before a reconcile withdraws v2
        )
        assert lapsed["config"]["generation"] == held["config"]["generation"], lapsed["config"]
        assert lapsed["config"]["candidate"]["version"] == "2", lapsed["config"]
        assert lapsed["lease"]["lapsed"] is True
        assert lapsed["serving"] == "live only: the rollout's lease is not held", lapsed
        # The Crashed run starts a reconcile (an automation): it withdraws v2, then rolls the
        # champion out again. Killed in its bake, it is baked again by the next one.
        bake_run = started(prefect, killed, skip=(canary_run.id, first.id))
        wait_for(
            "the recovery's rollout reaches its bake",
            lambda: (router_status(port)["config"]["rollout"] or {}).get("stage") == "bake",
            timeout=240,
            every=FAST_POLL_S,  # killed in the bake
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
    # Each killed reconcile and the serve-rollout subflow it was running are Crashed: the
    # worker marks only the process it started (the reconcile); the run that took the route
    # over marks the subflows.
    for run in (canary_run, bake_run):
        family = run_and_subflows(prefect, run.id)
        names = [prefect.read_flow(r.flow_id).name for r in family]
        assert names[0] == "reconcile" and "serve-rollout" in names[1:], names
        states = [r.state.name for r in family]
        assert states == ["Crashed"] * len(family), list(zip(names, states, strict=True))
    actions = {e.payload["action"] for e in recovered_events(prefect, "2")}
    assert actions == {"withdrawn", "promoted"}


def test_with_the_receiver_down_the_interval_reconcile_still_converges(stack, lifecycle):
    with explain_on_failure(lifecycle["prefect"], "reconcile/reconcile", stack.state_dir):
        interval_reconcile_converges(stack, lifecycle)


def interval_reconcile_converges(stack, lifecycle):
    from prefect.client.schemas.schedules import IntervalSchedule

    client, prefect = lifecycle["client"], lifecycle["prefect"]
    # The first test's kills leave reconciles queued: each kill crashes a reconcile run and its
    # serve-rollout subflow, and each Crashed run starts one. Left queued, one of them got the
    # slot ahead of the schedule's runs and rolled v3 out (seen with the machine busy), so they
    # end first: none may do the schedule's work.
    wait_for(
        "the reconciles the kills started end",
        lambda: all(r.state.is_final() for r in runs(prefect)),
        timeout=300,
    )
    receiver = stack.service("receiver")
    deployment = prefect.read_deployment_by_name("reconcile/reconcile")
    (schedule,) = prefect.read_deployment_schedules(deployment.id)
    # The route watch's heartbeats come from the receiver too: with it down, the watch runs a
    # reconcile for the route ~30 s later (a second safety net). Paused here: this test is
    # about the schedule.
    (watch,) = prefect.read_automations_by_name(ROUTE_WATCH)
    prefect.pause_automation(watch.id)
    local.stop(receiver)
    try:
        client.set_registered_model_alias(MODEL, registry.CHAMPION, "3")  # delivery fails
        turned_on = time.time()
        prefect.update_deployment_schedule(
            deployment.id,
            schedule.id,
            active=True,
            schedule=IntervalSchedule(interval=timedelta(seconds=5)),
        )

        in_sync: set = set()  # completed runs without v3's rollout: never read again

        def rolled_v3_out():
            if live(client) != "3":
                return None
            done = [
                r
                for r in runs(prefect, turned_on)
                if r.state.is_completed() and r.id not in in_sync
            ]
            found = [r for r in done if rolled_out(prefect, r, "3")]
            in_sync.update(r.id for r in done if r not in found)
            return found

        (run,) = wait_for("the interval reconcile rolls v3 out", rolled_v3_out, timeout=240)
        # The run that did it came from the schedule, not from an event.
        assert run.auto_scheduled, run
        assert "model_name" not in run.parameters, run.parameters
    finally:
        prefect.update_deployment_schedule(deployment.id, schedule.id, active=False)
        prefect.resume_automation(watch.id)
        local.start(receiver)


def rolled_out(prefect, run, version: str) -> bool:
    """Whether reconcile run `run` rolled `version` out: a completed serve-rollout subflow of
    it (a run that found the route in sync has none)."""
    return any(
        r.id != run.id
        and prefect.read_flow(r.flow_id).name == "serve-rollout"
        and str(r.parameters.get("version")) == version
        and r.state.is_completed()
        for r in run_and_subflows(prefect, run.id)
    )
