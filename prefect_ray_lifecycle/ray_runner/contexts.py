"""The Prefect context of a task run, shipped to its Ray worker once and kept on both sides.

Stock prefect-ray serialises the whole context (settings included) at every submit, and every
Ray worker builds settings and opens a Prefect client (an ssl context) for every task run:
most of its cost per task. Here the driver serialises the settings and the flow run's context
once per context object and puts each in Ray's object store; a task carries their keys and
refs, and a worker resolves each key once: the settings, one open client per settings, the
flow run's context. Settings are keyed by a digest of their content, a flow run's context by a
key minted for it, so two flow runs with different settings on one worker never share.
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
from typing import Any
from uuid import UUID

from prefect.context import (
    AssetContext,
    AsyncClientContext,
    EngineContext,
    SettingsContext,
    SyncClientContext,
    TagsContext,
    TaskRunContext,
)
from prefect.tasks import Task
from prefect.utilities.importtools import lazy_import

from prefect_ray_lifecycle.compat import prefect_internals
from prefect_ray_lifecycle.ray_runner.settings import deep_merge

# Ray loads on first use (as in prefect-ray): importing a flow module must not pay for it.
ray = lazy_import("ray")

WORKER_CACHE_SIZE = 8  # settings (and their open clients) and flow run contexts per worker


@dataclass(frozen=True)
class Shipped:
    """A part of the context in Ray's object store, under a key the worker caches it by."""

    key: str
    ref: Any  # ray.ObjectRef; resolved by a worker only when its cache misses the key


class ContextShipper:
    """Driver side, one per task runner: the context of each submit, with the settings and the
    flow run's context serialised and put in Ray's object store once per context object."""

    def __init__(self, worker_settings: dict[str, Any]):
        self.worker_settings = worker_settings
        # id(context object) -> (the object, kept so its id stays its own, what was shipped)
        self._settings: dict[int, tuple[SettingsContext, Shipped]] = {}
        self._flow_runs: dict[int, tuple[EngineContext, Shipped]] = {}

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
            key = hashlib.sha256(pickle.dumps(serialized)).hexdigest()
            cached = self._settings[id(settings)] = (settings, Shipped(key, ray.put(serialized)))
        return cached[1]

    def _ship_flow_run(self, flow_run: EngineContext | None) -> Shipped | None:
        if flow_run is None:
            return None
        cached = self._flow_runs.get(id(flow_run))
        if cached is None or cached[0] is not flow_run:
            shipped = Shipped(uuid.uuid4().hex, ray.put(flow_run.serialize()))
            cached = self._flow_runs[id(flow_run)] = (flow_run, shipped)
        return cached[1]


@dataclass
class WorkerContext:
    """Worker side: what one task run enters, resolved from the worker's caches."""

    settings_key: str
    settings: SettingsContext
    client: SyncClientContext
    engine_context: dict[str, Any]  # for the task engine: everything but the settings

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
        """The task run's settings and the cached client as the current ones (the engine
        uses an active SyncClientContext instead of opening its own)."""
        settings_token = SettingsContext.__var__.set(self.settings)
        client_token = SyncClientContext.__var__.set(self.client)
        try:
            yield
        finally:
            SyncClientContext.__var__.reset(client_token)
            SettingsContext.__var__.reset(settings_token)


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
_flow_run_cache = _Lru(WORKER_CACHE_SIZE * 2)


def worker_context(shipped: dict[str, Any]) -> WorkerContext:
    """In a Ray worker: the context a submit shipped, from this process's caches."""
    settings_handle: Shipped = shipped["settings_context"]
    flow_run_handle: Shipped | None = shipped["flow_run_context"]
    with _lock:
        settings = _settings_cache.get_or_make(
            settings_handle.key, lambda: SettingsContext(**ray.get(settings_handle.ref))
        )
        client, _ = _client_cache.get_or_make(settings_handle.key, lambda: _open_client(settings))
        flow_run = (
            _flow_run_cache.get_or_make(flow_run_handle.key, lambda: ray.get(flow_run_handle.ref))
            if flow_run_handle is not None
            else {}
        )
    engine_context = {
        **{k: v for k, v in shipped.items() if k != "settings_context"},
        "flow_run_context": flow_run,
    }
    return WorkerContext(settings_handle.key, settings, client, engine_context)
