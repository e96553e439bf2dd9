"""Logs of work on Ray, posted under the task run that did it.

A task run's own logs are collected in its Ray worker and go back to the flow process beside
its final state, where Prefect's own log worker posts them in batches with the flow's logs
(TaskRunLogs, forward_task_logs): one POST per task run from each worker cost the Prefect
server about 3 ms of CPU each, against half a millisecond per line in batches, and a flow
process, unlike a Ray worker, is not killed at the end of its job before it has sent them.
What plain Ray tasks started from inside a task run print or log reaches the flow process
through Ray's own log stream, named by lineage.ray_task_name, and is posted there
(ChildTaskLogs); no Ray worker is dedicated to a task run for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple
from uuid import UUID

import orjson
from prefect.client.orchestration import get_client
from prefect.context import SettingsContext
from prefect.logging.configuration import ensure_logging_setup
from prefect.logging.handlers import APILogWorker, PrefectConsoleHandler, set_api_log_sink
from prefect.logging.loggers import get_logger
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.utilities.importtools import lazy_import

from prefect_ray_lifecycle.compat import ray_internals
from prefect_ray_lifecycle.ray_runner.lineage import NAME_TAG, child_tasks_key, prefect_ids_in_name
from prefect_ray_lifecycle.workloads.constants import PROJECT_NAMESPACE

# Ray loads on first use (as in prefect-ray): importing a flow module must not pay for it.
ray = lazy_import("ray")

logger = get_logger(__name__)

POST_BATCHES_AT_MOST = 64  # task runs' log batches merged into one POST /logs/


CONSOLE_LIVE_AFTER_S = 1.0  # a task run's console lines are held this long, then go live
CONSOLE_SWEEP_S = 0.25  # how often a worker looks for held lines that are due


class HeldLines:
    """The console lines of one task run, held in its Ray worker while the run is young."""

    def __init__(self, console: WorkerConsole | None) -> None:
        self.console = console  # None: this worker prints to no console, nothing is held
        self.lines: list[str] = []
        self.due = time.monotonic() + CONSOLE_LIVE_AFTER_S
        self.live = False  # printed in the worker from now on (or taken for the driver)

    def take(self) -> str:
        """The lines still held, as one text for the driver; none are printed here after."""
        return self.console.stop_holding(self) if self.console else ""

    def go_live(self) -> None:
        """Print what is held now, here, and every later line of the run at once."""
        if self.console:
            with self.console.lock:
                write_console(self.console, self.console.stop_holding(self))


_held_lines: contextvars.ContextVar[HeldLines | None] = contextvars.ContextVar(
    "prefect_ray_held_console_lines", default=None
)


class WorkerConsole(logging.StreamHandler):
    """A Ray worker's console handler, in place of Prefect's console handler (Rich): the same
    lines, level and format, on the same stream, without Rich rendering each one. A task run's
    lines are held for its first CONSOLE_LIVE_AFTER_S: a run that ends by then hands them to
    the driver with its result, which prints them once (print_console_lines), so they skip the
    worker's stderr, Ray's log monitor and the GCS; a longer run prints them, and everything
    after, live from the worker (Ray's log stream), as before. Lines logged outside a task run
    (a library's warning at import) are printed at once. About a millisecond of CPU a task
    run on 2 cores (docs/benchmarks.md)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._young: set[HeldLines] = set()  # under self.lock
        self._sweeper: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:  # called under self.lock
        held = _held_lines.get()
        if held is None or held.live:
            super().emit(record)
            return
        try:
            held.lines.append(self.format(record))
        except Exception:
            self.handleError(record)

    def hold(self, held: HeldLines) -> None:
        with self.lock:
            self._young.add(held)
            if self._sweeper is None:
                self._sweeper = threading.Thread(
                    target=self._sweep_forever, daemon=True, name="prefect-ray-console"
                )
                self._sweeper.start()

    def stop_holding(self, held: HeldLines) -> str:
        """Stop holding `held`'s lines: the ones held so far, as one text."""
        with self.lock:
            self._young.discard(held)
            lines, held.lines, held.live = held.lines, [], True
        return "".join(line + self.terminator for line in lines)

    def _sweep_forever(self) -> None:
        while True:
            time.sleep(CONSOLE_SWEEP_S)
            now = time.monotonic()
            with self.lock:
                for held in [held for held in self._young if held.due <= now]:
                    write_console(self, self.stop_holding(held))


@contextlib.contextmanager
def held_console() -> Iterator[HeldLines]:
    """Hold the console lines of what runs inside (a task run) until it ends or is due; what
    is still held at the end is the caller's: take() it, or print it (go_live)."""
    console = worker_console()
    held = HeldLines(console)
    if console is None:
        yield held
        return
    token = _held_lines.set(held)
    console.hold(held)
    try:
        yield held
    finally:
        _held_lines.reset(token)


@functools.cache  # once per process, like the worker's other caches (contexts.worker_context)
def worker_console() -> WorkerConsole | None:
    """This process's (a Ray worker's) console handler, WorkerConsole in place of Prefect's;
    None where Prefect's logging prints to no console. Prefect configures a worker's logging
    on first use (ensure_logging_setup), so it is configured here first, with the flow's
    settings adopted (worker.run_on_ray)."""
    ensure_logging_setup()
    root = logging.getLogger()
    for index, handler in enumerate(root.handlers):
        if isinstance(handler, PrefectConsoleHandler):
            console = WorkerConsole(handler.stream)
            console.setLevel(handler.level)
            console.setFormatter(handler.formatter)
            for log_filter in handler.filters:
                console.addFilter(log_filter)
            root.handlers[index] = console
            return console
    return None


def write_console(handler: logging.StreamHandler, text: str) -> None:
    """Write formatted lines to a console handler's stream (the caller holds its lock)."""
    if text:
        try:
            handler.stream.write(text)
            handler.stream.flush()
        except Exception:  # the console is best effort; the task's outcome is not
            pass


def print_console_lines(text: str) -> None:
    """Print a task run's console lines (formatted in its worker) on this process's console:
    the stream of the root logger's console handler (Prefect's, or WorkerConsole in a Ray
    worker), under its lock; nowhere where the root logger prints to no console."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler | WorkerConsole):
            with handler.lock or contextlib.nullcontext():
                write_console(handler, text)
            return


class TaskRunLogs:
    """Collects what a task run logs in this Ray worker, for the driver (taken) or, when the
    run ends in an exception that returns nothing, for a sender thread that posts them at once
    (send). Prefect's own log worker would only flush a batch in its next interval or at
    process exit, and Ray kills a job's workers at its end, so the batch would be lost.
    (Prefect's ProcessPoolTaskRunner swaps the same sink.)"""

    _queue: queue.Queue | None = None  # LogBatch items for the sender thread, one per process

    def __init__(self, settings: SettingsContext):
        self.settings = settings
        self.logs: list[dict[str, Any]] = []
        set_api_log_sink(self.logs.append)

    def taken(self) -> list[bytes]:
        """Stop collecting; each line collected as the JSON Prefect's log worker sends."""
        set_api_log_sink(None)
        return [
            orjson.dumps({k: v for k, v in log.items() if k != "__payload_size__"})
            for log in self.logs
        ]

    def send(self) -> None:
        """Stop collecting; post what was collected from here."""
        lines = self.taken()
        if lines:
            body = b"[" + b",".join(lines) + b"]"
            self.sender_queue().put(LogBatch(self.settings.settings.api.url, body, self.settings))

    @classmethod
    def sender_queue(cls) -> queue.Queue:
        """The queue of LogBatch items this process's sender thread posts."""
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
    def _post_forever(pending: queue.Queue) -> None:
        clients: dict[str, Any] = {}  # one per API URL: opening a client is slow
        while True:
            batches = [pending.get()]
            while len(batches) < POST_BATCHES_AT_MOST:  # what queued meanwhile goes along
                try:
                    batches.append(pending.get_nowait())
                except queue.Empty:
                    break
            for api_url, logs in _by_api(batches):
                try:
                    if api_url not in clients:
                        clients[api_url] = _open_client(logs[0])
                    clients[api_url].request(
                        "POST",
                        "/logs/",
                        content=b"[" + b",".join(batch.body[1:-1] for batch in logs) + b"]",
                        headers={"Content-Type": "application/json"},
                    )
                except Exception as error:  # logs are best effort; the task's outcome is not
                    logger.warning("Could not send task run logs to %s: %s", api_url, error)
            for _ in batches:
                pending.task_done()


class RunLines(NamedTuple):
    """What a task run's Ray task returns beside its final state (worker.run_on_ray)."""

    api: list[bytes]  # its log lines as the JSON Prefect's log worker sends
    console: str  # its console lines that its worker did not print (WorkerConsole)


_forwarding: dict[Any, threading.Event] = {}  # lines refs whose callback has not ended yet
_forwarding_lock = threading.Lock()


def forward_task_logs(lines_ref: Any, settings: SettingsContext) -> None:
    """Once a task run's Ray task has returned, print the console lines it returned and post
    its log lines (RunLines, the second return of worker.run_on_ray) with the flow's own logs,
    through Prefect's log worker of `settings` (the flow's), which batches them. An attempt
    that crashed returns nothing: its lines went with its worker (a re-run returns its own).
    Ray calls back on a thread of its own, possibly after the flow has the run's state:
    wait_forwarded waits for it."""
    forwarded = threading.Event()
    with _forwarding_lock:
        _forwarding[lines_ref] = forwarded

    def forward(done: Any) -> None:
        try:
            lines = done.result()
        except Exception:
            return
        else:
            if lines.console:
                print_console_lines(lines.console)
            if lines.api:
                post_log_lines(lines.api, settings)
        finally:
            with _forwarding_lock:
                _forwarding.pop(lines_ref, None)
            forwarded.set()

    lines_ref.future().add_done_callback(forward)


def wait_forwarded(timeout: float) -> None:
    """Wait (at most `timeout` s) until the lines of every task run whose Ray task has
    returned are printed and queued for the API: a runner that leaves Ray at its exit would
    drop the callbacks still due. Task runs still going are not waited for."""
    with _forwarding_lock:
        pending = dict(_forwarding)
    if not pending:
        return
    try:
        returned, _ = ray.wait(
            list(pending), num_returns=len(pending), timeout=0, fetch_local=False
        )
    except Exception as error:  # refs of a Ray this process has left: nothing will call back
        logger.debug("Not waiting for task runs' lines: %r", error)
        return
    deadline = time.monotonic() + timeout
    for ref in returned:
        pending[ref].wait(max(0.0, deadline - time.monotonic()))


def post_log_lines(lines: list[bytes], settings: SettingsContext) -> None:
    """Queue log lines (JSON) for the API of `settings`: with Prefect's log worker in a flow
    process; from a Ray worker (a task run submitting task runs) by the sender thread, since
    Ray may kill the worker before the log worker's next batch."""
    if ray_internals.is_worker_mode():
        body = b"[" + b",".join(lines) + b"]"
        TaskRunLogs.sender_queue().put(LogBatch(settings.settings.api.url, body, settings))
        return
    # Ray calls back on a thread of its own, whose context is not the flow's.
    token = SettingsContext.__var__.set(settings)
    try:
        log_worker = APILogWorker.instance()
        for line in lines:
            log_worker.send(line)
    except Exception as error:  # logs are best effort; the task's outcome is not
        logger.warning("Could not queue task run logs for %s: %s", settings.settings.api.url, error)
    finally:
        SettingsContext.__var__.reset(token)


class LogBatch(NamedTuple):
    """A JSON array of log records for one API; `settings` to open its client with, else the
    process settings with the URL replaced."""

    api_url: str
    body: bytes
    settings: SettingsContext | None = None


def _by_api(batches: list[LogBatch]) -> list[tuple[str, list[LogBatch]]]:
    grouped: dict[str, list[LogBatch]] = {}
    for batch in batches:
        grouped.setdefault(batch.api_url, []).append(batch)
    return list(grouped.items())


def _open_client(batch: LogBatch) -> Any:
    """A sync client for the batch's API, under its settings: settings built in this thread
    would read os.environ, which Ray changes while it starts a task (a KeyError)."""
    if batch.settings is None:
        with temporary_settings(updates={PREFECT_API_URL: batch.api_url}):
            return get_client(sync_client=True).__enter__()
    token = SettingsContext.__var__.set(batch.settings)
    try:
        return get_client(sync_client=True).__enter__()
    finally:
        SettingsContext.__var__.reset(token)


class ChildTaskLogs:
    """Driver side (the flow process): lines that Ray's log stream (log_to_driver) brings
    from Ray tasks named "from_task_run" are posted as that task run's logs. One handler per
    process, shared by nested task runners."""

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
        if not ray_internals.internal_kv_del(
            child_tasks_key(flow_run_id), namespace=PROJECT_NAMESPACE
        ):
            return
        started = time.monotonic()
        deadline = started + cls.DRAIN_LIMIT_S
        while time.monotonic() < deadline and (
            time.monotonic() - max(started, cls._last_line) < cls.QUIET_S
        ):
            time.sleep(0.05)
        TaskRunLogs.wait_sent(max(0.0, deadline - time.monotonic()) + 1.0)

    @classmethod
    def start(cls, api_url: str) -> bool:
        """Take a share of the log stream handler; False where this process has no stream."""
        if not ray_internals.is_script_mode():
            return False  # Ray Client or a driver inside a worker: no log stream here
        with cls._lock:
            cls._users += 1
            if cls._users == 1:
                ray_internals.stdstream_handler(
                    cls.HANDLER, lambda data: cls._forward_safely(api_url, data)
                )
        return True

    @classmethod
    def stop(cls) -> None:
        """Give the share back; the last user removes the handler."""
        with cls._lock:
            if cls._users == 0:
                return
            cls._users -= 1
            if cls._users == 0:
                ray_internals.stdstream_handler(cls.HANDLER, None)

    @classmethod
    def _forward_safely(cls, api_url: str, data: dict[str, Any]) -> None:
        try:  # an exception here would end Ray's log thread in this process
            cls._forward(api_url, data)
        except Exception as error:
            logger.debug("Could not forward Ray task logs: %r", error)

    @classmethod
    def _forward(cls, api_url: str, data: dict[str, Any]) -> None:
        ids = prefect_ids_in_name(data.get("task_name"))
        if ids is None or not ids[2] or not data.get("lines"):
            return  # not from a task run's child (the task run's own logs come by TaskRunLogs)
        flow_run_id, task_run_id, _ = ids
        function = NAME_TAG.sub("", data["task_name"])
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
        cls._last_line = time.monotonic()
        TaskRunLogs.sender_queue().put(LogBatch(api_url, body))
