"""The fine-tune's plan, made in the flow process before any Ray work: the corpus has rows and
the text columns asked for, the base is a causal LM with a tokenizer whose context holds
`training.seq_len`, the storage root is usable. Each failure names the parameter."""

from __future__ import annotations

import posixpath
import tempfile
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from prefect_ray_lifecycle.tasks.finetune.config import FineTuneInputError, FineTunePlan
from prefect_ray_lifecycle.tasks.tune import storage as run_storage
from prefect_ray_lifecycle.workloads.data.schema import summarize_source
from prefect_ray_lifecycle.workloads.data.source import SourceError, resolve_source
from prefect_ray_lifecycle.workloads.llm.models import (
    ModelLocation,
    causal_lm_problem,
    context_problem,
    local_model,
)
from prefect_ray_lifecycle.workloads.llm.tiny import build_tiny_llm
from prefect_ray_lifecycle.workloads.llm.train.history import HISTORY_FILE
from prefect_ray_lifecycle.workloads.llm.train.settings import (
    CorpusSettings,
    FailureSettings,
    ResourceSettings,
    TrainingSettings,
    TrainSpec,
)
from prefect_ray_lifecycle.workloads.llm.train.trainer import RUN_NAME

__all__ = ["CHART_FILE", "TINY_BASE", "default_base", "plan_finetune", "split_problem"]

# Where the default base (the tiny Llama) is built once, under the storage root.
TINY_BASE = "base/tiny-llama-seed-0"
CHART_FILE = "loss-chart.png"


def default_base(storage_root: str) -> ModelLocation:
    """The tiny Llama (workloads.llm.tiny), built once under the storage root, where every
    node reads it (a shared folder, or the URI)."""
    if not run_storage.is_uri(storage_root):
        folder = Path(storage_root).expanduser().resolve() / TINY_BASE
        if not (folder / "config.json").is_file():
            build_tiny_llm(folder)
        return ModelLocation(path=str(folder))
    import pyarrow.fs

    uri = f"{storage_root.rstrip('/')}/{TINY_BASE}"
    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    if filesystem.get_file_info(f"{path}/config.json").type == pyarrow.fs.FileType.NotFound:
        with tempfile.TemporaryDirectory(prefix="tiny-llama-") as scratch:
            built = build_tiny_llm(Path(scratch) / "model")
            filesystem.create_dir(path, recursive=True)
            pyarrow.fs.copy_files(
                str(built),
                path,
                source_filesystem=pyarrow.fs.LocalFileSystem(),
                destination_filesystem=filesystem,
            )
    return ModelLocation(path=uri)


def _columns(source: str, expected_schema: dict[str, str] | None) -> list[str]:
    try:
        files = resolve_source(source)
        summary = summarize_source(files)
    except SourceError as error:
        raise FineTuneInputError(f"data.source: {error}") from None
    if not summary.has_rows:
        raise FineTuneInputError(
            f"data.source {source!r} has no rows ({len(files.paths)} {files.format} files): "
            "the corpus is empty"
        )
    return list(expected_schema) if expected_schema else list(summary.columns)


def _check_base(base: ModelLocation, seq_len: int) -> None:
    try:
        folder = local_model(base)
    except (OSError, ValueError) as error:
        raise FineTuneInputError(f"base {base.label}: cannot be read here ({error})") from None
    if problem := causal_lm_problem(folder):
        raise FineTuneInputError(f"base: {problem}")
    if problem := context_problem(folder, seq_len):
        raise FineTuneInputError(f"training.seq_len: {problem} (base {base.label})")


@task(cache_policy=NO_CACHE)
def plan_finetune(
    source: str,
    expected_schema: dict[str, str] | None,
    required_columns: list[str],
    corpus: CorpusSettings,
    base: ModelLocation | None,
    training: TrainingSettings,
    resources: ResourceSettings,
    failures: FailureSettings,
    storage_root: str,
    flow_run_id: str | None,
) -> FineTunePlan:
    """Check everything the flow process can see before any Ray work, and plan the run."""
    try:
        run_storage.check_storage_root(storage_root)
    except ValueError as error:
        raise FineTuneInputError(str(error)) from None
    try:
        layout, text_columns = corpus.resolve(_columns(source, expected_schema))
    except FineTuneInputError:
        raise
    except ValueError as error:
        raise FineTuneInputError(str(error)) from None
    base = base or default_base(storage_root)
    _check_base(base, training.seq_len)
    experiment = run_storage.experiment_path(storage_root, flow_run_id, RUN_NAME)
    storage_path = experiment.rsplit("/", 1)[0]
    return FineTunePlan(
        flow_run_id=flow_run_id,
        spec=TrainSpec(
            base=base,
            training=training,
            layout=layout,
            text_columns=text_columns,
            torch_threads=resources.torch_threads(),
            preemption_grace_s=failures.preemption_grace_s,
            preemption_poll_s=failures.preemption_poll_s,
        ),
        resources=resources,
        failures=failures,
        tokenized=corpus.tokenized,
        # Empty texts go to the quarantine, with the data-prep flow's other bad rows.
        required_columns=sorted({*required_columns, *text_columns}),
        base_label=base.label,
        storage_path=storage_path,
        experiment_path=experiment,
        history_location=posixpath.join(experiment, HISTORY_FILE),
        chart_location=posixpath.join(experiment, CHART_FILE),
    )


def split_problem(rows_train: int, rows_eval: int, rows_quarantined: int) -> str | None:
    """Why the prepared dataset cannot be trained and evaluated on (an empty split), or None."""
    if rows_train == 0:
        return (
            f"data: the prepared train split has no rows ({rows_eval} eval, "
            f"{rows_quarantined} quarantined): the corpus is empty after data-prep"
        )
    if rows_eval == 0:
        return (
            f"data.eval_fraction: the prepared eval split has no rows ({rows_train} train): "
            "the fine-tune needs held-out text for its eval loss"
        )
    return None
