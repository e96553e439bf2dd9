"""A flow run on the Ray task runner is traceable from Ray and back: its Ray job and every
Ray task it starts carry its ids, it links to the Ray dashboard, and what plain @ray.remote
code started from a task run prints or logs lands in that task run's logs."""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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
    print(f"printed {marker}", file=sys.stderr)  # not logging: Ray's log stream, at once
    return [type(handler).__name__ for handler in logging.getLogger().handlers]


@flow
def console_flow(marker: str) -> list[str]:
    return says_on_the_console.submit(marker).result()


class Consoles:
    """What the flow process's console shows, by who printed it: the flow process itself
    (Prefect's console handler, given a stream of this test's) or Ray's log stream from the
    workers (printed on this process's stderr)."""

    def __init__(self, capfd, driver: io.StringIO):
        self.capfd, self.driver, self.ray = capfd, driver, ""

    def until(self, *wanted: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all(w in self.driver.getvalue() + self.ray for w in wanted):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
            self.ray += self.capfd.readouterr().err


@pytest.fixture
def consoles(capfd):
    from prefect.logging.handlers import PrefectConsoleHandler

    (handler,) = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    old, handler.stream = handler.stream, io.StringIO()
    try:
        yield Consoles(capfd, handler.stream)
    finally:
        handler.stream = old


def test_a_short_task_runs_console_line_is_printed_once_by_the_driver(stack, consoles):
    """In the Ray worker, Prefect's console handler (Rich) gives way to WorkerConsole (a
    plain StreamHandler with its format), which holds a young task run's lines: the flow
    process prints them once, as Prefect formats them, and Ray's log stream does not carry
    them too."""
    marker = f"m{time.monotonic_ns()}"
    runner = RayClusterTaskRunner(stack.ray_cluster())
    handlers = console_flow.with_options(task_runner=runner)(marker)
    assert "PrefectConsoleHandler" not in handlers and "WorkerConsole" in handlers, handlers
    # The worker printed to its stderr after it logged: once that line has come through
    # Ray's log stream, so would the logged line have, had the worker printed it.
    consoles.until(f"printed {marker}", f"console {marker}")
    assert f"printed {marker}" in consoles.ray and f"console {marker}" not in consoles.ray
    (line,) = [line for line in consoles.driver.getvalue().splitlines() if marker in line]
    assert "| INFO    | Task run 'says_on_the_console-" in line and line.endswith(marker), line


@task
def logs_then_waits(marker: str, release: str) -> None:
    from prefect import get_run_logger

    logger = get_run_logger()
    logger.info("early %s", marker)
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.1)
    logger.info("late %s released=%s", marker, os.path.exists(release))


@flow
def waiting_flow(marker: str, release: str) -> None:
    logs_then_waits.submit(marker, release).result()


def test_a_long_task_runs_console_lines_are_printed_while_it_runs(stack, consoles, tmp_path):
    """The flow's console keeps its live view: a task run still going after
    CONSOLE_LIVE_AFTER_S has its held lines printed from its worker (Ray's log stream) while
    it runs (here it waits for the test to see them), and each line once."""
    marker, release = f"m{time.monotonic_ns()}", tmp_path / "release"
    runner = RayClusterTaskRunner(stack.ray_cluster())
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(waiting_flow.with_options(task_runner=runner), marker, str(release))
        consoles.until(f"early {marker}")
        seen_while_running = f"early {marker}" in consoles.ray and not run.done()
        release.touch()
        run.result(timeout=180)
    consoles.until(f"late {marker}")
    printed = consoles.driver.getvalue() + consoles.ray
    assert seen_while_running, printed[-2000:]
    assert printed.count(f"early {marker}") == 1 and printed.count(f"late {marker}") == 1
    assert f"late {marker} released=True" in consoles.ray
