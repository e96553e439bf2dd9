"""A temporary stack of real services on free ports: one Ray head (`ray start --head`), one
lean MLflow server, one Prefect server and the MLflow webhook receiver between them, each with
its own temp dir, stopped by pid when the block ends. The test session and the serving
benchmarks run on it."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from deployments import local


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

    @property
    def webhook_url(self) -> str:
        """Where MLflow delivers registry webhooks (POST)."""
        return f"{self.receiver_url}{local.RECEIVER_WEBHOOK_PATH}"

    def ray_cluster(self, **fields):
        from blocks import RayCluster

        fields.setdefault("serve_port", self.serve_port)
        return RayCluster(address=self.ray_address, auth_token=self.ray_token, **fields)


@contextlib.contextmanager
def temporary_stack(ray_num_cpus: int, prefix: str = "rlt-") -> Iterator[Stack]:
    # Short path: Ray's unix sockets live under its temp dir and must stay under 107 bytes.
    state_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    prefect_port, mlflow_port, receiver_port, serve_port = local.free_ports(4)
    (ray_port,) = local.free_ports(1, spacing=local.RAY_DASHBOARD_PORT - local.DEFAULT_PORTS["ray"])
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
    try:
        with ThreadPoolExecutor(len(services)) as pool:
            for outcome in pool.map(local.start, services):
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
        )
    finally:
        for service in reversed(services):
            local.stop(service)
        shutil.rmtree(state_dir, ignore_errors=True)
