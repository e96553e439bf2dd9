"""serve_rollout and reconcile on real Ray Serve (the session's `ray start --head`) and a real
MLflow registry, each with closed-loop load through the router. Every test puts the route
in the state it starts from (`ensure_live`), so any one of them runs alone."""

from __future__ import annotations

import contextvars
import http.client
import json
import re
import struct
import threading
import time
import uuid

import numpy as np
import pytest
import requests
from mlflow import MlflowClient
from prefect.concurrency.sync import concurrency

from deployments.testing.fast import FAST_SERVING
from deployments.testing.load import LOAD_PAUSE_S, OBSERVATION, ClosedLoop
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.reconcile import reconcile
from prefect_ray_lifecycle.flows.rollout import RolloutFailed, serve_rollout
from prefect_ray_lifecycle.tasks.charts import PNG_MAGIC, artifact_url
from prefect_ray_lifecycle.tasks.rollout.config import Drill, Gates, Serving
from prefect_ray_lifecycle.workloads.constants import ROUTER_DEPLOYMENT
from prefect_ray_lifecycle.workloads.serve.route_state import route_figures

ROUTE = "policy-test"
VERSIONS = 11


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
        p99_slack_ms=3000,
    )
    return Gates(**{**settings, **overrides})


SERVING = Serving(**FAST_SERVING)


@pytest.fixture(scope="module")
def serving(stack, checkpoints):
    """The test process joins the cluster (as the flows do), a fresh model has VERSIONS versions
    of one policy, and every app this module made is deleted at the end."""
    cluster = stack.ray_cluster()
    server = MLflowServer(tracking_uri=stack.mlflow_uri)
    name = f"served-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(VERSIONS):
        registry.register_checkpoint(
            client,
            name=name,
            checkpoint=checkpoints["good"],
            experiment_name="rollout-tests",
            trial_key_value=f"{name}-{trial}",
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
            serve_control.delete_route(ROUTE, name)


def rollout(serving, version, **kwargs):
    kwargs.setdefault("gates", fast_gates())
    return serve_rollout(
        model_name=serving["name"],
        version=version,  # a number, as `--param version=3` sends it, or None
        route=ROUTE,
        serving=SERVING,
        ray_cluster=serving["cluster"],
        mlflow_server=serving["server"],
        **kwargs,
    )


def load(serving, **kwargs) -> ClosedLoop:
    return ClosedLoop(serving["port"], f"/{ROUTE}", pause_s=LOAD_PAUSE_S, **kwargs)


def live_version(serving) -> str | None:
    found = registry.resolve_alias(serving["client"], serving["name"], registry.LIVE)
    return found.version if found else None


def ensure_live(serving, version: str) -> None:
    """The route serves `version` (rolled out through the gates when it does not)."""
    router = serve_control.current_router(ROUTE)
    if router is None or router.live is None or router.live.version != version:
        rollout(serving, version)
    assert live_version(serving) == version


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


def rollout_artifact(prefect_client, flow_run_id, serving, kind: str = "rollout"):
    """The run's timeline (kind "rollout") or chart ("rollout-chart") artifact, keyed by
    route and model."""
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter

    (artifact,) = prefect_client.read_artifacts(
        artifact_filter=ArtifactFilter(key={"any_": [f"{kind}-{ROUTE}-{serving['name']}"]}),
        flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}),
    )
    return artifact


def rollout_chart(serving, version) -> tuple[str, dict]:
    """The version's last rollout chart on its MLflow run: its URL on the MLflow server (the
    PNG checked as served there) and the data it was drawn from."""
    client = serving["client"]
    run_id = client.get_model_version(serving["name"], str(version)).run_id
    pngs = sorted(
        f.path for f in client.list_artifacts(run_id, "rollouts") if f.path.endswith("png")
    )
    assert pngs, f"v{version} has no rollout chart"
    url = artifact_url(serving["server"], run_id, pngs[-1])
    png = requests.get(url, timeout=30)
    assert png.status_code == 200 and png.content[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", png.content[16:24])
    assert 800 <= width <= 3000 and 500 <= height <= 3000
    drawn = requests.get(url.replace(".png", ".json"), timeout=30).json()
    return url, drawn


def served_between(drawn: dict, version: str, start: float, end: float) -> int:
    """Requests the chart's data counts for `version` in buckets starting in [start, end)."""
    return sum(p["requests"] for p in drawn["series"].get(version, []) if start <= p["at"] < end)


def stage_end(drawn: dict, stage: str) -> float:
    return next(mark["at"] for mark in drawn["stages"] if mark["stage"] == stage)


def waiting_reconcile(prefect_client, timeout: float = 60):
    """The running reconcile flow run once it logged that it waits for the route's slot."""
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.client.schemas.objects import StateType

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = prefect_client.read_flow_runs(
            flow_filter=FlowFilter(name={"any_": ["reconcile"]}),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
            ),
        )
        for run in runs:
            logs = prefect_client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))
            )
            if any("waiting for it" in log.message for log in logs):
                return run
        time.sleep(0.5)
    raise AssertionError("no reconcile run logged that it waits for the route")


def within_chance(hits: int, trials: int, share: float) -> bool:
    """`hits` of `trials` is what a share of `share` gives, within three standard deviations
    (and the two edge samples a window drawn between hits adds)."""
    spread = 3 * (share * (1 - share) / trials) ** 0.5 + 2 / trials
    return trials > 0 and abs(hits / trials - share) <= spread


def router_status(serving) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", serving["port"], timeout=30)
    connection.request("GET", f"/{ROUTE}/-/status")
    return json.loads(connection.getresponse().read())


def test_first_rollout_by_alias_then_a_good_candidate_swaps_with_zero_failed_requests(
    serving, prefect_client
):
    serve_control.delete_route(ROUTE, serving["name"])
    serving["client"].set_registered_model_alias(serving["name"], registry.CHAMPION, "1")
    first = rollout(serving, None)  # no version: the one `champion` names
    assert first.outcome == "first_rollout" and first.version == "1"
    assert live_version(serving) == "1"
    # Nothing was live: health is every replica RUNNING and probed twice, no stability window.
    health = first.timeline[0]
    assert health["stage"] == "health" and health["figures"]["checks"] == 2, health
    assert health["detail"] == "1 replica(s) RUNNING and healthy (2 probes)"
    with load(serving) as traffic:
        time.sleep(1)
        result = serve_rollout(  # its state: the run's id, to read its artifact
            model_name=serving["name"],
            version="2",
            route=ROUTE,
            serving=SERVING,
            gates=fast_gates(),
            ray_cluster=serving["cluster"],
            mlflow_server=serving["server"],
            return_state=True,
        )
        time.sleep(1)
    promoted = result.result()
    assert promoted.outcome == "promoted", promoted
    assert live_version(serving) == "2"
    assert len(traffic.answers) > 100
    assert traffic.failed() == []
    assert traffic.versions() == {"1", "2"}  # the canary and the swap both carried traffic
    assert traffic.answers[-1].version == "2"
    stages = [e["stage"] for e in promoted.timeline]
    assert stages == ["health", "smoke", "canary 30%", "swap", "bake", "retire"]
    # With v1 live, v2's replicas were held for the stability window.
    assert promoted.timeline[0]["detail"] == "1 replica(s) healthy for 3 s"
    # After the bake the router hosts v2 in process, holds no rollout, and v1's app is gone.
    status = router_status(serving)
    assert status["inline_version"] == "2" and status["config"]["live"]["version"] == "2"
    assert status["config"]["rollout"] is None and status["config"]["previous"] is None
    assert not serve_control.app_exists(serve_control.version_app_name(serving["name"], "1"))
    assert verdict(serving, 2)["verdict"] == "promoted"
    history = registry.alias_history(serving["client"], serving["name"], registry.LIVE)
    assert [h["version"] for h in history] == ["1", "2"]
    (event,) = rollout_events(prefect_client, serving, 2, "promoted")
    assert event.payload["previous"] == "1"
    flow_run_id = result.state_details.flow_run_id
    artifact = rollout_artifact(prefect_client, flow_run_id, serving)
    assert "v2 replaced v1" in artifact.description and "| canary 30% | passed |" in artifact.data
    assert "| figures |" not in artifact.data  # the table stays scannable; the chart has them
    # The chart: on v2's MLflow run, on the flow run as an image, linked from the timeline.
    url, drawn = rollout_chart(serving, 2)
    assert promoted.chart_url == url and f"]({url})" in artifact.data
    assert rollout_artifact(prefect_client, flow_run_id, serving, "rollout-chart").data == url
    assert [mark["stage"] for mark in drawn["stages"]] == stages
    assert (drawn["live"], drawn["candidate"]) == ("1", "2")
    assert drawn["thresholds"]["max_error_rate"] == fast_gates().max_error_rate
    # What it drew is what users got: v1 before the canary, v2 during it too, and v2 alone
    # once swapped (a report lags its answer by under a second); no errors.
    assert served_between(drawn, "1", drawn["started"], stage_end(drawn, "smoke")) > 0
    assert served_between(drawn, "2", stage_end(drawn, "smoke"), stage_end(drawn, "swap")) > 0
    assert served_between(drawn, "2", stage_end(drawn, "swap"), time.time()) > 0
    assert served_between(drawn, "1", stage_end(drawn, "swap") + 2, time.time()) == 0
    assert all(p["errors"] == 0 for points in drawn["series"].values() for p in points)


def test_a_candidate_whose_health_check_fails_is_rejected_without_a_failed_request(
    serving, prefect_client
):
    ensure_live(serving, "2")
    # Healthy at first, failing two seconds later: one look at RUNNING would pass it.
    drill = Drill(faults={"fail_health_after_s": 2})
    with load(serving) as traffic:
        with pytest.raises(RolloutFailed, match="health"):
            rollout(serving, 3, drill=drill, gates=fast_gates(stability_window_s=6))
    assert live_version(serving) == "2"
    assert traffic.failed() == []
    assert traffic.versions() == {"2"}
    tags = verdict(serving, 3)
    assert (tags["verdict"], tags["stage"]) == ("rejected", "health")
    assert not serve_control.app_exists(serve_control.version_app_name(serving["name"], "3"))
    (event,) = rollout_events(prefect_client, serving, 3, "rejected")
    assert event.payload["stage"] == "health" and event.payload["live"] == "2"


def test_a_candidate_failing_half_its_requests_is_aborted_and_no_user_sees_it(serving):
    ensure_live(serving, "2")
    drill = Drill(faults={"error_rate": 0.5})
    bad = ClosedLoop(serving["port"], f"/{ROUTE}", pause_s=0.05, body=b"not json")
    started = time.time()
    with load(serving) as traffic, bad:
        # The canary judges after 20 of the candidate's requests, not 5: on a busy machine the
        # other loop's requests alone once made up the 5, and no user had reached v4 yet.
        with pytest.raises(RolloutFailed, match="canary"):
            rollout(serving, 4, drill=drill, gates=fast_gates(canary_min_requests=20))
        ended = time.time()
        time.sleep(1)
    assert live_version(serving) == "2"
    # Users saw no failure: every request the candidate failed was answered again by v2.
    assert traffic.failed() == []
    fell_back = [a for a in traffic.answers if a.fallback_from]
    assert fell_back and {(a.version, a.fallback_from) for a in fell_back} == {("2", "4")}
    # ...and the gates still saw every failure: the router counted them against v4.
    figures = route_figures(ROUTE, started, ended + 1)["4"]
    assert figures["errors"] > 0 and figures["fallbacks"] == figures["errors"]
    # Over the canary's own window (the candidate's first to last attempt), v4 had about its
    # 30% share of the good traffic, and failed about half of it.
    tried = [a for a in traffic.answers if "4" in (a.version, a.fallback_from)]
    window = [a for a in traffic.answers if tried[0].at <= a.at <= tried[-1].at]
    assert within_chance(len(tried), len(window), 0.3)
    assert within_chance(len(fell_back), len(tried), 0.5)
    # A bad request the candidate answered with a 4xx is not retried: the request was bad.
    from_candidate = [a for a in bad.answers if a.version == "4"]
    assert from_candidate and all(
        a.status == 400 and a.fallback_from is None for a in from_candidate
    )
    assert all(a.status == 400 for a in bad.answers)
    tags = verdict(serving, 4)
    assert (tags["verdict"], tags["stage"]) == ("rejected", "canary")
    assert "error rate" in tags["reason"]
    status = router_status(serving)
    assert status["config"]["rollout"] is None
    # The router let go of v4's handle (each runs a router of its own in the process): it
    # holds handles only to what its config names, here live.
    assert set(status["handles"]) <= {serve_control.version_app_name(serving["name"], "2")}
    # The chart of the aborted rollout shows the canary failing, and v4's errors in it.
    _, drawn = rollout_chart(serving, 4)
    assert [(m["stage"], m["outcome"]) for m in drawn["stages"]][-1] == ("canary", "failed")
    assert any(
        p["error_rate"] > drawn["thresholds"]["max_error_rate"] for p in drawn["series"]["4"]
    )


def test_with_fallback_off_the_candidates_failures_reach_users_and_still_stop_it(serving):
    """`Gates.fallback=false`, for requests that must not be sent twice: a request the
    candidate fails is not asked again of live; its user gets the router's 502 for the
    candidate's failure, tagged with the candidate's version and no X-Fallback-From, and the
    canary still rejects it."""
    ensure_live(serving, "2")
    drill = Drill(faults={"error_rate": 0.5})
    with load(serving) as traffic:
        with pytest.raises(RolloutFailed, match="canary"):
            rollout(
                serving, 10, drill=drill, gates=fast_gates(fallback=False, canary_min_requests=20)
            )
    assert live_version(serving) == "2"
    failed = traffic.failed()
    assert failed and {(a.status, a.version, a.fallback_from) for a in failed} == {
        (502, "10", None)
    }
    assert all("error injected by a drill" in json.loads(a.body)["error"] for a in failed)
    assert not any(a.fallback_from for a in traffic.answers)
    tags = verdict(serving, 10)
    assert (tags["verdict"], tags["stage"]) == ("rejected", "canary")
    assert "error rate" in tags["reason"]


def drill_app(serving, version: str, faults: dict) -> None:
    """A drill's faults on one version's app, in place (the router's hosted copy of it, if
    any, is untouched); nothing when the app is gone."""
    from prefect_ray_lifecycle.workloads.constants import POLICY_DEPLOYMENT

    app = serve_control.version_app_name(serving["name"], version)
    config = serve_control.app_configs().get(app)
    if config is not None:
        serve_control.apply(
            {app: serve_control.with_user_config(config, POLICY_DEPLOYMENT, {"faults": faults})}
        )


def test_a_fallback_that_fails_too_returns_the_failure_it_would_have(serving):
    """In the bake the freshly swapped v11 fails every request (a drill), and its fallback,
    v2's app (hosted in the router until the swap, so nobody noticed), is slower than the
    time left: each user v11 failed gets v11's own failure, the answer it would have had with
    no fallback (its 502, or its 504 if it was too slow to fail), tagged v11 and without
    X-Fallback-From, never v2's 504; both failures count, each against its own version, and
    the bake rolls back."""
    ensure_live(serving, "2")
    assert router_status(serving)["inline_version"] == "2"
    started = time.time()
    drill_app(serving, "2", {"latency_ms": 3000})
    try:
        # Four users: a request v11 fails takes the router's whole 1 s timeout (half for v11,
        # half for the fallback), and the bake judges 10 requests a window.
        with load(serving, threads=4) as traffic:
            with pytest.raises(RolloutFailed, match="rolled back"):
                rollout(
                    serving,
                    11,
                    drill=Drill(after_swap={"error_rate": 1.0}),
                    gates=fast_gates(bake_s=20, bake_window_s=4, request_timeout_s=1),
                )
        ended = time.time()
    finally:
        drill_app(serving, "2", {})
    assert live_version(serving) == "2"
    failed_by_v11 = [a for a in traffic.answers if a.version == "11" and a.status >= 500]
    assert failed_by_v11 and all(a.fallback_from is None for a in failed_by_v11)
    errors = [(a.status, json.loads(a.body)["error"]) for a in failed_by_v11]

    def v11s_own(status: int, error: str) -> bool:
        drilled = status == 502 and "error injected by a drill" in error
        return drilled or (status == 504 and error.startswith("v11 did not answer"))

    assert all(v11s_own(*e) for e in errors) and any(s == 502 for s, _ in errors), errors
    # No fallback answered: v2's app never made it within the time left.
    assert not any(a.fallback_from for a in traffic.answers)
    figures = route_figures(ROUTE, started, ended + 1)
    assert figures["11"]["errors"] >= len(failed_by_v11), figures["11"]
    assert figures["2"]["errors"] > 0, figures["2"]  # the fallback's own failures
    tags = verdict(serving, 11)
    assert (tags["verdict"], tags["stage"]) == ("rolled_back", "bake")


def test_degradation_after_the_swap_is_rolled_back_without_a_failed_request(
    serving, prefect_client
):
    ensure_live(serving, "2")
    drill = Drill(after_swap={"error_rate": 1.0})
    with load(serving) as traffic:
        with pytest.raises(RolloutFailed, match="rolled back"):
            rollout(serving, 5, drill=drill, gates=fast_gates(bake_s=20))
        time.sleep(1)
    assert live_version(serving) == "2"
    tags = verdict(serving, 5)
    assert (tags["verdict"], tags["stage"]) == ("rolled_back", "bake")
    history = registry.alias_history(serving["client"], serving["name"], registry.LIVE)
    assert [h["version"] for h in history[-2:]] == ["5", "2"]
    # During the bake v2's app was still up: v5's failures were answered by it.
    assert traffic.failed() == []
    fell_back = [a for a in traffic.answers if a.fallback_from]
    assert fell_back and {(a.version, a.fallback_from) for a in fell_back} == {("2", "5")}
    assert fell_back[-1].at - fell_back[0].at < 10  # rolled back within seconds
    assert traffic.answers[-1].version == "2" and traffic.answers[-1].fallback_from is None
    assert not serve_control.app_exists(serve_control.version_app_name(serving["name"], "5"))
    (event,) = rollout_events(prefect_client, serving, 5, "rolled-back")
    assert event.payload["stage"] == "bake"


def test_a_candidate_is_stopped_by_its_smoke_test_or_its_canary_p99(serving):
    ensure_live(serving, "2")
    with load(serving) as traffic:
        # A golden observation the version cannot act on: smoke stops it before any traffic.
        with pytest.raises(RolloutFailed, match="smoke"):
            rollout(serving, 8, gates=fast_gates(smoke_observations=[[0.1, 0.2]]))
        # 300 ms more on every answer: slow, not failing, and the canary judges its p99.
        with pytest.raises(RolloutFailed, match="p99"):
            rollout(
                serving,
                9,
                drill=Drill(faults={"latency_ms": 300}),
                gates=fast_gates(max_p99_ms=250, canary_min_requests=10),
            )
    assert live_version(serving) == "2"
    assert traffic.failed() == []
    assert (verdict(serving, 8)["verdict"], verdict(serving, 8)["stage"]) == ("rejected", "smoke")
    tags = verdict(serving, 9)
    assert (tags["verdict"], tags["stage"]) == ("rejected", "canary") and "p99" in tags["reason"]
    assert "9" in {a.version for a in traffic.answers}  # the canary did serve it, slowly
    assert not serve_control.app_exists(serve_control.version_app_name(serving["name"], "9"))


@pytest.mark.parametrize(
    "body, content_type, status, message",
    [
        (b'{"observation": [1, 2, 3]}', "application/json", 422, "shape [4]"),
        (b'{"observation": ["a", "b", "c", "d"]}', "application/json", 422, "numbers only"),
        (b'{"observation": [1, 2, NaN, 4]}', "application/json", 400, "not valid JSON"),
        (b"not json", "application/json", 400, "not valid JSON"),
        (b"\0" * 12, "application/octet-stream", 422, "float32"),
        (b"x" * (2 << 20), "application/json", 413, "exceeds the limit"),
        (b"<observation/>", "application/xml", 415, "not supported"),
    ],
)
def test_bad_requests_get_4xx_with_a_message_and_the_replica_that_answered_stays_healthy(
    serving, body, content_type, status, message
):
    ensure_live(serving, "2")
    # After its bake the router hosts v2 in its own replicas: those answer, so those must
    # stay up, unreplaced.
    assert router_status(serving)["inline_version"] == "2"
    app = serve_control.router_app_name(ROUTE)
    replicas = serve_control.deployment_state(app, ROUTER_DEPLOYMENT)["replicas"]
    connection = http.client.HTTPConnection("127.0.0.1", serving["port"], timeout=30)
    connection.request(
        "POST", f"/{ROUTE}", body, {"content-type": content_type, "X-Request-Id": "bad-1"}
    )
    response = connection.getresponse()
    payload = json.loads(response.read())
    assert response.status == status
    assert message in payload["error"]
    assert response.getheader("X-Model-Version") == "2"
    assert response.getheader("X-Request-Id") == "bad-1"
    raw = np.asarray([OBSERVATION, OBSERVATION], dtype="<f4").tobytes()
    connection.request("POST", f"/{ROUTE}", raw, {"content-type": "application/octet-stream"})
    answer = json.loads(connection.getresponse().read())
    assert len(answer["actions"]) == 2 and answer["model_version"] == "2"
    state = serve_control.deployment_state(app, ROUTER_DEPLOYMENT)
    assert state["replicas"] == replicas and str(state["status"]).endswith("HEALTHY")


def test_reconcile_rolls_out_a_manual_champion_and_otherwise_does_nothing(serving, prefect_client):
    client, name = serving["client"], serving["name"]
    ensure_live(serving, "2")
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
    registry.tag_verdict(client, name, "7", "rollout", {"verdict": "rejected", "reason": "drill"})
    client.set_registered_model_alias(name, registry.CHAMPION, "7")  # failed before
    skipped = reconcile(**common)
    assert skipped.action == "skipped_failed" and live_version(serving) == "2"
    client.set_registered_model_alias(name, registry.CHAMPION, "6")  # a person's promotion
    outcome = {}
    limit = f"serve-rollout-{ROUTE}"
    with load(serving) as traffic:
        # Another rollout holds the route: this one waits for its slot before touching Serve.
        with concurrency(limit, occupy=1):
            waiting = threading.Thread(
                target=contextvars.copy_context().run,
                args=(lambda: outcome.update(done=reconcile(**common)),),
            )
            waiting.start()
            run = waiting_reconcile(prefect_client)
            assert run.state.is_running() and waiting.is_alive()
            held = prefect_client.read_global_concurrency_limit_by_name(limit)
            assert held.active_slots == 1
            assert not serve_control.app_exists(serve_control.version_app_name(name, "6"))
        waiting.join(timeout=300)
    done = outcome["done"]
    assert done.action == "rolled_out" and done.rollout.outcome == "promoted"
    assert live_version(serving) == "6"
    assert traffic.failed() == []
    assert reconcile(**common).action == "in_sync"


def test_mlflow_down_at_the_swap_undoes_it_and_the_next_reconcile_rolls_the_champion_out(
    serving, checkpoints, tmp_path, monkeypatch
):
    """The router moves first, then `live`; when `live` cannot follow (MLflow down past the
    task's retries), the swap is undone: the router and `live` name the same version again,
    no user saw an error, and the next reconcile (MLflow back) rolls the champion out. An
    MLflow server of its own, so the session's stays up."""
    from deployments import local, ports
    from prefect_ray_lifecycle.tasks.rollout.record import record

    (port,) = ports.free_ports(1)
    (service,) = local.services(tmp_path / "mlflow-swap", {"mlflow": port}, ("mlflow",))
    assert local.start(service).startswith("started")
    route, name = "swap-outage-test", f"swap-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(service.url)
    for trial in range(2):
        registry.register_checkpoint(
            client,
            name=name,
            checkpoint=checkpoints["good"],
            experiment_name="swap-outage",
            trial_key_value=f"{name}-{trial}",
            observation_size=4,
        )
    server = MLflowServer(tracking_uri=service.url, request_retries=0)
    common = dict(model_name=name, route=route, serving=SERVING, ray_cluster=serving["cluster"])
    # One quick retry of the swap's MLflow write instead of two minutes of them: what is
    # tested is what follows once they are used up.
    monkeypatch.setattr(record, "retries", 1)
    monkeypatch.setattr(record, "retry_delay_seconds", [1])

    def router() -> dict:
        return requests.get(
            f"http://127.0.0.1:{serving['port']}/{route}/-/status", timeout=30
        ).json()

    try:
        first = serve_rollout(version="1", gates=fast_gates(), mlflow_server=server, **common)
        assert first.outcome == "first_rollout"
        client.set_registered_model_alias(name, registry.CHAMPION, "2")
        outcome: list = []
        held = fast_gates(canary_hold_s=10)  # time to stop MLflow while it holds
        with ClosedLoop(serving["port"], f"/{route}", pause_s=LOAD_PAUSE_S) as traffic:
            rolling = threading.Thread(
                target=contextvars.copy_context().run,
                args=(
                    lambda: outcome.append(
                        serve_rollout(
                            version="2",
                            gates=held,
                            mlflow_server=server,
                            return_state=True,
                            **common,
                        )
                    ),
                ),
            )
            rolling.start()
            wait_for_share = time.monotonic() + 120
            while router()["candidate_share"] == 0:
                assert rolling.is_alive() and time.monotonic() < wait_for_share, outcome
                time.sleep(0.25)
            local.stop(service)
            rolling.join(timeout=180)
        (state,) = outcome
        assert state.is_failed() and "`live` could not be moved" in state.message, state.message
        assert "back on v1" in state.message
        status = router()
        assert status["config"]["live"]["version"] == "1", status["config"]
        assert status["config"]["candidate"] is None and status["config"]["rollout"] is None
        assert not serve_control.app_exists(serve_control.version_app_name(name, "2"))
        assert traffic.failed() == [], traffic.failed()[:3]
        assert traffic.answers[-1].version == "1"

        assert local.start(service).startswith("started")
        assert registry.resolve_alias(client, name, registry.LIVE).version == "1"  # never moved
        with ClosedLoop(serving["port"], f"/{route}", pause_s=LOAD_PAUSE_S) as traffic:
            healed = reconcile(gates=fast_gates(), mlflow_server=server, **common)
        assert healed.action == "rolled_out" and healed.live == "2", healed
        assert traffic.failed() == [] and traffic.answers[-1].version == "2"
        assert registry.resolve_alias(client, name, registry.LIVE).version == "2"
        assert router()["config"]["live"]["version"] == "2"
    finally:
        local.start(service)
        serve_control.delete_route(route, name)
        local.stop(service)


def test_the_status_command_says_what_the_router_and_mlflow_say(serving, capsys):
    """`python -m deployments.status --json` gives the router's own `-/status` (live version,
    candidate, weight, served share, lease), MLflow's aliases and last rollout verdicts, and
    the figures of the requests just sent; its tables name the same."""
    from deployments import status as status_command

    router = serve_control.current_router(ROUTE)
    if router is None or router.live is None:
        ensure_live(serving, "2")
    sent, started = 20, time.time()
    connection = http.client.HTTPConnection("127.0.0.1", serving["port"], timeout=30)
    for _ in range(sent):
        body = json.dumps({"observation": OBSERVATION})
        connection.request("POST", f"/{ROUTE}", body, {"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, response.read()
        response.read()
    live = response.getheader("X-Model-Version")
    # Router replicas report their figures every 0.25 s, without waiting for an answer.
    deadline = time.monotonic() + 20
    while route_figures(ROUTE, started).get(live, {}).get("requests", 0) < sent:
        assert time.monotonic() < deadline, route_figures(ROUTE, started)
        time.sleep(0.25)

    name, client = serving["name"], serving["client"]
    args = ["--url", f"http://127.0.0.1:{serving['port']}/{ROUTE}", "--model", name]
    args += ["--mlflow-uri", serving["server"].tracking_uri, "--window", "60"]
    assert status_command.main([*args, "--json"]) == 0
    now = json.loads(capsys.readouterr().out)
    direct = router_status(serving)  # the router's own answer, no window: the last 300 s
    for key in ("route", "candidate_share", "lease", "inline_version"):
        assert now[key] == direct[key], key
    for key in ("live", "candidate", "candidate_weight", "previous", "rollout", "generation"):
        assert now[key] == direct["config"][key], key
    assert now["live"]["version"] == live and now["model"] == name
    assert now["candidate"] is None and now["candidate_share"] == 0.0
    assert direct["figures"]["window_s"] == 300 and now["figures"]["window_s"] == 60
    figures = now["figures"]["versions"][live]
    assert figures["requests"] >= sent and figures["errors"] == 0, figures
    assert direct["figures"]["versions"][live]["requests"] >= figures["requests"]
    # The aliases as MLflow resolves them; `live` is the version the route serves.
    assert client.get_model_version_by_alias(name, registry.LIVE).version == live
    for alias in (registry.CHAMPION, registry.LIVE, registry.CHALLENGER):
        found = registry.resolve_alias(client, name, alias)
        assert now["aliases"][alias] == (found.version if found else None), alias
    # The last five rollout verdicts, newest first, as each version's tags give them.
    tagged = [
        (tags["at"], str(v), tags)
        for v in range(1, VERSIONS + 1)
        if "verdict" in (tags := verdict(serving, v))
    ]
    expected = [
        {
            "version": version,
            "verdict": tags["verdict"],
            "stage": tags.get("stage"),
            "reason": tags.get("reason"),
            "route": tags.get("route"),
            "at": at,
            "flow_run_id": tags.get("flow_run_id") or None,
        }
        for at, version, tags in sorted(tagged, key=lambda t: t[:2], reverse=True)[:5]
    ]
    assert now["verdicts"] == expected and expected and "mlflow_error" not in now

    assert status_command.main(args) == 0
    table = capsys.readouterr().out
    assert f"live       v{live}  (app {now['live']['app']}" in table
    row = re.search(rf"^{live}\s+live\s+(\d+)\s+0\s+0\.00%", table, re.MULTILINE)
    assert row and int(row.group(1)) >= sent, table
    newest = expected[0]
    assert re.search(rf"^{newest['version']}\s+{newest['verdict']}\s", table, re.MULTILINE), table


@pytest.mark.parametrize("answer", [None, (404, b"no such route"), (200, b'{"ok": true}')])
def test_the_status_command_exits_2_where_no_router_answers(answer, capsys):
    """Nothing listening (a closed port), a 404, or a JSON that is not a router's status."""
    import http.server
    import socket

    from deployments import status as status_command

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(answer[0])
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(answer[1])

        def log_message(self, *args):
            pass

    if answer is None:
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
        server = None
    else:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = status_command.main(["--url", f"http://127.0.0.1:{port}/policy", "--json"])
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    expected = "nothing answers at" if answer is None else "is not a route"
    assert expected in captured.err and f"127.0.0.1:{port}/policy" in captured.err
