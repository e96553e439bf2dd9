"""The chart of one Tune sweep: per trial, the sweep's metric against env steps and against
training iterations; the trials ASHA stopped early marked where they stopped, failed trials
marked too; the winner highlighted, with its held-out evaluation (mean ± std).

Pure drawing (tasks.charts.new_figure: Agg, no pyplot): the task that owns the data saves it
and publishes it. Trials and the evaluation are read by attribute (tasks.tune.sweep's TrialSummary
and EvaluationReport, or anything shaped like them), so this module imports no task module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prefect_ray_lifecycle.tasks.charts import new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "EARLY_LABEL",
    "STOPPED_EARLY",
    "STOPPED_ERROR",
    "draw_sweep",
]

# TrialSummary.stopped values the chart marks.
STOPPED_EARLY = "early (ASHA)"
STOPPED_ERROR = "error"
EARLY_LABEL = "stopped early (ASHA)"
ERROR_LABEL = "failed (error)"
# Beyond this many trials only the winner is named in the legend.
MAX_NAMED_TRIALS = 10


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def trial_label(trial: Any) -> str:
    config = ", ".join(f"{key}={_short(value)}" for key, value in (trial.config or {}).items())
    return f"{trial.trial_id} {config}".strip()


def _xy(points: Sequence[Mapping[str, Any]], x: str) -> tuple[list[float], list[float]]:
    pairs = [
        (float(p[x]), float(p["return"]))
        for p in points
        if p.get(x) is not None and p.get("return") is not None and math.isfinite(p["return"])
    ]
    return [a for a, _ in pairs], [b for _, b in pairs]


def draw_sweep(
    trials: Sequence[Any],
    curves: Mapping[str, Sequence[Mapping[str, Any]]],
    best_trial_id: str | None,
    evaluation: Any | None,
    metric: str,
    experiment: str = "",
    title: str = "Tune sweep",
) -> Figure:
    """Two panels (metric vs env steps, metric vs iteration), one line per trial with points.

    trials: objects with trial_id, config, status and stopped (TrialSummary).
    curves: trial id -> points {"iteration", "env_steps", "return"}, in iteration order.
    evaluation: an object with mean_return, std_return and episodes (EvaluationReport), drawn
        at the winner's last point as mean ± std, with a reference line at the mean.
    """
    figure = new_figure(12.0, 6.0)
    by_steps, by_iteration = figure.subplots(1, 2, sharey=True)
    panels: list[tuple[Axes, str]] = [(by_steps, "env_steps"), (by_iteration, "iteration")]
    colors = [f"C{i % 10}" for i in range(len(trials))]
    named = len(trials) <= MAX_NAMED_TRIALS
    early: dict[str, list[tuple[float, float]]] = {"env_steps": [], "iteration": []}
    failed: dict[str, list[tuple[float, float]]] = {"env_steps": [], "iteration": []}
    last: dict[str, tuple[float, float]] = {}

    # The winner last, so it is drawn over the others.
    order = sorted(range(len(trials)), key=lambda i: trials[i].trial_id == best_trial_id)
    for index in order:
        trial = trials[index]
        points = list(curves.get(trial.trial_id) or [])
        best = trial.trial_id == best_trial_id
        errored = trial.status == "ERROR" or getattr(trial, "stopped", None) == STOPPED_ERROR
        label = trial_label(trial) + (" (best)" if best else "")
        for axes, x in panels:
            xs, ys = _xy(points, x)
            if not xs:
                continue
            axes.plot(
                xs,
                ys,
                color=colors[index],
                linewidth=2.6 if best else 1.3,
                alpha=1.0 if best else 0.75,
                linestyle="--" if errored else "-",
                marker="." if len(xs) <= 30 else None,
                zorder=3 if best else 2,
                label=label if (named or best) and x == "env_steps" else None,
                gid=f"trial:{trial.trial_id}",
            )
            if best:
                last[x] = (xs[-1], ys[-1])
            if errored:
                failed[x].append((xs[-1], ys[-1]))
            elif getattr(trial, "stopped", None) == STOPPED_EARLY:
                early[x].append((xs[-1], ys[-1]))

    for axes, x in panels:
        markers = (
            (
                early[x],
                EARLY_LABEL,
                "stopped-early",
                {"marker": "x", "markersize": 10, "markeredgewidth": 2.2, "color": "black"},
            ),
            (
                failed[x],
                ERROR_LABEL,
                "failed",
                {
                    "marker": "s",
                    "markersize": 8,
                    "markerfacecolor": "none",
                    "markeredgewidth": 2,
                    "color": "red",
                },
            ),
        )
        for points, label, gid, style in markers:
            if points:
                axes.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    linestyle="none",
                    zorder=4,
                    label=label if x == "env_steps" else None,
                    gid=gid,
                    **style,
                )
        if evaluation is not None:
            mean, std = float(evaluation.mean_return), float(evaluation.std_return)
            axes.axhline(mean, color="0.3", linestyle=":", linewidth=1.2, zorder=1, gid="eval-mean")
            if x in last:
                drawn = axes.errorbar(
                    [last[x][0]],
                    [mean],
                    yerr=[std],
                    fmt="D",
                    markersize=8,
                    capsize=6,
                    elinewidth=2,
                    color="black",
                    markerfacecolor="gold",
                    zorder=5,
                    label=(
                        f"held-out evaluation of the best: {mean:.1f} ± {std:.1f} "
                        f"({evaluation.episodes} episodes)"
                        if x == "env_steps"
                        else None
                    ),
                )
                drawn.lines[0].set_gid("evaluation")  # its point (a gid= would name the caps too)
        axes.grid(True, alpha=0.3)

    from matplotlib.ticker import MaxNLocator

    by_iteration.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_steps.set_xlabel("env steps sampled")
    by_iteration.set_xlabel("training iteration")
    by_steps.set_ylabel(metric)
    by_steps.set_title(f"{metric} vs env steps", fontsize=10)
    by_iteration.set_title(f"{metric} vs training iteration", fontsize=10)
    if by_steps.get_legend_handles_labels()[0]:
        by_steps.legend(fontsize=8, loc="best")
    figure.suptitle(f"{title}\n{experiment}" if experiment else title, fontsize=11)
    return figure
