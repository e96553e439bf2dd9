"""Prefect tasks around one Tune sweep of an RLlib algorithm (its settings: tasks.tune_config):
the Tune run itself (preflight, resume, progress), the held-out evaluation of its best
checkpoint, the sweep's chart (tasks.sweep_chart) and the artifacts that show it in Prefect
(tasks.tune_report).

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
from tasks.charts import save_png
from tasks.sweep_chart import STOPPED_EARLY, STOPPED_ERROR, draw_sweep
from tasks.tune_config import StopConditions, SweepConfig
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
    stopped: str = Field(
        default="unknown",
        description=(
            "Why it stopped: 'error'; 'stop condition (<field>)' when its last result met that "
            f"stop condition; '{STOPPED_EARLY}' when ASHA cut it before max_iterations; "
            "'max iterations' (ASHA's max_iterations); 'sweep time budget'; 'no results' "
            "(never reported); 'completed' otherwise."
        ),
    )


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
    curves: dict[str, list[dict[str, Any]]] = Field(
        default_factory=dict,
        description="Trial id -> its learning curve: points {iteration, env_steps, return}.",
    )
    chart_path: str | None = Field(
        default=None, description="The sweep's chart (PNG) on this machine; None if not drawn."
    )


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


def _criteria_met(criteria: dict[str, float], result: dict[str, Any]) -> list[str]:
    """The keys of `criteria` that `result` (nested, as Tune reports it) meets."""
    from ray.tune.utils import flatten_dict

    flat = flatten_dict(result, delimiter="/")
    return [
        key
        for key, value in criteria.items()
        if key in flat and flat[key] is not None and flat[key] >= value
    ]


def _stop_criteria_met(criteria: dict[str, float], result: dict[str, Any]) -> bool:
    return bool(_criteria_met(criteria, result))


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


# The trials ASHA stopped before max_iterations in the sweep this thread drives. Tune pickles
# its scheduler with the experiment and a resumed sweep runs the unpickled one, so the
# scheduler finds the live set here (none where Tune's driver runs elsewhere: Ray Client).
_EARLY_STOPS: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "tune_sweep_early_stops", default=None
)


def _record_early_stop(trial_id: str) -> None:
    stops = _EARLY_STOPS.get()
    if stops is not None:
        stops.add(trial_id)


def _asha(settings):
    """Tune's ASHA, recording the trials it stops before max_t (built lazily: no Ray import)."""
    from ray.tune.schedulers import ASHAScheduler

    class _RecordingASHA(ASHAScheduler):
        def on_trial_result(self, tune_controller, trial, result):
            decision = super().on_trial_result(tune_controller, trial, result)
            # Tune only asks the scheduler about results that met no stop condition.
            if decision == self.STOP and result.get(self._time_attr, 0) < self._max_t:
                _record_early_stop(trial.trial_id)
            return decision

    return _RecordingASHA(
        time_attr="training_iteration",
        max_t=settings.max_iterations,
        grace_period=settings.grace_period,
        reduction_factor=settings.reduction_factor,
    )


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


def _curve(frame, metric: str) -> list[dict[str, Any]]:
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


def _stopped(
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
    met = _criteria_met(sweep.stop.criteria(), metrics)
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


def _summarise(
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
    trial_id = str(metrics.get("trial_id") or _trial_id_from_dir(result.path))
    summary = TrialSummary(
        trial_id=trial_id,
        status="ERROR" if result.error is not None else "TERMINATED",
        config={key: config.get(key) for key in search_keys},
        best_return=best_return if best_return is None or math.isfinite(best_return) else None,
        env_steps=int(steps) if steps is not None else None,
        iterations=metrics.get("training_iteration"),
        checkpoint=tune_storage.checkpoint_location(checkpoint, experiment) if checkpoint else None,
        error=error,
        stopped=_stopped(
            sweep, trial_id, result.error is not None, metrics, early_stops or set(), budget_spent
        ),
    )
    return summary, checkpoint, _curve(frame, metric)


def _tuner(sweep: SweepConfig, param_space: dict[str, Any], path: str):
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    if tune.Tuner.can_restore(path):
        return tune.Tuner.restore(
            path, trainable=sweep.algorithm, resume_errored=True, param_space=param_space
        ), True
    scheduler = _asha(sweep.scheduler) if sweep.scheduler.kind == "asha" else FIFOScheduler()
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
    recording = _EARLY_STOPS.set(set())
    try:
        return _sweep(sweep, cluster, path, evaluation_episodes, watch)
    finally:
        _EARLY_STOPS.reset(recording)
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
            started = time.monotonic()
            results = tuner.fit()
            # This attempt's time only: Tune carries a resumed sweep's remaining budget over.
            budget = sweep.stop.sweep_seconds
            budget_spent = budget is not None and time.monotonic() - started >= budget
            dashboard = (context.dashboard_url if context else None) or cluster.dashboard_url
            if watch.cancelled:
                # A Cancelled state (not an exception): the flow ends its run Cancelled with it.
                return Cancelled(
                    message=f"flow run {flow_run_id} was cancelled; its sweep stopped at {path}"
                )
            early_stops = set(_EARLY_STOPS.get() or ())
            summaries = [_summarise(r, sweep, path, early_stops, budget_spent) for r in results]
            trials = [summary for summary, _, _ in summaries]
            curves = {summary.trial_id: curve for summary, _, curve in summaries}
            report.trials(_trial_rows(trials))
            try:
                best, checkpoint = _best([(t, c) for t, c, _ in summaries], sweep, path)
            except RuntimeError as failure:
                # The sweep fails; its chart still shows where each trial got to.
                if chart := _chart(sweep, path, flow_run_id, trials, curves, None, None):
                    report.chart(chart.read_bytes(), f"The sweep failed: {failure}")
                raise
            local = tune_storage.local_checkpoint(checkpoint, flow_run_id, best.trial_id)

            def evaluate_and_draw() -> tuple[EvaluationReport, Path | None]:
                evaluation = _evaluate(local, sweep, evaluation_episodes)
                return evaluation, _chart(
                    sweep, path, flow_run_id, trials, curves, best, evaluation
                )

            # Evaluated and drawn while Ray shuts down: neither needs Ray.
            evaluated = evaluator.submit(contextvars.copy_context().run, evaluate_and_draw)
        evaluation, chart = evaluated.result()
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
            curves=curves,
            chart_path=str(chart) if chart else None,
        )
        report.best(_best_markdown(outcome))
        if chart:
            report.chart(chart.read_bytes(), _chart_caption(outcome))
    return outcome


def _chart(
    sweep: SweepConfig,
    path: str,
    flow_run_id: str | None,
    trials: list[TrialSummary],
    curves: dict[str, list[dict[str, Any]]],
    best: TrialSummary | None,
    evaluation: EvaluationReport | None,
) -> Path | None:
    """Draw the sweep's chart and save it on this machine; None (logged) when that failed:
    a chart reports the sweep, it never fails it."""
    try:
        figure = draw_sweep(
            trials,
            curves,
            best.trial_id if best else None,
            evaluation,
            sweep.metric,
            experiment=path,
            title=(
                f"{sweep.algorithm} on {sweep.environment}: {len(trials)} trials, "
                f"{sweep.scheduler.kind.upper()} scheduler"
            ),
        )
        return save_png(figure, tune_storage.local_chart(path, flow_run_id))
    except Exception as error:
        log(f"could not draw the sweep's chart: {error!r}", warning=True)
        return None


def _chart_caption(outcome: SweepOutcome) -> str:
    early = sum(t.stopped == STOPPED_EARLY for t in outcome.trials)
    return (
        f"{len(outcome.trials)} trials ({early} stopped early by ASHA, marked x); "
        f"best `{outcome.best.trial_id}`, held-out {outcome.evaluation.mean_return:.1f} ± "
        f"{outcome.evaluation.std_return:.1f}. File: `{outcome.chart_path}`"
    )


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
            "stopped": t.stopped,
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
