"""Stopping this process's Ray connection off the critical path: a local Ray takes over a
second to stop its processes, which the work that follows (publishing a dataset, ending the
flow run) need not wait for. Whatever connects this process to Ray next waits for it first."""

from __future__ import annotations

import threading

__all__ = ["shutdown_in_background", "wait_for_shutdown"]

_lock = threading.Lock()
_pending: threading.Thread | None = None


def shutdown_in_background() -> None:
    """ray.shutdown() in a thread; returns at once. Not a daemon: the interpreter waits for
    it at exit, so no Ray process this one started outlives it."""
    import gc

    import ray

    global _pending
    with _lock:
        wait_for_shutdown()
        # Garbage that still holds ObjectRefs (Ray Data's plans keep reference cycles) is
        # freed now, while Ray is up, not by a collection in this thread racing the
        # shutdown's teardown of the core worker. A guess at a crash seen once: a pytest
        # worker died without a trace in the test after a data-prep run stopped in the
        # background.
        gc.collect()
        _pending = threading.Thread(target=ray.shutdown, name="ray-shutdown")
        _pending.start()


def wait_for_shutdown() -> None:
    """Block until a shutdown started by shutdown_in_background has finished (at once when
    none is pending)."""
    pending = _pending
    if pending is not None and pending is not threading.current_thread():
        pending.join()
