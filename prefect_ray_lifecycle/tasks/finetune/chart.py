"""The chart of one fine-tune: train and eval loss against tokens seen, one train line per
attempt (a worker-group start), the steps a resume trained again drawn dashed in grey; the
base model's eval loss at 0; checkpoints marked by kind (periodic, just-in-time, final); a
preemption notice and each resume as vertical lines, labelled with what they cost.

Pure drawing from the run's history records (workloads.llm.train.history) and their summary,
on tasks.charts.new_figure (Agg, no pyplot): the task that owns them saves and publishes it.
Every drawn element has a gid, so a test can find it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefect_ray_lifecycle.tasks.charts import new_figure
from prefect_ray_lifecycle.workloads.llm.train.history import HistorySummary

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CHECKPOINT_MARKERS", "draw_finetune"]

# Marker, colour and legend label of each checkpoint kind.
CHECKPOINT_MARKERS = {
    "periodic": ("^", "tab:green", "periodic checkpoint"),
    "jit": ("*", "gold", "just-in-time checkpoint (preemption)"),
    "final": ("s", "black", "final checkpoint"),
}
LOST_COLOR = "0.6"


def _attempts(records: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    groups: list[list[dict[str, Any]]] = []
    for record in records:
        if "step" not in record:
            continue
        if not groups or groups[-1][0].get("attempt") != record.get("attempt"):
            groups.append([])
        groups[-1].append(record)
    return groups


def _short(text: str, width: int = 12) -> str:
    return text if len(text) <= width else text[:width] + "…"


def _mark(axes, x, color, style, label, gid, text, top: bool) -> None:
    """A vertical line at `x` with its text along it, at the top or the bottom."""
    axes.axvline(x, color=color, linestyle=style, linewidth=1.4, label=label, gid=gid)
    axes.annotate(
        text,
        (x, 1.0 if top else 0.02),
        xycoords=("data", "axes fraction"),
        rotation=90,
        va="top" if top else "bottom",
        ha="right" if top else "left",
        fontsize=7,
        color=color,
    )


def draw_finetune(
    records: Sequence[dict[str, Any]], summary: HistorySummary, title: str = "Fine-tune"
) -> Figure:
    """One panel: loss against tokens seen (see the module's docstring)."""
    figure = new_figure(12.0, 6.5)
    axes = figure.subplots()
    attempts = _attempts(records)
    # Where each attempt was taken over by the next (the tokens of its resume checkpoint).
    cut = [
        int((later[0].get("resumed_from") or {}).get("tokens_seen", 0)) for later in attempts[1:]
    ] + [None]
    lost_labelled = False
    for index, (attempt, until) in enumerate(zip(attempts, cut, strict=True)):
        points = [(r["tokens_seen"], r["loss"]) for r in attempt if r.get("loss") is not None]
        kept = [p for p in points if until is None or p[0] <= until]
        lost = [p for p in points if until is not None and p[0] >= until]
        label = "train loss" if index == 0 else None
        if kept:
            axes.plot(
                [p[0] for p in kept],
                [p[1] for p in kept],
                color="tab:blue",
                linewidth=1.2,
                alpha=0.85,
                label=label,
                gid=f"train:{index}",
            )
        if len(lost) > 1:
            axes.plot(
                [p[0] for p in lost],
                [p[1] for p in lost],
                color=LOST_COLOR,
                linestyle="--",
                linewidth=1.8,
                zorder=4,  # over the resumed attempt's line, which retraces the same tokens
                # One legend entry for every attempt's lost steps.
                label=None if lost_labelled else "steps lost to a failure (trained again)",
                gid=f"lost:{index}",
            )
            lost_labelled = True
    evals = [(r["tokens_seen"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if evals:
        axes.plot(
            [p[0] for p in evals],
            [p[1] for p in evals],
            color="tab:orange",
            marker="o",
            markersize=3.5,
            linewidth=1.4,
            label="held-out eval loss",
            gid="eval",
        )
    if summary.base_eval_loss is not None:
        axes.plot(
            [0],
            [summary.base_eval_loss],
            marker="D",
            markersize=8,
            color="tab:red",
            linestyle="none",
            label=f"base model: eval loss {summary.base_eval_loss:.2f}",
            gid="base",
        )
    for kind, (marker, color, label) in CHECKPOINT_MARKERS.items():
        marks = [c for c in summary.checkpoints if c.kind == kind and c.eval_loss]
        if marks:
            axes.plot(
                [c.tokens_seen for c in marks],
                [c.eval_loss for c in marks],
                marker=marker,
                markersize=12 if kind == "jit" else 8,
                markeredgecolor="black",
                color=color,
                linestyle="none",
                zorder=5,
                label=label,
                gid=f"checkpoint:{kind}",
            )
    for number, notice in enumerate(summary.preemptions):
        warning = (
            f"{notice.deadline_ms / 1000 - notice.detected_at:.0f} s warning"
            if notice.deadline_ms
            else "no deadline"
        )
        _mark(
            axes,
            notice.tokens_seen,
            "tab:red",
            "--",
            f"preemption notice ({warning})" if number == 0 else None,
            f"preemption:{number}",
            f"drain: {', '.join(_short(n) for n in notice.nodes)}",
            top=True,
        )
    for number, resume in enumerate(summary.resumes):
        _mark(
            axes,
            resume.tokens_seen,
            "tab:purple",
            ":",
            "resume" if number == 0 else None,
            f"resume:{number}",
            f"{resume.kind}: resumed at step {resume.from_step} "
            f"({resume.checkpoint_kind or 'base'}), lost {resume.lost_steps} steps, "
            f"{resume.repeated_blocks} blocks seen twice",
            top=False,
        )
    axes.set_xlabel("tokens seen")
    axes.set_ylabel("loss (nats per token)")
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8, loc="upper right")
    best = f", best eval {summary.best_eval_loss:.3f}" if summary.best_eval_loss else ""
    figure.suptitle(
        f"{title}\n{summary.steps} steps, {summary.tokens_seen:,} tokens{best}, "
        f"{len(summary.resumes)} resume{'' if len(summary.resumes) == 1 else 's'}",
        fontsize=11,
    )
    return figure
