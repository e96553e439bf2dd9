"""The task runner over Ray Client (ray://, the head's client server): task runs recorded as
on a GCS address, and the flow run's log says what Ray Client cannot carry."""

from __future__ import annotations

import logging
import time

from prefect.states import StateType

from blocks import RayCluster
from flows.ray_smoke import ray_smoke
from ray_runner import RAY_CLIENT_LIMITS


def test_the_smoke_flow_over_ray_client_records_its_task_runs_and_says_what_it_lacks(
    stack, prefect_client, task_runs
):
    from prefect.client.schemas.filters import LogFilter

    cluster = RayCluster(
        address=stack.ray_client_address, auth_token=stack.ray_token, serve_port=stack.serve_port
    )
    report = ray_smoke(tasks=4, ray_cluster=cluster)

    assert report.tasks == 4
    assert report.prefect_api_urls == [stack.prefect_api_url]
    assert report.temporary_servers == 0
    for path in report.workloads_paths:  # the project came through py_modules
        assert "py_modules_files" in path, path
    runs = task_runs(
        report.fan_out_flow_run_id,
        lambda runs: len(runs) == 4 and all(run.state.is_completed() for run in runs),
    )
    assert {run.state.type for run in runs} == {StateType.COMPLETED}
    assert len(runs) == 4

    fan_out = prefect_client.read_flow_run(report.fan_out_flow_run_id)
    assert fan_out.labels.get("ray.job_id")
    deadline = time.monotonic() + 10  # log lines are posted a moment after their task run
    while True:
        logs = prefect_client.read_logs(
            log_filter=LogFilter(flow_run_id={"any_": [fan_out.id]}), limit=200
        )
        task_runs_logged = {log.task_run_id for log in logs if log.task_run_id}
        if task_runs_logged == {run.id for run in runs} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # Each task run's own log lines still reach it from its Ray worker ...
    assert task_runs_logged == {run.id for run in runs}
    # ... and the flow run says, once, what Ray Client cannot carry.
    warnings = [log for log in logs if log.task_run_id is None and RAY_CLIENT_LIMITS in log.message]
    assert [log.level for log in warnings] == [logging.WARNING]
