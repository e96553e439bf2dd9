"""register_and_promote against a real MLflow server, with real RLlib checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest
import requests
from chart_checks import synthetic_chart
from mlflow import MlflowClient
from pydantic import ValidationError

from deployments import local, ports
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry
from prefect_ray_lifecycle.flows.register import RegistrationRequest, register_and_promote
from prefect_ray_lifecycle.workloads.rl.rllib import module_path

EPISODES = 5


def request(model: str, checkpoint: str, trial: str, **fields) -> RegistrationRequest:
    return RegistrationRequest(
        model_name=model,
        checkpoint=checkpoint,
        experiment_path="/tmp/experiments/sweep-a",
        trial_id=trial,
        evaluation_episodes=EPISODES,
        best_config={"lr": 1e-3},
        metrics={"episode_return_mean": 100.0},
        trials=[{"trial_id": trial}],
        **fields,
    )


@pytest.fixture
def model_name() -> str:
    return f"policy-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def server(stack) -> MLflowServer:
    return MLflowServer(tracking_uri=stack.mlflow_uri)


def versions(client: MlflowClient, name: str) -> list:
    return client.search_model_versions(f"name = '{name}'")


def flow_artifacts(prefect_client, flow_run_id) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter

    return {
        a.key: a
        for a in prefect_client.read_artifacts(
            flow_run_filter=FlowRunFilter(id={"any_": [str(flow_run_id)]})
        )
    }


def warnings_of(prefect_client, flow_run_id, text: str, timeout: float = 15.0) -> list[str]:
    """The flow run's warning lines that contain `text` (log lines land a moment later)."""
    import logging

    from prefect.client.schemas.filters import LogFilter

    deadline = time.monotonic() + timeout
    while True:
        found = [
            log.message
            for log in prefect_client.read_logs(
                log_filter=LogFilter(flow_run_id={"any_": [flow_run_id]}), limit=200
            )
            if log.level == logging.WARNING and text in log.message
        ]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_registering_the_same_trial_twice_gives_one_version(
    checkpoints, server, model_name, stack, prefect_client, tmp_path
):
    chart = synthetic_chart(tmp_path / "sweep.png")
    states = [
        register_and_promote(
            request(model_name, checkpoints["good"], "t1", sweep_chart=str(chart)),
            server,
            return_state=True,
        )
        for _ in range(2)
    ]
    first, second = (state.result() for state in states)

    assert (first.created, second.created) == (True, False)
    assert first.version == second.version == "1"
    client = MlflowClient(stack.mlflow_uri)
    (version,) = versions(client, model_name)
    tags = version.tags
    assert tags["lifecycle.tune.trial_id"] == "t1"
    assert tags["lifecycle.tune.experiment_path"] == "/tmp/experiments/sweep-a"
    assert len(tags["lifecycle.git_commit"]) == 40
    assert json.loads(tags["lifecycle.eval.protocol"])["episodes"] == EPISODES
    assert tags["lifecycle.prefect.flow_run_url"].startswith("http://127.0.0.1:")
    assert "\n" not in version.description and "t1" in version.description
    run = client.get_run(version.run_id)
    assert run.data.tags["lifecycle.prefect.flow_run_id"] == tags["lifecycle.prefect.flow_run_id"]
    assert "eval_mean_return" in run.data.metrics and run.data.params["lr"] == "0.001"
    assert {a.path for a in client.list_artifacts(version.run_id)} >= {
        "trials.json",
        "evaluation.json",
    }

    # The sweep's chart, on the version's run as it was drawn, and on both flow runs (the
    # second found the version, and its run, already registered) as an image MLflow serves.
    assert [a.path for a in client.list_artifacts(version.run_id, "charts")] == ["charts/sweep.png"]
    for state in states:
        artifacts = flow_artifacts(prefect_client, state.state_details.flow_run_id)
        image = artifacts[f"sweep-chart-{model_name}"]
        assert image.type == "image"
        assert version.run_id in image.data and "charts%2Fsweep.png" in image.data
        response = requests.get(image.data, timeout=10)
        assert response.status_code == 200 and response.content == chart.read_bytes()
        assert image.data in artifacts["registration"].data

    # A chart that is missing or not a PNG is a warning; the registration goes on without it.
    not_png = tmp_path / "chart.png"
    not_png.write_text("not an image")
    for path, why in [(tmp_path / "missing.png", "No such file"), (not_png, "is not a PNG")]:
        state = register_and_promote(
            request(model_name, checkpoints["good"], "t1", sweep_chart=str(path)),
            server,
            return_state=True,
        )
        assert state.is_completed() and state.result().version == "1"
        flow_run_id = state.state_details.flow_run_id
        (warning,) = warnings_of(prefect_client, flow_run_id, "could not publish the chart")
        assert why in warning
        artifacts = flow_artifacts(prefect_client, flow_run_id)
        assert f"sweep-chart-{model_name}" not in artifacts
        assert "Sweep chart" not in artifacts["registration"].data
    response = requests.get(image.data, timeout=10)
    assert response.content == chart.read_bytes()  # the version's chart is still the sweep's


def test_promotion_rejection_and_alias_history(checkpoints, server, model_name, stack):
    client = MlflowClient(stack.mlflow_uri)
    first = register_and_promote(request(model_name, checkpoints["bad"], "t1"), server)
    assert first.promoted and "no champion" in first.reason

    better = register_and_promote(request(model_name, checkpoints["good"], "t2"), server)
    assert better.promoted, better.reason
    assert client.get_model_version_by_alias(model_name, "champion").version == "2"
    assert registry.resolve_alias(client, model_name, "challenger") is None
    assert client.get_model_version(model_name, "2").tags["lifecycle.previous_champion"] == "1"

    worse = register_and_promote(request(model_name, checkpoints["bad"], "t3"), server)
    assert not worse.promoted
    rejected = client.get_model_version(model_name, "3").tags
    assert rejected["lifecycle.promotion.verdict"] == "rejected"
    assert rejected["lifecycle.promotion.champion_version"] == "2"
    assert float(rejected["lifecycle.promotion.challenger_mean_return"]) < float(
        rejected["lifecycle.promotion.champion_mean_return"]
    )
    assert "not better" in rejected["lifecycle.promotion.reason"]
    assert client.get_model_version_by_alias(model_name, "champion").version == "2"
    # The rejected version stays the challenger, for a person to inspect or promote.
    assert registry.resolve_alias(client, model_name, "challenger").version == "3"

    # A person moves champion back to v1; a later better trial is promoted over it.
    registry.move_alias(client, model_name, "champion", "1", reason="manual", actor="a person")
    again = register_and_promote(request(model_name, checkpoints["good"], "t4"), server)
    assert again.promoted and again.version == "4"

    history = registry.alias_history(client, model_name, "champion")
    assert [(h["version"], h["previous"]) for h in history] == [
        ("1", None),
        ("2", "1"),
        ("1", "2"),
        ("4", "1"),
    ]


def test_champion_loads_in_a_fresh_process_without_ray_and_acts_like_its_module(
    checkpoints, server, model_name, stack, tmp_path
):
    """README: `models:/NAME@champion` gives greedy actions in any process, without Ray."""
    import numpy as np
    import torch
    from ray.rllib.core.columns import Columns
    from ray.rllib.core.rl_module.rl_module import RLModule

    register_and_promote(request(model_name, checkpoints["good"], "t1"), server)
    rng = np.random.default_rng(0)
    observations = rng.uniform([-2.4, -2, -0.2, -2], [2.4, 2, 0.2, 2], (64, 4)).astype("float32")
    module = RLModule.from_checkpoint(module_path(checkpoints["good"]))
    with torch.no_grad():
        logits = module.forward_inference({Columns.OBS: torch.from_numpy(observations)})
    greedy = logits[Columns.ACTION_DIST_INPUTS].argmax(-1).tolist()
    assert set(greedy) == {0, 1}  # both actions occur, so the comparison can fail

    script = (
        "import json, sys, numpy as np, mlflow, ray\n"
        f"model = mlflow.pyfunc.load_model('models:/{model_name}@champion')\n"
        "actions = model.predict(np.asarray(json.load(sys.stdin), dtype='float32'))\n"
        "assert not ray.is_initialized(), 'loading or predicting started Ray'\n"
        "print(json.dumps(np.asarray(actions).tolist()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(observations.tolist()),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == greedy


def test_a_replica_loads_its_version_from_mlflow_and_leaves_no_copy_behind(
    checkpoints, server, model_name, stack, tmp_path, monkeypatch
):
    """What each policy replica does at start (and the router, hosting the version): download
    the version from MLflow, load it, act. The download goes once loaded: every replica start
    used to leave its copy in the temp folder."""
    import tempfile

    import numpy as np

    from prefect_ray_lifecycle.workloads.rl.rllib import load_policy
    from prefect_ray_lifecycle.workloads.serve.policy import ModelSpec, PolicyCore

    register_and_promote(request(model_name, checkpoints["good"], "t1"), server)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    core = PolicyCore(ModelSpec(model_name, "1", stack.mlflow_uri))
    assert list(temp.iterdir()) == []
    observations = (
        np.random.default_rng(0)
        .uniform([-2.4, -2, -0.2, -2], [2.4, 2, 0.2, 2], (64, 4))
        .astype("float32")
    )
    expected = PolicyCore(core.spec, module=load_policy(checkpoints["good"])).act(observations)
    assert set(expected.tolist()) == {0, 1}  # both actions occur, so the comparison can fail
    assert core.act(observations).tolist() == expected.tolist()


def test_bad_inputs_register_nothing(checkpoints, server, model_name, stack, tmp_path):
    corrupt = shutil.copytree(checkpoints["good"], tmp_path / "corrupt")
    (module_path(corrupt) / "module_state.pkl").write_bytes(b"not a pickle")
    cases = [
        (request(model_name, str(corrupt), "t1"), "does not load"),
        (request(model_name, str(tmp_path / "missing"), "t1"), "does not exist"),
    ]
    for bad_request, message in cases:
        state = register_and_promote(bad_request, server, return_state=True)
        assert state.is_failed()
        with pytest.raises(Exception, match=message):
            state.result()
    with pytest.raises(ValidationError, match="'bad name!' is not a valid registered model"):
        request("bad name!", checkpoints["good"], "t1")
    client = MlflowClient(stack.mlflow_uri)
    assert versions(client, model_name) == []
    with pytest.raises(Exception, match="not exist|RESOURCE_DOES_NOT_EXIST"):
        client.get_registered_model(model_name)

    state = register_and_promote(
        request(model_name, checkpoints["good"], "t1"),
        server,
        create_model=False,
        return_state=True,
    )
    assert state.is_failed() and versions(client, model_name) == []


def test_an_mlflow_outage_during_registration_is_retried_to_exactly_one_version(
    checkpoints, model_name, prefect_client, task_runs, tmp_path
):
    """A server of its own, down when the flow starts and brought back only once Prefect
    has recorded an attempt that failed on the connection and waits to retry."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    (port,) = ports.free_ports(1)
    (service,) = local.services(tmp_path / "mlflow-outage", {"mlflow": port}, ("mlflow",))
    local.start(service)
    run_name = f"outage-{model_name}"
    outcome: list = []
    try:
        server = MLflowServer(tracking_uri=service.url, request_retries=0)
        # Make sure the model exists, then take the server down before the flow talks to it.
        MlflowClient(service.url).create_registered_model(model_name)
        local.stop(service)
        flow = register_and_promote.with_options(flow_run_name=run_name)
        thread = threading.Thread(
            target=lambda: outcome.append(
                flow(
                    request(model_name, checkpoints["good"], "t1"),
                    server,
                    create_model=False,
                    return_state=True,
                )
            ),
            daemon=True,
        )
        thread.start()

        def waiting_retry():
            flow_runs = prefect_client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name]))
            )
            for flow_run in flow_runs:
                for task_run in task_runs(flow_run.id):
                    states = prefect_client.read_task_run_states(task_run.id)
                    if any(state.name == "AwaitingRetry" for state in states):
                        return task_run
            return None

        deadline = time.monotonic() + 180  # the evaluation comes first
        while (retrying := waiting_retry()) is None:
            assert thread.is_alive() and time.monotonic() < deadline, "no attempt failed"
            time.sleep(0.5)
        with pytest.raises(requests.ConnectionError):  # the outage the attempt met
            requests.get(service.url, timeout=5)
        local.start(service)
        thread.join(timeout=120)

        (state,) = outcome
        result = state.result()
        assert result.created and result.version == "1"
        assert len(versions(MlflowClient(service.url), model_name)) == 1
        runs = task_runs(
            state.state_details.flow_run_id,
            lambda runs: any(t.id == retrying.id and t.state.is_completed() for t in runs),
        )
        (recovered,) = [t for t in runs if t.id == retrying.id]
        assert recovered.state.is_completed() and recovered.run_count > 1
    finally:
        local.stop(service)


def test_a_new_verdict_replaces_the_old_one_whole(stack, model_name):
    """A version rejected at a stage and promoted later shows the promotion, not the old
    stage; tags that are not verdicts (lineage) still add up."""
    client = MlflowClient(stack.mlflow_uri)
    run = client.create_run(client.create_experiment(f"verdicts-{model_name}"))
    client.create_registered_model(model_name)
    version = client.create_model_version(
        model_name, f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    ).version
    registry.tag_verdict(
        client, model_name, version, "rollout", {"verdict": "rejected", "stage": "canary"}
    )
    registry.tag_verdict(client, model_name, version, "rollout", {"verdict": "promoted"})
    registry.tag_verdict(client, model_name, version, "tune", {"flow_run_id": "a"})
    registry.tag_verdict(client, model_name, version, "tune", {"trial_id": "b"})
    tags = client.get_model_version(model_name, version).tags
    rollout = {k: v for k, v in tags.items() if k.startswith(f"{registry.TAG}.rollout.")}
    assert set(rollout) == {f"{registry.TAG}.rollout.verdict", f"{registry.TAG}.rollout.at"}
    assert rollout[f"{registry.TAG}.rollout.verdict"] == "promoted"
    assert tags[f"{registry.TAG}.tune.flow_run_id"] == "a"
    assert tags[f"{registry.TAG}.tune.trial_id"] == "b"
