"""vLLM's V1 `LLMEngine` inside the Serve replica, and the replica's request figures.

The engine runs in the replica's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor
"uni"), stepped by one thread that feeds asyncio queues: no engine-core subprocess, so it
starts fast and small on CPU. vLLM is imported lazily: only the LLM venv has it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect_ray_lifecycle.compat.vllm_internals import shut_down_in_process
from prefect_ray_lifecycle.workloads.figures import percentile
from prefect_ray_lifecycle.workloads.llm.config import EngineSettings
from prefect_ray_lifecycle.workloads.llm.protocol import invalid

__all__ = ["ENGINE_IDLE_WAIT_S", "STATS_SAMPLES", "EngineLoop", "ReplicaStats", "make_engine"]

logger = logging.getLogger("ray.serve")

ENGINE_IDLE_WAIT_S = 0.5
STATS_SAMPLES = 2048
SAMPLE_SERIES = ("ttft_ms", "latency_ms", "tokens_per_s")


def make_engine(model_dir: Path, settings: EngineSettings, served_name: str):
    """vLLM's LLMEngine for the model in `model_dir`, in this process."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    backend = settings.distributed_executor_backend or (
        "uni" if settings.tensor_parallel_size == 1 else "mp"
    )
    engine_args = {
        "model": str(model_dir),
        "served_model_name": served_name,
        "max_model_len": settings.max_model_len,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "enforce_eager": settings.enforce_eager,
        "kv_cache_memory_bytes": settings.kv_cache_memory_bytes,
        "dtype": settings.dtype,
        "seed": settings.seed,
        "distributed_executor_backend": backend,
        "disable_log_stats": True,
        **({"max_num_seqs": settings.max_num_seqs} if settings.max_num_seqs else {}),
        **settings.extra,
    }
    return LLMEngine.from_engine_args(EngineArgs(**engine_args), enable_multiprocessing=False)


def warm_up(engine, prompt_ids: list[int], timeout_s: float) -> None:
    """Generate a few tokens straight on the engine, before its loop thread starts: the first
    request pays for lazy initialisation, not a client."""
    from vllm import SamplingParams

    engine.add_request(
        "warmup",
        {"prompt_token_ids": prompt_ids},
        SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
    )
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"warm-up generated nothing in {timeout_s} s")
        engine.step()


class EngineLoop:
    """vLLM's LLMEngine stepped by one thread; requests and their outputs cross to asyncio
    through queues. The engine object is touched by this thread only."""

    def __init__(self, engine):
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive() and self.failure is None

    async def generate(self, request_id: str, prompt_ids: list[int], params) -> AsyncIterator:
        """Yield vLLM RequestOutputs (deltas or final, as `params` asks) until finished."""
        if not self.alive():
            raise RuntimeError(f"the engine is not running: {self.failure!r}")
        outputs: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = (asyncio.get_running_loop(), outputs)
        self.inbox.put(("add", request_id, prompt_ids, params))
        finished = False
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(outputs.get(), ENGINE_IDLE_WAIT_S * 10)
                except TimeoutError:
                    if self.alive():
                        continue  # a long prefill or a busy engine: keep waiting
                    raise RuntimeError(f"the engine stopped: {self.failure!r}") from None
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.streams.pop(request_id, None)
            if not finished:  # the client went away, or the caller stopped reading
                self.inbox.put(("abort", request_id))

    def stop(self, timeout: float = 5.0) -> None:
        """Stop stepping, then release the engine; never the process's distributed state,
        which another engine in the process (a router's next hosted version) still uses."""
        self._stop.set()
        self.inbox.put(("stop",))
        self.thread.join(timeout)
        if not self.thread.is_alive():
            shut_down_in_process(self.engine)

    def _deliver(self, request_id: str, item) -> None:
        target = self.streams.get(request_id)
        if target is None:
            return
        loop, outputs = target
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # that event loop is closed: nobody is reading any more
            self.streams.pop(request_id, None)

    def _command(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params = command
            try:
                self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)
            except Exception as exc:  # a request vLLM refuses fails alone
                self._deliver(
                    request_id,
                    invalid(f"the engine refused the request: {exc}", code="engine_rejected"),
                )
        elif kind == "abort":
            try:
                self.engine.abort_request([command[1]])
            except Exception:  # already finished and gone: nothing to abort
                logger.debug("abort of %s ignored", command[1], exc_info=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                try:
                    command = (
                        self.inbox.get_nowait()
                        if busy
                        else self.inbox.get(timeout=ENGINE_IDLE_WAIT_S)
                    )
                    while command is not None:
                        if command[0] == "stop":
                            return
                        self._command(command)
                        command = self.inbox.get_nowait()
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._deliver(output.request_id, output)
        except BaseException as exc:
            self.failure = exc
            logger.exception("vLLM engine loop failed")
            for request_id in list(self.streams):
                self._deliver(request_id, RuntimeError(f"engine failure: {exc!r}"))


def _samples() -> collections.deque:
    return collections.deque(maxlen=STATS_SAMPLES)


@dataclass
class ReplicaStats:
    """One replica's counters and latest samples since start or the last reset, which the
    canary gates compare between versions."""

    started: float = field(default_factory=time.time)
    requests: int = 0
    errors: int = 0
    client_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    health_tokens: int = 0  # tokens generated by health checks (not requests)
    ttft_ms: collections.deque = field(default_factory=_samples)
    latency_ms: collections.deque = field(default_factory=_samples)
    tokens_per_s: collections.deque = field(default_factory=_samples)

    def count_error(self, status: int) -> None:
        """A failed request: a server error for a 5xx, a client error otherwise."""
        if status >= 500:
            self.errors += 1
        else:
            self.client_errors += 1

    def record(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        started: float,
        first_token_at: float | None,
        done: float,
    ) -> None:
        """One finished generation; times from time.perf_counter()."""
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.latency_ms.append((done - started) * 1000)
        if first_token_at is not None:
            self.ttft_ms.append((first_token_at - started) * 1000)
        if completion_tokens and done > started:
            self.tokens_per_s.append(completion_tokens / (done - started))

    def counters(self) -> dict[str, Any]:
        return {
            "since": self.started,
            "requests": self.requests,
            "errors": self.errors,
            "client_errors": self.client_errors,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "health_tokens": self.health_tokens,
        }

    def series(self) -> dict[str, dict[str, Any]]:
        """p50, p99, count and the samples themselves of each sampled figure."""
        summary = {}
        for name in SAMPLE_SERIES:
            samples = list(getattr(self, name))
            summary[name] = {
                "p50": percentile(samples, 0.5),
                "p99": percentile(samples, 0.99),
                "count": len(samples),
                "samples": samples,
            }
        return summary
