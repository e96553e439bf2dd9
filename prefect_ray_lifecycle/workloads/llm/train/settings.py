"""The fine-tune's typed settings: what to train and how (TrainingSettings), on what share of
the cluster (ResourceSettings), with which failure budgets (FailureSettings), from which
columns, tokenized how (CorpusSettings); and the spec the training loop receives
(TrainSpec). Flow parameters too, so every field is described."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from prefect_ray_lifecycle.workloads.llm.models import ModelLocation

__all__ = [
    "CHECKPOINT_METRIC",
    "FailureSettings",
    "ResourceSettings",
    "CorpusSettings",
    "TrainSpec",
    "TrainingSettings",
]

# Checkpoints are ranked by it (lower is better) and each carries it.
CHECKPOINT_METRIC = "eval_loss"
Layout = Literal["text", "prompt_completion"]


class TrainingSettings(BaseModel):
    """The optimisation: AdamW, a linear warm-up then a cosine decay, gradient accumulation."""

    seq_len: int = Field(
        default=128, ge=8, description="Tokens per training block (texts are packed into them)."
    )
    micro_batch_size: int = Field(
        default=8, ge=1, description="Blocks per worker per forward/backward pass."
    )
    grad_accum_steps: int = Field(
        default=1, ge=1, description="Micro-batches whose gradients make one optimizer step."
    )
    total_steps: int = Field(default=200, ge=1, description="Optimizer steps to train.")
    learning_rate: float = Field(default=3e-3, gt=0, description="AdamW's peak learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW's weight decay.")
    warmup_steps: int = Field(
        default=20, ge=0, description="Steps of linear warm-up from 0 to the peak rate."
    )
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Where the cosine decay ends, as a share of the peak."
    )
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="Gradient clipping by global norm; empty: none."
    )
    eval_every_steps: int = Field(
        default=50, ge=1, description="Held-out eval loss every N steps (and at every checkpoint)."
    )
    checkpoint_every_steps: int = Field(
        default=50,
        ge=1,
        description="A periodic checkpoint every N steps: the most a worker failure can lose.",
    )
    keep_checkpoints: int = Field(
        default=2, ge=1, description="Checkpoints kept: the N lowest eval losses (and the latest)."
    )
    eval_batch_size: int = Field(default=16, ge=1, description="Blocks per eval batch.")
    seed: int = Field(default=0, ge=0, description="Seeds each worker's torch, numpy and random.")
    jit_margin_s: float = Field(
        default=5.0,
        ge=0,
        description="On preemption, the just-in-time checkpoint is taken when the deadline is "
        "less than one step, one checkpoint and this margin away.",
    )

    @model_validator(mode="after")
    def _warm_up_fits(self) -> TrainingSettings:
        if self.warmup_steps >= self.total_steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be below total_steps ({self.total_steps})"
            )
        return self


class ResourceSettings(BaseModel):
    """What the fine-tune asks of the cluster. The Train controller takes no CPU (Ray Train
    V2 schedules it with num_cpus=0 on the driver's node), nor does the preemption watcher."""

    workers: int = Field(default=2, ge=1, description="Ray Train workers (data-parallel ranks).")
    cpus_per_worker: float = Field(
        default=1.0, gt=0, description="CPUs each worker reserves (and torch threads, rounded)."
    )
    gpus: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="'auto': one GPU per worker where the cluster has enough, else CPU; "
        "'always': fail without them; 'never': CPU only.",
    )
    placement_strategy: Literal["PACK", "SPREAD"] = Field(
        default="PACK",
        description="'PACK': workers on as few nodes as fit; 'SPREAD': one per node where it can.",
    )
    tokenize_cpus: float = Field(
        default=0.25,
        gt=0,
        description="CPUs each Ray Data read-and-tokenize task reserves, beside the workers'.",
    )
    tokenize_tasks: int = Field(
        default=2,
        ge=1,
        description="Read-and-tokenize tasks running at once (each a Ray worker process that "
        "loads the tokenizer once; more only crowd a small machine).",
    )
    tokenize_batch_rows: int = Field(
        default=1024, ge=1, description="Rows per tokenize batch (packed together into blocks)."
    )

    def cpus_needed(self) -> float:
        """What the run reserves at once: every worker and every tokenize task. Workers hold
        their CPUs for the whole run, so tokenize tasks must fit beside them."""
        return self.workers * self.cpus_per_worker + self.tokenize_tasks * self.tokenize_cpus

    def torch_threads(self) -> int:
        return max(1, int(self.cpus_per_worker))

    def use_gpu(self, cluster_gpus: float) -> bool:
        """Whether the workers train on GPUs (one each), by the `gpus` policy."""
        if self.gpus == "never":
            return False
        return self.gpus == "always" or cluster_gpus >= self.workers

    def problem(self, cluster_cpus: float, cluster_gpus: float, largest_node_cpus: float):
        """Why the run could not be scheduled whole on this cluster (naming the fields), or
        None: nothing of it may wait for CPUs another part holds."""
        needed = self.cpus_needed()
        if needed > cluster_cpus:
            return (
                f"resources: the run reserves {needed:g} CPUs at once (resources.workers "
                f"{self.workers} x resources.cpus_per_worker {self.cpus_per_worker:g} + "
                f"resources.tokenize_tasks {self.tokenize_tasks} x resources.tokenize_cpus "
                f"{self.tokenize_cpus:g}), but the Ray cluster has {cluster_cpus:g}"
            )
        if self.cpus_per_worker > largest_node_cpus:
            return (
                f"resources.cpus_per_worker: {self.cpus_per_worker:g} CPUs, but the largest "
                f"node of the Ray cluster has {largest_node_cpus:g}"
            )
        if self.gpus == "always" and cluster_gpus < self.workers:
            return (
                f"resources.gpus is 'always': {self.workers} workers need a GPU each, but the "
                f"Ray cluster has {cluster_gpus:g}"
            )
        return None


class FailureSettings(BaseModel):
    """Failure and preemption budgets (Ray Train's FailureConfig), and how fast it notices."""

    max_failures: int = Field(
        default=2,
        ge=-1,
        description="Worker-group failures (a worker killed, a node lost without warning) to "
        "recover from the latest checkpoint; -1: no limit.",
    )
    max_preemption_failures: int = Field(
        default=-1,
        ge=-1,
        description="Preemptions (a node drained with the preemption reason) to recover from, "
        "counted apart from max_failures; -1: no limit.",
    )
    preemption_grace_s: float = Field(
        default=0.0,
        ge=0,
        description="How long workers may run past a preemption deadline before the restart.",
    )
    relax_collectives_on_preemption: bool = Field(
        default=False,
        description="Let the surviving ranks commit a checkpoint without the preempted ones "
        "(Ray ignores it when rank 0 is preempted); only needed when a checkpoint outlasts "
        "the drain window.",
    )
    preemption_poll_s: float = Field(
        default=5.0, gt=0, description="How often Ray Train's watcher polls for drained nodes."
    )
    health_check_s: float = Field(
        default=0.1,
        gt=0,
        description="How often the Train controller polls its workers. Each worker holds one "
        "unread report, so a loop that reports every step runs no faster than this.",
    )
    process_group_shutdown_s: int = Field(
        default=5,
        ge=1,
        description="How long a restart waits for the workers to leave their torch process "
        "group (Ray's default: 30 s); a worker stuck in a collective with a dead peer never "
        "does, so a restart after a lost worker waits this long.",
    )


class CorpusSettings(BaseModel):
    """Which columns of the prepared data hold the text (one text column, or a prompt and a
    completion, joined), and where its tokenized blocks are kept between epochs."""

    text: str = Field(default="text", min_length=1, description="The plain-text column.")
    prompt: str = Field(default="prompt", min_length=1, description="The prompt column.")
    completion: str = Field(
        default="completion", min_length=1, description="The completion column."
    )
    layout: Literal["auto", "text", "prompt_completion"] = Field(
        default="auto",
        description="'auto': the text column if the data has it, else prompt and completion.",
    )
    tokenized: Literal["object_store", "stream"] = Field(
        default="object_store",
        description="'object_store': Ray Data tokenizes the train split once into the object "
        "store (spilled to disk past its size) and every epoch streams the workers their "
        "shards from there; 'stream': read and tokenize it again every epoch (for a corpus "
        "larger than the object store and its spill space; each epoch then waits seconds for "
        "the pipeline to start).",
    )

    def resolve(self, columns: list[str]) -> tuple[Layout, list[str]]:
        """The layout and the columns it reads; ValueError naming what is missing."""
        has_text = self.text in columns
        has_pair = self.prompt in columns and self.completion in columns
        if self.layout == "text" or (self.layout == "auto" and has_text):
            if not has_text:
                raise ValueError(
                    f"corpus.text: the data has no column {self.text!r} (it has {columns})"
                )
            return "text", [self.text]
        if not has_pair:
            missing = [c for c in (self.prompt, self.completion) if c not in columns]
            fields = "corpus.text, or corpus.prompt and corpus.completion"
            raise ValueError(
                f"{fields}: the data has no text column {self.text!r} and no "
                f"{' or '.join(repr(c) for c in missing)} (it has {columns})"
            )
        return "prompt_completion", [self.prompt, self.completion]


class TrainSpec(BaseModel):
    """What every training worker and tokenize task receives."""

    base: ModelLocation
    training: TrainingSettings
    layout: Layout
    text_columns: list[str]
    torch_threads: int = 1
    use_gpu: bool = False
    preemption_grace_s: float = 0.0
    # Ray Train's watcher polls for drained nodes this often; the loop asks about as often.
    preemption_poll_s: float = 5.0
