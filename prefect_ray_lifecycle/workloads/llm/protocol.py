"""The OpenAI surface of the LLM app, pure: routes, request validation into a prompt and
sampling fields, and the shape of answers, SSE chunks and error bodies. No vLLM and no Ray,
so it is tested without the LLM venv."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect_ray_lifecycle.workloads.constants import REQUEST_ID_HEADER
from prefect_ray_lifecycle.workloads.http import MAX_BODY_BYTES, BadRequest, describe, parse_json

__all__ = [
    "CHAT_ROLES",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "EVENT_STREAM_TYPE",
    "SSE_DONE",
    "AnswerFormat",
    "CompletionRequest",
    "Sampling",
    "bad_request_body",
    "compact_json",
    "endpoint",
    "error_body",
    "generation_budget",
    "invalid",
    "models_body",
    "openai_request_id",
    "parse_json_body",
    "sse",
    "usage",
]

# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
OWNED_BY = "prefect-ray-lifecycle"
EVENT_STREAM_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"
# A caller's request id is echoed only when it is this tame; otherwise a new one is made.
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

Endpoint = Literal["models", "health", "chat", "completions"]


def invalid(
    message: str, *, param: str | None = None, code: str | None = None, status: int = 400
) -> BadRequest:
    """A client error carrying OpenAI's error `code` for its body."""
    return BadRequest(status, message, param, code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: a 5xx is a server_error, anything else an invalid request."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request_body(error: BadRequest) -> dict[str, Any]:
    return error_body(error.status, error.message, error.param, error.code)


def compact_json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def sse(data: Any) -> bytes:
    """One server-sent event: `data` (JSON, or bytes as they are) and a blank line."""
    return b"data: " + (data if isinstance(data, bytes) else compact_json(data)) + b"\n\n"


def openai_request_id(headers: dict[str, str]) -> str:
    """The caller's X-Request-Id (`headers` lower-cased) when it is safe to echo, else new."""
    given = headers.get(REQUEST_ID_HEADER.lower(), "")
    return given if _SAFE_REQUEST_ID.match(given) else uuid.uuid4().hex


def endpoint(method: str, path: str) -> Endpoint:
    """Which endpoint `path` names: a 404 for none, a 405 for a completion that is not a POST."""
    path = "/" + path.strip("/")
    if path.endswith("/models"):
        return "models"
    if path.endswith("/health"):
        return "health"
    if path.endswith("/chat/completions"):
        kind: Endpoint = "chat"
    elif path.endswith("/completions"):
        kind = "completions"
    else:
        raise invalid(
            f"no route {path!r}: use /v1/completions or /v1/chat/completions",
            status=404,
            code="not_found",
        )
    if method.upper() != "POST":
        raise invalid(f"{path} takes POST, not {method}", status=405, code="method_not_allowed")
    return kind


def parse_json_body(body: bytes) -> dict[str, Any]:
    try:
        payload = parse_json(body or b"", MAX_BODY_BYTES)
    except BadRequest as exc:
        code = "request_too_large" if exc.status == 413 else "invalid_json"
        raise invalid(exc.message, code=code, status=exc.status) from None
    if not isinstance(payload, dict):
        raise invalid(
            f"the body must be a JSON object, got {type(payload).__name__}", code="invalid_json"
        )
    return payload


def _wrong_type(name: str, expected: str, value: Any) -> BadRequest:
    return invalid(
        f"'{name}' must be {expected}, got {describe(value)}", param=name, code="invalid_type"
    )


def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _wrong_type(name, "an integer" if integer else "a number", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise invalid(
            f"'{name}' must be between {lo} and {hi}, got {describe(value)}",
            param=name,
            code="invalid_value",
        )
    return value


@dataclass
class Sampling:
    """The sampling fields of a request, validated; max_tokens None: the rest of the context."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False

    @classmethod
    def from_body(
        cls, body: dict, default_max_tokens: int | None, max_tokens_field: str = "max_tokens"
    ) -> Sampling:
        n = _number(body, "n", 1, lo=1, integer=True)
        if n != 1:
            raise invalid(f"'n' must be 1 here, got {n}", param="n", code="unsupported")
        max_tokens = _number(body, max_tokens_field, None, lo=1, integer=True)
        if max_tokens is None and max_tokens_field != "max_tokens":
            max_tokens = _number(body, "max_tokens", None, lo=1, integer=True)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (
            isinstance(stop, list)
            and len(stop) <= MAX_STOP_SEQUENCES
            and all(isinstance(s, str) and s for s in stop)
        ):
            raise invalid(
                f"'stop' must be a string or up to {MAX_STOP_SEQUENCES} strings, "
                f"got {describe(stop)}",
                param="stop",
                code="invalid_value",
            )
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise _wrong_type("ignore_eos", "a boolean", ignore_eos)
        return cls(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=_number(body, "temperature", 1.0, lo=0, hi=2),
            top_p=_number(body, "top_p", 1.0, lo=1e-6, hi=1),
            top_k=_number(body, "top_k", 0, lo=-1, integer=True),
            seed=_number(body, "seed", None, lo=-(2**63), hi=2**63 - 1, integer=True),
            stop=stop,
            presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2, hi=2),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2, hi=2),
            min_tokens=_number(body, "min_tokens", 0, lo=0, integer=True),
            ignore_eos=ignore_eos,
        )

    def engine_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """vLLM SamplingParams arguments for a generation of at most `max_tokens`."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop or None,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "min_tokens": min(self.min_tokens, max_tokens),
            "ignore_eos": self.ignore_eos,
        }


def _message_text(message: Any, index: int) -> dict[str, str]:
    if not isinstance(message, dict):
        raise invalid(
            f"messages[{index}] must be an object, got {describe(message)}",
            param=f"messages[{index}]",
            code="invalid_type",
        )
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid(
            f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}; got {describe(role)}",
            param=f"messages[{index}].role",
            code="invalid_value",
        )
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise invalid(
                    f"messages[{index}].content parts must be text parts, got {describe(part)}",
                    param=f"messages[{index}].content",
                    code="unsupported",
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise invalid(
            f"messages[{index}].content must be a string or text parts, got {describe(content)}",
            param=f"messages[{index}].content",
            code="invalid_type",
        )
    return {"role": role, "content": content}


def _chat_turns(payload: dict) -> list[dict[str, str]]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid(
            "'messages' is required: a non-empty list of {role, content}",
            param="messages",
            code="missing_required_parameter",
        )
    return [_message_text(m, i) for i, m in enumerate(messages)]


def _completion_prompt(payload: dict, vocab_size: int) -> str | list[int]:
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise invalid(
                f"'prompt' token ids must lie in [0, {vocab_size})",
                param="prompt",
                code="invalid_value",
            )
        return prompt
    if prompt is None or prompt == "" or prompt == []:
        raise invalid(
            "'prompt' is required: a non-empty string or token ids",
            param="prompt",
            code="missing_required_parameter",
        )
    raise invalid(
        f"'prompt' must be one string or one list of token ids (no batches "
        f"here), got {type(prompt).__name__}",
        param="prompt",
        code="invalid_type",
    )


@dataclass
class CompletionRequest:
    """A validated completion or chat completion body, before tokenization: `prompt` (text or
    token ids) for /v1/completions, `turns` for /v1/chat/completions."""

    chat: bool
    stream: bool
    include_usage: bool
    sampling: Sampling
    prompt: str | list[int] | None = None
    turns: list[dict[str, str]] | None = None

    @classmethod
    def from_body(
        cls, payload: dict, *, chat: bool, model_name: str, vocab_size: int
    ) -> CompletionRequest:
        model = payload.get("model")
        if model is not None and model != model_name:
            raise invalid(
                f"the model {describe(model)} does not exist here; this app serves {model_name!r}",
                param="model",
                code="model_not_found",
                status=404,
            )
        stream = payload.get("stream", False)
        if not isinstance(stream, bool):
            raise _wrong_type("stream", "a boolean", stream)
        stream_options = payload.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise _wrong_type("stream_options", "an object", stream_options)
        include_usage = bool(stream_options.get("include_usage"))
        sampling = Sampling.from_body(
            payload,
            None if chat else DEFAULT_COMPLETION_MAX_TOKENS,
            "max_completion_tokens" if chat else "max_tokens",
        )
        if chat:
            return cls(chat, stream, include_usage, sampling, turns=_chat_turns(payload))
        return cls(
            chat, stream, include_usage, sampling, prompt=_completion_prompt(payload, vocab_size)
        )


def generation_budget(
    prompt_tokens: int, max_model_len: int, max_tokens: int | None, *, chat: bool
) -> int:
    """Tokens to generate: `max_tokens`, or (None) the rest of the context. A 400 when the
    prompt leaves no room, or max_tokens does not fit beside it."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise invalid(
            f"the prompt is {prompt_tokens} tokens; this model's maximum context length "
            f"is {max_model_len} tokens, which leaves no room to generate",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    budget = max_tokens if max_tokens is not None else room
    if budget > room:
        raise invalid(
            f"'max_tokens' is too large: {budget}. This model's maximum context length "
            f"is {max_model_len} tokens and your request has {prompt_tokens} input "
            f"tokens ({budget} > {max_model_len} - {prompt_tokens})",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return budget


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def models_body(model_name: str, max_model_len: int, version: str) -> dict[str, Any]:
    """The /v1/models list: the one model this app serves."""
    model = {
        "id": model_name,
        "object": "model",
        "owned_by": OWNED_BY,
        "max_model_len": max_model_len,
        "version": version,
    }
    return {"object": "list", "data": [model]}


@dataclass
class AnswerFormat:
    """The OpenAI JSON of one completion: the whole answer, or its stream chunks and usage."""

    id: str
    chat: bool
    model: str
    version: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def for_request(
        cls, request_id: str, *, chat: bool, model: str, version: str, include_usage: bool
    ) -> AnswerFormat:
        answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        return cls(answer_id, chat, model, version, include_usage)

    def envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.version,
        }

    def whole(self, text: str, finish_reason: str | None, counts: dict[str, int]) -> dict:
        """The non-streaming answer: one choice holding all of `text`, and `counts` as usage."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self.envelope(chunk=False), "choices": [choice], "usage": counts}

    def chunk(
        self, delta_text: str | None, finish_reason: str | None, role: bool = False
    ) -> dict[str, Any]:
        """One stream chunk; `role` opens a chat stream with the assistant's role."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta_text is not None:
                delta["content"] = delta_text
            choice["delta"] = delta
        else:
            choice["text"] = delta_text or ""
        chunk = {**self.envelope(chunk=True), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        """The last chunk of a stream with include_usage: no choices, the token counts."""
        return {**self.envelope(chunk=True), "choices": [], "usage": counts}
