"""The Train controller's side of the history: a Ray Train UserCallback that keeps rank 0's
report of every step (and each worker failure) in the run's storage, as HISTORY_FILE (JSON
lines) beside the checkpoints. It lives in the controller, which outlives worker-group
restarts; a flow re-run starts a new controller, which appends to what the last one wrote.

On a local or shared folder every record is appended as it comes, so a controller killed with
its flow process loses none. On a URI (object stores take no appends) the whole file is
written again at most every FLUSH_S, and at once for a checkpoint, a preemption, a resume or a
failure: a killed controller can lose the steps of its last FLUSH_S."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ray.train import UserCallback

from prefect_ray_lifecycle.workloads.llm.train.history import (
    CONTROLLER_START,
    WORKER_FAILURE,
    read_history,
)

__all__ = ["HistoryRecorder"]

# On a URI, steps are written at most this often; checkpoints, preemptions, resumes and
# failures at once.
FLUSH_S = 2.0
URGENT_KEYS = ("checkpoint_kind", "preemption", "resumed_from", "event")


class HistoryRecorder(UserCallback):
    def __init__(self, location: str):
        self.location = location
        self.records: list[dict[str, Any]] | None = None
        self.pending: list[dict[str, Any]] = []
        self.written_at = 0.0

    def _filesystem(self):
        import pyarrow.fs

        if "://" in self.location:
            return pyarrow.fs.FileSystem.from_uri(self.location)
        return pyarrow.fs.LocalFileSystem(), self.location

    def _add(self, record: dict[str, Any], urgent: bool) -> None:
        if self.records is None:
            self.records = read_history(self.location)
            if self.records:  # a new controller for a run that has a history: a flow re-run
                self._add({"event": CONTROLLER_START, "time": time.time()}, urgent=False)
        self.records.append(record)
        self.pending.append(record)
        if "://" not in self.location:
            Path(self.location).parent.mkdir(parents=True, exist_ok=True)
            with open(self.location, "a") as stream:
                stream.writelines(json.dumps(r) + "\n" for r in self.pending)
            self.pending = []
        elif urgent or time.monotonic() - self.written_at >= FLUSH_S:
            filesystem, path = self._filesystem()
            filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
            with filesystem.open_output_stream(path) as stream:
                stream.write("".join(json.dumps(r) + "\n" for r in self.records).encode())
            self.pending = []
            self.written_at = time.monotonic()

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        record = dict(metrics[0]) if metrics else {}
        if not record:
            return
        if checkpoint is not None:
            record["checkpoint_path"] = checkpoint.path
        self._add(record, urgent=any(key in record for key in URGENT_KEYS))

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        failure = {
            "event": WORKER_FAILURE,
            "ranks": sorted(worker_exceptions),
            "error": str(next(iter(worker_exceptions.values())))[:500],
        }
        last = self.records[-1] if self.records else {}
        if all(last.get(key) == value for key, value in failure.items()):
            return  # the same failure, seen again by the next poll
        self._add({**failure, "time": time.time()}, urgent=True)
