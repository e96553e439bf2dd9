"""The fine-tune's plan (what the flow process learnt before any Ray work) and its outcome:
checkpoints, resumes and what each cost, preemptions, eval losses, the chart."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from prefect_ray_lifecycle.workloads.llm.train.settings import (
    FailureSettings,
    ResourceSettings,
    TrainSpec,
)

__all__ = [
    "DEFAULT_STORAGE_ROOT",
    "CheckpointRecord",
    "FineTuneInputError",
    "FineTuneOutcome",
    "FineTunePlan",
    "PreemptionRecord",
    "ResumeRecord",
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


class CheckpointRecord(BaseModel):
    step: int = Field(description="The optimizer step it holds.")
    tokens_seen: int = Field(description="Tokens trained on when it was taken.")
    kind: str = Field(description="'periodic', 'jit' (before a preemption) or 'final'.")
    eval_loss: float | None = Field(description="Held-out eval loss of its weights.")
    path: str | None = Field(description="Where it was written (a path, or a path on the URI).")
    kept: bool = Field(default=False, description="Still in storage (the N best and the latest).")


class ResumeRecord(BaseModel):
    kind: str = Field(description="'preemption', 'worker failure' or 'flow re-run'.")
    from_step: int = Field(description="The step of the checkpoint it resumed from.")
    reached_step: int = Field(description="The last step the interrupted attempt finished.")
    checkpoint_kind: str = Field(description="Kind of the checkpoint it resumed from.")
    tokens_seen: int = Field(description="Tokens trained on at the resume point.")
    lost_steps: int = Field(description="Steps trained again: reached_step - from_step.")
    replayed_blocks: int = Field(description="Blocks of the lost steps, trained again.")
    reread_blocks: int = Field(
        description="Blocks read again to get back to the resume point in its epoch (Ray Data "
        "cannot checkpoint an iterator) and skipped."
    )
    repeated_blocks: int = Field(
        description="Blocks the resumed run trained on twice within one epoch: the re-read "
        "epoch handed blocks to workers anew."
    )


class PreemptionRecord(BaseModel):
    step: int = Field(description="The first step that saw the notice.")
    tokens_seen: int = Field(description="Tokens trained on then.")
    deadline_ms: int | None = Field(description="When the node goes (UNIX ms), as drained.")
    nodes: list[str] = Field(description="The preempted nodes.")
    ranks: list[int] = Field(description="The worker ranks on them.")
    detected_at: float = Field(description="When the loop saw it (UNIX seconds).")


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
    resumes: list[ResumeRecord] = Field(description="Every restart of the training loop.")
    preemptions: list[PreemptionRecord] = Field(description="Every preemption notice seen.")
    checkpoints: list[CheckpointRecord] = Field(description="Every checkpoint taken.")
    history_location: str = Field(description="Every step's report (JSON).")
    chart_path: str | None = Field(description="The loss chart (PNG) on this machine.")
    train_s: float = Field(description="Seconds in Ray Train's fit().")
    use_gpu: bool = Field(description="Whether the workers trained on GPUs.")
