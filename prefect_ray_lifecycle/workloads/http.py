"""The HTTP contract shared by every Serve app of the project: requests passed between
deployments as plain dicts, JSON answers, the request id, and the one error type for a
request that is answered with a 4xx."""

from __future__ import annotations

import json
from typing import Any

from prefect_ray_lifecycle.workloads.constants import REQUEST_ID_HEADER, VERSION_HEADER

__all__ = [
    "JSON_TYPE",
    "MAX_BODY_BYTES",
    "RAW_TYPE",
    "BadRequest",
    "describe",
    "json_response",
    "parse_json",
    "peek_field",
    "request_dict",
    "tagged_headers",
    "to_response",
]

MAX_BODY_BYTES = 1 << 20
JSON_TYPE = "application/json"
RAW_TYPE = "application/octet-stream"


class BadRequest(Exception):
    """A request that cannot be acted on: answered with `status` (a 4xx) and `message`,
    never a 500. `param` names the offending field where there is one; `code` is a
    machine-readable reason (OpenAI-style answers carry it)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def parse_json(body: bytes, max_bytes: int | None = None) -> Any:
    """The JSON value of a request body: a 413 over `max_bytes`, a 400 naming the problem
    for anything that is not strict JSON (NaN and Infinity included) or nests too deeply."""
    if max_bytes is not None and len(body) > max_bytes:
        raise BadRequest(413, f"body of {len(body)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise BadRequest(400, "body is not usable JSON: it nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(400, f"body is not valid JSON: {error}") from None


def peek_field(body: bytes, name: str) -> Any:
    """A JSON object body's field `name`, read by the router before the version answers the
    request; None when it is not there, or the body is not a JSON object (the version then
    answers with its own 4xx). The body is parsed only when it names the field."""
    if f'"{name}"'.encode() not in body:
        return None
    try:
        payload = parse_json(body)
    except BadRequest:
        return None
    return payload.get(name) if isinstance(payload, dict) else None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def describe(value: Any, limit: int = 80) -> str:
    """A client's value for an error message: its JSON, cut to `limit` characters."""
    try:
        text = json.dumps(value, default=repr)
    except (RecursionError, ValueError):
        return f"a deeply nested {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "status": status,
        "headers": {"content-type": JSON_TYPE, **(headers or {})},
        "body": json.dumps(body).encode(),
    }


async def request_dict(request: Any, max_body_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """A Starlette request as the plain dict deployments pass to each other. A body over
    the limit is cut at limit + 1 bytes, so the answer is a 413 without reading it all."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_body_bytes:
        body = b"\0" * (max_body_bytes + 1)
    else:
        chunks = []
        size = 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > max_body_bytes:
                break
        body = b"".join(chunks)
    return {
        "method": request.method,
        "path": request.url.path,
        "query": request.url.query,
        "headers": dict(request.headers),
        "body": body,
    }


def to_response(answer: dict[str, Any]) -> Any:
    from starlette.responses import Response

    return Response(content=answer["body"], status_code=answer["status"], headers=answer["headers"])


def tagged_headers(
    headers: dict[str, str], version: str, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """An upstream answer's headers as a route answers them: exactly one X-Model-Version
    (and `extra`), whatever case the upstream used, and no X-Request-Id of its own: Serve's
    proxy answers with the request's id (the client's, or one it made)."""
    ours = {VERSION_HEADER: version, **(extra or {})}
    dropped = {k.lower() for k in ours} | {REQUEST_ID_HEADER.lower()}
    kept = {k: v for k, v in headers.items() if k.lower() not in dropped}
    return {**kept, **ours}
