"""A prefect-ray RayTaskRunner that carries the flow's Prefect API into every Ray worker.

Stock prefect-ray serialises the flow's settings context, but when the flow process uses
Prefect's temporary (ephemeral) server that context holds no API URL: each Ray worker then
starts a temporary server of its own (20+ s) and records its task runs there (upstream
PrefectHQ/prefect#18485). This runner resolves the API URL the flow process really uses and
writes it into the context each Ray task hydrates, with ephemeral mode off on the worker, so
a worker that still cannot reach the API fails loudly instead of silently going elsewhere.
It also runs Prefect tasks with Ray-level `max_retries=0`: Prefect's retries decide.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from uuid import uuid4

from prefect.context import FlowRunContext, serialize_context
from prefect.futures import PrefectFuture
from prefect.settings import get_current_settings
from prefect.tasks import Task
from prefect.utilities.engine import collect_task_run_inputs_sync
from prefect_ray.context import RemoteOptionsContext
from prefect_ray.task_runners import PrefectRayFuture, RayTaskRunner

from blocks.ray_cluster import RayCluster

# Ray must never re-run a Prefect task run behind Prefect's back (worker crash -> same
# task_run_id run twice); retries are Prefect's.
RAY_TASK_DEFAULTS: dict[str, Any] = {"max_retries": 0}


class PrefectAPIUnavailable(RuntimeError):
    """The flow process has no Prefect API that Ray workers could reach."""


def prefect_api_url() -> str:
    """The API URL this process's Prefect client uses, starting the temporary server if that
    is what the client would do anyway."""
    settings = get_current_settings()
    if settings.api.url:
        return settings.api.url
    if not settings.server.ephemeral.enabled:
        raise PrefectAPIUnavailable(
            "PREFECT_API_URL is not set and ephemeral mode is off: Ray workers would have no "
            "Prefect API to record task runs in")
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return server.api_url


def worker_settings_overrides(api_url: str) -> dict[str, Any]:
    """Settings merged into the context every Ray task hydrates."""
    return {"api": {"url": api_url}, "server": {"ephemeral": {"enabled": False}}}


def _deep_merge(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class ProjectRayTaskRunner(RayTaskRunner):
    """RayTaskRunner built from a RayCluster block (see the module docstring)."""

    def __init__(
        self,
        cluster: RayCluster | None = None,
        remote_defaults: dict[str, Any] | None = None,
    ):
        self.cluster = cluster or RayCluster()
        self.remote_defaults = {**RAY_TASK_DEFAULTS, **(remote_defaults or {})}
        self._worker_settings: dict[str, Any] | None = None
        super().__init__(address=self.cluster.ray_init_address,
                         init_kwargs=self.cluster.init_kwargs())

    def duplicate(self) -> ProjectRayTaskRunner:
        return type(self)(cluster=self.cluster, remote_defaults=self.remote_defaults)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ProjectRayTaskRunner) and self.cluster == other.cluster
                and self.remote_defaults == other.remote_defaults)

    def __enter__(self) -> ProjectRayTaskRunner:
        self._worker_settings = worker_settings_overrides(prefect_api_url())
        self.cluster.export_auth_token()
        super().__enter__()
        return self

    @property
    def worker_settings(self) -> dict[str, Any]:
        if self._worker_settings is None:
            raise RuntimeError("The task runner must be started before submitting work.")
        return self._worker_settings

    def submit(
        self,
        task: Task[Any, Any],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
        dependencies: dict[str, set[Any]] | None = None,
    ) -> PrefectRayFuture[Any]:
        # Mirrors RayTaskRunner.submit, plus: worker settings, Ray-level defaults, and the
        # flow run id in the Ray task name so the dashboard ties each task to its flow run.
        import ray

        if not self._started:
            raise RuntimeError("The task runner must be started before submitting work.")
        task_run_id = uuid4()
        task_inputs = {
            k: collect_task_run_inputs_sync(v, future_cls=PrefectRayFuture)
            for k, v in parameters.items()
        }
        context = serialize_context(asset_ctx_kwargs={
            "task": task, "task_run_id": task_run_id,
            "task_inputs": task_inputs, "copy_to_child_ctx": True,
        })
        settings_context = context.get("settings_context") or {}
        settings_context["settings"] = _deep_merge(settings_context.get("settings") or {},
                                                   self.worker_settings)
        context["settings_context"] = settings_context

        parameters, upstream_refs = self._exchange_prefect_for_ray_futures(parameters)
        options = {**self.remote_defaults, **RemoteOptionsContext.get().current_remote_options}
        flow_run = FlowRunContext.get()
        name = task.name if flow_run is None or flow_run.flow_run is None else (
            f"{task.name} (flow run {flow_run.flow_run.id})")
        object_ref = (
            ray.remote(**options)(self._run_prefect_task)
            .options(name=name)
            .remote(
                *upstream_refs,
                task=task,
                task_run_id=task_run_id,
                parameters=parameters,
                wait_for=wait_for,
                dependencies=dependencies,
                context=context,
            )
        )
        return PrefectRayFuture(task_run_id=task_run_id, wrapped_future=object_ref)
