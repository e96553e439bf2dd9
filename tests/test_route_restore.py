"""A Ray head that restarts loses Serve's state: the route refuses connections while MLflow
still says `live` and `champion` agree. reconcile compares what is wanted with what is
actually served, so it restores the route through the gates, and says so."""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from deployments import local
from deployments.testing.load import OBSERVATION
from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster
from prefect_ray_lifecycle.control import registry
from prefect_ray_lifecycle.flows.reconcile import reconcile
from prefect_ray_lifecycle.flows.rollout import serve_rollout
from prefect_ray_lifecycle.tasks.rollout.config import Gates, Serving

ROUTE = "restore-test"
GATES = Gates(
    health_timeout_s=120, stability_window_s=3, canary_steps=[0.3], canary_hold_s=3, bake_s=3
)
SERVING = Serving(
    num_cpus=0.1, health_check_period_s=1, health_check_timeout_s=5, router_num_cpus=0.1
)

pytestmark = pytest.mark.slow


@pytest.fixture
def own_head():
    """A Ray head of this test's own (the session's head must not restart under others)."""
    state = Path(tempfile.mkdtemp(prefix="rlt-head-", dir="/tmp"))
    (port,) = local.free_ports(1, spacing=local.RAY_DASHBOARD_PORT - local.DEFAULT_PORTS["ray"])
    head = local.Service("ray", port, state, num_cpus=2)
    local.start(head)
    try:
        yield head
    finally:
        local.stop(head)
        shutil.rmtree(state, ignore_errors=True)


def ask(port: int) -> tuple[int, str | None]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/{ROUTE}",
        data=json.dumps({"observation": OBSERVATION}).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers.get("X-Model-Version")
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("X-Model-Version")
    except OSError:
        return 0, None  # refused: nothing listens


def test_a_restarted_head_gets_its_route_restored_through_the_gates(stack, checkpoints, own_head):
    (serve_port,) = local.free_ports(1)
    cluster = RayCluster(
        address=own_head.url, auth_token=own_head.ray_token(), serve_port=serve_port
    )
    server = MLflowServer(tracking_uri=stack.mlflow_uri)
    client = MlflowClient(stack.mlflow_uri)
    name = f"restored-{uuid.uuid4().hex[:6]}"
    registry.register_checkpoint(
        client,
        name=name,
        checkpoint=checkpoints["good"],
        experiment_name="restore-tests",
        trial_key_value=f"{name}-0",
        observation_size=4,
    )
    client.set_registered_model_alias(name, registry.CHAMPION, "1")
    common = dict(
        model_name=name,
        route=ROUTE,
        gates=GATES,
        serving=SERVING,
        ray_cluster=cluster,
        mlflow_server=server,
    )
    first = serve_rollout(version="1", **common)
    assert first.outcome == "first_rollout" and ask(serve_port) == (200, "1")

    local.stop(own_head)
    local.start(own_head)  # same address, no Serve state
    assert ask(serve_port)[0] == 0
    assert registry.resolve_alias(client, name, registry.LIVE).version == "1"  # MLflow agrees

    result = reconcile(**common)
    assert result.action == "restored", result
    assert result.found["router"] == "missing" and result.live == "1"
    assert result.rollout.outcome == "first_rollout"  # health and smoke gates, again
    assert ask(serve_port) == (200, "1")
    assert reconcile(**common).action == "in_sync"
    client.delete_registered_model(name)
