"""Lineage between a flow run and its Ray work, readable from either side.

The Ray job the runner starts has the flow run id in its metadata; every Ray task of a task
run is named "<task> [flow_run=<id> task_run=<id>]", and Ray tasks started from it, at any
depth, "<function> [flow_run=<id> from_task_run=<id>]"; the flow run gets ray.* labels and a
link artifact to its job on the Ray dashboard.
"""

from __future__ import annotations

import re
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate
from prefect.logging.loggers import get_logger
from prefect.utilities.importtools import lazy_import

from prefect_ray_lifecycle.blocks.ray_cluster import RayCluster
from prefect_ray_lifecycle.compat import ray_internals

# Ray loads on first use (as in prefect-ray): importing a flow module must not pay for it.
ray = lazy_import("ray")

logger = get_logger(__name__)

RAY_DASHBOARD_ARTIFACT_KEY = "ray-dashboard"
JOB_METADATA_FLOW_RUN_ID = "prefect_flow_run_id"
NAME_TAG = re.compile(
    r" \[flow_run=(?P<flow_run>[0-9a-f-]{36}) "
    r"(?P<kind>task_run|from_task_run)=(?P<task_run>[0-9a-f-]{36})\]$"
)


def ray_task_name(
    name: str, flow_run_id: UUID | str, task_run_id: UUID | str, started_from: bool = False
) -> str:
    """The Ray task name carrying a task run's ids (`started_from`: a Ray task started inside
    it). Copied by value into workers: it uses no module global."""
    kind = "from_task_run" if started_from else "task_run"
    return f"{name} [flow_run={flow_run_id} {kind}={task_run_id}]"


def prefect_ids_in_name(name: str | None) -> tuple[str, str, bool] | None:
    """(flow run id, task run id, started from the task run) carried by a Ray task name.
    Copied by value into workers: it uses NAME_TAG only."""
    match = NAME_TAG.search(name or "")
    if match is None:
        return None
    return match["flow_run"], match["task_run"], match["kind"] == "from_task_run"


def child_tasks_key(flow_run_id: UUID | str) -> str:
    """Ray KV key flagging that a task run of this flow run started Ray tasks of its own."""
    return f"children-of-flow-run:{flow_run_id}"


def job_config(flow_run_id: UUID) -> Any:
    """The Ray JobConfig of a job started for this flow run: its id in the job's metadata."""
    return ray.job_config.JobConfig(metadata={JOB_METADATA_FLOW_RUN_ID: str(flow_run_id)})


def ray_dashboard_url(cluster: RayCluster, ray_context: Any = None) -> str | None:
    """The block's dashboard URL, else the one Ray reports for this connection."""
    url = (
        cluster.dashboard_url
        or getattr(ray_context, "dashboard_url", None)
        or (ray_internals.dashboard_url() if ray.is_initialized() else None)
    )
    if not url:
        return None
    url = url.rstrip("/")
    return url if "://" in url else f"http://{url}"


def link_flow_run(flow_run_id: UUID, cluster: RayCluster, ray_context: Any = None) -> None:
    """Label the flow run with its Ray job and dashboard, and add a link artifact to the
    dashboard's page of the job. Best effort: a failure only logs a warning."""
    try:
        job_id = ray.get_runtime_context().get_job_id()
        dashboard = ray_dashboard_url(cluster, ray_context)
        labels: dict[str, Any] = {"ray.job_id": job_id, "ray.namespace": cluster.namespace}
        if dashboard:
            labels["ray.dashboard_url"] = dashboard
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(flow_run_id, labels)
            if dashboard:
                client.create_artifact(
                    ArtifactCreate(
                        key=RAY_DASHBOARD_ARTIFACT_KEY,
                        type="markdown",
                        data=f"[Ray job {job_id}]({dashboard}/#/jobs/{job_id})",
                        description=f"This flow run's Ray job on the Ray dashboard ({dashboard})",
                        flow_run_id=flow_run_id,
                    )
                )
    except Exception as error:
        logger.warning("Could not link flow run %s to its Ray job: %s", flow_run_id, error)
