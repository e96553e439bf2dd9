"""The typed settings of one Tune sweep of an RLlib algorithm: search space, scheduler, stop
conditions, trial resources and checkpoints. Flow parameters, so every field is described."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from prefect_ray_lifecycle.workloads.rl import rllib

__all__ = [
    "DEFAULT_HYPERPARAMETERS",
    "DEFAULT_SEARCH_SPACE",
    "DEFAULT_STORAGE_ROOT",
    "CheckpointPolicy",
    "SchedulerSettings",
    "StopConditions",
    "SweepConfig",
    "TrialResourceSettings",
]

DEFAULT_STORAGE_ROOT = "~/ray_results/tune-sweep"
# PPO on CartPole: RLlib's tuned example, with a smaller batch so trials report often.
DEFAULT_HYPERPARAMETERS: dict[str, Any] = {
    "train_batch_size_per_learner": 2000,
    "minibatch_size": 128,
    "num_epochs": 6,
    "lr": 3e-4,
    "vf_loss_coeff": 0.01,
}
DEFAULT_SEARCH_SPACE: dict[str, Any] = {"lr": {"loguniform": [1e-4, 1e-3]}}


class SchedulerSettings(BaseModel):
    kind: Literal["asha", "fifo"] = Field(
        default="asha",
        description=(
            "'asha': stop weak trials early (Async Successive Halving); 'fifo': run "
            "every trial to its stop condition."
        ),
    )
    max_iterations: int = Field(
        default=100, ge=1, description="ASHA: training iterations a trial may run at most."
    )
    grace_period: int = Field(
        default=2, ge=1, description="ASHA: iterations every trial runs before it may be stopped."
    )
    reduction_factor: float = Field(
        default=3, gt=1, description="ASHA: 1/reduction_factor of trials go on at each rung."
    )


class StopConditions(BaseModel):
    """A trial stops at the first condition met; empty ones are ignored."""

    training_iterations: int | None = Field(
        default=None, ge=1, description="Stop a trial after this many training iterations."
    )
    env_steps: int | None = Field(
        default=200_000, ge=1, description="Stop a trial after this many sampled env steps."
    )
    episode_return: float | None = Field(
        default=450.0, description="Stop a trial once its mean episode return reaches this."
    )
    trial_seconds: float | None = Field(
        default=None, gt=0, description="Stop a trial after this many seconds of training."
    )
    sweep_seconds: float | None = Field(
        default=None, gt=0, description="Stop the whole sweep after this many seconds."
    )

    @staticmethod
    def result_keys() -> dict[str, str]:
        """The flattened result key each per-trial condition compares, by field name."""
        return {
            "training_iterations": "training_iteration",
            "env_steps": rllib.ENV_STEPS_METRIC,
            "episode_return": rllib.RETURN_METRIC,
            "trial_seconds": "time_total_s",
        }

    def criteria(self) -> dict[str, float]:
        """Tune's stop dict (flattened result keys)."""
        pairs = {key: getattr(self, field) for field, key in self.result_keys().items()}
        return {key: value for key, value in pairs.items() if value is not None}


class TrialResourceSettings(BaseModel):
    env_runners: int = Field(
        default=0,
        ge=0,
        description="Remote env runners per trial; 0 samples in the trial's own process.",
    )
    cpus_per_env_runner: float = Field(default=1, gt=0, description="CPUs per env runner.")
    cpus: float = Field(
        default=1, gt=0, description="CPUs for the trial's main process (algorithm and learner)."
    )
    gpus: float = Field(default=0, ge=0, description="GPUs for the trial's learner.")
    custom: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Custom Ray resources the trial's main process and each env runner ask for, e.g. "
            "{'worker_node': 1} to run trials only on nodes started with "
            "`ray start --resources '{\"worker_node\": N}'`."
        ),
    )

    @field_validator("custom")
    @classmethod
    def _check_custom(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"custom resource {name!r} is not custom: use cpus or gpus")
            if not amount > 0:
                raise ValueError(f"custom resource {name!r} needs an amount > 0, got {amount!r}")
        return value

    def to_workload(self) -> rllib.TrialResources:
        return rllib.TrialResources(**self.model_dump())


class CheckpointPolicy(BaseModel):
    keep: int = Field(default=2, ge=1, description="Checkpoints kept per trial: the N best.")
    metric: str = Field(
        default=rllib.RETURN_METRIC,
        description="Result key that ranks checkpoints (higher is better).",
    )
    every_iterations: int = Field(
        default=0,
        ge=0,
        description="Also checkpoint every N iterations (0: only at the end of a trial).",
    )


class SweepConfig(BaseModel):
    """One Tune sweep of an RLlib algorithm, written as data."""

    algorithm: str = Field(default="PPO", description="RLlib algorithm name, e.g. PPO, APPO, DQN.")
    environment: str = Field(
        default="CartPole-v1",
        description=(
            "A Gymnasium id, or a 'module:function' env creator that takes env_config; the "
            "module must be importable on the cluster (ship it with the RayCluster block's "
            "runtime_env working_dir or py_modules) and in the flow process (evaluation)."
        ),
    )
    env_config: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the env creator (or gymnasium.make)."
    )
    hyperparameters: dict[str, Any] = Field(
        default_factory=lambda: dict(DEFAULT_HYPERPARAMETERS),
        description="Fixed algorithm config fields shared by every trial.",
    )
    search_space: dict[str, Any] = Field(
        default_factory=lambda: dict(DEFAULT_SEARCH_SPACE),
        description=(
            "Config fields to search, e.g. {'lr': {'loguniform': [1e-4, 1e-3]}, "
            "'minibatch_size': {'choice': [64, 128]}}; kinds: uniform, loguniform, "
            "choice, randint (high exclusive), grid."
        ),
    )
    num_samples: int = Field(
        default=4, ge=1, description="Trials to sample (times the grid, if any)."
    )
    max_concurrent_trials: int | None = Field(
        default=None, ge=1, description="Trials running at once; empty: as resources allow."
    )
    scheduler: SchedulerSettings = Field(
        default_factory=SchedulerSettings, description="Trial scheduler and its settings."
    )
    stop: StopConditions = Field(
        default_factory=StopConditions, description="When a trial (or the sweep) stops."
    )
    resources: TrialResourceSettings = Field(
        default_factory=TrialResourceSettings, description="What one trial asks the cluster."
    )
    checkpoints: CheckpointPolicy = Field(
        default_factory=CheckpointPolicy, description="Which checkpoints each trial keeps."
    )
    max_failures: int = Field(
        default=1, ge=0, description="Times a failed trial is retried before the sweep fails."
    )
    seed: int = Field(
        default=0,
        ge=0,
        description=(
            "Seeds the search space's sampling, every trial's envs and the held-out evaluation."
        ),
    )
    metric: str = Field(
        default=rllib.RETURN_METRIC, description="Result key that ranks trials (higher is better)."
    )

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        allowed = rllib.config_fields(rllib.algorithm_class(self.algorithm).get_default_config())
        rllib.parse_search_space(self.search_space, allowed)
        unknown = sorted(set(self.hyperparameters) - allowed)
        if unknown:
            raise ValueError(
                f"hyperparameters key {unknown[0]!r} is not a {self.algorithm} config field"
            )
        return self
