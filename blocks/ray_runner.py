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
Crashed, and Ray never runs its body again. A user retry waits out its retry_delay_seconds
blocked in ray.get on a zero-CPU timer task, so its CPUs serve other tasks meanwhile.
Lineage: the Ray job started by the runner has the flow run id in its metadata; every Ray
task of a task run is named "<task> [flow_run=<id> task_run=<id>]", and Ray tasks started
from it, at any depth, "<function> [flow_run=<id> from_task_run=<id>]" (a worker setup hook
names them); the flow run gets ray.* labels and a link artifact to its job on the Ray
dashboard. What those started tasks print or log reaches the flow process through Ray's own
log stream and is posted under their task run.
"""

from __future__ import annotations

import re
import threading
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
            "Prefect API to record task runs in"
        )
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


RAY_DASHBOARD_ARTIFACT_KEY = "ray-dashboard"
JOB_METADATA_FLOW_RUN_ID = "prefect_flow_run_id"
KV_NAMESPACE = "prefect-ray-lifecycle"
# Ray task names carry their Prefect ids: "<task> [flow_run=<id> task_run=<id>]" for the Ray
# task running a Prefect task run, "<function> [flow_run=<id> from_task_run=<id>]" for Ray
# tasks started (at any depth) from inside one.
_NAME_TAG = re.compile(
    r" \[flow_run=(?P<flow_run>[0-9a-f-]{36}) "
    r"(?P<kind>task_run|from_task_run)=(?P<task_run>[0-9a-f-]{36})\]$"
)


def ray_task_name(
    name: str, flow_run_id: UUID | str, task_run_id: UUID | str, started_from: bool = False
) -> str:
    kind = "from_task_run" if started_from else "task_run"
    return f"{name} [flow_run={flow_run_id} {kind}={task_run_id}]"


def prefect_ids_in_name(name: str | None) -> tuple[str, str, bool] | None:
    """(flow run id, task run id, started from the task run) carried by a Ray task name."""
    match = _NAME_TAG.search(name or "")
    if match is None:
        return None
    return match["flow_run"], match["task_run"], match["kind"] == "from_task_run"


def ray_dashboard_url(cluster: RayCluster, ray_context: Any = None) -> str | None:
    """The block's dashboard URL, else the one Ray reports for this connection."""
    import ray

    url = (
        cluster.dashboard_url
        or getattr(ray_context, "dashboard_url", None)
        or (ray._private.worker.get_dashboard_url() if ray.is_initialized() else None)
    )
    if not url:
        return None
    url = url.rstrip("/")
    return url if "://" in url else f"http://{url}"


def _job_config(flow_run_id: UUID):
    from ray.job_config import JobConfig

    return JobConfig(metadata={JOB_METADATA_FLOW_RUN_ID: str(flow_run_id)})


def _flow_run_being_started() -> UUID | None:
    """The flow run whose engine is entering this task runner. Prefect 3 enters the runner
    before the FlowRunContext (FlowRunContext.get() is then the parent of a subflow, or
    None), so the id is read from the engine's frame; PREFECT__FLOW_RUN_ID (set for
    deployment runs) is the fallback."""
    import inspect
    import os

    from prefect.flow_engine import BaseFlowRunEngine

    frame = inspect.currentframe()
    try:
        for _ in range(12):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                break
            engine = frame.f_locals.get("self")
            if isinstance(engine, BaseFlowRunEngine) and engine.flow_run is not None:
                return engine.flow_run.id
    finally:
        del frame
    value = os.environ.get("PREFECT__FLOW_RUN_ID")
    try:
        return UUID(value) if value else None
    except ValueError:
        return None


class _ChildTaskLogs:
    """Driver side (the flow process): what Ray tasks started from inside a Prefect task run
    print or log reaches the driver through Ray's own log stream (log_to_driver), with the
    Ray task's name; names tagged "from_task_run" (see _tag_child_tasks) are posted as
    that task run's logs. Nothing runs in the workers but the naming, so no Ray worker is
    dedicated to a task run. One handler per process, shared by nested task runners."""

    HANDLER = "prefect-ray-child-task-logs"
    QUIET_S = 0.5  # Ray's log monitor polls files every 0.1 s when idle
    DRAIN_LIMIT_S = 3.0
    _users = 0
    _lock = threading.Lock()
    _last_line = 0.0  # monotonic time of the last forwarded batch

    @classmethod
    def drain(cls, flow_run_id: UUID) -> None:
        """At the end of a flow run whose task runs started Ray tasks (a flag they leave in
        Ray's KV store), wait until the log stream has been quiet for QUIET_S, at most
        DRAIN_LIMIT_S, then until the sender thread has posted: their last lines may still
        be on their way. A flow run without such tasks pays one KV lookup."""
        from ray.experimental.internal_kv import _internal_kv_del

        if not _internal_kv_del(_children_key(flow_run_id), namespace=KV_NAMESPACE):
            return
        started = time.monotonic()
        deadline = started + cls.DRAIN_LIMIT_S
        while time.monotonic() < deadline and (
            time.monotonic() - max(started, cls._last_line) < cls.QUIET_S
        ):
            time.sleep(0.05)
        _TaskRunLogs.wait_sent(max(0.0, deadline - time.monotonic()) + 1.0)

    @classmethod
    def start(cls, api_url: str) -> bool:
        import ray

        worker = ray._private.worker.global_worker
        if worker.mode != ray._private.worker.SCRIPT_MODE:
            return False  # Ray Client or a driver inside a worker: no log stream here
        from ray._private.ray_logging import global_worker_stdstream_dispatcher

        with cls._lock:
            cls._users += 1
            if cls._users == 1:
                global_worker_stdstream_dispatcher.add_handler(
                    cls.HANDLER, lambda data: cls._forward_safely(api_url, data)
                )
        return True

    @classmethod
    def stop(cls) -> None:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher

        with cls._lock:
            if cls._users == 0:
                return
            cls._users -= 1
            if cls._users == 0:
                global_worker_stdstream_dispatcher.remove_handler(cls.HANDLER)

    @classmethod
    def _forward_safely(cls, api_url: str, data: dict[str, Any]) -> None:
        try:  # an exception here would end Ray's log thread in this process
            cls._forward(api_url, data)
        except Exception as error:
            logger.debug("Could not forward Ray task logs: %r", error)

    @staticmethod
    def _forward(api_url: str, data: dict[str, Any]) -> None:
        ids = prefect_ids_in_name(data.get("task_name"))
        if ids is None or not ids[2] or not data.get("lines"):
            return  # not from a task run's child (the task run's own logs come by _TaskRunLogs)
        import datetime

        import orjson

        flow_run_id, task_run_id, _ = ids
        function = _NAME_TAG.sub("", data["task_name"])
        timestamp = datetime.datetime.now(datetime.UTC).isoformat()
        body = orjson.dumps(
            [
                {
                    "name": f"ray.{function}",
                    "level": 20,
                    "message": line,
                    "timestamp": timestamp,
                    "flow_run_id": flow_run_id,
                    "task_run_id": task_run_id,
                }
                for line in data["lines"]
            ]
        )
        _ChildTaskLogs._last_line = time.monotonic()
        _TaskRunLogs._sender().put((api_url, body))


def _children_key(flow_run_id: UUID | str) -> str:
    return f"children-of-flow-run:{flow_run_id}"


def _tag_child_tasks() -> None:
    """In a Ray worker: Ray tasks submitted from a task whose name carries Prefect ids get
    those ids in their own name (unless given a name), so they, and what they print, can be
    tied to the task run. Installed in every worker of the runner's job at its start (see
    _worker_setup_hook), else once in each worker that runs a Prefect task run; the tag is
    read from the running Ray task's name, so nothing leaks between tasks."""
    import functools

    import ray
    from ray.remote_function import RemoteFunction

    if getattr(RemoteFunction._remote, "_tags_prefect_children", False):
        return
    submit = RemoteFunction._remote
    flagged: set[str] = set()  # flow runs whose KV flag this process has set

    @functools.wraps(submit)
    def _remote(self, *args: Any, **options: Any):
        if not options.get("name"):
            ids = prefect_ids_in_name(ray.get_runtime_context().get_task_name())
            if ids is not None:
                function = (
                    getattr(self._function_descriptor, "function_name", "")
                    or self._function_name.rsplit(".", 1)[-1]
                )
                options["name"] = ray_task_name(
                    function.rsplit(".", 1)[-1], ids[0], ids[1], started_from=True
                )
                if ids[0] not in flagged:  # the driver then waits for their logs
                    from ray.experimental.internal_kv import _internal_kv_put

                    _internal_kv_put(_children_key(ids[0]), b"1", namespace=KV_NAMESPACE)
                    flagged.add(ids[0])
        return submit(self, *args, **options)

    _remote._tags_prefect_children = True
    RemoteFunction._remote = _remote


def _by_value(*functions: Any) -> Any:
    """Copies of `functions` (the last returned) in a module no worker can import, so Ray
    pickles them by value: a worker loads them without importing this module and Prefect
    (about a second per fresh worker)."""
    import types

    namespace: dict[str, Any] = {
        "__name__": "prefect_ray_by_value",
        "re": re,
        "time": time,
        "_NAME_TAG": _NAME_TAG,
        "KV_NAMESPACE": KV_NAMESPACE,
    }
    for function in functions:
        copy = types.FunctionType(
            function.__code__,
            namespace,
            function.__name__,
            function.__defaults__,
            function.__closure__,
        )
        copy.__module__, copy.__qualname__ = namespace["__name__"], function.__qualname__
        namespace[function.__name__] = copy
    return namespace[functions[-1].__name__]


def _worker_setup_hook():
    """_tag_child_tasks as a worker_process_setup_hook that every worker of the job runs at
    start, so Ray tasks started at any depth below a task run are tagged."""
    return _by_value(ray_task_name, prefect_ids_in_name, _children_key, _tag_child_tasks)


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
            raise ValueError(
                f"crash_retries ({crash_retries}) and crash_backoff_s "
                f"({crash_backoff_s}) must be >= 0"
            )
        self.cluster = cluster or RayCluster()
        self.crash_retries = crash_retries
        self.crash_backoff_s = crash_backoff_s
        # Ray only retries system failures by default (retry_exceptions is off), and each
        # re-run is recorded in Prefect by _run_on_ray.
        self.remote_defaults = {**(remote_defaults or {}), "max_retries": crash_retries}
        self._worker_settings: dict[str, Any] | None = None
        self._flow_run_id: UUID | None = None
        self._child_logs = False  # this runner holds a share of _ChildTaskLogs' handler
        super().__init__(
            address=self.cluster.ray_init_address, init_kwargs=self.cluster.init_kwargs()
        )

    def duplicate(self) -> ProjectRayTaskRunner:
        return type(self)(
            cluster=self.cluster,
            remote_defaults=self.remote_defaults,
            crash_retries=self.crash_retries,
            crash_backoff_s=self.crash_backoff_s,
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ProjectRayTaskRunner)
            and self.cluster == other.cluster
            and self.remote_defaults == other.remote_defaults
            and self.crash_retries == other.crash_retries
        )

    def __enter__(self) -> ProjectRayTaskRunner:
        import ray

        self._worker_settings = worker_settings_overrides(prefect_api_url())
        self.cluster.export_auth_token()
        # Prefect enters the task runner before it opens the flow run's context: the run
        # being started is read from the engine (None when not found; linked at first submit).
        self._flow_run_id = _flow_run_being_started()
        if not ray.is_initialized():  # we start the Ray job: it carries the flow run
            kwargs = dict(self.init_kwargs)
            if self._flow_run_id is not None:
                kwargs["job_config"] = _job_config(self._flow_run_id)
            runtime_env = dict(kwargs.get("runtime_env") or {})
            runtime_env.setdefault("worker_process_setup_hook", _worker_setup_hook())
            kwargs["runtime_env"] = runtime_env
            self.init_kwargs = kwargs
        super().__enter__()
        self._child_logs = _ChildTaskLogs.start(self.worker_settings["api"]["url"])
        if self._flow_run_id is not None:
            self._link_flow_run(self._flow_run_id)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if self._child_logs and self._flow_run_id is not None:
                _ChildTaskLogs.drain(self._flow_run_id)
        finally:
            if self._child_logs:
                self._child_logs = False
                _ChildTaskLogs.stop()
            super().__exit__(*exc_info)

    def _link_flow_run(self, flow_run_id: UUID) -> None:
        """Label the flow run with its Ray job and dashboard, and add a link artifact to the
        dashboard's page of the job. Best effort: a failure only logs a warning."""
        import ray

        try:
            job_id = ray.get_runtime_context().get_job_id()
            dashboard = ray_dashboard_url(
                self.cluster, self._ray_context if self._owns_ray else None
            )
            labels: dict[str, Any] = {"ray.job_id": job_id, "ray.namespace": self.cluster.namespace}
            if dashboard:
                labels["ray.dashboard_url"] = dashboard
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.actions import ArtifactCreate

            with get_client(sync_client=True) as client:
                client.update_flow_run_labels(flow_run_id, labels)
                if dashboard:
                    client.create_artifact(
                        ArtifactCreate(
                            key=RAY_DASHBOARD_ARTIFACT_KEY,
                            type="markdown",
                            data=f"[Ray job {job_id}]({dashboard}/#/jobs/{job_id})",
                            description=f"This flow run's Ray job on the Ray dashboard "
                            f"({dashboard})",
                            flow_run_id=flow_run_id,
                        )
                    )
        except Exception as error:
            logger.warning("Could not link flow run %s to its Ray job: %s", flow_run_id, error)

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
        context = serialize_context(
            asset_ctx_kwargs={
                "task": task,
                "task_run_id": task_run_id,
                "task_inputs": task_inputs,
                "copy_to_child_ctx": True,
            }
        )
        settings_context = context.get("settings_context") or {}
        settings_context["settings"] = _deep_merge(
            settings_context.get("settings") or {}, self.worker_settings
        )
        context["settings_context"] = settings_context

        parameters, upstream_refs = self._exchange_prefect_for_ray_futures(parameters)
        options = {
            **self.remote_defaults,
            **getattr(task.fn, RAY_OPTIONS_ATTRIBUTE, {}),
            **RemoteOptionsContext.get().current_remote_options,
        }
        flow_run = FlowRunContext.get()
        flow_run_id = flow_run.flow_run.id if flow_run and flow_run.flow_run else None
        if flow_run_id is not None and self._flow_run_id is None:
            # Not found while entering: linked at the first submit instead.
            self._flow_run_id = flow_run_id
            self._link_flow_run(flow_run_id)
        name = (
            task.name if flow_run_id is None else ray_task_name(task.name, flow_run_id, task_run_id)
        )
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
        future.flow_run_id = flow_run_id
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
                    client.create_task_run(
                        self.task,
                        self.flow_run_id,
                        dynamic_key=str(self.task_run_id),
                        id=self.task_run_id,
                        state=state,
                    )
        except Exception as error:  # the flow still sees Crashed; only the UI lags
            logger.warning("Could not record Crashed for task run %s: %s", self.task_run_id, error)


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
    from prefect.utilities.collections import visit_collection

    _adopt_flow_settings(context)
    _tag_child_tasks()
    parameters = visit_collection(
        parameters,
        visit_fn=lambda x: ray.get(x) if isinstance(x, ray.ObjectRef) else x,
        return_data=True,
    )
    attempt = ray._private.worker.global_worker.core_worker.get_current_task_attempt_number()
    task_run = None
    if attempt > 0:
        time.sleep(crash_backoff_s * 2 ** (attempt - 1))
        task_run = _continue_after_crash(task_run_id, context, attempt)
    kwargs: dict[str, Any] = dict(
        task=task,
        parameters=parameters,
        wait_for=wait_for,
        dependencies=dependencies,
        context=context,
        return_type="state",
    )
    if task_run is None:
        kwargs["task_run_id"] = task_run_id
    else:
        kwargs["task_run"] = task_run
    logs = _TaskRunLogs(context)
    try:
        if task.isasync:
            return asyncio.run(_run_async(kwargs))
        lost_attempts = attempt if attempt > 0 and task_run is None else 0
        return _run_sync(kwargs, lost_attempts)
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
        body = orjson.dumps(
            [{k: v for k, v in log.items() if k != "__payload_size__"} for log in self.logs]
        )
        self._sender().put((self.api_url, body))

    @classmethod
    def _sender(cls):
        import queue
        import threading

        if cls._queue is None:
            cls._queue = queue.Queue()
            threading.Thread(
                target=cls._post_forever,
                args=(cls._queue,),
                daemon=True,
                name="prefect-ray-task-logs",
            ).start()
        return cls._queue

    @classmethod
    def wait_sent(cls, timeout: float) -> None:
        """Wait (at most `timeout` s) until every queued batch has been posted."""
        deadline = time.monotonic() + timeout
        while (
            cls._queue is not None and cls._queue.unfinished_tasks and time.monotonic() < deadline
        ):
            time.sleep(0.02)

    @staticmethod
    def _post_forever(pending) -> None:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        clients: dict[str, Any] = {}  # one per API URL: opening one costs about 60 ms
        while True:
            api_url, body = pending.get()
            try:
                if api_url not in clients:
                    # This thread reads the process-global settings: name the URL.
                    with temporary_settings(updates={PREFECT_API_URL: api_url}):
                        clients[api_url] = get_client(sync_client=True).__enter__()
                clients[api_url].request(
                    "POST", "/logs/", content=body, headers={"Content-Type": "application/json"}
                )
            except Exception as error:  # logs are best effort; the task's outcome is not
                logger.warning("Could not send a task run's logs to %s: %s", api_url, error)
            finally:
                pending.task_done()


RETRY_DELAY_OFF_SLOT_S = 0.5  # shorter retry delays are slept in place


def retry_delay(until: float) -> None:
    time.sleep(max(0.0, until - time.time()))  # a fresh worker's start counts in the delay


def _wait_off_slot(state: Any) -> None:
    """Wait out a retry delay (AwaitingRetry's scheduled time) blocked in ray.get on a
    zero-CPU Ray task: Ray lends a blocked task's CPUs to other tasks meanwhile, where the
    Prefect engine's own time.sleep would hold them for the whole delay. The engine then
    finds the time passed and goes on with the next attempt in this same worker."""
    import datetime

    import ray

    scheduled = state.state_details.scheduled_time if state is not None else None
    if scheduled is None:
        return
    delay = (scheduled - datetime.datetime.now(datetime.UTC)).total_seconds()
    if delay >= RETRY_DELAY_OFF_SLOT_S:
        # Named, so it is not tagged as a child of the task run (whose flow run would then
        # wait at exit for child log lines that never come).
        ray.get(
            ray.remote(num_cpus=0, max_retries=3)(_by_value(retry_delay))
            .options(name="prefect-retry-delay")
            .remote(time.time() + delay)
        )


def _run_sync(kwargs: dict[str, Any], lost_attempts: int = 0):
    """prefect.task_engine.run_task_sync, with retry delays off the Ray slot; for a re-run
    whose crashed attempts never reached the API (the worker died before its events were
    sent: the run is created afresh) its run_count also counts those lost attempts."""
    from prefect._flow_run_suspension import raise_if_flow_run_suspension_requested
    from prefect.task_engine import SyncTaskRunEngine

    class Engine(SyncTaskRunEngine):
        def wait_until_ready(self) -> None:
            _wait_off_slot(self.state)
            super().wait_until_ready()

    engine = Engine(
        task=kwargs["task"],
        parameters=kwargs["parameters"],
        task_run=kwargs.get("task_run"),
        wait_for=kwargs["wait_for"],
        context=kwargs["context"],
    )
    with engine.start(task_run_id=kwargs.get("task_run_id"), dependencies=kwargs["dependencies"]):
        if lost_attempts and engine.task_run is not None:
            engine.task_run.run_count += lost_attempts
            engine.logger.warning(
                "Attempt %s of this task run: the Ray worker running the previous one crashed",
                engine.task_run.run_count,
            )
        while engine.is_running():
            engine.wait_until_ready()
            with engine.asset_context(), engine.run_context(), engine.transaction_context() as txn:
                engine.call_task_fn(txn)
            raise_if_flow_run_suspension_requested()
    return engine.state


async def _run_async(kwargs: dict[str, Any]):
    """prefect.task_engine.run_task_async, with retry delays off the Ray slot."""
    from prefect._flow_run_suspension import raise_if_flow_run_suspension_requested
    from prefect.task_engine import AsyncTaskRunEngine

    class Engine(AsyncTaskRunEngine):
        async def wait_until_ready(self) -> None:
            _wait_off_slot(self.state)  # blocks this task's own event loop only
            await super().wait_until_ready()

    engine = Engine(
        task=kwargs["task"],
        parameters=kwargs["parameters"],
        task_run=kwargs.get("task_run"),
        wait_for=kwargs["wait_for"],
        context=kwargs["context"],
    )
    async with engine.start(
        task_run_id=kwargs.get("task_run_id"), dependencies=kwargs["dependencies"]
    ):
        while engine.is_running():
            await engine.wait_until_ready()
            async with (
                engine.asset_context(),
                engine.run_context(),
                engine.transaction_context() as txn,
            ):
                await engine.call_task_fn(txn)
            raise_if_flow_run_suspension_requested()
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
            logger.debug(
                "Task run %s is not in the API (%r): its crashed worker died "
                "before sending its events",
                task_run_id,
                error,
            )
            return None
        previous = task_run.state
        task_run.state = AwaitingRetry(
            scheduled_time=None,
            message=f"Ray worker crashed; Ray re-run {attempt} of this task run",
        )
        emit_task_run_state_change_event(
            task_run=task_run, initial_state=previous, validated_state=task_run.state
        )
    return task_run
