"""The fine-tune's plan (what the flow process learnt before any Ray work) and its outcome:
checkpoints, resumes and what each cost, preemptions (workloads.llm.train.history's records),
eval losses, the chart."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from prefect_ray_lifecycle.workloads.llm.train.history import CheckpointMark, Preemption, Resume
from prefect_ray_lifecycle.workloads.llm.train.settings import (
    FailureSettings,
    ResourceSettings,
    TrainSpec,
)

__all__ = [
    "DEFAULT_STORAGE_ROOT",
    "FineTuneInputError",
    "FineTuneOutcome",
    "FineTunePlan",
]

DEFAULT_STORAGE_ROOT = "~/ray_results/llm-finetune"


class FineTuneInputError(ValueError):
    """A parameter the fine-tune cannot run with; raised before any Ray work, naming it."""


class FineTunePlan(BaseModel):
    flow_run_id: str | None = Field(description="The flow run whose storage folder this is.")
    spec: TrainSpec = Field(description="What every worker and tokenize task receives.")
    resources: ResourceSettings = Field(description="What the run asks of the cluster.")
    failures: FailureSettings = Field(description="Failure and preemption budgets.")
    tokenized: Literal["object_store", "stream"] = Field(
        description="Where the train split's blocks are kept between epochs (CorpusSettings)."
    )
    required_columns: list[str] = Field(
        description="The data-prep columns whose nulls go to the quarantine (text included)."
    )
    base_label: str = Field(description="The base model, as people name it.")
    storage_path: str = Field(description="The flow run's folder (a path or URI).")
    experiment_path: str = Field(description="The Ray Train run's folder: checkpoints, history.")
    history_location: str = Field(description="The history file (a path or URI).")
    chart_location: str = Field(description="Where the loss chart is saved beside checkpoints.")


class FineTuneOutcome(BaseModel):
    experiment_path: str = Field(description="The Ray Train run: a folder or storage URI.")
    best_checkpoint: str = Field(
        description="The checkpoint with the lowest eval loss (a path, or a path on the URI)."
    )
    best_checkpoint_local: str = Field(
        description="That checkpoint on this machine (a copy when the storage is remote): a "
        "Hugging Face folder the LLM app loads."
    )
    latest_checkpoint: str | None = Field(description="The last checkpoint taken.")
    steps: int = Field(description="Optimizer steps trained.")
    tokens_seen: int = Field(description="Tokens trained on along the run that survived.")
    tokens_per_s: float | None = Field(description="Median training throughput, all workers.")
    base_eval_loss: float | None = Field(description="Held-out eval loss of the base model.")
    best_eval_loss: float | None = Field(description="The best checkpoint's eval loss.")
    final_eval_loss: float | None = Field(description="Eval loss after the last step.")
    resumed: bool = Field(description="Whether this flow run resumed an earlier attempt's run.")
    resumes: list[Resume] = Field(description="Every restart of the training loop.")
    preemptions: list[Preemption] = Field(description="Every preemption notice seen.")
    checkpoints: list[CheckpointMark] = Field(description="Every checkpoint taken.")
    history_location: str = Field(description="Every step's report (JSON).")
    chart_path: str | None = Field(description="The loss chart (PNG) on this machine.")
    train_s: float = Field(description="Seconds in Ray Train's fit().")
    use_gpu: bool = Field(description="Whether the workers trained on GPUs.")
