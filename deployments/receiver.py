"""MLflow's registry webhook in, one Prefect event per delivery out.

    python -m deployments.receiver --port 4210 [--host 127.0.0.1] [--block lifecycle]

POST /mlflow takes MLflow's deliveries. Signature, timestamp window and delivery id are
checked before anything is acted on; each accepted delivery becomes exactly one Prefect event
(`mlflow.<entity>.<action>` on the resource `mlflow.registered-model.<name>`), and a 200 means
the Prefect API took it. 503, which MLflow retries, while the MLflowWebhook block does not
exist yet or Prefect cannot be reached. Every 4xx answers {"error": message}. GET /health
answers 200. Needs PREFECT_API_URL; binds 127.0.0.1 unless told otherwise.

It also watches the routes (deployments.route_watch): a heartbeat event per healthy route,
so that a route that stops answering is noticed by a trigger in prefect.yaml.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import re
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import uvicorn
from mlflow.webhooks.constants import (
    WEBHOOK_DELIVERY_ID_HEADER,
    WEBHOOK_SIGNATURE_HEADER,
    WEBHOOK_TIMESTAMP_HEADER,
)
from prefect.client.orchestration import PrefectClient, get_client
from prefect.events import Event
from prefect.settings import PREFECT_API_URL
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments import local, route_watch
from deployments.setup import BLOCK_NAME
from prefect_ray_lifecycle.blocks import MLflowWebhook
from prefect_ray_lifecycle.workloads.http import JSON_TYPE, BadRequest, request_dict

MAX_DELIVERY_BYTES = 256 * 1024  # MLflow's registry payloads are well under 1 KiB
SECRET_REFRESH_S = 5.0  # a failed signature re-reads the block at most this often
EMIT_TIMEOUT_S = 10.0  # below MLflow's 30 s request timeout, so its retry finds us ready
MAX_REMEMBERED = 100_000  # delivery ids kept for replay checks (bounded memory)
# Event ids are uuid5(namespace, delivery id): a delivery sent twice is one event in Prefect.
EVENT_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://mlflow.org/webhooks/delivery-id")

_DELIVERY_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_WORD = re.compile(r"[a-z_]{1,64}")
logger = logging.getLogger("deployments.receiver")


class Unavailable(Exception):
    """The receiver cannot take a delivery now (no block yet, Prefect unreachable): a 503."""


def event_id(delivery_id: str) -> uuid.UUID:
    """The Prefect event id of an MLflow delivery."""
    return uuid.uuid5(EVENT_NAMESPACE, delivery_id)


def _text(container: dict, key: str, where: str, limit: int, required: bool = True) -> str | None:
    value = container.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
        raise BadRequest(
            422, f"{where} must be a printable string of 1 to {limit} characters", param=where
        )
    return value


def delivery_event(delivery: Any, delivery_id: str, timestamp: int) -> Event:
    """The Prefect event for one verified delivery; BadRequest(422) naming a missing field."""
    if not isinstance(delivery, dict):
        raise BadRequest(422, "the delivery must be a JSON object")
    entity, action = (_text(delivery, key, key, 64) for key in ("entity", "action"))
    if not (_WORD.fullmatch(entity) and _WORD.fullmatch(action)):
        raise BadRequest(422, "entity and action must be lower-case words", param="entity")
    mlflow_timestamp = _text(delivery, "timestamp", "timestamp", 64)
    data = delivery.get("data")
    if not isinstance(data, dict):
        raise BadRequest(422, "data must be a JSON object", param="data")
    name = _text(data, "name", "data.name", 256)
    alias = _text(data, "alias", "data.alias", 256, required=False)
    version = _text(data, "version", "data.version", 64, required=False)
    resource = {"prefect.resource.id": f"mlflow.registered-model.{name}"}
    resource["prefect.resource.name"] = name
    if alias is not None:
        resource["mlflow.alias"] = alias
    if version is not None:
        resource["mlflow.version"] = version
    return Event(
        id=event_id(delivery_id),
        occurred=datetime.fromtimestamp(timestamp, UTC),
        event=f"mlflow.{entity}.{action}",
        resource=resource,
        payload={
            "name": name,
            "alias": alias,
            "version": version,
            "delivery_id": delivery_id,
            "mlflow_timestamp": mlflow_timestamp,
        },
    )


def parse_json(body: bytes) -> Any:
    """The delivery's JSON; BadRequest(400) for anything that is not strict JSON."""

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(body, parse_constant=no_constant)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise BadRequest(400, f"the body is not JSON: {str(error)[:200]}") from None


class WebhookSecret:
    """The MLflowWebhook block, loaded on first use and re-read (at most every `refresh_s`)
    when a signature does not match, so `deployments.setup` may create or rotate it while
    the receiver runs. A block given up front is used as is."""

    def __init__(self, block_name: str, webhook: MLflowWebhook | None, refresh_s: float):
        self.block_name = block_name
        self.webhook = webhook
        self.fixed = webhook is not None
        self.refresh_s = refresh_s
        self.loaded_at = -math.inf
        self.lock = asyncio.Lock()

    async def current(self, client: PrefectClient) -> MLflowWebhook:
        """The block as last read; Unavailable while there is none."""
        if self.webhook is None:
            await self.reload(client)
        if self.webhook is None:
            raise Unavailable(
                f"no MLflowWebhook block {self.block_name!r} yet: run `python -m "
                f"deployments.setup` (MLflow retries this delivery)"
            )
        return self.webhook

    async def reload(self, client: PrefectClient) -> bool:
        """Re-read the block unless it was read within `refresh_s`; True when it changed."""
        async with self.lock:
            if self.fixed or time.monotonic() - self.loaded_at < self.refresh_s:
                return False
            self.loaded_at = time.monotonic()
            try:
                fresh = await MLflowWebhook.aload(self.block_name, client=client)
            except ValueError:  # no such block (yet)
                fresh = None
            except (httpx.HTTPError, OSError) as error:
                raise Unavailable(f"the Prefect API cannot be reached: {error}") from None
            changed = fresh != self.webhook
            self.webhook = fresh
            return changed


class Deliveries:
    """Delivery ids accepted lately (for replay checks, bounded) and those being handled."""

    def __init__(self, limit: int = MAX_REMEMBERED):
        self.limit = limit
        self.accepted: OrderedDict[str, float] = OrderedDict()
        self.pending: set[str] = set()

    def claim(self, delivery_id: str, keep_s: float) -> bool:
        """Whether the id is new; if so it is pending until `settle`."""
        horizon = time.monotonic() - keep_s
        while self.accepted and next(iter(self.accepted.values())) < horizon:
            self.accepted.popitem(last=False)
        if delivery_id in self.accepted or delivery_id in self.pending:
            return False
        self.pending.add(delivery_id)
        return True

    def settle(self, delivery_id: str, accepted: bool) -> None:
        self.pending.discard(delivery_id)
        if accepted:
            self.accepted[delivery_id] = time.monotonic()
            while len(self.accepted) > self.limit:
                self.accepted.popitem(last=False)


class Receiver:
    """Checks each delivery, cheapest refusal first, and emits its event."""

    def __init__(self, secret: WebhookSecret):
        self.secret = secret
        self.deliveries = Deliveries()
        self.client: PrefectClient | None = None

    async def handle(self, request: Request) -> JSONResponse:
        body = (await request_dict(request, MAX_DELIVERY_BYTES))["body"]
        if len(body) > MAX_DELIVERY_BYTES:
            raise BadRequest(413, f"the body is over {MAX_DELIVERY_BYTES} bytes")
        headers = request.headers
        signature = headers.get(WEBHOOK_SIGNATURE_HEADER, "")
        delivery_id = headers.get(WEBHOOK_DELIVERY_ID_HEADER, "")
        timestamp = headers.get(WEBHOOK_TIMESTAMP_HEADER, "")
        if not signature:
            raise BadRequest(401, f"{WEBHOOK_SIGNATURE_HEADER} is missing")
        if not _DELIVERY_ID.fullmatch(delivery_id):
            raise BadRequest(401, f"{WEBHOOK_DELIVERY_ID_HEADER} is missing or malformed")
        if not _TIMESTAMP.fullmatch(timestamp):
            raise BadRequest(401, f"{WEBHOOK_TIMESTAMP_HEADER} is missing or not a Unix time")
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != JSON_TYPE:
            raise BadRequest(415, f"the body must be {JSON_TYPE}, not {content_type!r}")
        assert self.client is not None, "the app's lifespan opens the Prefect client"
        webhook = await self.secret.current(self.client)
        skew = abs(time.time() - int(timestamp))
        if skew > webhook.max_age_s:
            raise BadRequest(
                401, f"{WEBHOOK_TIMESTAMP_HEADER} is {skew:.0f} s off, over {webhook.max_age_s} s"
            )
        if not webhook.verify(signature, delivery_id, timestamp, body):
            # The secret may have been rotated since the block was read.
            if not await self.secret.reload(self.client):
                raise BadRequest(401, f"{WEBHOOK_SIGNATURE_HEADER} does not match")
            webhook = await self.secret.current(self.client)
            if not webhook.verify(signature, delivery_id, timestamp, body):
                raise BadRequest(401, f"{WEBHOOK_SIGNATURE_HEADER} does not match")
        if not self.deliveries.claim(delivery_id, 2 * webhook.max_age_s):
            raise BadRequest(409, f"delivery {delivery_id} was already received (replay)")
        accepted = False
        try:
            event = delivery_event(parse_json(body), delivery_id, int(timestamp))
            await self.emit(event)
            accepted = True
        finally:
            self.deliveries.settle(delivery_id, accepted)
        logger.info("delivery %s -> %s on %s", delivery_id, event.event, event.resource.id)
        return JSONResponse({"event_id": str(event.id), "event": event.event})

    async def emit(self, event: Event) -> None:
        """POST the event to the Prefect API: its 204 is what our 200 promises."""
        assert self.client is not None
        try:
            await asyncio.wait_for(
                self.client.request("POST", "/events", json=[event.model_dump(mode="json")]),
                EMIT_TIMEOUT_S,
            )
        except (httpx.HTTPError, OSError, TimeoutError) as error:
            raise Unavailable(f"the Prefect API did not take the event: {error!r}") from None


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _receive(request: Request) -> JSONResponse:
    receiver: Receiver = request.app.state.receiver
    delivery_id = request.headers.get(WEBHOOK_DELIVERY_ID_HEADER, "")[:128]
    try:
        return await receiver.handle(request)
    except BadRequest as refused:
        logger.warning("delivery %r refused (%s): %s", delivery_id, refused.status, refused)
        return _error(refused.status, refused.message)
    except Unavailable as down:
        logger.warning("delivery %r deferred (503): %s", delivery_id, down)
        # MLflow's retry honours Retry-After: by then the block may be re-read.
        return _error(503, str(down), {"Retry-After": str(math.ceil(SECRET_REFRESH_S))})


async def _health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def _http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPException)
    return _error(error.status_code, str(error.detail), dict(error.headers or {}))


def create_app(
    block_name: str = BLOCK_NAME,
    webhook: MLflowWebhook | None = None,
    secret_refresh_s: float = SECRET_REFRESH_S,
    watch_routes_s: float | None = None,
) -> Starlette:
    """The receiver app; `webhook` fixes the block instead of loading `block_name`. With
    `watch_routes_s`, it also sends each healthy route's heartbeat that often
    (deployments.route_watch), from the RayCluster block of the same name."""
    receiver = Receiver(WebhookSecret(block_name, webhook, secret_refresh_s))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with get_client() as client:  # one client (one connection pool) for every call
            receiver.client = client
            watching = (
                asyncio.create_task(route_watch.watch(client, block_name, watch_routes_s))
                if watch_routes_s
                else None
            )
            try:
                yield
            finally:
                if watching is not None:
                    watching.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watching
        receiver.client = None

    app = Starlette(
        routes=[
            Route(local.RECEIVER_WEBHOOK_PATH, _receive, methods=["POST"]),
            Route(local.RECEIVER_HEALTH_PATH, _health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.receiver = receiver
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.receiver",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default=local.HOST, help=f"default {local.HOST}")
    parser.add_argument(
        "--block",
        default=BLOCK_NAME,
        help=f"MLflowWebhook and RayCluster block name (default {BLOCK_NAME})",
    )
    parser.add_argument(
        "--watch-routes",
        type=float,
        default=route_watch.EVERY_S,
        metavar="SECONDS",
        help="send each healthy route's heartbeat this often (0: do not watch routes)",
    )
    args = parser.parse_args(argv)
    if not PREFECT_API_URL.value():
        # Without it Prefect's client would start a private temporary server for the events.
        print("set PREFECT_API_URL to the Prefect API the events go to", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = create_app(args.block, watch_routes_s=args.watch_routes or None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
