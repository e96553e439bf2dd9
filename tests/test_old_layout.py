"""What the layout before the one import package left behind still works: a version it
registered (a pyfunc whose pickle names `workloads.policy_model`) loads in a plain process,
and a route it rolled out (its router built from `workloads.router`, its version apps from
`workloads.serving`) is rolled forward by today's code and reconciled, with load through the
router the whole time and no failed answer.

The old code is the last commit before the move (OLD_COMMIT), exported from git and run
from its own folder, as a user who upgrades would have run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
import uuid
from io import BytesIO
from pathlib import Path

import pytest
from mlflow import MlflowClient

from deployments.testing.fast import FAST_SERVING
from deployments.testing.load import LOAD_PAUSE_S, ClosedLoop
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.reconcile import reconcile
from prefect_ray_lifecycle.flows.rollout import serve_rollout
from prefect_ray_lifecycle.tasks.rollout.config import Gates, Serving

ROOT = Path(__file__).resolve().parent.parent
OLD_COMMIT = "1c42094"  # the top-level flows/ tasks/ blocks/ workloads/ layout
ROUTE = "old-layout-test"
GATES = dict(
    health_timeout_s=120,
    stability_window_s=2,
    canary_steps=[0.5],
    canary_hold_s=4,
    canary_min_requests=5,
    canary_max_wait_s=60,
    bake_s=4,
    bake_window_s=2,
    max_error_rate=0.05,
    max_p99_ms=5000,
    p99_slack_ms=3000,
)
SERVING = FAST_SERVING

OLD_ROLLOUT = """
import json, sys
from mlflow import MlflowClient
from blocks import MLflowServer, RayCluster
from flows.rollout import serve_rollout
from tasks.serve_config import Gates, Serving
from workloads import registry

args = json.loads(sys.argv[1])
client = MlflowClient(args["mlflow"])
registration = registry.register_checkpoint(
    client, name=args["model"], checkpoint=args["checkpoint"], experiment_name="old-layout",
    trial_key_value=args["model"] + "-old", observation_size=4,
)
result = serve_rollout(
    model_name=args["model"], version=registration.version, route=args["route"],
    gates=Gates(**args["gates"]), serving=Serving(**args["serving"]),
    ray_cluster=RayCluster(address=args["ray"], serve_port=args["serve_port"]),
    mlflow_server=MLflowServer(tracking_uri=args["mlflow"]),
)
print(json.dumps({"version": registration.version, "outcome": result.outcome}))
"""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory) -> Path:
    """The old layout's code, as `git archive` of its commit."""
    target = tmp_path_factory.mktemp("old-layout")
    archive = subprocess.run(
        ["git", "archive", OLD_COMMIT], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target


def run_old(old_tree: Path, code: str, args: dict, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), json.dumps(args)],
        cwd=old_tree,
        env={**env, "PYTHONPATH": str(old_tree)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_route_and_a_version_of_the_old_layout_roll_forward_without_a_failed_answer(
    stack, checkpoints, old_tree
):
    model = f"old-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(stack.mlflow_uri)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    first = run_old(
        old_tree,
        OLD_ROLLOUT,
        {
            "mlflow": stack.mlflow_uri,
            "model": model,
            "checkpoint": str(checkpoints["good"]),
            "route": ROUTE,
            "gates": GATES,
            "serving": SERVING,
            "ray": stack.ray_address,
            "serve_port": stack.serve_port,
        },
        env,
    )
    assert first == {"version": "1", "outcome": "first_rollout"}
    cluster = stack.ray_cluster()
    with cluster.connect():
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            router = serve_control.app_configs()[serve_control.router_app_name(ROUTE)]
            assert router["import_path"] == "workloads.router:build_router_app"  # the old code

            # The old version's pyfunc loads in a plain process from its own copy of the code.
            loaded = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import mlflow, numpy, sys; m = mlflow.pyfunc.load_model(sys.argv[1]); "
                    "print(int(m.predict(numpy.array([[0.01, -0.02, 0.03, 0.04]], "
                    "dtype=numpy.float32))[0]))",
                    f"models:/{model}/1",
                ],
                cwd=Path("/"),
                env={**env, "MLFLOW_TRACKING_URI": stack.mlflow_uri},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert loaded.returncode == 0, loaded.stderr[-2000:]
            assert loaded.stdout.strip().splitlines()[-1] in ("0", "1")

            # Today's code registers v2 and rolls it out onto the old route, under load.
            registry.register_checkpoint(
                client,
                name=model,
                checkpoint=checkpoints["good"],
                experiment_name="old-layout",
                trial_key_value=f"{model}-new",
                observation_size=4,
            )
            common = dict(
                model_name=model,
                route=ROUTE,
                gates=Gates(**GATES),
                serving=Serving(**SERVING),
                ray_cluster=cluster,
                mlflow_server=MLflowServer(tracking_uri=stack.mlflow_uri),
            )
            with ClosedLoop(cluster.serve_port, f"/{ROUTE}", pause_s=LOAD_PAUSE_S) as traffic:
                result = serve_rollout(version="2", **common)
            assert result.outcome == "promoted", result
            assert traffic.failed() == [], traffic.failed()[:3]
            assert traffic.answers and traffic.answers[-1].version == "2"
            router = serve_control.app_configs()[serve_control.router_app_name(ROUTE)]
            assert router["import_path"].startswith("prefect_ray_lifecycle.")
            assert registry.resolve_alias(client, model, registry.LIVE).version == "2"
            client.set_registered_model_alias(model, registry.CHAMPION, "2")
            reconciled = reconcile(**common)
            assert (reconciled.action, reconciled.live) == ("in_sync", "2"), reconciled
        finally:
            serve_control.delete_route(ROUTE, model)
            client.delete_registered_model(model)
