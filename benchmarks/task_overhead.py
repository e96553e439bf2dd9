"""Per-task overhead: N trivial Prefect tasks through this project's Ray task runner, through
stock prefect-ray RayTaskRunner, and as plain @ray.remote calls, on one Ray in the same run.

`python -m benchmarks.task_overhead [--tasks 200]`; the last line is JSON:
{"tasks": 200, "ours_ms": ..., "stock_ms": ..., "plain_ray_ms": ...}
Uses PREFECT_API_URL when set, else starts a Prefect server of its own (a temporary one would
make stock prefect-ray start a server in every Ray worker, which is not what is measured here).
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks._prefect import prefect_api

WARMUP_TASKS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=200)
    args = parser.parse_args()
    with prefect_api():
        print(json.dumps(run(args.tasks)))


def run(tasks: int) -> dict:
    import ray
    from prefect import flow, task
    from prefect_ray import RayTaskRunner

    from blocks import RayCluster
    from ray_runner import RayClusterTaskRunner

    cluster = RayCluster(num_cpus=2)
    ray.init("local", **cluster.init_kwargs())
    try:

        @ray.remote
        def plain(i: int) -> int:
            return i

        @task
        def noop(i: int) -> int:
            return i

        @flow
        def fan_out(n: int) -> int:
            return len(noop.map(range(n)).result())

        ray.get([plain.remote(i) for i in range(WARMUP_TASKS)])
        started = time.perf_counter()
        ray.get([plain.remote(i) for i in range(tasks)])
        plain_ms = (time.perf_counter() - started) * 1000 / tasks

        results = {}
        for name, runner in (
            ("stock", RayTaskRunner()),
            ("ours", RayClusterTaskRunner(cluster)),
        ):
            measured = fan_out.with_options(task_runner=runner)
            measured(WARMUP_TASKS)  # worker processes import Prefect once
            started = time.perf_counter()
            assert measured(tasks) == tasks
            results[name] = (time.perf_counter() - started) * 1000 / tasks
    finally:
        ray.shutdown()
    return {
        "tasks": tasks,
        "ours_ms": round(results["ours"], 2),
        "stock_ms": round(results["stock"], 2),
        "plain_ray_ms": round(plain_ms, 3),
    }


if __name__ == "__main__":
    main()
