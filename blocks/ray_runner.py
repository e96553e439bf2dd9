"""A prefect-ray RayTaskRunner that carries the flow's Prefect API into every Ray worker.

Stock prefect-ray serialises the flow's settings context, but when the flow process uses
Prefect's temporary (ephemeral) server that context holds no API URL: each Ray worker then
starts a temporary server of its own (20+ s) and records its task runs there (upstream
PrefectHQ/prefect#18485). This runner resolves the API URL the flow process really uses and
writes it into the context each Ray task hydrates, with ephemeral mode off on the worker, so
a worker that still cannot reach the API fails loudly instead of silently going elsewhere.
Crash-aware retries: a Ray system failure (the worker process died, its node died, it was
killed for memory) is re-run by Ray up to `crash_retries` times, but never behind Prefect's
back: the re-run reads the task run from the API, records "AwaitingRetry: Ray worker crashed"
and runs it as the next attempt of the same task run (run_count goes up), after a backoff.
User exceptions never reach Ray (the task engine turns them into a Failed state), so they
follow the task's own retry settings. With crash_retries=0 a dead worker's task run ends
Crashed, and Ray never runs its body again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any
from uuid import UUID, uuid4

from prefect.context import FlowRunContext, serialize_context
from prefect.futures import PrefectFuture
from prefect.logging.loggers import get_logger
from prefect.settings import get_current_settings
from prefect.tasks import Task
from prefect.utilities.engine import collect_task_run_inputs_sync
from prefect_ray.context import RemoteOptionsContext
from prefect_ray.task_runners import PrefectRayFuture, RayTaskRunner

from blocks.ray_cluster import RayCluster

CRASH_RETRIES = 2  # Ray-level re-runs after a system failure, each recorded in Prefect
CRASH_BACKOFF_S = 1.0  # first re-run waits this long, then twice as long each time


logger = get_logger(__name__)
RAY_OPTIONS_ATTRIBUTE = "__ray_options__"


def ray_options(**options: Any):
    """Ray resources and options for one Prefect task, on the task itself:

        @task
        @ray_options(num_cpus=2, memory=2 * 1024**3, runtime_env={"env_vars": {"A": "1"}})
        def train(...): ...

    Any `ray.remote` option is accepted (num_cpus, num_gpus, memory, resources, runtime_env,
    scheduling_strategy, ...). prefect-ray's `remote_options` context still wins over these.
    """
    import ray  # noqa: F401  (the private module below expects the package loaded first)
    from ray._common.ray_option_utils import task_options

    unknown = set(options) - set(task_options)
    if unknown:
        raise ValueError(f"unknown Ray task options: {sorted(unknown)}")

    def attach(fn):
        setattr(fn, RAY_OPTIONS_ATTRIBUTE, dict(options))
        return fn

    return attach


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
        crash_retries: int = CRASH_RETRIES,
        crash_backoff_s: float = CRASH_BACKOFF_S,
    ):
        if crash_retries < 0 or crash_backoff_s < 0:
            raise ValueError(f"crash_retries ({crash_retries}) and crash_backoff_s "
                             f"({crash_backoff_s}) must be >= 0")
        self.cluster = cluster or RayCluster()
        self.crash_retries = crash_retries
        self.crash_backoff_s = crash_backoff_s
        # Ray only retries system failures by default (retry_exceptions is off), and each
        # re-run is recorded in Prefect by _run_on_ray.
        self.remote_defaults = {**(remote_defaults or {}), "max_retries": crash_retries}
        self._worker_settings: dict[str, Any] | None = None
        super().__init__(address=self.cluster.ray_init_address,
                         init_kwargs=self.cluster.init_kwargs())

    def duplicate(self) -> ProjectRayTaskRunner:
        return type(self)(cluster=self.cluster, remote_defaults=self.remote_defaults,
                          crash_retries=self.crash_retries, crash_backoff_s=self.crash_backoff_s)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ProjectRayTaskRunner) and self.cluster == other.cluster
                and self.remote_defaults == other.remote_defaults
                and self.crash_retries == other.crash_retries)

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
        options = {**self.remote_defaults, **getattr(task.fn, RAY_OPTIONS_ATTRIBUTE, {}),
                   **RemoteOptionsContext.get().current_remote_options}
        flow_run = FlowRunContext.get()
        name = task.name if flow_run is None or flow_run.flow_run is None else (
            f"{task.name} (flow run {flow_run.flow_run.id})")
        object_ref = (
            ray.remote(**options)(_run_on_ray)
            .options(name=name)
            .remote(
                *upstream_refs,
                task=task,
                task_run_id=task_run_id,
                parameters=parameters,
                wait_for=wait_for,
                dependencies=dependencies,
                context=context,
                crash_backoff_s=self.crash_backoff_s,
            )
        )
        future = CrashRecordingRayFuture(task_run_id=task_run_id, wrapped_future=object_ref)
        future.task = task
        future.flow_run_id = flow_run.flow_run.id if flow_run and flow_run.flow_run else None
        return future


class CrashRecordingRayFuture(PrefectRayFuture):
    """A PrefectRayFuture that, when Ray gives up on a crashed task, also records Crashed in
    the API (stock prefect-ray only keeps it in the flow process, and the UI shows Running,
    or nothing at all when the dead worker never sent its events)."""

    task: Task[Any, Any] | None = None
    flow_run_id: UUID | None = None

    def wait(self, timeout: float | None = None) -> None:
        super().wait(timeout)
        self._record_crash()

    def result(self, timeout: float | None = None, raise_on_failure: bool = True):
        if self._final_state is None:
            self.wait(timeout)
        return super().result(timeout=timeout, raise_on_failure=raise_on_failure)

    def _record_crash(self) -> None:
        state = self._final_state
        if state is None or not state.is_crashed() or getattr(self, "_crash_recorded", False):
            return
        self._crash_recorded = True
        import httpx
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        try:
            with get_client(sync_client=True) as client:
                try:
                    client.set_task_run_state(self.task_run_id, state, force=True)
                except (ObjectNotFound, httpx.HTTPStatusError) as missing:
                    if getattr(getattr(missing, "response", None), "status_code", 404) != 404:
                        raise
                    client.create_task_run(self.task, self.flow_run_id,
                                           dynamic_key=str(self.task_run_id),
                                           id=self.task_run_id, state=state)
        except Exception as error:  # the flow still sees Crashed; only the UI lags
            logger.warning("Could not record Crashed for task run %s: %s",
                           self.task_run_id, error)


def _run_on_ray(
    *upstream_refs: Any,
    task: Task[Any, Any],
    task_run_id: UUID,
    context: dict[str, Any],
    parameters: dict[str, Any],
    wait_for: Iterable[PrefectFuture[Any]] | None = None,
    dependencies: dict[str, set[Any]] | None = None,
    crash_backoff_s: float = CRASH_BACKOFF_S,
) -> Any:
    """Run one Prefect task run in a Ray worker; when Ray re-runs it after a system failure,
    continue the same task run as its next, recorded attempt."""
    import asyncio

    import ray
    from prefect.task_engine import run_task_async, run_task_sync
    from prefect.utilities.collections import visit_collection

    _adopt_flow_settings(context)
    parameters = visit_collection(
        parameters, visit_fn=lambda x: ray.get(x) if isinstance(x, ray.ObjectRef) else x,
        return_data=True)
    attempt = ray._private.worker.global_worker.core_worker.get_current_task_attempt_number()
    task_run = None
    if attempt > 0:
        time.sleep(crash_backoff_s * 2 ** (attempt - 1))
        task_run = _continue_after_crash(task_run_id, context, attempt)
    kwargs: dict[str, Any] = dict(task=task, parameters=parameters, wait_for=wait_for,
                                  dependencies=dependencies, context=context,
                                  return_type="state")
    if task_run is None:
        kwargs["task_run_id"] = task_run_id
    else:
        kwargs["task_run"] = task_run
    logs = _TaskRunLogs(context)
    try:
        if task.isasync:
            return asyncio.run(run_task_async(**kwargs))
        if attempt == 0 or task_run is not None:
            return run_task_sync(**kwargs)
        return _run_sync_counting_lost_attempts(task_run_id, attempt, kwargs)
    finally:
        logs.send()


class _TaskRunLogs:
    """Collects what a task run logs in this Ray worker and hands it, when the run ends, to a
    sender thread that posts it at once. Prefect's own log worker only flushes a batch on its
    next log or at process exit, and idle Ray workers are killed, not exited: measured, a
    task's logs never reached the API. The POST (about 8 ms) stays off the task's path.
    (Prefect's ProcessPoolTaskRunner swaps the same sink.)"""

    _queue: Any = None  # (api_url, body) for the sender thread, one per worker process

    def __init__(self, context: dict[str, Any]):
        from prefect.logging.handlers import set_api_log_sink

        self.api_url = context["settings_context"]["settings"]["api"]["url"]
        self.logs: list[dict[str, Any]] = []
        set_api_log_sink(self.logs.append)

    def send(self) -> None:
        import orjson
        from prefect.logging.handlers import set_api_log_sink

        set_api_log_sink(None)
        if not self.logs:
            return
        body = orjson.dumps([{k: v for k, v in log.items() if k != "__payload_size__"}
                             for log in self.logs])
        self._sender().put((self.api_url, body))

    @classmethod
    def _sender(cls):
        import queue
        import threading

        if cls._queue is None:
            cls._queue = queue.Queue()
            threading.Thread(target=cls._post_forever, args=(cls._queue,), daemon=True,
                             name="prefect-ray-task-logs").start()
        return cls._queue

    @staticmethod
    def _post_forever(pending) -> None:
        from prefect.client.orchestration import get_client

        clients: dict[str, Any] = {}  # one per API URL: opening one costs about 60 ms
        while True:
            api_url, body = pending.get()
            try:
                if api_url not in clients:
                    # Global settings hold this URL already (_adopt_flow_settings).
                    clients[api_url] = get_client(sync_client=True).__enter__()
                clients[api_url].request("POST", "/logs/", content=body,
                                         headers={"Content-Type": "application/json"})
            except Exception as error:  # logs are best effort; the task's outcome is not
                logger.warning("Could not send a task run's logs to %s: %s", api_url, error)


def _run_sync_counting_lost_attempts(task_run_id: UUID, attempt: int, kwargs: dict[str, Any]):
    """run_task_sync for a re-run whose crashed attempts never reached the API (the worker
    died before its events were sent): the run is created afresh, and its run_count then
    counts those lost attempts too."""
    from prefect.task_engine import SyncTaskRunEngine

    engine = SyncTaskRunEngine(task=kwargs["task"], parameters=kwargs["parameters"],
                               wait_for=kwargs["wait_for"], context=kwargs["context"])
    with engine.start(task_run_id=task_run_id, dependencies=kwargs["dependencies"]):
        if engine.task_run is not None:
            engine.task_run.run_count += attempt
            engine.logger.warning("Attempt %s of this task run: the Ray worker running the "
                                  "previous one crashed", engine.task_run.run_count)
        while engine.is_running():
            engine.wait_until_ready()
            with (engine.asset_context(), engine.run_context(),
                  engine.transaction_context() as txn):
                engine.call_task_fn(txn)
    return engine.state


def _adopt_flow_settings(context: dict[str, Any]) -> None:
    """Make the flow's settings this worker process's global ones. The task engine hydrates
    them per task, but Prefect's background services (the API log worker, the events worker)
    run in their own thread and read the process-global settings: without this they have no
    API URL, start a temporary server, and the task's logs never reach its task run."""
    import prefect.context
    from prefect.context import SettingsContext

    wanted = context["settings_context"]["settings"]["api"]["url"]
    if prefect.context.GLOBAL_SETTINGS_CONTEXT.settings.api.url != wanted:
        # Building settings re-reads env and profiles (about 30 ms): once per process.
        prefect.context.GLOBAL_SETTINGS_CONTEXT = SettingsContext(**context["settings_context"])


def _continue_after_crash(task_run_id: UUID, context: dict[str, Any], attempt: int):
    """The crashed attempt's task run, marked AwaitingRetry; None when the crashed worker
    died before the API heard of it (the engine then creates the run afresh)."""
    from prefect.client.orchestration import get_client
    from prefect.context import SettingsContext
    from prefect.states import AwaitingRetry
    from prefect.utilities.engine import emit_task_run_state_change_event

    with SettingsContext(**context["settings_context"]):
        try:
            with get_client(sync_client=True) as client:
                task_run = client.read_task_run(task_run_id)
        except Exception as error:
            logger.debug("Task run %s is not in the API (%r): its crashed worker died "
                         "before sending its events", task_run_id, error)
            return None
        previous = task_run.state
        task_run.state = AwaitingRetry(
            scheduled_time=None,
            message=f"Ray worker crashed; Ray re-run {attempt} of this task run")
        emit_task_run_state_change_event(task_run=task_run, initial_state=previous,
                                         validated_state=task_run.state)
    return task_run
