"""The plugin inside a user's own Prefect project, which has its own `flows`, `tasks` and
`blocks` packages (as Prefect projects often do): a worker started there runs one of our
flows (by its module path) and one of the project's own, whose task runs on Ray through our
task runner and imports the project's `tasks`, not ours."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deployments import local, setup
from deployments.testing.stack import environment as stack_environment

PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "user-project-pool"
RUN_TIMEOUT_S = 240

pytestmark = pytest.mark.slow

PROJECT_FILES = {
    "flows/__init__.py": '"""The user\'s own flows."""\n',
    "flows/mine.py": '''
        """A user's flow: its task runs on Ray through prefect-ray-lifecycle's runner."""
        import json
        from pathlib import Path

        from prefect import flow
        from prefect.artifacts import create_markdown_artifact

        import blocks
        from prefect_ray_lifecycle.blocks import RayCluster
        from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner
        from tasks.where import where

        PROJECT = Path(__file__).resolve().parents[1]
        # The deployment environment's cluster, with this project shipped to its workers.
        CLUSTER = RayCluster.load("lifecycle", _sync=True).model_copy(
            update={"runtime_env": {"working_dir": str(PROJECT)}}
        )


        @flow(name="mine", task_runner=RayClusterTaskRunner(CLUSTER))
        def mine(n: int = 3) -> list[dict]:
            seen = [future.result() for future in where.map(range(n))]
            create_markdown_artifact(
                key="where-tasks-ran",
                markdown=json.dumps({"greeting": blocks.GREETING, "seen": seen}),
            )
            return seen
    ''',
    "tasks/__init__.py": '"""The user\'s own tasks."""\n',
    "tasks/where.py": '''
        import os

        from prefect import task


        @task
        def where(index: int) -> dict:
            """Where this ran: the process, and the `tasks` and `flows` it imports there."""
            import ray

            import flows
            import tasks

            return {
                "index": index,
                "pid": os.getpid(),
                "in_ray_task": ray.is_initialized()
                and ray.get_runtime_context().get_task_id() is not None,
                "tasks": tasks.__doc__,
                "tasks_file": tasks.__file__,
                "flows": flows.__doc__,
            }
    ''',
    "blocks/__init__.py": '"""The user\'s own blocks."""\nGREETING = "the user\'s blocks"\n',
}


def prefect_yaml(project: Path) -> str:
    return textwrap.dedent(
        f"""
        name: a-user-project
        prefect-version: 3.9.1
        build: null
        push: null
        pull:
          - prefect.deployments.steps.set_working_directory:
              directory: {project}
        deployments:
          - name: ours
            entrypoint: prefect_ray_lifecycle.flows.ray_smoke:ray_smoke
            enforce_parameter_schema: false
            parameters:
              tasks: 4
              ray_cluster:
                $ref: {{block_document_slug: ray-cluster/lifecycle}}
            work_pool: {{name: {POOL}}}
          - name: theirs
            entrypoint: flows/mine.py:mine
            work_pool: {{name: {POOL}}}
        """
    )


def make_project(root: Path) -> Path:
    project = root / "a-user-project"
    for name, text in PROJECT_FILES.items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    (project / "prefect.yaml").write_text(prefect_yaml(project))
    return project


def cli(args: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        [PREFECT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, f"prefect {args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def final_run(client, deployment: str, env: dict[str, str], cwd: Path):
    out = cli(["deployment", "run", deployment], env, cwd)
    flow_run_id = next(
        line.split("UUID:")[1].strip() for line in out.splitlines() if "UUID:" in line
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        assert time.monotonic() < deadline, f"{deployment} still {run.state.name}"
        time.sleep(1)


@pytest.fixture
def user_project(stack, tmp_path):
    """The project, deployed from its own folder, and a worker running there (stopped by
    pid at the end)."""
    env = dataclasses.replace(stack_environment(stack), receiver_url=None)
    with setup.prefect_api(stack.prefect_api_url):
        setup.save_blocks(env)
        setup.ensure_work_pool(POOL)
    project = make_project(tmp_path)
    cli_env = {**os.environ, **env.client_env}
    cli_env.pop("PYTHONPATH", None)
    cli(["--no-prompt", "deploy", "--all"], cli_env, project)
    service = setup.worker_service(tmp_path / "worker")
    local.launch(service, setup.worker_command(POOL, name="user-project-worker"), cli_env, project)
    try:
        yield project, cli_env
    finally:
        local.stop(service)


def test_a_user_project_with_its_own_flows_tasks_and_blocks_runs_ours_and_its_own(
    stack, prefect_client, task_runs, user_project
):
    project, env = user_project

    ours = final_run(prefect_client, "ray-smoke/ours", env, project)
    assert ours.state.is_completed(), ours.state.message
    fan_out = prefect_client.read_flow_runs(
        flow_run_filter=_children_of(ours.id),
    )
    (fan_out,) = fan_out
    runs = task_runs(fan_out.id, lambda runs: len(runs) == 4 and all_completed(runs))
    assert len(runs) == 4 and all_completed(runs)

    theirs = final_run(prefect_client, "mine/theirs", env, project)
    assert theirs.state.is_completed(), theirs.state.message
    runs = task_runs(theirs.id, lambda runs: len(runs) == 3 and all_completed(runs))
    assert sorted(t.name.split("-")[0] for t in runs) == ["where"] * 3
    assert all_completed(runs)
    # Our runner ran them on the stack's Ray and linked the flow run to its Ray job.
    assert theirs.labels.get("ray.job_id")
    seen = json.loads(_artifact(prefect_client, theirs.id, "where-tasks-ran"))
    assert seen["greeting"] == "the user's blocks"
    for answer in seen["seen"]:
        assert answer["in_ray_task"] is True
        assert (
            answer["tasks"] == "The user's own tasks."
            and answer["flows"] == "The user's own flows."
        )
        # The project's own copy, shipped as the job's working_dir, not a file of ours.
        assert "working_dir_files" in answer["tasks_file"], answer["tasks_file"]


def _children_of(flow_run_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))


def all_completed(task_runs) -> bool:
    return all(t.state.is_completed() for t in task_runs)


def _artifact(client, flow_run_id, key: str) -> str:
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    (artifact,) = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
        )
    )
    return str(artifact.data)


def test_outside_the_checkout_our_old_top_level_names_do_not_import(tmp_path):
    """The plugin installs one import package: `tasks`, `flows`, `blocks` and the rest are
    the user's names to take."""
    names = ["tasks", "flows", "blocks", "workloads", "ray_runner", "deployments", "benchmarks"]
    code = (
        "import importlib.util, json, prefect_ray_lifecycle; "
        f"print(json.dumps({{n: importlib.util.find_spec(n) is not None for n in {names!r}}}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == dict.fromkeys(names, False)
