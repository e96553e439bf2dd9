"""Closed-loop load through the router during four rollouts, and steady-state throughput
through the router versus straight to the version's own app, in one run on one cluster.

    python -m benchmarks.serve_swap [--threads 4] [--steady-s 10]

(a) a good rollout, (b) a candidate whose health check fails after it looked healthy,
(c) a candidate erroring on half its requests (aborted at the canary), (d) a degradation
injected after the swap (rolled back). Then the router (hosting the live version in process)
and a direct route to the same version's app are loaded in turn, twice each.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

ROUTE = "bench"
DIRECT = "bench-direct"
OBSERVATION = json.dumps({"observation": [0.01, -0.02, 0.03, 0.04]}).encode()


class ClosedLoop:
    """`threads` clients, each sending its next request when the last one is answered."""

    def __init__(self, port: int, path: str, threads: int):
        self.port, self.path, self.threads = port, path, threads
        self.results: list[tuple[float, int, str | None, float]] = []
        self._stop = threading.Event()
        self._workers = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        results = []
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                connection.request(
                    "POST", self.path, OBSERVATION, {"content-type": "application/json"}
                )
                response = connection.getresponse()
                response.read()
                status, version = response.status, response.getheader("X-Model-Version")
            except (OSError, http.client.HTTPException):
                status, version = 0, None
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            results.append((time.time(), status, version, (time.perf_counter() - started) * 1000))
        self.results.extend(results)

    def __enter__(self) -> ClosedLoop:
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=120)

    def summary(self) -> dict[str, Any]:
        latencies = sorted(r[3] for r in self.results)
        return {
            "requests": len(self.results),
            "non_2xx": sum(1 for r in self.results if not 200 <= r[1] < 300),
            "p99_ms": round(float(np.percentile(latencies, 99)), 1) if latencies else None,
        }


def steady(port: int, path: str, threads: int, seconds: float) -> tuple[float, float]:
    with ClosedLoop(port, path, threads) as load:
        time.sleep(1)  # warm
        mark = time.time()
        time.sleep(seconds)
    window = [r for r in load.results if r[0] >= mark and r[1] == 200]
    p50 = float(np.percentile([r[3] for r in window], 50))
    return len(window) / seconds, p50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--steady-s", type=float, default=10.0)
    args = parser.parse_args(argv)

    from deployments.stack import temporary_stack

    with temporary_stack(ray_num_cpus=4, prefix="bench-serve-") as stack:
        os.environ.update(
            PREFECT_API_URL=stack.prefect_api_url,
            MLFLOW_TRACKING_URI=stack.mlflow_uri,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(stack.state_dir / "ray_auth_token"),
        )
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: stack.prefect_api_url}):
            result = run(stack, args.threads, args.steady_s)
    print(json.dumps(result))
    return 0


def run(stack, threads: int, steady_s: float) -> dict[str, Any]:
    from mlflow import MlflowClient
    from ray.rllib.algorithms.ppo import PPOConfig

    from blocks import MLflowServer
    from flows.rollout import RolloutFailed, serve_rollout
    from tasks.serve_config import Drill, Gates, Serving
    from workloads import registry, serve_control
    from workloads.constants import POLICY_DEPLOYMENT

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
                params={},
                metrics={},
                tags={},
                description="",
                artifacts={},
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
            started = time.time()
            rollout(4, Drill(faults={"error_rate": 0.5}), expect_failure=True)
            ended = time.time()
        # The canary's window: from the candidate's first answer to its last.
        at = sorted(r[0] for r in load.results if r[2] == "4")
        during = [r for r in load.results if at and at[0] <= r[0] <= at[-1]]
        figures["canary_abort"] = {
            **load.summary(),
            "errors_from_candidate": sum(1 for r in load.results if r[1] != 200 and r[2] == "4"),
            "errors_outside_canary": sum(
                1
                for r in load.results
                if r[1] != 200 and not (started <= r[0] <= ended and r[2] == "4")
            ),
            "canary_share": round(len(at) / max(len(during), 1), 3),
            "canary_s": round(at[-1] - at[0], 2) if at else 0.0,
        }

        with ClosedLoop(port, f"/{ROUTE}", threads) as load:
            rollout(5, Drill(after_swap={"error_rate": 1.0}), expect_failure=True)
            time.sleep(1)
        failed = [r[0] for r in load.results if r[1] != 200]
        figures["rollback"] = {
            **load.summary(),
            "seconds_to_rollback": round(max(failed) - min(failed), 2) if failed else None,
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
        for _ in range(2):
            router_runs.append(steady(port, f"/{ROUTE}", threads, steady_s))
            direct_runs.append(steady(port, f"/{DIRECT}", threads, steady_s))
        serve_control.apply(
            deletes={
                a
                for a in serve_control.app_configs()
                if a.startswith(name) or a in (DIRECT, serve_control.router_app_name(ROUTE))
            }
        )

    router_rps = sum(r[0] for r in router_runs) / 2
    direct_rps = sum(r[0] for r in direct_runs) / 2
    return {
        **figures,
        "router_vs_direct_throughput": round(router_rps / direct_rps, 3),
        "router_rps": round(router_rps, 1),
        "direct_rps": round(direct_rps, 1),
        "router_p50_ms": round(sum(r[1] for r in router_runs) / 2, 2),
        "direct_p50_ms": round(sum(r[1] for r in direct_runs) / 2, 2),
    }


if __name__ == "__main__":
    raise SystemExit(main())
