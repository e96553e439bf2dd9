"""A fine-tune's checkpoint registered as an LLM version in MLflow: the Hugging Face folder the
LLM app loads (control.registry.register_llm_folder), with its lineage (the registering and
the training flow runs, the Ray Train run and checkpoint step, the dataset, the base, the Tune
trial when a sweep chose it) and its held-out evaluation as tags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.runtime import flow_run, task_run
from prefect.utilities.urls import url_for

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry
from prefect_ray_lifecycle.tasks._base import mlflow_task
from prefect_ray_lifecycle.tasks.finetune.evaluate import LLMEvaluationSummary
from prefect_ray_lifecycle.tasks.register import (
    EXACT_MATCH_TAG,
    PERPLEXITY_TAG,
    PROTOCOL_TAG,
    git_commit,
)

__all__ = ["LLMLineage", "llm_lineage_tags", "register_llm"]

T = registry.TAG


@dataclass(frozen=True)
class LLMLineage:
    """Where a checkpoint came from, as its version's tags tell it."""

    train_run: str
    checkpoint: str
    checkpoint_step: int | None = None
    finetune_flow_run_id: str | None = None
    dataset_fingerprint: str | None = None
    base: str = ""
    base_version: str | None = None
    trial_id: str | None = None


def llm_lineage_tags(
    lineage: LLMLineage,
    *,
    flow_run_id: str,
    flow_run_url: str,
    task_run_id: str,
    commit: str,
    evaluation: LLMEvaluationSummary,
) -> dict[str, str]:
    """The tags an LLM version carries, from what is known of it (empty facts left out)."""
    step = lineage.checkpoint_step
    tags = {
        f"{T}.prefect.flow_run_id": flow_run_id,
        f"{T}.prefect.flow_run_url": flow_run_url,
        f"{T}.prefect.task_run_id": task_run_id,
        f"{T}.train.run": lineage.train_run,
        f"{T}.train.checkpoint": lineage.checkpoint,
        f"{T}.train.checkpoint_step": "" if step is None else str(step),
        f"{T}.train.flow_run_id": lineage.finetune_flow_run_id or "",
        f"{T}.dataset.fingerprint": lineage.dataset_fingerprint or "",
        f"{T}.base": lineage.base,
        f"{T}.base.version": lineage.base_version or "",
        f"{T}.tune.trial_id": lineage.trial_id or "",
        f"{T}.git_commit": commit,
        PROTOCOL_TAG: evaluation.protocol,
        EXACT_MATCH_TAG: f"{evaluation.exact_match:.6g}",
        PERPLEXITY_TAG: f"{evaluation.perplexity:.6g}",
    }
    return {key: value[:5000] for key, value in tags.items() if value}


@mlflow_task
def register_llm(
    mlflow_server: MLflowServer,
    *,
    model_name: str,
    lineage: LLMLineage,
    evaluation: LLMEvaluationSummary,
    params: dict[str, Any],
    metrics: dict[str, float],
    mlflow_experiment: str,
    create_model: bool,
) -> registry.Registration:
    """Register the checkpoint once; a retry or a second call returns the same version."""
    tags = llm_lineage_tags(
        lineage,
        flow_run_id=str(flow_run.id or ""),
        flow_run_url=str(url_for("flow-run", obj_id=flow_run.id) or ""),
        task_run_id=str(task_run.id or ""),
        commit=git_commit(),
        evaluation=evaluation,
    )
    step = "" if lineage.checkpoint_step is None else f" at step {lineage.checkpoint_step}"
    description = (
        f"Fine-tune of {lineage.base} (Ray Train run {lineage.train_run}{step}), registered by "
        f"Prefect flow "
        f"run {flow_run.id}; held-out exact match {evaluation.exact_match:.2f}, perplexity "
        f"{evaluation.perplexity:.3f} on {evaluation.examples} prompts."
    )
    with mlflow_server.session() as client:
        result = registry.register_llm_folder(
            client,
            name=model_name,
            checkpoint=lineage.checkpoint,
            experiment_name=mlflow_experiment,
            trial_key_value=registry.trial_key(
                lineage.train_run, lineage.trial_id or "finetune", lineage.checkpoint
            ),
            params=params,
            metrics={
                **metrics,
                "eval_exact_match": evaluation.exact_match,
                "eval_perplexity": evaluation.perplexity,
            },
            tags=tags,
            description=description,
            artifacts={"evaluation.json": evaluation.model_dump()},
            create_model=create_model,
        )
    return result
