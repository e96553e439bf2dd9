"""The task runner over Ray Client (ray://, the head's client server): task runs recorded as
on a GCS address, and the flow run's log says what Ray Client cannot carry."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from prefect.states import StateType

from deployments.testing.fast import FAST_SERVING
from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.flows.ray_smoke import ray_smoke
from prefect_ray_lifecycle.ray_runner import RAY_CLIENT_LIMITS


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


def outside_cluster(stack, kind: str) -> RayCluster:
    """The stack's cluster by each address kind a RayCluster block takes."""
    if kind == "ray-client":
        return client_cluster(stack)
    if kind == "gcs":
        return stack.ray_cluster()
    return RayCluster(num_cpus=1)  # embedded: a Ray of its own in this process


@pytest.mark.parametrize("kind", ["ray-client", "gcs", "embedded"])
def test_the_runner_used_outside_any_flow_run_runs_its_task_on_every_address_kind(stack, kind):
    """A runner used as a library (no flow run), as stock prefect-ray's is: the task's answer
    comes back from a Ray worker of the cluster the address names. Over Ray Client the warning
    about what it lacks goes to the module's logger (there is no run logger to take it);
    elsewhere there is nothing to warn about."""
    import ray
    from prefect import task
    from prefect.logging.loggers import get_logger

    from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner

    @task
    def where(x: int) -> tuple[int, str, str]:
        import ray

        context = ray.get_runtime_context()
        return x * 2, context.get_node_id(), context.gcs_address

    said: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = said.append
    logger = get_logger("prefect_ray_lifecycle.ray_runner.runner")
    logger.addHandler(handler)
    try:
        with RayClusterTaskRunner(outside_cluster(stack, kind)) as runner:
            future = runner.submit(where, parameters={"x": 21}, wait_for=[])
            doubled, node, gcs = future.result(timeout=120)
    finally:
        logger.removeHandler(handler)
    assert doubled == 42 and node  # it ran in a Ray worker ...
    head_port = stack.ray_address.rpartition(":")[2]
    # ... of the stack's head, or (embedded) of a Ray of the runner's own
    assert (gcs.rpartition(":")[2] == head_port) == (kind != "embedded"), (kind, gcs)
    expected = [RAY_CLIENT_LIMITS] if kind == "ray-client" else []
    assert [record.getMessage() for record in said] == expected
    assert not ray.is_initialized()  # the runner let go of what it started


CONNECT = """
import logging
import sys

import ray
from ray.util.client_connect import connect

# The client retries a refused ping until it gives up with a bare "connection timeout"; the
# server's reason is in its debug log ("Received when checking init: ...").
logging.basicConfig(stream=sys.stderr)
logging.getLogger("ray.util.client.worker").setLevel(logging.DEBUG)
# A head that fails to start this connection's server process is tried again, as the project
# does (a busy head failed the control connection so once); a refusal is not.
from prefect_ray_lifecycle.blocks.ray_cluster import retry_client_start

address = sys.argv[1]
retry_client_start(
    lambda: connect(address.removeprefix("ray://"), connection_retries=1), address, ray.shutdown
)
print("connected", ray.cluster_resources()["CPU"])
"""


def client_without(stack, token: str | None, home) -> subprocess.CompletedProcess:
    """A plain Ray Client connection to the head's client server from a fresh process: with
    `token` sent as the cluster's (token auth on), or none at all (no auth mode, no token
    anywhere: an empty HOME, so no ~/.ray token file either)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    if token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    argv = [sys.executable, "-c", CONNECT, stack.ray_client_address]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)


def test_the_client_server_refuses_a_client_without_the_clusters_token(stack, tmp_path):
    """docs/clusters.md: the client server listens on every interface and refuses clients
    without the cluster's token. The same connection with the token is the control."""
    allowed = client_without(stack, stack.ray_token, tmp_path)
    assert allowed.returncode == 0 and "connected" in allowed.stdout, allowed.stderr[-2000:]
    for token in (None, "not-" + stack.ray_token):
        refused = client_without(stack, token, tmp_path)
        assert refused.returncode != 0, (token, refused.stdout)
        assert "connected" not in refused.stdout
        reasons = re.findall(r"Received when checking init: (.*)", refused.stderr)
        assert reasons and all(re.search(r"(?i)auth|token", r) for r in reasons), (
            token,
            refused.stderr[-2000:],
        )


def client_cluster(stack) -> RayCluster:
    return RayCluster(
        address=stack.ray_client_address, auth_token=stack.ray_token, serve_port=stack.serve_port
    )


@pytest.mark.slow
def test_a_sweep_over_ray_client_runs_its_trials_on_the_cluster_and_returns_a_checkpoint(
    stack, tmp_path
):
    from prefect_ray_lifecycle.flows.tune_sweep import tune_sweep
    from prefect_ray_lifecycle.tasks.tune.config import SweepConfig
    from prefect_ray_lifecycle.workloads.rl import rllib

    result = tune_sweep(
        sweep=SweepConfig(
            num_samples=2,
            hyperparameters={
                "train_batch_size_per_learner": 256,
                "minibatch_size": 64,
                "num_epochs": 2,
            },
            scheduler={"kind": "fifo"},
            stop={"training_iterations": 2, "env_steps": None, "episode_return": None},
        ),
        ray_cluster=client_cluster(stack),
        storage_root=str(tmp_path),  # the head and this process share the machine here
        evaluation_episodes=2,
    )
    assert [t.status for t in result.trials] == ["TERMINATED", "TERMINATED"]
    assert {t.iterations for t in result.trials} == {2}
    # The checkpoint returned is the one the flow evaluated on the cluster: here, on the same
    # held-out seeds, its greedy episodes return exactly what the flow recorded.
    evaluation = result.evaluation
    again = rllib.evaluate_checkpoint(
        result.checkpoint_path,
        "CartPole-v1",
        episodes=evaluation.episodes,
        seed=evaluation.seeds[0] - rllib.EVAL_SEED_OFFSET,
    )
    assert again.seeds == evaluation.seeds and again.returns == evaluation.returns


@pytest.mark.slow
def test_a_rollout_over_ray_client_serves_the_version_through_the_gates(stack, checkpoints):
    import mlflow
    import numpy as np
    from mlflow import MlflowClient

    from prefect_ray_lifecycle.blocks import MLflowServer
    from prefect_ray_lifecycle.control import registry, serve_control
    from prefect_ray_lifecycle.flows.rollout import serve_rollout
    from prefect_ray_lifecycle.tasks.rollout.config import Gates, Serving

    route, name = "client-test", f"client-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(2):
        registry.register_checkpoint(
            client,
            name=name,
            checkpoint=checkpoints["good"],
            experiment_name="ray-client-tests",
            trial_key_value=f"{name}-{trial}",
            observation_size=4,
        )
    common = dict(
        model_name=name,
        route=route,
        gates=Gates(
            health_timeout_s=120,
            stability_window_s=3,
            canary_steps=[0.5],
            canary_hold_s=3,
            bake_s=3,
            bake_window_s=2,
        ),
        serving=Serving(**FAST_SERVING),
        ray_cluster=client_cluster(stack),
        mlflow_server=MLflowServer(tracking_uri=stack.mlflow_uri),
    )
    try:
        first = serve_rollout(version="1", **common)
        second = serve_rollout(version="2", **common)
        assert (first.outcome, second.outcome) == ("first_rollout", "promoted")
        # What the route serves is what the registered version does, observation by observation.
        observations = np.random.default_rng(0).uniform(
            [-2.4, -2, -0.2, -2], [2.4, 2, 0.2, 2], (64, 4)
        )
        observations = observations.astype("float32")
        registered = mlflow.pyfunc.load_model(f"models:/{name}/2")
        expected = np.asarray(registered.predict(observations)).tolist()
        assert set(expected) == {0, 1}  # both actions occur, so the comparison can fail
        request = urllib.request.Request(
            f"http://127.0.0.1:{stack.serve_port}/{route}",
            data=json.dumps({"observations": observations.tolist()}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["X-Model-Version"] == "2"
            assert json.load(response)["actions"] == expected
        assert registry.resolve_alias(client, name, registry.LIVE).version == "2"
    finally:
        cluster = stack.ray_cluster()
        with cluster.connect():
            serve_control.start(cluster.serve_host, cluster.serve_port)
            serve_control.delete_route(route, name)
        client.delete_registered_model(name)
