"""MLflow registry webhooks -> deployments.receiver -> Prefect events -> the reconcile trigger.

A real alias move in MLflow becomes exactly one Prefect event; forged, stale, replayed,
malformed and oversized deliveries are refused with a JSON 4xx and leave no event; the
receiver's HTTP surface never answers 5xx to bad input; `deployments.setup` keeps one webhook
in MLflow, and `prefect deploy` creates the reconcile trigger, which a moved champion fires.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest
from http_fuzz import RECEIVER_REQUESTS
from hypothesis import HealthCheck, event, example, given, reject, settings
from mlflow import MlflowClient
from prefect.events.filters import EventFilter, EventIDFilter, EventResourceFilter
from prefect.settings import PREFECT_API_URL, temporary_settings
from starlette.testclient import TestClient

from deployments import local, ports, receiver, setup
from deployments.testing.stack import environment as stack_environment
from deployments.testing.stack import undeploy
from prefect_ray_lifecycle.blocks import MLflowWebhook
from prefect_ray_lifecycle.blocks.mlflow_webhook import DEFAULT_EVENTS

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
ALIAS_CREATED = "mlflow.model_version_alias.created"
TRIGGER = "reconcile-on-champion-moved"
TRIGGERED_MODEL = f"triggered-{uuid.uuid4().hex[:6]}"  # the trigger watches every model

pytestmark = pytest.mark.slow


def our_webhooks(client: MlflowClient, name: str) -> list:
    return [hook for hook in client.list_webhooks(max_results=1000) if hook.name == name]


@pytest.fixture(scope="module")
def webhook(stack):
    """The MLflowWebhook block and MLflow's webhook, as `deployments.setup` makes them; the
    webhook is deleted afterwards so later modules' alias moves stay quiet."""
    setup.ensure_webhook(stack_environment(stack))
    block = MLflowWebhook.load(setup.BLOCK_NAME)
    yield block
    client = MlflowClient(stack.mlflow_uri)
    for hook in our_webhooks(client, block.webhook_name):
        client.delete_webhook(hook.webhook_id)


def registered_version(client: MlflowClient, name: str) -> str:
    """A registered model `name` with one new version (a tiny artifact), its number."""
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name)
    experiment = client.get_experiment_by_name("webhook-tests")
    experiment_id = (
        experiment.experiment_id if experiment else client.create_experiment("webhook-tests")
    )
    run = client.create_run(experiment_id)
    client.log_text(run.info.run_id, "tiny", "model/MLmodel")
    client.set_terminated(run.info.run_id)
    version = client.create_model_version(
        name, f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    )
    return version.version


def delivery(
    name: str, alias: str | None = "champion", version: str | None = "1", **fields
) -> bytes:
    data = {"name": name, "alias": alias, "version": version}
    body = {
        "entity": "model_version_alias",
        "action": "created",
        "timestamp": "2026-01-01T00:00:00+00:00",
        "data": {k: v for k, v in data.items() if v is not None},
        **fields,
    }
    return json.dumps(body).encode()


def signed_headers(
    block: MLflowWebhook,
    body: bytes,
    delivery_id: str | None = None,
    timestamp: int | None = None,
) -> dict[str, str]:
    delivery_id = delivery_id or str(uuid.uuid4())
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    return {
        "content-type": "application/json",
        "X-MLflow-Delivery-Id": delivery_id,
        "X-MLflow-Timestamp": stamp,
        "X-MLflow-Signature": block.signature(delivery_id, stamp, body),
    }


def read_events(prefect_client, *, resource_id: str | None = None, ids=None) -> list:
    flt = EventFilter(
        resource=EventResourceFilter(id=[resource_id]) if resource_id else None,
        id=EventIDFilter(id=list(ids or [])),
    )
    return prefect_client.read_events(filter=flt, limit=50).events


def wait_events(prefect_client, resource_id: str, ready, timeout: float = 60.0) -> list:
    """The resource's events once `ready(events)` holds (events land asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        events = read_events(prefect_client, resource_id=resource_id)
        if ready(events):
            return events
        if time.monotonic() > deadline:
            pytest.fail(f"events of {resource_id} after {timeout:.0f} s: {events}")
        time.sleep(0.5)


def sentinel_in(events) -> bool:
    return any(e.resource.get("mlflow.alias") == "sentinel" for e in events)


def sentinel_delivery(url: str, block: MLflowWebhook, prefect_client) -> None:
    """A valid delivery of a fresh model's sentinel alias, once its one event has landed:
    what the receiver took before it has landed too (it emits before it answers)."""
    name = f"sentinel-{uuid.uuid4().hex[:6]}"
    body = delivery(name, alias="sentinel")
    headers = signed_headers(block, body)
    answer = httpx.post(url, content=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    resource_id = f"mlflow.registered-model.{name}"
    (event,) = wait_events(prefect_client, resource_id, sentinel_in)
    assert event.id == receiver.event_id(headers["X-MLflow-Delivery-Id"])


def assert_json_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error, str) and error, response.text


def test_the_signature_is_the_one_mlflow_sends():
    from mlflow.webhooks.delivery import _generate_hmac_signature

    block = MLflowWebhook(secret="s3cret")
    payload = json.dumps({"data": {"name": "m\u00e9"}})
    expected = _generate_hmac_signature("s3cret", "id-1", "1700000000", payload)
    assert block.signature("id-1", "1700000000", payload.encode()) == expected
    assert block.verify(expected, "id-1", "1700000000", payload.encode())
    assert not block.verify(expected, "id-2", "1700000000", payload.encode())


def test_a_real_alias_move_becomes_exactly_one_event(stack, webhook, prefect_client):
    client = MlflowClient(stack.mlflow_uri)
    name = f"hooked-{uuid.uuid4().hex[:6]}"
    version = registered_version(client, name)
    client.set_registered_model_alias(name, "champion", version)
    resource_id = f"mlflow.registered-model.{name}"

    def has_both(events):
        names = {e.event for e in events}
        return {ALIAS_CREATED, "mlflow.model_version.created"} <= names

    wait_events(prefect_client, resource_id, has_both)
    # Barrier: MLflow queues a move's deliveries when the move happens, so those of a later
    # move (a sentinel alias) land after any duplicate of the champion's.
    client.set_registered_model_alias(name, "sentinel", version)
    events = wait_events(prefect_client, resource_id, lambda events: sentinel_in(events))
    events = [e for e in events if e.resource.get("mlflow.alias") != "sentinel"]
    moved = [e for e in events if e.event == ALIAS_CREATED]
    assert len(moved) == 1, events
    assert [e.event for e in events].count("mlflow.model_version.created") == 1
    event = moved[0]
    assert dict(event.resource) == {
        "prefect.resource.id": resource_id,
        "prefect.resource.name": name,
        "mlflow.alias": "champion",
        "mlflow.version": version,
    }
    payload = dict(event.payload)
    delivery_id = payload.pop("delivery_id")
    assert event.id == receiver.event_id(delivery_id)
    # MLflow's own ISO 8601 time of the move (the event's `occurred` is the signed header's).
    assert datetime.fromisoformat(payload.pop("mlflow_timestamp")).utcoffset() == timedelta(0)
    assert payload == {"name": name, "alias": "champion", "version": version}


def test_webhook_secrets_still_decrypt_after_mlflow_restarts(stack, webhook, prefect_client):
    """MLflow keeps the webhook's secret encrypted with a key; the launcher keeps that key in
    the state folder, so MLflow started again decrypts the secret it stored and signs with it
    (a new key per start could not): a move after the restart still becomes its event,
    through the same webhook, set up once."""
    client = MlflowClient(stack.mlflow_uri)
    hooks = [hook.webhook_id for hook in our_webhooks(client, webhook.webhook_name)]
    mlflow = stack.service("mlflow")
    local.stop(mlflow)
    assert local.start(mlflow).startswith("started")
    assert [hook.webhook_id for hook in our_webhooks(client, webhook.webhook_name)] == hooks
    name = f"restarted-{uuid.uuid4().hex[:6]}"
    version = registered_version(client, name)
    client.set_registered_model_alias(name, "champion", version)
    events = wait_events(
        prefect_client,
        f"mlflow.registered-model.{name}",
        lambda events: any(e.event == ALIAS_CREATED for e in events),
    )
    moved = [e for e in events if e.event == ALIAS_CREATED]
    assert moved[0].resource.get("mlflow.version") == version, events


def test_bad_deliveries_are_refused_with_json_and_leave_no_event(stack, webhook, prefect_client):
    url = stack.webhook_url
    max_age = webhook.max_age_s
    forged = MLflowWebhook(secret="not-the-secret")
    refused: list[str] = []  # delivery ids that must not become events

    def post(body: bytes, headers: dict[str, str], status: int) -> None:
        response = httpx.post(url, content=body, headers=headers, timeout=30)
        assert_json_error(response, status)
        if "X-MLflow-Delivery-Id" in headers:
            refused.append(headers["X-MLflow-Delivery-Id"])

    body = delivery(f"refused-{uuid.uuid4().hex[:6]}")
    unsigned = signed_headers(webhook, body)
    del unsigned["X-MLflow-Signature"]
    post(body, unsigned, 401)
    post(body, signed_headers(forged, body), 401)
    tampered = signed_headers(webhook, body)
    post(body.replace(b"champion", b"champio_"), tampered, 401)
    post(body, signed_headers(webhook, body, timestamp=int(time.time()) - max_age - 60), 401)
    post(body, signed_headers(webhook, body, timestamp=int(time.time()) + max_age + 60), 401)
    post(b'{"entity": "model_', signed_headers(webhook, b'{"entity": "model_'), 400)
    nameless = delivery(f"refused-{uuid.uuid4().hex[:6]}", data={"alias": "champion"})
    post(nameless, signed_headers(webhook, nameless), 422)
    post(body, {**signed_headers(webhook, body), "content-type": "text/plain"}, 415)
    huge = b'{"pad": "' + b"x" * (receiver.MAX_DELIVERY_BYTES + 10) + b'"}'
    post(huge, signed_headers(webhook, huge), 413)

    def chunks():  # no Content-Length: the receiver stops reading past the limit
        for _ in range(40):
            yield b"x" * 10_000

    chunked = httpx.post(url, content=chunks(), headers=signed_headers(webhook, b""), timeout=30)
    assert_json_error(chunked, 413)
    assert_json_error(httpx.get(url, timeout=30), 405)
    assert_json_error(httpx.post(f"{stack.receiver_url}/elsewhere", timeout=30), 404)

    # A replayed delivery id is refused; the first delivery is the one event.
    name = f"replayed-{uuid.uuid4().hex[:6]}"
    body = delivery(name)
    headers = signed_headers(webhook, body)
    first = httpx.post(url, content=body, headers=headers, timeout=30)
    assert first.status_code == 200, first.text
    assert first.json()["event_id"] == str(receiver.event_id(headers["X-MLflow-Delivery-Id"]))
    post(body, headers, 409)
    refused.pop()  # that id did become (one) event
    resource_id = f"mlflow.registered-model.{name}"
    wait_events(prefect_client, resource_id, lambda events: len(events) >= 1)
    # Barrier: the receiver emits before it answers, so a refused delivery's event (if any)
    # reached Prefect before the sentinel, sent after every refusal, was even sent.
    sentinel_delivery(url, webhook, prefect_client)
    assert len(read_events(prefect_client, resource_id=resource_id)) == 1
    ids = [receiver.event_id(delivery_id) for delivery_id in refused]
    assert read_events(prefect_client, ids=ids) == []
    health = httpx.get(f"{stack.receiver_url}{local.RECEIVER_HEALTH_PATH}", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


@pytest.fixture(scope="module")
def in_process(prefect_api):
    """The receiver app in this process with a fixed secret; events go to the session's
    Prefect (conftest points PREFECT_API_URL there)."""
    block = MLflowWebhook(secret="in-process-secret")
    app = receiver.create_app(webhook=block)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, block


def fuzzed_headers(block, body, signature, timestamp, delivery_id, content_type):
    """(headers, delivery id) of one drawn request; a fresh id is never a replay."""
    stamp = str(int(time.time())) if timestamp == "now" else timestamp
    delivery_id = str(uuid.uuid4()) if delivery_id == "fresh" else delivery_id
    headers = {"X-MLflow-Timestamp": stamp, "X-MLflow-Delivery-Id": delivery_id}
    headers["content-type"] = content_type
    if signature == "right":
        headers["X-MLflow-Signature"] = block.signature(delivery_id, stamp, body)
    elif signature == "wrong":
        headers["X-MLflow-Signature"] = MLflowWebhook(secret="x").signature(delivery_id, stamp, b"")
    else:
        headers["X-MLflow-Signature"] = signature
    return {k: v for k, v in headers.items() if v != "missing"}, delivery_id


def assert_receiver_contract(response, body: bytes, delivery_id: str) -> None:
    """Never a 5xx; a 4xx is JSON with a message; a 200 is the health check's or names the
    delivery's one event."""
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        assert_json_error(response, response.status_code)
        return
    assert response.status_code == 200, response.text
    if response.request.url.path == local.RECEIVER_HEALTH_PATH:
        assert response.json() == {"status": "ok"}
        return
    sent = json.loads(body)
    assert response.json() == {
        "event_id": str(receiver.event_id(delivery_id)),
        "event": f"mlflow.{sent['entity']}.{sent['action']}",
    }


FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@settings(FUZZ, max_examples=200)
@given(**RECEIVER_REQUESTS)
def test_the_receiver_never_answers_5xx_to_bad_input(in_process, method, path, body, **parts):
    client, block = in_process
    headers, delivery_id = fuzzed_headers(block, body, **parts)
    response = client.request(method, path, content=body, headers=headers)
    event(f"status {response.status_code}")
    assert_receiver_contract(response, body, delivery_id)


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=30) as client:
        yield client


def _valid(**parts) -> dict:
    """A valid delivery's request parts, with `parts` changed."""
    body = delivery("explicit", alias="explicit")
    valid = {"method": "POST", "path": "/mlflow", "body": body, "signature": "right"}
    valid.update(timestamp="now", delivery_id="fresh", content_type="application/json")
    return {**valid, **parts}


@settings(FUZZ, max_examples=60)
@given(**RECEIVER_REQUESTS)
@example(**_valid(timestamp="1e9"))  # each refusal's check, whatever 60 draws reach
@example(**_valid(body=b"[" * 100_000))
@example(**_valid(content_type="text/plain; charset=utf-8"))
@example(**_valid(method="GET", path=local.RECEIVER_HEALTH_PATH))
def test_the_running_receiver_never_answers_5xx_to_bad_input(
    stack, webhook, http, method, path, body, **parts
):
    """The same over HTTP to the session's receiver process (its block: `webhook`)."""
    headers, delivery_id = fuzzed_headers(webhook, body, **parts)
    try:
        response = http.request(
            method, f"{stack.receiver_url}{path}", content=body, headers=headers
        )
    except httpx.LocalProtocolError:  # e.g. a header value of b" ": no HTTP client sends it
        reject()
    event(f"status {response.status_code}")
    assert_receiver_contract(response, body, delivery_id)


def test_the_running_receiver_still_makes_one_event_of_a_valid_delivery_after_the_fuzz(
    stack, webhook, prefect_client
):
    name = f"after-fuzz-{uuid.uuid4().hex[:6]}"
    body = delivery(name, alias="fuzzed", version="7")  # not champion: no trigger fires
    headers = signed_headers(webhook, body)
    answer = httpx.post(stack.webhook_url, content=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    resource_id = f"mlflow.registered-model.{name}"
    sentinel_delivery(stack.webhook_url, webhook, prefect_client)  # then nothing more comes
    (event,) = read_events(prefect_client, resource_id=resource_id)
    assert event.id == receiver.event_id(headers["X-MLflow-Delivery-Id"])
    assert event.event == ALIAS_CREATED
    assert (event.resource.get("mlflow.alias"), event.resource.get("mlflow.version")) == (
        "fuzzed",
        "7",
    )


def test_no_block_or_no_prefect_is_a_503_that_mlflow_retries(prefect_client):
    block = MLflowWebhook(secret="in-process-secret")
    body = delivery(f"deferred-{uuid.uuid4().hex[:6]}")
    app = receiver.create_app(block_name=f"missing-{uuid.uuid4().hex[:6]}")
    with TestClient(app) as client:
        response = client.post("/mlflow", content=body, headers=signed_headers(block, body))
    assert_json_error(response, 503)
    assert response.headers["retry-after"]
    (port,) = ports.free_ports(1)
    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
        with TestClient(receiver.create_app(webhook=block)) as client:
            headers = signed_headers(block, body)
            response = client.post("/mlflow", content=body, headers=headers)
    assert_json_error(response, 503)
    # MLflow's retry of that delivery goes through once Prefect answers.
    with TestClient(receiver.create_app(webhook=block)) as client:
        assert client.post("/mlflow", content=body, headers=headers).status_code == 200


def test_a_rotated_secret_is_picked_up_without_a_restart(prefect_client):
    name = f"rotation-{uuid.uuid4().hex[:6]}"
    old = MLflowWebhook(secret="old-secret")
    new = MLflowWebhook(secret="new-secret")
    body = delivery(f"rotated-{uuid.uuid4().hex[:6]}")
    old.save(name)
    app = receiver.create_app(block_name=name, secret_refresh_s=0.2)
    with TestClient(app) as client:
        assert client.post("/mlflow", content=body, headers=signed_headers(old, body)).is_success
        new.save(name, overwrite=True)
        time.sleep(0.3)
        assert client.post("/mlflow", content=body, headers=signed_headers(new, body)).is_success
        stale = client.post("/mlflow", content=body, headers=signed_headers(old, body))
        assert_json_error(stale, 401)


def test_setup_keeps_one_webhook_and_deploy_creates_the_reconcile_trigger(
    stack, webhook, prefect_client
):
    env = stack_environment(stack)
    assert setup.ensure_webhook(env) == setup.ensure_webhook(env)  # idempotent
    client = MlflowClient(stack.mlflow_uri)
    (hook,) = our_webhooks(client, webhook.webhook_name)
    assert hook.url == stack.webhook_url
    assert sorted(str(event) for event in hook.events) == sorted(DEFAULT_EVENTS)
    assert MLflowWebhook.load(setup.BLOCK_NAME).secret == webhook.secret  # made once, kept

    setup.save_blocks(env)
    setup.ensure_work_pool(env.work_pool)
    done = subprocess.run(
        [PREFECT, "--no-prompt", "deploy", "--all"],
        env={**os.environ},
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    deployment = prefect_client.read_deployment_by_name("reconcile/reconcile")
    (automation,) = prefect_client.read_automations_by_name(TRIGGER)
    assert automation.enabled
    assert automation.trigger.expect == {ALIAS_CREATED}
    assert automation.trigger.match.root == {
        "prefect.resource.id": "mlflow.registered-model.*",  # any model's champion
        "mlflow.alias": "champion",
    }
    (action,) = automation.actions
    assert action.deployment_id == deployment.id
    assert action.parameters == {"model_name": "{{ event.payload.name }}"}
    schedules = prefect_client.read_deployment_schedules(deployment.id)
    assert schedules and not any(s.active for s in schedules)  # the net stays off by default

    # And it fires: the champion moved in MLflow starts a reconcile run for that model.
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    only_reconcile = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
    before = {run.id for run in prefect_client.read_flow_runs(deployment_filter=only_reconcile)}
    version = registered_version(client, TRIGGERED_MODEL)
    client.set_registered_model_alias(TRIGGERED_MODEL, "champion", version)
    deadline = time.monotonic() + 60
    triggered = []
    try:
        while not triggered and time.monotonic() < deadline:
            time.sleep(1)
            runs = prefect_client.read_flow_runs(deployment_filter=only_reconcile)
            triggered = [run for run in runs if run.id not in before]
        assert len(triggered) == 1, "no reconcile run within 60 s of the champion move"
        assert triggered[0].parameters["model_name"] == TRIGGERED_MODEL
    finally:  # never leave a run, nor a trigger, for a later test's worker
        undeploy()
        client.delete_registered_model(TRIGGERED_MODEL)
