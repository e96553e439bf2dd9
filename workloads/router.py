"""The router: one Serve application on a stable route that never changes.

It sends each request to the live version or, during a canary, a weighted share to the
candidate. Both are separate Serve applications reached through DeploymentHandles, with a
per-request timeout (504) and a JSON 502 for upstream errors. Once a live version has passed
its gates the router loads it into its own replicas and answers live traffic in process, so
steady-state requests pay no extra hop; only the canary share crosses to another app.

Everything the router does is set by its user_config (`RouterConfig`), applied in place by
`reconfigure`, which never raises and is idempotent. Per-version request, error and latency
figures go to a `RouteStats` actor that the rollout flow reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray import serve

from workloads.constants import (
    LLM_DEPLOYMENT,
    POLICY_DEPLOYMENT,
    REQUEST_ID_HEADER,
    ROUTER_DEPLOYMENT,
    SERVE_NAMESPACE,
)
from workloads.figures import summarize
from workloads.http import (
    MAX_BODY_BYTES,
    json_response,
    request_dict,
    request_id,
    tagged_headers,
    to_response,
)
from workloads.serving import ModelSpec, PolicyCore

logger = logging.getLogger("ray.serve")

STATS_FLUSH_S = 0.25
LATENCY_SAMPLES = 2000  # per version per flush


TargetKind = Literal["policy", "llm"]
# The Serve deployment a target's app runs, by its kind.
DEPLOYMENTS: dict[str, str] = {"policy": POLICY_DEPLOYMENT, "llm": LLM_DEPLOYMENT}


@dataclass(frozen=True)
class Target:
    """A model version's Serve application (a policy or an LLM, by `kind`), and how to load
    it in process."""

    version: str
    app: str
    kind: TargetKind = "policy"
    model: dict[str, Any] | None = None  # ModelSpec fields; needed to host it in process

    def __post_init__(self):
        if self.kind not in DEPLOYMENTS:
            raise ValueError(
                f"a target's kind must be one of {sorted(DEPLOYMENTS)}, got {self.kind!r}"
            )

    @property
    def deployment(self) -> str:
        return DEPLOYMENTS[self.kind]

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> Target | None:
        if value is None:
            return None
        if not isinstance(value, dict) or not value.get("app") or not value.get("version"):
            raise ValueError(f"a target needs app and version, got {value!r}")
        model = value.get("model")
        if model is not None:
            ModelSpec.parse(model)
        kind = value.get("kind")
        if kind is None:  # a config written before targets had a kind names the deployment
            kind = "llm" if value.get("deployment") == LLM_DEPLOYMENT else "policy"
        return cls(str(value["version"]), str(value["app"]), kind, model)

    def as_dict(self) -> dict[str, Any]:
        # `deployment` too: routers still running the previous code read it.
        return {
            "version": self.version,
            "app": self.app,
            "kind": self.kind,
            "deployment": self.deployment,
            "model": self.model,
        }


@dataclass(frozen=True)
class RouterConfig:
    live: Target | None = None
    candidate: Target | None = None
    candidate_weight: float = 0.0
    inline_live: bool = False  # host the live version in the router's own replicas
    timeout_s: float = 10.0
    generation: int = 0

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> RouterConfig:
        value = dict(value or {})
        unknown = set(value) - {
            "live",
            "candidate",
            "candidate_weight",
            "inline_live",
            "timeout_s",
            "generation",
        }
        if unknown:
            raise ValueError(f"unknown router config fields {sorted(unknown)}")
        config = cls(
            Target.parse(value.get("live")),
            Target.parse(value.get("candidate")),
            float(value.get("candidate_weight", 0.0)),
            bool(value.get("inline_live", False)),
            float(value.get("timeout_s", 10.0)),
            int(value.get("generation", 0)),
        )
        if not 0.0 <= config.candidate_weight <= 1.0:
            raise ValueError(
                f"candidate_weight must be within [0, 1], got {config.candidate_weight}"
            )
        if config.candidate_weight and config.candidate is None:
            raise ValueError("candidate_weight is set but there is no candidate")
        if config.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {config.timeout_s}")
        live = config.live
        if config.inline_live and (live is None or live.kind != "policy" or live.model is None):
            raise ValueError("inline_live needs a live policy target with its model spec")
        return config

    def as_dict(self) -> dict[str, Any]:
        return {
            "live": self.live and self.live.as_dict(),
            "candidate": self.candidate and self.candidate.as_dict(),
            "candidate_weight": self.candidate_weight,
            "inline_live": self.inline_live,
            "timeout_s": self.timeout_s,
            "generation": self.generation,
        }


def stats_actor_name(route: str) -> str:
    return f"route-stats:{route}"


@ray.remote(num_cpus=0, max_restarts=-1)
class RouteStats:
    """Per-version request figures for one route, in time-stamped windows from every router
    replica. Kept for `keep_s` seconds."""

    def __init__(self, keep_s: float = 900.0):
        self.keep_s = keep_s
        self.windows: deque[tuple[float, str, int, int, list[float]]] = deque()

    def record(self, at: float, entries: dict[str, tuple[int, int, list[float]]]) -> None:
        for version, (requests, errors, latencies) in entries.items():
            self.windows.append((at, version, requests, errors, latencies))
        while self.windows and self.windows[0][0] < at - self.keep_s:
            self.windows.popleft()

    def summary(self, since: float, until: float | None = None) -> dict[str, dict[str, Any]]:
        until = until if until is not None else time.time() + 1
        grouped: dict[str, list] = defaultdict(lambda: [0, 0, []])
        for at, version, requests, errors, latencies in self.windows:
            if since <= at <= until:
                g = grouped[version]
                g[0] += requests
                g[1] += errors
                g[2].extend(latencies)
        return {
            version: summarize(requests, errors, latencies)
            for version, (requests, errors, latencies) in grouped.items()
        }


class _StatsBuffer:
    """Counts in the replica; a background task flushes them to the RouteStats actor."""

    def __init__(self, route: str):
        self.route = route
        self.pending: dict[str, list] = {}
        self.actor = None

    def add(self, version: str, error: bool, latency_ms: float) -> None:
        entry = self.pending.setdefault(version, [0, 0, []])
        entry[0] += 1
        entry[1] += int(error)
        if len(entry[2]) < LATENCY_SAMPLES:
            entry[2].append(latency_ms)
        else:  # keep a uniform sample
            slot = random.randrange(entry[0])
            if slot < LATENCY_SAMPLES:
                entry[2][slot] = latency_ms

    async def run(self) -> None:
        while True:
            await asyncio.sleep(STATS_FLUSH_S)
            if not self.pending:
                continue
            pending, self.pending = self.pending, {}
            try:
                if self.actor is None:
                    self.actor = RouteStats.options(
                        name=stats_actor_name(self.route),
                        namespace=SERVE_NAMESPACE,
                        lifetime="detached",
                        get_if_exists=True,
                    ).remote()
                self.actor.record.remote(time.time(), {v: tuple(e) for v, e in pending.items()})
            except Exception:  # stats must never break serving
                logger.exception("could not record route stats")
                self.actor = None


@serve.deployment(name=ROUTER_DEPLOYMENT, max_ongoing_requests=64, health_check_period_s=5.0)
class Router:
    def __init__(self, route: str, max_body_bytes: int = MAX_BODY_BYTES):
        self.route = route
        self.max_body_bytes = max_body_bytes
        self.config = RouterConfig()
        self.handles: dict[tuple[str, str], Any] = {}
        self.inline: PolicyCore | None = None
        self.loading: str | None = None
        self.load_error: str | None = None
        self.rejected_config: str | None = None
        self.stats = _StatsBuffer(route)
        self._lock = threading.Lock()
        self._flusher: asyncio.Task | None = None

    def reconfigure(self, config: dict[str, Any]) -> None:
        # Serve stops a replica whose reconfigure raises, and calls this twice on a new
        # replica: never raise, and do nothing when nothing changed.
        try:
            parsed = RouterConfig.parse(config)
        except (TypeError, ValueError) as error:
            self.rejected_config = str(error)
            logger.error(
                "router %s ignored a bad config (kept generation %s): %s",
                self.route,
                self.config.generation,
                error,
            )
            return
        self.rejected_config = None
        if parsed == self.config:
            return
        self.config = parsed
        if parsed.inline_live:
            self._load_inline(parsed.live)
        else:
            self.inline = None
        logger.info(
            "router %s now at generation %s: %s", self.route, parsed.generation, parsed.as_dict()
        )

    def _load_inline(self, live: Target) -> None:
        if self.inline is not None and self.inline.version == live.version:
            return
        with self._lock:
            if self.loading == live.version:
                return
            self.loading = live.version

        def load() -> None:
            try:
                core = PolicyCore(ModelSpec.parse(live.model), max_body_bytes=self.max_body_bytes)
                core.check()
                if self.config.inline_live and self.config.live == live:
                    self.inline = core
                    self.load_error = None
            except Exception as error:  # keep forwarding to the live app
                self.load_error = f"v{live.version}: {error}"
                logger.exception(
                    "router %s could not host v%s in process", self.route, live.version
                )
            finally:
                with self._lock:
                    self.loading = None

        threading.Thread(target=load, name=f"load-v{live.version}", daemon=True).start()

    def _handle(self, target: Target) -> Any:
        key = (target.app, target.deployment)
        handle = self.handles.get(key)
        if handle is None:
            handle = serve.get_deployment_handle(target.deployment, target.app)
            self.handles[key] = handle
        return handle

    def status(self) -> dict[str, Any]:
        """What this replica serves now."""
        inline = self.inline
        return {
            "route": self.route,
            "config": self.config.as_dict(),
            "inline_version": inline.version
            if inline is not None
            and self.config.live is not None
            and inline.version == self.config.live.version
            else None,
            "loading": self.loading,
            "load_error": self.load_error,
            "rejected_config": self.rejected_config,
        }

    def check_health(self) -> None:
        pass  # the router holds no model it cannot do without; targets have their own checks

    async def __call__(self, request: Any) -> Any:
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self.stats.run())
        if request.method == "GET" and request.url.path.rstrip("/").endswith("/-/status"):
            return to_response(json_response(200, self.status()))
        started = time.perf_counter()
        req = await request_dict(request, self.max_body_bytes)
        req_id = request_id(req["headers"])
        config = self.config
        use_candidate = config.candidate is not None and random.random() < config.candidate_weight
        target = config.candidate if use_candidate else config.live
        if target is None:
            answer = json_response(503, {"error": f"route {self.route} has no live version"})
            answer["headers"][REQUEST_ID_HEADER] = req_id
            return to_response(answer)
        inline = self.inline
        if not use_candidate and inline is not None and inline.version == target.version:
            answer = inline.answer(req)
        elif _wants_stream(req):
            return await self._forward_stream(target, req, config.timeout_s, started, req_id)
        else:
            answer = await self._forward(target, req, config.timeout_s)
        self.stats.add(
            target.version, answer["status"] >= 500, (time.perf_counter() - started) * 1000
        )
        answer["headers"] = tagged_headers(answer["headers"], target.version, req_id)
        return to_response(answer)

    async def _forward_stream(
        self, target: Target, req: dict[str, Any], timeout_s: float, started: float, req_id: str
    ) -> Any:
        """Stream a target's chunks through: its first item is {"status", "headers"}; the
        timeout covers the wait for it (time to first token), not the whole stream."""
        from starlette.responses import StreamingResponse

        stream = None
        try:
            stream = self._handle(target).options(stream=True).handle_http_stream.remote(req)
            head = await asyncio.wait_for(stream.__anext__(), timeout_s)
        except Exception as error:
            if stream is not None:
                stream.cancel()
            status = 504 if isinstance(error, TimeoutError) else 502
            reason = (
                f"no first chunk within {timeout_s:g} s"
                if status == 504
                else f"{type(error).__name__}: {str(error)[-300:]}"
            )
            answer = json_response(status, {"error": f"v{target.version}: {reason}"})
            self.stats.add(target.version, True, (time.perf_counter() - started) * 1000)
            answer["headers"] = tagged_headers(answer["headers"], target.version, req_id)
            return to_response(answer)

        async def chunks():
            failed = head.get("status", 200) >= 500
            try:
                async for chunk in stream:
                    yield chunk
            except Exception:
                failed = True
                raise
            finally:
                self.stats.add(target.version, failed, (time.perf_counter() - started) * 1000)

        headers = tagged_headers(head.get("headers", {}), target.version, req_id)
        return StreamingResponse(chunks(), status_code=head.get("status", 200), headers=headers)

    async def _forward(self, target: Target, req: dict[str, Any], timeout_s: float):
        try:
            response = self._handle(target).handle_http.remote(req)
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
            response.cancel()
            return json_response(
                504, {"error": f"v{target.version} did not answer within {timeout_s:g} s"}
            )
        except Exception as error:
            message = str(error).strip().splitlines()[-1] if str(error).strip() else ""
            return json_response(
                502, {"error": f"v{target.version} failed: {type(error).__name__}: {message[:300]}"}
            )


def _wants_stream(req: dict[str, Any]) -> bool:
    """An OpenAI-style `"stream": true` request (LLM targets answer it in chunks)."""
    body = req.get("body", b"")
    if b'"stream"' not in body:
        return False
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False


def build_router_app(args: dict[str, Any]) -> Any:
    """Application builder (`workloads.router:build_router_app`): args are {"route": name,
    "max_body_bytes": int, "serving": {num_replicas, num_cpus, max_ongoing_requests}}."""
    route = str(args.get("route") or "")
    if not route:
        raise ValueError("router args need a route name")
    serving = dict(args.get("serving") or {})
    options: dict[str, Any] = {
        "num_replicas": int(serving.get("num_replicas", 1)),
        "ray_actor_options": {"num_cpus": float(serving.get("num_cpus", 0.25))},
        "max_ongoing_requests": int(serving.get("max_ongoing_requests", 64)),
    }
    return Router.options(**options).bind(route, int(args.get("max_body_bytes", MAX_BODY_BYTES)))


__all__ = ["Router", "RouterConfig", "RouteStats", "Target", "build_router_app", "stats_actor_name"]
