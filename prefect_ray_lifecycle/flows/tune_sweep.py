"""A Tune sweep of an RLlib agent as a Prefect flow: run (or resume) the sweep, evaluate the
best checkpoint's RLModule on held-out seeds, publish what happened (trial table, best trial,
a chart of every trial's learning curve), record the experiment.

The Tune driver runs in the flow process. Cancelling the flow run in Prefect stops Tune and
its trials (polled by the driver; a worker's SIGTERM ends the driver, and Ray its trials)."""

from __future__ import annotations

from typing import Annotated, Any

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.tasks import lineage
from prefect_ray_lifecycle.tasks.params import Text
from prefect_ray_lifecycle.tasks.tune.config import DEFAULT_STORAGE_ROOT, SweepConfig
from prefect_ray_lifecycle.tasks.tune.sweep import EvaluationReport, TrialSummary, run_sweep


class SweepResult(BaseModel):
    best_config: dict[str, Any] = Field(description="The best trial's searched fields.")
    metrics: dict[str, Any] = Field(description="The best trial's return, env steps, iterations.")
    checkpoint_path: str = Field(
        description="The best trial's best checkpoint on this machine (a copy when the "
        "storage is remote)."
    )
    experiment_path: str = Field(description="The Tune experiment: a folder or a storage URI.")
    evaluation: EvaluationReport = Field(description="Greedy held-out episodes of the checkpoint.")
    trials: list[TrialSummary] = Field(description="Every trial of the sweep.")
    resumed: bool = Field(description="Whether this run resumed an earlier attempt's sweep.")
    curves: dict[str, list[dict[str, Any]]] = Field(
        default_factory=dict,
        description="Trial id -> its learning curve: points {iteration, env_steps, return}.",
    )
    chart_path: str | None = Field(
        default=None,
        description="The sweep's chart (PNG) on this machine, for registration to log; None "
        "when it could not be drawn.",
    )


@flow(name="tune-sweep", log_prints=True)
def tune_sweep(
    sweep: SweepConfig | None = None,
    ray_cluster: RayCluster | None = None,
    storage_root: Text = DEFAULT_STORAGE_ROOT,
    evaluation_episodes: Annotated[int, Field(ge=1)] = 10,
    asset_deps: list[str] | None = None,
) -> SweepResult:
    """Sweep an RLlib algorithm with Tune, then evaluate and publish the best checkpoint.

    Args:
        sweep: What to train, what to search and how trials run; empty: PPO on CartPole.
        ray_cluster: Where to run; an embedded local Ray when empty.
        storage_root: Where sweeps live: a folder every Ray node reaches (NFS, a shared
            volume) or a pyarrow filesystem URI (s3://bucket/prefix, gs://..., file://...);
            a flow run's sweep lives under its id, so a retry or re-run of it resumes it.
        evaluation_episodes: Held-out greedy episodes to evaluate the best checkpoint.
        asset_deps: Prefect asset keys the sweep trained on (e.g. a data-prep dataset's
            asset_key); the experiment asset records them as its upstream.
    """
    sweep = sweep or SweepConfig()
    swept = run_sweep(
        sweep, ray_cluster or RayCluster(), storage_root, evaluation_episodes, return_state=True
    )
    if swept.is_cancelled():
        return swept  # cancelled in Prefect: Tune stopped its trials; end the run Cancelled
    outcome = swept.result()
    evaluation = outcome.evaluation
    best = outcome.best
    lineage.record_experiment(
        outcome.experiment_path,
        deps=list(asset_deps or []),
        metadata={
            "flow_run_id": str(flow_run.id),
            "best_trial_id": best.trial_id,
            "best_return": best.best_return,
            "eval_mean_return": evaluation.mean_return,
            "trials": len(outcome.trials),
            "algorithm": sweep.algorithm,
            "environment": sweep.environment,
        },
    )
    return SweepResult(
        best_config=best.config,
        metrics={
            "best_return": best.best_return,
            "env_steps": best.env_steps,
            "iterations": best.iterations,
            "trial_id": best.trial_id,
            "flow_run_id": str(flow_run.id),
        },
        checkpoint_path=outcome.checkpoint_path,
        experiment_path=outcome.experiment_path,
        evaluation=evaluation,
        trials=outcome.trials,
        resumed=outcome.resumed,
        curves=outcome.curves,
        chart_path=outcome.chart_path,
    )
