"""The loop every Ray Train worker runs: a causal LM from the base (or the latest checkpoint),
DDP over gloo (NCCL on GPUs), AdamW with warm-up and cosine decay, gradient accumulation, a
held-out eval loss, checkpoints that are Hugging Face folders, and a just-in-time checkpoint
when a node of the run is being preempted.

Every step ends with the same collectives on every rank, in the same order: Ray Train's
`get_preemption_info` (a barrier that hands out rank 0's view) on the steps every rank agreed
to ask on (about once per poll interval of Ray Train's watcher until a preemption is seen,
then every step; see preemption.steps_between_checks), one all-reduce of the step's figures
and of each rank's wish to checkpoint now (so all ranks agree), then a report. Only rank 0's
report is kept (the history and the checkpoint's metrics)."""

from __future__ import annotations

import contextlib
import math
import os
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from prefect_ray_lifecycle.compat import ray_internals
from prefect_ray_lifecycle.workloads.llm.models import local_model
from prefect_ray_lifecycle.workloads.llm.train.preemption import (
    effective_deadline_s,
    jit_verdict,
    steps_between_checks,
)
from prefect_ray_lifecycle.workloads.llm.train.schedule import WarmupCosine
from prefect_ray_lifecycle.workloads.llm.train.settings import CHECKPOINT_METRIC, TrainSpec
from prefect_ray_lifecycle.workloads.llm.train.state import (
    CheckpointKind,
    TrainState,
    load_training_state,
    save_checkpoint,
)
from prefect_ray_lifecycle.workloads.llm.train.tokenize import BLOCK_ID, INPUT_IDS

__all__ = ["EVAL_DATASET", "TRAIN_DATASET", "train_loop"]

TRAIN_DATASET = "train"
EVAL_DATASET = "eval"
# A first guess of a checkpoint's cost, before one was measured.
CHECKPOINT_S_GUESS = 2.0
# After a just-in-time checkpoint a worker waits for Ray Train's restart; past the deadline
# by this much, something is wrong and it fails instead.
HOLD_PAST_DEADLINE_S = 60.0
STEP_S_SMOOTHING = 0.3


class EmptyTrainSplit(ValueError):
    """An epoch of a worker's train shard held no full micro-batch."""


def _unwrap(model):
    return getattr(model, "module", model)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class _Batches:
    """One rank's micro-batches, epoch after epoch, from its Ray Train dataset shard; on a
    resume, the epoch is read again from its start and the micro-batches already taken are
    skipped (Ray Data cannot checkpoint an iterator). Counts what that costs."""

    def __init__(self, shard, batch_size: int, state: TrainState, device):
        self.shard, self.batch_size, self.state, self.device = shard, batch_size, state, device
        self.iterator = None
        self.skip = state.batches_in_epoch
        # Blocks some rank trained in this epoch before the checkpoint: met again, they count
        # as trained twice (the resumed epoch hands blocks out anew).
        self.before_checkpoint = set(state.epoch_block_ids)
        self.taken: list[int] = []  # this rank's blocks since the last checkpoint
        self.repeated = 0
        self.reread = 0

    def _open(self) -> None:
        import torch

        self.iterator = iter(
            self.shard.iter_torch_batches(
                batch_size=self.batch_size, drop_last=True, dtypes=torch.int64, device=self.device
            )
        )

    def _new_epoch(self, empty: bool) -> None:
        if empty:
            raise EmptyTrainSplit(
                f"epoch {self.state.epoch} of this worker's train shard holds no full "
                f"micro-batch of {self.batch_size} blocks: the corpus is too small for "
                "training.micro_batch_size x resources.workers blocks of training.seq_len tokens"
            )
        self.state.epoch += 1
        self.state.batches_in_epoch = 0
        self.state.epoch_block_ids = []
        self.before_checkpoint = set()
        self.taken = []
        self.iterator = None

    def next(self) -> dict[str, Any]:
        while True:
            if self.iterator is None:
                self._open()
                fresh = True
            else:
                fresh = False
            try:
                while self.skip:
                    batch = next(self.iterator)
                    self.skip -= 1
                    self.reread += len(batch[BLOCK_ID])
                    fresh = False
                batch = next(self.iterator)
            except StopIteration:
                self.skip = 0
                self._new_epoch(empty=fresh)
                continue
            self.state.batches_in_epoch += 1
            ids = batch[BLOCK_ID].tolist()
            self.taken.extend(ids)
            self.repeated += sum(block in self.before_checkpoint for block in ids)
            return batch


class _WorkerRun:
    """One worker's part of the run, from setup to its last step."""

    def __init__(self, spec: TrainSpec):
        import ray.train
        import ray.train.torch
        import torch

        self.spec, self.settings = spec, spec.training
        ray_internals.quiet_train_report_logs()  # the history keeps every report
        torch.set_num_threads(spec.torch_threads)
        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()
        self.attempt = uuid.uuid4().hex[:8]
        checkpoint = ray.train.get_checkpoint()
        folder = (
            checkpoint.as_directory()
            if checkpoint
            else contextlib.nullcontext(str(local_model(spec.base)))
        )
        with folder as model_dir:
            self._load(Path(model_dir), resumed=checkpoint is not None)
        self.batches = _Batches(
            ray.train.get_dataset_shard("train"),
            self.settings.micro_batch_size,
            self.state,
            self.device,
        )
        self.eval_shard = ray.train.get_dataset_shard("eval")
        self.step_s: float | None = None
        self.checkpoint_s = CHECKPOINT_S_GUESS
        self.preemption: dict[str, Any] | None = None
        self.deadline_s: float | None = None
        self.jit_taken = False
        # The step this attempt next asks Ray Train about a preemption at (the same on every
        # rank: it is set from figures all ranks agreed on).
        self.next_check = self.state.step + 1
        # Fields of this attempt's first record: where each rank runs, what it resumed from.
        self.first_fields: dict[str, Any] = {"worker_nodes": self._gather(_node_id())}
        if self.resumed_from is not None:
            self.first_fields["resumed_from"] = self.resumed_from

    def _load(self, model_dir: Path, resumed: bool) -> None:
        import numpy as np
        import ray.train.torch
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        seed = self.settings.seed + self.rank
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = ray.train.torch.prepare_model(model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.settings.learning_rate,
            weight_decay=self.settings.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            WarmupCosine(
                self.settings.warmup_steps, self.settings.total_steps, self.settings.min_lr_ratio
            ),
        )
        self.state = TrainState()
        self.resumed_from: dict[str, Any] | None = None
        if resumed:
            self.state = load_training_state(
                model_dir, rank=self.rank, optimizer=self.optimizer, scheduler=self.scheduler
            )
            self.state.resumes += 1
            self.resumed_from = {
                "step": self.state.step,
                "kind": self.state.kind,
                "tokens_seen": self.state.tokens_seen,
                "repeated_blocks": self.state.repeated_blocks,
                "reread_blocks": self.state.reread_blocks,
            }

    # -- one step ---------------------------------------------------------------------------

    def _micro_batches(self) -> tuple[float, int, int]:
        """Forward and backward over the accumulation's micro-batches: (summed loss x
        predicted tokens, predicted tokens, input tokens) on this rank."""
        accumulate = self.settings.grad_accum_steps
        loss_sum, predicted, tokens = 0.0, 0, 0
        for index in range(accumulate):
            ids = self.batches.next()[INPUT_IDS]
            last = index == accumulate - 1
            sync = contextlib.nullcontext() if last or self.world == 1 else self.model.no_sync()
            with sync:
                loss = self.model(input_ids=ids, labels=ids).loss
                (loss / accumulate).backward()
            count = ids.numel() - ids.shape[0]
            loss_sum += loss.item() * count
            predicted += count
            tokens += ids.numel()
        return loss_sum, predicted, tokens

    def _optimizer_step(self) -> None:
        import torch

        if self.settings.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _watch_preemption(self, record: dict[str, Any]) -> bool:
        """Whether this rank wants the just-in-time checkpoint now."""
        import ray.train

        info = ray.train.get_preemption_info()  # a barrier: every rank gets rank 0's view
        if info is None or self.jit_taken:
            return False
        if self.preemption is None:
            detected = time.time()
            self.deadline_s = effective_deadline_s(info.deadline_ms, detected)
            self.preemption = {
                "deadline_ms": info.deadline_ms,
                "ranks": list(info.preempted_ranks),
                "nodes": list(info.preempted_node_ids),
                "detected_at": detected,
            }
            record["preemption"] = self.preemption
        verdict = jit_verdict(
            time.time(),
            self.deadline_s,
            self.step_s or 0.0,
            self.checkpoint_s,
            self.settings.jit_margin_s,
        )
        return verdict.kind == "checkpoint_now"

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order."""
        import torch.distributed as dist

        if self.world == 1:
            return [value]
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, value)
        return gathered

    def _agree(self, *values: float) -> list[float]:
        """Sum each value over the ranks: every rank gets the same numbers."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor.tolist()

    def evaluate(self) -> float:
        import torch

        core = _unwrap(self.model)
        core.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in self.eval_shard.iter_torch_batches(
                batch_size=self.settings.eval_batch_size, dtypes=torch.int64, device=self.device
            ):
                ids = batch[INPUT_IDS]
                predicted = ids.numel() - ids.shape[0]
                total += core(input_ids=ids, labels=ids).loss.item() * predicted
                count += predicted
        core.train()
        total, count = self._agree(total, count)
        return total / count if count else math.nan

    def _checkpoint_kind(self, jit: bool) -> CheckpointKind | None:
        if self.state.step >= self.settings.total_steps:
            return "final"
        if jit:
            return "jit"
        if self.state.step % self.settings.checkpoint_every_steps == 0:
            return "periodic"
        return None

    def _save(self, kind: CheckpointKind, record: dict[str, Any]) -> None:
        import ray.train

        started = time.monotonic()
        taken = self._gather(self.batches.taken)
        self.state.epoch_block_ids += [block for rank_ids in taken for block in rank_ids]
        self.batches.taken = []
        self.state.kind = kind
        self.state.eval_loss = record[CHECKPOINT_METRIC]
        with tempfile.TemporaryDirectory(prefix="finetune-ckpt-") as folder:
            save_checkpoint(
                Path(folder),
                rank=self.rank,
                model=_unwrap(self.model),
                tokenizer=self.tokenizer,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                state=self.state,
            )
            ray.train.report(
                record if self.rank == 0 else {},
                checkpoint=ray.train.Checkpoint.from_directory(folder),
                checkpoint_dir_name=f"checkpoint-{self.state.step:06d}-{kind}",
            )
        self.checkpoint_s = max(self.checkpoint_s, time.monotonic() - started)

    def _report(self, record: dict[str, Any]) -> None:
        import ray.train
        from ray.train import CheckpointUploadMode

        # Asynchronous: the step goes on while the controller has not read the last report.
        ray.train.report(
            record if self.rank == 0 else {}, checkpoint_upload_mode=CheckpointUploadMode.ASYNC
        )

    def _record(self, **fields: Any) -> dict[str, Any]:
        record = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "tokens_seen": self.state.tokens_seen,
            "attempt": self.attempt,
            "time": time.time(),
            "repeated_blocks": self.state.repeated_blocks,
            "reread_blocks": self.state.reread_blocks,
            "pid": os.getpid(),
            **fields,
        }
        record.update(self.first_fields)
        self.first_fields = {}
        return record

    def _hold(self) -> None:
        """Wait, training nothing, for Ray Train to restart the run from the just-in-time
        checkpoint at the deadline: a step now would be lost."""
        limit = (self.deadline_s or time.time()) + self.spec.preemption_grace_s
        while time.time() < limit + HOLD_PAST_DEADLINE_S:
            time.sleep(0.5)
        raise RuntimeError(
            f"took a just-in-time checkpoint at step {self.state.step} for a preemption with "
            f"deadline {self.deadline_s}, but Ray Train did not restart the run"
        )

    def train(self) -> dict[str, Any]:
        if self.state.step == 0:
            self._report(self._record(eval_loss=self.evaluate()))  # the base, before training
        while self.state.step < self.settings.total_steps:
            started = time.monotonic()
            loss_sum, predicted, tokens = self._micro_batches()
            self._optimizer_step()
            lr = self.scheduler.get_last_lr()[0]
            self.state.step += 1
            record: dict[str, Any] = {}
            asked = self.preemption is not None or self.state.step >= self.next_check
            wants_jit = asked and self._watch_preemption(record)
            loss_sum, predicted, tokens, jit, repeated, reread, ranks_s = self._agree(
                loss_sum,
                predicted,
                tokens,
                float(wants_jit),
                self.batches.repeated,
                self.batches.reread,
                time.monotonic() - started,
            )
            self.batches.repeated = self.batches.reread = 0
            if asked:
                poll_s = self.spec.preemption_poll_s
                self.next_check = self.state.step + steps_between_checks(
                    poll_s, ranks_s / self.world
                )
            elapsed = time.monotonic() - started
            self.step_s = (
                elapsed
                if self.step_s is None
                else (1 - STEP_S_SMOOTHING) * self.step_s + STEP_S_SMOOTHING * elapsed
            )
            self.state.tokens_seen += int(tokens)
            self.state.repeated_blocks += int(repeated)
            self.state.reread_blocks += int(reread)
            kind = self._checkpoint_kind(jit > 0)
            record = self._record(
                loss=loss_sum / predicted,
                lr=lr,
                step_s=elapsed,
                tokens_per_s=tokens / elapsed,
                **record,
            )
            if kind is not None or self.state.step % self.settings.eval_every_steps == 0:
                record[CHECKPOINT_METRIC] = self.evaluate()
            if kind is None:
                self._report(record)
                continue
            record["checkpoint_kind"] = kind
            self._save(kind, record)
            if kind == "jit":
                self.jit_taken = True
                self._hold()
        return {"step": self.state.step, "tokens_seen": self.state.tokens_seen}


def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train's train_loop_per_worker: `config` is a TrainSpec as a dict."""
    return _WorkerRun(TrainSpec.model_validate(config)).train()
