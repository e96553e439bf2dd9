"""The driver's side of a fine-tune (no Prefect): the Ray Data pipelines that tokenize the
prepared splits, the TorchTrainer over them, and its fit. Runs where Ray is initialised.

The train split streams: Ray Data reads and tokenizes it while the workers train, epoch
after epoch, and hands each worker its shard (streaming_split); the corpus is never
gathered in the driver. The eval split, small and read at every evaluation, is tokenized once
into the object store."""

from __future__ import annotations

from typing import Any

from prefect_ray_lifecycle.compat import ray_internals
from prefect_ray_lifecycle.workloads.data.source import data_files, filesystem_and_path
from prefect_ray_lifecycle.workloads.llm.train.loop import EVAL_DATASET, TRAIN_DATASET, train_loop
from prefect_ray_lifecycle.workloads.llm.train.recorder import HistoryRecorder
from prefect_ray_lifecycle.workloads.llm.train.settings import (
    CHECKPOINT_METRIC,
    FailureSettings,
    ResourceSettings,
    TrainSpec,
)
from prefect_ray_lifecycle.workloads.llm.train.tokenize import PATH, pack_files

__all__ = ["RUN_NAME", "build_trainer", "job_env_vars", "tokenized_split"]

# The Ray Train run's folder name under the flow run's storage folder.
RUN_NAME = "finetune"


def tokenized_split(folder: str, spec: TrainSpec, resources: ResourceSettings):
    """A lazy Ray Dataset of {input_ids, block_id} blocks from a split's parquet files: one
    map_batches task per file (tokenize.pack_files), at most `resources.tokenize_tasks` at
    once, each reserving `resources.tokenize_cpus`, so they run beside workers that hold their
    CPUs for the whole run."""
    import ray.data

    filesystem, path = filesystem_and_path(folder)
    files = sorted(i.path for i in data_files(filesystem, path) if i.path.endswith(".parquet"))
    if not files:
        raise ValueError(f"{folder} holds no parquet files")
    dataset = ray.data.from_items(
        [{PATH: file} for file in files], override_num_blocks=len(files)
    ).map_batches(
        pack_files,
        batch_size=1,
        num_cpus=resources.tokenize_cpus,
        compute=ray.data.TaskPoolStrategy(size=resources.tokenize_tasks),
        fn_kwargs={
            "folder": folder,
            "base": spec.base.model_dump_json(),
            "seq_len": spec.training.seq_len,
            "layout": spec.layout,
            "columns": spec.text_columns,
            "chunk_rows": resources.tokenize_batch_rows,
        },
    )
    # Progress bars of every epoch's split would flood the flow run's logs.
    dataset.context.enable_progress_bars = False
    return dataset


def build_trainer(
    spec: TrainSpec,
    datasets: dict[str, Any],
    resources: ResourceSettings,
    failures: FailureSettings,
    storage_path: str,
    history_location: str,
    callbacks: list | None = None,
):
    """The TorchTrainer of one fine-tune run, stored at `storage_path`/RUN_NAME: the same path
    again (a re-run of the flow run) resumes from its latest checkpoint. `callbacks`: more
    Ray Train callbacks beside the history's (a sweep's trial reports to Tune)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    per_worker: dict[str, float] = {"CPU": resources.cpus_per_worker}
    if spec.use_gpu:
        per_worker["GPU"] = 1
    return TorchTrainer(
        train_loop,
        train_loop_config=spec.model_dump(mode="json"),
        scaling_config=ScalingConfig(
            num_workers=resources.workers,
            use_gpu=spec.use_gpu,
            resources_per_worker=per_worker,
            placement_strategy=resources.placement_strategy,
        ),
        run_config=RunConfig(
            name=RUN_NAME,
            storage_path=storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=spec.training.keep_checkpoints,
                checkpoint_score_attribute=CHECKPOINT_METRIC,
                checkpoint_score_order="min",
            ),
            failure_config=FailureConfig(
                max_failures=failures.max_failures,
                max_preemption_failures=failures.max_preemption_failures,
                preemption_grace_s=failures.preemption_grace_s,
                relax_collectives_on_preemption=failures.relax_collectives_on_preemption,
            ),
            callbacks=[HistoryRecorder(history_location), *(callbacks or [])],
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
        datasets={TRAIN_DATASET: datasets[TRAIN_DATASET], EVAL_DATASET: datasets[EVAL_DATASET]},
    )


def job_env_vars(failures: FailureSettings) -> dict[str, str]:
    """Environment variables for the Ray job of a fine-tune: its Train controller (which
    inherits the job's env_vars, merged with its own) reads how often to poll its workers and
    the drain state, and how long to wait for the torch process group to go on a restart
    (`ray.train.constants.TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S`, read by TorchConfig's
    on_shutdown in the controller)."""
    from ray.train.constants import TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S

    return {
        **ray_internals.train_controller_env(failures.health_check_s, failures.preemption_poll_s),
        TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S: str(failures.process_group_shutdown_s),
    }
