"""serve_rollout and reconcile on real Ray Serve (the session's `ray start --head`) and a real
MLflow registry, each with a load thread sending requests through the router."""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid

import numpy as np
import pytest
from mlflow import MlflowClient
from prefect.concurrency.sync import concurrency

from blocks import MLflowServer
from flows.reconcile import reconcile
from flows.rollout import RolloutFailed, serve_rollout
from tasks.serve_config import Drill, Gates, Serving
from workloads import registry, serve_control
from workloads.constants import POLICY_DEPLOYMENT

ROUTE = "policy-test"
OBSERVATION = [0.01, -0.02, 0.03, 0.04]


def fast_gates(**overrides) -> Gates:
    settings = dict(
        health_timeout_s=120,
        stability_window_s=3,
        canary_steps=[0.3],
        canary_hold_s=3,
        canary_min_requests=5,
        canary_max_wait_s=60,
        bake_s=4,
        bake_window_s=2,
        max_error_rate=0.05,
        # Latency gates are loose here: a shared 2-core machine's p99 is noise.
        max_p99_ms=5000,
        p99_slack_ms=1000,
    )
    return Gates(**{**settings, **overrides})


SERVING = Serving(
    num_cpus=0.1, health_check_period_s=1, health_check_timeout_s=5, router_num_cpus=0.1
)


class Load(threading.Thread):
    """Closed-loop requests through the router: (time, status, X-Model-Version, body)."""

    def __init__(self, port: int, route: str = ROUTE, pause_s: float = 0.02):
        super().__init__(daemon=True)
        self.port, self.route, self.pause_s = port, route, pause_s
        self.results: list[tuple[float, int, str | None, bytes]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        body = json.dumps({"observation": OBSERVATION}).encode()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self.stopping.is_set():
            try:
                connection.request(
                    "POST", f"/{self.route}", body, {"content-type": "application/json"}
                )
                response = connection.getresponse()
                self.results.append(
                    (
                        time.time(),
                        response.status,
                        response.getheader("X-Model-Version"),
                        response.read(),
                    )
                )
            except (OSError, http.client.HTTPException) as error:
                self.results.append((time.time(), 0, None, repr(error).encode()))
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            time.sleep(self.pause_s)

    def __enter__(self) -> Load:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.join(timeout=60)

    def failed(self) -> list:
        return [r for r in self.results if r[1] != 200]

    def versions(self) -> set[str | None]:
        return {r[2] for r in self.results if r[1] == 200}


@pytest.fixture(scope="module")
def serving(stack, checkpoints):
    """The test process joins the cluster (as the flows do), a fresh model has six versions
    of one policy, and every app this module made is deleted at the end."""
    cluster = stack.ray_cluster()
    server = MLflowServer(tracking_uri=stack.mlflow_uri)
    name = f"served-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(6):
        registry.register_checkpoint(
            client,
            name=name,
            checkpoint=checkpoints["good"],
            experiment_name="rollout-tests",
            trial_key_value=f"{name}-{trial}",
            params={},
            metrics={},
            tags={},
            description="",
            artifacts={},
            observation_size=4,
        )
    with cluster.connect():
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            yield {
                "cluster": cluster,
                "server": server,
                "name": name,
                "client": client,
                "port": cluster.serve_port,
            }
        finally:
            apps = [
                a
                for a in serve_control.app_configs()
                if a.startswith(name) or a == serve_control.router_app_name(ROUTE)
            ]
            serve_control.apply(deletes=set(apps))
            serve_control.drop_route_stats(ROUTE)


def rollout(serving, version, **kwargs):
    kwargs.setdefault("gates", fast_gates())
    return serve_rollout(
        model_name=serving["name"],
        version=str(version),
        route=ROUTE,
        serving=SERVING,
        ray_cluster=serving["cluster"],
        mlflow_server=serving["server"],
        **kwargs,
    )


def live_version(serving) -> str | None:
    found = registry.resolve_alias(serving["client"], serving["name"], registry.LIVE)
    return found.version if found else None


def verdict(serving, version) -> dict[str, str]:
    tags = serving["client"].get_model_version(serving["name"], str(version)).tags
    prefix = f"{registry.TAG}.rollout."
    return {k.removeprefix(prefix): v for k, v in tags.items() if k.startswith(prefix)}


def rollout_events(prefect_client, serving, version, outcome) -> list:
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    flt = EventFilter(
        event=EventNameFilter(name=[f"ray-lifecycle.rollout.{outcome}"]),
        resource=EventResourceFilter(id=[f"mlflow.model-version.{serving['name']}.{version}"]),
    )
    deadline = time.monotonic() + 20
    while True:  # events reach the API asynchronously
        events = prefect_client.read_events(filter=flt, limit=50).events
        if events or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


def test_first_rollout_then_a_good_candidate_swaps_with_zero_failed_requests(serving):
    first = rollout(serving, 1)
    assert first.outcome == "first_rollout"
    assert live_version(serving) == "1"
    with Load(serving["port"]) as load:
        time.sleep(1)
        result = rollout(serving, 2)
        time.sleep(1)
    assert result.outcome == "promoted", result
    assert live_version(serving) == "2"
    assert len(load.results) > 100
    assert load.failed() == []
    assert load.versions() == {"1", "2"}  # the canary and the swap both carried traffic
    assert load.results[-1][2] == "2"
    stages = [e["stage"] for e in result.timeline]
    assert stages == ["health", "smoke", "canary 30%", "swap", "bake", "retire"]
    # After the bake the router hosts v2 in process and v1's app is gone.
    connection = http.client.HTTPConnection("127.0.0.1", serving["port"], timeout=30)
    connection.request("GET", f"/{ROUTE}/-/status")
    status = json.loads(connection.getresponse().read())
    assert status["inline_version"] == "2" and status["config"]["live"]["version"] == "2"
    assert not serve_control.app_exists(serve_control.version_app_name(serving["name"], "1"))
    assert verdict(serving, 2)["verdict"] == "promoted"
    history = registry.alias_history(serving["client"], serving["name"], registry.LIVE)
    assert [h["version"] for h in history] == ["1", "2"]


def test_a_candidate_whose_health_check_fails_is_rejected_without_a_failed_request(
    serving, prefect_client
):
    assert live_version(serving) == "2"
    # Healthy at first, failing two seconds later: one look at RUNNING would pass it.
    drill = Drill(faults={"fail_health_after_s": 2})
    with Load(serving["port"]) as load:
        with pytest.raises(RolloutFailed, match="health"):
            rollout(serving, 3, drill=drill, gates=fast_gates(stability_window_s=6))
    assert live_version(serving) == "2"
    assert load.failed() == []
    assert load.versions() == {"2"}
    tags = verdict(serving, 3)
    assert (tags["verdict"], tags["stage"]) == ("rejected", "health")
    assert not serve_control.app_exists(serve_control.version_app_name(serving["name"], "3"))
    (event,) = rollout_events(prefect_client, serving, 3, "rejected")
    assert event.payload["stage"] == "health" and event.payload["live"] == "2"


def test_a_candidate_erroring_on_a_share_is_aborted_at_the_canary(serving):
    drill = Drill(faults={"error_rate": 0.5})
    with Load(serving["port"]) as load:
        started = time.time()
        with pytest.raises(RolloutFailed, match="canary"):
            rollout(serving, 4, drill=drill)
        ended = time.time()
        time.sleep(1)
    assert live_version(serving) == "2"
    failed = load.failed()
    assert failed, "the drill's errors never reached the canary"
    # Every failure came from the candidate, through the router's 502, while it ran.
    assert {(status, version) for _, status, version, _ in failed} == {(502, "4")}
    assert all(started < at < ended for at, *_ in failed)
    during = [r for r in load.results if started < r[0] < ended]
    assert len(failed) < 0.3 * len(during)  # at most the canary share
    assert load.results[-1][1:3] == (200, "2")
    tags = verdict(serving, 4)
    assert (tags["verdict"], tags["stage"]) == ("rejected", "canary")
    assert "error rate" in tags["reason"]


def test_degradation_after_the_swap_is_rolled_back(serving, prefect_client):
    drill = Drill(after_swap={"error_rate": 1.0})
    with Load(serving["port"]) as load:
        with pytest.raises(RolloutFailed, match="rolled back"):
            rollout(serving, 5, drill=drill, gates=fast_gates(bake_s=20))
        time.sleep(1)
    assert live_version(serving) == "2"
    tags = verdict(serving, 5)
    assert (tags["verdict"], tags["stage"]) == ("rolled_back", "bake")
    history = registry.alias_history(serving["client"], serving["name"], registry.LIVE)
    assert [h["version"] for h in history[-2:]] == ["5", "2"]
    failed = load.failed()
    assert failed and {v for _, _, v, _ in failed} == {"5"}
    assert failed[-1][0] - failed[0][0] < 10  # rolled back within seconds
    assert load.results[-1][1:3] == (200, "2")
    assert not serve_control.app_exists(serve_control.version_app_name(serving["name"], "5"))
    assert rollout_events(prefect_client, serving, 5, "rolled-back")


@pytest.mark.parametrize(
    "body, content_type, status, message",
    [
        (b'{"observation": [1, 2, 3]}', "application/json", 422, "shape [4]"),
        (b'{"observation": ["a", "b", "c", "d"]}', "application/json", 422, "numbers only"),
        (b'{"observation": [1, 2, NaN, 4]}', "application/json", 400, "not valid JSON"),
        (b"not json", "application/json", 400, "not valid JSON"),
        (b"\0" * 12, "application/octet-stream", 422, "float32"),
        (b"x" * (2 << 20), "application/json", 413, "exceeds the limit"),
    ],
)
def test_bad_requests_get_4xx_with_a_message_and_the_replica_stays_healthy(
    serving, body, content_type, status, message
):
    app = serve_control.version_app_name(serving["name"], "2")
    replicas = serve_control.deployment_state(app, POLICY_DEPLOYMENT)["replicas"]
    connection = http.client.HTTPConnection("127.0.0.1", serving["port"], timeout=30)
    connection.request("POST", f"/{ROUTE}", body, {"content-type": content_type})
    response = connection.getresponse()
    payload = json.loads(response.read())
    assert response.status == status
    assert message in payload["error"]
    assert response.getheader("X-Model-Version") == "2"
    raw = np.asarray([OBSERVATION, OBSERVATION], dtype="<f4").tobytes()
    connection.request("POST", f"/{ROUTE}", raw, {"content-type": "application/octet-stream"})
    answer = json.loads(connection.getresponse().read())
    assert len(answer["actions"]) == 2 and answer["model_version"] == "2"
    state = serve_control.deployment_state(app, POLICY_DEPLOYMENT)
    assert state["replicas"] == replicas and str(state["status"]).endswith("HEALTHY")


def test_reconcile_rolls_out_a_manual_champion_and_otherwise_does_nothing(serving):
    client, name = serving["client"], serving["name"]
    common = dict(
        model_name=name,
        route=ROUTE,
        gates=fast_gates(),
        serving=SERVING,
        ray_cluster=serving["cluster"],
        mlflow_server=serving["server"],
    )
    client.set_registered_model_alias(name, registry.CHAMPION, "2")
    assert reconcile(**common).action == "in_sync"
    client.set_registered_model_alias(name, registry.CHAMPION, "4")  # failed its canary
    skipped = reconcile(**common)
    assert skipped.action == "skipped_failed" and live_version(serving) == "2"
    client.set_registered_model_alias(name, registry.CHAMPION, "6")  # a person's promotion
    outcome = {}
    with Load(serving["port"]) as load:
        # Another rollout holds the route: this one waits for it before touching Serve.
        with concurrency(f"serve-rollout-{ROUTE}", occupy=1):
            waiting = threading.Thread(target=lambda: outcome.update(done=reconcile(**common)))
            waiting.start()
            time.sleep(8)
            assert not serve_control.app_exists(serve_control.version_app_name(name, "6"))
        waiting.join(timeout=300)
    done = outcome["done"]
    assert done.action == "rolled_out" and done.rollout.outcome == "promoted"
    assert live_version(serving) == "6"
    assert load.failed() == []
    assert reconcile(**common).action == "in_sync"
