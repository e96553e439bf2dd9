"""A task run waiting out its retry delay on the Ray task runner lends its CPUs to other work."""

from __future__ import annotations

import time
from pathlib import Path

from conftest import RAY_HEAD_CPUS
from prefect import flow, task

from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner, ray_options

RETRY_DELAY_S = 8


@task(retries=1, retry_delay_seconds=RETRY_DELAY_S)
@ray_options(num_cpus=RAY_HEAD_CPUS)
def fails_once(marker: str) -> int:
    with open(marker, "a") as out:
        out.write(f"{time.time()}\n")
    attempts = len(Path(marker).read_text().splitlines())
    if attempts == 1:
        raise RuntimeError("first attempt fails")
    return attempts


@task
@ray_options(num_cpus=RAY_HEAD_CPUS)
def needs_every_cpu() -> float:
    return time.time()


@task
@ray_options(num_cpus=1)
def warm_up() -> None:
    time.sleep(1)


@flow
def retry_flow(marker: str) -> tuple[int, float]:
    # Three idle workers with Prefect imported, one each for the task in its retry delay, the
    # zero-CPU timer it waits on and the task that needs every CPU: none waits for a cold start.
    for future in [warm_up.submit() for _ in range(3)]:
        future.result()
    flaky = fails_once.submit(marker)
    deadline = time.monotonic() + 60
    while not Path(marker).exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # the first attempt has run and is failing into its retry delay
    time.sleep(0.5)
    busy = needs_every_cpu.submit()
    return flaky.result(), busy.result()


def test_a_retry_delay_holds_no_cpus_on_ray(stack, tmp_path, task_runs):
    marker = tmp_path / "attempts.txt"
    state = retry_flow.with_options(task_runner=RayClusterTaskRunner(stack.ray_cluster()))(
        str(marker), return_state=True
    )
    attempts, busy_started = state.result()

    first, second = map(float, marker.read_text().splitlines())
    assert attempts == 2
    assert second - first >= RETRY_DELAY_S - 0.5  # the delay was kept ...
    # ... and a task needing every CPU of the cluster ran inside it, not after it.
    assert first < busy_started < second
    runs = task_runs(
        state.state_details.flow_run_id,
        lambda runs: len(runs) == 5 and all(run.state.is_completed() for run in runs),
    )
    (flaky_run,) = [run for run in runs if run.name.startswith("fails_once")]
    assert flaky_run.state.is_completed() and flaky_run.run_count == 2
