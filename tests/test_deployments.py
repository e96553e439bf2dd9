"""Every prefect.yaml deployment loads: its entrypoint imports and its parameters validate."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())["deployments"]
# What a user fills in the run form for parameters a deployment cannot default.
USER_INPUT = {
    "data-prep": {"params": {"source": "/data/*.parquet", "output": "/prepared",
                             "split_key": "id"}},
    "register-and-promote": {"request": {"checkpoint": "/ckpt", "experiment_path": "/exp",
                                         "trial_id": "t1"}},
}


def test_prefect_yaml_names_deployments():
    names = [d["name"] for d in DEPLOYMENTS]
    assert names and len(names) == len(set(names))


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_entrypoint_imports_and_parameters_validate(deployment, monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    flow = load_flow_from_entrypoint(deployment["entrypoint"])
    given = {**(deployment.get("parameters") or {}), **USER_INPUT.get(deployment["name"], {})}
    parameters = flow.validate_parameters(given)
    assert set(parameters) <= set(flow.parameters.properties)
    # Every parameter is documented, so the Prefect UI renders a described form.
    for name, schema in flow.parameters.properties.items():
        assert schema.get("description"), name
    assert deployment["work_pool"]["name"]
