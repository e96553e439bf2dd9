"""One Tune trial as the sweep reports it: its summary (best return, checkpoint, why it
stopped), its learning curve for the chart, the trial table's rows; and the ASHA scheduler
that records which trials it stopped early."""

from __future__ import annotations

import contextvars
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from prefect_ray_lifecycle.tasks.tune import storage as tune_storage
from prefect_ray_lifecycle.tasks.tune.chart import STOPPED_EARLY, STOPPED_ERROR
from prefect_ray_lifecycle.tasks.tune.config import StopConditions, SweepConfig
from prefect_ray_lifecycle.workloads.rl import rllib

__all__ = [
    "EARLY_STOPS",
    "TrialSummary",
    "criteria_met",
    "curve",
    "recording_asha",
    "stop_criteria_met",
    "stopped_because",
    "summarise",
    "trial_rows",
]


class TrialSummary(BaseModel):
    trial_id: str
    status: Literal["TERMINATED", "ERROR"]
    config: dict[str, Any] = Field(description="The searched fields' values.")
    best_return: float | None
    env_steps: int | None
    iterations: int | None
    checkpoint: str | None = Field(description="Its best checkpoint: a path, or a storage URI.")
    error: str | None = None
    stopped: str = Field(
        default="unknown",
        description=(
            "Why it stopped: 'error'; 'stop condition (<field>)' when its last result met that "
            f"stop condition; '{STOPPED_EARLY}' when ASHA cut it before max_iterations; "
            "'max iterations' (ASHA's max_iterations); 'sweep time budget'; 'no results' "
            "(never reported); 'completed' otherwise."
        ),
    )


def criteria_met(criteria: dict[str, float], result: dict[str, Any]) -> list[str]:
    """The keys of `criteria` that `result` (nested, as Tune reports it) meets."""
    from ray.tune.utils import flatten_dict

    flat = flatten_dict(result, delimiter="/")
    return [
        key
        for key, value in criteria.items()
        if key in flat and flat[key] is not None and flat[key] >= value
    ]


def stop_criteria_met(criteria: dict[str, float], result: dict[str, Any]) -> bool:
    return bool(criteria_met(criteria, result))


# The trials ASHA stopped before max_iterations in the sweep this thread drives. Tune pickles
# its scheduler with the experiment and a resumed sweep runs the unpickled one, so the
# scheduler finds the live set here (none where Tune's driver runs elsewhere: Ray Client).
EARLY_STOPS: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "tune_sweep_early_stops", default=None
)


def record_early_stop(trial_id: str) -> None:
    stops = EARLY_STOPS.get()
    if stops is not None:
        stops.add(trial_id)


def recording_asha(settings):
    """Tune's ASHA, recording the trials it stops before max_t (built lazily: no Ray import)."""
    from ray.tune.schedulers import ASHAScheduler

    class _RecordingASHA(ASHAScheduler):
        def on_trial_result(self, tune_controller, trial, result):
            decision = super().on_trial_result(tune_controller, trial, result)
            # Tune only asks the scheduler about results that met no stop condition.
            if decision == self.STOP and result.get(self._time_attr, 0) < self._max_t:
                record_early_stop(trial.trial_id)
            return decision

    return _RecordingASHA(
        time_attr="training_iteration",
        max_t=settings.max_iterations,
        grace_period=settings.grace_period,
        reduction_factor=settings.reduction_factor,
    )


def trial_id_from_dir(path: str) -> str:
    """Tune names trial dirs '<trainable>_<env>_<trial id>_<index>_<params>_<time>'."""
    match = re.search(r"_([0-9a-f]{5}_\d{5})_", Path(path).name)
    return match.group(1) if match else Path(path).name


def curve(frame, metric: str) -> list[dict[str, Any]]:
    """The trial's learning curve: one point per iteration with a finite `metric` (an
    iteration that finished no episode has none), the last report of an iteration kept."""
    if frame is None or metric not in frame or "training_iteration" not in frame:
        return []
    frame = frame.drop_duplicates("training_iteration", keep="last").sort_values(
        "training_iteration"
    )
    steps = (
        frame[rllib.ENV_STEPS_METRIC].tolist()
        if rllib.ENV_STEPS_METRIC in frame
        else [None] * len(frame)
    )
    points = []
    for iteration, env_steps, value in zip(
        frame["training_iteration"].tolist(), steps, frame[metric].tolist(), strict=True
    ):
        try:
            value = float(value)
            env_steps = float(env_steps) if env_steps is not None else math.nan
        except (TypeError, ValueError):
            continue
        if not math.isfinite(value):
            continue
        points.append(
            {
                "iteration": int(iteration),
                "env_steps": int(env_steps) if math.isfinite(env_steps) else None,
                "return": value,
            }
        )
    return points


def stopped_because(
    sweep: SweepConfig,
    trial_id: str,
    errored: bool,
    metrics: dict[str, Any],
    early_stops: set[str],
    budget_spent: bool,
) -> str:
    """Why a trial stopped, as far as its last result and this sweep's run can tell."""
    if errored:
        return STOPPED_ERROR
    iterations = metrics.get("training_iteration")
    if iterations is None:
        return "sweep time budget" if budget_spent else "no results"
    fields = {key: field for field, key in StopConditions.result_keys().items()}
    met = criteria_met(sweep.stop.criteria(), metrics)
    if met:
        return f"stop condition ({', '.join(fields.get(key, key) for key in met)})"
    asha = sweep.scheduler.kind == "asha"
    if trial_id in early_stops:
        return STOPPED_EARLY
    if asha and iterations >= sweep.scheduler.max_iterations:
        return "max iterations"
    if budget_spent:
        return "sweep time budget"
    if asha:
        # Not seen by this run (stopped before a resume, or Tune's driver ran elsewhere):
        # nothing but ASHA stops a trial short of max_iterations with no condition met.
        return STOPPED_EARLY
    return "completed"


def summarise(
    result,
    sweep: SweepConfig,
    experiment: str,
    early_stops: set[str] | None = None,
    budget_spent: bool = False,
):
    """The trial's summary, its best checkpoint (a ray.tune.Checkpoint) or None, and its
    learning curve."""
    metric, search_keys = sweep.metric, list(sweep.search_space)
    frame = result.metrics_dataframe
    returns = frame[metric].dropna() if frame is not None and metric in frame else None
    best_return = float(returns.max()) if returns is not None and len(returns) else None
    metrics = result.metrics or {}  # None for a trial that never reported
    params = Path(result.path) / "params.json"
    config = result.config or (json.loads(params.read_text()) if params.is_file() else {})
    steps = metrics.get(rllib.ENV_STEPS_METRIC)
    checkpoint = result.checkpoint
    if result.best_checkpoints:
        try:
            checkpoint = result.get_best_checkpoint(metric, "max")
        except (RuntimeError, KeyError):
            pass
    error = None
    if result.error is not None:
        error = str(result.error).strip().splitlines()[-1][:500]
    trial_id = str(metrics.get("trial_id") or trial_id_from_dir(result.path))
    summary = TrialSummary(
        trial_id=trial_id,
        status="ERROR" if result.error is not None else "TERMINATED",
        config={key: config.get(key) for key in search_keys},
        best_return=best_return if best_return is None or math.isfinite(best_return) else None,
        env_steps=int(steps) if steps is not None else None,
        iterations=metrics.get("training_iteration"),
        checkpoint=tune_storage.checkpoint_location(checkpoint, experiment) if checkpoint else None,
        error=error,
        stopped=stopped_because(
            sweep, trial_id, result.error is not None, metrics, early_stops or set(), budget_spent
        ),
    )
    return summary, checkpoint, curve(frame, metric)


def trial_rows(trials: list[TrialSummary]) -> list[dict[str, Any]]:
    return [
        {
            "trial": t.trial_id,
            "status": t.status,
            "config": t.config,
            "best_return": t.best_return,
            "env_steps": t.env_steps,
            "iterations": t.iterations,
            "stopped": t.stopped,
            "checkpoint": t.checkpoint,
        }
        for t in trials
    ]
