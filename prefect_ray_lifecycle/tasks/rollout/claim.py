"""Holding a route for one rollout, safely when the holder dies.

A claim is two things, renewed together by one thread while the holder runs:
- the route's Prefect global concurrency limit `serve-rollout-<route>` (limit 1), taken with
  a lease whose id the claim records, so that rollouts never overlap whoever starts them;
- the lease in the route's state actor (workloads.serve.route_state), which router replicas check
  before they send a candidate any traffic.

A holder that dies stops renewing: the route lease lapses within `lease_s` and the router
serves the live version only. The next claimant then frees the dead holder's Prefect slot by
its recorded lease id instead of waiting for Prefect to expire it (its leases last at least
60 s). Claims are reentrant within one call chain: a reconcile that holds the route runs its
serve-rollout subflow under the same claim.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import ray
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.exceptions import MissingContextError, ObjectAlreadyExists, ObjectNotFound
from prefect.logging import get_logger, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Crashed

from prefect_ray_lifecycle.workloads.serve.route_state import route_state

__all__ = [
    "RouteClaim",
    "holding_route",
    "route_holder",
    "RouteClaimLost",
    "ensure_rollout_limit",
    "hold_route",
    "limit_name",
    "mark_crashed",
    "run_and_subflows",
]

logger = get_logger(__name__)

SLOT_LEASE_S = 60.0  # the shortest lease Prefect's server grants on a concurrency slot
POLL_S = 1.0  # how often a waiting claimant looks at the slot and the route lease
SUBFLOW_DEPTH = 3  # reconcile -> serve-rollout -> rollout-approval
_HELD: contextvars.ContextVar[dict[str, RouteClaim] | None] = contextvars.ContextVar(
    "held_routes", default=None
)


class RouteClaimLost(RuntimeError):
    """This rollout no longer holds its route (its lease lapsed and was taken over)."""


@dataclass
class RouteClaim:
    route: str
    holder: str
    lease_s: float
    slot_lease_id: uuid.UUID | None
    took_over: str | None = None  # the lapsed holder whose slot this claim freed
    lost: threading.Event = field(default_factory=threading.Event, repr=False)

    def check(self) -> None:
        """Raise RouteClaimLost when the route is no longer ours."""
        if self.lost.is_set():
            raise RouteClaimLost(
                f"rollout {self.holder} lost route {self.route}: its lease lapsed and was "
                f"taken over"
            )


def route_holder() -> str:
    """Who holds a route: this flow run (a fresh id outside one)."""
    return str(flow_run.id or uuid.uuid4())


def limit_name(route: str) -> str:
    return f"serve-rollout-{route}"


def ensure_rollout_limit(route: str) -> str:
    """The global concurrency limit that keeps rollouts on one route from overlapping
    (deployments.setup creates it too); returns its name."""
    name = limit_name(route)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1)
                )
    return name


@contextlib.contextmanager
def hold_route(route: str, holder: str, lease_s: float) -> Iterator[RouteClaim]:
    """Wait for the route, hold it while the block runs, then let it go. Needs this process
    connected to the route's Ray cluster."""
    held = _HELD.get() or {}
    if route in held:  # a subflow of the holder: the route is already ours
        yield held[route]
        return
    actor = route_state(route)
    claim = _acquire(route, holder, lease_s, actor)
    token = _HELD.set({**held, route: claim})
    stop = threading.Event()
    # Two threads: the route's lease (Ray) never waits on Prefect, whose client retries a call
    # for about a minute while its server is down (the lease would lapse meanwhile). Each runs
    # in a copy of this context: Prefect's settings (its API URL) live in context variables,
    # and a bare thread would talk to a temporary server instead.
    renewers = [
        threading.Thread(
            target=contextvars.copy_context().run,
            args=args,
            name=f"{what}-{route}",
            daemon=True,
        )
        for what, args in (
            ("route-lease", (_renew, claim, actor, stop)),
            ("route-slot", (_renew_slot, claim, stop)),
        )
    ]
    for renewer in renewers:
        renewer.start()
    try:
        yield claim
    finally:
        stop.set()
        for renewer in renewers:
            renewer.join(timeout=5)
        _HELD.reset(token)
        with contextlib.suppress(Exception):  # a dead cluster lets nothing be released
            ray.get(actor.release.remote(holder), timeout=10)
        _release_slot(claim.slot_lease_id)


@contextlib.contextmanager
def holding_route(cluster: Any, route: str, lease_s: float) -> Iterator[RouteClaim]:
    """This flow run joins `cluster` (a RayCluster block) and holds `route` for the block:
    its subflows' rollouts and reconciles run under the same claim. A pipeline holds the
    route from the promotion it makes to the end of its rollout, so the reconcile that its
    `champion` move triggers finds the route in sync when it gets it, instead of racing it."""
    from prefect_ray_lifecycle.control import serve_control

    with cluster.connect() as joined:
        try:
            with hold_route(route, route_holder(), lease_s) as claim:
                yield claim
        finally:
            if joined is not None:  # this flow started the Ray connection: leave no handles
                serve_control.release()


def _run_logger() -> Any:
    """The flow run's logger (its lines reach the run in the UI), else this module's."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logger


def _acquire(route: str, holder: str, lease_s: float, actor: Any) -> RouteClaim:
    log = _run_logger()
    name = ensure_rollout_limit(route)
    lease_holder = _lease_holder(holder)
    took_over = None
    waited = False
    while True:
        slot = _try_slot(name, lease_holder)
        if slot is not None:
            break
        if not waited:
            log.info("route %s is held by another rollout: waiting for it", route)
            waited = True
        lease = ray.get(actor.lease.remote(), timeout=10)
        dead = lease["holder"] is not None and not lease["held"] and lease["holder"] != holder
        if dead and lease["info"].get("slot_lease_id"):
            # Its lease lapsed: it stopped renewing. Free its slot rather than wait for
            # Prefect to expire it.
            log.warning(
                "route %s: holder %s let its lease lapse; freeing its concurrency slot",
                route,
                lease["holder"],
            )
            _release_slot(uuid.UUID(lease["info"]["slot_lease_id"]))
            took_over = lease["holder"]
        time.sleep(POLL_S)
    info = {"slot_lease_id": str(slot), "claimed_at": time.time()}
    while True:
        granted = ray.get(actor.claim.remote(holder, lease_s, info), timeout=10)
        if granted["granted"]:
            took_over = took_over or granted["replaced"]
            break
        # A holder that takes no slot (or one Prefect already expired) still holds its lease.
        time.sleep(min(POLL_S, max(0.1, granted["expires_in_s"] or POLL_S)))
    return RouteClaim(route, holder, lease_s, slot, took_over=took_over)


def _lease_holder(holder: str) -> ConcurrencyLeaseHolder | None:
    try:
        return ConcurrencyLeaseHolder(type="flow_run", id=uuid.UUID(holder))
    except ValueError:
        return None


def _try_slot(name: str, holder: ConcurrencyLeaseHolder | None) -> uuid.UUID | None:
    """One attempt at the route's slot: the lease id, or None while another holds it."""
    with get_client(sync_client=True) as client:
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[name],
                slots=1,
                mode="concurrency",
                lease_duration=SLOT_LEASE_S,
                holder=holder,
            )
        except httpx.HTTPStatusError as error:
            if error.response.status_code == 423:  # locked: held by someone else
                return None
            raise
    return uuid.UUID(response.json()["lease_id"])


def _release_slot(lease_id: uuid.UUID | None) -> None:
    if lease_id is None:
        return
    try:
        with get_client(sync_client=True) as client:
            client.release_concurrency_slots_with_lease(lease_id)
    except Exception as error:  # already expired or released: nothing is held
        logger.debug("concurrency lease %s was not released: %r", lease_id, error)


def _renew(claim: RouteClaim, actor: Any, stop: threading.Event) -> None:
    """Renew the route lease every third of its length; mark the claim lost when the route
    lease is no longer ours."""
    every = claim.lease_s / 3
    last_ok = time.monotonic()
    while not stop.wait(every):
        try:
            if not ray.get(actor.renew.remote(claim.holder, claim.lease_s), timeout=every):
                claim.lost.set()
                return
            last_ok = time.monotonic()
        except Exception as error:  # the actor may be restarting: keep trying for a while
            logger.warning("could not renew the lease on route %s: %r", claim.route, error)
            if time.monotonic() - last_ok > claim.lease_s:
                claim.lost.set()
                return


def _renew_slot(claim: RouteClaim, stop: threading.Event) -> None:
    """Renew the route's Prefect concurrency slot well before its expiry. While Prefect is
    down the slot may expire; the route's lease (in Ray) still keeps other rollouts out."""
    if claim.slot_lease_id is None:
        return
    while not stop.wait(SLOT_LEASE_S / 4):
        try:
            with get_client(sync_client=True) as client:
                client.renew_concurrency_lease(claim.slot_lease_id, SLOT_LEASE_S)
        except Exception as error:
            logger.warning("could not renew route %s's slot: %r", claim.route, error)


def run_and_subflows(client: Any, run_id: uuid.UUID) -> list[Any]:
    """A flow run and its subflows down to their own (reconcile -> serve-rollout ->
    rollout-approval), the run first; ObjectNotFound when there is no such run."""
    runs, parents = [client.read_flow_run(run_id)], [run_id]
    for _ in range(SUBFLOW_DEPTH):
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)
            )
        )
        runs += children
        parents = [run.id for run in children]
        if not parents:
            break
    return runs


def mark_crashed(holder: str, taken_over_by: str) -> list[str]:
    """The flow runs a dead holder left unfinished (itself when no worker saw it die, and its
    subflows down to their own: the serve-rollout a killed reconcile was running, the approval
    a killed rollout was waiting for, Paused), marked Crashed with who took the route over.
    Returns their ids."""
    try:
        holder_id = uuid.UUID(holder)
    except ValueError:
        return []
    message = f"its process died holding the route; taken over by flow run {taken_over_by}"
    marked = []
    with get_client(sync_client=True) as client:
        try:
            runs = run_and_subflows(client, holder_id)
        except ObjectNotFound:  # a holder that was not a flow run
            return []
        for run in runs:
            if run.state is not None and not run.state.is_final():
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                marked.append(str(run.id))
    return marked
