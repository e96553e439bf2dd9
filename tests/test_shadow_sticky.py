"""What reaches users during a rollout, on real Ray Serve with two router replicas and load
through the router: the shadow stage (the candidate's answers compared with live's while every
user still gets live's), sticky sessions through the canary steps, a tester's header, and the
contract of the new headers and fields. One rollout of an identical candidate is shared by
several tests (`gated`); the rejected ones run after it."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter

import numpy as np
import pytest
import ray
import requests
from http_fuzz import JSON_VALUES, LIVE_FUZZ, PRINTABLE, assert_contract, mostly
from hypothesis import event, given
from hypothesis import strategies as st
from mlflow import MlflowClient

from deployments import status as status_command
from deployments.testing import drive
from deployments.testing.fast import FAST_SERVING
from deployments.testing.load import ClosedLoop
from deployments.testing.watch import (
    FAST_POLL_S,
    sessions_per_step,
    stage_windows,
    wait_for,
)
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.rollout import RolloutFailed, serve_rollout
from prefect_ray_lifecycle.tasks.rollout.config import Drill, Gates, Serving
from prefect_ray_lifecycle.workloads.constants import (
    CANARY_HEADER,
    CANARY_TOKEN_HEADER,
    SESSION_HEADER,
    VERSION_HEADER,
)
from prefect_ray_lifecycle.workloads.serve.route_state import (
    route_figures,
    route_state,
)
from prefect_ray_lifecycle.workloads.serve.router_config import Testers
from prefect_ray_lifecycle.workloads.serve.traffic import token_digest

pytestmark = pytest.mark.slow

ROUTE = "gated-test"
SESSIONS = 200
# Session ids new each run: the router's draw is a hash of the id, so a fixed set of ids has
# one fixed share on the candidate (s0..s199 under version 2: 54 % below 0.5), and a window's
# sessions are a contiguous run of them; random ids make every window's sessions a random
# sample, which the binomial bound below is about.
SESSION_PREFIX = uuid.uuid4().hex[:8]
BURST = 3  # requests a session sends in a row
STEPS = [0.2, 0.5]
SERVING = Serving(**FAST_SERVING, router_replicas=2)
BOUNDARY_S = 1.0  # around a step's start and end, the two replicas may disagree on the share


def gates(**overrides) -> Gates:
    settings = dict(
        health_timeout_s=120,
        stability_window_s=3,
        shadow_share=1.0,
        shadow_hold_s=3,
        shadow_min_requests=30,
        shadow_max_wait_s=60,
        canary_steps=[0.3],
        canary_hold_s=3,
        canary_max_wait_s=60,
        bake_s=3,
        bake_window_s=2,
        max_error_rate=0.05,
        max_p99_ms=5000,
        p99_slack_ms=3000,
    )
    return Gates(**{**settings, **overrides})


def observations(n: int) -> bytes:
    """Varied CartPole observations: a comparison on one repeated input would prove little."""
    rng = np.random.default_rng(n)
    return json.dumps({"observations": rng.uniform(-0.5, 0.5, (4, 4)).tolist()}).encode()


def session_of(n: int) -> int:
    """The session of the n-th request: sessions take turns, BURST requests at a time, so
    that each visit is several requests within a step however fast the machine is."""
    return n // BURST % SESSIONS


def session_requests(n: int) -> tuple[bytes, dict[str, str]]:
    """The n-th request of SESSIONS interleaved sessions, keyed by X-Session-Id or (a third
    of them, a policy's episode) by the body's episode_id."""
    session = f"{SESSION_PREFIX}-{session_of(n)}"
    if session_of(n) % 3 == 0:
        body = {"observation": [0.01, -0.02, 0.03, 0.04], "episode_id": session}
        return json.dumps(body).encode(), {}
    return observations(n), {SESSION_HEADER: session}


@pytest.fixture(scope="module")
def route(stack, checkpoints):
    cluster = stack.ray_cluster()
    server = MLflowServer(tracking_uri=stack.mlflow_uri)
    name = f"gated-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(stack.mlflow_uri)
    for trial in range(5):
        registry.register_checkpoint(
            client,
            name=name,
            checkpoint=checkpoints["good"],
            experiment_name="gated-tests",
            trial_key_value=f"{name}-{trial}",
            observation_size=4,
        )
    with cluster.connect():
        serve_control.start(cluster.serve_host, cluster.serve_port)
        try:
            common = dict(
                model_name=name,
                route=ROUTE,
                serving=SERVING,
                ray_cluster=cluster,
                mlflow_server=server,
            )
            assert serve_rollout(version="1", gates=gates(), **common).outcome == "first_rollout"
            yield {
                "name": name,
                "client": client,
                "server": server,
                "port": cluster.serve_port,
                "url": f"http://127.0.0.1:{cluster.serve_port}/{ROUTE}",
                "common": common,
            }
        finally:
            serve_control.release()
            serve_control.delete_route(ROUTE, name)


def load(route, **kwargs) -> ClosedLoop:
    return ClosedLoop(route["port"], f"/{ROUTE}", **kwargs)


def tags_of(route, version) -> dict[str, str]:
    tags = route["client"].get_model_version(route["name"], str(version)).tags
    prefix = f"{registry.TAG}.rollout."
    return {k.removeprefix(prefix): v for k, v in tags.items() if k.startswith(prefix)}


def chart_data(route, version) -> dict:
    client = route["client"]
    run_id = client.get_model_version(route["name"], str(version)).run_id
    path = sorted(
        f.path for f in client.list_artifacts(run_id, "rollouts") if f.path.endswith(".json")
    )[-1]
    return json.loads(open(client.download_artifacts(run_id, path)).read())


def windows(gated) -> dict[str, tuple[float, float]]:
    stages = ["shadow", "canary 20%", "canary 50%"]
    return stage_windows(gated["result"].timeline, stages, BOUNDARY_S)


@pytest.fixture(scope="module")
def gated(route):
    """v2, the same policy as v1, rolled out with a shadow stage and two canary steps while
    a few hundred sessions, plain users and a tester (X-Canary: always) send requests."""
    # Paced, not flat out: a loop without pauses costs Serve a core (about 13 ms of CPU a
    # request). Three session threads still give each 8 s step 100+ visits of BURST requests.
    users = load(route, pause_s=0.05, requests=lambda n: (observations(n), {}))
    sessions = load(route, threads=3, pause_s=0.03, requests=session_requests)
    tester = load(route, pause_s=0.1, headers={CANARY_HEADER: "always"})
    started = time.time()
    with users, sessions, tester:
        time.sleep(1)
        result = serve_rollout(
            version="2",
            gates=gates(
                canary_steps=STEPS,
                canary_hold_s=8,
                # Each step lasts until the candidate answered 200, however slow the machine:
                # the checks below need sessions seen in both steps (a visit to all SESSIONS
                # is 600 requests) and 50 with several requests in each. Held 8 s alone, a
                # loaded run saw no session in both steps.
                canary_min_requests=200,
                canary_max_wait_s=120,
                min_agreement=1.0,
                tester_header="on",
                shadow_noise_floor="on",
            ),
            **route["common"],
        )
        time.sleep(1)
    return {
        "result": result,
        "users": users,
        "sessions": sessions,
        "tester": tester,
        "started": started,
        "drawn": chart_data(route, 2),
    }


def test_an_identical_candidate_agrees_fully_in_the_shadow_and_users_got_live_meanwhile(
    route, gated
):
    result, drawn = gated["result"], gated["drawn"]
    assert result.outcome == "promoted", result
    stages = [e["stage"] for e in result.timeline]
    assert stages[:5] == ["health", "smoke", "shadow", "canary 20%", "canary 50%"], stages
    shadow = next(e for e in result.timeline if e["stage"] == "shadow")
    assert shadow["outcome"] == "passed"
    ours, floor = shadow["figures"]["candidate"], shadow["figures"]["noise_floor"]
    assert ours["copies"] >= 30 and ours["errors"] == 0, ours
    assert ours["agreement"] == 1.0 and ours["tvd"] == pytest.approx(0.0, abs=1e-6), ours
    assert floor["agreement"] == 1.0  # a policy on CPU agrees with itself exactly
    # While it shadowed, no user got one of its answers: the candidate had no users' figures.
    shadow_start, shadow_end = windows(gated)["shadow"]
    during = [
        a
        for loop in (gated["users"], gated["sessions"])
        for a in loop.answers
        if shadow_start < a.at < shadow_end
    ]
    assert during and {a.version for a in during} == {"1"}
    assert all(a.status == 200 for loop in ("users", "sessions") for a in gated[loop].answers)
    assert route_figures(ROUTE, shadow_start, shadow_end).get("2") is None
    # Where people look: the chart's shadow panel, the version's tags, deployments.status.
    assert any(p["agreement"] == 1.0 for p in drawn["shadow"]["candidate"]["2"])
    assert drawn["thresholds"]["min_agreement"] == 1.0
    tags = tags_of(route, 2)
    assert tags["verdict"] == "promoted" and float(tags["shadow_agreement"]) == 1.0
    assert int(tags["shadow_copies"]) == ours["copies"]
    now = status_command.gather(route["url"], window_s=300)
    assert now["figures"]["shadow"]["candidate"]["2"]["agreement"] == 1.0
    assert "shadow" in status_command.render(now)


def test_each_session_sees_one_version_per_canary_step_in_the_share_of_its_weight(gated):
    held = windows(gated)
    steps = {0.2: held["canary 20%"], 0.5: held["canary 50%"]}
    seen, fallbacks = sessions_per_step(
        gated["sessions"].answers, steps, lambda a: session_of(a.request)
    )
    for weight, (start, end) in steps.items():
        versions = seen[weight]
        switched = [k for k, v in versions.items() if len(v) > 1]
        assert switched == [], (weight, switched[:5])
        counts = Counter(
            session_of(a.request) for a in gated["sessions"].answers if start < a.at < end
        )
        several = sum(1 for n in counts.values() if n >= 2)
        assert several >= 50, (weight, counts)  # enough sessions of several requests to judge
        share = sum(v == {"2"} for v in versions.values()) / len(versions)
        spread = 4 * (weight * (1 - weight) / len(versions)) ** 0.5  # 4 sigma
        assert abs(share - weight) <= spread, (weight, share, len(versions))
    assert fallbacks == 0  # a good candidate: none to except
    # A session moves only when the share grows, and only towards the candidate.
    both = seen[0.2].keys() & seen[0.5].keys()
    moved_back = [k for k in both if seen[0.2][k] == {"2"} and seen[0.5][k] == {"1"}]
    assert both and moved_back == []


def test_a_testers_header_reaches_the_candidate_only_while_the_rollout_holds_the_route(gated):
    held = windows(gated)
    smoke = next(e["at"] for e in gated["result"].timeline if e["stage"] == "smoke")
    answers = gated["tester"].answers
    assert all(a.status == 200 for a in answers)
    before = [a for a in answers if a.at < smoke]
    start, end = held["shadow"][0], held["canary 50%"][1]
    holding = [a for a in answers if start < a.at < end]
    assert before and {a.version for a in before} == {"1"}  # no candidate yet: live
    assert holding and {a.version for a in holding} == {"2"}  # shadow and canary: candidate
    # The testers' requests are kept apart: none in the users' figures of the shadow stage
    # (when the candidate had no users), all of them in the testers' figures.
    assert route_figures(ROUTE, *held["shadow"]).get("2") is None
    testers = ray.get(route_state(ROUTE).summary.remote(start, end, True), timeout=10)
    assert testers["2"]["requests"] >= len(holding) * 0.9, testers


def test_a_candidate_that_answers_differently_is_rejected_at_shadow_and_no_user_saw_it(
    route, gated
):
    """A drill makes v3 choose another action on 30% of the observations; its health, smoke,
    error rate and latency are fine. The testers' header is off on this rollout: ignored."""
    tester = load(route, pause_s=0.05, headers={CANARY_HEADER: "always"})
    users = load(route, threads=3, pause_s=0.03, requests=lambda n: (observations(n), {}))
    with users, tester, pytest.raises(RolloutFailed, match="at shadow: agreement with live"):
        serve_rollout(
            version="3",
            gates=gates(),
            drill=Drill(faults={"disagree_rate": 0.3}),
            **route["common"],
        )
    for loop in (users, tester):
        assert loop.answers and {(a.status, a.version) for a in loop.answers} == {(200, "2")}
    tags = tags_of(route, 3)
    assert (tags["verdict"], tags["stage"]) == ("rejected", "shadow")
    assert 0.6 < float(tags["shadow_agreement"]) < 0.8, tags
    assert "agreement with live" in tags["reason"] and "below 99.0%" in tags["reason"]


def test_a_candidate_hanging_past_the_request_timeout_costs_shadowed_users_nothing(route, gated):
    """v4 takes 3 s per answer, the router's timeout is 1 s: its copies time out (rejected at
    shadow, on its errors), and users see no 504 and no fallback: nobody waits for a copy."""
    users = load(route, threads=2, pause_s=0.05, requests=lambda n: (observations(n), {}))
    with users, pytest.raises(RolloutFailed, match="at shadow: shadow error rate"):
        serve_rollout(
            version="4",
            gates=gates(request_timeout_s=1.0, shadow_min_requests=10),
            drill=Drill(faults={"latency_ms": 3000}),
            **route["common"],
        )
    assert users.answers and all(a.status == 200 and a.version == "2" for a in users.answers)
    assert not any(a.fallback_from for a in users.answers)
    assert tags_of(route, 4)["stage"] == "shadow"


# ---- the new headers and fields, fuzzed on a route held by a rollout ------------------------

# ASCII: Serve's proxy (Ray 2.60) decodes X-Session-Id and X-Request-Id itself as UTF-8 and
# answers a plain 500 for other bytes, and uvicorn refuses DEL with a plain 400, both before
# the router sees the request (docs/serving.md, the HTTP contract).
HEADER_VALUES = mostly(
    st.sampled_from(["always", "never", "ALWAYS", " never ", "s3cret"]),
    PRINTABLE | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=300),
)


def held_by_a_fuzzer(stage: str):
    """The route's router serving live v2 and, as its candidate, v2's app again, under a
    rollout record this test holds the route for: a shadow stage, or a canary at 50% with
    testers let in by token."""
    good = serve_control.current_router(ROUTE)
    fields = {"candidate": good.live, "rollout": {"stage": stage}}
    if stage == "shadow":
        fields["shadow"] = {"share": 1.0, "max_per_s": 100, "noise_floor": True}
    else:
        fields["candidate_weight"] = 0.5
        fields["testers"] = Testers("token", token_digest("s3cret"))
    return drive.held(ROUTE, **fields)


@pytest.mark.parametrize("stage", ["canary", "shadow"])
def test_new_headers_and_fields_never_get_a_5xx_and_the_route_stays_healthy(route, gated, stage):
    session = requests.Session()

    @LIVE_FUZZ
    @given(
        headers=st.dictionaries(
            st.sampled_from([SESSION_HEADER, CANARY_HEADER, CANARY_TOKEN_HEADER]),
            HEADER_VALUES,
            max_size=3,
        ),
        episode=mostly(st.text(max_size=20) | st.integers(), JSON_VALUES),
        temperature=st.sampled_from([None, 0, 0.5]),
    )
    def fuzz(headers, episode, temperature):
        body = {"observation": [random.uniform(-1, 1) for _ in range(4)], "episode_id": episode}
        if temperature is not None:
            body["temperature"] = temperature
        try:
            data = json.dumps(body).encode()
        except (ValueError, TypeError):
            data = b'{"observation": [0, 0, 0, 0], "episode_id": NaN}'
        # What an HTTP client can send: latin-1, no surrounding whitespace.
        safe = {
            k: v.encode("latin-1", "replace").decode("latin-1").strip() for k, v in headers.items()
        }
        answer = session.post(
            route["url"],
            data=data,
            headers={"content-type": "application/json", **safe},
            timeout=30,
        )
        event(f"{stage}: {answer.status_code}")
        assert_contract(answer.status_code, answer.content, answer.headers)
        assert answer.headers[VERSION_HEADER] == "2"

    with held_by_a_fuzzer(stage):

        def held() -> dict | None:
            status = session.get(f"{route['url']}/-/status", timeout=30).json()
            return status if status["lease"]["lapsed"] is False else None

        status = wait_for("the replicas see the lease", held, 10, every=FAST_POLL_S)
        assert status["serving"] == "as configured"
        assert status["shadow"]["active"] is (stage == "shadow")
        assert status["config"]["testers"]["token_sha256"] in (None, "set")  # never the digest
        fuzz()
    ok = session.post(route["url"], json={"observation": [0.0] * 4}, timeout=30)
    assert ok.status_code == 200 and ok.headers[VERSION_HEADER] == "2"
    state = serve_control.deployment_state(serve_control.router_app_name(ROUTE), "Router")
    assert str(state["status"]).endswith("HEALTHY")


def test_a_candidate_failing_while_a_person_looks_is_aborted_at_approval(route, gated):
    """In process too (no deployment): the rollout waits for approval before the swap, and
    when its candidate starts failing meanwhile it is aborted without anyone answering."""
    from prefect_ray_lifecycle.tasks.rollout.changes import inject

    def waiting() -> bool:
        config = serve_control.current_router(ROUTE)
        return config.rollout is not None and config.rollout.approval is not None

    users = load(route, pause_s=0.05, requests=lambda n: (observations(n), {}))
    failing = threading.Thread(
        target=lambda: (
            wait_for("the rollout waits for approval", waiting, 240, every=FAST_POLL_S),
            inject.fn(serve_control.version_app_name(route["name"], "5"), {"error_rate": 1.0}),
        ),
        daemon=True,
    )
    with users, pytest.raises(RolloutFailed, match="at approval: aborted by serve-rollout"):
        failing.start()
        serve_rollout(
            version="5", gates=gates(shadow_share=0.0, approval="before_swap"), **route["common"]
        )
    failing.join(timeout=30)
    tags = tags_of(route, 5)
    assert (tags["verdict"], tags["stage"]) == ("rejected", "approval")
    assert "the candidate failed while waiting" in tags["reason"]
    assert all(a.status == 200 for a in users.answers)  # its failures were answered by live
    assert {a.version for a in users.answers} <= {"2", "5"}
