"""What `prefect deploy` needs beyond prefect.yaml, per environment, and idempotent: the
blocks the deployments name, MLflow's registry webhook to the receiver, the process work pool,
the rollout concurrency limits, schedules on or off, and a worker for the pool.

    python -m deployments.setup                   # the local services of deployments.local
    python -m deployments.setup --ray-address HOST:PORT --ray-token-file F --mlflow-uri URI \
        [--receiver-url https://HOST/mlflow]
    python -m deployments.setup --schedules on    # after `prefect deploy`: nightly + reconcile
    python -m deployments.setup --worker start    # a process worker for the pool (or stop)

An environment is a Prefect API (PREFECT_API_URL) plus the values below; prefect.yaml names
the blocks (`ray-cluster/lifecycle`, `mlflow-server/lifecycle`), this module fills them in.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deployments import local
from deployments.crashes import ensure_crash_detection, mark_dead_runs_crashed
from prefect_ray_lifecycle.workloads.constants import PROJECT_ROOT

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from prefect_ray_lifecycle.blocks import MLflowWebhook

WORK_POOL = "ray-lifecycle-process"
BLOCK_NAME = "lifecycle"  # what prefect.yaml's `$ref: {block_document_slug: ...}` name
ROUTES = ("policy",)
SCHEDULED = ("train-and-ship", "reconcile")  # deployments with schedules in prefect.yaml
WORKER_NAME = "ray-lifecycle-local"
WEBHOOK_NOTE = "Registry events to Prefect (deployments.receiver); kept by deployments.setup."
# Flow runs the worker starts send a heartbeat event this often (Prefect's minimum; its
# default, which runs started elsewhere keep, is 180 s): deployments.crashes marks a run
# Crashed whose heartbeats stopped.
HEARTBEAT_S = 30


@dataclass(frozen=True)
class Environment:
    """Per-environment values: where Ray and MLflow are, and what the deployments name."""

    ray_address: str
    mlflow_uri: str
    ray_token: str | None = None
    ray_dashboard_url: str | None = None
    serve_port: int = 8000
    routes: tuple[str, ...] = ROUTES
    block_name: str = BLOCK_NAME
    work_pool: str = WORK_POOL
    client_env: dict[str, str] = field(default_factory=dict)  # for workers and CLI calls
    receiver_url: str | None = None  # where MLflow delivers registry webhooks; None: no webhook

    def ray_cluster(self):
        from prefect_ray_lifecycle.blocks import RayCluster

        return RayCluster(
            address=self.ray_address,
            auth_token=self.ray_token,
            dashboard_url=self.ray_dashboard_url,
            serve_port=self.serve_port,
        )

    def mlflow_server(self):
        from prefect_ray_lifecycle.blocks import MLflowServer

        return MLflowServer(tracking_uri=self.mlflow_uri)

    def mlflow_webhook(self, secret: str):
        from prefect_ray_lifecycle.blocks import MLflowWebhook

        return MLflowWebhook(secret=secret, url=self.receiver_url)


def local_environment(
    state_dir: Path = local.DEFAULT_STATE_DIR, serve_port: int = 8000
) -> Environment:
    """The services `python -m deployments.local up --ray` runs (a Ray head is required: Serve
    rollouts need a cluster that outlives a flow run)."""
    names = ("prefect", "mlflow", "receiver", "ray")
    services = {s.name: s for s in local.services(state_dir, names=names)}
    ray = services["ray"]
    return Environment(
        ray_address=ray.url,
        mlflow_uri=services["mlflow"].url,
        ray_token=ray.ray_token(),
        ray_dashboard_url=f"http://{local.HOST}:{ray.dashboard_port}",
        serve_port=serve_port,
        client_env=local.environment(list(services.values())),
        receiver_url=services["receiver"].webhook_url,
    )


def save_blocks(env: Environment) -> list[str]:
    """Register the block types and (over)write the two named blocks."""
    from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster

    done = []
    for block_type, block in ((RayCluster, env.ray_cluster()), (MLflowServer, env.mlflow_server())):
        block_type.register_type_and_schema()
        block.save(env.block_name, overwrite=True)
        done.append(f"block {block_type.get_block_type_slug()}/{env.block_name}")
    return done


def ensure_webhook(env: Environment) -> list[str]:
    """The MLflowWebhook block (its secret made once, then kept) and the one MLflow webhook
    of that name, with the block's URL, events and secret. Nothing without a receiver URL."""
    if env.receiver_url is None:
        return []
    from mlflow.exceptions import MlflowException

    from prefect_ray_lifecycle.blocks import MLflowWebhook

    MLflowWebhook.register_type_and_schema()
    try:
        secret = MLflowWebhook.load(env.block_name).secret.get_secret_value()
    except ValueError:  # no block yet
        secret = secrets.token_urlsafe(32)
    webhook = env.mlflow_webhook(secret)
    webhook.save(env.block_name, overwrite=True)
    with env.mlflow_server().session() as client:
        try:
            outcome = register_webhook(client, webhook)
        except MlflowException as error:
            raise RuntimeError(
                f"MLflow at {env.mlflow_uri} refused the webhook to {webhook.url}: {error.message} "
                f"(a local MLflow needs MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https and "
                f"MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true: restart it with deployments.local)"
            ) from None
    slug = f"{MLflowWebhook.get_block_type_slug()}/{env.block_name}"
    return [f"block {slug}", f"mlflow webhook {webhook.webhook_name} -> {webhook.url}: {outcome}"]


def register_webhook(client: MlflowClient, webhook: MLflowWebhook) -> str:
    """Create MLflow's webhook named by the block, or bring the existing one (and only one)
    in line with it. MLflow never returns a secret, so it is always set."""
    found, token = [], None
    while True:
        page = client.list_webhooks(max_results=100, page_token=token)
        found += [hook for hook in page if hook.name == webhook.webhook_name]
        token = page.token
        if not token:
            break
    settings = {"url": webhook.url, "events": list(webhook.events)}
    settings["secret"] = webhook.secret.get_secret_value()
    if not found:
        client.create_webhook(name=webhook.webhook_name, description=WEBHOOK_NOTE, **settings)
        return "registered"
    keep, *extra = found
    for hook in extra:
        client.delete_webhook(hook.webhook_id)
    client.update_webhook(keep.webhook_id, status="ACTIVE", description=WEBHOOK_NOTE, **settings)
    return "in line"


def ensure_work_pool(name: str = WORK_POOL) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
            if pool.type != "process":
                raise ValueError(
                    f"work pool {name!r} exists with type {pool.type!r}; the "
                    f"deployments need a process pool"
                )
            return f"work pool {name} (process): exists"
        except ObjectNotFound:
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            except ObjectAlreadyExists:
                pass
    return f"work pool {name} (process): created"


def ensure_rollout_limits(routes: tuple[str, ...] = ROUTES) -> list[str]:
    """Global concurrency limits `serve-rollout-<route>` (limit 1) that every rollout on the
    route holds, whichever deployment or flow started it."""
    from prefect_ray_lifecycle.tasks.rollout.claim import ensure_rollout_limit

    return [f"concurrency limit {ensure_rollout_limit(route)} (1)" for route in routes]


def prepare(env: Environment) -> list[str]:
    return [
        *save_blocks(env),
        *ensure_webhook(env),
        ensure_work_pool(env.work_pool),
        *ensure_rollout_limits(env.routes),
        ensure_crash_detection(),
    ]


def set_schedules(active: bool, deployments: tuple[str, ...] = SCHEDULED) -> list[str]:
    """Turn the prefect.yaml schedules of the named deployments on or off."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    done = []
    with get_client(sync_client=True) as client:
        found = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=list(deployments)))
        )
        for deployment in found:
            for schedule in client.read_deployment_schedules(deployment.id):
                client.update_deployment_schedule(deployment.id, schedule.id, active=active)
                done.append(
                    f"schedule {deployment.name}/{schedule.slug or schedule.id}: "
                    f"{'on' if active else 'off'}"
                )
    if not done:
        done.append("no schedules found: run `prefect --no-prompt deploy --all` first")
    return done


# ---- the worker -------------------------------------------------------------------------
def worker_service(state_dir: Path) -> local.Service:
    """The worker's pid and log files live with the other local services' (port unused)."""
    return local.Service("worker", 0, Path(state_dir).resolve())


def worker_env(client_env: dict[str, str]) -> dict[str, str]:
    """A worker's environment: the services, and this checkout for prefect.yaml's pull step.
    Flow runs inherit it."""
    env = {**os.environ, **client_env, "PREFECT_RAY_LIFECYCLE_DIR": str(PROJECT_ROOT)}
    # Heartbeats a dead run stops sending (see ensure_crash_detection).
    env.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))
    # A triggered run waits for the worker's next poll: poll each second (Prefect's default
    # is 10 s), a trivial load on a local server.
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", "1")
    return env


def worker_command(pool: str = WORK_POOL, name: str = WORKER_NAME) -> list[str]:
    prefect = str(Path(sys.executable).parent / "prefect")
    return [
        prefect,
        "worker",
        "start",
        "--pool",
        pool,
        "--type",
        "process",
        "--name",
        name,
        "--install-policy",
        "never",
    ]


def start_worker(
    state_dir: Path, client_env: dict[str, str], pool: str = WORK_POOL, timeout: float = 90.0
) -> str:
    """Start a process worker for the pool (a no-op when ours runs) and wait until the Prefect
    API sees it."""
    service = worker_service(state_dir)
    record = local.running(service)
    if record:
        return f"worker: already running (pid {record['pid']})"
    with prefect_api(client_env.get("PREFECT_API_URL")):
        swept = "".join(f"{line}\n" for line in mark_dead_runs_crashed(pool, WORKER_NAME))
    process = local.launch(service, worker_command(pool), worker_env(client_env), PROJECT_ROOT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            local.stop(service)
            raise RuntimeError(
                f"the worker exited with {process.returncode}; see {service.log_file}"
            )
        if _worker_online(pool, client_env):
            return f"{swept}worker: started (pid {process.pid}, log {service.log_file})"
        time.sleep(1)
    local.stop(service)
    raise RuntimeError(
        f"the worker did not reach the Prefect API in {timeout:.0f} s; see {service.log_file}"
    )


def _worker_online(pool: str, client_env: dict[str, str]) -> bool:
    from prefect.client.orchestration import get_client

    with prefect_api(client_env.get("PREFECT_API_URL")), get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool(pool)
    return any(w.name == WORKER_NAME and str(w.status).upper().endswith("ONLINE") for w in workers)


def stop_worker(state_dir: Path) -> str:
    return f"worker: {local.stop(worker_service(state_dir))}"


# ---- command line -----------------------------------------------------------------------
@contextlib.contextmanager
def prefect_api(url: str | None) -> Iterator[None]:
    """This process talks to the environment's Prefect API (the local server by default)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url} if url else {}):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.setup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=local.DEFAULT_STATE_DIR,
        help="deployments.local's state folder (default: .local/)",
    )
    parser.add_argument("--ray-address", help="Ray GCS address (default: the local head)")
    parser.add_argument("--ray-token-file", type=Path, help="file holding the Ray token")
    parser.add_argument("--ray-dashboard-url")
    parser.add_argument("--mlflow-uri", help="MLflow tracking URI (default: the local one)")
    parser.add_argument(
        "--receiver-url",
        help="URL MLflow delivers registry webhooks to (default: the local receiver's; with "
        "--ray-address, no webhook unless given)",
    )
    parser.add_argument(
        "--serve-port",
        type=int,
        default=8000,
        help="port of Serve's HTTP proxy on the cluster (default 8000)",
    )
    parser.add_argument(
        "--route",
        action="append",
        dest="routes",
        help="route that gets a rollout concurrency limit (repeatable; default: policy)",
    )
    parser.add_argument(
        "--schedules", choices=["on", "off"], help="only turn the deployments' schedules on or off"
    )
    parser.add_argument(
        "--worker", choices=["start", "stop"], help="only start or stop the local process worker"
    )
    args = parser.parse_args(argv)

    if args.schedules:
        # The Prefect API this shell points at, else the local services'.
        api = os.environ.get("PREFECT_API_URL") or (
            None
            if args.ray_address
            else local_environment(args.state_dir).client_env.get("PREFECT_API_URL")
        )
        with prefect_api(api):
            lines = set_schedules(args.schedules == "on")
    elif args.worker == "stop":
        lines = [stop_worker(args.state_dir)]
    else:
        if args.ray_address:
            token = args.ray_token_file.read_text().strip() if args.ray_token_file else None
            env = Environment(
                ray_address=args.ray_address,
                mlflow_uri=args.mlflow_uri
                or os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000"),
                ray_token=token,
                ray_dashboard_url=args.ray_dashboard_url,
                serve_port=args.serve_port,
                receiver_url=args.receiver_url,
                client_env={
                    k: v
                    for k, v in os.environ.items()
                    if k.startswith(("PREFECT_", "MLFLOW_", "RAY_"))
                },
            )
        else:
            env = local_environment(args.state_dir, args.serve_port)
            if args.mlflow_uri:
                env = dataclasses.replace(env, mlflow_uri=args.mlflow_uri)
            if args.receiver_url:
                env = dataclasses.replace(env, receiver_url=args.receiver_url)
        if args.routes:
            env = dataclasses.replace(env, routes=tuple(args.routes))
        with prefect_api(env.client_env.get("PREFECT_API_URL")):
            if args.worker == "start":
                lines = [start_worker(args.state_dir, env.client_env, env.work_pool)]
            else:
                lines = prepare(env)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
