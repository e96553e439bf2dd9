"""The shadow stage inside a router replica: copies of sampled live requests sent to the
candidate off the users' path, and each pair of answers compared.

A user's request only decides whether it is copied (`Mirror.admit`: the share and a
per-replica rate cap) and, once live has answered it, drops the copy in a bounded queue
(`Mirror.offer`; a full queue drops it, counted). The copies are sent by the mirror's own
task on the replica's event loop, started in an empty context: Serve cancels the calls a
request made when that request ends, and finds them through the request's context, so a copy
made under the user's request would die with it.

A policy's copies share calls: those that arrive within BATCH_WAIT_S go to the candidate as
one batch of the observations live parsed (float32 rows), and its actions are split back per
copy. A call through Serve costs far more CPU than a small policy's forward pass, and a copy
per call would add a second request's worth of work for every user request (at share 1.0 on
a busy machine, users' p99 more than tripled). A batch the candidate fails is sent again one
copy at a time, so a failure counts against the requests that fail; one that timed out is
not (each copy counts as failed). Each copy's candidate latency is its batch's.

Comparison (pure, `compare`): a policy's greedy actions row by row, and the total variation
distance of its action probabilities where the policy reports them; an LLM's completion at
temperature 0 as token ids, exact match and their common prefix. Both sides' latencies on the
same requests are kept, and a candidate's failure (5xx, timeout, an answer live did not give)
is an error.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect_ray_lifecycle.workloads.constants import SHADOW_KEY
from prefect_ray_lifecycle.workloads.figures import percentile
from prefect_ray_lifecycle.workloads.http import RAW_TYPE

if TYPE_CHECKING:  # the route's state actor loads this module: keep it light
    from prefect_ray_lifecycle.workloads.serve.router_config import Shadow, Target

__all__ = [
    "Mirror",
    "batches",
    "Pair",
    "ShadowTally",
    "compare",
    "greedy_llm_request",
    "summarize_shadow",
]

logger = logging.getLogger("ray.serve")

QUEUE_SIZE = 256  # copies waiting per replica (a batch window of them); more are dropped
IN_FLIGHT = 8  # calls (single copies or batches) being answered at once per replica
BATCH_WAIT_S = 0.25  # a policy copy waits this long for others to share its call
BATCH_ROWS = 1024  # observations per batched call, at most
LATENCY_SAMPLES = 1000  # per version and role per flush
ACTION_TOLERANCE = 1e-6  # continuous actions agree within this


@dataclass(frozen=True)
class Pair:
    """One compared pair: `rows` answers (a policy's batch rows; 1 for an LLM) of which
    `agreed` were the same; a policy's summed TVD over `tvd_rows`; an LLM's common token
    prefix over the longer completion's length."""

    rows: int
    agreed: int
    tvd_sum: float = 0.0
    tvd_rows: int = 0
    prefix: int = 0
    longest: int = 0


def compare(kind: str, live: dict[str, Any] | None, candidate: dict[str, Any] | None) -> Pair:
    """Compare two versions' shadow extras for one request; ValueError when they cannot be
    compared (missing, or different batch sizes: the candidate answered something else)."""
    if not isinstance(live, dict) or not isinstance(candidate, dict):
        raise ValueError("an answer carries nothing to compare")
    if kind == "llm":
        ours, theirs = list(live.get("token_ids") or []), candidate.get("token_ids")
        if not isinstance(theirs, list):
            raise ValueError("the candidate's answer carries no token ids")
        prefix = 0
        for a, b in zip(ours, theirs, strict=False):
            if a != b:
                break
            prefix += 1
        longest = max(len(ours), len(theirs))
        return Pair(1, int(ours == theirs), prefix=prefix, longest=longest)
    ours, theirs = live.get("actions"), candidate.get("actions")
    if not isinstance(ours, list) or not isinstance(theirs, list) or len(ours) != len(theirs):
        raise ValueError("the two answers hold different numbers of actions")
    agreed = sum(_same_action(a, b) for a, b in zip(ours, theirs, strict=True))
    tvd_sum, tvd_rows = 0.0, 0
    p, q = live.get("probabilities"), candidate.get("probabilities")
    if isinstance(p, list) and isinstance(q, list) and len(p) == len(q) == len(ours):
        for left, right in zip(p, q, strict=True):
            if len(left) == len(right):
                tvd_sum += 0.5 * sum(abs(a - b) for a, b in zip(left, right, strict=True))
                tvd_rows += 1
    return Pair(len(ours), agreed, tvd_sum, tvd_rows)


def _same_action(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_action(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= ACTION_TOLERANCE
        except (TypeError, ValueError):
            return False
    return a == b


def greedy_llm_request(req: dict[str, Any]) -> dict[str, Any] | None:
    """The copy of an LLM request to mirror: whole (a streamed request is mirrored
    unstreamed), or None when it is not greedy (temperature 0), so that two versions' answers
    could not be compared."""
    try:
        payload = json.loads(req.get("body") or b"")
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(payload, dict) or payload.get("temperature") != 0:
        return None
    if payload.get("stream") is True:
        payload = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
        return {**req, "body": json.dumps(payload).encode()}
    return req


@dataclass
class ShadowTally:
    """What one replica saw of one version's copies since its last flush."""

    copies: int = 0  # copies answered or failed
    errors: int = 0
    dropped: int = 0  # copies the full queue turned away
    rows: int = 0
    agreed: int = 0
    exact: int = 0  # pairs whose answers were the same whole
    tvd_sum: float = 0.0
    tvd_rows: int = 0
    prefix_share_sum: float = 0.0  # LLM: the common token prefix over the longer completion
    llm_pairs: int = 0
    live_ms: list[float] = field(default_factory=list)
    candidate_ms: list[float] = field(default_factory=list)

    def add(self, pair: Pair | None, live_ms: float, candidate_ms: float, kind: str) -> None:
        self.copies += 1
        if pair is None:
            self.errors += 1
        else:
            self.rows += pair.rows
            self.agreed += pair.agreed
            self.exact += int(pair.agreed == pair.rows)
            self.tvd_sum += pair.tvd_sum
            self.tvd_rows += pair.tvd_rows
            if kind == "llm":
                self.llm_pairs += 1
                self.prefix_share_sum += pair.prefix / pair.longest if pair.longest else 1.0
        for samples, value in ((self.live_ms, live_ms), (self.candidate_ms, candidate_ms)):
            if len(samples) < LATENCY_SAMPLES:
                samples.append(value)
            else:  # a uniform sample
                slot = random.randrange(self.copies)
                if slot < LATENCY_SAMPLES:
                    samples[slot] = value

    def as_tuple(self) -> tuple:
        return (
            self.copies,
            self.errors,
            self.dropped,
            self.rows,
            self.agreed,
            self.exact,
            self.tvd_sum,
            self.tvd_rows,
            self.prefix_share_sum,
            self.llm_pairs,
            self.live_ms,
            self.candidate_ms,
        )


def summarize_shadow(tallies: list[tuple]) -> dict[str, Any]:
    """One version's shadow figures from replicas' flushed tallies: copies, compared, errors,
    error_rate, dropped, agreement (rows that agreed), exact_match (pairs the same whole),
    tvd (mean, None where no probabilities), token_prefix (LLM: mean common prefix share),
    and p50/p99 of the candidate and of live on the same requests."""
    copies = errors = dropped = rows = agreed = exact = tvd_rows = llm_pairs = 0
    tvd_sum = prefix_sum = 0.0
    live_ms: list[float] = []
    candidate_ms: list[float] = []
    for t in tallies:
        copies += t[0]
        errors += t[1]
        dropped += t[2]
        rows += t[3]
        agreed += t[4]
        exact += t[5]
        tvd_sum += t[6]
        tvd_rows += t[7]
        prefix_sum += t[8]
        llm_pairs += t[9]
        live_ms.extend(t[10])
        candidate_ms.extend(t[11])
    compared = copies - errors
    live_ms.sort()
    candidate_ms.sort()
    return {
        "copies": copies,
        "compared": compared,
        "errors": errors,
        "error_rate": errors / copies if copies else 0.0,
        "dropped": dropped,
        "rows": rows,
        "agreement": agreed / rows if rows else None,
        "exact_match": exact / compared if compared else None,
        "tvd": tvd_sum / tvd_rows if tvd_rows else None,
        "token_prefix": prefix_sum / llm_pairs if llm_pairs else None,
        "candidate_p50_ms": percentile(candidate_ms, 0.5, presorted=True),
        "candidate_p99_ms": percentile(candidate_ms, 0.99, presorted=True),
        "live_p50_ms": percentile(live_ms, 0.5, presorted=True),
        "live_p99_ms": percentile(live_ms, 0.99, presorted=True),
    }


@dataclass(frozen=True)
class Copy:
    """A live answer to compare against: the request to send again, the target to send it
    to, what live answered (its extras) and how long live took."""

    target: Target
    role: str  # "candidate", or "noise_floor": the live version's own app again
    request: dict[str, Any]
    live: dict[str, Any] | None
    live_ms: float
    timeout_s: float


Send = Callable[["Target", dict[str, Any], float], Awaitable[dict[str, Any]]]


class Mirror:
    """One router replica's shadow: admission, the bounded queue, the task that sends the
    copies (`send`: the router's own forwarding, so failures read as they do for users), and
    the tallies flushed to the route's state."""

    def __init__(self, send: Send, max_bytes: int = 1 << 20):
        self.send = send
        self.max_bytes = max_bytes  # a batched call's body, at most (the users' own limit)
        self.queue: asyncio.Queue[Copy] | None = None
        self.task: asyncio.Task | None = None
        self.pending: dict[tuple[str, str], ShadowTally] = {}
        self.dropped_total = 0
        self.sent_total = 0
        self._tokens: float | None = None  # the rate cap's bucket, full at first
        self._filled_at = time.monotonic()

    def admit(self, shadow: Shadow) -> bool:
        """Whether to copy this request: `share` of them, within the replica's rate cap."""
        if random.random() >= shadow.share:
            return False
        now = time.monotonic()
        capacity = max(1.0, shadow.max_per_s)
        tokens = capacity if self._tokens is None else self._tokens
        self._tokens = min(capacity, tokens + (now - self._filled_at) * shadow.max_per_s)
        self._filled_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def offer(self, copy: Copy) -> None:
        """Queue a copy for sending; never waits (a full queue drops it, counted)."""
        self._start()
        try:
            self.queue.put_nowait(copy)
        except asyncio.QueueFull:
            self.dropped_total += 1
            self._tally(copy).dropped += 1

    def take(self) -> dict[tuple[str, str], tuple]:
        """The tallies since the last call, to flush: {(version, role): tally tuple}."""
        pending, self.pending = self.pending, {}
        return {key: tally.as_tuple() for key, tally in pending.items()}

    def status(self) -> dict[str, Any]:
        return {
            "queued": self.queue.qsize() if self.queue is not None else 0,
            "sent": self.sent_total,
            "dropped": self.dropped_total,
        }

    def _tally(self, copy: Copy) -> ShadowTally:
        return self.pending.setdefault((copy.target.version, copy.role), ShadowTally())

    def _start(self) -> None:
        if self.task is None or self.task.done():
            if self.queue is None:
                self.queue = asyncio.Queue(QUEUE_SIZE)
            # An empty context: no Serve request context for these calls to be cancelled with.
            self.task = asyncio.get_running_loop().create_task(
                self._run(), context=contextvars.Context()
            )

    async def _run(self) -> None:
        slots = asyncio.Semaphore(IN_FLIGHT)
        loop = asyncio.get_running_loop()
        while True:
            copies = [await self.queue.get()]
            if _observations(copies[0]) is not None:
                await asyncio.sleep(BATCH_WAIT_S)  # copies arriving meanwhile share the call
                while not self.queue.empty():
                    copies.append(self.queue.get_nowait())
            for group in batches(copies, self.max_bytes):
                await slots.acquire()
                call = self._one(group[0]) if len(group) == 1 else self._many(group)
                task = loop.create_task(call)
                task.add_done_callback(lambda _: slots.release())

    async def _call(self, copy: Copy, request: dict[str, Any]) -> tuple[dict[str, Any], float]:
        started = time.perf_counter()
        try:
            answer = await self.send(copy.target, request, copy.timeout_s)
        except Exception:  # the router's forwarding answers failures; this is a bug's net
            logger.exception("shadow copy to v%s failed", copy.target.version)
            answer = {"status": 599}
        return answer, (time.perf_counter() - started) * 1000

    async def _one(self, copy: Copy) -> None:
        answer, elapsed = await self._call(copy, copy.request)
        self.sent_total += 1
        pair = None
        if answer.get("status") == 200:
            try:
                pair = compare(copy.target.kind, copy.live, answer.get(SHADOW_KEY))
            except ValueError:
                pair = None
        self._tally(copy).add(pair, copy.live_ms, elapsed, copy.target.kind)

    async def _many(self, group: list[Copy]) -> None:
        """Send policy copies as one batch and compare each copy's rows with live's."""
        first = group[0]
        parts = [_observations(copy) for copy in group]
        body = b"".join(data for data, _ in parts)
        request = {**first.request, "headers": {"content-type": RAW_TYPE}, "body": body}
        answer, elapsed = await self._call(first, request)
        status = answer.get("status")
        if status not in (200, 504):  # again one by one: the failure is some copies' own
            for copy in group:
                await self._one(copy)
            return
        extras = answer.get(SHADOW_KEY) if status == 200 else None
        start = 0
        for copy, (_, rows) in zip(group, parts, strict=True):
            pair = None
            if isinstance(extras, dict):
                try:
                    pair = compare(copy.target.kind, copy.live, _rows(extras, start, rows))
                except ValueError:
                    pair = None
            start += rows
            self.sent_total += 1
            self._tally(copy).add(pair, copy.live_ms, elapsed, copy.target.kind)


def _observations(copy: Copy) -> tuple[bytes, int] | None:
    """A policy copy's observations as live parsed them (float32 bytes, and their rows: one per
    action live gave), or None when the copy cannot share a call."""
    live = copy.live
    if copy.target.kind != "policy" or not isinstance(live, dict):
        return None
    data, actions = live.get("observations"), live.get("actions")
    if not isinstance(data, bytes) or not isinstance(actions, list) or not actions:
        return None
    return data, len(actions)


def _rows(extras: dict[str, Any], start: int, rows: int) -> dict[str, Any]:
    """One copy's share of a batch's answer (ValueError when the batch's is short)."""
    actions, probabilities = extras.get("actions"), extras.get("probabilities")
    if not isinstance(actions, list) or len(actions) < start + rows:
        raise ValueError("the candidate answered fewer rows than it was sent")
    part = probabilities[start : start + rows] if isinstance(probabilities, list) else None
    return {"actions": actions[start : start + rows], "probabilities": part}


def batches(copies: list[Copy], max_bytes: int) -> list[list[Copy]]:
    """Copies grouped into calls: a policy's copies to the same app for the same role share a
    call, up to BATCH_ROWS observations and `max_bytes` of body, in the order they came; any
    other copy goes alone."""
    calls: list[list[Copy]] = []
    open_: dict[tuple[str, str], tuple[list[Copy], int, int]] = {}
    for copy in copies:
        part = _observations(copy)
        if part is None:
            calls.append([copy])
            continue
        key = (copy.target.app, copy.role)
        group, rows, size = open_.get(key, ([], 0, 0))
        if group and (rows + part[1] > BATCH_ROWS or size + len(part[0]) > max_bytes):
            group, rows, size = [], 0, 0
        if not group:
            calls.append(group)
        group.append(copy)
        open_[key] = (group, rows + part[1], size + len(part[0]))
    return calls
