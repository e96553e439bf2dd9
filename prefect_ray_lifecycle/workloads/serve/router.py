"""The router: one Serve application on a stable route that never changes.

It sends each request to the live version or, during a canary, a weighted share to the
candidate, each a separate Serve application reached through a DeploymentHandle (a JSON 502
for upstream errors, 504 after the per-request timeout). Once a live version has passed its
gates the router hosts it in its own replicas (workloads.serve.hosted: a policy, or an LLM's vLLM
engine when the route's router runs in the LLM venv), so steady-state requests pay no extra
hop; while it loads, or if its engine stops, requests go to the version's app as before.

Which version answers: the candidate's share of requests, drawn per request, or per session
for a request with a session key (a stable hash: the same session stays on one version while
the share holds); a tester's `X-Canary` header where the route lets testers in
(workloads.serve.traffic). In a shadow stage users get live's answers only, and copies of a
share of them go to the candidate, sent and compared off the users' path
(workloads.serve.shadow).

Safety lives here, not in the flow that drives it:
- a candidate share (or its shadow copies, or a tester's way to it) is served only while the
  rollout that set it holds the route's lease (workloads.serve.route_state); when the lease
  lapses the router serves the live version only;
- a request the candidate (or, during a bake, the freshly swapped version) fails with a 5xx,
  a connection error or a timeout is answered once more by the version it would otherwise
  have gone to, within the request's own timeout, and the failure still counts against the
  version that failed.

Everything else is set by its user_config (workloads.serve.router_config), applied in place by
`reconfigure`, which never raises and is idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from prefect_ray_lifecycle.workloads.constants import (
    FALLBACK_HEADER,
    ROUTER_DEPLOYMENT,
    SHADOW_KEY,
    STREAM_FAILED_KEY,
)
from prefect_ray_lifecycle.workloads.http import (
    MAX_BODY_BYTES,
    BadRequest,
    json_response,
    peek_field,
    request_dict,
    tagged_headers,
    to_response,
)
from prefect_ray_lifecycle.workloads.serve import upstream
from prefect_ray_lifecycle.workloads.serve.hosted import Hosted, host
from prefect_ray_lifecycle.workloads.serve.route_state import RouteStateClient, status_window
from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig, Target
from prefect_ray_lifecycle.workloads.serve.shadow import (
    Copy,
    Mirror,
    greedy_llm_request,
)
from prefect_ray_lifecycle.workloads.serve.traffic import (
    canary_choice,
    episode_key,
    session_key,
    sticky_draw,
)

__all__ = ["Router", "build_router_app"]

logger = logging.getLogger("ray.serve")

FALLBACK_SHARE = 0.5  # of the request's timeout, left for the fallback attempt
FIGURES_TIMEOUT_S = 2.0  # status answers without figures rather than wait longer
# A handle to a version the config no longer names is shut down this long after: requests
# already sent through it end first (shutting one down stops its metrics pushes; its
# replicas' long-poll listener lets go of it with the last reference).
STALE_HANDLE_GRACE_S = 60.0


@serve.deployment(name=ROUTER_DEPLOYMENT, max_ongoing_requests=64, health_check_period_s=5.0)
class Router:
    def __init__(self, route: str, max_body_bytes: int = MAX_BODY_BYTES):
        self.route = route
        self.max_body_bytes = max_body_bytes
        self.config = RouterConfig()
        self.handles: dict[tuple[str, str], Any] = {}
        self.inline: Hosted | None = None
        self.loading: str | None = None
        self.load_error: str | None = None
        self.rejected_config: str | None = None
        self.mirror = Mirror(self._forward, max_body_bytes)
        self.state = RouteStateClient(route, shadow=self.mirror)
        self._lock = threading.Lock()
        self._background: asyncio.Task | None = None
        self.replica = serve.get_replica_context().replica_id.unique_id

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
        self._drop_stale_handles(parsed)
        if parsed.inline_live:
            self._load_inline(parsed.live)
        else:
            self._replace_inline(None)
        logger.info(
            "router %s now at generation %s: %s",
            self.route,
            parsed.generation,
            parsed.as_dict(),
        )

    def _load_inline(self, live: Target) -> None:
        inline = self.inline
        if inline is not None and inline.version == live.version and inline.alive():
            return
        with self._lock:
            if self.loading == live.version:
                return
            self.loading = live.version

        def load() -> None:
            try:
                hosted = host(live, self.max_body_bytes)
                if self.config.inline_live and self.config.live == live:
                    self._replace_inline(hosted)
                    self.load_error = None
                else:  # the route moved on while it loaded
                    hosted.close()
            except Exception as error:  # keep forwarding to the live app
                self.load_error = f"v{live.version}: {error}"
                logger.exception(
                    "router %s could not host v%s in process", self.route, live.version
                )
            finally:
                with self._lock:
                    self.loading = None

        threading.Thread(target=load, name=f"load-v{live.version}", daemon=True).start()

    def _replace_inline(self, hosted: Hosted | None) -> None:
        previous, self.inline = self.inline, hosted
        if previous is not None and previous is not hosted:
            previous.close()  # an engine stops once the requests it is answering are done

    def _hosted(self, target: Target) -> Hosted | None:
        """The in-process copy of `target` when this replica hosts it and it can answer."""
        inline = self.inline
        if inline is not None and inline.version == target.version and inline.alive():
            return inline
        return None

    def _handle(self, target: Target) -> Any:
        key = (target.app, target.deployment)
        handle = self.handles.get(key)
        if handle is None:
            # Our own handle, not `serve.get_deployment_handle`'s: that one is cached by Serve
            # for the whole process (up to 100), so a version's handle could be neither shut
            # down (a version rolled out again later would get the dead one) nor let go.
            handle = DeploymentHandle(target.deployment, target.app)
            self.handles[key] = handle
        return handle

    def _drop_stale_handles(self, config: RouterConfig) -> None:
        """Let go of the handles to versions `config` no longer names. Each handle runs a
        router of its own in this process (the replicas' long-poll listener, metrics pushes)
        for as long as it lives: kept, every version ever rolled out through the route stayed
        in the router's memory (about 1-3 MB a rollout in the soak)."""
        named = {
            (t.app, t.deployment)
            for t in (config.live, config.candidate, config.previous)
            if t is not None
        }
        for key in [key for key in self.handles if key not in named]:
            timer = threading.Timer(STALE_HANDLE_GRACE_S, _shut_down, (self.handles.pop(key), key))
            timer.daemon = True
            timer.start()

    def _start_background(self) -> None:
        if self._background is None:
            self._background = asyncio.get_running_loop().create_task(self.state.run())

    def candidate_share(self, config: RouterConfig) -> float:
        """The candidate's share as served: its weight while its rollout holds the lease."""
        if config.candidate is None or not self.state.holds(config.rollout):
            return 0.0
        return config.candidate_weight

    async def status(self, window_s: int | None = None) -> dict[str, Any]:
        """What this replica serves now; with `window_s`, also the route's per-version
        figures over the last `window_s` seconds (every replica's reports)."""
        self._start_background()
        config, inline = self.config, self.inline
        share = self.candidate_share(config)
        # In a shadow stage the share is 0 by design: lapsed means the lease is not held.
        lapsed = config.candidate is not None and not self.state.holds(config.rollout)
        extra = {} if window_s is None else {"figures": await self._figures(window_s)}
        shown = config.as_dict()
        if shown["testers"]["token_sha256"]:  # a digest of a secret is still not shown
            shown["testers"]["token_sha256"] = "set"
        return {
            "route": self.route,
            "replica": self.replica,  # which of the router's replicas answered
            "config": shown,
            "candidate_share": share,
            "lease": {
                "holder": self.state.lease.get("holder"),
                "held": self.state.lease.get("held", False),
                "lapsed": lapsed,
            },
            "serving": "live only: the rollout's lease is not held" if lapsed else "as configured",
            "inline_version": inline.version
            if inline is not None
            and config.live is not None
            and inline.version == config.live.version
            and inline.alive()
            else None,
            "loading": self.loading,
            "handles": sorted(app for app, _ in self.handles),  # the versions' apps it calls
            "load_error": self.load_error,
            "rejected_config": self.rejected_config,
            "shadow": {
                "active": config.shadow is not None and not lapsed,
                **self.mirror.status(),
            },
            **extra,
        }

    async def _figures(self, window_s: int) -> dict[str, Any]:
        """{"window_s", "versions": {version: summary}}; with "error" and no versions when
        the route's state did not answer in time (status never fails for it)."""
        figures: dict[str, Any] = {"window_s": window_s, "versions": {}}
        since = time.time() - window_s
        try:
            figures["versions"] = await self.state.summary(since, FIGURES_TIMEOUT_S)
            figures["testers"] = await self.state.summary(since, FIGURES_TIMEOUT_S, testers=True)
            figures["shadow"] = await self.state.shadow_summary(since, FIGURES_TIMEOUT_S)
        except Exception as error:
            figures["error"] = f"route state unreachable: {type(error).__name__}: {error}"[:300]
        return figures

    async def llm_stats(self, version: str, reset: bool = False) -> dict[str, Any] | None:
        """The hosted LLM's own figures (as its app's `stats`), None unless it hosts `version`."""
        inline = self.inline
        if inline is None or inline.version != version:
            return None
        return await inline.stats(reset)

    def check_health(self) -> None:
        """Never fails: what it hosts has a fallback (the version's app), and targets have
        their own checks. A hosted engine whose loop stopped is loaded again."""
        config, inline = self.config, self.inline
        if config.inline_live and inline is not None and not inline.alive():
            if config.live is not None and inline.version == config.live.version:
                self._load_inline(config.live)

    def stop_hosted(self) -> str | None:
        """A drill: what this replica hosts stops as a crashed engine does, left in place, so
        its app answers until the next health check loads it again; its version, or None."""
        inline = self.inline
        if inline is not None:
            inline.close()
        return inline.version if inline is not None else None

    async def __call__(self, request: Any) -> Any:
        self._start_background()
        if request.method == "GET" and request.url.path.rstrip("/").endswith("/-/status"):
            try:
                window_s = status_window(request.query_params.getlist("window_s"))
            except BadRequest as error:
                return to_response(json_response(error.status, {"error": error.message}))
            return to_response(json_response(200, await self.status(window_s)))
        started = time.perf_counter()
        req = await request_dict(request, self.max_body_bytes)
        config = self.config
        if config.live is None:
            return to_response(
                json_response(503, {"error": f"route {self.route} has no live version"})
            )
        try:
            use_candidate, tester, copy = self._choose(req, config)
        except BadRequest as error:
            answer = json_response(error.status, {"error": error.message})
            answer["headers"] = tagged_headers(answer["headers"], config.live.version)
            return to_response(answer)
        target = config.candidate if use_candidate else config.live
        backup = (config.live if use_candidate else config.previous) if config.fallback else None
        budget = config.timeout_s * (1 - FALLBACK_SHARE) if backup else config.timeout_s
        if copy is not None:  # live is asked for what the comparison needs
            req = {**req, SHADOW_KEY: True}
        if target.kind == "llm" and _wants_stream(req):
            return await self._stream(
                target, backup, req, config.timeout_s, budget, tester is not None, copy
            )
        answer = await self._answer(target, req, budget)
        failed = answer["status"] >= 500
        failed_ms = _ms_since(started)
        answered, extra = target, None
        if failed and backup is not None:
            retry_started = time.perf_counter()
            second = await self._answer(backup, req, config.timeout_s - budget)
            self.state.add(
                backup.version,
                second["status"] >= 500,
                _ms_since(retry_started),
                tester=tester is not None,
            )
            if second["status"] < 500:
                answer, answered, extra = (
                    second,
                    backup,
                    {FALLBACK_HEADER: target.version},
                )
        # The failure counts against the version that failed, answered or not.
        self.state.add(
            target.version, failed, failed_ms, fallback=extra is not None, tester=tester is not None
        )
        if copy is not None and answer["status"] == 200 and answered is target:
            self._mirror(config, copy, answer.get(SHADOW_KEY), failed_ms)
        answer["headers"] = tagged_headers(answer["headers"], answered.version, extra)
        return to_response(answer)

    def _choose(
        self, req: dict[str, Any], config: RouterConfig
    ) -> tuple[bool, str | None, dict[str, Any] | None]:
        """(whether the candidate answers, the tester's choice that decided it, the copy to
        send the candidate in a shadow stage). A request with a session key is drawn by its
        key, so that a session stays on one version while the share holds."""
        candidate = config.candidate
        held = candidate is not None and self.state.holds(config.rollout)
        tester = (
            canary_choice(req, config.testers.mode, config.testers.token_sha256) if held else None
        )
        key = session_key(req)
        if tester is not None:
            return tester == "always", tester, None
        share = config.candidate_weight if held else 0.0
        if share > 0.0:
            if key is None and config.live.kind == "policy":
                key = episode_key(req.get("body") or b"")
            draw = sticky_draw(candidate.version, key) if key is not None else random.random()
            return draw < share, None, None
        copy = None
        if held and config.shadow is not None:
            copy = req if candidate.kind == "policy" else greedy_llm_request(req)
            if copy is not None and not self.mirror.admit(config.shadow):
                copy = None
        return False, None, copy

    def _mirror(
        self,
        config: RouterConfig,
        request: dict[str, Any],
        live: dict[str, Any] | None,
        live_ms: float,
    ) -> None:
        """Queue the copies of a request live answered: to the candidate, and with the
        noise floor to live's own app again. Never waits."""
        request = {**request, SHADOW_KEY: True}
        roles = [(config.candidate, "candidate")]
        if config.shadow.noise_floor:
            roles.append((config.live, "noise_floor"))
        for target, role in roles:
            self.mirror.offer(Copy(target, role, request, live, live_ms, config.timeout_s))

    async def _answer(self, target: Target, req: dict[str, Any], timeout_s: float):
        hosted = self._hosted(target)
        if hosted is None:
            return await self._forward(target, req, timeout_s)
        try:
            if target.kind == "policy":  # answered in microseconds, on this thread
                return await hosted.answer(req)
            return await asyncio.wait_for(hosted.answer(req), timeout_s)
        except TimeoutError:
            return json_response(
                504, {"error": f"v{target.version} did not answer within {timeout_s:g} s"}
            )
        except Exception as error:  # a bug must not become Serve's bare 500
            return json_response(502, {"error": f"v{target.version} failed: {error!r}"[:400]})

    async def _stream(
        self,
        target: Target,
        backup: Target | None,
        req: dict[str, Any],
        timeout_s: float,
        budget: float,
        tester: bool = False,
        copy: dict[str, Any] | None = None,
    ) -> Any:
        """Stream a target's chunks through: its first item is {"status", "headers"}. The
        timeout covers the wait for it (time to first token), and a failure before it falls
        back like any other request; after the first byte there is no going back. With a
        shadow `copy`, live's last item carries its token ids, kept from the user."""
        from starlette.responses import StreamingResponse

        started = time.perf_counter()
        opened = await self._open_stream(target, req, budget)
        answered, extra = target, None
        if not isinstance(opened, tuple):
            failed_ms = _ms_since(started)
            if backup is not None:
                started = time.perf_counter()
                second = await self._open_stream(backup, req, timeout_s - budget)
                if isinstance(second, tuple):
                    opened, answered = second, backup
                    extra = {FALLBACK_HEADER: target.version}
                else:
                    self.state.add(backup.version, True, _ms_since(started), tester=tester)
            self.state.add(
                target.version, True, failed_ms, fallback=extra is not None, tester=tester
            )
        if not isinstance(opened, tuple):
            opened["headers"] = tagged_headers(opened["headers"], target.version)
            return to_response(opened)
        stream, head = opened
        config = self.config

        async def chunks():
            failed = head.get("status", 200) >= 500
            extras = None
            try:
                async for chunk in stream:
                    if isinstance(chunk, dict):  # for the router: failed after its first byte
                        failed = failed or bool(chunk.get(STREAM_FAILED_KEY))  # (counted only)
                        extras = chunk.get(SHADOW_KEY, extras)  # or the shadow's extras
                        continue
                    yield chunk
            except Exception:
                failed = True
                raise
            finally:
                elapsed = _ms_since(started)
                self.state.add(answered.version, failed, elapsed, tester=tester)
                if copy is not None and not failed and answered is target:
                    self._mirror(config, copy, extras, elapsed)

        headers = tagged_headers(head.get("headers", {}), answered.version, extra)
        return StreamingResponse(chunks(), status_code=head.get("status", 200), headers=headers)

    def _forward(self, target: Target, req: dict[str, Any], timeout_s: float):
        return upstream.forward(self._handle, target, req, timeout_s)

    def _open_stream(self, target: Target, req: dict[str, Any], timeout_s: float):
        return upstream.open_stream(self._hosted(target), self._handle, target, req, timeout_s)


def _shut_down(handle: Any, key: tuple[str, str]) -> None:
    try:
        handle.shutdown()
    except Exception:  # its app may be gone already: nothing left to stop
        logger.warning("router: the handle to %s/%s did not shut down", *key, exc_info=True)


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def _wants_stream(req: dict[str, Any]) -> bool:
    """An OpenAI-style `"stream": true` request (LLM targets answer it in chunks)."""
    return peek_field(req.get("body", b""), "stream") is True


def build_router_app(args: dict[str, Any]) -> Any:
    """Application builder (`prefect_ray_lifecycle.workloads.serve.router:build_router_app`):
    args are {"route": name, "max_body_bytes": int, "serving": {num_replicas, num_cpus, num_gpus,
    max_ongoing_requests}} (an LLM route's router takes an LLM replica's CPUs and GPUs)."""
    route = str(args.get("route") or "")
    if not route:
        raise ValueError("router args need a route name")
    serving = dict(args.get("serving") or {})
    actor: dict[str, Any] = {"num_cpus": float(serving.get("num_cpus", 0.25))}
    if serving.get("num_gpus"):
        actor["num_gpus"] = float(serving["num_gpus"])
    options: dict[str, Any] = {
        "num_replicas": int(serving.get("num_replicas", 1)),
        "ray_actor_options": actor,
        "max_ongoing_requests": int(serving.get("max_ongoing_requests", 64)),
    }
    return Router.options(**options).bind(route, int(args.get("max_body_bytes", MAX_BODY_BYTES)))
