"""The Prefect context of a task run, serialised once in the driver and kept in each worker.

Stock prefect-ray serialises the whole context (settings included) and the task at every
submit, and every Ray worker builds settings, opens a Prefect client (an ssl context) and
builds the flow run's context for every task run: most of its cost per task. Here the driver
pickles the settings, the flow run's context and each task once per object; a submit carries
those bytes under a key, and a worker unpickles each key once and keeps it: the settings, one
open client per settings, the flow run's context (copied per task run, as Prefect would build
it afresh), the task. Settings and tasks are keyed by a digest of their bytes, a flow run's
context by a key minted for it, so two flow runs with different settings never share.

The bytes travel inline, not as object refs: an ObjectRef nested in a task's arguments makes
Ray track the worker as its borrower, which cost more per task (about 0.5 ms of driver CPU
and a round trip more, measured on Ray 2.60) than copying a few KB.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import pickle
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple
from uuid import UUID

import cloudpickle
from prefect.context import (
    AssetContext,
    AsyncClientContext,
    EngineContext,
    FlowRunContext,
    SettingsContext,
    SyncClientContext,
    TagsContext,
    TaskRunContext,
)
from prefect.tasks import Task

from prefect_ray_lifecycle.compat import prefect_internals
from prefect_ray_lifecycle.ray_runner.settings import deep_merge

WORKER_CACHE_SIZE = 8  # settings (and their open clients) and flow run contexts per worker
WORKER_TASK_CACHE_SIZE = 64  # tasks per worker


class Shipped(NamedTuple):
    """A part of the context, pickled once, under the key a worker keeps it by."""

    key: str
    payload: bytes  # unpickled by a worker only when it does not have the key yet


class ContextShipper:
    """Driver side, one per task runner: the context of each submit, with the settings, the
    flow run's context and the task pickled once per object."""

    def __init__(self, worker_settings: dict[str, Any]):
        self.worker_settings = worker_settings
        # id(object) -> (the object, kept so its id stays its own, what was shipped)
        self._settings: dict[int, tuple[SettingsContext, Shipped]] = {}
        self._flow_runs: dict[int, tuple[EngineContext, Shipped]] = {}
        self._tasks: dict[int, tuple[Task[Any, Any], Shipped]] = {}

    def task(self, task: Task[Any, Any]) -> Shipped:
        """The task, pickled at its first submit (tasks are not changed once made: with_options
        makes a new one)."""
        cached = self._tasks.get(id(task))
        if cached is None or cached[0] is not task:
            cached = self._tasks[id(task)] = (task, _digested(cloudpickle.dumps(task)))
        return cached[1]

    def context(
        self, task: Task[Any, Any], task_run_id: UUID, task_inputs: dict[str, Any]
    ) -> dict[str, Any]:
        """What prefect.context.serialize_context gives, with "settings_context" and
        "flow_run_context" as Shipped handles; the parts that change per submit inline."""
        task_run = TaskRunContext.get()
        tags = TagsContext.get()
        deployment_id = prefect_internals.deployment_id()
        asset = AssetContext.from_task_and_inputs(
            task=task, task_run_id=task_run_id, task_inputs=task_inputs, copy_to_child_ctx=True
        )
        return {
            "settings_context": self._ship_settings(SettingsContext.get()),
            "flow_run_context": self._ship_flow_run(EngineContext.get()),
            "task_run_context": task_run.serialize() if task_run else {},
            "tags_context": tags.serialize() if tags else {},
            "asset_context": asset.serialize(),
            "deployment_id": str(deployment_id) if deployment_id else None,
            "deployment_parameters": prefect_internals.deployment_parameters(),
        }

    def _ship_settings(self, settings: SettingsContext) -> Shipped:
        cached = self._settings.get(id(settings))
        if cached is None or cached[0] is not settings:
            serialized = settings.serialize()
            serialized["settings"] = deep_merge(serialized["settings"], self.worker_settings)
            cached = self._settings[id(settings)] = (settings, _digested(pickle.dumps(serialized)))
        return cached[1]

    def _ship_flow_run(self, flow_run: EngineContext | None) -> Shipped | None:
        if flow_run is None:
            return None
        cached = self._flow_runs.get(id(flow_run))
        if cached is None or cached[0] is not flow_run:
            shipped = Shipped(uuid.uuid4().hex, cloudpickle.dumps(flow_run.serialize()))
            cached = self._flow_runs[id(flow_run)] = (flow_run, shipped)
        return cached[1]


def _digested(payload: bytes) -> Shipped:
    return Shipped(hashlib.sha256(payload).hexdigest(), payload)


@dataclass
class WorkerContext:
    """Worker side: what one task run enters, resolved from the worker's caches."""

    settings_key: str
    settings: SettingsContext
    client: SyncClientContext
    flow_run: FlowRunTemplate | None  # the flow run's context, copied for each task run
    engine_context: dict[str, Any]  # for the task engine: all but settings and flow run

    def run_async(self, make_coroutine: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        """Run an async task run on this process's event loop, kept between task runs so one
        open async client per settings serves them all (asyncio.run would need a new one per
        run); what the run leaves on the loop is cancelled, as asyncio.run does."""
        global _loop
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()

        async def run() -> Any:
            client = await _async_client(self.settings_key)
            token = AsyncClientContext.__var__.set(client)
            try:
                return await make_coroutine()
            finally:
                AsyncClientContext.__var__.reset(token)

        try:
            return _loop.run_until_complete(run())
        finally:
            leftovers = [task for task in asyncio.all_tasks(_loop) if not task.done()]
            for task in leftovers:
                task.cancel()
            if leftovers:
                _loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The task run's settings, the cached client (the engine uses an active
        SyncClientContext instead of opening its own) and a copy of the flow run's context
        as the current ones."""
        settings_token = SettingsContext.__var__.set(self.settings)
        client_token = SyncClientContext.__var__.set(self.client)
        try:
            if self.flow_run is None:
                yield
            else:
                with self.flow_run.context(self.client.client):
                    yield
        finally:
            SyncClientContext.__var__.reset(client_token)
            SettingsContext.__var__.reset(settings_token)


class FlowRunTemplate:
    """A flow run's context in a worker, built once (under the settings of its first task
    run) and copied for each task run with fresh copies of the per-run records it keeps
    (results, dynamic keys, pauses, a suspension request, assets), as
    prefect.context.hydrated_context would build it anew: validating the flow run and
    starting a task runner copy for each task run cost a fifth of a small task's time in the
    worker. A flow process's thread pool shares one context between its task runs."""

    def __init__(self, serialized: dict[str, Any]):
        self.serialized = serialized
        self._built: EngineContext | None = None
        self._runner: Any = None  # the flow's task runner copy, entered once
        self._per_run: tuple[str, ...] = ()

    def context(self, client: Any) -> EngineContext:
        """A context for one task run, to be entered."""
        if self._built is None:
            prefect_internals.rebuild_context_models()  # as hydrated_context does first
            runner = self.serialized["flow"].task_runner.duplicate()
            runner.__enter__()
            self._runner = runner
            self._built = FlowRunContext(
                **self.serialized, client=client, task_runner=runner, detached=True
            )
            # Records made by a class (dict, FlowRunSuspensionRequest): each run its own.
            self._per_run = tuple(
                name
                for name, field in FlowRunContext.model_fields.items()
                if isinstance(field.default_factory, type)
                and name not in self._built.model_fields_set
            )
        fields = FlowRunContext.model_fields
        return self._built.model_copy(
            update={name: fields[name].default_factory() for name in self._per_run}
        )

    def close(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                self._runner.__exit__(None, None, None)


class _Lru(OrderedDict):
    """A small LRU map; `on_evict(value)` runs for each value pushed out."""

    def __init__(self, size: int, on_evict: Any = None):
        super().__init__()
        self.size, self.on_evict = size, on_evict

    def get_or_make(self, key: str, make: Any) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        while len(self) > self.size:
            _, old = self.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old)
        return value


def _open_client(settings: SettingsContext) -> tuple[SyncClientContext, contextvars.Context]:
    """A SyncClientContext entered once, under `settings`, in a context of its own (so it is
    current only where WorkerContext.entered makes it so); the engine never closes it."""
    holder = contextvars.copy_context()

    def open_() -> SyncClientContext:
        SettingsContext.__var__.set(settings)
        client = SyncClientContext()
        client.__enter__()
        return client

    return holder.run(open_), holder


def _close_client(entry: tuple[SyncClientContext, contextvars.Context]) -> None:
    client, holder = entry
    with contextlib.suppress(Exception):
        holder.run(client.__exit__, None, None, None)


async def _async_client(key: str) -> AsyncClientContext:
    """The open AsyncClientContext of these settings on this process's loop (made under the
    current settings, which are those of `key`)."""
    client = _async_clients.pop(key, None)
    if client is None:
        client = AsyncClientContext()
        await client.__aenter__()  # left open; its context var is set per run instead
    _async_clients[key] = client
    while len(_async_clients) > WORKER_CACHE_SIZE:
        _, old = _async_clients.popitem(last=False)
        with contextlib.suppress(Exception):
            await old.client.__aexit__(None, None, None)
    return client


_loop: asyncio.AbstractEventLoop | None = None  # async task runs, one at a time
_async_clients: OrderedDict[str, AsyncClientContext] = OrderedDict()
_lock = threading.Lock()  # a worker runs one task at a time; threaded actors may not
_settings_cache = _Lru(WORKER_CACHE_SIZE)
_client_cache = _Lru(WORKER_CACHE_SIZE, on_evict=_close_client)
# By flow run and settings: a template holds a client of its settings.
_flow_run_cache = _Lru(WORKER_CACHE_SIZE * 2, on_evict=FlowRunTemplate.close)
_task_cache = _Lru(WORKER_TASK_CACHE_SIZE)


def worker_context(shipped: dict[str, Any]) -> WorkerContext:
    """In a Ray worker: the context a submit shipped, from this process's caches."""
    settings_handle: Shipped = shipped["settings_context"]
    flow_run_handle: Shipped | None = shipped["flow_run_context"]
    with _lock:
        settings = _settings_cache.get_or_make(
            settings_handle.key, lambda: SettingsContext(**pickle.loads(settings_handle.payload))
        )
        client, _ = _client_cache.get_or_make(settings_handle.key, lambda: _open_client(settings))
        flow_run = None
        if flow_run_handle is not None:
            flow_run = _flow_run_cache.get_or_make(
                f"{flow_run_handle.key}:{settings_handle.key}",
                lambda: FlowRunTemplate(pickle.loads(flow_run_handle.payload)),
            )
    engine_context = {
        k: v for k, v in shipped.items() if k not in ("settings_context", "flow_run_context")
    }
    return WorkerContext(settings_handle.key, settings, client, flow_run, engine_context)


def worker_task(shipped: Shipped) -> Task[Any, Any]:
    """In a Ray worker: the task a submit shipped, from this process's cache."""
    with _lock:
        return _task_cache.get_or_make(shipped.key, lambda: pickle.loads(shipped.payload))
