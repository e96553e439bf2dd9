"""Closed-loop load through the router during four rollouts, and steady-state throughput
through the router versus straight to the version's own app, in one run on one cluster.

    python -m benchmarks.serve_swap [--threads 4] [--steady-s 10]

(a) a good rollout, (b) a candidate whose health check fails after it looked healthy,
(c) a candidate erroring on half its requests (aborted at the canary), (d) a degradation
injected after the swap (rolled back). Each reports the answers users got (`non_2xx`) and how
many of them the router answered from the previous version after the candidate failed them
(`fallbacks`). Then the router (hosting the live version in process) and a direct route to
the same version's app are loaded in turn, alternating over `--rounds`; medians reported.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

from deployments.load import ClosedLoop
from prefect_ray_lifecycle.workloads.figures import percentile

ROUTE = "bench"
DIRECT = "bench-direct"


def steady(port: int, path: str, threads: int, seconds: float) -> tuple[float, float]:
    with ClosedLoop(port, path, threads) as load:
        time.sleep(1)  # warm
        mark = time.time()
        time.sleep(seconds)
    window = [a for a in load.answers if a.at >= mark and a.status == 200]
    return len(window) / seconds, percentile([a.latency_ms for a in window], 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3, help="steady-state rounds (>= 3)")
    args = parser.parse_args(argv)

    from deployments.stack import pointed_at, temporary_stack

    with temporary_stack(ray_num_cpus=4, prefix="bench-serve-") as stack:
        with pointed_at(stack):
            result = run(stack, args.threads, args.steady_s, max(3, args.rounds))
    print(json.dumps(result))
    return 0


def run(stack, threads: int, steady_s: float, rounds: int) -> dict[str, Any]:
    from mlflow import MlflowClient
    from ray.rllib.algorithms.ppo import PPOConfig

    from prefect_ray_lifecycle.blocks import MLflowServer
    from prefect_ray_lifecycle.control import registry, serve_control
    from prefect_ray_lifecycle.flows.rollout import RolloutFailed, serve_rollout
    from prefect_ray_lifecycle.tasks.rollout.config import Drill, Gates, Serving
    from prefect_ray_lifecycle.workloads.constants import POLICY_DEPLOYMENT

    cluster = stack.ray_cluster()
    server = MLflowServer(tracking_uri=stack.mlflow_uri)
    client = MlflowClient(stack.mlflow_uri)
    name = f"bench-{uuid.uuid4().hex[:6]}"
    gates = Gates(
        health_timeout_s=180,
        stability_window_s=4,
        canary_steps=[0.1, 0.5],
        canary_hold_s=4,
        canary_min_requests=10,
        bake_s=8,
        bake_window_s=2,
        max_error_rate=0.02,
        max_p99_ms=5000,
        p99_slack_ms=1000,
    )
    serving = Serving(num_cpus=0.25, health_check_period_s=1, router_num_cpus=0.25)
    port = stack.serve_port
    figures: dict[str, Any] = {}

    with cluster.connect():
        algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).build_algo()
        checkpoint = algo.save(str(stack.state_dir / "checkpoint")).checkpoint.path
        algo.stop()
        for trial in range(5):
            registry.register_checkpoint(
                client,
                name=name,
                checkpoint=checkpoint,
                experiment_name="bench",
                trial_key_value=f"{name}-{trial}",
                observation_size=4,
            )
        serve_control.start(cluster.serve_host, port)

        def rollout(version: int, drill: Drill | None = None, expect_failure: bool = False):
            try:
                return serve_rollout(
                    model_name=name,
                    version=str(version),
                    route=ROUTE,
                    gates=gates,
                    serving=serving,
                    drill=drill,
                    ray_cluster=cluster,
                    mlflow_server=server,
                )
            except RolloutFailed:
                if not expect_failure:
                    raise
                return None

        rollout(1)
        with ClosedLoop(port, f"/{ROUTE}", threads) as load:
            rollout(2)
        figures["good"] = load.summary()

        with ClosedLoop(port, f"/{ROUTE}", threads) as load:
            rollout(3, Drill(faults={"fail_health_after_s": 2}), expect_failure=True)
        figures["failed_health"] = load.summary()

        with ClosedLoop(port, f"/{ROUTE}", threads) as load:
            rollout(4, Drill(faults={"error_rate": 0.5}), expect_failure=True)
        # The canary's window: from the candidate's first attempt to its last.
        tried = [a for a in load.answers if "4" in (a.version, a.fallback_from)]
        during = [a for a in load.answers if tried and tried[0].at <= a.at <= tried[-1].at]
        figures["canary_abort"] = {
            **load.summary(),
            "candidate_failures_answered_by_live": sum(
                1 for a in load.answers if a.fallback_from == "4" and a.status == 200
            ),
            "canary_share": round(len(tried) / max(len(during), 1), 3),
            "canary_s": round(tried[-1].at - tried[0].at, 2) if tried else 0.0,
        }

        with ClosedLoop(port, f"/{ROUTE}", threads) as load:
            rollout(5, Drill(after_swap={"error_rate": 1.0}), expect_failure=True)
            time.sleep(1)
        failing = [a.at for a in load.answers if a.fallback_from == "5" or a.status != 200]
        figures["rollback"] = {
            **load.summary(),
            "seconds_to_rollback": round(max(failing) - min(failing), 2) if failing else None,
        }

        # Steady state: the router hosts v2 in process; a second app of v2 gets its own route.
        live = registry.resolve_alias(client, name, registry.LIVE).version
        runtime_env = serve_control.app_configs()[serve_control.version_app_name(name, live)][
            "runtime_env"
        ]
        app = serve_control.version_app_config(
            DIRECT,
            {"name": name, "version": live, "tracking_uri": stack.mlflow_uri},
            serving.version_options(),
            {},
            runtime_env,
        )
        serve_control.apply({DIRECT: {**app, "route_prefix": f"/{DIRECT}"}})
        if not serve_control.wait_stable(
            DIRECT, POLICY_DEPLOYMENT, timeout_s=180, window_s=1
        ).healthy:
            raise RuntimeError("the direct app did not start")
        serve_control.wait_router(
            ROUTE,
            serve_control.router_status(ROUTE, 1)[0]["config"]["generation"],
            inline_version=live,
            timeout_s=120,
        )
        router_runs, direct_runs = [], []
        for round_ in range(rounds):  # alternate which goes first
            sides = [(router_runs, ROUTE), (direct_runs, DIRECT)]
            for runs, path in sides if round_ % 2 == 0 else reversed(sides):
                runs.append(steady(port, f"/{path}", threads, steady_s))
        serve_control.apply(
            deletes={
                a
                for a in serve_control.app_configs()
                if a.startswith(name) or a in (DIRECT, serve_control.router_app_name(ROUTE))
            }
        )

    router_rps = statistics.median(r[0] for r in router_runs)
    direct_rps = statistics.median(r[0] for r in direct_runs)
    return {
        **figures,
        "router_vs_direct_throughput": round(router_rps / direct_rps, 3),
        "router_rps": round(router_rps, 1),
        "direct_rps": round(direct_rps, 1),
        "router_p50_ms": round(statistics.median(r[1] for r in router_runs), 2),
        "direct_p50_ms": round(statistics.median(r[1] for r in direct_runs), 2),
        "rounds": rounds,
    }


if __name__ == "__main__":
    raise SystemExit(main())
