"""The RayCluster connection carries Prefect into Ray workers, against a `ray start --head`."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.states import StateType

from deployments import processes
from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.flows.ray_smoke import ray_smoke
from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner, ray_options

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def test_twenty_tasks_on_the_head_are_recorded_under_their_flow_run(stack, task_runs):
    report = ray_smoke(tasks=20, ray_cluster=stack.ray_cluster())

    runs = task_runs(
        report.fan_out_flow_run_id,
        lambda runs: len(runs) == 20 and all(run.state.is_completed() for run in runs),
    )
    assert len(runs) == 20
    assert {run.state.type for run in runs} == {StateType.COMPLETED}
    assert {run.name.split("-")[0] for run in runs} == {"probe"}
    # Every worker recorded in this server, and none started a temporary one.
    assert report.prefect_api_urls == [stack.prefect_api_url]
    assert report.temporary_servers == 0
    assert report.tasks == 20


def test_a_driver_elsewhere_gets_the_project_from_py_modules_and_its_own_temporary_api(
    stack, tmp_path
):
    """The upstream #18485 case: no PREFECT_API_URL, so the flow process runs Prefect's
    temporary server. Workers must use that one, not start their own; and with the driver
    outside the checkout, workers import the project from the shipped py_modules."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    # Prefect gives its temporary server 20 s to answer: on a loaded CI machine it took
    # longer once ("Timed out while attempting to connect to ephemeral Prefect API server").
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_ray_lifecycle.flows.ray_smoke",
            "--tasks",
            "4",
            "--address",
            stack.ray_address,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    assert report["tasks"] == 4
    assert report["temporary_servers"] == 0
    (api_url,) = report["prefect_api_urls"]
    assert api_url.startswith("http://127.0.0.1:") and api_url != stack.prefect_api_url
    # The driver started the one temporary server; a worker's would show in the driver's
    # output too (Ray forwards worker logs to the driver).
    assert (result.stderr + result.stdout).count("Starting temporary server") == 1
    for path in report["workloads_paths"]:
        assert str(stack.ray_temp_dir) in path and "py_modules_files" in path, path
        assert not path.startswith(str(PROJECT_ROOT))


@task
def record_then_die(marker: str, survive_after: int) -> int:
    """Append a line; kill the Ray worker process until `survive_after` lines exist."""
    with open(marker, "a") as out:
        out.write("ran\n")
    runs = len(Path(marker).read_text().splitlines())
    if runs <= survive_after:
        os._exit(1)  # the worker process dies mid-task, as on a node loss or OOM kill
    return runs


@flow
def dying_flow(marker: str, survive_after: int):
    return record_then_die.submit(marker, survive_after).result()


def test_a_crashed_worker_is_retried_as_a_recorded_attempt(stack, tmp_path, task_runs):
    """The default crash_retries (2): two crashes, then the third run completes."""
    marker = tmp_path / "runs.txt"
    runner = RayClusterTaskRunner(stack.ray_cluster(), crash_backoff_s=0.1)
    state = dying_flow.with_options(task_runner=runner)(str(marker), 2, return_state=True)

    assert state.is_completed(), state
    assert state.result() == 3
    # The body ran once per attempt, and Prefect knows of every attempt.
    assert marker.read_text().splitlines() == ["ran"] * 3
    (task_run,) = task_runs(
        state.state_details.flow_run_id, lambda runs: runs and runs[0].state.is_completed()
    )
    assert task_run.state.is_completed() and task_run.run_count == 3


def test_with_no_crash_retries_a_crash_ends_crashed_and_ray_never_reruns_it(
    stack, tmp_path, task_runs
):
    marker = tmp_path / "runs.txt"
    runner = RayClusterTaskRunner(stack.ray_cluster(), crash_retries=0)
    state = dying_flow.with_options(task_runner=runner)(str(marker), 99, return_state=True)

    assert not state.is_completed()
    (task_run,) = task_runs(
        state.state_details.flow_run_id, lambda runs: runs and runs[0].state.is_crashed()
    )
    assert task_run.state.is_crashed() and task_run.run_count == 1
    # No wait needed: Ray's owner sets a crashed task's error only after it has spent the
    # task's max_retries, so with Ray's own default (3) the marker would already hold four
    # runs when the flow saw the crash.
    assert marker.read_text().splitlines() == ["ran"]


@task(retries=1)
def fail_with_user_error(marker: str) -> None:
    with open(marker, "a") as out:
        out.write("ran\n")
    raise ValueError("bad input")


@flow
def user_error_flow(marker: str):
    return fail_with_user_error.submit(marker).result()


def test_a_user_error_follows_the_tasks_own_retries_only(stack, tmp_path):
    marker = tmp_path / "runs.txt"
    runner = RayClusterTaskRunner(stack.ray_cluster(), crash_retries=3)
    state = user_error_flow.with_options(task_runner=runner)(str(marker), return_state=True)

    assert state.is_failed()
    with pytest.raises(ValueError, match="bad input"):
        state.result()
    assert marker.read_text().splitlines() == ["ran", "ran"]  # 1 run + retries=1


def test_embedded_ray_dashboard_answers_on_loopback_only(stack):
    """Ray 2.60 maps 127.0.0.1 to the node's own IP for its core ports (GCS, raylet): those
    listen on every interface, behind Ray's token auth. The dashboard is ours to bind."""
    import socket

    import ray

    with RayCluster(num_cpus=1).connect() as context:
        host, port = context.dashboard_url.split(":")
        assert host == "127.0.0.1"
        assert ray.cluster_resources()["CPU"] == 1
        socket.create_connection((host, int(port)), timeout=5).close()
        # Linux's loopback answers all of 127/8: a server on every interface would take a
        # connection to 127.0.0.2, one bound to 127.0.0.1 refuses it. Likewise the node IP.
        others = {"127.0.0.2", ray.util.get_node_ip_address()} - {"127.0.0.1"}
        for other in sorted(others):
            with pytest.raises(OSError):
                socket.create_connection((other, int(port)), timeout=5).close()
    assert not ray.is_initialized()


@task
@ray_options(num_cpus=3, runtime_env={"env_vars": {"PROBE_FLAG": "on"}})
def what_ray_gave_me() -> dict:
    import ray

    return {
        "cpus": ray.get_runtime_context().get_assigned_resources().get("CPU"),
        "flag": os.environ.get("PROBE_FLAG"),
    }


@task(timeout_seconds=2)
def too_slow() -> None:
    time.sleep(60)


@task(log_prints=True)
def chatty(word: str) -> None:
    from prefect import get_run_logger

    get_run_logger().info("logger says %s", word)
    print(f"print says {word}")


@flow
def execution_flow(word: str):
    resources = what_ray_gave_me.submit().result()
    slow = too_slow.submit()
    slow.wait()
    chatty.submit(word).result()
    return resources, slow.state


def test_ray_resources_timeouts_and_logs_on_the_task_itself(stack, prefect_client, task_runs):
    from prefect.client.schemas.filters import LogFilter

    word = f"w{time.monotonic_ns()}"
    state = execution_flow.with_options(task_runner=RayClusterTaskRunner(stack.ray_cluster()))(
        word, return_state=True
    )
    resources, slow_state = state.result()

    assert resources == {"cpus": 3.0, "flag": "on"}
    assert slow_state.is_failed() and slow_state.name == "TimedOut"
    # What the task logged and printed inside its Ray worker sits under its own task run.
    runs = task_runs(
        state.state_details.flow_run_id, lambda runs: any(r.name.startswith("chatty") for r in runs)
    )
    (chatty_run,) = [r for r in runs if r.name.startswith("chatty")]
    deadline = time.monotonic() + 20
    while True:
        messages = [
            log.message
            for log in prefect_client.read_logs(
                log_filter=LogFilter(task_run_id={"any_": [chatty_run.id]})
            )
        ]
        if sum(word in m for m in messages) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert f"logger says {word}" in messages and f"print says {word}" in messages


def test_an_unknown_ray_option_is_rejected():
    with pytest.raises(ValueError, match="num_cpu"):
        ray_options(num_cpu=1)


SLEEPER_FLOW = """
import os, sys, time
from prefect import flow, task
from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner

@task
def sleeper(marker_dir: str, index: int) -> None:
    with open(os.path.join(marker_dir, f"{index}.pid"), "w") as out:
        out.write(str(os.getpid()))
    time.sleep(600)

@flow
def sleepers(marker_dir: str):
    futures = [sleeper.submit(marker_dir, i) for i in range(2)]
    for future in futures:
        future.wait()

if __name__ == "__main__":
    runner = RayClusterTaskRunner(RayCluster(address=sys.argv[1]))
    sleepers.with_options(task_runner=runner)(sys.argv[2])
"""


def test_stopping_the_flow_process_stops_its_ray_tasks(stack, tmp_path):
    """What a cancelled deployment run does to the flow process (SIGTERM): none of its Ray
    tasks may keep running on the cluster."""
    import signal
    import subprocess

    script = tmp_path / "sleepers.py"
    script.write_text(SLEEPER_FLOW)
    markers = tmp_path / "markers"
    markers.mkdir()
    process = subprocess.Popen(
        [sys.executable, str(script), stack.ray_address, str(markers)],
        cwd=PROJECT_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(markers.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            assert process.poll() is None, "the flow ended before its tasks started"
            time.sleep(0.5)
        pids = [int(path.read_text()) for path in markers.glob("*.pid")]
        assert len(pids) == 2
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)

        deadline = time.monotonic() + 30
        while any(map(processes.process_running, pids)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(map(processes.process_running, pids)), (
            "Ray tasks outlived their flow process"
        )
    finally:
        if process.poll() is None:
            process.kill()


def test_a_heads_workers_look_up_their_own_cluster(stack):
    """Ray code in a worker that looks its cluster up by itself (the state API: Ray Train's
    placement group cleaner asks it whether a Train controller lives) is told which cluster is
    its own, and gets an answer from it. Auto-detection fails wherever a second Ray cluster
    runs on the machine (a test session's second worker has one), and the cleaner then never
    removes the worker group of a trial ASHA stopped."""
    import ray

    @ray.remote(num_cpus=0)
    def look_up() -> tuple[str | None, int]:
        from ray.util.state import list_nodes

        return os.environ.get("RAY_ADDRESS"), len(list_nodes())

    with stack.ray_cluster().connect():
        address, nodes = ray.get(look_up.remote(), timeout=120)
    assert address == stack.ray_address and nodes >= 1


def test_a_local_heads_workers_run_at_the_priority_of_what_started_it(stack):
    """Ray starts its workers at niceness 15 by default (RAY_worker_niceness): on a small
    machine shared with the Prefect server, MLflow and the flow processes at 0, the work itself
    (replicas, routers, trials, Train workers) then got about 1/30 of a busy CPU. A local head
    starts them at the niceness of the process that started it."""
    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    with stack.ray_cluster().connect():
        assert ray.get(niceness.remote(), timeout=120) == os.nice(0)


def test_a_local_head_starts_one_worker_for_a_jobs_task_and_none_for_jobs_that_never_come(stack):
    """When its first driver connects, a Ray node starts workers for jobs without a runtime
    env (RAY_JOB_ID ffffffff) by default; every job here has one, so they idled for the head's
    whole life. Without them, a job's first task got two workers started (a node starts as
    many at once as it has CPUs), one of them never used. A local head does neither: the
    workers on this machine that belong to the stack's head all carry a real job's id, and
    this job's one task started one."""
    import ray

    @ray.remote(num_cpus=0)
    def job_id() -> str:
        return os.environ["RAY_JOB_ID"]

    def head_worker_jobs() -> list[str]:
        jobs = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours
                env = processes.environ(int(pid))
                if env.get("RAY_ADDRESS") == stack.ray_address and "RAY_JOB_ID" in env:
                    jobs.append(env["RAY_JOB_ID"])
        return jobs

    with stack.ray_cluster().connect():
        this_job = ray.get(job_id.remote(), timeout=120)
        jobs = head_worker_jobs()
    assert jobs.count(this_job) == 1
    assert "ffffffff" not in jobs


def test_placement_groups_a_sweep_left_are_removed_and_no_others(stack):
    """After a sweep, what Ray did not remove of the groups its job made meanwhile is removed
    (a trial's worker group Ray Train's cleaner missed); a group made before it, or by
    another job, stays."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from prefect_ray_lifecycle.compat.ray_internals import job_placement_groups
    from prefect_ray_lifecycle.workloads.llm.train.sweep import remove_left_groups

    other_job = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_GROUP, stack.ray_address],
        env={**os.environ, **stack.client_env()},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other_job.stdout.readline().strip() == "holding"
        with stack.ray_cluster().connect():
            kept = placement_group([{"CPU": 0.1}])
            ray.get(kept.ready(), timeout=60)
            before = set(job_placement_groups())
            left = placement_group([{"CPU": 0.1}])
            ray.get(left.ready(), timeout=60)
            try:
                assert remove_left_groups(before, settle_s=1) == [left.id.hex()]
                assert ray.util.placement_group_table(left)["state"] == "REMOVED"
                assert set(job_placement_groups()) == {kept.id.hex()}
                table = ray.util.placement_group_table()
                assert any(
                    info["state"] == "CREATED" and gid not in {kept.id.hex(), left.id.hex()}
                    for gid, info in table.items()
                ), "the other job's group went too"
            finally:
                remove_placement_group(kept)
    finally:
        other_job.kill()
        other_job.wait(timeout=30)


HOLD_A_GROUP = """
import sys, time, ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1], log_to_driver=False)
ray.get(placement_group([{"CPU": 0.1}]).ready(), timeout=60)
print("holding", flush=True)
time.sleep(600)
"""
