"""The router's calls to a version: a request through its app's DeploymentHandle, a stream
from its hosted engine or its app, and cancelling a call no longer wanted. Every failure
becomes a JSON 502 or 504 that names the version; none raises."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from prefect_ray_lifecycle.workloads.http import json_response
from prefect_ray_lifecycle.workloads.serve.hosted import Hosted
from prefect_ray_lifecycle.workloads.serve.router_config import Target

__all__ = ["cancel", "forward", "open_stream"]

logger = logging.getLogger("ray.serve")


async def open_stream(
    hosted: Hosted | None,
    handle: Callable[[Target], Any],
    target: Target,
    req: dict[str, Any],
    timeout_s: float,
):
    """(stream, head) once the first item came and is not a 5xx; else a JSON answer. The
    stream is `hosted`'s when the router hosts the version, else its app's."""
    stream = None
    try:
        if hosted is not None:
            stream = hosted.stream(req)
        else:
            stream = handle(target).options(stream=True).handle_http_stream.remote(req)
        head = await asyncio.wait_for(stream.__anext__(), timeout_s)
    except Exception as error:
        if stream is not None:
            await cancel(stream)
        if isinstance(error, TimeoutError):
            reason, status = f"no first chunk within {timeout_s:g} s", 504
        else:
            reason, status = f"{type(error).__name__}: {str(error)[-300:]}", 502
        return json_response(status, {"error": f"v{target.version}: {reason}"})
    if head.get("status", 200) >= 500:
        await cancel(stream)
        return json_response(502, {"error": f"v{target.version} answered {head['status']}"})
    return stream, head


async def forward(
    handle: Callable[[Target], Any], target: Target, req: dict[str, Any], timeout_s: float
):
    """The version app's answer to one request, or a JSON 502/504 within `timeout_s`."""
    try:
        response = handle(target).handle_http.remote(req)
    except Exception as error:
        return json_response(
            502,
            {
                "error": f"v{target.version} ({target.app}) is not "
                f"reachable: {type(error).__name__}: {error}"
            },
        )

    async def result():
        return await response

    try:
        return await asyncio.wait_for(result(), timeout_s)
    except TimeoutError:
        await cancel(response)
        return json_response(
            504,
            {"error": f"v{target.version} did not answer within {timeout_s:g} s"},
        )
    except Exception as error:
        message = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        return json_response(
            502,
            {"error": f"v{target.version} failed: {type(error).__name__}: {message[:300]}"},
        )


async def cancel(call: Any) -> None:
    """Cancel a handle call (or close a hosted stream) that is no longer wanted; one whose
    replica died may refuse."""
    try:
        if hasattr(call, "aclose"):
            await call.aclose()
        else:
            call.cancel()
    except Exception:  # nothing to cancel: the answer is already decided
        logger.debug("could not cancel a call", exc_info=True)
