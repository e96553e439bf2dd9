"""Session-wide real services: one Ray head (`ray start --head`), one MLflow server and one
Prefect server, started through deployments.local on free ports with their own temp dirs,
and stopped by pid after the session.

Only tests that need them start them: a test whose fixtures reach `stack` is marked
`services` at collection, so `pytest -m "not services"` runs the pure tests in seconds."""

from __future__ import annotations

import functools
import os
import shutil
import uuid
from pathlib import Path

import pytest

from deployments import local
from deployments.testing.stack import Stack, environ, pointed_at, temporary_stack
from prefect_ray_lifecycle.workloads.constants import llm_python
from prefect_ray_lifecycle.workloads.rl.rllib import module_path

# Logical CPUs of the shared test head: trials and tasks are tiny, so the 2-core CI machine
# is oversubscribed on purpose rather than queueing every test behind one another.
RAY_HEAD_CPUS = 4
# Set by `make test` (and so CI): a missing LLM venv fails the LLM tests instead of skipping.
REQUIRE_LLM_ENV = "RLT_REQUIRE_LLM"
SERVICE_FIXTURES = {"stack", "prefect_api"}
# The session's id, set by the controller and inherited by pytest-xdist's workers: each
# worker's stack is marked with it, so that the services of a worker that died (a hung test
# past faulthandler_timeout, see pyproject.toml) are stopped when the session ends.
SESSION_ENV = "RLT_TEST_SESSION"
SESSION_MARK = "pytest-session"


# Seconds of one worker each group took in a full `make test` here (2026-12-05, 2 workers,
# 2 cores; junit times, setup and teardown included). Groups are handed out longest first, so
# that the last to start are short and both workers end together: xdist's own order (by number
# of tests) left the 2-test recovery and stack-restart modules for last, and one worker ran
# alone for its last 260 s. A group not listed counts as DEFAULT_GROUP_S; stale figures cost
# balance only.
GROUP_S = {
    "llm": 680,  # the vLLM modules and the fine-tune, one after another
    "test_rollout": 431,
    "test_approval": 322,
    "test_recovery": 298,
    "test_outages": 260,  # 378 with Prefect down 3 minutes, 75 s now (2026-12-05)
    "test_stack_restart": 255,
    "test_shadow_sticky": 213,
    "test_ray_client": 159,
    "test_pipeline_deployment": 153,
    "test_tune_sweep": 134,
    "test_multinode": 108,
    "test_ray_connection": 83,
    "test_old_layout": 83,
    "test_register": 67,
    "test_data_prep": 59,
    "test_webhooks": 51,
    "test_http_contract": 44,
    "test_user_project": 42,
    "test_local_services": 34,
    "test_ray_runner_worker_caches": 27,
}
DEFAULT_GROUP_S = 20


# Modules that share the "llm" group's worker, one after another: side by side on the two
# workers, the fine-tune's setup took 274 s instead of 178 s and the LLM rollout 161 s
# instead of 85 s (both CPU-heavy on 2 cores).
HEAVY_WITH_LLM = {"test_llm_finetune"}


def _group(item) -> str:
    module = item.module.__name__.rpartition(".")[2]
    return "llm" if item.get_closest_marker("llm") or module in HEAVY_WITH_LLM else module


def _is_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ  # set before a worker loads this file


def pytest_configure(config):
    if not _is_worker():
        os.environ[SESSION_ENV] = uuid.uuid4().hex  # a pytest run inside a test: its own
    # Groups in the order of the collection (sorted below), not by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVICE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.services)
        # Under `pytest -n N --dist loadgroup` (make test) a module runs whole on one worker,
        # which has its own services; the vLLM modules share one worker, so that no two vLLM
        # engines load at once.
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    # Longest groups first; within a group, the order of the files (a stable sort).
    items.sort(key=lambda item: -GROUP_S.get(_group(item), DEFAULT_GROUP_S))


def pytest_collection_finish(session):
    """Under `--dist loadgroup` pytest-xdist groups a worker's items by an `@group` suffix it
    adds to their ids; without it every test is its own group, and both workers set up every
    module's fixtures (pytest 9.2 with xdist 3.8 did that silently). Fail instead."""
    if not getattr(session.config.option, "loadgroup", False) or not session.items:
        return
    ungrouped = [item.nodeid for item in session.items if "@" not in item.nodeid]
    if ungrouped:
        raise pytest.UsageError(
            f"pytest-xdist does not see the test groups ({ungrouped[0]} has no @group): "
            "modules would be split across workers; see the pytest pin in pyproject.toml"
        )


@functools.cache
def _gpu_missing() -> str | None:
    """Why this process has no GPU for the `gpu` tests, or None when torch sees one."""
    import torch

    if torch.cuda.is_available():
        return None
    return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """GPU tests need a GPU: skipped, by name, where torch sees none (before their fixtures
    start any service). LLM tests need the vLLM venv: skipped without it, failed without it
    under make test."""
    if item.get_closest_marker("gpu") is not None and (missing := _gpu_missing()):
        pytest.skip(f"{item.nodeid} needs a GPU: {missing}")
    if item.get_closest_marker("llm") is None or Path(llm_python()).exists():
        return
    message = f"no LLM venv at {llm_python()} (`make llm-venv` builds it)"
    if os.environ.get(REQUIRE_LLM_ENV):
        pytest.fail(f"{message}; {REQUIRE_LLM_ENV} is set, so this is a failure", pytrace=False)
    pytest.skip(f"{message}; set {REQUIRE_LLM_ENV}=1 to fail instead")


def _stop_stacks_left_behind() -> None:
    """Stop the services of the session's stacks that their worker did not stop (it died)."""
    session = os.environ.get(SESSION_ENV)
    if _is_worker() or not session:
        return
    for mark in Path("/tmp").glob(f"rlt-*/{SESSION_MARK}"):
        if mark.read_text() == session:
            stopped = local.stop_recorded(mark.parent)
            print(f"\nservices a dead test worker left in {mark.parent}: {'; '.join(stopped)}")
            shutil.rmtree(mark.parent, ignore_errors=True)


# The session's stack in this process, once a test has asked for it (see no_leftover_groups).
_STACKS: list[Stack] = []


@pytest.fixture(scope="session")
def stack() -> Stack:
    """The services, with this process (and the subprocesses tests start) pointed at them."""
    with temporary_stack(RAY_HEAD_CPUS) as services, pointed_at(services):
        (services.state_dir / SESSION_MARK).write_text(os.environ.get(SESSION_ENV, ""))
        _STACKS.append(services)
        try:
            yield services
        finally:
            _STACKS.remove(services)


@pytest.fixture(scope="session")
def prefect_api(stack: Stack) -> Stack:
    return stack


@pytest.fixture(scope="session", autouse=True)
def no_temporary_prefect_server():
    """Outside the services there is no Prefect API: a flow run or Prefect client that does
    not ask for them fails at once instead of starting Prefect's temporary server in this
    process (20 s, and a stray server to stop at exit). It holds in this thread and in the
    others (they read Prefect's global settings, rebuilt here from the environment);
    subprocesses are not bound."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings

    with environ({PREFECT_SERVER_EPHEMERAL_ENABLED.name: "false"}):
        refresh_global_settings_context()
    try:
        with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_ENABLED: False}):
            yield
    finally:
        refresh_global_settings_context()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Keep faulthandler on once pytest turns its own off, through interpreter exit: a crash
    after the summary (Ray or Serve threads outliving the session) then prints every thread's
    stack instead of a bare exit code 139. Then stop what a dead worker left running."""
    import atexit
    import faulthandler

    atexit.register(faulthandler.enable, all_threads=True)
    _stop_stacks_left_behind()


@pytest.fixture(scope="module", autouse=True)
def no_leftover_placement_groups():
    """A module must leave no placement group on the session's head: one left behind holds its
    CPUs for good, and a later module whose tasks need every CPU waits until its timeout (a
    0.75-CPU Train worker's group did that to test_ray_runner_retries in a full run). Found
    ones are removed, so the next module runs, and fail this module's teardown by name."""
    yield
    if not _STACKS:
        return
    from deployments.testing.groups import remove_leftover_groups

    if leftovers := remove_leftover_groups(_STACKS[0]):
        pytest.fail(f"the module left placement groups on the head: {leftovers}")


@pytest.fixture(scope="module", autouse=True)
def no_stray_ray():
    """A module must leave this process without a Ray connection: one left behind (or one
    that Ray started on its own) would quietly become the next module's cluster."""
    yield
    import ray

    from prefect_ray_lifecycle.control.ray_shutdown import wait_for_shutdown

    wait_for_shutdown()  # a data-prep flow's Ray stops in the background
    if ray.is_initialized():
        ray.shutdown()
        pytest.fail("the module left a Ray connection (or Ray auto-started one) behind")


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
    import fcntl

    # Trained once per session: under xdist the workers share their session's temp dir, and
    # the first to get here trains while the others wait for its files (same seed, same
    # policy; the files are only read afterwards).
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    root = shared / "checkpoints"
    with open(shared / "checkpoints.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "trained").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            _train_checkpoints(stack, root)
            (root / "trained").touch()
    return {"good": str(root / "good"), "bad": str(root / "bad")}


def _train_checkpoints(stack, root: Path) -> None:
    import torch
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.rl_module import RLModule

    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=0)
        .training(train_batch_size_per_learner=1000, minibatch_size=128, num_epochs=6, lr=1e-3)
        .debugging(seed=0)
    )
    from prefect_ray_lifecycle.workloads.torch_threads import torch_threads

    # No env runners: the learner trains in this process, on one torch thread (see
    # torch_threads: two threads on a busy machine made it many times slower).
    with stack.ray_cluster().connect(), torch_threads(1):
        algo = config.build_algo()
        try:
            for _ in range(8):
                algo.train()
            good = algo.save(str(root / "good")).checkpoint.path
        finally:
            algo.stop()
    assert Path(good) == root / "good", good
    bad = shutil.copytree(good, root / "bad")
    module = RLModule.from_checkpoint(module_path(bad))
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "pi" in name:
                parameter.zero_()
                if name.endswith("bias"):
                    parameter[0] = 10.0
    module.save_to_path(module_path(bad))


@pytest.fixture(scope="module")
def core():
    """An untrained CartPole PPO module behind the policy contract (what a version serves),
    in this process: no services."""
    import gymnasium as gym
    from ray.rllib.algorithms.ppo import PPOConfig

    from prefect_ray_lifecycle.workloads.serve.policy import ModelSpec, PolicyCore

    env = gym.make("CartPole-v1")
    spec = PPOConfig().environment("CartPole-v1").get_rl_module_spec(env=env)
    spec.observation_space, spec.action_space = env.observation_space, env.action_space
    return PolicyCore(ModelSpec("untrained", "1", "http://127.0.0.1:1"), module=spec.build())
