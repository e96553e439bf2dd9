"""A long run of the control loop: closed-loop load through a route while good and
drilled-bad candidates are rolled out in turn, one after the other, for `--minutes`.

    python -m benchmarks.soak [--minutes 30] [--threads 2]

Reports the answers that failed (`non_2xx`, goal 0), the rollouts done (promoted and
rejected), the resident memory of the router's replicas, the route's state actor and the
webhook receiver at the start and at the end (`router_rss_growth_mb`, goal <= 50 over 30
minutes; the routers' after each rollout too, to tell growth from a plateau), and the Serve
apps left over besides the route's router and its live version's app (`leftover_apps`,
goal 0). Its peer is the same route at rest: the memory at the start,
after the first rollout, is the baseline. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

from benchmarks._output import strict_json
from deployments.testing.load import ClosedLoop

ROUTE = "soak"


def rss_mb(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


def actor_pids(dashboard: str, class_part: str) -> dict[str, int]:
    """Alive actors whose class name contains `class_part`, by actor id: their pids."""
    from ray.util.state import list_actors

    alive = list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=10000)
    return {
        actor.actor_id: actor.pid
        for actor in alive
        if class_part in (actor.class_name or "") and actor.pid
    }


def memory(stack, router_class: str) -> dict[str, Any]:
    receiver = json.loads(stack.service("receiver").pid_file.read_text())["pid"]
    routers = actor_pids(stack.ray_dashboard_url, router_class)
    states = actor_pids(stack.ray_dashboard_url, "RouteState")
    return {
        "router_pids": sorted(routers.values()),
        "router_rss_mb": round(sum(rss_mb(p) for p in routers.values()), 1),
        "route_state_rss_mb": round(sum(rss_mb(p) for p in states.values()), 1),
        "receiver_rss_mb": round(rss_mb(receiver), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from deployments.testing.stack import pointed_at, temporary_stack

    with temporary_stack(ray_num_cpus=4, prefix="bench-soak-") as stack:
        with pointed_at(stack):
            result = run(stack, args.minutes, args.threads)
    print(strict_json(result))
    return 0


def run(stack, minutes: float, threads: int) -> dict[str, Any]:
    from mlflow import MlflowClient
    from ray.rllib.algorithms.ppo import PPOConfig

    from prefect_ray_lifecycle.blocks import MLflowServer
    from prefect_ray_lifecycle.control import registry, serve_control
    from prefect_ray_lifecycle.flows.rollout import RolloutFailed, serve_rollout
    from prefect_ray_lifecycle.tasks.rollout.config import Drill, Gates, Serving

    cluster = stack.ray_cluster()
    server = MLflowServer(tracking_uri=stack.mlflow_uri)
    client = MlflowClient(stack.mlflow_uri)
    name = f"soak-{uuid.uuid4().hex[:6]}"
    gates = Gates(
        health_timeout_s=180,
        stability_window_s=3,
        canary_steps=[0.2, 0.5],
        canary_hold_s=5,
        canary_min_requests=10,
        bake_s=8,
        bake_window_s=2,
        max_error_rate=0.02,
        max_p99_ms=5000,
        p99_slack_ms=1000,
    )
    serving = Serving(num_cpus=0.25, health_check_period_s=1, router_num_cpus=0.25)
    bad = Drill(faults={"error_rate": 0.5})
    port = stack.serve_port
    router_class = f"{serve_control.router_app_name(ROUTE)}:Router"
    outcomes: dict[str, int] = {"promoted": 0, "rejected": 0}

    with cluster.connect():
        algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).build_algo()
        checkpoint = algo.save(str(stack.state_dir / "checkpoint")).checkpoint.path
        algo.stop()
        serve_control.start(cluster.serve_host, port)
        versions = iter(range(1, 10_000))

        def rollout(drill: Drill | None) -> None:
            trial = next(versions)
            registration = registry.register_checkpoint(
                client,
                name=name,
                checkpoint=checkpoint,
                experiment_name="soak",
                trial_key_value=f"{name}-{trial}",
                observation_size=4,
            )
            try:
                serve_rollout(
                    model_name=name,
                    version=registration.version,
                    route=ROUTE,
                    gates=gates,
                    serving=serving,
                    drill=drill,
                    ray_cluster=cluster,
                    mlflow_server=server,
                )
                outcomes["promoted"] += 1
            except RolloutFailed:
                if drill is None:
                    raise
                outcomes["rejected"] += 1

        rollout(None)  # the route exists and hosts v1: the baseline, not counted
        outcomes.update(promoted=0, rejected=0)
        with ClosedLoop(port, f"/{ROUTE}", threads, pause_s=0.02) as load:
            time.sleep(5)
            start = memory(stack, router_class)
            started = time.monotonic()
            good = False
            samples = []  # the routers' RSS after each rollout: growth or a plateau
            while time.monotonic() - started < minutes * 60:
                rollout(None if good else bad)
                good = not good
                samples.append(memory(stack, router_class)["router_rss_mb"])
            end = memory(stack, router_class)
        apps = set(serve_control.app_configs())
        live = registry.resolve_alias(client, name, registry.LIVE)
        expected = {serve_control.router_app_name(ROUTE)}
        if live is not None:
            expected.add(serve_control.version_app_name(name, live.version))
        leftover = sorted(apps - expected)
        serve_control.delete_route(ROUTE, name)
    failed = load.failed()
    return {
        "minutes": round((time.monotonic() - started) / 60, 1),
        "requests": len(load.answers),
        "non_2xx": len(failed),
        "rollouts": outcomes["promoted"] + outcomes["rejected"],
        "promoted": outcomes["promoted"],
        "rejected": outcomes["rejected"],
        "router_rss_start_mb": start["router_rss_mb"],
        "router_rss_end_mb": end["router_rss_mb"],
        "router_rss_growth_mb": round(end["router_rss_mb"] - start["router_rss_mb"], 1),
        "router_replaced": start["router_pids"] != end["router_pids"],
        "router_rss_after_each_rollout_mb": samples,
        "route_state_rss_growth_mb": round(
            end["route_state_rss_mb"] - start["route_state_rss_mb"], 1
        ),
        "receiver_rss_growth_mb": round(end["receiver_rss_mb"] - start["receiver_rss_mb"], 1),
        "leftover_apps": len(leftover),
        "leftover_app_names": leftover,
    }


if __name__ == "__main__":
    raise SystemExit(main())
