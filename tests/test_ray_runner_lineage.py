"""A flow run on the Ray task runner is traceable from Ray and back: its Ray job and every
Ray task it starts carry its ids, it links to the Ray dashboard, and what plain @ray.remote
code started from a task run prints or logs lands in that task run's logs."""

from __future__ import annotations

import logging
import time

import pytest
import ray
from prefect import flow, task

from prefect_ray_lifecycle.ray_runner import (
    JOB_METADATA_FLOW_RUN_ID,
    RAY_DASHBOARD_ARTIFACT_KEY,
    RayClusterTaskRunner,
    prefect_ids_in_name,
    ray_task_name,
)


@ray.remote
def whisper(marker: str) -> str:
    print(f"grandchild prints {marker}")
    return marker


@ray.remote
def shout(marker: str) -> str:
    print(f"child prints {marker}")
    logging.getLogger("child").warning("child logs %s", marker)
    return ray.get(whisper.remote(marker))


@task
def starts_ray_work(marker: str) -> str:
    return ray.get(shout.remote(marker))


@flow
def lineage_flow(marker: str) -> str:
    return starts_ray_work.submit(marker).result()


@pytest.fixture(scope="module")
def lineage_run(stack, task_runs):
    marker = f"m{time.monotonic_ns()}"
    state = lineage_flow.with_options(task_runner=RayClusterTaskRunner(stack.ray_cluster()))(
        marker, return_state=True
    )
    assert state.result() == marker
    flow_run_id = state.state_details.flow_run_id
    (task_run,) = task_runs(flow_run_id, lambda runs: len(runs) == 1)
    return {"marker": marker, "flow_run_id": flow_run_id, "task_run": task_run}


def _flow_run(prefect_client, run):
    return prefect_client.read_flow_run(run["flow_run_id"])


def test_the_flow_run_links_its_ray_job_on_the_dashboard(stack, prefect_client, lineage_run):
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter

    labels = _flow_run(prefect_client, lineage_run).labels
    job_id = labels["ray.job_id"]
    assert labels["ray.dashboard_url"] == stack.ray_dashboard_url
    (artifact,) = prefect_client.read_artifacts(
        artifact_filter=ArtifactFilter(key={"any_": [RAY_DASHBOARD_ARTIFACT_KEY]}),
        flow_run_filter=FlowRunFilter(id={"any_": [lineage_run["flow_run_id"]]}),
    )
    assert artifact.type == "markdown"
    assert f"({stack.ray_dashboard_url}/#/jobs/{job_id})" in artifact.data


def test_the_ray_job_and_every_ray_task_carry_the_flow_run_id(stack, prefect_client, lineage_run):
    from ray.util.state import list_jobs, list_tasks

    flow_run_id = str(lineage_run["flow_run_id"])
    task_run_id = str(lineage_run["task_run"].id)
    job_id = _flow_run(prefect_client, lineage_run).labels["ray.job_id"]

    (job,) = [
        j
        for j in list_jobs(address=stack.ray_dashboard_url, limit=1000, detail=True)
        if j.job_id == job_id
    ]
    assert job.metadata[JOB_METADATA_FLOW_RUN_ID] == flow_run_id

    names = {
        t.name
        for t in list_tasks(
            address=stack.ray_dashboard_url, filters=[("job_id", "=", job_id)], limit=1000
        )
    }
    # The task run's own Ray task, its child and its grandchild, all tied to the task run.
    assert names == {
        ray_task_name("starts_ray_work", flow_run_id, task_run_id),
        ray_task_name("shout", flow_run_id, task_run_id, started_from=True),
        ray_task_name("whisper", flow_run_id, task_run_id, started_from=True),
    }
    assert {prefect_ids_in_name(name)[:2] for name in names} == {(flow_run_id, task_run_id)}


def test_plain_ray_tasks_started_by_a_task_run_log_under_it(prefect_client, lineage_run):
    from prefect.client.schemas.filters import LogFilter

    marker = lineage_run["marker"]
    wanted = {f"child prints {marker}", f"child logs {marker}", f"grandchild prints {marker}"}
    deadline = time.monotonic() + 10  # the flow waited for them; the API may lag a little
    while True:
        logs = prefect_client.read_logs(
            log_filter=LogFilter(task_run_id={"any_": [lineage_run["task_run"].id]})
        )
        found = {w for w in wanted if any(w in log.message for log in logs)}
        if found == wanted or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert found == wanted
    by_message = {log.message: log for log in logs}
    child = by_message[f"child prints {marker}"]
    assert child.name == "ray.shout" and child.flow_run_id == lineage_run["flow_run_id"]
    # Forwarded once each, and nothing else the task run printed or logged came this way.
    assert sorted(log.message for log in logs if log.name.startswith("ray.")) == sorted(wanted)


@task
def says_on_the_console(marker: str) -> list[str]:
    from prefect import get_run_logger

    get_run_logger().info("console %s", marker)
    return [type(handler).__name__ for handler in logging.getLogger().handlers]


@flow
def console_flow(marker: str) -> list[str]:
    return says_on_the_console.submit(marker).result()


def test_a_task_runs_console_line_is_printed_plain_in_its_worker_and_reaches_the_driver(
    stack, capfd
):
    """In the Ray worker, Prefect's console handler (Rich) gives way to a plain StreamHandler
    with its format; the task run's line still reaches the flow's console through Ray's log
    stream, as Prefect formats it."""
    marker = f"m{time.monotonic_ns()}"
    runner = RayClusterTaskRunner(stack.ray_cluster())
    handlers = console_flow.with_options(task_runner=runner)(marker)
    assert "PrefectConsoleHandler" not in handlers and "StreamHandler" in handlers, handlers
    printed, deadline = "", time.monotonic() + 30
    while f"console {marker}" not in printed and time.monotonic() < deadline:
        time.sleep(0.5)
        printed += capfd.readouterr().err
    (line,) = [line for line in printed.splitlines() if f"console {marker}" in line]
    assert "| INFO    | Task run 'says_on_the_console-" in line, line
