"""Arguments of the LLM app: the model source, vLLM engine settings, autoscaling, and the
replicas' runtime_env (the LLM venv's python, since vLLM never runs in the flow's venv)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from prefect_ray_lifecycle.workloads.constants import VERSION_HEADER, llm_python

__all__ = [
    "CPU_KV_CACHE_GIB",
    "REPLICA_ENV_VARS",
    "AutoscalingSettings",
    "EngineSettings",
    "LLMAppArgs",
    "LLMFaults",
    "MLflowModelSource",
    "engine_runtime_env",
]

# vLLM in one process (no engine-core subprocess), quiet and offline.
REPLICA_ENV_VARS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# CPU builds without kv_cache_memory_bytes size their KV cache from this (GiB); with neither,
# start-up fails on small machines. Set only then: on CPU it overrides kv_cache_memory_bytes.
# GPU builds ignore it.
CPU_KV_CACHE_GIB = "1"


class LLMFaults(BaseModel):
    """Faults a drill injects into one LLM version's app, to rehearse the LLM gates:
    `token_delay_ms` holds every generated token that long before it is sent (whole answers
    and streams alike; Serve's health checks are spared), so time to first token grows by it
    and tokens/s falls to at most 1000 / token_delay_ms. Streams only (whole answers, the smoke
    test's and the shadow's among them, are spared): `stream_refuse_rate` of streamed
    completions are refused with a 503 before their first byte (the router falls back to
    live), and those not refused end after `stream_break_after_tokens` tokens (0: never) with
    an error event (after the first byte nothing falls back; the failure still counts)."""

    model_config = {"extra": "forbid"}

    token_delay_ms: float = Field(0.0, ge=0, le=60_000)
    stream_refuse_rate: float = Field(0.0, ge=0, le=1)
    stream_break_after_tokens: int = Field(0, ge=0, le=100_000)

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> LLMFaults:
        """From a drill's faults; ValueError names unknown fields and bad values."""
        try:
            return cls.model_validate(dict(value or {}))
        except Exception as error:  # pydantic's ValidationError is a ValueError
            raise ValueError(f"LLM faults {value!r}: {error}") from None


class MLflowModelSource(BaseModel):
    """A Hugging Face model folder logged to MLflow and registered as a model version."""

    tracking_uri: str = Field(description="MLflow tracking server, e.g. http://127.0.0.1:5000.")
    model_name: str = Field(min_length=1, description="Registered model name.")
    version: str = Field(
        min_length=1, description="Model version number, or an alias such as 'champion'."
    )


class EngineSettings(BaseModel):
    """vLLM engine settings (EngineArgs); `extra` passes any other EngineArgs field."""

    max_model_len: int | None = Field(
        default=None, ge=8, description="Context length in tokens; None: the model's own."
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Share of GPU memory for weights and KV cache."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per replica.")
    enforce_eager: bool = Field(
        default=True, description="No CUDA graphs / torch.compile: faster start."
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        ge=1 << 20,
        description="KV cache size in bytes; overrides gpu_memory_utilization for the cache.",
    )
    dtype: str = Field(default="auto", description="Weights dtype: auto, float32, bfloat16...")
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Most sequences in one engine step."
    )
    seed: int = Field(default=0, description="Engine seed.")
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = Field(
        default=None,
        description="None: 'uni' (in process) for one GPU or CPU, 'mp' for tensor parallel.",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="More vLLM EngineArgs fields, passed as they are."
    )


class AutoscalingSettings(BaseModel):
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    target_ongoing_requests: float = Field(
        default=16, gt=0, description="Ongoing requests per replica to aim at."
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})"
            )
        return self


class LLMAppArgs(BaseModel):
    """Arguments of `build_llm_app`: one LLM app serving one model version."""

    model: str | None = Field(
        default=None, description="Local Hugging Face folder, readable on every replica node."
    )
    mlflow: MLflowModelSource | None = Field(
        default=None, description="Or an MLflow model version whose artifacts are such a folder."
    )
    served_model_name: str | None = Field(
        default=None, description="The `model` name clients send and see; None: from the source."
    )
    version_label: str | None = Field(
        default=None,
        description=f"Sent as {VERSION_HEADER} on every response; None: 'name/version' from "
        "MLflow, or the folder's name.",
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    max_ongoing_requests: int = Field(
        default=64, ge=1, description="Requests one replica takes at once."
    )
    ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 1},
        description="Ray options of each replica (num_cpus may be fractional, num_gpus...).",
    )
    python: str | None = Field(
        default=None,
        description="The LLM venv's python for replicas (runtime_env py_executable); None: "
        "$RLT_LLM_PYTHON, else this checkout's .venv-llm/bin/python.",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="More runtime_env for replicas; env_vars are merged over the defaults.",
    )
    route_prefix: str | None = Field(
        default=None,
        description="HTTP route of the app; None: none (reached through the router's handle).",
    )
    health_check_period_s: float = Field(default=10, gt=0)
    health_check_timeout_s: float = Field(default=30, gt=0)
    warmup: bool = Field(default=True, description="Generate once before taking traffic.")

    @model_validator(mode="after")
    def _one_source(self) -> LLMAppArgs:
        if (self.model is None) == (self.mlflow is None):
            raise ValueError(
                "give exactly one model source: 'model' (a local folder) or "
                "'mlflow' ({tracking_uri, model_name, version})"
            )
        return self

    def resolved_version_label(self) -> str:
        if self.version_label:
            return self.version_label
        if self.mlflow is not None:
            return f"{self.mlflow.model_name}/{self.mlflow.version}"
        return Path(self.model).name

    def resolved_served_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.mlflow.model_name if self.mlflow is not None else Path(self.model).name

    def replica_runtime_env(self) -> dict[str, Any]:
        """The replicas' runtime_env: the LLM venv's python and vLLM's environment variables,
        with `runtime_env` (its env_vars merged) over them."""
        return engine_runtime_env(self.engine, self.python, self.runtime_env)


def engine_runtime_env(
    engine: EngineSettings, python: str | None = None, runtime_env: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The runtime_env of a process that runs a vLLM engine (an LLM replica, or the router
    of an LLM route that hosts its live version): the LLM venv's python and vLLM's
    environment variables, with `runtime_env` (its env_vars merged) over them."""
    extra = dict(runtime_env or {})
    env_vars = dict(REPLICA_ENV_VARS)
    if engine.kv_cache_memory_bytes is None:
        env_vars["VLLM_CPU_KVCACHE_SPACE"] = CPU_KV_CACHE_GIB
    env_vars.update(extra.pop("env_vars", {}))
    return {"py_executable": llm_python(python), **extra, "env_vars": env_vars}
