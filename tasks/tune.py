"""Prefect tasks around one Tune sweep of an RLlib algorithm (its settings: tasks.tune_config):
the Tune run itself (preflight, resume, progress), the evaluation of its best checkpoint and
the artifacts that show it in Prefect.

The Tune driver runs in the flow process (inside `RayCluster.connect()`), so its callbacks can
update Prefect artifacts and watch the flow run for cancellation.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.states import Cancelled
from pydantic import BaseModel, Field

from blocks import RayCluster
from tasks.tune_config import SweepConfig
from workloads import rllib

EXPERIMENT_NAME = "sweep"
# How often the driver asks Prefect whether the flow run is being cancelled.
CANCEL_POLL_S = 5.0


class TrialSummary(BaseModel):
    trial_id: str
    status: Literal["TERMINATED", "ERROR"]
    config: dict[str, Any] = Field(description="The searched fields' values.")
    best_return: float | None
    env_steps: int | None
    iterations: int | None
    checkpoint: str | None
    error: str | None = None


class SweepOutcome(BaseModel):
    experiment_path: str
    trials: list[TrialSummary]
    best: TrialSummary
    resumed: bool = Field(description="Whether this run resumed an earlier attempt's sweep.")
    resource_request: dict[str, float]
    dashboard_url: str | None


class EvaluationReport(BaseModel):
    episodes: int
    mean_return: float
    std_return: float
    returns: list[float]
    seeds: list[int]


def _is_cancelling(flow_run_id: str) -> bool:
    """Whether Prefect is cancelling the flow run. An unreachable API is not a cancellation:
    the sweep goes on and the next poll asks again."""
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except (httpx.HTTPError, OSError) as error:
        _log(
            f"could not read flow run {flow_run_id} to check for cancellation: {error!r}",
            warning=True,
        )
        return False
    return bool(state and state.name in ("Cancelling", "Cancelled"))


def _stop_criteria_met(criteria: dict[str, float], result: dict[str, Any]) -> bool:
    from ray.tune.utils import flatten_dict

    flat = flatten_dict(result, delimiter="/")
    return any(
        key in flat and flat[key] is not None and flat[key] >= value
        for key, value in criteria.items()
    )


class SweepStopper:
    """The stop conditions per trial, plus a stop of every trial once the flow run is being
    cancelled in Prefect (polled at most every CANCEL_POLL_S)."""

    def __init__(self, criteria: dict[str, float], flow_run_id: str | None):
        self.criteria = criteria
        self.flow_run_id = flow_run_id
        self.cancelled = False
        self._last_poll = 0.0

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return _stop_criteria_met(self.criteria, result)

    def stop_all(self) -> bool:
        now = time.monotonic()
        if self.flow_run_id and not self.cancelled and now - self._last_poll >= CANCEL_POLL_S:
            self._last_poll = now
            self.cancelled = _is_cancelling(self.flow_run_id)
        return self.cancelled


def _as_tune_stopper(stopper: SweepStopper):
    """Tune only accepts its own Stopper subclasses; wrap ours in one (built lazily so the
    module imports without Ray)."""
    from ray.tune.stopper import Stopper

    class _Stopper(Stopper):
        def __init__(self, inner: SweepStopper):
            self.inner = inner

        def __call__(self, trial_id, result):
            return self.inner(trial_id, result)

        def stop_all(self):
            return self.inner.stop_all()

    return _Stopper(stopper)


def _log(message: str, warning: bool = False) -> None:
    logger = get_run_logger()
    (logger.warning if warning else logger.info)(message)


def _flat_get(result: dict[str, Any], key: str) -> Any:
    for part in key.split("/"):
        result = result.get(part, {}) if isinstance(result, dict) else {}
    return None if result == {} else result


def _progress_callback(key: str):
    """A Tune callback that keeps a Prefect progress artifact at the share of finished trials."""
    from ray.tune import Callback

    class ProgressArtifact(Callback):
        def setup(self, total_num_samples=None, **info):
            self.total = total_num_samples or 0
            self.artifact_id = None

        def _update(self, trials, finishing=None):
            # Tune calls the hooks before it marks the finishing trial as done.
            done = len(
                {t.trial_id for t in trials if t.status in ("TERMINATED", "ERROR")}
                | ({finishing.trial_id} if finishing is not None else set())
            )
            total = max(self.total, len(trials), 1)
            progress = 100.0 * done / total
            description = f"{done} of {total} trials finished"
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(
                    progress, key=key, description=description
                )
            else:
                update_progress_artifact(self.artifact_id, progress, description=description)

        def on_trial_start(self, iteration, trials, trial, **info):
            if self.artifact_id is None:
                self._update(trials)

        def on_trial_complete(self, iteration, trials, trial, **info):
            result = trial.last_result or {}
            _log(
                f"trial {trial.trial_id} finished after {result.get('training_iteration')} "
                f"iterations: {rllib.RETURN_METRIC}="
                f"{_flat_get(result, rllib.RETURN_METRIC)}"
            )
            self._update(trials, trial)

        def on_trial_error(self, iteration, trials, trial, **info):
            _log(f"trial {trial.trial_id} failed for good (no retries left)")
            self._update(trials, trial)

    return ProgressArtifact()


def experiment_path(storage_root: str, flow_run_id: str | None) -> Path:
    """Where a flow run's sweep lives: the same flow run (retry, re-run) finds it again."""
    return (
        Path(storage_root).expanduser().resolve() / (flow_run_id or "no-flow-run") / EXPERIMENT_NAME
    )


def _trial_id_from_dir(path: str) -> str:
    """Tune names trial dirs '<trainable>_<env>_<trial id>_<index>_<params>_<time>'."""
    match = re.search(r"_([0-9a-f]{5}_\d{5})_", Path(path).name)
    return match.group(1) if match else Path(path).name


def _summarise(result, metric: str, search_keys: list[str]) -> TrialSummary:
    frame = result.metrics_dataframe
    returns = frame[metric].dropna() if frame is not None and metric in frame else None
    best_return = float(returns.max()) if returns is not None and len(returns) else None
    metrics = result.metrics or {}  # None for a trial that never reported
    params = Path(result.path) / "params.json"
    config = result.config or (json.loads(params.read_text()) if params.is_file() else {})
    steps = metrics.get(rllib.ENV_STEPS_METRIC)
    checkpoint = None
    if result.best_checkpoints:
        try:
            checkpoint = result.get_best_checkpoint(metric, "max").path
        except (RuntimeError, KeyError):
            checkpoint = result.checkpoint.path if result.checkpoint else None
    elif result.checkpoint:
        checkpoint = result.checkpoint.path
    error = None
    if result.error is not None:
        error = str(result.error).strip().splitlines()[-1][:500]
    return TrialSummary(
        trial_id=str(metrics.get("trial_id") or _trial_id_from_dir(result.path)),
        status="ERROR" if result.error is not None else "TERMINATED",
        config={key: config.get(key) for key in search_keys},
        best_return=best_return if best_return is None or math.isfinite(best_return) else None,
        env_steps=int(steps) if steps is not None else None,
        iterations=metrics.get("training_iteration"),
        checkpoint=checkpoint,
        error=error,
    )


def _tuner(
    sweep: SweepConfig,
    param_space: dict[str, Any],
    path: Path,
    flow_run_id: str | None,
    progress_key: str,
):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if Path(path).is_dir() and tune.Tuner.can_restore(str(path)):
        return tune.Tuner.restore(
            str(path), trainable=sweep.algorithm, resume_errored=True, param_space=param_space
        ), True
    settings = sweep.scheduler
    scheduler = (
        ASHAScheduler(
            time_attr="training_iteration",
            max_t=settings.max_iterations,
            grace_period=settings.grace_period,
            reduction_factor=settings.reduction_factor,
        )
        if settings.kind == "asha"
        else FIFOScheduler()
    )
    tuner = tune.Tuner(
        sweep.algorithm,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode="max",
            num_samples=sweep.num_samples,
            max_concurrent_trials=sweep.max_concurrent_trials,
            scheduler=scheduler,
            time_budget_s=sweep.stop.sweep_seconds,
        ),
        run_config=tune.RunConfig(
            name=path.name,
            storage_path=str(path.parent),
            stop=_as_tune_stopper(SweepStopper(sweep.stop.criteria(), flow_run_id)),
            checkpoint_config=tune.CheckpointConfig(
                num_to_keep=sweep.checkpoints.keep,
                checkpoint_score_attribute=sweep.checkpoints.metric,
                checkpoint_score_order="max",
                checkpoint_frequency=sweep.checkpoints.every_iterations,
                checkpoint_at_end=True,
            ),
            failure_config=tune.FailureConfig(max_failures=sweep.max_failures),
            callbacks=[_progress_callback(progress_key)],
            verbose=0,
        ),  # Tune's own report prints the whole config dict
    )
    return tuner, False


def preflight(config) -> dict[str, float]:
    """Fail at once when one trial can never be scheduled on the connected cluster."""
    import ray  # lazy like ray.tune: loading the flow definitions needs no Ray

    request = rllib.resource_request(config)
    reason = rllib.unschedulable_reason(request, ray.cluster_resources())
    if reason:
        raise ValueError(f"preflight: {reason}")
    return request


@task(name="run-tune-sweep")
def run_sweep(sweep: SweepConfig, cluster: RayCluster, storage_root: str) -> SweepOutcome:
    """Run (or resume) this flow run's Tune sweep on the cluster; raise if a trial failed
    beyond max_failures. A Cancelled state when the flow run was cancelled meanwhile."""
    flow_run_id = flow_run.id
    path = experiment_path(storage_root, flow_run_id)
    with cluster.connect() as context:
        env_name = rllib.register_environment(sweep.environment)
        config = rllib.build_config(
            sweep.algorithm,
            env_name,
            sweep.env_config,
            sweep.resources.to_workload(),
            sweep.seed,
            sweep.hyperparameters,
        )
        request = preflight(config)
        param_space = rllib.param_space(config, rllib.parse_search_space(sweep.search_space))
        tuner, resumed = _tuner(sweep, param_space, path, flow_run_id, "tune-sweep-progress")
        results = tuner.fit()
        dashboard = (context.dashboard_url if context else None) or cluster.dashboard_url
    if flow_run_id and _is_cancelling(flow_run_id):
        # A Cancelled state (not an exception): the flow ends its run Cancelled with it.
        return Cancelled(
            message=f"flow run {flow_run_id} was cancelled; its sweep stopped at {path}"
        )
    trials = [_summarise(r, sweep.metric, list(sweep.search_space)) for r in results]
    failed = [t for t in trials if t.status == "ERROR"]
    if failed:
        raise RuntimeError(
            f"trial {failed[0].trial_id} failed after {sweep.max_failures} "
            f"retries: {failed[0].error}"
        )
    ranked = [t for t in trials if t.best_return is not None and t.checkpoint]
    if not ranked:
        raise RuntimeError(f"no trial of {path} reported {sweep.metric} with a checkpoint")
    best = max(ranked, key=lambda t: t.best_return)
    if dashboard and not dashboard.startswith("http"):
        dashboard = f"http://{dashboard}"
    return SweepOutcome(
        experiment_path=str(path),
        trials=trials,
        best=best,
        resumed=resumed,
        resource_request=request,
        dashboard_url=dashboard,
    )


@task(name="evaluate-checkpoint")
def evaluate(
    checkpoint: str, environment: str, env_config: dict[str, Any], episodes: int, seed: int
) -> EvaluationReport:
    """Greedy episodes of the checkpoint's RLModule alone, on held-out seeds."""
    evaluation = rllib.evaluate_checkpoint(
        checkpoint, environment, env_config, episodes=episodes, seed=seed
    )
    return EvaluationReport(**evaluation.__dict__)


@task(name="publish-sweep")
def publish(outcome: SweepOutcome, evaluation: EvaluationReport) -> None:
    """A table of every trial and a markdown summary of the best one."""
    create_table_artifact(
        key="tune-sweep-trials",
        table=[
            {
                "trial": t.trial_id,
                "status": t.status,
                "config": t.config,
                "best_return": t.best_return,
                "env_steps": t.env_steps,
                "iterations": t.iterations,
                "checkpoint": t.checkpoint,
            }
            for t in outcome.trials
        ],
        description="Every trial of the sweep",
    )
    best = outcome.best
    create_markdown_artifact(
        key="tune-sweep-best",
        markdown=(
            f"## Best trial `{best.trial_id}`\n\n"
            f"- config: `{best.config}`\n"
            f"- best return: {best.best_return:.1f} after {best.env_steps} env steps\n"
            f"- evaluation: {evaluation.mean_return:.1f} ± {evaluation.std_return:.1f} "
            f"over {evaluation.episodes} held-out episodes\n"
            f"- checkpoint: `{best.checkpoint}`\n"
            f"- experiment: `{outcome.experiment_path}`"
            f"{' (resumed)' if outcome.resumed else ''}\n"
            f"- Ray dashboard: {outcome.dashboard_url or 'unknown'}\n"
        ),
        description="Best trial of the sweep",
    )
