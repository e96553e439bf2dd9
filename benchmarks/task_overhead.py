"""Per-task overhead of a recorded Prefect task: this project's Ray task runner against stock
prefect-ray RayTaskRunner on the same Ray head, Prefect's in-process ThreadPoolTaskRunner (the
floor for a task run recorded in Prefect) and plain @ray.remote calls (the floor on Ray).

`python -m benchmarks.task_overhead [--tasks 200] [--rounds 3]`. One `ray start --head` (2
CPUs) and one Prefect server (or PREFECT_API_URL) serve every side. Each side connects the way
a flow does: the Ray runners start their own driver and Ray job per flow run (ours with its
job config and worker setup hook), the plain side its own driver. Within each flow run a
warm-up fills the job's workers first (and runs a few task runs that fail once and pass on
their retry); only the next `--tasks` tasks are timed. The order of the sides rotates each
round; medians over the rounds are reported. After each flow run the API must hold every task
run completed; then its task runs, their states and their log lines are counted, and the run
fails loudly unless ours recorded exactly as many of each as the thread pool did in the same
round (no saving may come from a record dropped). Last line, one
JSON object: {"tasks", "rounds", "ours_ms", "stock_ms", "threadpool_ms", "plain_ray_ms",
"ours_vs_stock", "ours_vs_threadpool", "ours_recorded_ms", "threadpool_recorded_ms",
"ours_vs_threadpool_recorded" (the same timed part, until the server had written the last of
the flow run's task runs: a side whose server work falls after its flow's results pays for it
too), "recorded" (per side, per flow run: task runs, states, log lines under task runs),
"task_runs_with_logs" (the least share of a side's task runs whose log lines reached the API
within LOGS_WAIT_S), "rounds_ms", "recorded_rounds_ms"}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks._prefect import prefect_api
from deployments import local, ports

RAY_CPUS = 2
WARMUP_TASKS = 8  # enough that each of the job's workers has imported Prefect
RETRIED_TASKS = 4  # in the warm-up too: each fails once, then passes on its retry
UNTIMED_TASKS = WARMUP_TASKS + RETRIED_TASKS
SIDES = ("stock", "ours", "threadpool", "plain_ray")
RECORDED_TIMEOUT_S = 60.0  # for every task run of a flow run to be recorded completed
LOGS_WAIT_S = 10.0  # for each of them to have its log lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=200, help="timed tasks per side and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the side order rotates")
    args = parser.parse_args()
    with prefect_api(), ray_head() as (address, token):
        print(json.dumps(run(address, token, args.tasks, args.rounds)))


@contextlib.contextmanager
def ray_head() -> Iterator[tuple[str, str]]:
    """A `ray start --head` of RAY_CPUS CPUs on free ports and its own temp dir: (address,
    token). Stopped afterwards."""
    state_dir = Path(tempfile.mkdtemp(prefix="bto-", dir="/tmp"))  # short: Ray's sockets
    spacing = local.RAY_DASHBOARD_PORT - local.DEFAULT_PORTS["ray"]
    (port,) = ports.free_ports(1, spacing=spacing)
    (service,) = local.services(state_dir, {"ray": port}, ("ray",), ray_num_cpus=RAY_CPUS)
    local.start(service)
    try:
        yield service.url, service.ray_token()
    finally:
        local.stop(service)
        shutil.rmtree(state_dir, ignore_errors=True)


class RecordsDiffer(RuntimeError):
    """Our runner recorded fewer (or more) task runs, states or log lines than the thread pool."""


def run(address: str, token: str, tasks: int, rounds: int) -> dict:
    from prefect_ray_lifecycle.blocks import RayCluster

    cluster = RayCluster(address=address, auth_token=token)
    cluster.export_auth_token()  # for stock prefect-ray's and the plain side's drivers
    records: dict[str, list[dict]] = {side: [] for side in SIDES if side != "plain_ray"}
    measure = sides(cluster, records)
    per_round: dict[str, list[float]] = {side: [] for side in SIDES}
    until_recorded: dict[str, list[float]] = {side: [] for side in records}
    for index in range(rounds):
        order = SIDES[index % len(SIDES) :] + SIDES[: index % len(SIDES)]
        for side in order:
            per_round[side].append(measure[side](tasks) * 1000 / tasks)
            if side in records:
                until_recorded[side].append(records[side][-1]["recorded_s"] * 1000 / tasks)
        ours, pool = records["ours"][-1], records["threadpool"][-1]
        counted = ("task_runs", "states", "log_lines")
        if any(ours[k] != pool[k] for k in counted) or ours["task_runs"] != tasks + UNTIMED_TASKS:
            raise RecordsDiffer(
                f"round {index}: ours recorded {ours}, the thread pool {pool} "
                f"({tasks + UNTIMED_TASKS} task runs each)"
            )
    median = {side: statistics.median(values) for side, values in per_round.items()}
    median_recorded = {side: statistics.median(v) for side, v in until_recorded.items()}
    return {
        "tasks": tasks,
        "rounds": rounds,
        "ours_ms": round(median["ours"], 2),
        "stock_ms": round(median["stock"], 2),
        "threadpool_ms": round(median["threadpool"], 2),
        "plain_ray_ms": round(median["plain_ray"], 3),
        "ours_vs_stock": round(median["ours"] / median["stock"], 3),
        "ours_vs_threadpool": round(median["ours"] / median["threadpool"], 3),
        "ours_recorded_ms": round(median_recorded["ours"], 2),
        "threadpool_recorded_ms": round(median_recorded["threadpool"], 2),
        "ours_vs_threadpool_recorded": round(
            median_recorded["ours"] / median_recorded["threadpool"], 3
        ),
        "recorded": {
            side: {k: runs[-1][k] for k in ("task_runs", "states", "log_lines")}
            for side, runs in records.items()
        },
        "task_runs_with_logs": {
            side: round(min(run["task_runs_with_logs"] for run in runs), 3)
            for side, runs in records.items()
        },
        "rounds_ms": {side: [round(v, 2) for v in values] for side, values in per_round.items()},
        "recorded_rounds_ms": {
            side: [round(v, 2) for v in values] for side, values in until_recorded.items()
        },
    }


def sides(cluster, records: dict[str, list[dict]]) -> dict[str, Callable[[int], float]]:
    """Each side as a function of the task count returning the timed seconds; the Prefect
    sides add to `records` what the API recorded of each of their flow runs (`recorded`)."""
    import ray
    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_ray import RayTaskRunner

    from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner

    @task
    def noop(i: int) -> int:
        return i

    @task(retries=1, retry_delay_seconds=0)
    def fails_once(i: int) -> int:
        from prefect.runtime import task_run

        if task_run.run_count < 2:
            raise RuntimeError(f"attempt {task_run.run_count} of {i} fails")
        return i

    @flow
    def fan_out(n: int) -> tuple[float, str]:
        from prefect.runtime import flow_run

        assert len(noop.map(range(WARMUP_TASKS)).result()) == WARMUP_TASKS
        assert len(fails_once.map(range(RETRIED_TASKS)).result()) == RETRIED_TASKS
        started, started_at = time.perf_counter(), time.time()
        assert len(noop.map(range(n)).result()) == n
        return time.perf_counter() - started, flow_run.id, started_at

    def timed_and_recorded(name: str, runner, n: int) -> float:
        elapsed, flow_run_id, started_at = fan_out.with_options(task_runner=runner)(n)
        records[name].append(recorded(flow_run_id, n + UNTIMED_TASKS, started_at))
        return elapsed

    def plain_ray(n: int) -> float:
        @ray.remote
        def plain(i: int) -> int:
            return i

        ray.init(cluster.address, namespace=cluster.namespace)
        try:
            ray.get([plain.remote(i) for i in range(WARMUP_TASKS)])
            started = time.perf_counter()
            ray.get([plain.remote(i) for i in range(n)])
            return time.perf_counter() - started
        finally:
            ray.shutdown()

    runners = {
        "stock": lambda: RayTaskRunner(address=cluster.address),
        "ours": lambda: RayClusterTaskRunner(cluster),
        "threadpool": lambda: ThreadPoolTaskRunner(),
    }
    measured = {
        name: (lambda n, name=name, make=make: timed_and_recorded(name, make(), n))
        for name, make in runners.items()
    }
    return {**measured, "plain_ray": plain_ray}


def recorded(flow_run_id: str, tasks: int, started_at: float) -> dict:
    """What the API recorded of the flow run: wait until it holds `tasks` completed task runs
    (raise when it does not in time: speed bought by lost records does not count); then, for
    LOGS_WAIT_S at most, until each has log lines. Returns the task runs, their states, the
    log lines under task runs, the share of task runs with log lines, and `recorded_s`: from
    `started_at` (the timed part's start, epoch seconds) until the server last wrote one of the
    task runs (their `updated`, the server's clock on this same machine)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter, TaskRunFilter

    runs = FlowRunFilter(id={"any_": [flow_run_id]})
    completed = TaskRunFilter(state={"type": {"any_": ["COMPLETED"]}})
    logs = LogFilter(flow_run_id={"any_": [flow_run_id]})
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + RECORDED_TIMEOUT_S
        filters = {
            "flow_runs": runs.model_dump(mode="json"),
            "task_runs": completed.model_dump(mode="json"),
        }
        while (done := client.request("POST", "/task_runs/count", json=filters).json()) < tasks:
            if time.monotonic() > deadline:
                raise RuntimeError(f"flow run {flow_run_id}: {done} of {tasks} task runs completed")
            time.sleep(0.5)
        deadline = time.monotonic() + LOGS_WAIT_S
        while True:
            lines = []
            offset = 0
            while True:  # every page of the flow run's logs
                page = client.read_logs(log_filter=logs, limit=200, offset=offset)
                lines += [log for log in page if log.task_run_id]
                offset += len(page)
                if len(page) < 200:
                    break
            logged = {log.task_run_id for log in lines}
            if len(logged) >= tasks or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        task_runs: list = []
        while page := client.read_task_runs(flow_run_filter=runs, limit=200, offset=len(task_runs)):
            task_runs += page
        states = sum(len(client.read_task_run_states(run.id)) for run in task_runs)
    return {
        "task_runs": len(task_runs),
        "states": states,
        "log_lines": len(lines),
        "task_runs_with_logs": len(logged) / tasks,
        "recorded_s": max(run.updated.timestamp() for run in task_runs) - started_at,
    }


if __name__ == "__main__":
    main()
