"""The fine-tune's plan (what the flow process learnt before any Ray work) and its outcome:
checkpoints, resumes and what each cost, preemptions (workloads.llm.train.history's records),
eval losses, the chart."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

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
    "LLMSweepOutcome",
    "LLMSweepSettings",
    "LLMTrialSummary",
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


# -- a Tune sweep of the fine-tune ------------------------------------------------------------

DEFAULT_LLM_SEARCH_SPACE: dict[str, Any] = {
    "learning_rate": {"loguniform": [1e-3, 1e-2]},
    "warmup_steps": {"choice": [5, 20]},
}


class LLMSweepSettings(BaseModel):
    """A Ray Tune sweep of the fine-tune over its learning rate and warm-up, ASHA on the
    held-out eval loss; the best trial's best checkpoint is the sweep's result."""

    search_space: dict[str, Any] = Field(
        default_factory=lambda: dict(DEFAULT_LLM_SEARCH_SPACE),
        description="training.learning_rate and training.warmup_steps to search, as tune-sweep "
        "takes them: {'learning_rate': {'loguniform': [1e-3, 1e-2]}, 'warmup_steps': "
        "{'choice': [5, 20]}}; kinds: uniform, loguniform, choice, randint, grid.",
    )
    num_samples: int = Field(default=4, ge=1, description="Trials sampled (times the grid).")
    max_concurrent_trials: int | None = Field(
        default=None,
        ge=1,
        description="Trials at once; empty (and never more than): as many as the cluster's "
        "CPUs hold their Train workers (resources.workers x resources.cpus_per_worker each).",
    )
    trial_cpus: float = Field(
        default=0.25,
        gt=0,
        description="CPUs each trial's own actor reserves: it only drives its TorchTrainer "
        "(whose workers reserve resources.workers x resources.cpus_per_worker), but Tune "
        "refuses a trial that asks for nothing. On 2 CPUs, two trials of one worker fit with "
        "cpus_per_worker 0.75.",
    )
    grace_period_steps: int = Field(
        default=20, ge=1, description="ASHA: steps every trial trains before it may be stopped."
    )
    reduction_factor: float = Field(
        default=2, gt=1, description="ASHA: 1/reduction_factor of trials go on at each rung."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the sampled configurations.")

    @field_validator("search_space")
    @classmethod
    def _check_space(cls, value: dict[str, Any]) -> dict[str, Any]:
        from prefect_ray_lifecycle.workloads.llm.train.sweep import SEARCHED
        from prefect_ray_lifecycle.workloads.rl.rllib import parse_search_space

        unknown = sorted(set(value) - set(SEARCHED))
        if unknown or not value:
            raise ValueError(
                f"sweep.search_space: searches {', '.join(SEARCHED)} only, got "
                f"{unknown or 'nothing'}"
            )
        parse_search_space(value, allowed=set(SEARCHED))
        return value

    def trial_count(self) -> int:
        """Trials the sweep runs: num_samples times every grid's length."""
        count = self.num_samples
        for entry in self.search_space.values():
            if "grid" in entry:
                count *= len(entry["grid"])
        return count

    def warmup_problem(self, total_steps: int) -> str | None:
        """Why a warm-up the sweep may pick is no whole number of steps below
        training.total_steps, or None."""
        entry = self.search_space.get("warmup_steps")
        if not entry:
            return None
        ((kind, args),) = entry.items()
        if kind not in ("choice", "grid", "randint"):
            return "sweep.search_space.warmup_steps: steps are whole: use choice, grid or randint"
        highest = args[1] - 1 if kind == "randint" else max(args)
        if highest >= total_steps:
            return (
                f"sweep.search_space.warmup_steps: may pick {highest:g}, not below "
                f"training.total_steps {total_steps}"
            )
        return None


class LLMTrialSummary(BaseModel):
    trial_id: str = Field(description="The Tune trial.")
    config: dict[str, Any] = Field(description="Its learning rate and warm-up.")
    status: str = Field(description="Tune's final status (TERMINATED or ERROR).")
    stopped_early: bool = Field(description="Stopped by ASHA before its last step.")
    steps: int = Field(description="Steps it trained.")
    best_eval_loss: float | None = Field(description="Its best checkpoint's eval loss.")
    best_checkpoint: str | None = Field(description="That checkpoint.")
    train_run: str = Field(description="Its Ray Train run's folder.")
    error: str | None = Field(default=None, description="Why it failed, if it did.")


class LLMSweepOutcome(BaseModel):
    experiment_path: str = Field(description="The Tune experiment.")
    trials: list[LLMTrialSummary] = Field(description="Every trial, best first.")
    best: LLMTrialSummary = Field(description="The trial whose checkpoint won.")
    best_checkpoint_local: str = Field(description="Its best checkpoint, on this machine.")
    best_step: int = Field(description="That checkpoint's step.")
    max_concurrent_trials: int = Field(description="Trials that ran at once.")
    chart_path: str | None = Field(description="The best trial's loss chart (PNG) here.")
    sweep_s: float = Field(description="Seconds in Tune's fit().")
