"""The Prefect API a benchmark records its flow runs in: PREFECT_API_URL when set, else a
Prefect server of the benchmark's own, stopped afterwards. (Prefect's temporary server would
make stock prefect-ray start a server in every Ray worker, which is not what is measured.)"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from deployments import local, ports


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """Yield the API URL, with this process's settings and environment pointed at it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if url := os.environ.get("PREFECT_API_URL"):
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
        return
    state_dir = Path(tempfile.mkdtemp(prefix="bench-prefect-"))
    (port,) = ports.free_ports(1)
    (service,) = local.services(state_dir, {"prefect": port}, ("prefect",))
    local.start(service)
    url = f"{service.url}/api"
    os.environ["PREFECT_API_URL"] = url  # for subprocesses, e.g. a raw script's driver
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        local.stop(service)
        shutil.rmtree(state_dir, ignore_errors=True)


def task_runs_named(client, flow_run_id: str, prefix: str) -> list:
    """`flow_run_id`'s task runs whose name starts with `prefix` (Prefect names a task run
    after its task, with a suffix): what a benchmark reads its phases' times from."""
    from prefect.client.schemas.filters import FlowRunFilter

    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    return [run for run in runs if run.name.startswith(prefix)]
