"""llm-sweep: a Ray Tune sweep of the fine-tune's learning rate and warm-up.

The story: the same checks and prepared corpus as llm-finetune, then a Tuner whose trials are
function trainables that each launch a TorchTrainer (Ray Train V2: not `Tuner(trainer)`),
ASHA stopping the trials whose held-out eval loss trails at its rungs, the trials sized so
that they and their trainers fit the cluster together; the checkpoint with the lowest eval
loss of all trials is scored against the base on the held-out prompts, ready to register.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.flows.llm_finetune import FineTuneParams, before_and_after, prepare
from prefect_ray_lifecycle.tasks.finetune.config import (
    FineTuneInputError,
    LLMSweepOutcome,
    LLMSweepSettings,
)
from prefect_ray_lifecycle.tasks.finetune.evaluate import LLMEvaluationSummary
from prefect_ray_lifecycle.tasks.finetune.sweep import run_llm_sweep

__all__ = ["LLMSweepResult", "llm_sweep"]


class LLMSweepResult(BaseModel):
    outcome: LLMSweepOutcome = Field(description="The trials and the winning checkpoint.")
    dataset_fingerprint: str = Field(description="The prepared dataset it trained on.")
    flow_run_id: str | None = Field(description="This flow run (its storage folder's name).")
    base_label: str = Field(description="The base model, as people name it.")
    base_evaluation: LLMEvaluationSummary | None = Field(description="The base's figures.")
    evaluation: LLMEvaluationSummary | None = Field(description="The winner's figures.")


@flow(name="llm-sweep", log_prints=True)
def llm_sweep(
    params: FineTuneParams,
    sweep: LLMSweepSettings | None = None,
    ray_cluster: RayCluster | None = None,
) -> LLMSweepResult:
    """Sweep the fine-tune's learning rate and warm-up with Ray Tune (ASHA on the held-out
    eval loss); return the best checkpoint of all trials with its held-out evaluation.

    Args:
        params: The fine-tune every trial runs (its training.learning_rate and
            training.warmup_steps are the sweep's to choose).
        sweep: The search space, trials, concurrency and ASHA settings.
        ray_cluster: Where to run; an embedded local Ray when empty.
    """
    cluster, sweep = ray_cluster or RayCluster(), sweep or LLMSweepSettings()
    if problem := sweep.warmup_problem(params.training.total_steps):
        raise FineTuneInputError(problem)
    run_id = str(flow_run.id) if flow_run.id else None
    plan, protocol, dataset = prepare(params, cluster, run_id)
    outcome = run_llm_sweep(plan, sweep, dataset.train_path, dataset.eval_path, cluster)
    best = outcome.best
    print(
        f"{len(outcome.trials)} trials ({sum(t.stopped_early for t in outcome.trials)} stopped "
        f"early by ASHA, {outcome.max_concurrent_trials} at once); best {best.trial_id} "
        f"{best.config}: eval loss {best.best_eval_loss} at step {outcome.best_step}"
    )
    before, after = before_and_after(plan, protocol, outcome.best_checkpoint_local)
    return LLMSweepResult(
        outcome=outcome,
        dataset_fingerprint=dataset.fingerprint,
        flow_run_id=run_id,
        base_label=plan.base_label,
        base_evaluation=before,
        evaluation=after,
    )
