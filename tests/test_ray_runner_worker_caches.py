"""A Ray worker keeps Prefect settings, clients and flow run contexts between task runs; flow
runs on two Prefect APIs that share a worker still each record their task runs in their own;
a fan-out of task runs starts Ray workers by the head's CPUs, not by the number queued."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import RAY_HEAD_CPUS
from prefect import flow, task

from deployments import local, ports
from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner


@pytest.fixture(scope="module")
def second_api():
    """A second Prefect server with its own database (another team's or environment's API):
    its URL and a future that is done once it answers (it starts while the test goes on)."""
    state_dir = Path(tempfile.mkdtemp(prefix="api2-", dir="/tmp"))
    (port,) = ports.free_ports(1)
    (server,) = local.services(state_dir, {"prefect": port}, ("prefect",))
    with ThreadPoolExecutor(1) as starting:
        started = starting.submit(local.start, server)
        try:
            yield f"{server.url}/api", started
        finally:
            started.exception()  # wait: stop only what has finished starting
            local.stop(server)
            shutil.rmtree(state_dir, ignore_errors=True)


@task
def where_am_i() -> tuple[int, str]:
    from prefect.settings import get_current_settings

    return os.getpid(), get_current_settings().api.url


@task
async def where_am_i_async() -> tuple[int, str]:
    return where_am_i.fn()


@flow
def two_tasks() -> list[tuple[int, str]]:
    return [where_am_i.submit().result(), where_am_i_async.submit().result()]


def recorded_states(api: str, flow_run_ids: list, until_completed, timeout: float = 20.0):
    """{flow run id: sorted state types} of the task runs `api` holds for those flow runs,
    polled until both of `until_completed` are completed (task runs are recorded from events)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    with temporary_settings(updates={PREFECT_API_URL: api}):
        with get_client(sync_client=True) as client:
            while True:
                runs = client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id={"any_": list(flow_run_ids)})
                )
                states: dict = {}
                for run in runs:
                    states.setdefault(run.flow_run_id, []).append(run.state.type.value)
                states = {flow_run: sorted(types) for flow_run, types in states.items()}
                done = states.get(until_completed) == ["COMPLETED"] * 2
                if done or time.monotonic() > deadline:
                    return states
                time.sleep(0.5)


def test_flow_runs_on_two_apis_sharing_a_ray_worker_record_each_in_its_own(stack, second_api):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    second_api, second_api_started = second_api
    cluster = stack.ray_cluster()
    runs = []  # (api, flow run id, [(worker pid, the API its task saw)] for a sync and an async)
    with cluster.connect():  # one Ray job: its idle worker serves every flow run below
        for api in (stack.prefect_api_url, second_api, stack.prefect_api_url):
            if api == second_api:
                second_api_started.result()
            with temporary_settings(updates={PREFECT_API_URL: api}):
                state = two_tasks.with_options(task_runner=RayClusterTaskRunner(cluster))(
                    return_state=True
                )
                runs.append((api, state.state_details.flow_run_id, state.result()))

    # Ray may start a second worker for the job under load; what matters is that a worker
    # served task runs of both APIs, one after the other.
    apis_by_worker: dict[int, set[str]] = {}
    for _, _, seen in runs:
        for pid, api in seen:
            apis_by_worker.setdefault(pid, set()).add(api)
    assert any(len(apis) == 2 for apis in apis_by_worker.values()), (
        f"no worker served both APIs: {apis_by_worker}"
    )
    assert [[api for _, api in seen] for _, _, seen in runs] == [[api, api] for api, _, _ in runs]
    first, other, again = (flow_run_id for _, flow_run_id, _ in runs)
    # Each API holds the task runs of its own flow runs, completed, and none of the other's.
    assert recorded_states(stack.prefect_api_url, [first, other, again], again) == {
        first: ["COMPLETED"] * 2,
        again: ["COMPLETED"] * 2,
    }
    assert recorded_states(second_api, [first, other, again], other) == {other: ["COMPLETED"] * 2}


@task
def pid_of_worker(i: int) -> int:
    return os.getpid()


@flow
def fan_out(n: int) -> list[int]:
    return pid_of_worker.map(range(n)).result()


def test_a_fan_out_of_task_runs_starts_ray_workers_by_the_heads_cpus_not_by_its_queue(stack):
    """Each worker a job starts imports Prefect and the task's code (seconds of CPU), and only
    as many as the head's CPUs run at once. Ray 2.60 starts workers for queued tasks up to
    RAY_num_workers_soft_limit: at its default (the CPUs) 80 task runs on a 4-CPU head started
    6 here, at 32 they started 16, and a 200-task fan-out on 2 CPUs started 22 and cost 5x
    as much per task (benchmarks.task_overhead). Nothing else runs on this worker's head
    meanwhile: the workers launched while the flow ran are its job's."""
    from ray.util.state import list_workers

    started_ms = time.time() * 1000
    state = fan_out.with_options(task_runner=RayClusterTaskRunner(stack.ray_cluster()))(
        80, return_state=True
    )
    ran_on = set(state.result())
    ended_ms = time.time() * 1000
    launched = [
        worker
        for worker in list_workers(
            address=stack.ray_dashboard_url,
            filters=[("worker_type", "=", "WORKER")],
            detail=True,
            limit=10_000,
            raise_on_missing_output=False,
        )
        if started_ms <= worker.worker_launch_time_ms <= ended_ms
    ]
    assert ran_on <= {worker.pid for worker in launched}
    assert len(launched) <= 2 * RAY_HEAD_CPUS, (
        f"{len(launched)} Ray workers started on a {RAY_HEAD_CPUS}-CPU head for 80 task runs, "
        f"which ran on {len(ran_on)} of them"
    )
