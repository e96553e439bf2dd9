"""Watching routes from outside Ray, beside the webhook receiver (a process that already lives
as long as the stack and talks to Prefect).

Every EVERY_S seconds, each route that ever had a rollout (it has a `serve-rollout-<route>`
concurrency limit) is asked for its `-/status` on the RayCluster block's Serve address, all
routes at once. A route whose router answers and serves a live version gets one heartbeat
event, `ray-lifecycle.route.healthy`, with the route, its model and kind; one that does not
answer gets none. A proactive trigger in prefect.yaml (per route) runs `reconcile` for a route
whose heartbeats stopped after it had some: a restarted Ray head, a lost router. The rollout
that leaves a route serving sends its first beat itself (tasks.rollout.record.heartbeat), so a
head lost before the watch's next round is missed too. So a healthy route costs a heartbeat
and no flow run, and nothing polls from a flow run.

MLflow is never asked, so an MLflow outage is not a lost route. While Prefect is down no
heartbeat can be sent, and the trigger (on the Prefect server) is down too: when both are
back, a route that kept answering sends its next heartbeat within EVERY_S.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from prefect.client.orchestration import PrefectClient
from prefect.events import Event

from deployments.status import model_of
from prefect_ray_lifecycle.tasks.rollout.record import (
    ROUTE_HEALTHY,
    ROUTE_REMOVED,
    heartbeat_resource,
    route_resource,
)

EVERY_S = 10.0  # a heartbeat per healthy route this often; the trigger waits 3 of them
PROBE_TIMEOUT_S = 5.0
LIMIT_PREFIX = "serve-rollout-"  # tasks.rollout.claim.limit_name

logger = logging.getLogger(__name__)


def heartbeat(route: str, status: dict[str, Any]) -> Event | None:
    """The route's heartbeat from what its router answered; None when it serves nothing."""
    live = (status.get("config") or {}).get("live")
    if not live:
        return None
    return Event(
        event=ROUTE_HEALTHY,
        resource=heartbeat_resource(
            route,
            model_of(status) or "",
            str(live.get("kind") or "policy"),
            str(live.get("version") or ""),
        ),
    )


def removed(route: str) -> None:
    """Say that `route` was taken down on purpose (its heartbeats stop): the trigger that
    restores lost routes leaves it alone."""
    from prefect.events import emit_event

    emit_event(
        event=ROUTE_REMOVED,
        resource={"prefect.resource.id": route_resource(route), "ray-lifecycle.route": route},
    )


async def watched_routes(client: PrefectClient) -> list[str]:
    limits = await client.read_global_concurrency_limits(limit=200)
    return sorted(
        limit.name.removeprefix(LIMIT_PREFIX)
        for limit in limits
        if limit.name.startswith(LIMIT_PREFIX)
    )


async def serve_url(client: PrefectClient, block_name: str) -> str | None:
    """The Serve address the RayCluster block names (None until the block exists)."""
    from prefect_ray_lifecycle.blocks import RayCluster

    try:
        document = await client.read_block_document_by_name(block_name, "ray-cluster")
    except Exception:  # no block yet, or Prefect unreachable: nothing to watch this round
        return None
    return RayCluster.model_validate(document.data).serve_url


async def probe(http: httpx.AsyncClient, url: str, route: str) -> dict[str, Any] | None:
    try:
        answer = await http.get(f"{url}/{route}/-/status", timeout=PROBE_TIMEOUT_S)
    except (httpx.HTTPError, OSError):
        return None
    if answer.status_code != 200:
        return None
    try:
        return answer.json()
    except ValueError:
        return None


async def beat_once(client: PrefectClient, http: httpx.AsyncClient, block_name: str) -> int:
    """One round: a heartbeat for every route that answers; returns how many were sent."""
    url = await serve_url(client, block_name)
    if url is None:
        return 0
    routes = await watched_routes(client)
    # All at once: one slow or dead route must not hold back the others' beats.
    statuses = await asyncio.gather(*(probe(http, url, route) for route in routes))
    events = [
        event
        for route, status in zip(routes, statuses, strict=True)
        if status is not None and (event := heartbeat(route, status)) is not None
    ]
    if events:
        await client.request("POST", "/events", json=[e.model_dump(mode="json") for e in events])
    return len(events)


async def watch(client: PrefectClient, block_name: str, every_s: float = EVERY_S) -> None:
    """Heartbeats until cancelled; a failed round (Prefect or the block unreachable) is
    logged and the next one tried."""
    async with httpx.AsyncClient() as http:
        while True:
            try:
                await beat_once(client, http, block_name)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                logger.warning("route watch: this round failed: %r", error)
            await asyncio.sleep(every_s)
