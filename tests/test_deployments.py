"""Every prefect.yaml deployment loads: its entrypoint imports and its parameters validate;
blocks are named (deployments.setup fills them in); schedules are defined but off."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint

from deployments import crashes, setup

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())["deployments"]
# What a user fills in the run form for parameters a deployment cannot default.
USER_INPUT = {
    "data-prep": {
        "params": {"source": "/data/*.parquet", "output": "/prepared", "split_key": "id"}
    },
    "llm-finetune": {
        "params": {"data": {"source": "/corpus/*.jsonl", "output": "/prepared", "split_key": "id"}}
    },
    "register-and-promote": {
        "request": {"checkpoint": "/ckpt", "experiment_path": "/exp", "trial_id": "t1"}
    },
    "llm-sweep": {
        "params": {"data": {"source": "/corpus/*.jsonl", "output": "/prepared", "split_key": "id"}}
    },
    "register-llm": {"request": {"checkpoint": "/ckpt", "train_run": "/runs/r/finetune"}},
    "llm-train-and-ship": {
        "params": {"data": {"source": "/corpus/*.jsonl", "output": "/prepared", "split_key": "id"}}
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
    # A deployment run whose process dies silently is marked Crashed (deployments.crashes).
    assert flow.name in crashes.FLOW_NAMES, flow.name


def test_rollouts_queue_and_schedules_are_defined_but_off():
    by_name = {d["name"]: d for d in DEPLOYMENTS}
    assert {
        "data-prep",
        "tune-sweep",
        "llm-finetune",
        "register-and-promote",
        "serve-rollout",
        "reconcile",
        "train-and-ship",
        "llm-sweep",
        "register-llm",
        "llm-train-and-ship",
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


def flow_of(deployment: dict):
    return load_flow_from_entrypoint(deployment["entrypoint"])


def text_parameters(flow) -> list[str]:
    """Top-level parameters the UI renders as a free text field."""
    names = []
    for name, schema in flow.parameters.properties.items():
        choices = [schema, *schema.get("anyOf", [])]
        types = {s.get("type") for s in choices}
        if "string" in types and not any("enum" in s for s in choices):
            names.append(name)
    return names


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_parameters_validate_as_the_cli_and_the_ui_form_send_them(deployment, monkeypatch):
    """`prefect deployment run ... --param k=v` reads v as JSON (version=2 sends the number 2);
    the UI's text field sends a string. Every text parameter takes both to the same text."""
    from prefect.cli._utilities import load_json_key_values

    monkeypatch.chdir(PROJECT_ROOT)
    flow = flow_of(deployment)
    required = USER_INPUT.get(deployment["name"], {})
    for name in text_parameters(flow):
        typed = "2" if name == "version" else "2024"  # what looks like a number to the CLI
        from_cli = load_json_key_values([f"{name}={typed}"], "parameter")
        assert not isinstance(from_cli[name], str)  # the CLI did send a number
        assert flow.validate_parameters({**required, **from_cli})[name] == typed, name
        assert flow.validate_parameters({**required, name: typed})[name] == typed, name  # UI


def test_a_version_parameter_takes_a_number_and_names_a_bad_one():
    from prefect.exceptions import ParameterTypeError

    from prefect_ray_lifecycle.flows.rollout import serve_rollout

    assert serve_rollout.validate_parameters({"version": 7})["version"] == "7"
    assert serve_rollout.validate_parameters({"version": " 07"})["version"] == "7"
    for bad in (0, -1, 2.5, "latest", True, "v2"):
        with pytest.raises(ParameterTypeError, match="version: .*whole number from 1"):
            serve_rollout.validate_parameters({"version": bad})
