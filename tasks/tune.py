"""Prefect tasks around one Tune sweep of an RLlib algorithm (its settings: tasks.tune_config):
the Tune run itself (preflight, resume, progress), the held-out evaluation of its best
checkpoint and the artifacts that show it in Prefect (tasks.tune_report).

The Tune driver runs in the flow process (inside `RayCluster.connect()`), so its callbacks can
update Prefect artifacts and watch the flow run for cancellation. Through Ray Client (ray://)
Tune runs its driver on the cluster instead, where those callbacks do nothing.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.states import Cancelled
from pydantic import BaseModel, Field

from blocks import RayCluster
from tasks import tune_storage
from tasks.tune_config import SweepConfig
from tasks.tune_report import SweepReport, log, progress_callback
from workloads import rllib

# How often the driver asks Prefect whether the flow run is being cancelled.
CANCEL_POLL_S = 5.0
# How long preflight waits for a Ray worker to try importing the env creator.
PREFLIGHT_TIMEOUT_S = 60.0


class TrialSummary(BaseModel):
    trial_id: str
    status: Literal["TERMINATED", "ERROR"]
    config: dict[str, Any] = Field(description="The searched fields' values.")
    best_return: float | None
    env_steps: int | None
    iterations: int | None
    checkpoint: str | None = Field(description="Its best checkpoint: a path, or a storage URI.")
    error: str | None = None


class EvaluationReport(BaseModel):
    episodes: int
    mean_return: float
    std_return: float
    returns: list[float]
    seeds: list[int]


class SweepOutcome(BaseModel):
    experiment_path: str
    trials: list[TrialSummary]
    best: TrialSummary
    checkpoint_path: str = Field(
        description="The best checkpoint on this machine (a copy when remote)."
    )
    evaluation: EvaluationReport = Field(
        description="Greedy held-out episodes of the best checkpoint."
    )
    resumed: bool = Field(description="Whether this run resumed an earlier attempt's sweep.")
    resource_request: dict[str, float]
    dashboard_url: str | None


def _is_cancelling(flow_run_id: str) -> bool:
    """Whether Prefect is cancelling the flow run. An unreachable API is not a cancellation:
    the sweep goes on and the next poll asks again."""
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except (httpx.HTTPError, OSError) as error:
        log(
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


class CancelWatch:
    """Whether Prefect is cancelling the flow run, polled at most every CANCEL_POLL_S."""

    def __init__(self, flow_run_id: str | None):
        self.flow_run_id = flow_run_id
        self.cancelled = False
        self._last_poll = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if self.flow_run_id and not self.cancelled and now - self._last_poll >= CANCEL_POLL_S:
            self._last_poll = now
            self.cancelled = _is_cancelling(self.flow_run_id)
        return self.cancelled


# The watch of the sweep this thread drives. Tune pickles its stopper with the experiment and
# a resumed sweep runs the unpickled one, so the stopper finds the live watch here.
_WATCH: contextvars.ContextVar[CancelWatch | None] = contextvars.ContextVar(
    "tune_sweep_cancel_watch", default=None
)


class SweepStopper:
    """The stop conditions per trial, plus a stop of every trial once the flow run driving
    this thread's sweep is being cancelled in Prefect."""

    def __init__(self, criteria: dict[str, float]):
        self.criteria = criteria

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return _stop_criteria_met(self.criteria, result)

    def stop_all(self) -> bool:
        watch = _WATCH.get()
        return watch is not None and watch()


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


def _trial_id_from_dir(path: str) -> str:
    """Tune names trial dirs '<trainable>_<env>_<trial id>_<index>_<params>_<time>'."""
    match = re.search(r"_([0-9a-f]{5}_\d{5})_", Path(path).name)
    return match.group(1) if match else Path(path).name


def _summarise(result, metric: str, search_keys: list[str], experiment: str):
    """The trial's summary, and its best checkpoint (a ray.tune.Checkpoint) or None."""
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
    summary = TrialSummary(
        trial_id=str(metrics.get("trial_id") or _trial_id_from_dir(result.path)),
        status="ERROR" if result.error is not None else "TERMINATED",
        config={key: config.get(key) for key in search_keys},
        best_return=best_return if best_return is None or math.isfinite(best_return) else None,
        env_steps=int(steps) if steps is not None else None,
        iterations=metrics.get("training_iteration"),
        checkpoint=tune_storage.checkpoint_location(checkpoint, experiment) if checkpoint else None,
        error=error,
    )
    return summary, checkpoint


def _tuner(sweep: SweepConfig, param_space: dict[str, Any], path: str):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if tune.Tuner.can_restore(path):
        return tune.Tuner.restore(
            path, trainable=sweep.algorithm, resume_errored=True, param_space=param_space
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
    storage_path, name = tune_storage.split_experiment(path)
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
            name=name,
            storage_path=storage_path,
            stop=_as_tune_stopper(SweepStopper(sweep.stop.criteria())),
            checkpoint_config=tune.CheckpointConfig(
                num_to_keep=sweep.checkpoints.keep,
                checkpoint_score_attribute=sweep.checkpoints.metric,
                checkpoint_score_order="max",
                checkpoint_frequency=sweep.checkpoints.every_iterations,
                checkpoint_at_end=True,
            ),
            failure_config=tune.FailureConfig(max_failures=sweep.max_failures),
            callbacks=[progress_callback()],
            verbose=0,  # Tune's own report prints the whole config dict
        ),
    )
    return tuner, False


def preflight(config, environment: str) -> dict[str, float]:
    """Fail at once when one trial can never be scheduled on the connected cluster, or when
    the cluster's workers cannot import the env creator (not shipped in the runtime_env)."""
    import ray  # lazy like ray.tune: loading the flow definitions needs no Ray
    from ray.exceptions import GetTimeoutError, RuntimeEnvSetupError

    request = rllib.resource_request(config)
    reason = rllib.unschedulable_reason(request, ray.cluster_resources())
    if reason:
        raise ValueError(f"preflight: {reason}")
    if rllib.is_creator(environment):
        check = ray.remote(num_cpus=0)(rllib.creator_problem).options(name="preflight-env")
        try:
            problem = ray.get(check.remote(environment), timeout=PREFLIGHT_TIMEOUT_S)
        except RuntimeEnvSetupError as error:
            raise ValueError(
                f"preflight: the cluster could not set up the runtime_env: {error}"
            ) from None
        except GetTimeoutError:
            raise ValueError(
                f"preflight: no Ray worker could check environment {environment!r} "
                f"within {PREFLIGHT_TIMEOUT_S:g}s"
            ) from None
        if problem:
            raise ValueError(
                f"preflight: on the Ray cluster, {problem}; ship the module with the "
                f"RayCluster block's runtime_env (working_dir or py_modules)"
            )
    return request


def _evaluate(checkpoint: str, sweep: SweepConfig, episodes: int) -> EvaluationReport:
    evaluation = rllib.evaluate_checkpoint(
        checkpoint, sweep.environment, sweep.env_config, episodes=episodes, seed=sweep.seed
    )
    return EvaluationReport(**evaluation.__dict__)


@task(name="run-tune-sweep", cache_policy=NO_CACHE)  # a sweep is never reused by inputs
def run_sweep(
    sweep: SweepConfig, cluster: RayCluster, storage_root: str, evaluation_episodes: int
) -> SweepOutcome:
    """Run (or resume) this flow run's Tune sweep on the cluster and evaluate its best
    checkpoint on held-out seeds; raise if a trial failed beyond max_failures. A Cancelled
    state when the flow run was cancelled meanwhile."""
    flow_run_id = flow_run.id
    tune_storage.check_storage_root(storage_root)
    if problem := rllib.creator_problem(sweep.environment):
        # Before any Ray work: the best checkpoint is evaluated in this process.
        raise ValueError(f"preflight: in the flow process, {problem}")
    path = tune_storage.experiment_path(storage_root, flow_run_id)
    watch = CancelWatch(flow_run_id)
    watching = _WATCH.set(watch)
    try:
        return _sweep(sweep, cluster, path, evaluation_episodes, watch)
    finally:
        _WATCH.reset(watching)


def _sweep(
    sweep: SweepConfig, cluster: RayCluster, path: str, evaluation_episodes: int, watch: CancelWatch
) -> SweepOutcome:
    flow_run_id = watch.flow_run_id
    with SweepReport() as report, ThreadPoolExecutor(1) as evaluator:
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
            request = preflight(config, sweep.environment)
            param_space = rllib.param_space(config, rllib.parse_search_space(sweep.search_space))
            tuner, resumed = _tuner(sweep, param_space, path)
            results = tuner.fit()
            dashboard = (context.dashboard_url if context else None) or cluster.dashboard_url
            if watch.cancelled:
                # A Cancelled state (not an exception): the flow ends its run Cancelled with it.
                return Cancelled(
                    message=f"flow run {flow_run_id} was cancelled; its sweep stopped at {path}"
                )
            summaries = [
                _summarise(r, sweep.metric, list(sweep.search_space), path) for r in results
            ]
            trials = [summary for summary, _ in summaries]
            report.trials(_trial_rows(trials))
            best, checkpoint = _best(summaries, sweep, path)
            local = tune_storage.local_checkpoint(checkpoint, flow_run_id, best.trial_id)
            # Evaluated while Ray shuts down: it reads the checkpoint and needs no Ray.
            evaluation = evaluator.submit(
                contextvars.copy_context().run, _evaluate, local, sweep, evaluation_episodes
            )
        evaluation = evaluation.result()
        if dashboard and not dashboard.startswith("http"):
            dashboard = f"http://{dashboard}"
        outcome = SweepOutcome(
            experiment_path=path,
            trials=trials,
            best=best,
            checkpoint_path=local,
            evaluation=evaluation,
            resumed=resumed,
            resource_request=request,
            dashboard_url=dashboard,
        )
        report.best(_best_markdown(outcome))
    return outcome


def _best(summaries, sweep: SweepConfig, path: str):
    failed = [t for t, _ in summaries if t.status == "ERROR"]
    if failed:
        raise RuntimeError(
            f"trial {failed[0].trial_id} failed after {sweep.max_failures} "
            f"retries: {failed[0].error}"
        )
    ranked = [(t, c) for t, c in summaries if t.best_return is not None and c is not None]
    if not ranked:
        raise RuntimeError(f"no trial of {path} reported {sweep.metric} with a checkpoint")
    return max(ranked, key=lambda pair: pair[0].best_return)


def _trial_rows(trials: list[TrialSummary]) -> list[dict[str, Any]]:
    return [
        {
            "trial": t.trial_id,
            "status": t.status,
            "config": t.config,
            "best_return": t.best_return,
            "env_steps": t.env_steps,
            "iterations": t.iterations,
            "checkpoint": t.checkpoint,
        }
        for t in trials
    ]


def _best_markdown(outcome: SweepOutcome) -> str:
    best, evaluation = outcome.best, outcome.evaluation
    return (
        f"## Best trial `{best.trial_id}`\n\n"
        f"- config: `{best.config}`\n"
        f"- best return: {best.best_return:.1f} after {best.env_steps} env steps\n"
        f"- evaluation: {evaluation.mean_return:.1f} ± {evaluation.std_return:.1f} "
        f"over {evaluation.episodes} held-out episodes\n"
        f"- checkpoint: `{best.checkpoint}`\n"
        f"- experiment: `{outcome.experiment_path}`"
        f"{' (resumed)' if outcome.resumed else ''}\n"
        f"- Ray dashboard: {outcome.dashboard_url or 'unknown'}\n"
    )
