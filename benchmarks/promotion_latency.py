"""How fast a promotion made in MLflow reaches the route, by the webhook-triggered reconcile and
by its peer, the interval reconcile, run for real; and how fast the route is safe again when
the rollout's flow process dies. On the deployments a user runs (setup, `prefect deploy
--all`, a process worker) on one temporary stack.

    python -m benchmarks.promotion_latency [--moves 3] [--kills 3] [--intervals 30x3,300x1]
                                           [--lease-s 10]

1. `champion` is moved `--moves` times with MlflowClient (a first move restores an empty route
   and is not counted): the time to the reconcile run's creation and start (webhook -> Prefect
   event -> trigger -> worker) and to `live` moving.
2. `--kills` rollouts are killed (kill -9) in their canary under closed-loop load: the time
   until the router serves live only (`crash_to_safe_s`, median), the answers that failed
   (`crash_non_2xx`, the sum over the kills), and the time until a reconcile started by the
   Crashed run has converged (`crash_to_converged_s`, median).
3. The peer: the webhook trigger is paused and the reconcile deployment's own schedule is
   turned on at each interval of `--intervals` ("SECONDSxMOVES": 30 s three times, 300 s once
   by default). Each move happens at a random phase of the schedule (a random wait within one
   interval after the last run); measured to the start of the first reconcile run that
   started after it and to `live` moving: `interval_peer_wait_s` and `interval_peer_to_live_s`
   per interval (medians; a single move is its own figure).

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Any

MODEL = "cartpole-ppo"  # the model prefect.yaml's reconcile trigger watches
ROUTE = "policy"
RECONCILE = "reconcile/reconcile"
ALIAS_TRIGGER = "reconcile-on-champion-moved"  # prefect.yaml's trigger (an automation)
PHASE_SEED = 29  # the random phases of the interval moves, the same each run


def parse_intervals(spec: str) -> list[tuple[float, int]]:
    """'30x3,300x1' -> [(30.0, 3), (300.0, 1)]."""
    parsed = []
    for part in (p for p in spec.split(",") if p):
        seconds, _, moves = part.partition("x")
        try:
            parsed.append((float(seconds), int(moves or 1)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--intervals takes SECONDSxMOVES,... (e.g. 30x3,300x1), got {part!r}"
            ) from None
    return parsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moves", type=int, default=3, help="timed alias moves (at least 3)")
    parser.add_argument("--kills", type=int, default=3, help="rollouts killed (at least 3)")
    parser.add_argument(
        "--intervals",
        type=parse_intervals,
        default=parse_intervals("30x3,300x1"),
        help="interval reconcile runs, SECONDSxMOVES,... ('' skips the peer)",
    )
    parser.add_argument("--lease-s", type=float, default=10.0, help="the rollout's route lease")
    args = parser.parse_args(argv)

    from deployments.testing.stack import pointed_at, temporary_stack

    with temporary_stack(ray_num_cpus=4, prefix="bench-promo-") as stack:
        with pointed_at(stack):
            result = run(
                stack, max(3, args.moves), max(3, args.kills), args.intervals, args.lease_s
            )
    print(json.dumps(result))
    return 0


def run(
    stack: Any, moves: int, kills: int, intervals: list[tuple[float, int]], lease_s: float
) -> dict[str, Any]:
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from ray.rllib.algorithms.ppo import PPOConfig

    from deployments.testing.stack import deployed
    from deployments.testing.watch import FAST_POLL_S, started_run, wait_for
    from prefect_ray_lifecycle.control import registry

    client = MlflowClient(stack.mlflow_uri)
    with stack.ray_cluster().connect():
        algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).build_algo()
        checkpoint = algo.save(str(stack.state_dir / "checkpoint")).checkpoint.path
        algo.stop()
    versions = iter(str(v) for v in range(1, 2 + moves + kills + sum(n for _, n in intervals)))
    for version in range(1, 2 + moves + kills + sum(n for _, n in intervals)):
        registry.register_checkpoint(
            client,
            name=MODEL,
            checkpoint=checkpoint,
            experiment_name="bench",
            trial_key_value=f"bench-{version}",
            observation_size=4,
        )
    gates = {
        "health_timeout_s": 180,
        "stability_window_s": 3,
        "canary_steps": [0.5],
        "canary_hold_s": 8,
        "bake_s": 5,
        "bake_window_s": 2,
        "max_p99_ms": 5000,
        "p99_slack_ms": 1000,
        "lease_s": lease_s,
    }
    serving = {"num_cpus": 0.1, "router_num_cpus": 0.1, "health_check_period_s": 1}
    fast = {"gates": gates, "serving": serving}

    def live() -> str | None:
        found = registry.resolve_alias(client, MODEL, registry.LIVE)
        return found.version if found else None

    to_created, to_start, to_live = [], [], []
    with (
        deployed(stack, parameters={RECONCILE: fast, "serve-rollout/serve-rollout": fast}),
        get_client(sync_client=True) as prefect,
    ):
        for index in range(moves + 1):
            version = next(versions)
            moved = time.time()
            client.set_registered_model_alias(MODEL, registry.CHAMPION, version)
            reconcile = started_run(prefect, RECONCILE, moved, timeout=300)
            wait_for(
                f"v{version} goes live",
                lambda v=version: live() == v,
                timeout=300,
                every=FAST_POLL_S,
            )
            went_live = time.time()
            wait_for(
                "the reconcile run ends",
                lambda r=reconcile: prefect.read_flow_run(r.id).state.is_final(),
                timeout=300,
                every=FAST_POLL_S,
            )
            if index:  # the first move restores an empty route: not a promotion
                to_created.append(reconcile.created.timestamp() - moved)  # the trigger fired
                to_start.append(reconcile.start_time.timestamp() - moved)
                to_live.append(went_live - moved)

        crashes = [
            crash_in_canary(stack, prefect, client, next(versions), live, lease_s)
            for _ in range(kills)
        ]
        settled_runs(prefect)  # the last kill's runs, before the peer or the teardown
        peer = interval_peer(prefect, client, versions, live, intervals)
    return {
        "alias_to_run_start_s": round(statistics.median(to_start), 2),
        "alias_to_live_s": round(statistics.median(to_live), 2),
        **peer,
        "crash_to_safe_s": round(statistics.median(c["to_safe_s"] for c in crashes), 2),
        "crash_non_2xx": sum(c["non_2xx"] for c in crashes),
        "crash_to_converged_s": round(statistics.median(c["to_converged_s"] for c in crashes), 2),
        "kills": len(crashes),
        "lease_s": lease_s,
        "moves": len(to_start),
        "alias_to_run_start_all_s": [round(t, 2) for t in to_start],
        "alias_to_run_created_s": round(statistics.median(to_created), 2),
        "crash_to_safe_all_s": [round(c["to_safe_s"], 2) for c in crashes],
        "crash_non_2xx_all": [c["non_2xx"] for c in crashes],
        "crash_requests": sum(c["requests"] for c in crashes),
        "statistic": "median",
    }


def crash_in_canary(
    stack: Any, prefect: Any, client: Any, version: str, live: Any, lease_s: float
) -> dict[str, Any]:
    """Move `champion` to `version`, kill -9 its rollout once the canary sends the candidate
    traffic, under closed-loop load; the route's way back to safe and to converged."""
    from deployments.testing.load import ClosedLoop
    from deployments.testing.watch import (
        FAST_POLL_S,
        kill_flow_run,
        route_status,
        started_run,
        wait_for,
    )
    from prefect_ray_lifecycle.control import registry

    port = stack.serve_port
    settled_runs(prefect)  # no earlier run left to take this move's rollout
    with ClosedLoop(port, f"/{ROUTE}", threads=2, pause_s=0.01) as traffic:
        moved = time.time()
        client.set_registered_model_alias(MODEL, registry.CHAMPION, version)
        doomed = started_run(prefect, RECONCILE, moved, timeout=300)
        wait_for(
            "the canary sends the candidate traffic",
            lambda: route_status(port, ROUTE)["candidate_share"] > 0,
            timeout=300,
            every=FAST_POLL_S,
        )
        killed = kill_flow_run(prefect, doomed.id)
        safe = wait_for(
            "the route serves live only",
            lambda: route_status(port, ROUTE)["candidate_share"] == 0 and time.time(),
            timeout=lease_s + 30,
            every=FAST_POLL_S,
        )

        def converged() -> float | None:
            status = route_status(port, ROUTE)["config"]
            settled = status["rollout"] is None and status["live"]["version"] == version
            return time.time() if settled and live() == version else None

        done = wait_for("the route converges", converged, timeout=600, every=FAST_POLL_S)
    return {
        "to_safe_s": safe - killed,
        "non_2xx": len(traffic.failed()),
        "to_converged_s": done - killed,
        "requests": len(traffic.answers),
    }


def interval_peer(
    prefect: Any, client: Any, versions: Any, live: Any, intervals: list[tuple[float, int]]
) -> dict[str, Any]:
    """The interval reconcile, run for real at each interval with the webhook trigger paused:
    per interval, the median wait from a move to the start of the first reconcile run after
    it, and to `live` moving."""
    from prefect.client.schemas.schedules import IntervalSchedule

    from deployments.testing.watch import FAST_POLL_S, wait_for
    from prefect_ray_lifecycle.control import registry

    if not intervals:
        return {}
    phases = random.Random(PHASE_SEED)
    deployment = prefect.read_deployment_by_name(RECONCILE)
    (schedule,) = prefect.read_deployment_schedules(deployment.id)
    (trigger,) = prefect.read_automations_by_name(ALIAS_TRIGGER)
    prefect.pause_automation(trigger.id)
    waits: dict[str, list[float]] = {}
    to_live: dict[str, list[float]] = {}
    try:
        for interval, count in intervals:
            key = f"{interval:g}"
            prefect.update_deployment_schedule(
                deployment.id,
                schedule.id,
                active=True,
                schedule=IntervalSchedule(interval=timedelta(seconds=interval)),
            )
            try:
                for _ in range(count):
                    settled_runs(prefect)
                    time.sleep(phases.uniform(0, interval))  # a random phase of the schedule
                    version = next(versions)
                    moved = time.time()
                    client.set_registered_model_alias(MODEL, registry.CHAMPION, version)
                    run = wait_for(
                        f"an interval reconcile starts after v{version}'s move",
                        lambda m=moved: first_started_after(prefect, m),
                        timeout=interval + 300,
                        every=FAST_POLL_S,
                    )
                    wait_for(
                        f"v{version} goes live",
                        lambda v=version: live() == v,
                        timeout=600,
                        every=FAST_POLL_S,
                    )
                    to_live.setdefault(key, []).append(time.time() - moved)
                    waits.setdefault(key, []).append(run.start_time.timestamp() - moved)
            finally:
                prefect.update_deployment_schedule(deployment.id, schedule.id, active=False)
                drop_scheduled_runs(prefect, deployment.id)
    finally:
        prefect.resume_automation(trigger.id)
    return {
        "interval_peer_wait_s": {k: round(statistics.median(v), 2) for k, v in waits.items()},
        "interval_peer_to_live_s": {k: round(statistics.median(v), 2) for k, v in to_live.items()},
        "interval_peer_moves": {k: len(v) for k, v in waits.items()},
        "interval_peer_wait_all_s": {k: [round(t, 2) for t in v] for k, v in waits.items()},
    }


def first_started_after(prefect: Any, moved: float) -> Any:
    """The reconcile run that started first at or after `moved` (started: not one scheduled
    to start then), or None yet."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        FlowRunFilter,
        FlowRunFilterStartTime,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    deployment = prefect.read_deployment_by_name(RECONCILE)
    after = datetime.fromtimestamp(moved, UTC)
    runs = prefect.read_flow_runs(
        deployment_filter=DeploymentFilter(id={"any_": [deployment.id]}),
        # Prefect filters start times as coalesce(start_time, expected_start_time): without
        # is_null_=False a run the interval schedule has due later matches before it starts.
        flow_run_filter=FlowRunFilter(
            start_time=FlowRunFilterStartTime(after_=after, is_null_=False)
        ),
        sort=FlowRunSort.START_TIME_ASC,
        limit=1,
    )
    return runs[0] if runs else None


def drop_scheduled_runs(prefect: Any, deployment_id: Any) -> None:
    """Delete the runs an interval schedule left scheduled ahead: the next interval's own."""
    from prefect.client.schemas.filters import DeploymentFilter, FlowRunFilter

    scheduled = FlowRunFilter(state={"type": {"any_": ["SCHEDULED"]}})
    while runs := prefect.read_flow_runs(
        deployment_filter=DeploymentFilter(id={"any_": [deployment_id]}),
        flow_run_filter=scheduled,
        limit=200,
    ):
        for flow_run in runs:
            prefect.delete_flow_run(flow_run.id)


def settled_runs(prefect: Any, timeout: float = 600) -> None:
    """Wait until no reconcile run is running, waiting for its slot, or due to start. A run
    created before the next move and started after it (a killed rollout's run asked again,
    put back to Scheduled while the slot was held) would roll the next champion out unseen:
    the move's own run then finds it in sync, and the canary it waits for is over."""
    from deployments.testing.watch import deployment_runs, wait_for

    def pending(run: Any, now: datetime) -> bool:
        state = run.state
        if state.is_final():
            return False
        if state.name == "AwaitingConcurrencySlot" or not state.is_scheduled():
            return True
        return run.expected_start_time is None or run.expected_start_time <= now

    def settled() -> bool:
        now = datetime.now(UTC)
        return not any(pending(r, now) for r in deployment_runs(prefect, RECONCILE))

    wait_for("the reconcile runs settle", settled, timeout, every=1.0)


if __name__ == "__main__":
    raise SystemExit(main())
