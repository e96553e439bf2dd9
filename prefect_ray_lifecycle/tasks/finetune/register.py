"""A fine-tune's checkpoint registered as an LLM version in MLflow: the Hugging Face folder the
LLM app loads (control.registry.register_llm_folder), with its lineage (the registering and
the training flow runs, the Ray Train run and checkpoint step, the dataset, the base, the Tune
trial when a sweep chose it) and its held-out evaluation as tags."""

from __future__ import annotations

import json
from typing import Any

from prefect import get_run_logger
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

__all__ = ["llm_lineage_tags", "register_llm"]

T = registry.TAG


def llm_lineage_tags(
    *,
    flow_run_id: str,
    flow_run_url: str,
    task_run_id: str,
    train_run: str,
    checkpoint: str,
    checkpoint_step: int | None,
    finetune_flow_run_id: str | None,
    dataset_fingerprint: str | None,
    base: str,
    base_version: str | None,
    trial_id: str | None,
    commit: str,
    evaluation: LLMEvaluationSummary,
) -> dict[str, str]:
    """The tags an LLM version carries, from what is known of it (empty facts left out)."""
    tags = {
        f"{T}.prefect.flow_run_id": flow_run_id,
        f"{T}.prefect.flow_run_url": flow_run_url,
        f"{T}.prefect.task_run_id": task_run_id,
        f"{T}.train.run": train_run,
        f"{T}.train.checkpoint": checkpoint,
        f"{T}.train.checkpoint_step": "" if checkpoint_step is None else str(checkpoint_step),
        f"{T}.train.flow_run_id": finetune_flow_run_id or "",
        f"{T}.dataset.fingerprint": dataset_fingerprint or "",
        f"{T}.base": base,
        f"{T}.base.version": base_version or "",
        f"{T}.tune.trial_id": trial_id or "",
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
    checkpoint: str,
    train_run: str,
    trial_id: str | None,
    checkpoint_step: int | None,
    finetune_flow_run_id: str | None,
    dataset_fingerprint: str | None,
    base: str,
    base_version: str | None,
    evaluation: LLMEvaluationSummary,
    params: dict[str, Any],
    metrics: dict[str, float],
    mlflow_experiment: str,
    create_model: bool,
) -> registry.Registration:
    """Register the checkpoint once; a retry or a second call returns the same version."""
    tags = llm_lineage_tags(
        flow_run_id=str(flow_run.id or ""),
        flow_run_url=str(url_for("flow-run", obj_id=flow_run.id) or ""),
        task_run_id=str(task_run.id or ""),
        train_run=train_run,
        checkpoint=checkpoint,
        checkpoint_step=checkpoint_step,
        finetune_flow_run_id=finetune_flow_run_id,
        dataset_fingerprint=dataset_fingerprint,
        base=base,
        base_version=base_version,
        trial_id=trial_id,
        commit=git_commit(),
        evaluation=evaluation,
    )
    step = f" at step {checkpoint_step}" if checkpoint_step is not None else ""
    description = (
        f"Fine-tune of {base} (Ray Train run {train_run}{step}), registered by Prefect flow "
        f"run {flow_run.id}; held-out exact match {evaluation.exact_match:.2f}, perplexity "
        f"{evaluation.perplexity:.3f} on {evaluation.examples} prompts."
    )
    with mlflow_server.session() as client:
        result = registry.register_llm_folder(
            client,
            name=model_name,
            checkpoint=checkpoint,
            experiment_name=mlflow_experiment,
            trial_key_value=registry.trial_key(train_run, trial_id or "finetune", checkpoint),
            params={k: v if isinstance(v, str) else json.dumps(v) for k, v in params.items()},
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
    get_run_logger().info(
        "%s %s v%s",
        "Registered" if result.created else "Already registered",
        model_name,
        result.version,
    )
    return result
