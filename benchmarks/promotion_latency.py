"""How fast a promotion made in MLflow reaches the route, and how fast the route is safe
again when the rollout's flow process dies, on the deployments a user runs (setup, `prefect
deploy --all`, a process worker) on one temporary stack.

    python -m benchmarks.promotion_latency [--moves 3] [--lease-s 10]

`champion` is moved `--moves` times with MlflowClient (the first move restores an empty
route and is not counted): the time to the reconcile run's start (webhook -> Prefect event ->
trigger -> worker) and to `live` moving. The peer is the interval reconcile at the interval
prefect.yaml configures: its expected wait for a promotion is half the interval. Then one
rollout is killed (kill -9) in its canary under closed-loop load: the time until the router
serves live only, the answers that failed, and the time until a reconcile started by the
Crashed run has converged. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import yaml

from prefect_ray_lifecycle.workloads.constants import PROJECT_ROOT

MODEL = "cartpole-ppo"  # the model prefect.yaml's reconcile trigger watches
ROUTE = "policy"
RECONCILE = "reconcile/reconcile"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moves", type=int, default=3, help="timed alias moves (at least 3)")
    parser.add_argument("--lease-s", type=float, default=10.0, help="the rollout's route lease")
    args = parser.parse_args(argv)

    from deployments.stack import pointed_at, temporary_stack

    with temporary_stack(ray_num_cpus=4, prefix="bench-promo-") as stack:
        with pointed_at(stack):
            result = run(stack, max(3, args.moves), args.lease_s)
    print(json.dumps(result))
    return 0


def configured_interval_s() -> float:
    """The interval of the reconcile deployment's schedule in prefect.yaml."""
    spec = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    (reconcile,) = [d for d in spec["deployments"] if d["name"] == "reconcile"]
    return float(reconcile["schedules"][0]["interval"])


def run(stack: Any, moves: int, lease_s: float) -> dict[str, Any]:
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from ray.rllib.algorithms.ppo import PPOConfig

    from deployments.load import ClosedLoop
    from deployments.stack import deployed
    from deployments.watch import kill_flow_run, route_status, started_run, wait_for
    from prefect_ray_lifecycle.control import registry

    client = MlflowClient(stack.mlflow_uri)
    with stack.ray_cluster().connect():
        algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).build_algo()
        checkpoint = algo.save(str(stack.state_dir / "checkpoint")).checkpoint.path
        algo.stop()
    for version in range(moves + 2):
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
    port = stack.serve_port

    def live() -> str | None:
        found = registry.resolve_alias(client, MODEL, registry.LIVE)
        return found.version if found else None

    to_created, to_start, to_live = [], [], []
    with (
        deployed(stack, parameters={RECONCILE: fast, "serve-rollout/serve-rollout": fast}),
        get_client(sync_client=True) as prefect,
    ):
        for version in [str(v) for v in range(1, moves + 2)]:
            moved = time.time()
            client.set_registered_model_alias(MODEL, registry.CHAMPION, version)
            reconcile = started_run(prefect, RECONCILE, moved, timeout=300)
            wait_for(f"v{version} goes live", lambda v=version: live() == v, timeout=300)
            went_live = time.time()
            wait_for(
                "the reconcile run ends",
                lambda r=reconcile: prefect.read_flow_run(r.id).state.is_final(),
                timeout=300,
            )
            if version != "1":  # the first move restores an empty route: not a promotion
                to_created.append(reconcile.created.timestamp() - moved)  # the trigger fired
                to_start.append(reconcile.start_time.timestamp() - moved)
                to_live.append(went_live - moved)

        version = str(moves + 2)
        with ClosedLoop(port, f"/{ROUTE}", threads=2, pause_s=0.01) as traffic:
            moved = time.time()
            client.set_registered_model_alias(MODEL, registry.CHAMPION, version)
            doomed = started_run(prefect, RECONCILE, moved, timeout=300)
            wait_for(
                "the canary sends the candidate traffic",
                lambda: route_status(port, ROUTE)["candidate_share"] > 0,
                timeout=300,
            )
            killed = kill_flow_run(prefect, doomed.id)
            safe = wait_for(
                "the route serves live only",
                lambda: route_status(port, ROUTE)["candidate_share"] == 0 and time.time(),
                timeout=lease_s + 30,
            )

            def converged() -> float | None:
                status = route_status(port, ROUTE)["config"]
                settled = status["rollout"] is None and status["live"]["version"] == version
                return time.time() if settled and live() == version else None

            done = wait_for("the route converges", converged, timeout=600)
    return {
        "alias_to_run_start_s": round(statistics.median(to_start), 2),
        "alias_to_live_s": round(statistics.median(to_live), 2),
        "poll_peer_expected_wait_s": round(configured_interval_s() / 2, 1),
        "crash_to_safe_s": round(safe - killed, 2),
        "crash_non_2xx": len(traffic.failed()),
        "crash_to_converged_s": round(done - killed, 2),
        "lease_s": lease_s,
        "moves": len(to_start),
        "alias_to_run_start_all_s": [round(t, 2) for t in to_start],
        "alias_to_run_created_s": round(statistics.median(to_created), 2),
        "crash_requests": len(traffic.answers),
    }


if __name__ == "__main__":
    raise SystemExit(main())
