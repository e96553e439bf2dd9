"""What a fine-tune shows in Prefect: a progress artifact kept up to date from the run's history
while Ray Train fits (a thread of the task run, polling the history file the controller
writes), then the checkpoint table, a summary of resumes and preemptions (with the data seen
twice) and the loss chart. An artifact that cannot be written is logged; it never fails the
run."""

from __future__ import annotations

import base64
import contextvars
import threading
from typing import Any

import httpx
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.exceptions import PrefectException
from prefect.logging import get_run_logger

from prefect_ray_lifecycle.tasks import lineage
from prefect_ray_lifecycle.tasks.finetune.config import FineTuneOutcome
from prefect_ray_lifecycle.workloads.llm.train.history import read_history

__all__ = [
    "CHART_KEY",
    "CHECKPOINTS_KEY",
    "PROGRESS_KEY",
    "SUMMARY_KEY",
    "ProgressWatch",
    "publish_chart",
    "publish_outcome",
    "record_run",
]

PROGRESS_KEY = "llm-finetune-progress"
CHECKPOINTS_KEY = "llm-finetune-checkpoints"
SUMMARY_KEY = "llm-finetune-summary"
CHART_KEY = "llm-finetune-chart"
PROGRESS_POLL_S = 3.0
ARTIFACT_ERRORS = (httpx.HTTPError, OSError, PrefectException)


def _guarded(what: str, write, *args: Any) -> None:
    try:
        write(*args)
    except ARTIFACT_ERRORS as error:
        get_run_logger().warning("could not write the %s artifact: %r", what, error)


class ProgressWatch:
    """While entered, a thread of this task run reads the history every few seconds and keeps
    the progress artifact at the share of steps done."""

    def __init__(self, history_location: str, total_steps: int):
        self.location, self.total = history_location, total_steps
        self.stop = threading.Event()
        self.artifact_id: Any = None
        self.shown = -1
        self.thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._watch,), daemon=True
        )

    def __enter__(self) -> ProgressWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self._poll()  # where the run ended

    def _watch(self) -> None:
        while not self.stop.wait(PROGRESS_POLL_S):
            self._poll()

    def _poll(self) -> None:
        try:
            steps = [r for r in read_history(self.location) if "step" in r]
        except (OSError, ValueError):  # not written yet, or being written
            return
        if not steps or steps[-1]["step"] == self.shown:
            return
        self.shown = steps[-1]["step"]
        loss = steps[-1].get("loss")
        description = f"step {self.shown} of {self.total}" + (
            f", train loss {loss:.3f}" if loss is not None else ""
        )
        _guarded("progress", self._show, 100.0 * self.shown / self.total, description)

    def _show(self, share: float, description: str) -> None:
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(
                share, key=PROGRESS_KEY, description=description
            )
        else:
            update_progress_artifact(self.artifact_id, share, description=description)


def _summary_markdown(outcome: FineTuneOutcome, base_label: str) -> str:
    lines = [
        f"## Fine-tune of {base_label}",
        "",
        f"- {outcome.steps} steps, {outcome.tokens_seen:,} tokens, median "
        f"{outcome.tokens_per_s or 0:,.0f} tokens/s ({'GPU' if outcome.use_gpu else 'CPU'})",
        f"- eval loss: base {outcome.base_eval_loss:.3f} -> best {outcome.best_eval_loss:.3f}"
        if outcome.base_eval_loss is not None and outcome.best_eval_loss is not None
        else "- eval loss: not measured",
        f"- best checkpoint: `{outcome.best_checkpoint}`",
        f"- run: `{outcome.experiment_path}`{' (resumed)' if outcome.resumed else ''}",
    ]
    for notice in outcome.preemptions:
        lines.append(
            f"- preemption notice at step {notice.step} (nodes {', '.join(notice.nodes)}, "
            f"ranks {notice.ranks})"
        )
    for resume in outcome.resumes:
        lines.append(
            f"- {resume.kind}: resumed at step {resume.from_step} from its "
            f"{resume.checkpoint_kind or 'base'} checkpoint, reached {resume.reached_step}: "
            f"{resume.lost_steps} steps ({resume.replayed_blocks} blocks) trained again; "
            f"{resume.reread_blocks} blocks read again and skipped, {resume.repeated_blocks} "
            "trained twice in their epoch (Ray Data cannot checkpoint an iterator)"
        )
    return "\n".join(lines) + "\n"


def publish_outcome(outcome: FineTuneOutcome, base_label: str, png: bytes | None) -> None:
    """The checkpoint table, the summary and the chart (embedded as a data URI: the run has no
    server to host the image) on this flow run."""
    rows = [c.model_dump() for c in outcome.checkpoints]
    _guarded(
        "checkpoints",
        lambda: create_table_artifact(
            rows, key=CHECKPOINTS_KEY, description="Every checkpoint of the fine-tune"
        ),
    )
    _guarded(
        "summary",
        lambda: create_markdown_artifact(
            _summary_markdown(outcome, base_label),
            key=SUMMARY_KEY,
            description="What the fine-tune did",
        ),
    )
    publish_chart(
        png, f"{outcome.steps} steps; best eval loss {outcome.best_eval_loss}", outcome.chart_path
    )


def publish_chart(png: bytes | None, caption: str, where: str | None) -> None:
    """The loss chart on this flow run, embedded as a data URI (the run has no server to host
    the image); also after a failed run, saying why."""
    if png is None:
        return
    data = base64.b64encode(png).decode("ascii")
    _guarded(
        "chart",
        lambda: create_markdown_artifact(
            f"![loss chart](data:image/png;base64,{data})\n\n{caption}. File: `{where}`\n",
            key=CHART_KEY,
            description="Train and eval loss against tokens seen, checkpoints, preemptions",
        ),
    )


def record_run(outcome: FineTuneOutcome, dataset_asset: str, metadata: dict[str, Any]) -> str:
    """The Ray Train run as a Prefect asset, downstream of the dataset it trained on."""
    return lineage.record(
        lineage.experiment_key(outcome.experiment_path),
        name=f"Ray Train fine-tune {outcome.experiment_path.rstrip('/').rsplit('/', 2)[-2]}",
        description=f"Ray Train fine-tune at {outcome.experiment_path}: checkpoints (Hugging "
        "Face folders), history, loss chart.",
        by="ray-train",
        deps=[dataset_asset],
        metadata={
            "best_checkpoint": outcome.best_checkpoint,
            "best_eval_loss": outcome.best_eval_loss,
            "base_eval_loss": outcome.base_eval_loss,
            "steps": outcome.steps,
            "tokens_seen": outcome.tokens_seen,
            "resumes": len(outcome.resumes),
            **metadata,
        },
    )
