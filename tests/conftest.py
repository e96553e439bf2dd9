"""Session-wide real services: one Ray head (`ray start --head`), one MLflow server and one
Prefect server, started through deployments.local on free ports with their own temp dirs,
and stopped by pid after the session."""

from __future__ import annotations

import os
import shutil

import pytest

from deployments.stack import Stack, temporary_stack
from workloads.rllib import module_path

# Logical CPUs of the shared test head: trials and tasks are tiny, so the 2-core CI machine
# is oversubscribed on purpose rather than queueing every test behind one another.
RAY_HEAD_CPUS = 4


@pytest.fixture(scope="session")
def stack() -> Stack:
    with temporary_stack(RAY_HEAD_CPUS) as services:
        yield services


@pytest.fixture(scope="module", autouse=True)
def no_stray_ray():
    """A module must leave this process without a Ray connection: one left behind (or one
    that Ray started on its own) would quietly become the next module's cluster."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
        pytest.fail("the module left a Ray connection (or Ray auto-started one) behind")


@pytest.fixture(scope="session", autouse=True)
def prefect_api(stack: Stack):
    """Point this process (and the subprocesses tests start) at the session's servers."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    overrides = {
        "PREFECT_API_URL": stack.prefect_api_url,
        "MLFLOW_TRACKING_URI": stack.mlflow_uri,
        # Ray's token for every driver and embedded Ray of the session, kept out of ~/.ray.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(stack.state_dir / "ray_auth_token"),
    }
    saved = {k: os.environ.get(k) for k in (*overrides, "RAY_AUTH_TOKEN")}
    os.environ.update(overrides)
    with temporary_settings(updates={PREFECT_API_URL: stack.prefect_api_url}):
        yield stack
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def prefect_client(stack: Stack):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        yield client


@pytest.fixture(scope="session")
def task_runs(prefect_client):
    """Read a flow run's task runs, polling briefly until `ready(runs)` holds: Prefect records
    task runs from events, so the last states land a moment after the flow returns."""
    import time

    from prefect.client.schemas.filters import FlowRunFilter

    def read(flow_run_id, ready=lambda runs: True, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while True:
            runs = prefect_client.read_task_runs(
                flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]})
            )
            if ready(runs) or time.monotonic() > deadline:
                return runs
            time.sleep(0.5)

    return read


@pytest.fixture(scope="session")
def checkpoints(stack, tmp_path_factory):
    """A PPO policy trained a little on CartPole ('good'), and the same policy with its action
    head forced to always push left ('bad', return about 9)."""
    import torch
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.rl_module import RLModule

    root = tmp_path_factory.mktemp("checkpoints")
    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=0)
        .training(train_batch_size_per_learner=1000, minibatch_size=128, num_epochs=6, lr=1e-3)
        .debugging(seed=0)
    )
    with stack.ray_cluster().connect():
        algo = config.build_algo()
        try:
            for _ in range(8):
                algo.train()
            good = algo.save(str(root / "good")).checkpoint.path
        finally:
            algo.stop()
    bad = shutil.copytree(good, root / "bad")
    module = RLModule.from_checkpoint(module_path(bad))
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "pi" in name:
                parameter.zero_()
                if name.endswith("bias"):
                    parameter[0] = 10.0
    module.save_to_path(module_path(bad))
    return {"good": str(good), "bad": str(bad)}
