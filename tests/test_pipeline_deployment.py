"""What a user does: set the environment up, `prefect --no-prompt deploy --all`, start a real
`prefect worker` on the process pool, `prefect deployment run 'train-and-ship/...'` with a
small budget; then the run Completed, MLflow holds the version with its lineage, the route
serves it over HTTP, and Prefect recorded the assets from the experiment to the route."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)

from deployments import lineage as walkback
from deployments import setup
from deployments.testing.fast import FAST_SERVING
from deployments.testing.stack import environment as stack_environment
from deployments.testing.stack import undeploy
from deployments.testing.watch import deployment_runs, wait_for
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.tasks import lineage

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
ROUTE = "pipeline-test"  # tests/test_rollout.py owns policy-test
RUN_TIMEOUT_S = 300
OBSERVATION = [0.01, -0.02, 0.03, 0.04]
# One short trial: the test checks the wiring, not the policy's quality.
TINY_SWEEP = {
    "num_samples": 1,
    "search_space": {},
    "scheduler": {"kind": "fifo"},
    "hyperparameters": {
        "train_batch_size_per_learner": 500,
        "minibatch_size": 64,
        "num_epochs": 2,
        "lr": 5e-4,
    },
    "stop": {"training_iterations": 2, "env_steps": None, "episode_return": None},
}
FAST_GATES = {
    "health_timeout_s": 180,
    "stability_window_s": 3,
    "canary_steps": [0.3],
    "canary_hold_s": 3,
    "bake_s": 3,
    "bake_window_s": 2,
    "max_p99_ms": 5000,
    "p99_slack_ms": 3000,
}
SMALL_SERVING = FAST_SERVING

pytestmark = pytest.mark.slow


def cli(args: list[str], env: dict[str, str], timeout: float = 240) -> str:
    done = subprocess.run(
        [PREFECT, *args], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (
        f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def wait_final(client, flow_run_id: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        if time.monotonic() > deadline:
            pytest.fail(
                f"flow run {flow_run_id} still {run.state and run.state.name} after {timeout:.0f} s"
            )
        time.sleep(2)


def asset_event(client, key: str):
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    flt = EventFilter(
        event=EventNameFilter(name=["prefect.asset.materialization.succeeded"]),
        resource=EventResourceFilter(id=[key]),
    )
    deadline = time.monotonic() + 30
    while True:  # events reach the API asynchronously
        events = client.read_events(filter=flt, limit=10).events
        if events or time.monotonic() > deadline:
            assert events, f"no materialization of {key}"
            return events[0]
        time.sleep(0.5)


@pytest.fixture
def environment(stack):
    """The stack as a deployment environment: blocks, pool, limit (deployments.setup); a real
    worker process for the pool; and, at the end, the worker stopped by pid and every Serve
    app this test made deleted."""
    # With the registry's webhook: the champion move the pipeline makes also triggers a
    # reconcile, as on a user's stack, and the test checks that only one of them rolls out.
    env = stack_environment(stack, routes=(ROUTE,))
    model_name = f"shipped-{uuid.uuid4().hex[:6]}"
    try:
        yield env, model_name
    finally:
        setup.stop_worker(stack.state_dir)
        undeploy()
        cluster = stack.ray_cluster()
        with cluster.connect():
            serve_control.start(cluster.serve_host, cluster.serve_port)
            serve_control.delete_route(ROUTE, model_name)


def run_deployment(
    prefect_client,
    cli_env: dict,
    params: dict,
    state_dir: Path,
    name: str = "train-and-ship/train-and-ship",
    typed: tuple[str, ...] = (),
):
    """`prefect deployment run NAME --params JSON [--param k=v for k=v in typed]` (by default
    train-and-ship) and its final flow run, Completed."""
    typed_params = [arg for pair in typed for arg in ("--param", pair)]
    out = cli(
        ["deployment", "run", name, "--params", json.dumps(params), *typed_params],
        cli_env,
        timeout=120,
    )
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    run = wait_final(prefect_client, flow_run_id, RUN_TIMEOUT_S)
    assert run.state.is_completed(), (
        f"{run.state.name}: {run.state.message}; worker log: "
        f"{setup.worker_service(state_dir).log_file}"
    )
    return run


def subflows(prefect_client, run) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    children = prefect_client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])
        )
    )
    assert all(c.state.is_completed() for c in children)
    return {prefect_client.read_flow(c.flow_id).name: c for c in children}


def reconcile_run_for(prefect_client, model_name: str, timeout: float = 120):
    """The `reconcile` deployment's run for `model_name` (as its trigger starts it)."""

    def found():
        runs = deployment_runs(prefect_client, "reconcile/reconcile")
        return [run for run in runs if run.parameters.get("model_name") == model_name]

    (run,) = wait_for(f"the champion trigger's reconcile run for {model_name}", found, timeout, 1.0)
    return run


def rollout_runs(prefect_client, model_name: str) -> list:
    """Every `serve-rollout` flow run of `model_name`, whoever started it."""
    return [
        run
        for run in prefect_client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["serve-rollout"]))
        )
        if run.parameters.get("model_name") == model_name
    ]


def summary(prefect_client, run) -> str:
    """The run's own `train-and-ship` artifact."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    (artifact,) = prefect_client.read_artifacts(
        artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["train-and-ship"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]),
        )
    )
    return str(artifact.data)


def set_schedules(state: str, cli_env: dict, ray_address: str) -> None:
    """`python -m deployments.setup --schedules on|off` against the environment's Prefect API
    (with --ray-address, setup takes the environment's, not the local services')."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "deployments.setup",
            "--schedules",
            state,
            "--ray-address",
            ray_address,
        ],
        env=cli_env,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(f": {state}") == 2, done.stdout  # the nightly run and reconcile


def test_train_and_ship_deployments_ship_a_better_version_and_keep_live_otherwise(
    stack, environment, prefect_client, tmp_path
):
    env, model_name = environment
    timings = {}
    started = time.monotonic()
    assert any("serve-rollout-pipeline-test" in line for line in setup.prepare(env))
    assert setup.prepare(env) == setup.prepare(env)  # idempotent
    timings["setup"] = time.monotonic() - started

    cli_env = {**os.environ, **env.client_env}
    started = time.monotonic()
    out = cli(["--no-prompt", "deploy", "--all"], cli_env)
    timings["deploy"] = time.monotonic() - started
    for name in (
        "data-prep",
        "tune-sweep",
        "register-and-promote",
        "serve-rollout",
        "reconcile",
        "train-and-ship",
    ):
        assert f"/{name}'" in out, out[-2000:]

    # Schedules are defined but off after a deploy; setup turns them on, and off again here
    # (before the worker starts, so no scheduled run is picked up).
    scheduled = [
        prefect_client.read_deployment_by_name(f"{name}/{name}") for name in setup.SCHEDULED
    ]

    def active() -> list[bool]:
        return [s.active for d in scheduled for s in prefect_client.read_deployment_schedules(d.id)]

    assert active() and not any(active())
    set_schedules("on", cli_env, stack.ray_address)
    assert all(active())
    set_schedules("off", cli_env, stack.ray_address)
    assert not any(active())
    for stray in prefect_client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[d.id for d in scheduled])),
        flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["SCHEDULED"]))
        ),
    ):
        prefect_client.delete_flow_run(stray.id)

    started = time.monotonic()
    print(setup.start_worker(stack.state_dir, env.client_env, env.work_pool))
    timings["worker"] = time.monotonic() - started

    params = {
        "model_name": model_name,
        "route": ROUTE,
        "sweep": TINY_SWEEP,
        "evaluation_episodes": 2,
        "gates": FAST_GATES,
        "serving": SMALL_SERVING,
        "storage_root": str(stack.state_dir / "sweeps"),
    }
    started = time.monotonic()
    run = run_deployment(prefect_client, cli_env, params, stack.state_dir)
    flow_run_id = str(run.id)
    timings["run"] = time.monotonic() - started

    # Its subflows, each Completed, under this run.
    by_flow = subflows(prefect_client, run)
    assert set(by_flow) == {"tune-sweep", "register-and-promote", "serve-rollout"}

    # MLflow: version 1, champion and live, with lineage back to the runs and the sweep.
    client = MlflowClient(stack.mlflow_uri)
    version = client.get_model_version(model_name, "1")
    tags = version.tags
    tag = f"{registry.TAG}."
    assert tags[tag + "pipeline.flow_run_id"] == flow_run_id
    assert tags[tag + "prefect.flow_run_id"] == str(by_flow["register-and-promote"].id)
    assert tags[tag + "tune.flow_run_id"] == str(by_flow["tune-sweep"].id)
    assert str(by_flow["tune-sweep"].id) in tags[tag + "tune.experiment_path"]
    assert tags[tag + "tune.trial_id"]
    assert tags[tag + "rollout.verdict"] == "promoted"
    assert tags[tag + "rollout.route"] == ROUTE
    for alias in (registry.CHAMPION, registry.LIVE):
        assert registry.resolve_alias(client, model_name, alias).version == "1"
    # The sweep's chart, handed from the sweep to the registration, and the rollout's chart,
    # both on the version's MLflow run.
    logged = {f.path for f in client.list_artifacts(version.run_id, "charts")}
    assert logged == {"charts/sweep.png"}
    rollout_charts = [f.path for f in client.list_artifacts(version.run_id, "rollouts")]
    assert any(path.endswith(".png") for path in rollout_charts), rollout_charts

    # One rollout owner: the champion move also started a reconcile (the registry's webhook,
    # the `reconcile-on-champion-moved` trigger). The pipeline held the route from its
    # promotion to the end of its rollout, so that reconcile found the route in sync: it
    # rolled nothing out, and the run's summary names the rollout that did.
    triggered = wait_final(
        prefect_client, str(reconcile_run_for(prefect_client, model_name).id), 240
    )
    assert triggered.state.is_completed(), triggered.state
    assert subflows(prefect_client, triggered) == {}
    assert [r.id for r in rollout_runs(prefect_client, model_name)] == [by_flow["serve-rollout"].id]
    assert f"/runs/flow-run/{by_flow['serve-rollout'].id}" in summary(prefect_client, run)

    # The route serves that version over HTTP.
    route_url = f"http://127.0.0.1:{stack.serve_port}/{ROUTE}"
    answer = walkback.ask(route_url, OBSERVATION)
    assert (answer["status"], answer["version"]) == (200, "1"), answer
    assert answer["answer"]["action"] in (0, 1) and answer["answer"]["model_version"] == "1"

    # The walk from that answer back to the runs that made it, as a user runs it.
    walk = subprocess.run(
        [
            sys.executable,
            "-m",
            "deployments.lineage",
            "--url",
            route_url,
            "--model",
            model_name,
            "--mlflow-uri",
            stack.mlflow_uri,
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert walk.returncode == 0, walk.stderr[-3000:]
    walked = json.loads(walk.stdout)
    assert walked["served"]["version"] == "1"
    assert walked["pipeline_flow_run"].endswith(flow_run_id)
    assert walked["sweep_flow_run"].endswith(str(by_flow["tune-sweep"].id))
    assert walked["rollout"]["flow_run_id"] == str(by_flow["serve-rollout"].id)
    assert walked["mlflow_version"].endswith(f"/models/{model_name}/versions/1")

    # Prefect assets: route <- app <- model version <- experiment.
    cluster, server = stack.ray_cluster(), MLflowServer(tracking_uri=stack.mlflow_uri)
    app = serve_control.version_app_name(model_name, "1")
    chain = [
        lineage.serve_route_key(cluster, ROUTE),
        lineage.serve_app_key(cluster, app),
        lineage.model_version_key(server, model_name, "1"),
        lineage.experiment_key(tags[tag + "tune.experiment_path"]),
    ]
    for downstream, upstream in zip(chain, chain[1:], strict=False):
        event = asset_event(prefect_client, downstream)
        assert upstream in {r.id for r in event.related}, (downstream, event.related)
    assert f"{model_name} v1" in summary(prefect_client, run)

    # A second run, on a prepared dataset, whose version is not better than the champion
    # (by the margin): registered and the challenger, but live keeps serving version 1.
    source = tmp_path / "source"
    source.mkdir()
    (source / "part-0.csv").write_text(
        "id,x\n" + "".join(f"{i},{i % 7 / 7:.3f}\n" for i in range(40))
    )
    data = {"source": str(source), "output": str(tmp_path / "prepared"), "split_key": "id"}
    started = time.monotonic()
    one_iteration = {**TINY_SWEEP, "stop": {**TINY_SWEEP["stop"], "training_iterations": 1}}
    second_params = {**params, "sweep": one_iteration, "data": data, "margin": 1e6}
    second = run_deployment(prefect_client, cli_env, second_params, stack.state_dir)
    timings["second run"] = time.monotonic() - started
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})
    by_flow = subflows(prefect_client, second)
    assert set(by_flow) == {"data-prep", "tune-sweep", "register-and-promote"}
    tags = client.get_model_version(model_name, "2").tags
    assert tags[tag + "promotion.verdict"] == "rejected"
    assert len(tags[tag + "dataset.fingerprint"]) >= 16
    assert registry.resolve_alias(client, model_name, registry.CHALLENGER).version == "2"
    for alias in (registry.CHAMPION, registry.LIVE):
        assert registry.resolve_alias(client, model_name, alias).version == "1"
    assert walkback.ask(route_url, OBSERVATION)["version"] == "1"
    assert "v1 keeps serving" in summary(prefect_client, second)
    # The sweep's experiment depends on the prepared dataset.
    event = asset_event(prefect_client, lineage.experiment_key(tags[tag + "tune.experiment_path"]))
    prepared = (tmp_path / "prepared").resolve().as_posix()
    assert any(r.id.endswith(prepared) for r in event.related), event.related

    # Someone rolls v2 out by hand, typing the version as people do: the CLI sends the
    # number 2, and the rollout takes it as MLflow's "2".
    rollout_params = {
        "model_name": model_name,
        "route": ROUTE,
        "gates": FAST_GATES,
        "serving": SMALL_SERVING,
    }
    run_deployment(
        prefect_client,
        cli_env,
        rollout_params,
        state_dir=stack.state_dir,
        name="serve-rollout/serve-rollout",
        typed=("version=2",),
    )
    assert registry.resolve_alias(client, model_name, registry.LIVE).version == "2"
    assert walkback.ask(route_url, OBSERVATION)["version"] == "2"


def test_asset_keys_are_valid_and_name_their_objects():
    from prefect.assets import Asset

    from prefect_ray_lifecycle.blocks import RayCluster

    cluster = RayCluster(address="ray://10.0.0.5:10001")
    server = MLflowServer(tracking_uri="http://user@mlflow.internal:5000")
    keys = [
        lineage.experiment_key("/data/sweeps/run 1/sweep/"),
        lineage.experiment_key("s3://bucket/sweeps/abc/sweep"),
        lineage.model_version_key(server, "cartpole-ppo", "3"),
        lineage.serve_app_key(cluster, "cartpole-ppo-v3"),
        lineage.serve_route_key(cluster, "policy"),
    ]
    assert [Asset(key=k).key for k in keys] == [
        "file:///data/sweeps/run_1/sweep",
        "s3://bucket/sweeps/abc/sweep",
        "mlflow://mlflow.internal:5000/models/cartpole-ppo/versions/3",
        "rayserve://10.0.0.5:10001/apps/cartpole-ppo-v3",
        "rayserve://10.0.0.5:10001/routes/policy",
    ]
