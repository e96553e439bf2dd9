"""The Prefect task around a Tune sweep of the fine-tune (workloads.llm.train.sweep): connect,
size the trials to the cluster, tokenize the prepared splits once into the object store, run
the Tuner (each trial a function trainable that launches its own TorchTrainer; ASHA on the
held-out eval loss), then read every trial's history, pick the checkpoint with the lowest eval
loss over all trials, draw that trial's loss chart and show the trial table."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.compat.ray_internals import job_placement_groups
from prefect_ray_lifecycle.ray_runner.lineage import job_config, link_flow_run
from prefect_ray_lifecycle.tasks.charts import save_png
from prefect_ray_lifecycle.tasks.finetune.chart import draw_finetune
from prefect_ray_lifecycle.tasks.finetune.config import (
    FineTuneInputError,
    FineTunePlan,
    LLMSweepOutcome,
    LLMSweepSettings,
    LLMTrialSummary,
)
from prefect_ray_lifecycle.tasks.finetune.plan import CHART_FILE
from prefect_ray_lifecycle.tasks.finetune.report import ARTIFACT_ERRORS
from prefect_ray_lifecycle.tasks.finetune.train import tokenized_datasets
from prefect_ray_lifecycle.workloads.llm.train.history import HISTORY_FILE, read_history, summarize
from prefect_ray_lifecycle.workloads.llm.train.settings import CHECKPOINT_METRIC
from prefect_ray_lifecycle.workloads.llm.train.sweep import (
    TrialCheckpoint,
    best_checkpoint,
    remove_left_groups,
    sweep_concurrency,
    sweep_trial,
    trial_train_storage,
)
from prefect_ray_lifecycle.workloads.llm.train.trainer import RUN_NAME, job_env_vars

__all__ = ["SWEEP_NAME", "SWEEP_TRIALS_KEY", "run_llm_sweep"]

SWEEP_NAME = "sweep"
SWEEP_TRIALS_KEY = "llm-sweep-trials"


def _tuner(plan: FineTunePlan, sweep: LLMSweepSettings, datasets: dict, concurrency: int):
    from ray import tune
    from ray.tune.schedulers import AsyncHyperBandScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from prefect_ray_lifecycle.workloads.rl.rllib import parse_search_space

    path = f"{plan.storage_path.rstrip('/')}/{SWEEP_NAME}"
    trainable = tune.with_parameters(
        sweep_trial,
        spec=plan.spec.model_dump(mode="json"),
        datasets=datasets,
        resources=plan.resources.model_dump(mode="json"),
        failures=plan.failures.model_dump(mode="json"),
        experiment=path,
    )
    return path, tune.Tuner(
        # The trial only drives its TorchTrainer: its workers hold most of the trial's CPUs.
        tune.with_resources(trainable, {"cpu": sweep.trial_cpus}),
        param_space=parse_search_space(sweep.search_space),
        tune_config=tune.TuneConfig(
            metric=CHECKPOINT_METRIC,
            mode="min",
            num_samples=sweep.num_samples,
            scheduler=AsyncHyperBandScheduler(
                time_attr="step",
                max_t=plan.spec.training.total_steps,
                grace_period=min(sweep.grace_period_steps, plan.spec.training.total_steps),
                reduction_factor=sweep.reduction_factor,
            ),
            # The limit goes to the generator: Tune ignores TuneConfig's max_concurrent_trials
            # once a search_alg of this kind is given.
            search_alg=BasicVariantGenerator(random_state=sweep.seed, max_concurrent=concurrency),
        ),
        run_config=tune.RunConfig(name=SWEEP_NAME, storage_path=plan.storage_path, verbose=0),
    )


def _trial(result: Any, path: str, total_steps: int) -> tuple[LLMTrialSummary, list]:
    """A trial's summary and its checkpoints still kept, from its Train run's history."""
    trial_id = str((result.metrics or {}).get("trial_id") or Path(result.path).name)
    storage = trial_train_storage(path, trial_id)
    records = read_history(f"{storage}/{RUN_NAME}/{HISTORY_FILE}")
    summary = summarize(records, 1)
    kept = [
        TrialCheckpoint(trial_id, c.eval_loss, c.path, c.step)
        for c in summary.checkpoints
        if c.path and Path(c.path).is_dir()
    ]
    best = best_checkpoint(kept)
    return LLMTrialSummary(
        trial_id=trial_id,
        config={k: v for k, v in (result.config or {}).items()},
        status="ERROR" if result.error else "TERMINATED",
        stopped_early=result.error is None and summary.steps < total_steps,
        steps=summary.steps,
        best_eval_loss=best.eval_loss if best else None,
        best_checkpoint=best.path if best else None,
        train_run=f"{storage}/{RUN_NAME}",
        error=str(result.error)[:2000] if result.error else None,
    ), records


def _chart(plan: FineTunePlan, trial: LLMTrialSummary, records: list[dict]) -> str | None:
    try:
        figure = draw_finetune(
            records,
            summarize(records, plan.spec.training.micro_batch_size * plan.resources.workers),
            title=f"Sweep of {plan.base_label}: trial {trial.trial_id} {trial.config}",
        )
        return str(save_png(figure, f"{trial.train_run}/{CHART_FILE}"))
    except Exception as error:  # a chart reports the run; it never fails it
        get_run_logger().warning("could not draw the trial's chart: %r", error)
        return None


@task(name="run-llm-sweep", cache_policy=NO_CACHE)
def run_llm_sweep(
    plan: FineTunePlan,
    sweep: LLMSweepSettings,
    train_path: str,
    eval_path: str,
    cluster: RayCluster,
) -> LLMSweepOutcome:
    """Sweep the fine-tune's learning rate and warm-up on the cluster (see the module's
    docstring); the checkpoint with the lowest held-out eval loss of all trials wins."""
    import ray

    if "://" in plan.storage_path:
        raise FineTuneInputError("storage_root: a sweep keeps its trials in a folder, not a URI")
    env = cluster.runtime_env.get("env_vars", {})
    cluster = cluster.model_copy(
        update={
            "runtime_env": {
                **cluster.runtime_env,
                "env_vars": {**job_env_vars(plan.failures), **env},
            }
        }
    )
    flow_run_id = plan.flow_run_id
    with cluster.connect(
        job_config=job_config(flow_run_id) if flow_run_id else None, stop_in_background=True
    ) as ray_context:
        if flow_run_id:
            link_flow_run(flow_run_id, cluster, ray_context)
        resources = plan.resources
        trials = sweep.trial_count()
        concurrency, problem = sweep_concurrency(
            ray.cluster_resources().get("CPU", 0),
            resources.workers,
            resources.cpus_per_worker,
            trials,
            sweep.max_concurrent_trials,
            sweep.trial_cpus,
        )
        if problem:
            raise FineTuneInputError(f"preflight: {problem}")
        path, tuner = _tuner(
            plan, sweep, tokenized_datasets(plan, train_path, eval_path), concurrency
        )
        before = set(job_placement_groups())
        started = time.monotonic()
        results = list(tuner.fit())
        sweep_s = time.monotonic() - started
        if left := remove_left_groups(before):
            get_run_logger().warning(
                "removed %d placement groups the sweep's trials left holding CPUs (Ray "
                "Train's cleaner missed them): %s",
                len(left),
                left,
            )
        del tuner
        gc.collect()  # the shared datasets' object refs go while Ray is up
    total = plan.spec.training.total_steps
    summaries = [_trial(result, path, total) for result in results]
    ranked = sorted(
        summaries, key=lambda s: (s[0].best_eval_loss is None, s[0].best_eval_loss or 0)
    )
    table = [t.model_dump(exclude={"train_run", "error"}) for t, _ in ranked]
    try:
        create_table_artifact(table, key=SWEEP_TRIALS_KEY, description="Every trial of the sweep")
    except ARTIFACT_ERRORS as error:
        get_run_logger().warning("could not write the trials artifact: %r", error)
    best, records = ranked[0] if ranked else (None, [])
    if best is None or best.best_checkpoint is None:
        errors = "; ".join(f"{t.trial_id}: {t.error}" for t, _ in summaries if t.error)
        raise RuntimeError(f"no trial of the sweep at {path} left a checkpoint ({errors})")
    step = next(
        (c.step for c in summarize(records, 1).checkpoints if c.path == best.best_checkpoint), 0
    )
    return LLMSweepOutcome(
        experiment_path=path,
        trials=[t for t, _ in ranked],
        best=best,
        best_checkpoint_local=best.best_checkpoint,
        best_step=step,
        max_concurrent_trials=concurrency,
        chart_path=_chart(plan, best, records),
        sweep_s=sweep_s,
    )
