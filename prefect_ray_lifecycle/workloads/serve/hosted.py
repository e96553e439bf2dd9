"""The live version hosted in the router's own replicas, so that steady-state requests pay no
hop to another Serve application: a policy (its PolicyCore) or an LLM (the LLMServer class
itself, its vLLM engine in the router's process, which then runs in the LLM venv).

Both answer the router's request dicts ({"method", "path", "query", "headers", "body"}) the
way their own app's `handle_http` does; an LLM also streams like `handle_http_stream`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from prefect_ray_lifecycle.workloads.serve.router_config import Target

__all__ = ["CLOSE_GRACE_S", "Hosted", "HostedLLM", "HostedPolicy", "host"]

logger = logging.getLogger("ray.serve")

CLOSE_GRACE_S = 600.0  # longest a replaced engine waits for its last streams to finish


class Hosted:
    """What the router needs of a hosted version."""

    version: str
    closed = False

    def alive(self) -> bool:
        return not self.closed

    async def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def stream(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        raise NotImplementedError(f"v{self.version} does not stream")

    async def stats(self, reset: bool = False) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        """Free what it holds once no request uses it any more (never blocks)."""
        self.closed = True


class HostedPolicy(Hosted):
    def __init__(self, target: Target, max_body_bytes: int):
        from prefect_ray_lifecycle.workloads.serve.policy import ModelSpec, PolicyCore

        self.core = PolicyCore(ModelSpec.parse(target.model), max_body_bytes=max_body_bytes)
        self.core.check()
        self.version = self.core.version

    async def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.core.answer(request)


class HostedLLM(Hosted):
    """An LLMServer built from the target's app args, outside Serve's deployment wrapper."""

    def __init__(self, target: Target):
        # Lazy: only an LLM route's router (in the LLM venv) ever builds an engine.
        from prefect_ray_lifecycle.workloads.llm.server import LLMServer

        self.server = LLMServer.func_or_class(target.model)
        self.version = self.server.version
        self.ongoing = 0

    def alive(self) -> bool:
        return self.server.engine.alive()

    async def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        self.ongoing += 1
        try:
            return await self.server.handle_http(request)
        finally:
            self.ongoing -= 1

    async def stream(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        self.ongoing += 1
        try:
            async for item in self.server.handle_http_stream(request):
                yield item
        finally:
            self.ongoing -= 1

    async def stats(self, reset: bool = False) -> dict[str, Any] | None:
        return await self.server.stats(reset)

    def close(self) -> None:
        """Stop the engine once its last request is done (streams started before a swap
        finish on it), in a thread of its own."""

        def stop() -> None:
            deadline = time.monotonic() + CLOSE_GRACE_S
            while self.ongoing > 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            self.server.engine.stop()
            logger.info("stopped the hosted engine of v%s", self.version)

        threading.Thread(target=stop, name=f"close-v{self.version}", daemon=True).start()


def host(target: Target, max_body_bytes: int) -> Hosted:
    """Load `target` here (slow: a model download, an engine start): run it in a thread."""
    if target.kind == "llm":
        return HostedLLM(target)
    return HostedPolicy(target, max_body_bytes)
