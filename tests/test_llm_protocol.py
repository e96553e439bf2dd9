"""The LLM app's OpenAI surface without vLLM, Ray or services: request validation into a prompt
and sampling parameters, the OpenAI-style 400s, SSE framing and the answer shapes."""

from __future__ import annotations

import json

import pytest

from prefect_ray_lifecycle.workloads.http import BadRequest
from prefect_ray_lifecycle.workloads.llm.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    SSE_DONE,
    AnswerFormat,
    CompletionRequest,
    bad_request_body,
    endpoint,
    error_body,
    generation_budget,
    models_body,
    openai_request_id,
    parse_json_body,
    sse,
    usage,
)

MODEL = "tiny-llm"
VOCAB = 1024
MAX_MODEL_LEN = 128


def completion(body: dict) -> CompletionRequest:
    return CompletionRequest.from_body(body, chat=False, model_name=MODEL, vocab_size=VOCAB)


def chat(body: dict) -> CompletionRequest:
    return CompletionRequest.from_body(body, chat=True, model_name=MODEL, vocab_size=VOCAB)


def refusal(call, *args, **kwargs) -> dict:
    """The OpenAI error object of the 400 that `call` raises, checked to be well formed."""
    with pytest.raises(BadRequest) as caught:
        call(*args, **kwargs)
    body = bad_request_body(caught.value)
    (error,) = body.values()
    assert set(body) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert error["message"] == caught.value.message and error["param"] == caught.value.param
    assert caught.value.status == 400
    return error


def test_a_completion_request_gives_its_prompt_and_sampling_parameters():
    request = completion(
        {
            "model": MODEL,
            "prompt": "ray serve canary",
            "max_tokens": 8,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "seed": 7,
            "stop": "\n",
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "min_tokens": 2,
            "ignore_eos": True,
        }
    )
    assert request.prompt == "ray serve canary" and request.turns is None
    assert not request.chat and not request.stream and not request.include_usage
    assert request.sampling.engine_kwargs(8) == {
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "stop": ["\n"],
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "min_tokens": 2,
        "ignore_eos": True,
    }


def test_completion_defaults_follow_openai():
    request = completion({"prompt": "ray"})
    assert request.sampling.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS == 16
    kwargs = request.sampling.engine_kwargs(16)
    assert kwargs["temperature"] == 1.0 and kwargs["top_p"] == 1.0 and kwargs["top_k"] == 0
    assert kwargs["stop"] is None and kwargs["seed"] is None and kwargs["min_tokens"] == 0
    # min_tokens never asks for more than the generation may have.
    capped = completion({"prompt": "ray", "min_tokens": 50}).sampling.engine_kwargs(4)
    assert capped["min_tokens"] == 4


def test_a_completion_prompt_may_be_token_ids_or_a_batch_of_one():
    assert completion({"prompt": [3, 4, 5]}).prompt == [3, 4, 5]
    assert completion({"prompt": ["ray"]}).prompt == "ray"
    assert completion({"prompt": [[3, 4]]}).prompt == [3, 4]


def test_a_chat_request_gives_its_turns_and_sampling_parameters():
    request = chat(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "which "}, {"type": "text", "text": "?"}],
                },
            ],
            "max_completion_tokens": 6,
            "max_tokens": 99,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert request.chat and request.prompt is None
    assert request.turns == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "which ?"},
    ]
    assert request.stream and request.include_usage
    assert request.sampling.max_tokens == 6 and request.sampling.temperature == 0
    # Chat takes max_tokens when max_completion_tokens is absent, else the rest of the context.
    assert (
        chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}).sampling.max_tokens
        == 5
    )
    assert chat({"messages": [{"role": "user", "content": "x"}]}).sampling.max_tokens is None


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({}, "prompt", "missing_required_parameter"),
        ({"prompt": ""}, "prompt", "missing_required_parameter"),
        ({"prompt": []}, "prompt", "missing_required_parameter"),
        ({"prompt": 42}, "prompt", "invalid_type"),
        ({"prompt": ["a", "b"]}, "prompt", "invalid_type"),
        ({"prompt": [1, True]}, "prompt", "invalid_type"),
        ({"prompt": [1, VOCAB]}, "prompt", "invalid_value"),
        ({"prompt": [-1]}, "prompt", "invalid_value"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "invalid_type"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "invalid_type"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "invalid_type"),
        ({"prompt": "x", "temperature": 2.5}, "temperature", "invalid_value"),
        ({"prompt": "x", "temperature": -0.1}, "temperature", "invalid_value"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "invalid_type"),
        ({"prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
        ({"prompt": "x", "top_p": 1.5}, "top_p", "invalid_value"),
        ({"prompt": "x", "top_k": -2}, "top_k", "invalid_value"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "invalid_value"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "invalid_value"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens", "invalid_value"),
        ({"prompt": "x", "seed": 1.5}, "seed", "invalid_type"),
        ({"prompt": "x", "n": 2}, "n", "unsupported"),
        ({"prompt": "x", "n": 0}, "n", "invalid_value"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"prompt": "x", "stop": [""]}, "stop", "invalid_value"),
        ({"prompt": "x", "stop": 3}, "stop", "invalid_value"),
        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
        ({"prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
        ({"prompt": "x", "stream": True, "stream_options": [1]}, "stream_options", "invalid_type"),
    ],
)
def test_bad_completion_requests_get_openai_style_400s(body, param, code):
    error = refusal(completion, body)
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code)


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({}, "messages", "missing_required_parameter"),
        ({"messages": []}, "messages", "missing_required_parameter"),
        ({"messages": "hi"}, "messages", "missing_required_parameter"),
        ({"messages": ["hi"]}, "messages[0]", "invalid_type"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "invalid_type"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [{}]}]},
            "messages[1].content",
            "unsupported",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
            "invalid_value",
        ),
    ],
)
def test_bad_chat_requests_get_openai_style_400s(body, param, code):
    error = refusal(chat, body)
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code)


def test_another_model_name_is_a_404():
    with pytest.raises(BadRequest) as caught:
        completion({"model": "gpt-4", "prompt": "x"})
    assert caught.value.status == 404
    error = bad_request_body(caught.value)["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert error["type"] == "invalid_request_error"


def test_the_generation_budget_fits_the_context():
    assert generation_budget(10, MAX_MODEL_LEN, None, chat=False) == MAX_MODEL_LEN - 10
    assert generation_budget(10, MAX_MODEL_LEN, 8, chat=True) == 8
    assert generation_budget(10, MAX_MODEL_LEN, MAX_MODEL_LEN - 10, chat=False) == 118

    too_long = refusal(generation_budget, MAX_MODEL_LEN, MAX_MODEL_LEN, 4, chat=False)
    assert (too_long["param"], too_long["code"]) == ("prompt", "context_length_exceeded")
    too_long = refusal(generation_budget, MAX_MODEL_LEN + 5, MAX_MODEL_LEN, None, chat=True)
    assert (too_long["param"], too_long["code"]) == ("messages", "context_length_exceeded")
    too_many = refusal(generation_budget, 3, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, chat=False)
    assert (too_many["param"], too_many["code"]) == ("max_tokens", "context_length_exceeded")
    assert f"{MAX_MODEL_LEN + 1} > {MAX_MODEL_LEN} - 3" in too_many["message"]


def test_routes_and_methods():
    assert endpoint("POST", "/v1/completions") == "completions"
    assert endpoint("post", "v1/chat/completions/") == "chat"
    assert endpoint("GET", "/v1/models") == "models"
    assert endpoint("GET", "/health") == "health"
    with pytest.raises(BadRequest) as caught:
        endpoint("POST", "/v1/embeddings")
    assert caught.value.status == 404
    assert bad_request_body(caught.value)["error"]["code"] == "not_found"
    with pytest.raises(BadRequest) as caught:
        endpoint("GET", "/v1/completions")
    assert caught.value.status == 405
    assert bad_request_body(caught.value)["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("body", [b"", b'{"messages": [', b"\xff", b"[1, 2]", b'"text"'])
def test_a_body_that_is_not_a_json_object_is_a_400(body):
    error = refusal(parse_json_body, body)
    assert (error["param"], error["code"]) == (None, "invalid_json")


def test_parse_json_body_returns_the_object():
    assert parse_json_body(b'{"prompt": "x"}') == {"prompt": "x"}


def test_the_request_id_is_echoed_only_when_safe():
    assert openai_request_id({"x-request-id": "req-42:a.b_c"}) == "req-42:a.b_c"
    for unsafe in ("", "has space", "x" * 129, "semi;colon"):
        made = openai_request_id({"x-request-id": unsafe})
        assert made != unsafe and len(made) == 32
    assert len(openai_request_id({})) == 32


def test_server_errors_are_typed_as_such():
    assert error_body(503, "engine is down") == {
        "error": {"message": "engine is down", "type": "server_error", "param": None, "code": None}
    }
    assert error_body(500, "boom", code="engine_error")["error"]["code"] == "engine_error"


def test_sse_framing():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse(b"[DONE]") == SSE_DONE == b"data: [DONE]\n\n"


def test_a_chat_stream_opens_with_the_role_and_ends_with_usage():
    shape = AnswerFormat.for_request(
        "req-1", chat=True, model=MODEL, version="v7", include_usage=True
    )
    opening = shape.chunk("", None, role=True)
    assert opening["id"] == "chatcmpl-req-1" and opening["object"] == "chat.completion.chunk"
    assert opening["model"] == MODEL and opening["system_fingerprint"] == "v7"
    assert opening["choices"] == [
        {
            "index": 0,
            "finish_reason": None,
            "logprobs": None,
            "delta": {"role": "assistant", "content": ""},
        }
    ]
    assert opening["usage"] is None
    last = shape.chunk("ok", "length")
    assert last["choices"][0]["delta"] == {"content": "ok"}
    assert last["choices"][0]["finish_reason"] == "length"

    final = shape.usage_chunk(usage(12, 5))
    assert final["choices"] == [] and final["object"] == "chat.completion.chunk"
    assert final["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    event = sse(final)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: ") : -2]) == final


def test_a_completion_stream_sends_text_chunks_without_usage_unless_asked():
    shape = AnswerFormat.for_request(
        "req-2", chat=False, model=MODEL, version="v7", include_usage=False
    )
    chunk = shape.chunk("ray", None)
    assert chunk["id"] == "cmpl-req-2" and chunk["object"] == "text_completion"
    assert chunk["choices"] == [
        {"index": 0, "finish_reason": None, "logprobs": None, "text": "ray"}
    ]
    assert "usage" not in chunk
    assert shape.chunk(None, "stop")["choices"][0]["text"] == ""


def test_whole_answers_have_openai_shape():
    shape = AnswerFormat.for_request(
        "req-3", chat=False, model=MODEL, version="v7", include_usage=False
    )
    answer = shape.whole("ray serve", "length", usage(3, 2))
    assert answer["object"] == "text_completion" and answer["id"] == "cmpl-req-3"
    assert isinstance(answer["created"], int)
    assert answer["choices"] == [
        {"index": 0, "finish_reason": "length", "logprobs": None, "text": "ray serve"}
    ]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}

    shape = AnswerFormat.for_request(
        "req-4", chat=True, model=MODEL, version="v7", include_usage=True
    )
    answer = shape.whole("hi", "stop", usage(9, 1))
    assert answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-req-4"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert "usage" in answer and "text" not in answer["choices"][0]


def test_the_models_list_names_the_one_model():
    body = models_body(MODEL, MAX_MODEL_LEN, "v7")
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == MODEL and model["max_model_len"] == MAX_MODEL_LEN
    assert model["version"] == "v7" and model["object"] == "model"
