"""What a rollout leaves behind for people and automations: the version's verdict tags and
the `live` alias in MLflow, a Prefect event per outcome, the route's heartbeat, and a timeline
artifact."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import httpx
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from prefect.runtime import flow_run

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry
from prefect_ray_lifecycle.tasks._base import mlflow_task
from prefect_ray_lifecycle.tasks.charts import artifact_key
from prefect_ray_lifecycle.tasks.charts import publish as publish_chart
from prefect_ray_lifecycle.tasks.rollout.chart import draw_rollout
from prefect_ray_lifecycle.tasks.rollout.config import Gates
from prefect_ray_lifecycle.workloads.serve.route_state import route_series, route_shadow_series

__all__ = [
    "ROUTE_HEALTHY",
    "ROUTE_REMOVED",
    "Timeline",
    "emit",
    "heartbeat",
    "heartbeat_resource",
    "record",
    "route_resource",
    "wait_for_prefect",
]

# A route that serves a live version beats (deployments.route_watch, and each rollout that
# leaves it serving); a proactive trigger in prefect.yaml restores one whose beats stop.
ROUTE_HEALTHY = "ray-lifecycle.route.healthy"
ROUTE_REMOVED = "ray-lifecycle.route.removed"  # a route taken down on purpose: not lost

logger = logging.getLogger(__name__)


# How long a rollout that ended while Prefect was down waits for it before it records its
# ending: as long as the `mark-silent-flow-runs-crashed` automation waits before it marks a
# silent run Crashed (deployments.crashes.SILENT_RUN_S).
PREFECT_WAIT_S = 600.0
PREFECT_POLL_S = 2.0


def wait_for_prefect(max_s: float = PREFECT_WAIT_S) -> bool:
    """Wait until Prefect's API answers its health check (True), for at most `max_s` (False).

    A rollout's outcome is decided in Ray and MLflow, never in Prefect: while Prefect is down
    the gates go on (the route's lease lives in Ray), and only Prefect's record of them waits.
    Its client retries a call for about a minute, so without this a rollout that ended in a
    longer outage failed on its timeline artifact after it had promoted (or rejected) the
    version, and the run's final state never reached Prefect. Asked with a short timeout of
    its own, not through Prefect's client and its backoff."""
    from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL

    url = (PREFECT_API_URL.value() or "").rstrip("/")
    if not url:
        return True  # an ephemeral API in this process: nothing to wait for
    key = PREFECT_API_KEY.value()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + max_s
    waited = False
    while True:
        try:
            # Any answer but a 5xx is a server that answers (one behind auth may say 401).
            if httpx.get(f"{url}/health", headers=headers, timeout=5).status_code < 500:
                if waited:
                    logger.warning("Prefect at %s answers again: recording the rollout", url)
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            logger.error("Prefect at %s is still unreachable after %.0f s", url, max_s)
            return False
        if not waited:
            logger.warning(
                "Prefect at %s is unreachable: the rollout has ended and waits up to %.0f s "
                "for it, to record its timeline and final state",
                url,
                max_s,
            )
            waited = True
        time.sleep(PREFECT_POLL_S)


@mlflow_task
def record(
    mlflow_server: MLflowServer,
    model_name: str,
    version: str,
    verdict: dict[str, Any],
    move_live_to: str | None = None,
    reason: str = "",
) -> str | None:
    """Tag the version with the rollout's verdict; move `live` when asked (with history).
    Returns the previous `live` version when it moved."""
    actor = f"prefect flow run {flow_run.id}"
    with mlflow_server.session() as client:
        registry.tag_verdict(
            client,
            model_name,
            version,
            "rollout",
            {**verdict, "flow_run_id": str(flow_run.id or ""), "by": actor},
        )
        if move_live_to is not None:
            current = registry.resolve_alias(client, model_name, registry.LIVE)
            if current is None or current.version != str(move_live_to):
                return registry.move_alias(
                    client, model_name, registry.LIVE, str(move_live_to), reason=reason, actor=actor
                )
    return None


def emit(outcome: str, model_name: str, version: str, route: str, payload: dict[str, Any]) -> None:
    """A Prefect event for automations: ray-lifecycle.rollout.<outcome>."""
    emit_event(
        event=f"ray-lifecycle.rollout.{outcome}",
        resource={
            "prefect.resource.id": f"mlflow.model-version.{model_name}.{version}",
            "prefect.resource.name": f"{model_name} v{version}",
            "ray-lifecycle.route": route,
        },
        payload=payload,
    )


def route_resource(route: str) -> str:
    return f"ray-lifecycle.route.{route}"


def heartbeat_resource(route: str, model_name: str, kind: str, live: str) -> dict[str, str]:
    """The resource of a route's heartbeat: what the restoring trigger hands reconcile."""
    return {
        "prefect.resource.id": route_resource(route),
        "prefect.resource.name": f"/{route}",
        "ray-lifecycle.route": route,
        "ray-lifecycle.model": model_name,
        "ray-lifecycle.kind": kind,
        "ray-lifecycle.live": live,
    }


def heartbeat(route: str, model_name: str, kind: str, live: str) -> None:
    """The route's first heartbeat, from the rollout that left it serving: the trigger only
    misses a route that has beaten once, and the watch's next round may come after the route
    is already gone (a head lost seconds after a first rollout)."""
    emit_event(event=ROUTE_HEALTHY, resource=heartbeat_resource(route, model_name, kind, live))


class Timeline:
    """A rollout's stages, logged as they happen and published as one markdown artifact per
    route and model (key `rollout-<route>-<model>`), with the rollout's chart (requests/s,
    error rate and p99 per version, the shadow's agreement, stage boundaries, gate
    thresholds) on the version's MLflow
    run and as the image artifact `rollout-chart-<route>-<model>`, linked from the table."""

    def __init__(
        self,
        title: str,
        *,
        model_name: str,
        version: str,
        route: str,
        server: MLflowServer | None = None,
        gates: Gates | None = None,
        kind: str = "policy",
    ):
        self.title = title
        self.kind = kind
        self.model_name, self.version, self.route = model_name, version, route
        self.server, self.gates = server, gates
        self.key = artifact_key("rollout", route, model_name)
        self.chart_key = artifact_key("rollout-chart", route, model_name)
        self.started = time.monotonic()
        self.started_at = time.time()
        self.entries: list[dict[str, Any]] = []
        self.marks: list[dict[str, Any]] = []
        self.live: str | None = None
        self.chart_url: str | None = None

    def add(self, stage: str, outcome: str, detail: str, figures: dict | None = None) -> None:
        at = time.time()
        self.marks.append({"at": at, "stage": stage, "outcome": outcome})
        self.entries.append(
            {
                "at_s": round(time.monotonic() - self.started, 1),
                "at": at,  # epoch seconds, to line up with what clients saw
                "stage": stage,
                "outcome": outcome,
                "detail": detail,
                "figures": {
                    k: v
                    for k, v in (figures or {}).items()
                    if k not in ("timeline", "reason", "at")
                },
            }
        )
        get_run_logger().info("%s: %s (%s)", stage, outcome, detail)

    def publish(self, decision: str, chart: bool = True) -> None:
        """The timeline artifact (what a person scans: when, stage, outcome, detail; the
        figures are in the chart and in the flow's result), after the chart when asked.
        Waits for Prefect first when it is down: see wait_for_prefect."""
        wait_for_prefect()
        if chart:
            self.chart_url = self._chart(decision)
        rows = "\n".join(
            f"| {e['at_s']:.1f} s | {e['stage']} | {e['outcome']} | "
            f"{e['detail'].replace('|', '/')} |"
            for e in self.entries
        )
        shown = (
            f"\n\n[Chart: requests/s, error rate and p99 per version]({self.chart_url})"
            f"\n\n![rollout chart]({self.chart_url})"
            if self.chart_url
            else ""
        )
        create_markdown_artifact(
            key=self.key,
            markdown=(
                f"## {self.title}\n\n**Decision: {decision}**\n\n"
                f"| at | stage | outcome | detail |\n|---|---|---|---|\n"
                f"{rows}{shown}\n\n_{datetime.now(UTC).isoformat(timespec='seconds')}_"
            ),
            description=f"{self.title}: {decision}",
        )

    def chart_data(self) -> dict[str, Any]:
        """What the chart draws: the route's per-version figures since the rollout started,
        the stages as they ended, and the gates' thresholds."""
        gates = self.gates or Gates()
        return {
            "title": self.title,
            "route": self.route,
            "model_name": self.model_name,
            "candidate": self.version,
            "live": self.live,
            "started": self.started_at,
            "series": route_series(self.route, self.started_at),
            "shadow": route_shadow_series(self.route, self.started_at),
            "stages": list(self.marks),
            "thresholds": {
                "max_error_rate": gates.max_error_rate,
                "max_p99_ms": gates.max_p99_ms,
                "max_p99_ratio": gates.max_p99_ratio,
                "p99_slack_ms": gates.p99_slack_ms,
                "min_agreement": gates.min_llm_agreement
                if self.kind == "llm"
                else gates.min_agreement,
            },
        }

    def _chart(self, decision: str) -> str | None:
        if self.server is None:
            return None
        try:
            data = self.chart_data()
            with self.server.session() as client:
                run_id = client.get_model_version(self.model_name, self.version).run_id
        except Exception as error:  # the chart reports the rollout; it must never fail it
            get_run_logger().warning("no rollout chart: %r", error)
            return None
        if not run_id:
            get_run_logger().warning(
                "no rollout chart: %s v%s has no MLflow run to hold it",
                self.model_name,
                self.version,
            )
            return None
        stamp = datetime.fromtimestamp(self.started_at, UTC).strftime("%Y%m%dT%H%M%SZ")
        return publish_chart(
            lambda: draw_rollout(data),
            server=self.server,
            run_id=run_id,
            artifact_path=f"rollouts/{artifact_key(self.route)}-{stamp}.png",
            key=self.chart_key,
            description=f"{self.title}: {decision}",
            data=data,
        )
