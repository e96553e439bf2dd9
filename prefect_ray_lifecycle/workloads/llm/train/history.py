"""The history of a fine-tune: what rank 0 reported at every step (ray.train.report), kept by
the Train controller's callback (recorder.HistoryRecorder) in the run's storage across worker
restarts and flow re-runs, and what can be read from it (pure): resumes and what each lost,
preemptions, checkpoints, the eval loss before and after.

A record is a dict. Every step record has `step`, `epoch`, `tokens_seen`, `loss`, `lr`,
`tokens_per_s`, `step_s`, `attempt` (one id per worker-group start), `time`,
`repeated_blocks` and `reread_blocks` (running totals along the run that survived); some add
`eval_loss`, `checkpoint_kind` (+ `checkpoint_path`), `preemption` (the first step that saw
one: deadline, ranks, nodes), `resumed_from` (the first step after a resume: the checkpoint's
step, kind and tokens) or `worker_nodes` (the first record of an attempt: each rank's node).
Step 0 is the base model's eval loss. The controller adds `event` records: `controller-start`
(a new controller found this history: a flow re-run) and `worker-failure`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = [
    "CONTROLLER_START",
    "HISTORY_FILE",
    "WORKER_FAILURE",
    "CheckpointMark",
    "HistorySummary",
    "Preemption",
    "Resume",
    "ResumeKind",
    "read_history",
    "summarize",
]

HISTORY_FILE = "history.jsonl"
CONTROLLER_START = "controller-start"
WORKER_FAILURE = "worker-failure"
# A resume after a preemption the run saw coming, after a worker or node lost without warning,
# or of a flow run that died and ran again (its controller died with it).
ResumeKind = Literal["preemption", "worker failure", "flow re-run"]


class Resume(BaseModel):
    """One restart of the training loop, and what it cost."""

    kind: ResumeKind = Field(description="'preemption', 'worker failure' or 'flow re-run'.")
    from_step: int = Field(description="The step of the checkpoint it resumed from (0: base).")
    reached_step: int = Field(description="The last step the interrupted attempt finished.")
    checkpoint_kind: str = Field(description="Kind of that checkpoint ('' for the base).")
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


class Preemption(BaseModel):
    """A preemption notice, as the training loop first saw it."""

    step: int = Field(description="The first step that saw the notice.")
    tokens_seen: int = Field(description="Tokens trained on then.")
    deadline_ms: int | None = Field(description="When the node goes (UNIX ms), as drained.")
    nodes: list[str] = Field(description="The preempted nodes.")
    ranks: list[int] = Field(description="The worker ranks on them.")
    detected_at: float = Field(description="When the loop saw it (UNIX seconds).")


class CheckpointMark(BaseModel):
    """A checkpoint the run took."""

    step: int = Field(description="The optimizer step it holds.")
    tokens_seen: int = Field(description="Tokens trained on when it was taken.")
    kind: str = Field(description="'periodic', 'jit' (before a preemption) or 'final'.")
    eval_loss: float | None = Field(description="Held-out eval loss of its weights.")
    path: str | None = Field(description="Where it was written (a path, or a path on the URI).")
    kept: bool = Field(default=False, description="Still in storage (the N best and the latest).")


@dataclass(frozen=True)
class HistorySummary:
    steps: int  # the last step trained
    tokens_seen: int
    base_eval_loss: float | None  # the base model, before any step
    final_eval_loss: float | None
    best_eval_loss: float | None
    tokens_per_s: float | None  # median over steps
    resumes: list[Resume] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    checkpoints: list[CheckpointMark] = field(default_factory=list)


def read_history(location: str) -> list[dict[str, Any]]:
    """The records at `location` (a path or pyarrow URI of HISTORY_FILE, JSON lines); [] when
    absent."""
    import pyarrow.fs

    if "://" in location:
        filesystem, path = pyarrow.fs.FileSystem.from_uri(location)
    else:
        filesystem, path = pyarrow.fs.LocalFileSystem(), location
    if filesystem.get_file_info(path).type == pyarrow.fs.FileType.NotFound:
        return []
    with filesystem.open_input_stream(path) as stream:
        lines = stream.read().decode().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return records


def _attempts(records: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], bool]]:
    """Step records grouped by attempt, in order, each with whether a controller-start came
    right before it."""
    groups: list[tuple[list[dict[str, Any]], bool]] = []
    restarted = False
    for record in records:
        if record.get("event") == CONTROLLER_START:
            restarted = True
            continue
        if "step" not in record:
            continue
        if not groups or groups[-1][0][0].get("attempt") != record.get("attempt"):
            groups.append(([], restarted))
            restarted = False
        groups[-1][0].append(record)
    return groups


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def summarize(records: list[dict[str, Any]], blocks_per_step: int) -> HistorySummary:
    """What the history says: the resumes and their cost, preemptions, checkpoints and eval
    losses. `blocks_per_step`: micro-batch size x accumulation x workers."""
    attempts = _attempts(records)
    resumes = []
    for index in range(1, len(attempts)):
        before, _ = attempts[index - 1]
        after, restarted = attempts[index]
        resumed = after[0].get("resumed_from") or {}
        from_step = int(resumed.get("step", 0))
        reached = max(int(r["step"]) for r in before)
        if restarted:
            kind: ResumeKind = "flow re-run"
        elif any("preemption" in r for r in before):
            kind = "preemption"
        else:
            kind = "worker failure"
        lost = max(0, reached - from_step)
        resumes.append(
            Resume(
                kind=kind,
                from_step=from_step,
                reached_step=reached,
                checkpoint_kind=str(resumed.get("kind", "")),
                tokens_seen=int(resumed.get("tokens_seen", 0)),
                lost_steps=lost,
                replayed_blocks=lost * blocks_per_step,
                reread_blocks=int(after[-1].get("reread_blocks", 0))
                - int(resumed.get("reread_blocks", 0)),
                repeated_blocks=int(after[-1].get("repeated_blocks", 0))
                - int(resumed.get("repeated_blocks", 0)),
            )
        )
    steps = [r for r in records if "step" in r]
    trained = [float(r["eval_loss"]) for r in steps if r["step"] and r.get("eval_loss") is not None]
    survivors = attempts[-1][0] if attempts else []
    base = next((r for r in steps if r["step"] == 0 and r.get("eval_loss") is not None), None)
    return HistorySummary(
        steps=int(survivors[-1]["step"]) if survivors else 0,
        tokens_seen=int(survivors[-1]["tokens_seen"]) if survivors else 0,
        base_eval_loss=float(base["eval_loss"]) if base else None,
        final_eval_loss=next(
            (float(r["eval_loss"]) for r in reversed(steps) if r.get("eval_loss") is not None),
            None,
        ),
        best_eval_loss=min(trained, default=None),
        tokens_per_s=_median([float(r["tokens_per_s"]) for r in steps if r.get("tokens_per_s")]),
        resumes=resumes,
        preemptions=[
            Preemption(step=r["step"], tokens_seen=r["tokens_seen"], **r["preemption"])
            for r in steps
            if "preemption" in r
        ],
        checkpoints=[
            CheckpointMark(
                step=r["step"],
                tokens_seen=r["tokens_seen"],
                kind=r["checkpoint_kind"],
                eval_loss=r.get("eval_loss"),
                path=r.get("checkpoint_path"),
            )
            for r in steps
            if r.get("checkpoint_kind")
        ],
    )
