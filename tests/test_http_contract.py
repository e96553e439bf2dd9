"""The HTTP contract of the policy route and the OpenAI routes: bad input is a 4xx with a JSON
message, never a 5xx, and a valid request right after is answered. The request parsing is
fuzzed in process with Hypothesis (random bytes, JSON of any depth and size, NaN, Infinity,
huge numbers, ragged and oversized batches, wrong methods and content types); then a live
route (router and version app on the session's Ray head) is fuzzed through Serve's proxy, and
its documented answers are checked: 415, one X-Request-Id, a 504 after the router's timeout, a
bad router config refused by the replica, and config changes without a replica restart."""

from __future__ import annotations

import json
import struct
import time

import http_fuzz
import pytest
from http_fuzz import (
    JSON_TYPE,
    METHODS,
    NASTY,
    RAW_TYPE,
    STATUS_QUERIES,
    WINDOWS,
    assert_contract,
    expected_window,
    mostly,
    openai_requests,
    policy_requests,
    status_window_of,
)
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from deployments.testing.fast import FAST_SERVING
from prefect_ray_lifecycle.workloads.constants import (
    POLICY_DEPLOYMENT,
    REQUEST_ID_HEADER,
    VERSION_HEADER,
)
from prefect_ray_lifecycle.workloads.http import BadRequest
from prefect_ray_lifecycle.workloads.llm.protocol import (
    CompletionRequest,
    bad_request_body,
    endpoint,
    generation_budget,
    parse_json_body,
)
from prefect_ray_lifecycle.workloads.serve.policy import MAX_BATCH, PolicyCore
from prefect_ray_lifecycle.workloads.serve.route_state import (
    MAX_STATUS_WINDOW_S,
    STATUS_WINDOW_S,
    status_window,
)

VALID = json.dumps({"observation": [0.01, -0.02, 0.03, 0.04]}).encode()
FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def ask(core: PolicyCore, method: str, content_type: str, body: bytes) -> dict:
    headers = {} if content_type == "missing" else {"content-type": content_type}
    return core.answer({"method": method, "path": "/", "headers": headers, "body": body})


@FUZZ
@given(request=policy_requests())
def test_the_policy_contract_never_answers_5xx(core, request):
    answer = ask(core, *request)
    event(f"status {answer['status']}")
    assert answer["status"] in (200, 400, 405, 413, 415, 422), answer
    body = assert_contract(answer["status"], answer["body"], answer["headers"])
    if answer["status"] == 200:
        actions = [body["action"]] if "action" in body else body["actions"]
        assert actions and set(actions) <= {0, 1}, body


@pytest.mark.parametrize(
    "content_type, body, status, words",
    [
        (JSON_TYPE, b"[" * 100_000, 400, "nests too deeply"),
        (JSON_TYPE, b'{"observation": [1, 2, NaN, 4]}', 400, "NaN is not a number"),
        (JSON_TYPE, b'{"observation": [1e39, 0, 0, 0]}', 422, "float32's range"),
        (JSON_TYPE, b'{"observation": [1e999, 0, 0, 0]}', 422, "NaN or infinite"),
        (JSON_TYPE, b'{"observation": [true, 0, 0, 0]}', 422, "not true or false"),
        (JSON_TYPE, b'{"observation": [1, 2, 3, 1' + b"0" * 30 + b"]}", 422, "numbers only"),
        (JSON_TYPE, b'{"observation": [[1, 2, 3, 4], [1, 2, 3]]}', 422, "ragged"),
        (JSON_TYPE, json.dumps({"observation": [[0] * 4] * (MAX_BATCH + 1)}).encode(), 413, ""),
        (JSON_TYPE, b"0" * ((1 << 20) + 1), 413, "exceeds the limit"),
        (RAW_TYPE, struct.pack("<4f", 0, 0, float("nan"), 0), 422, "NaN or infinite"),
        (RAW_TYPE, b"\0" * 15, 422, "16 bytes each"),
        ("text/plain", VALID, 415, "content type 'text/plain'"),
    ],
)
def test_bad_policy_requests_get_the_documented_4xx(core, content_type, body, status, words):
    answer = ask(core, "POST", content_type, body)
    assert answer["status"] == status, answer["body"][:300]
    assert words in json.loads(answer["body"])["error"]
    assert ask(core, "GET", JSON_TYPE, VALID)["status"] == 405
    assert json.loads(ask(core, "POST", "missing", VALID)["body"])["action"] in (0, 1)


@FUZZ
@given(request=openai_requests("tiny"))
def test_openai_request_validation_only_ever_refuses_with_a_4xx(request):
    """Whatever the body, validation gives a request the engine accepts or an OpenAI 4xx."""
    path, body = request
    chat = endpoint("POST", path) == "chat"
    try:
        request = CompletionRequest.from_body(
            parse_json_body(body), chat=chat, model_name="tiny", vocab_size=100
        )
        prompt_tokens = 3 if chat or isinstance(request.prompt, str) else len(request.prompt)
        budget = generation_budget(prompt_tokens, 128, request.sampling.max_tokens, chat=chat)
    except BadRequest as error:
        event(f"status {error.status}: {error.code}")
        assert 400 <= error.status < 500 and error.message, error
        assert_contract(
            error.status, json.dumps(bad_request_body(error)).encode(), {"content-type": JSON_TYPE}
        )
        return
    event("accepted")
    kwargs = request.sampling.engine_kwargs(budget)
    # What vLLM's SamplingParams checks, so an accepted request never fails in the engine.
    assert 1 <= kwargs["max_tokens"] <= 128 and 0 <= kwargs["min_tokens"] <= budget
    assert 0 <= kwargs["temperature"] <= 2 and 0 < kwargs["top_p"] <= 1
    assert kwargs["top_k"] >= -1 and -2 <= kwargs["presence_penalty"] <= 2
    assert kwargs["seed"] is None or -(2**63) <= kwargs["seed"] < 2**63


@FUZZ
@given(values=st.lists(mostly(st.integers(-5, 1000).map(str), WINDOWS), max_size=3))
def test_the_status_window_is_whole_seconds_within_the_figures_kept_or_a_400(values):
    """The figures window of `-/status?window_s=N`, from the values the query gave."""
    expected = expected_window(values, STATUS_WINDOW_S, MAX_STATUS_WINDOW_S)
    try:
        window = status_window(values)
    except BadRequest as error:
        event("400")
        assert expected is None and error.status == 400 and "window_s" in error.message
        return
    event("window")
    assert window == expected and 1 <= window <= MAX_STATUS_WINDOW_S


# ---- the live route: a router and a version app on the session's Ray head -----------------

ROUTE = "contract-test"  # tests/test_rollout.py owns policy-test
LIVE_FUZZ = settings(http_fuzz.LIVE_FUZZ, max_examples=80)  # more examples than the profile


@pytest.fixture(scope="module")
def route(stack, checkpoints):
    """Version 1 of a fresh model rolled out to ROUTE (router + version app), the test
    process joined to the cluster, an HTTP session to Serve's proxy; all deleted after."""
    import uuid

    import requests
    from mlflow import MlflowClient

    from prefect_ray_lifecycle.blocks import MLflowServer
    from prefect_ray_lifecycle.control import registry, serve_control
    from prefect_ray_lifecycle.flows.rollout import serve_rollout
    from prefect_ray_lifecycle.tasks.rollout.config import Gates, Serving

    cluster = stack.ray_cluster()
    name = f"contract-{uuid.uuid4().hex[:6]}"
    registry.register_checkpoint(
        MlflowClient(stack.mlflow_uri),
        name=name,
        checkpoint=checkpoints["good"],
        experiment_name="contract-tests",
        trial_key_value=name,
        params={},
        metrics={},
        tags={},
        description="",
        artifacts={},
        observation_size=4,
    )
    gates = Gates(health_timeout_s=120, stability_window_s=2, bake_s=2, bake_window_s=1)
    serving = Serving(**FAST_SERVING)
    with cluster.connect():
        try:
            result = serve_rollout(
                model_name=name,
                version="1",
                route=ROUTE,
                gates=gates,
                serving=serving,
                ray_cluster=cluster,
                mlflow_server=MLflowServer(tracking_uri=stack.mlflow_uri),
            )
            assert result.outcome == "first_rollout", result
            with requests.Session() as session:
                yield {
                    "url": f"http://127.0.0.1:{cluster.serve_port}/{ROUTE}",
                    "session": session,
                    "app": serve_control.version_app_name(name, "1"),
                }
        finally:
            serve_control.release()  # no handle may outlive this driver's Ray connection
            serve_control.delete_route(ROUTE, name)


def post(route, body: bytes = VALID, content_type: str = JSON_TYPE, **headers):
    headers = {"content-type": content_type, **headers} if content_type != "missing" else headers
    return route["session"].post(route["url"], data=body, headers=headers, timeout=30)


def assert_serving(route) -> None:
    """A valid request right after is answered by the live version."""
    answer = post(route)
    assert answer.status_code == 200, answer.text
    assert answer.json()["action"] in (0, 1) and answer.headers[VERSION_HEADER] == "1"


@LIVE_FUZZ
@given(request=policy_requests())
def test_the_policy_route_never_answers_5xx_to_bad_input(route, request):
    method, content_type, body = request
    headers = {} if content_type == "missing" else {"content-type": content_type}
    response = route["session"].request(
        method, route["url"], data=body, headers=headers, timeout=30
    )
    event(f"status {response.status_code}")
    assert_contract(response.status_code, response.content, response.headers)
    assert response.headers[REQUEST_ID_HEADER]
    assert_serving(route)


def test_every_hostile_body_through_the_router_is_a_4xx(route):
    """Each of the fuzz's hostile bodies once, whatever Hypothesis happens to draw."""
    for body in NASTY:
        response = post(route, body)
        assert_contract(response.status_code, response.content, response.headers)
        assert response.status_code >= 400, (body[:40], response.status_code)
    assert_serving(route)


def test_a_policy_request_asking_for_a_stream_is_answered_whole(route):
    """Only LLM versions stream: `"stream": true` to a policy is an ordinary request (it was a
    502 once, the router asking the policy's app for a stream it does not have)."""
    answer = post(route, b'{"stream": true, "observation": [0.01, 0.02, 0.03, 0.04]}')
    assert answer.status_code == 200, answer.text
    assert answer.json()["action"] in (0, 1) and answer.headers[VERSION_HEADER] == "1"


@LIVE_FUZZ
@given(request=policy_requests())
def test_a_versions_own_app_never_answers_5xx_to_bad_input(route, request):
    """What the router sends a version's app (through its handle), fuzzed."""
    from prefect_ray_lifecycle.control import serve_control

    method, content_type, body = request
    headers = {} if content_type == "missing" else {"content-type": content_type}
    app = serve_control.handle(route["app"], POLICY_DEPLOYMENT)
    request_dict = {"method": method, "path": "/", "query": "", "headers": headers, "body": body}
    answer = app.handle_http.remote(request_dict).result(timeout_s=30)
    event(f"status {answer['status']}")
    assert_contract(answer["status"], answer["body"], answer["headers"])
    valid = dict(request_dict, method="POST", headers={"content-type": JSON_TYPE}, body=VALID)
    assert app.handle_http.remote(valid).result(timeout_s=30)["status"] == 200


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    method=METHODS | st.just("GET"),
    suffix=st.sampled_from(["/-/status", "/-/status/", "/-/STATUS", "/-/statusx", "/-/"])
    | st.sampled_from(["/-/status?", "/-/status/?"]).flatmap(
        lambda path: STATUS_QUERIES.map(lambda query: path + query)
    ),
    body=st.binary(max_size=100) | st.just(VALID),
)
def test_the_router_status_never_answers_5xx(route, method, suffix, body):
    """`-/status` answers 200 with the figures of the window asked for, a 400 JSON for a bad
    window_s (not a whole number of seconds in [1, 900], or given twice), never a 5xx."""
    response = route["session"].request(
        method, route["url"] + suffix, data=body, headers={"content-type": JSON_TYPE}, timeout=30
    )
    event(f"{method} {response.status_code}")
    status = assert_contract(response.status_code, response.content, response.headers)
    if method == "GET" and suffix.split("?")[0].rstrip("/") == "/-/status":
        window = status_window_of(response.request.url)  # the query as it was sent
        event(f"GET -/status, window_s {'refused' if window is None else 'taken'}")
        if window is None:
            assert response.status_code == 400 and "window_s" in status["error"], status
        else:
            assert response.status_code == 200 and status["config"]["live"]["version"] == "1"
            assert status["figures"]["window_s"] == window and "error" not in status["figures"]
            assert isinstance(status["figures"]["versions"], dict)
    assert_serving(route)


@LIVE_FUZZ
@given(query=STATUS_QUERIES)
@example(query="window_s=0")
@example(query="window_s=901")
@example(query="window_s=-5")
@example(query="window_s=1.5")
@example(query="window_s=1e3")
@example(query="window_s=")
@example(query="window_s=%D9%A3")  # an Arabic-Indic 3: a digit, but not ASCII
@example(query="window_s=" + "9" * 60)
@example(query="window_s=5&window_s=6")
@example(query="window_s=1")
@example(query="window_s=900")
@example(query="other=1")
def test_the_router_status_window_is_whole_seconds_or_a_json_400(route, query):
    """`GET -/status?window_s=N`: the figures of the last N seconds for whole seconds in
    [1, 900] (300 without it), a JSON 400 naming window_s for anything else."""
    response = route["session"].get(f"{route['url']}/-/status?{query}", timeout=30)
    window = status_window_of(response.request.url)  # the query as it was sent
    event(f"window_s {'refused' if window is None else 'taken'}: {response.status_code}")
    status = assert_contract(response.status_code, response.content, response.headers)
    if window is None:
        assert response.status_code == 400 and "window_s" in status["error"], status
    else:
        assert response.status_code == 200, status
        figures = status["figures"]
        assert figures["window_s"] == window and "error" not in figures, figures
        assert set(figures) == {"window_s", "versions", "testers", "shadow"}, figures
    assert_serving(route)


def test_request_ids_and_a_wrong_content_type_through_the_router(route):
    refused = post(route, VALID, "text/plain", **{REQUEST_ID_HEADER: "req-7"})
    assert refused.status_code == 415 and "content type 'text/plain'" in refused.json()["error"]
    assert refused.headers[VERSION_HEADER] == "1"
    answered = post(route)
    assert answered.status_code == 200
    # Exactly one request id on each answer: the caller's, or a new one.
    assert refused.headers[REQUEST_ID_HEADER] == "req-7"
    assert len(answered.headers[REQUEST_ID_HEADER]) >= 16
    assert "," not in answered.headers[REQUEST_ID_HEADER]


def router_replicas() -> set[str]:
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.workloads.constants import ROUTER_DEPLOYMENT

    app = serve_control.details()["applications"][serve_control.router_app_name(ROUTE)]
    return {r["replica_id"] for r in app["deployments"][ROUTER_DEPLOYMENT]["replicas"]}


def test_a_blocks_own_malloc_arena_setting_wins_over_the_routers_default():
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig

    def router_env(runtime_env: dict) -> dict:
        return serve_control.router_app_config("r", RouterConfig(), runtime_env)["runtime_env"]

    assert router_env({"py_modules": ["p"]}) == {
        "py_modules": ["p"],
        "env_vars": {"MALLOC_ARENA_MAX": "2"},
    }
    mine = {"py_modules": ["p"], "env_vars": {"MALLOC_ARENA_MAX": "8", "A": "1"}}
    assert router_env(mine) == mine


def test_the_routers_replicas_run_with_two_malloc_arenas_and_the_version_apps_as_set(route):
    """The router lives across every rollout: its process (each replica's, read from /proc)
    runs with MALLOC_ARENA_MAX=2, which the soak's memory growth came down by; the version's
    own app, replaced at each rollout, keeps glibc's default."""
    from deployments.processes import environ
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.workloads.constants import POLICY_DEPLOYMENT, ROUTER_DEPLOYMENT

    def environs(app: str, deployment: str) -> list[dict[str, str]]:
        replicas = serve_control.details()["applications"][app]["deployments"][deployment]
        return [environ(replica["pid"]) for replica in replicas["replicas"]]

    routers = environs(serve_control.router_app_name(ROUTE), ROUTER_DEPLOYMENT)
    assert routers and all(env.get("MALLOC_ARENA_MAX") == "2" for env in routers)
    (version,) = environs(route["app"], POLICY_DEPLOYMENT)
    assert "MALLOC_ARENA_MAX" not in version


def apply_user_config(app: str, deployment: str, user_config: dict) -> None:
    from prefect_ray_lifecycle.control import serve_control

    config = serve_control.app_configs()[app]
    serve_control.apply({app: serve_control.with_user_config(config, deployment, user_config)})


def wait_for(check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)
    return found


def test_config_changes_reconfigure_the_router_in_place_and_a_slow_version_is_a_504(route):
    """A bad config leaves the router on its last good one; a good one applies without a
    replica restart; a live version slower than the router's timeout is a JSON 504."""
    from dataclasses import replace

    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.workloads.constants import ROUTER_DEPLOYMENT

    router_app = serve_control.router_app_name(ROUTE)
    good = serve_control.current_router(ROUTE)
    replicas = router_replicas()

    def status() -> dict:
        return serve_control.router_status(ROUTE, samples=1)[0]

    apply_user_config(router_app, ROUTER_DEPLOYMENT, {**good.as_dict(), "candidate_weight": 7})
    refused = wait_for(lambda: (s := status())["rejected_config"] and s)
    assert "candidate_weight" in refused["rejected_config"]
    assert refused["config"]["generation"] == good.generation
    assert_serving(route)

    try:
        apply_user_config(route["app"], POLICY_DEPLOYMENT, {"faults": {"latency_ms": 5000}})
        slow = replace(good, inline_live=False, timeout_s=1.0, generation=good.generation + 1)
        apply_user_config(router_app, ROUTER_DEPLOYMENT, slow.as_dict())
        settled = serve_control.wait_router(ROUTE, slow.generation)
        assert settled["rejected_config"] is None and settled["inline_version"] is None
        answer = post(route, **{REQUEST_ID_HEADER: "slow-1"})
        assert answer.status_code == 504, answer.text
        # The router's own timeout (its message), not the 5 s latency drill's answer.
        assert "did not answer within 1 s" in answer.json()["error"]
        assert router_replicas() == replicas  # reconfigured in place, never restarted
        assert answer.headers[REQUEST_ID_HEADER] == "slow-1"  # exactly one, the caller's
    finally:
        apply_user_config(route["app"], POLICY_DEPLOYMENT, {"faults": {}})
        restored = replace(good, generation=good.generation + 2)
        apply_user_config(router_app, ROUTER_DEPLOYMENT, restored.as_dict())
        serve_control.wait_router(ROUTE, restored.generation)
    assert_serving(route)


def test_status_answers_while_the_route_state_is_stuck_and_no_figure_is_lost(stack, route):
    """The route's state actor (figures and lease) stopped with SIGSTOP, as a stuck process
    is: `-/status` still answers 200 with the router's config and `figures.error` instead of
    figures, users are still served, and once the actor runs again the figures count the
    answers given meanwhile (each replica keeps them until the actor takes them)."""
    import math
    import os
    import signal

    from deployments.worker_node import alive_actors
    from prefect_ray_lifecycle.workloads.serve.route_state import route_state_name

    def figures(window_s: int) -> dict:
        answer = route["session"].get(f"{route['url']}/-/status?window_s={window_s}", timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()

    (actor,) = [
        a
        for a in alive_actors(stack.ray_dashboard_url, stack.ray_token, "RouteState")
        if a["name"] == route_state_name(ROUTE)
    ]
    stopped_at = time.time()
    os.kill(actor["pid"], signal.SIGSTOP)
    try:
        for _ in range(3):
            assert_serving(route)
        stuck = figures(60)
        assert stuck["config"]["live"]["version"] == "1" and stuck["serving"] == "as configured"
        assert stuck["figures"]["versions"] == {}
        assert stuck["figures"]["error"].startswith("route state unreachable"), stuck["figures"]
    finally:
        os.kill(actor["pid"], signal.SIGCONT)

    def counted() -> dict | None:
        now = figures(math.ceil(time.time() - stopped_at) + 1)["figures"]
        return now if now["versions"].get("1", {}).get("requests", 0) >= 3 else None

    assert "error" not in wait_for(counted)
