"""A Prefect task runner on Ray that carries the flow's Prefect API and lineage into Ray."""

from prefect_ray_lifecycle.ray_runner.lineage import (
    JOB_METADATA_FLOW_RUN_ID,
    RAY_DASHBOARD_ARTIFACT_KEY,
    prefect_ids_in_name,
    ray_dashboard_url,
    ray_task_name,
)
from prefect_ray_lifecycle.ray_runner.options import RAY_OPTIONS_ATTRIBUTE, ray_options
from prefect_ray_lifecycle.ray_runner.runner import (
    CRASH_BACKOFF_S,
    CRASH_RETRIES,
    RAY_CLIENT_LIMITS,
    CrashRecordingRayFuture,
    RayClusterTaskRunner,
)
from prefect_ray_lifecycle.ray_runner.settings import PrefectAPIUnavailable, prefect_api_url

__all__ = [
    "CRASH_BACKOFF_S",
    "CRASH_RETRIES",
    "JOB_METADATA_FLOW_RUN_ID",
    "RAY_CLIENT_LIMITS",
    "RAY_DASHBOARD_ARTIFACT_KEY",
    "RAY_OPTIONS_ATTRIBUTE",
    "CrashRecordingRayFuture",
    "PrefectAPIUnavailable",
    "RayClusterTaskRunner",
    "prefect_api_url",
    "prefect_ids_in_name",
    "ray_dashboard_url",
    "ray_options",
    "ray_task_name",
]
