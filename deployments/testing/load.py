"""Closed-loop HTTP load on a route, recording what every answer said: its status, the
version that answered (X-Model-Version), the version it fell back from (X-Fallback-From), its
latency and the session it belonged to (X-Session-Id). The tests, the serving benchmarks and
the demo watch rollouts through it."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect_ray_lifecycle.workloads.constants import (
    FALLBACK_HEADER,
    SESSION_HEADER,
    VERSION_HEADER,
)
from prefect_ray_lifecycle.workloads.figures import percentile

__all__ = ["LOAD_PAUSE_S", "OBSERVATION", "Answer", "ClosedLoop", "OpenLoop", "Request"]

OBSERVATION = [0.01, -0.02, 0.03, 0.04]  # a CartPole observation
# The users the tests send while a rollout runs: one request about every 0.1 s. Each request
# costs about 13 ms of CPU across Serve's proxy, the router and a version's replica (measured
# on 2 cores): a loop at 0.02 s took a third of a core from everything else in the suite,
# while the gates only need a few requests a step (canary_min_requests).
LOAD_PAUSE_S = 0.1


@dataclass(frozen=True)
class Answer:
    at: float  # time.time() when the answer arrived
    status: int  # 0: no answer (connection refused or reset)
    version: str | None
    fallback_from: str | None
    latency_ms: float
    body: bytes
    session: str | None = None  # the X-Session-Id it was sent with
    request: int | None = None  # which request it answered (n, for a `requests` load)


# The n-th request a load sends: its body and extra headers.
Request = Callable[[int], tuple[bytes, dict[str, str]]]


def _post(
    connection: http.client.HTTPConnection, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, str | None, str | None, bytes]:
    """One request: (status, X-Model-Version, X-Fallback-From, body); status 0 and the error
    for no answer (refused or reset: the connection is closed, make another)."""
    try:
        connection.request("POST", path, body, headers)
        response = connection.getresponse()
        answer = response.read()
        return (
            response.status,
            response.getheader(VERSION_HEADER),
            response.getheader(FALLBACK_HEADER),
            answer,
        )
    except (OSError, http.client.HTTPException) as error:
        connection.close()
        return 0, None, None, repr(error).encode()


class ClosedLoop:
    """`threads` clients on http://host:port/path, each sending its next request when the
    last one is answered (after `pause_s`): `body` with `headers` each time, or what
    `requests(n)` makes of the n-th request."""

    def __init__(
        self,
        port: int,
        path: str,
        threads: int = 1,
        pause_s: float = 0.0,
        body: bytes | None = None,
        content_type: str = "application/json",
        host: str = "127.0.0.1",
        headers: dict[str, str] | None = None,
        requests: Request | None = None,
    ):
        self.host, self.port, self.path = host, port, path
        self.pause_s = pause_s
        self.body = body if body is not None else json.dumps({"observation": OBSERVATION}).encode()
        self.content_type = content_type
        self.headers = dict(headers or {})
        self.requests = requests
        self._count = itertools.count()
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._workers = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=60)

    def _run(self) -> None:
        connection = self._connect()
        while not self._stop.is_set():
            body, extra, n = self.body, self.headers, None
            if self.requests is not None:
                n = next(self._count)
                body, extra = self.requests(n)
            headers = {"content-type": self.content_type, **extra}
            started = time.perf_counter()
            status, version, fallback, body = _post(connection, self.path, body, headers)
            if status == 0:
                connection = self._connect()
            latency = (time.perf_counter() - started) * 1000
            session = headers.get(SESSION_HEADER)
            self.answers.append(
                Answer(time.time(), status, version, fallback, latency, body, session, n)
            )
            if self.pause_s:
                self._stop.wait(self.pause_s)

    def __enter__(self) -> ClosedLoop:
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=120)

    def failed(self) -> list[Answer]:
        return [a for a in self.answers if not 200 <= a.status < 300]

    def versions(self) -> set[str | None]:
        """The versions that answered 200."""
        return {a.version for a in self.answers if a.status == 200}

    def summary(self) -> dict[str, Any]:
        p99 = percentile([a.latency_ms for a in self.answers], 0.99)
        return {
            "requests": len(self.answers),
            "non_2xx": len(self.failed()),
            "fallbacks": sum(1 for a in self.answers if a.fallback_from),
            "p99_ms": round(p99, 1) if p99 is not None else None,
        }


class OpenLoop:
    """Open-loop load: requests sent at `rate_per_s`, on schedule whether or not earlier ones
    were answered (up to `threads` in flight), each answer's latency counted from when it was
    due, so that a slow server's queueing shows (no coordinated omission). `requests(n)`
    makes the n-th request, as for ClosedLoop."""

    def __init__(
        self,
        port: int,
        path: str,
        rate_per_s: float,
        threads: int = 16,
        requests: Request | None = None,
        host: str = "127.0.0.1",
    ):
        from concurrent.futures import ThreadPoolExecutor

        self.host, self.port, self.path, self.rate = host, port, path, rate_per_s
        self.requests = requests or (
            lambda n: (json.dumps({"observation": OBSERVATION}).encode(), {})
        )
        self.answers: list[Answer] = []
        self.late = 0  # requests that found every thread busy at their time
        self._pool = ThreadPoolExecutor(threads)
        self._local = threading.local()
        self._stop = threading.Event()
        self._scheduler = threading.Thread(target=self._schedule, daemon=True)
        self._busy = threading.Semaphore(threads)

    def _schedule(self) -> None:
        started = time.perf_counter()
        for n in itertools.count():
            due = started + n / self.rate
            if self._stop.wait(max(0.0, due - time.perf_counter())):
                return
            if not self._busy.acquire(blocking=False):
                self.late += 1
                self._busy.acquire()
            self._pool.submit(self._send, n, due)

    def _send(self, n: int, due: float) -> None:
        try:
            connection = getattr(self._local, "connection", None)
            if connection is None:
                connection = self._local.connection = http.client.HTTPConnection(
                    self.host, self.port, timeout=60
                )
            body, extra = self.requests(n)
            headers = {"content-type": "application/json", **extra}
            status, version, fallback, answer = _post(connection, self.path, body, headers)
            if status == 0:
                self._local.connection = None
            latency = (time.perf_counter() - due) * 1000
            self.answers.append(
                Answer(time.time(), status, version, fallback, latency, answer, None, n)
            )
        finally:
            self._busy.release()

    def __enter__(self) -> OpenLoop:
        self._scheduler.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._scheduler.join(timeout=10)
        self._pool.shutdown(wait=True)
