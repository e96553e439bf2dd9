"""The HTTP contract shared by every Serve app of the project: requests passed between
deployments as plain dicts, JSON answers, the request id, and the one error type for a
request that is answered with a 4xx."""

from __future__ import annotations

import json
import uuid
from typing import Any

from workloads.constants import REQUEST_ID_HEADER, VERSION_HEADER

__all__ = [
    "JSON_TYPE",
    "MAX_BODY_BYTES",
    "RAW_TYPE",
    "BadRequest",
    "json_response",
    "request_dict",
    "request_id",
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


def request_id(headers: dict[str, str]) -> str:
    """The caller's X-Request-Id (cut to 128 characters), else a new one."""
    given = headers.get(REQUEST_ID_HEADER.lower(), "")
    return given[:128] if given else uuid.uuid4().hex


def tagged_headers(
    headers: dict[str, str], version: str, request: str, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """`headers` with exactly one X-Model-Version and X-Request-Id (and `extra`), whatever
    case the upstream used."""
    ours = {VERSION_HEADER: version, REQUEST_ID_HEADER: request, **(extra or {})}
    lowered = {k.lower() for k in ours}
    kept = {k: v for k, v in headers.items() if k.lower() not in lowered}
    return {**kept, **ours}
