"""A route's shared state, one detached actor per route: the request figures every router
replica reports (users' and, apart, testers'), the shadow stage's comparisons, and the lease
under which one rollout holds the route.

The lease is timed by the actor's own clock, so no two hosts' clocks are compared: a holder
renews it while it runs; once it lapses, router replicas stop sending any candidate share and
whoever comes next may take the route over."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Any

import ray

from prefect_ray_lifecycle.compat.ray_internals import actor_class
from prefect_ray_lifecycle.workloads.constants import SERVE_NAMESPACE
from prefect_ray_lifecycle.workloads.figures import percentile, summarize
from prefect_ray_lifecycle.workloads.http import BadRequest, describe
from prefect_ray_lifecycle.workloads.serve.shadow import summarize_shadow

if TYPE_CHECKING:
    from prefect_ray_lifecycle.workloads.serve.router_config import RolloutRecord

__all__ = [
    "RouteState",
    "RouteStateClient",
    "drop_route_state",
    "lease_of",
    "route_figures",
    "route_series",
    "route_shadow",
    "route_shadow_series",
    "route_state",
    "route_state_name",
    "status_window",
]

logger = logging.getLogger("ray.serve")

FIGURES_KEEP_S = 900.0
STATUS_WINDOW_S = 300  # the figures `GET <route>/-/status` reports: the last 5 minutes
MAX_STATUS_WINDOW_S = int(FIGURES_KEEP_S)  # what the route's state keeps
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's own resource of the head node
STATS_FLUSH_S = 0.25
LEASE_POLL_S = 0.5
LEASE_POLL_TIMEOUT_S = 2.0
LATENCY_SAMPLES = 2000  # per version per flush


def route_state_name(route: str) -> str:
    return f"route-state:{route}"


@ray.remote(num_cpus=0, max_restarts=-1)
class RouteState:
    def __init__(self, keep_s: float = FIGURES_KEEP_S):
        self.keep_s = keep_s
        # (at, version, requests, errors, fallbacks, latencies): users' requests, and testers'
        self.windows: deque[tuple[float, str, int, int, int, list[float]]] = deque()
        self.tester_windows: deque[tuple[float, str, int, int, int, list[float]]] = deque()
        # (at, version, role, tally): the shadow's copies (workloads.serve.shadow)
        self.shadow_windows: deque[tuple[float, str, str, tuple]] = deque()
        self.holder: str | None = None
        self.expires_at = 0.0
        self.info: dict[str, Any] = {}

    def record(
        self,
        at: float,
        entries: dict[str, tuple[int, int, int, list[float]]],
        testers: dict[str, tuple[int, int, int, list[float]]] | None = None,
        shadow: dict[tuple[str, str], tuple] | None = None,
    ) -> None:
        for version, (requests, errors, fallbacks, latencies) in entries.items():
            self.windows.append((at, version, requests, errors, fallbacks, latencies))
        for version, (requests, errors, fallbacks, latencies) in (testers or {}).items():
            self.tester_windows.append((at, version, requests, errors, fallbacks, latencies))
        for (version, role), tally in (shadow or {}).items():
            self.shadow_windows.append((at, version, role, tally))
        for window in (self.windows, self.tester_windows, self.shadow_windows):
            while window and window[0][0] < at - self.keep_s:
                window.popleft()

    def summary(
        self, since: float, until: float | None = None, testers: bool = False
    ) -> dict[str, dict[str, Any]]:
        """Per version: requests, errors, error_rate, fallbacks (its failures answered by
        another version), p50_ms and p99_ms, over reports made in [since, until]: users'
        requests (what the gates judge), or with `testers` the testers' alone."""
        until = until if until is not None else time.time() + 1
        grouped: dict[str, list] = defaultdict(lambda: [0, 0, 0, []])
        for at, version, requests, errors, fallbacks, latencies in (
            self.tester_windows if testers else self.windows
        ):
            if since <= at <= until:
                entry = grouped[version]
                entry[0] += requests
                entry[1] += errors
                entry[2] += fallbacks
                entry[3].extend(latencies)
        return {
            version: {**summarize(requests, errors, latencies), "fallbacks": fallbacks}
            for version, (requests, errors, fallbacks, latencies) in grouped.items()
        }

    def series(
        self, since: float, until: float | None = None, bucket_s: float = 1.0
    ) -> dict[str, list[dict[str, Any]]]:
        """Per version, in time order, one point per `bucket_s` in which it was served: `at`
        (the bucket's start, time.time()), requests, requests_per_s, errors, error_rate and
        p99_ms, over reports made in [since, until]."""
        until = until if until is not None else time.time() + 1
        buckets: dict[tuple[str, int], list] = {}
        for at, version, requests, errors, _fallbacks, latencies in self.windows:
            if since <= at <= until:
                entry = buckets.setdefault((version, int((at - since) // bucket_s)), [0, 0, []])
                entry[0] += requests
                entry[1] += errors
                entry[2].extend(latencies)
        series: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for (version, index), (requests, errors, latencies) in sorted(buckets.items()):
            series[version].append(
                {
                    "at": since + index * bucket_s,
                    "requests": requests,
                    "requests_per_s": requests / bucket_s,
                    "errors": errors,
                    "error_rate": errors / requests if requests else 0.0,
                    "p99_ms": percentile(latencies, 0.99),
                }
            )
        return dict(series)

    def shadow_summary(self, since: float, until: float | None = None) -> dict[str, Any]:
        """The shadow's figures over reports made in [since, until]: {"candidate": {version:
        figures}, "noise_floor": {version: figures}} (workloads.serve.shadow.summarize_shadow;
        the noise floor is the live version's own app against live)."""
        until = until if until is not None else time.time() + 1
        grouped: dict[tuple[str, str], list[tuple]] = defaultdict(list)
        for at, version, role, tally in self.shadow_windows:
            if since <= at <= until:
                grouped[(role, version)].append(tally)
        out: dict[str, Any] = {"candidate": {}, "noise_floor": {}}
        for (role, version), tallies in grouped.items():
            out.setdefault(role, {})[version] = summarize_shadow(tallies)
        return out

    def shadow_series(
        self, since: float, until: float | None = None, bucket_s: float = 1.0
    ) -> dict[str, dict[str, list[dict[str, Any]]]]:
        """Per role and version, in time order, one point per `bucket_s` with copies: `at`,
        compared, errors and agreement."""
        until = until if until is not None else time.time() + 1
        buckets: dict[tuple[str, str, int], list[tuple]] = defaultdict(list)
        for at, version, role, tally in self.shadow_windows:
            if since <= at <= until:
                buckets[(role, version, int((at - since) // bucket_s))].append(tally)
        series: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
        for (role, version, index), tallies in sorted(buckets.items()):
            figures = summarize_shadow(tallies)
            series[role][version].append(
                {
                    "at": since + index * bucket_s,
                    "compared": figures["compared"],
                    "errors": figures["errors"],
                    "dropped": figures["dropped"],
                    "agreement": figures["agreement"],
                }
            )
        return {role: dict(versions) for role, versions in series.items()}

    def claim(self, holder: str, lease_s: float, info: dict[str, Any]) -> dict[str, Any]:
        """Take (or keep) the route for `holder` when it is free, lapsed or already
        theirs. Returns the lease as it stands afterwards, with `granted`, and `replaced`:
        the lapsed holder it was taken from."""
        now = time.monotonic()
        granted = self.holder in (None, holder) or now >= self.expires_at
        replaced = self.holder if granted and self.holder not in (None, holder) else None
        if granted:
            self.holder, self.expires_at, self.info = holder, now + lease_s, dict(info)
        return {**self.lease(), "granted": granted, "replaced": replaced}

    def renew(self, holder: str, lease_s: float, info: dict[str, Any] | None = None) -> bool:
        """Extend the holder's lease; False when it is no longer theirs (lapsed and taken)."""
        if self.holder != holder:
            return False
        self.expires_at = time.monotonic() + lease_s
        if info:
            self.info.update(info)
        return True

    def release(self, holder: str) -> bool:
        if self.holder != holder:
            return False
        self.holder, self.expires_at, self.info = None, 0.0, {}
        return True

    def lease(self) -> dict[str, Any]:
        remaining = self.expires_at - time.monotonic()
        return {
            "holder": self.holder,
            "held": self.holder is not None and remaining > 0,
            "expires_in_s": round(remaining, 3) if self.holder is not None else None,
            "info": dict(self.info),
        }

    def holds(self, holder: str) -> bool:
        return self.holder == holder and time.monotonic() < self.expires_at


_THIS_CLASS = f"{__name__}.RouteState"


def route_state(route: str, create: bool = True) -> Any:
    """The route's state actor (created when missing, unless `create` is False: then None).

    A route's actor that an earlier layout created (its class under another module, e.g.
    `workloads.route_state` before the one import package) is replaced by this one: this
    process cannot load that class, so its handle would take keyword arguments only. What is
    lost is seconds of request figures and a lease, which no rollout of today's code holds."""
    name = route_state_name(route)
    for _ in range(3):
        try:
            actor = ray.get_actor(name, namespace=SERVE_NAMESPACE)
        except ValueError:
            actor = None
        if actor is not None and actor_class(actor) not in (_THIS_CLASS, None):
            logger.warning("route %s: replacing its state actor of %s", route, actor_class(actor))
            ray.kill(actor, no_restart=True)
            _wait_gone(name)
            continue
        if actor is not None or not create:
            return actor
        actor = RouteState.options(
            name=name,
            namespace=SERVE_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            # On the head, with Serve's controller: losing a worker node must not lose the lease.
            resources={HEAD_NODE_RESOURCE: 0.001},
        ).remote()
        # An old router may have recreated its own class in the meantime: check again.
        if actor_class(actor) in (_THIS_CLASS, None):  # None: Ray Client does not say
            return actor
    raise RuntimeError(f"route {route}: its state actor keeps coming back as another class")


def _wait_gone(name: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=SERVE_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


class RouteStateClient:
    """A router replica's side of the route's state: request figures, counted in the replica
    and flushed in batches, and the route's lease, polled in the background (`run`)."""

    def __init__(self, route: str, shadow: Any = None):
        self.route = route
        self.pending: dict[str, list] = {}
        self.pending_testers: dict[str, list] = {}
        self.shadow = shadow  # the replica's workloads.serve.shadow.Mirror, if any
        self.actor: Any = None
        self.lease: dict[str, Any] = {}
        # Until when (time.monotonic()) the lease last seen holds: the expiry the actor gave,
        # counted from when this replica asked, so never later than the actor's own.
        self.lease_until = 0.0

    def add(
        self,
        version: str,
        error: bool,
        latency_ms: float,
        fallback: bool = False,
        tester: bool = False,
    ) -> None:
        """Count one answer: a user's (what the gates judge), or a tester's, kept apart."""
        pending = self.pending_testers if tester else self.pending
        entry = pending.setdefault(version, [0, 0, 0, []])
        entry[0] += 1
        entry[1] += int(error)
        entry[2] += int(fallback)
        if len(entry[3]) < LATENCY_SAMPLES:
            entry[3].append(latency_ms)
        else:  # keep a uniform sample
            slot = random.randrange(entry[0])
            if slot < LATENCY_SAMPLES:
                entry[3][slot] = latency_ms

    def holds(self, rollout: RolloutRecord | None) -> bool:
        """Whether `rollout` holds the route's lease: its holder's, as last seen, and not past
        the expiry the actor last gave (a holder that stops renewing loses it then, even
        while the actor does not answer; a slow poll under load does not lose it early)."""
        return (
            rollout is not None
            and self.lease.get("held") is True
            and self.lease.get("holder") == rollout.holder
            and time.monotonic() < self.lease_until
        )

    async def summary(
        self, since: float, timeout_s: float, testers: bool = False
    ) -> dict[str, dict[str, Any]]:
        """The route's per-version figures since `since` (time.time()), as every replica
        reported them; raises when the route's state does not answer within `timeout_s`."""
        return await asyncio.wait_for(self._actor().summary.remote(since, None, testers), timeout_s)

    async def shadow_summary(self, since: float, timeout_s: float) -> dict[str, Any]:
        return await asyncio.wait_for(self._actor().shadow_summary.remote(since), timeout_s)

    def _actor(self) -> Any:
        if self.actor is None:
            self.actor = route_state(self.route)
        return self.actor

    async def run(self) -> None:
        polled = 0.0
        while True:
            await asyncio.sleep(STATS_FLUSH_S)
            try:
                shadow = self.shadow.take() if self.shadow is not None else {}
                if self.pending or self.pending_testers or shadow:
                    pending, self.pending = self.pending, {}
                    testers, self.pending_testers = self.pending_testers, {}
                    self._actor().record.remote(
                        time.time(),
                        {v: tuple(e) for v, e in pending.items()},
                        {v: tuple(e) for v, e in testers.items()},
                        shadow,
                    )
                if time.monotonic() - polled >= LEASE_POLL_S:
                    polled = time.monotonic()
                    lease = await asyncio.wait_for(
                        self._actor().lease.remote(), LEASE_POLL_TIMEOUT_S
                    )
                    self.lease = lease
                    self.lease_until = polled + (lease.get("expires_in_s") or 0.0)
            except Exception:  # figures and leases must never break serving
                logger.exception("router %s: route state unreachable", self.route)
                self.actor = None


def route_figures(route: str, since: float, until: float | None = None) -> dict[str, dict]:
    """Per-version figures the route's routers reported since `since` (time.time()); empty
    when nothing was served."""
    actor = route_state(route, create=False)
    if actor is None:
        return {}
    return ray.get(actor.summary.remote(since, until), timeout=10)


def route_series(
    route: str, since: float, until: float | None = None, points: int = 240
) -> dict[str, list[dict[str, Any]]]:
    """Per-version request figures over time (see RouteState.series), in about `points`
    buckets of at least a second; empty when the route has no state. Kept FIGURES_KEEP_S."""
    actor = route_state(route, create=False)
    if actor is None:
        return {}
    return ray.get(actor.series.remote(since, until, _bucket_s(since, until, points)), timeout=10)


def _bucket_s(since: float, until: float | None, points: int) -> float:
    """Buckets of at least a second, about `points` of them over [since, until]."""
    span = (until if until is not None else time.time()) - since
    return max(1.0, span / max(points, 1))


def route_shadow(route: str, since: float, until: float | None = None) -> dict[str, Any]:
    """The shadow's figures the route's routers reported since `since` (see
    RouteState.shadow_summary); empty roles when the route has no state."""
    actor = route_state(route, create=False)
    if actor is None:
        return {"candidate": {}, "noise_floor": {}}
    return ray.get(actor.shadow_summary.remote(since, until), timeout=10)


def route_shadow_series(
    route: str, since: float, until: float | None = None, points: int = 240
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The shadow's agreement over time (see RouteState.shadow_series), bucketed as
    route_series; empty when the route has no state."""
    actor = route_state(route, create=False)
    if actor is None:
        return {}
    bucket_s = _bucket_s(since, until, points)
    return ray.get(actor.shadow_series.remote(since, until, bucket_s), timeout=10)


def lease_of(route: str) -> dict[str, Any] | None:
    """The route's lease as its state actor sees it; None when the route has no state."""
    actor = route_state(route, create=False)
    if actor is None:
        return None
    return ray.get(actor.lease.remote(), timeout=10)


def drop_route_state(route: str) -> None:
    actor = route_state(route, create=False)
    if actor is not None:
        ray.kill(actor)


def status_window(values: list[str]) -> int:
    """The figures window of `GET <route>/-/status?window_s=N`: whole seconds within
    [1, MAX_STATUS_WINDOW_S], STATUS_WINDOW_S when not given; a 400 for anything else."""
    if not values:
        return STATUS_WINDOW_S
    expected = f"a whole number of seconds from 1 to {MAX_STATUS_WINDOW_S}"
    if len(values) > 1:
        raise BadRequest(400, f"window_s is given {len(values)} times; give it once: {expected}")
    value = values[0]
    if not re.fullmatch(r"[0-9]{1,6}", value) or not 1 <= int(value) <= MAX_STATUS_WINDOW_S:
        raise BadRequest(400, f"window_s must be {expected}, got {describe(value)}", "window_s")
    return int(value)
