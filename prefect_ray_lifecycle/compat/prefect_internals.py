"""Every private Prefect (and prefect-ray) name the project relies on, and nothing else.

Each use says what it relies on and the version it was checked against; an upgrade that
removes one fails tests/test_compat.py, naming the symbol (`SYMBOLS` lists them all). Our
task runner and its future subclass the two classes below instead of reading prefect-ray's
private attributes themselves.

Checked against Prefect 3.9.1 and prefect-ray 0.6.0.
"""

from __future__ import annotations

import inspect
import os
import queue
import sys
from typing import Any
from uuid import UUID

from prefect.context import _deployment_id, _deployment_parameters
from prefect_ray.task_runners import PrefectRayFuture, RayTaskRunner

from prefect_ray_lifecycle.compat import Symbol

__all__ = [
    "SYMBOLS",
    "RayFuture",
    "RayRunnerBase",
    "deployment_id",
    "deployment_parameters",
    "flow_run_being_started",
    "pending_events",
    "raise_if_flow_run_suspension_requested",
    "rebuild_context_models",
    "temporary_server_running",
]

SYMBOLS: tuple[Symbol, ...] = (
    Symbol("prefect._flow_run_suspension", "raise_if_flow_run_suspension_requested"),
    Symbol("prefect.flow_engine", "BaseFlowRunEngine.flow_run"),
    Symbol("prefect.context", "_deployment_id"),
    Symbol("prefect.context", "_deployment_parameters"),
    Symbol("prefect._internal.concurrency.services", "_QueueServiceBase._queue", instance=True),
    Symbol("prefect.server.api.server", "SubprocessASGIServer._instances"),
    Symbol("prefect.task_runners", "TaskRunner._started", instance=True),
    Symbol("prefect_ray.task_runners", "RayTaskRunner._exchange_prefect_for_ray_futures"),
    Symbol("prefect.futures", "PrefectWrappedFuture._final_state", instance=True),
    Symbol("prefect._internal.result_records", "ResultRecordMetadata"),
)


def flow_run_being_started() -> UUID | None:
    """The flow run whose engine is entering this task runner. Prefect 3 enters the runner
    before the FlowRunContext (FlowRunContext.get() is then the parent of a subflow, or
    None), so the id is read from the engine's frame; PREFECT__FLOW_RUN_ID (set for
    deployment runs) is the fallback. Relies on the engine (a `BaseFlowRunEngine` with its
    `flow_run` set) being a `self` within 12 frames above the runner's `__enter__`."""
    # Imported here: Ray workers import this module and never need the flow engine.
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


def raise_if_flow_run_suspension_requested() -> None:
    """What Prefect's own task engine calls after each attempt, so that a task that paused or
    suspended its flow run stops there. Relies on `prefect._flow_run_suspension.
    raise_if_flow_run_suspension_requested()` (moved out of the engine in Prefect 3.9)."""
    from prefect._flow_run_suspension import raise_if_flow_run_suspension_requested as check

    check()


def rebuild_context_models() -> None:
    """Complete the flow and task run context models with the types they name, as
    `prefect.context.hydrated_context` does before it builds a context from its serialised
    form. Relies on `prefect._internal.result_records.ResultRecordMetadata` being one of them
    (Prefect 3.9.1)."""
    from prefect._internal.result_records import ResultRecordMetadata
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.flows import Flow
    from prefect.tasks import Task

    types = {"Flow": Flow, "Task": Task, "ResultRecordMetadata": ResultRecordMetadata}
    FlowRunContext.model_rebuild(_types_namespace=types)
    TaskRunContext.model_rebuild(_types_namespace=types)


def deployment_id() -> Any:
    """The deployment id Prefect's context carries for the running flow. Relies on the
    context variable `prefect.context._deployment_id`."""
    return _deployment_id.get()


def deployment_parameters() -> Any:
    """The deployment's parameters Prefect's context carries. Relies on the context variable
    `prefect.context._deployment_parameters`."""
    return _deployment_parameters.get()


def pending_events() -> queue.Queue:
    """The queue of events this process's events worker has still to send (a queue.Queue,
    `task_done()` once sent). Relies on `EventsWorker.instance()._queue`
    (prefect._internal.concurrency.services._QueueServiceBase)."""
    from prefect.events.worker import EventsWorker

    return EventsWorker.instance()._queue


def temporary_server_running() -> bool:
    """Whether this process runs one of Prefect's temporary API servers. Relies on
    `prefect.server.api.server.SubprocessASGIServer._instances` (its instances by port)."""
    server = sys.modules.get("prefect.server.api.server")
    return bool(server and any(s.running for s in server.SubprocessASGIServer._instances.values()))


class RayRunnerBase(RayTaskRunner):
    """prefect-ray's RayTaskRunner, with the private state a subclass needs named publicly.
    Relies on `TaskRunner._started` and `RayTaskRunner._exchange_prefect_for_ray_futures(
    parameters)` (prefect-ray 0.6.0)."""

    @property
    def started(self) -> bool:
        return self._started

    def exchange_futures(self, parameters: dict[str, Any]) -> tuple[dict[str, Any], list]:
        """`parameters` with Prefect futures swapped for Ray object refs, and those refs."""
        return self._exchange_prefect_for_ray_futures(parameters)


class RayFuture(PrefectRayFuture):
    """prefect-ray's future, with its final state named publicly. Relies on
    `PrefectWrappedFuture._final_state` (Prefect 3.9.1)."""

    @property
    def final_state(self) -> Any:
        return self._final_state
