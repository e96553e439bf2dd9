"""Prefect tasks around one Tune sweep of an RLlib algorithm (its settings: tasks.tune.config):
the Tune run itself (preflight, resume, progress), the held-out evaluation of its best
checkpoint, the sweep's chart (tasks.tune.chart) and the artifacts that show it in Prefect
(tasks.tune.report).

The Tune driver runs in the flow process (inside `RayCluster.connect()`), so its callbacks can
update Prefect artifacts and watch the flow run for cancellation. Through Ray Client (ray://)
Tune runs its driver on the cluster instead, where those callbacks do nothing.
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.states import Cancelled
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.tasks.charts import save_png
from prefect_ray_lifecycle.tasks.tune import storage as tune_storage
from prefect_ray_lifecycle.tasks.tune.chart import STOPPED_EARLY, draw_sweep
from prefect_ray_lifecycle.tasks.tune.config import SweepConfig
from prefect_ray_lifecycle.tasks.tune.report import SweepReport, log, progress_callback
from prefect_ray_lifecycle.tasks.tune.trials import (
    EARLY_STOPS,
    TrialSummary,
    recording_asha,
    stop_criteria_met,
    summarise,
    trial_rows,
)
from prefect_ray_lifecycle.workloads.rl import rllib

# How often the driver asks Prefect whether the flow run is being cancelled.
CANCEL_POLL_S = 5.0
# How long preflight waits for a Ray worker to try importing the env creator.
PREFLIGHT_TIMEOUT_S = 60.0


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
        return stop_criteria_met(self.criteria, result)

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


def _tuner(sweep: SweepConfig, param_space: dict[str, Any], path: str):
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    if tune.Tuner.can_restore(path):
        return tune.Tuner.restore(
            path, trainable=sweep.algorithm, resume_errored=True, param_space=param_space
        ), True
    scheduler = (
        recording_asha(sweep.scheduler) if sweep.scheduler.kind == "asha" else FIFOScheduler()
    )
    storage_path, name = tune_storage.split_experiment(path)
    tuner = tune.Tuner(
        sweep.algorithm,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode="max",
            num_samples=sweep.num_samples,
            scheduler=scheduler,
            time_budget_s=sweep.stop.sweep_seconds,
            # The search space is sampled from the sweep's seed too: the same sweep draws the
            # same trials (Tune's default generator draws from unseeded numpy). The generator
            # holds the concurrency limit: Tune ignores TuneConfig's max_concurrent_trials
            # (with a warning) once a search_alg of this kind is given.
            search_alg=BasicVariantGenerator(
                random_state=sweep.seed, max_concurrent=sweep.max_concurrent_trials or 0
            ),
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
    recording = EARLY_STOPS.set(set())
    try:
        return _sweep(sweep, cluster, path, evaluation_episodes, watch)
    finally:
        EARLY_STOPS.reset(recording)
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
            early_stops = set(EARLY_STOPS.get() or ())
            summaries = [summarise(r, sweep, path, early_stops, budget_spent) for r in results]
            trials = [summary for summary, _, _ in summaries]
            curves = {summary.trial_id: curve for summary, _, curve in summaries}
            report.trials(trial_rows(trials))
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
