"""The Prefect task around one Ray Train fine-tune: connect, check the run fits the cluster,
tokenize the prepared splits with Ray Data, fit the TorchTrainer (resuming from the flow run's
storage when an earlier attempt left checkpoints there) while a thread shows its progress,
then read what happened from its history, draw the loss chart beside the checkpoints and
publish the outcome.

Ray Train's driver runs in the flow process; its controller runs on this node (Ray Train V2
pins it there, with no CPU) and writes the history the progress thread reads."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.ray_runner.lineage import job_config, link_flow_run
from prefect_ray_lifecycle.tasks.charts import save_png
from prefect_ray_lifecycle.tasks.finetune.chart import draw_finetune
from prefect_ray_lifecycle.tasks.finetune.config import (
    FineTuneInputError,
    FineTuneOutcome,
    FineTunePlan,
)
from prefect_ray_lifecycle.tasks.finetune.plan import CHART_FILE
from prefect_ray_lifecycle.tasks.finetune.report import (
    ProgressWatch,
    publish_chart,
    publish_outcome,
)
from prefect_ray_lifecycle.tasks.tune import storage as run_storage
from prefect_ray_lifecycle.workloads.llm.train.history import (
    HistorySummary,
    read_history,
    summarize,
)
from prefect_ray_lifecycle.workloads.llm.train.loop import EVAL_DATASET, TRAIN_DATASET
from prefect_ray_lifecycle.workloads.llm.train.settings import CHECKPOINT_METRIC
from prefect_ray_lifecycle.workloads.llm.train.trainer import (
    RUN_NAME,
    build_trainer,
    job_env_vars,
    tokenized_split,
)

__all__ = ["run_finetune", "tokenized_datasets"]


def _preflight(plan: FineTunePlan) -> bool:
    """Fail at once when the run cannot be scheduled whole; whether it trains on GPUs."""
    import ray

    totals = ray.cluster_resources()
    node_cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
    problem = plan.resources.problem(
        totals.get("CPU", 0), totals.get("GPU", 0), max(node_cpus, default=0)
    )
    if problem:
        raise FineTuneInputError(f"preflight: {problem}")
    return plan.resources.use_gpu(totals.get("GPU", 0))


def tokenized_datasets(plan: FineTunePlan, train_path: str, eval_path: str) -> dict:
    train = tokenized_split(train_path, plan.spec, plan.resources)
    training = plan.spec.training
    if plan.tokenized == "object_store":
        train = train.materialize()
        step_blocks = training.micro_batch_size * plan.resources.workers
        if (blocks := train.count()) < step_blocks:
            raise FineTuneInputError(
                f"the train split ({train_path}) holds {blocks} blocks of training.seq_len "
                f"{training.seq_len} tokens, fewer than one step takes (training."
                f"micro_batch_size {training.micro_batch_size} x resources.workers "
                f"{plan.resources.workers})"
            )
    held_out = tokenized_split(eval_path, plan.spec, plan.resources).materialize()
    if held_out.count() == 0:
        raise FineTuneInputError(
            f"the eval split ({eval_path}) holds no block of training.seq_len "
            f"{training.seq_len} tokens: raise data.eval_fraction or lower seq_len"
        )
    return {TRAIN_DATASET: train, EVAL_DATASET: held_out}


def _chart(plan: FineTunePlan, records: list[dict], summary: HistorySummary):
    """The loss chart, saved beside the checkpoints (and on this machine when the storage is
    remote): (local path, PNG bytes), or (None, None), logged, when it could not be drawn."""
    try:
        figure = draw_finetune(records, summary, title=f"Fine-tune of {plan.base_label}")
        if not run_storage.is_uri(plan.chart_location):
            path = save_png(figure, plan.chart_location)
            return path, path.read_bytes()
        path = save_png(
            figure,
            run_storage.LOCAL_CHARTS.expanduser()
            / (plan.flow_run_id or "no-flow-run")
            / CHART_FILE,
        )
        import pyarrow.fs

        filesystem, remote = pyarrow.fs.FileSystem.from_uri(plan.chart_location)
        with filesystem.open_output_stream(remote) as stream:
            stream.write(path.read_bytes())
        return path, path.read_bytes()
    except Exception as error:  # a chart reports the run; it never fails it
        get_run_logger().warning("could not draw the fine-tune's chart: %r", error)
        return None, None


@dataclass(frozen=True)
class _Fitted:
    """What the run left, as plain data: no Ray object outlives the connection (a reference
    dropped after Ray stopped would end this process)."""

    use_gpu: bool
    train_s: float
    failure: str | None = None
    best: str | None = None  # as its experiment names it (a path, or a path on the URI)
    best_local: str | None = None
    latest: str | None = None
    kept: frozenset[str] = frozenset()


def _train(plan: FineTunePlan, train_path: str, eval_path: str) -> _Fitted:
    """Tokenize, fit and pick the best checkpoint, on the connected cluster."""
    use_gpu = _preflight(plan)
    spec = plan.spec.model_copy(update={"use_gpu": use_gpu})
    trainer = build_trainer(
        spec,
        tokenized_datasets(plan, train_path, eval_path),
        plan.resources,
        plan.failures,
        plan.storage_path,
        plan.history_location,
    )
    started = time.monotonic()
    with ProgressWatch(plan.history_location, spec.training.total_steps):
        try:
            result = trainer.fit()
        except Exception as error:  # Ray Train's TrainingFailedError, after its retries
            return _Fitted(use_gpu, time.monotonic() - started, failure=str(error))
    best = result.get_best_checkpoint(CHECKPOINT_METRIC, "min") or result.checkpoint
    return _Fitted(
        use_gpu,
        time.monotonic() - started,
        best=run_storage.checkpoint_location(best, plan.experiment_path),
        best_local=run_storage.local_checkpoint(best, plan.flow_run_id, RUN_NAME),
        latest=result.checkpoint.path if result.checkpoint else None,
        kept=frozenset(checkpoint.path for checkpoint, _ in result.best_checkpoints),
    )


@task(name="run-llm-finetune", cache_policy=NO_CACHE)  # a fine-tune is never reused by inputs
def run_finetune(
    plan: FineTunePlan, train_path: str, eval_path: str, cluster: RayCluster
) -> FineTuneOutcome:
    """Fine-tune on the cluster (see the module's docstring); resumes the flow run's own run."""
    resumed = bool(read_history(plan.history_location))
    flow_run_id = plan.flow_run_id
    env = cluster.runtime_env.get("env_vars", {})
    cluster = cluster.model_copy(
        update={
            "runtime_env": {
                **cluster.runtime_env,
                "env_vars": {**job_env_vars(plan.failures), **env},
            }
        }
    )
    with cluster.connect(
        job_config=job_config(flow_run_id) if flow_run_id else None, stop_in_background=True
    ) as ray_context:
        if flow_run_id:  # the run's id in the job's metadata, the job on the run
            link_flow_run(flow_run_id, cluster, ray_context)
        fitted = _train(plan, train_path, eval_path)
        gc.collect()  # the run's datasets and their object refs go while Ray is up
    records = read_history(plan.history_location)
    training = plan.spec.training
    summary = summarize(
        records, training.micro_batch_size * training.grad_accum_steps * plan.resources.workers
    )
    chart_path, png = _chart(plan, records, summary)
    if fitted.failure is not None:
        publish_chart(png, f"The fine-tune failed: {fitted.failure}", plan.chart_location)
        raise RuntimeError(f"the fine-tune failed: {fitted.failure}")
    outcome = FineTuneOutcome(
        experiment_path=plan.experiment_path,
        best_checkpoint=fitted.best,
        best_checkpoint_local=fitted.best_local,
        latest_checkpoint=fitted.latest,
        steps=summary.steps,
        tokens_seen=summary.tokens_seen,
        tokens_per_s=summary.tokens_per_s,
        base_eval_loss=summary.base_eval_loss,
        best_eval_loss=min(
            (c.eval_loss for c in summary.checkpoints if c.path in fitted.kept),
            default=summary.best_eval_loss,
        ),
        final_eval_loss=summary.final_eval_loss,
        resumed=resumed,
        resumes=summary.resumes,
        preemptions=summary.preemptions,
        checkpoints=[
            c.model_copy(update={"kept": c.path in fitted.kept}) for c in summary.checkpoints
        ],
        history_location=plan.history_location,
        chart_path=str(chart_path) if chart_path else None,
        train_s=fitted.train_s,
        use_gpu=fitted.use_gpu,
    )
    publish_outcome(outcome, plan.base_label, png)
    return outcome
