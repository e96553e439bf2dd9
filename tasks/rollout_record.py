"""What a rollout leaves behind for people and automations: the version's verdict tags and
the `live` alias in MLflow, a Prefect event per outcome, and a timeline artifact."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from prefect.runtime import flow_run

from blocks import MLflowServer
from tasks.register import mlflow_task
from workloads import registry

__all__ = ["Timeline", "emit", "record"]


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


class Timeline:
    """A rollout's stages, logged as they happen and published as one markdown artifact."""

    def __init__(self, title: str, key: str = "rollout"):
        self.title = title
        self.key = key
        self.started = time.monotonic()
        self.entries: list[dict[str, Any]] = []

    def add(self, stage: str, outcome: str, detail: str, figures: dict | None = None) -> None:
        self.entries.append(
            {
                "at_s": round(time.monotonic() - self.started, 1),
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

    def publish(self, decision: str) -> None:
        rows = "\n".join(
            f"| {e['at_s']:.1f} s | {e['stage']} | {e['outcome']} | {e['detail']} | "
            f"{_figures(e['figures'])} |"
            for e in self.entries
        )
        create_markdown_artifact(
            key=self.key,
            markdown=(
                f"## {self.title}\n\n**Decision: {decision}**\n\n"
                f"| at | stage | outcome | detail | figures |\n|---|---|---|---|---|\n"
                f"{rows}\n\n_{datetime.now(UTC).isoformat(timespec='seconds')}_"
            ),
            description=f"{self.title}: {decision}",
        )


def _figures(figures: dict[str, Any]) -> str:
    parts = []
    for key, value in figures.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={_round(v)}" for k, v in value.items())
            parts.append(f"{key}: {value}")
        elif value is not None:
            parts.append(f"{key}={_round(value)}")
    return "; ".join(parts).replace("|", "/")


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value
