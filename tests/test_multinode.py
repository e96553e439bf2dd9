"""Past one machine: a real second Ray node beside the session's head (tests/multinode.py).

User code reaches the trials on the second node through the RayCluster block's runtime_env, not
through the driver's cwd; the sweep's storage is a URI every node writes; a checkpoint written
on the second node registers in MLflow; losing the node mid-sweep retries its trials on the
head."""

from __future__ import annotations

import contextvars
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pydantic import ValidationError

from deployments import processes
from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster
from prefect_ray_lifecycle.flows.register import RegistrationRequest, register_and_promote
from prefect_ray_lifecycle.flows.tune_sweep import tune_sweep
from prefect_ray_lifecycle.tasks.register import EvaluationSummary
from prefect_ray_lifecycle.tasks.tune.config import SweepConfig
from tests import multinode
from tests.multinode import WORKER_RESOURCE

# A user's own env module: each env it builds leaves a marker naming the process that built it
# (a trial's actor; a Ray worker's parent is its node's raylet) and the module's own file.
USER_ENVS = """
import json, os, time, uuid
from pathlib import Path

import gymnasium as gym


def make_env(env_config):
    marker = Path(env_config["marker_dir"]) / f"{uuid.uuid4().hex}.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    made = {"pid": os.getpid(), "ppid": os.getppid(), "module": __file__, "at": time.time()}
    marker.write_text(json.dumps(made))
    return gym.make("CartPole-v1")
"""
TINY = {
    "hyperparameters": {"train_batch_size_per_learner": 256, "minibatch_size": 64, "num_epochs": 2},
    "scheduler": {"kind": "fifo"},
    "stop": {"training_iterations": 2, "env_steps": None, "episode_return": None},
    "search_space": {"lr": {"grid": [1e-4, 1e-3]}},
    "num_samples": 1,
}


def test_the_block_refuses_a_working_dir_that_is_not_there_and_merges_excludes(tmp_path):
    with pytest.raises(ValidationError, match=r"runtime_env.working_dir '.*missing' is neither"):
        RayCluster(runtime_env={"working_dir": str(tmp_path / "missing")})
    shipped = RayCluster(
        runtime_env={"working_dir": str(tmp_path), "excludes": ["*.ckpt"]}
    ).project_runtime_env()
    assert shipped["working_dir"] == str(tmp_path)
    assert shipped["excludes"] == ["__pycache__", "*.pyc", "*.ckpt"]


@pytest.fixture(scope="module")
def second_node(stack):
    """Module-scoped: the last test kills it; the next module that asks gets a fresh one."""
    with multinode.second_node(stack) as node:
        yield node


@pytest.fixture
def user_project(tmp_path, monkeypatch) -> Path:
    """The user's folder outside the checkout, importable in the flow process (evaluation and
    registration build the env there) from a driver whose cwd is somewhere else."""
    folder = tmp_path / "user_project"
    folder.mkdir()
    (folder / "my_envs.py").write_text(USER_ENVS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.syspath_prepend(str(folder))
    return folder


def markers(folder: Path) -> list[dict]:
    found = []
    for path in folder.glob("*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being written
    return sorted(found, key=lambda m: m["at"])


def test_user_code_reaches_trials_on_the_second_node_and_their_checkpoint_registers(
    stack, second_node, user_project, tmp_path
):
    made = tmp_path / "made"
    sweep = SweepConfig(
        **TINY,
        environment="my_envs:make_env",
        env_config={"marker_dir": str(made)},
        resources={"custom": {WORKER_RESOURCE: 1}},
    )
    storage = f"file://{tmp_path / 'shared'}"

    # Importable here, but not shipped: preflight names the module before anything runs.
    with pytest.raises(
        ValueError,
        match=r"preflight: on the Ray cluster, environment 'my_envs:make_env': module "
        r"'my_envs' is not importable .*runtime_env \(working_dir or py_modules\)",
    ):
        tune_sweep(sweep=sweep, ray_cluster=stack.ray_cluster(), storage_root=storage)
    assert not made.exists()  # refused before anything ran: the sweep never started

    result = tune_sweep(
        sweep=sweep,
        ray_cluster=stack.ray_cluster(runtime_env={"working_dir": str(user_project)}),
        storage_root=storage,
        evaluation_episodes=1,
    )
    assert {t.status for t in result.trials} == {"TERMINATED"}
    assert {t.iterations for t in result.trials} == {2}
    # Both trials built their envs on the second node, from the copy Ray shipped there.
    in_trials = [m for m in markers(made) if "runtime_resources" in m["module"]]
    assert len({m["pid"] for m in in_trials}) == 2
    assert {m["ppid"] for m in in_trials} == {second_node.raylet_pid()}
    assert all(Path(m["module"]).is_relative_to(second_node.temp_dir) for m in in_trials)
    # The storage URI holds the experiment and its checkpoints; the best one has a local path.
    flow_run_id = result.metrics["flow_run_id"]
    assert result.experiment_path == f"{storage}/{flow_run_id}/sweep"
    assert all(t.checkpoint.startswith(f"{result.experiment_path}/") for t in result.trials)
    assert Path(result.checkpoint_path).is_dir()

    registration = register_and_promote(
        RegistrationRequest(
            model_name=f"multinode-{flow_run_id[:8]}",
            checkpoint=result.checkpoint_path,
            experiment_path=result.experiment_path,
            trial_id=result.metrics["trial_id"],
            environment="my_envs:make_env",
            env_config={"marker_dir": str(made)},
            evaluation_episodes=result.evaluation.episodes,
            evaluation_seed=0,
            evaluation=EvaluationSummary(
                mean_return=result.evaluation.mean_return,
                std_return=result.evaluation.std_return,
                episodes=result.evaluation.episodes,
                seed=0,
            ),
        ),
        mlflow_server=MLflowServer(tracking_uri=stack.mlflow_uri),
    )
    assert registration.created and registration.promoted  # the model's first champion

    import mlflow
    import numpy as np

    from prefect_ray_lifecycle.workloads.rl import rllib

    # The champion acts as the trial's best checkpoint does, observation by observation.
    policy = mlflow.pyfunc.load_model(f"models:/{registration.model_name}@champion")
    observations = np.random.default_rng(0).uniform(-2, 2, (32, 4)).astype(np.float32)
    module = rllib.load_policy(result.checkpoint_path)
    greedy = [int(rllib.greedy_action(module, observation)) for observation in observations]
    assert np.asarray(policy.predict(observations)).tolist() == greedy


def test_a_node_lost_mid_sweep_has_its_trials_retried_on_the_head(
    stack, second_node, user_project, tmp_path, prefect_client
):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    made = tmp_path / "made"
    sweep = SweepConfig(
        **TINY,
        environment="my_envs:make_env",
        env_config={"marker_dir": str(made)},
        max_failures=1,
    )
    cluster = stack.ray_cluster(runtime_env={"working_dir": str(user_project)})
    node2 = second_node.raylet_pid()
    with cluster.connect(), ThreadPoolExecutor(1) as pool:
        # Hold the head's free CPUs so that both trials start on the second node.
        head = ray.get_runtime_context().get_node_id()
        free = ray.available_resources()["CPU"] - ray.cluster_resources()[WORKER_RESOURCE]
        holder = placement_group([{"CPU": free}], bundle_label_selector=[{"ray.io/node-id": head}])
        ray.get(holder.ready(), timeout=30)
        running = pool.submit(
            contextvars.copy_context().run,
            tune_sweep,
            sweep=sweep,
            ray_cluster=cluster,
            storage_root=str(tmp_path / "sweeps"),
            evaluation_episodes=1,
        )
        try:
            deadline = time.monotonic() + 120
            while len({m["pid"] for m in markers(made) if m["ppid"] == node2}) < 2:
                assert not running.done(), running.result()
                assert time.monotonic() < deadline, "the trials never started on the second node"
                time.sleep(0.2)
        finally:
            remove_placement_group(holder)
        os.kill(node2, signal.SIGKILL)  # the node is lost mid-sweep
        killed_at = time.time()
        result = running.result(timeout=240)

    assert {t.status for t in result.trials} == {"TERMINATED"}
    assert {t.iterations for t in result.trials} == {2}
    before = [m for m in markers(made) if m["at"] < killed_at]
    after = [
        m for m in markers(made) if m["at"] >= killed_at and "runtime_resources" in m["module"]
    ]
    assert {m["ppid"] for m in before if "runtime_resources" in m["module"]} == {node2}
    # Each trial still running at the kill runs again, in a new actor (under load one of the
    # two may have finished on the second node just before it).
    assert 1 <= len({m["pid"] for m in after}) <= 2
    assert all(m["ppid"] != node2 and processes.process_running(m["ppid"]) for m in after)
    run = prefect_client.read_flow_run(result.metrics["flow_run_id"])
    assert run.state.is_completed()


def test_a_node_lost_during_a_canary_is_caught_by_the_gates_and_no_user_sees_it(stack, checkpoints):
    """The candidate's replica runs on a second node that dies mid-canary: the router answers
    the requests it loses from live, the gates reject the candidate, live keeps serving."""
    from mlflow import MlflowClient

    from deployments.testing.load import LOAD_PAUSE_S, ClosedLoop
    from prefect_ray_lifecycle.control import registry, serve_control
    from prefect_ray_lifecycle.flows.rollout import RolloutFailed, serve_rollout
    from prefect_ray_lifecycle.tasks.rollout.config import Gates, Serving

    route, name = "multinode", f"lost-{os.getpid()}"
    client = MlflowClient(stack.mlflow_uri)
    for version in range(2):
        registry.register_checkpoint(
            client,
            name=name,
            checkpoint=checkpoints["good"],
            experiment_name="multinode",
            trial_key_value=f"{name}-{version}",
            observation_size=4,
        )
    # One router replica, on the head (with two nodes the default is two, spread over both):
    # this test loses the candidate's node, not a router (test_outages kills one).
    on_head = Serving(num_cpus=0.1, health_check_period_s=1, router_num_cpus=0.1, router_replicas=1)
    on_node = on_head.model_copy(update={"resources": {WORKER_RESOURCE: 1}})
    gates = Gates(
        stability_window_s=3,
        canary_steps=[0.5],
        canary_hold_s=30,
        max_error_rate=0.05,
        max_p99_ms=5000,
        p99_slack_ms=3000,
        request_timeout_s=4,
    )
    common = dict(
        model_name=name,
        route=route,
        gates=gates,
        ray_cluster=stack.ray_cluster(),
        mlflow_server=MLflowServer(tracking_uri=stack.mlflow_uri),
    )
    cluster = stack.ray_cluster()
    with cluster.connect(), ThreadPoolExecutor(1) as pool:
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            # The router and live run on the head; the node joins for the candidate only.
            serve_rollout(version="1", serving=on_head, **common)
            with (
                multinode.second_node(stack, "w3") as node,
                ClosedLoop(stack.serve_port, f"/{route}", pause_s=LOAD_PAUSE_S) as traffic,
            ):
                running = pool.submit(
                    contextvars.copy_context().run,
                    serve_rollout,
                    version="2",
                    serving=on_node,
                    **common,
                )
                deadline = time.monotonic() + 180
                while not any(a.version == "2" for a in traffic.answers):
                    assert not running.done(), running.result()
                    assert time.monotonic() < deadline, "the canary never served v2"
                    time.sleep(0.2)
                app = serve_control.version_app_name(name, "2")
                details = serve_control.details()["applications"][app]["deployments"]
                replicas = [r for d in details.values() for r in d["replicas"]]
                assert {r["node_id"] for r in replicas} == {node.node_id}
                os.kill(node.raylet_pid(), signal.SIGKILL)  # the candidate's node is lost
                with pytest.raises(RolloutFailed, match="canary"):
                    running.result(timeout=300)
                time.sleep(1)
            assert traffic.failed() == [], traffic.failed()[:3]
            lost = [a for a in traffic.answers if a.fallback_from == "2"]
            assert lost and {a.version for a in lost} == {"1"}
            assert traffic.answers[-1].version == "1"
            assert registry.resolve_alias(client, name, registry.LIVE).version == "1"
        finally:
            serve_control.delete_route(route, name)
