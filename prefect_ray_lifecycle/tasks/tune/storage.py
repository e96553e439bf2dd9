"""Where a sweep's experiment lives: a folder every Ray node reaches (NFS, a shared volume) or a
pyarrow filesystem URI (s3://, gs://, abfs://, hdfs://, file://), the local copy of a
checkpoint that evaluation and registration read, and where the sweep's chart is saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXPERIMENT_NAME = "sweep"
# Checkpoints of remote storage are copied here (per flow run and trial) to be evaluated and
# registered: MLflow logs artifacts from local files.
LOCAL_CHECKPOINTS = Path("~/.cache/prefect-ray-lifecycle/checkpoints")
# The sweep's chart of an experiment on remote storage is drawn here (per flow run).
LOCAL_CHARTS = Path("~/.cache/prefect-ray-lifecycle/charts")
CHART_NAME = "sweep.png"


def is_uri(storage: str) -> bool:
    return "://" in storage


def check_storage_root(storage_root: str) -> None:
    """Fail before any Ray work when storage_root is neither a path nor a URI pyarrow knows."""
    if not is_uri(storage_root):
        return
    import pyarrow.fs

    try:
        pyarrow.fs.FileSystem.from_uri(storage_root)
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError, OSError) as error:
        raise ValueError(
            f"storage_root {storage_root!r} is not a pyarrow filesystem URI pyarrow can open "
            f"here ({error})"
        ) from None


def experiment_path(storage_root: str, flow_run_id: str | None, name: str = EXPERIMENT_NAME) -> str:
    """Where a flow run's sweep (or other Ray run `name`) lives: the same flow run (retry,
    re-run) finds it again."""
    run = flow_run_id or "no-flow-run"
    if is_uri(storage_root):
        return f"{storage_root.rstrip('/')}/{run}/{name}"
    return str(Path(storage_root).expanduser().resolve() / run / name)


def split_experiment(path: str) -> tuple[str, str]:
    """(storage_path, name) as Tune's RunConfig takes them."""
    parent, _, name = path.rstrip("/").rpartition("/")
    return parent, name


def checkpoint_location(checkpoint: Any, experiment: str) -> str:
    """A Tune checkpoint named the way its experiment is: a path, or a URI under its URI."""
    import pyarrow.fs

    if not is_uri(experiment):
        return checkpoint.path
    _, root = pyarrow.fs.FileSystem.from_uri(experiment)
    relative = checkpoint.path.removeprefix(root.rstrip("/"))
    return f"{experiment.rstrip('/')}{relative}"


def local_checkpoint(
    checkpoint: Any, flow_run_id: str | None, trial_id: str, cache: Path = LOCAL_CHECKPOINTS
) -> str:
    """A folder on this machine holding the checkpoint: its own path on a local filesystem, a
    copy under `cache` (downloaded once per flow run and trial) on remote storage."""
    import pyarrow.fs

    if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        return checkpoint.path
    target = (
        cache.expanduser() / (flow_run_id or "no-flow-run") / trial_id / Path(checkpoint.path).name
    )
    if not target.is_dir():
        partial = target.with_name(f"{target.name}.partial")
        checkpoint.to_directory(str(partial))
        partial.rename(target)
    return str(target)


def local_chart(experiment: str, flow_run_id: str | None, cache: Path = LOCAL_CHARTS) -> Path:
    """Where the sweep's chart is saved on this machine: next to the experiment folder (in the
    flow run's folder) when it is local, under `cache` (per flow run) when it is a URI."""
    if is_uri(experiment):
        return cache.expanduser() / (flow_run_id or "no-flow-run") / CHART_NAME
    return Path(experiment).parent / CHART_NAME
