"""A fine-tune checkpoint: a Hugging Face folder the LLM app loads as it is (config, safetensors
weights, tokenizer, generation config at its top level), plus `trainer_state/` with what a
resume needs (optimizer, scheduler, each rank's RNG state, and the step, epoch and data
position as JSON). vLLM and `from_pretrained` read the top level only."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "STATE_DIR",
    "CheckpointKind",
    "TrainState",
    "load_training_state",
    "read_state",
    "save_checkpoint",
]

STATE_DIR = "trainer_state"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
CheckpointKind = Literal["periodic", "jit", "final"]


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


@dataclass
class TrainState:
    """Where a run is: the step done, and its place in the data (Ray Data cannot checkpoint an
    iterator, so a resume re-reads the epoch and skips the micro-batches already taken)."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches each rank took in this epoch
    tokens_seen: int = 0  # by the optimizer, all ranks, along the run that survived
    epoch_block_ids: list[int] = field(default_factory=list)  # blocks trained in this epoch
    eval_loss: float | None = None
    kind: str = ""  # CheckpointKind of the checkpoint holding it
    repeated_blocks: int = 0  # blocks trained twice in one epoch because of resumes, so far
    reread_blocks: int = 0  # blocks read again and skipped on resumes, so far
    resumes: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainState:
        return cls(**json.loads(text))


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def save_checkpoint(
    folder: Path, *, rank: int, model, tokenizer, optimizer, scheduler, state: TrainState
) -> None:
    """Write this rank's part of a checkpoint into `folder`: everything from rank 0 (whose
    model, optimizer and scheduler equal every rank's under DDP), the RNG state from each."""
    import torch

    (folder / STATE_DIR).mkdir(parents=True, exist_ok=True)
    if rank == 0:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        torch.save(optimizer.state_dict(), folder / STATE_DIR / OPTIMIZER_FILE)
        torch.save(scheduler.state_dict(), folder / STATE_DIR / SCHEDULER_FILE)
        (folder / STATE_DIR / STATE_FILE).write_text(state.to_json())
    torch.save(_rng_state(), folder / STATE_DIR / _rng_file(rank))


def load_training_state(folder: Path, *, rank: int, optimizer, scheduler) -> TrainState:
    """Restore the optimizer, scheduler and this rank's RNG from a checkpoint folder; return
    its TrainState. A rank the checkpoint has no RNG for (more workers now) keeps its seed."""
    import numpy as np
    import torch

    optimizer.load_state_dict(torch.load(folder / STATE_DIR / OPTIMIZER_FILE, weights_only=True))
    scheduler.load_state_dict(torch.load(folder / STATE_DIR / SCHEDULER_FILE, weights_only=False))
    rng_file = folder / STATE_DIR / _rng_file(rank)
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)  # our own file: numpy's state is a tuple
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
    return read_state(folder)


def read_state(checkpoint: str | Path) -> TrainState:
    """The TrainState of a checkpoint: a folder here, or a pyarrow filesystem URI."""
    location = str(checkpoint)
    if "://" not in location:
        return TrainState.from_json((Path(location) / STATE_DIR / STATE_FILE).read_text())
    import pyarrow.fs

    filesystem, path = pyarrow.fs.FileSystem.from_uri(location)
    with filesystem.open_input_stream(f"{path.rstrip('/')}/{STATE_DIR}/{STATE_FILE}") as f:
        return TrainState.from_json(f.read().decode())
