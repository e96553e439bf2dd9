"""What runs inside the Ray worker for one Prefect task run.

Crash-aware retries: a Ray system failure (the worker process died, its node died, it was
killed for memory) is re-run by Ray up to the runner's crash_retries, but never behind
Prefect's back: the re-run reads the task run from the API, records "AwaitingRetry: Ray worker
crashed" and runs it as the next attempt of the same task run (run_count goes up), after a
backoff. User exceptions never reach Ray (the task engine turns them into a Failed state), so
they follow the task's own retry settings. A user retry waits out its retry_delay_seconds
blocked in ray.get on a zero-CPU timer task, so its CPUs serve other tasks meanwhile.

Functions pickled by value (see pickled_by_value) import what they need inside their body and
read no module global but the few pickled_by_value supplies: a worker then loads them without
importing Prefect (only Ray and the package's compat module for Ray's private names).
"""

from __future__ import annotations

import datetime
import time
import types
from collections.abc import Iterable
from typing import Any
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import TaskRun
from prefect.futures import PrefectFuture
from prefect.logging.loggers import get_logger
from prefect.states import AwaitingRetry, State
from prefect.task_engine import AsyncTaskRunEngine, SyncTaskRunEngine
from prefect.utilities.collections import visit_collection
from prefect.utilities.engine import emit_task_run_state_change_event
from prefect.utilities.importtools import lazy_import

from prefect_ray_lifecycle.compat import prefect_internals, ray_internals
from prefect_ray_lifecycle.compat.prefect_internals import raise_if_flow_run_suspension_requested
from prefect_ray_lifecycle.ray_runner.contexts import Shipped, worker_context, worker_task
from prefect_ray_lifecycle.ray_runner.lineage import (
    NAME_TAG,
    child_tasks_key,
    prefect_ids_in_name,
    ray_task_name,
)
from prefect_ray_lifecycle.ray_runner.logs import RunLines, TaskRunLogs, held_console
from prefect_ray_lifecycle.ray_runner.settings import adopt_flow_settings, route_events
from prefect_ray_lifecycle.workloads.constants import PROJECT_NAMESPACE

# Ray loads on first use (as in prefect-ray): importing a flow module must not pay for it.
ray = lazy_import("ray")

logger = get_logger(__name__)

RETRY_DELAY_OFF_SLOT_S = 0.5  # shorter retry delays are slept in place
EVENTS_SENT_TIMEOUT_S = 5.0  # at most this long for a Running event to be sent
BY_VALUE_MODULE = "prefect_ray_by_value"  # a module name no worker can import


def run_on_ray(
    *upstream_refs: Any,
    task: Shipped,
    task_run_id: UUID,
    context: dict[str, Any],
    parameters: dict[str, Any],
    crash_backoff_s: float,
    wait_for: Iterable[PrefectFuture[Any]] | None = None,
    dependencies: dict[str, set[Any]] | None = None,
) -> tuple[State, RunLines]:
    """Run one Prefect task run in a Ray worker; when Ray re-runs it after a system failure,
    continue the same task run as its next, recorded attempt. `task` and `context` come from
    contexts.ContextShipper; the task, settings, client and flow run context are cached per
    process. Returns the final state and the run's log lines: as JSON, which the driver posts,
    and its console lines not printed here yet, which the driver prints
    (logs.forward_task_logs)."""
    prefect_context = worker_context(context)
    adopt_flow_settings(prefect_context.settings)
    route_events(prefect_context.settings)
    tag_child_tasks()
    task = worker_task(task)
    parameters = visit_collection(
        parameters,
        visit_fn=lambda x: ray.get(x) if isinstance(x, ray.ObjectRef) else x,
        return_data=True,
    )
    attempt = ray_internals.task_attempt_number()
    with prefect_context.entered():
        task_run = None
        if attempt > 0:
            time.sleep(crash_backoff_s * 2 ** (attempt - 1))
            task_run = continue_after_crash(task_run_id, prefect_context.client.client, attempt)
        kwargs: dict[str, Any] = dict(
            task=task,
            parameters=parameters,
            wait_for=wait_for,
            dependencies=dependencies,
            context=prefect_context.engine_context,
        )
        if task_run is None:
            kwargs["task_run_id"] = task_run_id
        else:
            kwargs["task_run"] = task_run
        logs = TaskRunLogs(prefect_context.settings)
        with held_console() as console_lines:
            try:
                if task.isasync:
                    state = prefect_context.run_async(lambda: run_async(kwargs))
                else:
                    lost_attempts = attempt if attempt > 0 and task_run is None else 0
                    state = run_sync(kwargs, lost_attempts)
            except BaseException:
                logs.send()  # nothing goes back to the driver: post and print them from here
                console_lines.go_live()
                raise
        return state, RunLines(logs.taken(), console_lines.take())


def continue_after_crash(
    task_run_id: UUID, client: SyncPrefectClient, attempt: int
) -> TaskRun | None:
    """The crashed attempt's task run, marked AwaitingRetry; None when the crashed worker
    died before the API heard of it (the engine then creates the run afresh)."""
    try:
        task_run = client.read_task_run(task_run_id)
    except Exception as error:
        logger.debug(
            "Task run %s is not in the API (%r): its crashed worker died before sending its events",
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


def retry_delay(until: float) -> None:
    """Sleep until `until` (epoch seconds). Pickled by value: runs on a zero-CPU Ray task."""
    time.sleep(max(0.0, until - time.time()))  # a fresh worker's start counts in the delay


def wait_retry_delay_off_slot(state: State | None) -> None:
    """Wait out a retry delay (AwaitingRetry's scheduled time) blocked in ray.get on a
    zero-CPU Ray task: Ray lends a blocked task's CPUs to other tasks meanwhile, where the
    Prefect engine's own time.sleep would hold them for the whole delay. The engine then
    finds the time passed and goes on with the next attempt in this same worker."""
    scheduled = state.state_details.scheduled_time if state is not None else None
    if scheduled is None:
        return
    delay = (scheduled - datetime.datetime.now(datetime.UTC)).total_seconds()
    if delay >= RETRY_DELAY_OFF_SLOT_S:
        # Named, so it is not tagged as a child of the task run (whose flow run would then
        # wait at exit for child log lines that never come).
        ray.get(
            ray.remote(num_cpus=0, max_retries=3)(pickled_by_value(retry_delay))
            .options(name="prefect-retry-delay")
            .remote(time.time() + delay)
        )


def wait_events_sent(timeout: float = EVENTS_SENT_TIMEOUT_S) -> None:
    """Wait (at most `timeout` s) until this process's events worker has sent every queued
    event. Run before a task body starts: a worker that dies in the body (os._exit, OOM kill)
    then leaves its Running state recorded, so the crash counts as an attempt."""
    pending = prefect_internals.pending_events()
    deadline = time.monotonic() + timeout
    with pending.all_tasks_done:
        while pending.unfinished_tasks and (remaining := deadline - time.monotonic()) > 0:
            pending.all_tasks_done.wait(remaining)


class RaySyncTaskRunEngine(SyncTaskRunEngine):
    """Prefect's sync task engine, waiting out retry delays off the Ray CPU slot and each
    Running state's event sent before the attempt's body starts."""

    def wait_until_ready(self) -> None:
        wait_retry_delay_off_slot(self.state)
        super().wait_until_ready()

    def set_state(self, state: State, force: bool = False) -> State:
        new_state = super().set_state(state, force)
        if new_state.is_running():
            wait_events_sent()
        return new_state


class RayAsyncTaskRunEngine(AsyncTaskRunEngine):
    """Prefect's async task engine, waiting as RaySyncTaskRunEngine does."""

    async def wait_until_ready(self) -> None:
        wait_retry_delay_off_slot(self.state)  # blocks this task's own event loop only
        await super().wait_until_ready()

    async def set_state(self, state: State, force: bool = False) -> State:
        new_state = await super().set_state(state, force)
        if new_state.is_running():
            wait_events_sent()  # the events worker runs on Prefect's own loop thread
        return new_state


def run_sync(kwargs: dict[str, Any], lost_attempts: int = 0) -> State:
    """prefect.task_engine.run_task_sync on RaySyncTaskRunEngine; for a re-run whose crashed
    attempts never reached the API (the worker died before its events were sent: the run is
    created afresh) its run_count also counts those lost attempts."""
    engine = RaySyncTaskRunEngine(
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


async def run_async(kwargs: dict[str, Any]) -> State:
    """prefect.task_engine.run_task_async on RayAsyncTaskRunEngine."""
    engine = RayAsyncTaskRunEngine(
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


def tag_child_tasks() -> None:
    """Ray tasks submitted from a task whose name carries Prefect ids get those ids in their
    own name (unless given a name), so they, and what they print, can be tied to the task run.
    Installed in every worker of the runner's job at its start (worker_setup_hook), else once
    in each worker that runs a Prefect task run; the tag is read from the running Ray task's
    name, so nothing leaks between tasks. Pickled by value."""
    import ray

    # Ray and the package's compat module only: no Prefect is imported in the worker.
    from prefect_ray_lifecycle.compat import ray_internals

    flagged: set[str] = set()  # flow runs whose KV flag this process has set

    def tagging(submit: Any) -> Any:
        def remote(self: Any, *args: Any, **options: Any) -> Any:
            if not options.get("name"):
                ids = prefect_ids_in_name(ray.get_runtime_context().get_task_name())
                if ids is not None:
                    function = ray_internals.remote_function_name(self)
                    options["name"] = ray_task_name(function, ids[0], ids[1], started_from=True)
                    if ids[0] not in flagged:  # the driver then waits for their logs
                        key = child_tasks_key(ids[0])
                        ray_internals.internal_kv_put(key, b"1", namespace=PROJECT_NAMESPACE)
                        flagged.add(ids[0])
            return submit(self, *args, **options)

        return remote

    ray_internals.wrap_remote_submit(tagging)


def pickled_by_value(*functions: Any) -> Any:
    """Copies of `functions` (the last returned) in a module no worker can import, so Ray
    pickles them by value: a worker loads them without importing this package and Prefect,
    slow in a fresh worker. The copies see each other and the globals below."""
    namespace: dict[str, Any] = {
        "__name__": BY_VALUE_MODULE,
        "time": time,
        "NAME_TAG": NAME_TAG,
        "PROJECT_NAMESPACE": PROJECT_NAMESPACE,
    }
    for function in functions:
        copy = types.FunctionType(
            function.__code__,
            namespace,
            function.__name__,
            function.__defaults__,
            function.__closure__,
        )
        copy.__module__, copy.__qualname__ = BY_VALUE_MODULE, function.__qualname__
        namespace[function.__name__] = copy
    return namespace[functions[-1].__name__]


def worker_setup_hook() -> Any:
    """tag_child_tasks as a worker_process_setup_hook that every worker of the job runs at
    start, so Ray tasks started at any depth below a task run are tagged."""
    return pickled_by_value(ray_task_name, prefect_ids_in_name, child_tasks_key, tag_child_tasks)
