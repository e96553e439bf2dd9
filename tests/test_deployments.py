"""Every prefect.yaml deployment loads: its entrypoint imports and its parameters validate;
blocks are named (deployments.setup fills them in); schedules are defined but off."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint

from deployments import setup

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())["deployments"]
# What a user fills in the run form for parameters a deployment cannot default.
USER_INPUT = {
    "data-prep": {
        "params": {"source": "/data/*.parquet", "output": "/prepared", "split_key": "id"}
    },
    "register-and-promote": {
        "request": {"checkpoint": "/ckpt", "experiment_path": "/exp", "trial_id": "t1"}
    },
}


def test_prefect_yaml_names_deployments():
    names = [d["name"] for d in DEPLOYMENTS]
    assert names and len(names) == len(set(names))


def block_refs(parameters: dict) -> dict[str, str]:
    """Parameters given as block references, by name: {parameter: "type-slug/name"}."""
    return {
        name: value["$ref"]["block_document_slug"]
        for name, value in parameters.items()
        if isinstance(value, dict) and "$ref" in value
    }


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_entrypoint_imports_and_parameters_validate(deployment, monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    flow = load_flow_from_entrypoint(deployment["entrypoint"])
    given = {**(deployment.get("parameters") or {}), **USER_INPUT.get(deployment["name"], {})}
    # Block references load at run time from the environment's API: checked by name here.
    refs = block_refs(given)
    for name, slug in refs.items():
        definition = flow.parameters.definitions[
            flow.parameters.properties[name]["anyOf"][0]["$ref"].rsplit("/", 1)[-1]
        ]
        assert slug == f"{definition['block_type_slug']}/{setup.BLOCK_NAME}", (name, slug)
    parameters = flow.validate_parameters({k: v for k, v in given.items() if k not in refs})
    assert set(parameters) <= set(flow.parameters.properties)
    # Every parameter is documented, so the Prefect UI renders a described form.
    for name, schema in flow.parameters.properties.items():
        assert schema.get("description"), name
    assert deployment["work_pool"]["name"]


def test_rollouts_queue_and_schedules_are_defined_but_off():
    by_name = {d["name"]: d for d in DEPLOYMENTS}
    assert {
        "data-prep",
        "tune-sweep",
        "register-and-promote",
        "serve-rollout",
        "reconcile",
        "train-and-ship",
    } <= set(by_name)
    assert by_name["serve-rollout"]["concurrency_limit"]["limit"] == 1
    assert [s["cron"] for s in by_name["train-and-ship"]["schedules"]] == ["0 2 * * *"]
    assert [s["interval"] for s in by_name["reconcile"]["schedules"]] == [300]
    for deployment in DEPLOYMENTS:
        for schedule in deployment.get("schedules") or []:
            assert schedule["active"] is False, deployment["name"]
        assert deployment["work_pool"]["name"] == setup.WORK_POOL
        refs = block_refs(deployment.get("parameters") or {})
        assert set(refs) <= {"ray_cluster", "mlflow_server"}
        if refs:  # Prefect 3.9's server-side check refuses a $ref to an all-defaults block
            assert deployment["enforce_parameter_schema"] is False, deployment["name"]
        assert set(setup.SCHEDULED) == {d["name"] for d in DEPLOYMENTS if d.get("schedules")}
