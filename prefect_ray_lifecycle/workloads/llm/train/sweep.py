"""A Ray Tune sweep of the fine-tune (no Prefect): each trial is a Tune *function* trainable
that builds the same TorchTrainer as a single fine-tune (workloads.llm.train.trainer) with the
trial's learning rate and warm-up, and fits it. Ray Train V2 is the default in Ray 2.60: a
TorchTrainer handed to `Tuner(trainer)` is not supported; the trial function launches it, and
Ray Train's TuneReportCallback carries its workers' reports to Tune, where ASHA compares the
trials' held-out eval losses at its rungs and stops the weak ones.

What a trial holds: its function runs in a Tune trial actor that only drives, with a small
CPU share (`trial_cpus`: Tune refuses a trial that asks for nothing, "Cannot initialize a
ResourceRequest with an empty head and zero worker bundles"); the Train controller takes none
(Ray Train V2 schedules it with num_cpus=0 on the driver's node); the Train workers take
`workers x cpus_per_worker`. The prepared splits
are tokenized once by the sweep's driver into the object store and shared by every trial,
so no tokenize task competes with a trial's workers. `sweep_concurrency` sets how many trials
run at once so that their workers fit the cluster together.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from prefect_ray_lifecycle.compat.ray_internals import job_placement_groups
from prefect_ray_lifecycle.workloads.llm.train.settings import (
    CHECKPOINT_METRIC,
    FailureSettings,
    ResourceSettings,
    TrainSpec,
)

__all__ = [
    "SEARCHED",
    "TRAIN_RUNS",
    "TrialCheckpoint",
    "best_checkpoint",
    "eval_report_callback",
    "remove_left_groups",
    "sweep_concurrency",
    "sweep_trial",
    "trial_train_storage",
]

# The training settings a sweep may search (TrainingSettings fields).
SEARCHED = ("learning_rate", "warmup_steps")
# Each trial's Ray Train run lives under the experiment's `train/<trial id>/`.
TRAIN_RUNS = "train"
# Tune stops a trial's actor before its Train controller has shut its worker group down, and
# Ray Train's detached cleaner removes the group about a second later. A cleaner that cannot
# reach the state API gives up (several clusters on one machine: "Found multiple active Ray
# instances"), and the group then holds its CPUs after the sweep, even once its job ended.
LEFT_GROUPS_SETTLE_S = 10.0


def sweep_concurrency(
    cluster_cpus: float,
    workers: int,
    cpus_per_worker: float,
    trials: int,
    requested: int | None,
    trial_cpus: float = 0.0,
) -> tuple[int, str | None]:
    """How many trials run at once so that each trial's actor and Train workers fit the
    cluster's CPUs together (Train controllers take none); and why none can, or None."""
    per_trial = trial_cpus + workers * cpus_per_worker
    fit = math.floor(cluster_cpus / per_trial + 1e-9)
    if fit < 1:
        return 0, (
            f"resources: one trial reserves {per_trial:g} CPUs (sweep.trial_cpus "
            f"{trial_cpus:g} + resources.workers {workers} x resources.cpus_per_worker "
            f"{cpus_per_worker:g}), but the Ray cluster has {cluster_cpus:g}"
        )
    return max(1, min(fit, trials, requested or trials)), None


def remove_left_groups(before: set[str], settle_s: float = LEFT_GROUPS_SETTLE_S) -> list[str]:
    """Once a sweep has ended: the placement groups this job made since `before` that Ray has
    not removed within `settle_s` (see LEFT_GROUPS_SETTLE_S), removed; their ids."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    deadline = time.monotonic() + settle_s
    while (left := set(job_placement_groups()) - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    for group_id in sorted(left):
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
    return sorted(left)


def trial_train_storage(experiment: str, trial_id: str) -> str:
    """The folder that holds a trial's Ray Train run (its checkpoints and history)."""
    return f"{experiment.rstrip('/')}/{TRAIN_RUNS}/{trial_id}"


def eval_report_callback():
    """Ray Train's TuneReportCallback, forwarding to Tune only the reports that carry a
    held-out eval loss: Tune checks every result for the sweep's metric, and the loop reports
    every step (its loss) but evaluates every `eval_every_steps`. Built in the trial (the
    callback must be made inside a Tune session)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class EvalLossReport(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and CHECKPOINT_METRIC in metrics[0]:
                super().after_report(run_context, metrics, checkpoint)

    return EvalLossReport()


def sweep_trial(
    config: dict[str, Any],
    *,
    spec: dict[str, Any],
    datasets: dict[str, Any],
    resources: dict[str, Any],
    failures: dict[str, Any],
    experiment: str,
) -> None:
    """One trial: the fine-tune with the trial's `config` (SEARCHED settings), fitted by a
    TorchTrainer launched from here (tune.with_parameters passes the shared datasets)."""
    import ray.tune

    from prefect_ray_lifecycle.workloads.llm.train.history import HISTORY_FILE
    from prefect_ray_lifecycle.workloads.llm.train.trainer import RUN_NAME, build_trainer

    trial_id = ray.tune.get_context().get_trial_id()
    base = TrainSpec.model_validate(spec)
    training = base.training.model_validate(
        {**base.training.model_dump(), **{k: config[k] for k in SEARCHED if k in config}}
    )
    storage = trial_train_storage(experiment, trial_id)
    trainer = build_trainer(
        base.model_copy(update={"training": training}),
        datasets,
        ResourceSettings.model_validate(resources),
        FailureSettings.model_validate(failures),
        storage,
        f"{storage}/{RUN_NAME}/{HISTORY_FILE}",
        callbacks=[eval_report_callback()],
    )
    trainer.fit()


@dataclass(frozen=True)
class TrialCheckpoint:
    trial_id: str
    eval_loss: float | None
    path: str | None
    step: int


def best_checkpoint(checkpoints: list[TrialCheckpoint]) -> TrialCheckpoint | None:
    """The checkpoint with the lowest held-out eval loss over every trial (one a trial still
    keeps), or None when no trial left one."""
    ranked = [c for c in checkpoints if c.eval_loss is not None and c.path]
    return min(ranked, key=lambda c: (c.eval_loss, c.trial_id, -c.step), default=None)
