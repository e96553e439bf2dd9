"""A temporary stack of real services on free ports: one Ray head (`ray start --head`), one
lean MLflow server, one Prefect server and the MLflow webhook receiver between them, each with
its own temp dir, stopped by pid when the block ends. The test session and the serving
benchmarks run on it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments import crashes, local, ports, route_watch, setup
from prefect_ray_lifecycle.workloads.constants import PROJECT_ROOT

SCHEDULER_ENV = (("PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS", "2"),)
# Serve's replicas log each request to their log files only (still under the head's session
# logs/serve/), not also to stderr, which Ray's log monitor would ship to every driver: under
# the tests' load that was a line per request through the monitor, the GCS and pytest.
QUIET_SERVE = (("RAY_SERVE_LOG_TO_STDERR", "0"),)


@dataclass(frozen=True)
class Stack:
    state_dir: Path
    prefect_api_url: str
    mlflow_uri: str
    ray_address: str
    ray_dashboard_url: str
    ray_temp_dir: Path
    ray_token: str
    serve_port: int
    receiver_url: str  # deployments.receiver; it loads the MLflowWebhook block `lifecycle`
    services: tuple[local.Service, ...] = ()

    @property
    def ray_client_address(self) -> str:
        """ray:// address of the head's Ray Client server (a free port chosen at start)."""
        argv = local.running(self.service("ray"))["argv"]
        return f"ray://{local.HOST}:{argv[argv.index('--ray-client-server-port') + 1]}"

    def client_env(self) -> dict[str, str]:
        """What a client of the stack needs in its environment (Ray's token by path, kept out
        of ~/.ray)."""
        return {
            "PREFECT_API_URL": self.prefect_api_url,
            "MLFLOW_TRACKING_URI": self.mlflow_uri,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.state_dir / "ray_auth_token"),
        }

    def service(self, name: str) -> local.Service:
        """One of the stack's services, to stop and start again (local.stop / local.start)."""
        return next(s for s in self.services if s.name == name)

    @property
    def webhook_url(self) -> str:
        """Where MLflow delivers registry webhooks (POST)."""
        return f"{self.receiver_url}{local.RECEIVER_WEBHOOK_PATH}"

    def ray_cluster(self, **fields):
        from prefect_ray_lifecycle.blocks import RayCluster

        fields.setdefault("serve_port", self.serve_port)
        return RayCluster(address=self.ray_address, auth_token=self.ray_token, **fields)


@contextlib.contextmanager
def temporary_stack(ray_num_cpus: int, prefix: str = "rlt-") -> Iterator[Stack]:
    # Short path: Ray's unix sockets live under its temp dir and must stay under 107 bytes.
    state_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    prefect_port, mlflow_port, receiver_port, serve_port = ports.free_ports(4)
    (ray_port,) = ports.free_ports(1, spacing=local.RAY_DASHBOARD_PORT - local.DEFAULT_PORTS["ray"])
    services = local.services(
        state_dir,
        {
            "prefect": prefect_port,
            "mlflow": mlflow_port,
            "receiver": receiver_port,
            "ray": ray_port,
        },
        ("prefect", "mlflow", "receiver", "ray"),
        ray_num_cpus=ray_num_cpus,
    )
    # Schedules are due within seconds here, not at the scheduler's next minute.
    services = [
        dataclasses.replace(s, extra_env={"prefect": SCHEDULER_ENV, "ray": QUIET_SERVE}[s.name])
        if s.name in ("prefect", "ray")
        else s
        for s in services
    ]
    try:
        for outcome in local.start_together(services):
            if not outcome.startswith("started"):
                raise RuntimeError(outcome)
        by_name = {s.name: s for s in services}
        ray_service = by_name["ray"]
        yield Stack(
            state_dir=state_dir,
            prefect_api_url=f"{by_name['prefect'].url}/api",
            mlflow_uri=by_name["mlflow"].url,
            ray_address=ray_service.url,
            ray_dashboard_url=f"http://{local.HOST}:{ray_service.dashboard_port}",
            ray_temp_dir=state_dir / "ray",
            ray_token=ray_service.ray_token(),
            serve_port=serve_port,
            receiver_url=by_name["receiver"].url,
            services=tuple(services),
        )
    finally:
        for service in reversed(services):
            local.stop(service)
        shutil.rmtree(state_dir, ignore_errors=True)


def stop_all(stack: Stack) -> None:
    """What the README says to run to stop it all: the worker (and the flow runs it
    started), then every service, the Ray head too."""
    setup.stop_worker(stack.state_dir)
    for service in reversed(stack.services):
        local.stop(service)


def start_all(stack: Stack) -> list[str]:
    """Every service again on its own state folder and port, then the worker; what the
    worker's start said (the dead runs it marked Crashed among it)."""
    for service in stack.services:
        outcome = local.start(service)
        if not outcome.startswith("started"):
            raise RuntimeError(f"{service.name}: {outcome}")
    return setup.start_worker(stack.state_dir, stack.client_env()).splitlines()


def environment(stack: Stack, routes: tuple[str, ...] = ("policy",)) -> setup.Environment:
    """The stack as a deployment environment (what `deployments.setup` fills in)."""
    return setup.Environment(
        ray_address=stack.ray_address,
        mlflow_uri=stack.mlflow_uri,
        ray_token=stack.ray_token,
        ray_dashboard_url=stack.ray_dashboard_url,
        serve_port=stack.serve_port,
        routes=routes,
        receiver_url=stack.webhook_url,
        client_env={**stack.client_env(), "PREFECT_WORKER_QUERY_SECONDS": "1"},
    )


@contextlib.contextmanager
def deployed(
    stack: Stack,
    routes: tuple[str, ...] = ("policy",),
    parameters: dict[str, dict[str, Any]] | None = None,
    webhook: bool = True,
) -> Iterator[setup.Environment]:
    """What a user does on the stack: `deployments.setup` (blocks, pool, limits, and unless
    `webhook` is False the MLflow webhook), `prefect --no-prompt deploy --all`, default
    parameters overridden per deployment ("flow/deployment": {name: value}), and a process
    worker, stopped by pid at the end."""
    env = environment(stack, routes)
    if not webhook:  # e.g. a second Prefect server on the stack: MLflow's webhook stays put
        env = dataclasses.replace(env, receiver_url=None)
    cli_env = {**os.environ, **env.client_env}
    with setup.prefect_api(stack.prefect_api_url):
        setup.prepare(env)
        done = subprocess.run(
            [str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy", "--all"],
            env=cli_env,
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"prefect deploy --all failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        if parameters:
            set_parameters(parameters)
        setup.start_worker(stack.state_dir, env.client_env, env.work_pool)
        try:
            yield env
        finally:
            # Its routes are gone on purpose (or about to be): no trigger may restore them,
            # and no run it queued may wait for the next worker on this Prefect server.
            for route in routes:
                route_watch.removed(route)
            setup.stop_worker(stack.state_dir)
            undeploy()


def undeploy() -> None:
    """Delete this project's deployments (their triggers go with them) and every run of
    theirs that has not ended: a later test's worker on this Prefect server runs nothing
    this one queued, and no later champion move anywhere starts a reconcile."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    drop_unfinished_runs()
    with get_client(sync_client=True) as client:
        found = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=crashes.FLOW_NAMES))
        )
        for deployment in found:
            # Prefect 3.9 deletes a deployment without the automations its triggers made
            # (only `prefect deploy` replaces them): left behind, the next deploy on this
            # server made a second `reconcile-on-champion-moved`, acting for a deleted
            # deployment.
            client.delete_resource_owned_automations(f"prefect.deployment.{deployment.id}")
            client.delete_deployment(deployment.id)


def drop_unfinished_runs() -> list[str]:
    """Delete every flow run of this project's deployments that has not ended."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    open_types = [
        StateType.SCHEDULED,
        StateType.PENDING,
        StateType.RUNNING,
        StateType.PAUSED,
        StateType.CANCELLING,
    ]
    names = sorted(crashes.FLOW_NAMES)
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=open_types))
            ),
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=names)),
        )
        for run in runs:
            client.delete_flow_run(run.id)
    return [str(run.id) for run in runs]


def set_parameters(parameters: dict[str, dict[str, Any]]) -> None:
    """Override deployments' default parameters ("flow/deployment": {name: value})."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    with get_client(sync_client=True) as client:
        for name, values in parameters.items():
            deployment = client.read_deployment_by_name(name)
            merged = {**(deployment.parameters or {}), **values}
            client.update_deployment(deployment.id, DeploymentUpdate(parameters=merged))


@contextlib.contextmanager
def pointed_at(stack: Stack) -> Iterator[None]:
    """Point this process, its threads and the subprocesses it starts at the stack's
    servers. temporary_settings reaches this thread only: other threads read Prefect's global
    settings, refreshed here from the environment (without it, a flow run in a thread starts
    Prefect's temporary server)."""
    from prefect.context import refresh_global_settings_context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Blocks export the token they carry into RAY_AUTH_TOKEN: put back what was there before.
    token = os.environ.get("RAY_AUTH_TOKEN")
    try:
        with environ(stack.client_env()):
            refresh_global_settings_context()
            with temporary_settings(updates={PREFECT_API_URL: stack.prefect_api_url}):
                try:
                    yield
                finally:
                    # Send what is queued while the server still runs: drained at exit, with
                    # no API URL left, Prefect would start a temporary server to send it to.
                    for worker in (EventsWorker, APILogWorker):
                        worker.drain_all(timeout=30)
    finally:
        if token is None:
            os.environ.pop("RAY_AUTH_TOKEN", None)
        else:
            os.environ["RAY_AUTH_TOKEN"] = token
        refresh_global_settings_context()


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values`, restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
