"""An OpenAI-compatible LLM on Ray Serve with vLLM as the engine, from a local Hugging Face
folder or an MLflow model version.

vLLM never runs in the flow's environment (it pins fastapi below Prefect's range): replicas
run under the LLM venv's python (runtime_env `py_executable`) and import vLLM lazily. This
module itself needs only Ray Serve, pydantic and starlette, so a flow process can build and
deploy the app.

Engine: vLLM's V1 `LLMEngine` in the replica's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
executor "uni"), stepped by one engine thread that feeds asyncio queues. On 2 CPUs that starts
in about 2 s in about 0.9 GB, where `AsyncLLM` (always a separate engine-core process) took
about 27 s and two processes of 0.7 GB each, and `ray.serve.llm`'s ingress was never scheduled.

Use it from `serve.run(build_llm_app({...}), name=..., route_prefix=None)`, or from Serve's
declarative config (`import_path: workloads.llm:build_llm_app`, `args: {...}`); `llm_app_config`
writes that entry.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from ray import serve

logger = logging.getLogger("ray.serve")

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LLM_PYTHON = PROJECT_ROOT / ".venv-llm" / "bin" / "python"
IMPORT_PATH = "workloads.llm:build_llm_app"
VERSION_HEADER = "X-Model-Version"
REQUEST_ID_HEADER = "X-Request-Id"
# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
WARMUP_PROMPT = "ray serve"
STATS_SAMPLES = 2048
ENGINE_IDLE_WAIT_S = 0.5
MODEL_CACHE_DIR = Path(os.environ.get("RLT_LLM_MODEL_CACHE", "/tmp/rlt-llm-models"))
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
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


# ---------------------------------------------------------------------------------------------
# Arguments


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
        python = self.python or os.environ.get("RLT_LLM_PYTHON") or str(DEFAULT_LLM_PYTHON)
        extra = dict(self.runtime_env)
        env_vars = dict(REPLICA_ENV_VARS)
        if self.engine.kv_cache_memory_bytes is None:
            env_vars["VLLM_CPU_KVCACHE_SPACE"] = CPU_KV_CACHE_GIB
        env_vars.update(extra.pop("env_vars", {}))
        return {"py_executable": python, **extra, "env_vars": env_vars}


# ---------------------------------------------------------------------------------------------
# Building and deploying


def build_llm_app(args: dict | LLMAppArgs) -> serve.Application:
    """Serve application builder: `serve.run(build_llm_app({...}))`, or Serve's declarative
    config with `import_path: workloads.llm:build_llm_app` and these `args`."""
    spec = args if isinstance(args, LLMAppArgs) else LLMAppArgs.model_validate(args)
    actor_options = {
        **spec.ray_actor_options,
        "runtime_env": {
            **spec.ray_actor_options.get("runtime_env", {}),
            **spec.replica_runtime_env(),
        },
    }
    scaling = spec.autoscaling
    deployment = LLMServer.options(
        ray_actor_options=actor_options,
        autoscaling_config={
            "min_replicas": scaling.min_replicas,
            "initial_replicas": max(scaling.min_replicas, 1),
            "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
        },
        max_ongoing_requests=spec.max_ongoing_requests,
        health_check_period_s=spec.health_check_period_s,
        health_check_timeout_s=spec.health_check_timeout_s,
    )
    return deployment.bind(spec.model_dump(mode="json"))


def deploy_llm_app(args: dict | LLMAppArgs, name: str, *, blocking: bool = False):
    """`serve.run` the app under `name` at its route_prefix (None: no HTTP route); returns its
    DeploymentHandle once the replicas are healthy (warm-up done)."""
    spec = args if isinstance(args, LLMAppArgs) else LLMAppArgs.model_validate(args)
    return serve.run(
        build_llm_app(spec), name=name, route_prefix=spec.route_prefix, blocking=blocking
    )


def llm_app_config(
    name: str, args: dict | LLMAppArgs, runtime_env: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One `applications:` entry of a Serve config (REST / `serve deploy`) for this app.
    `runtime_env` is the app's own (e.g. py_modules or working_dir holding `workloads`)."""
    spec = args if isinstance(args, LLMAppArgs) else LLMAppArgs.model_validate(args)
    entry: dict[str, Any] = {
        "name": name,
        "import_path": IMPORT_PATH,
        "route_prefix": spec.route_prefix,
        "args": spec.model_dump(mode="json"),
    }
    if runtime_env:
        entry["runtime_env"] = runtime_env
    return entry


# ---------------------------------------------------------------------------------------------
# Request handling (pure: no vLLM here)


class RequestError(Exception):
    """An OpenAI-style client error: status, message, the offending parameter and a code."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message,
            param,
            code,
            status,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise RequestError(
            f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}",
            param=name,
            code="invalid_type",
        )
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(
            f"'{name}' must be between {lo} and {hi}, got {value!r}",
            param=name,
            code="invalid_value",
        )
    return value


@dataclass
class Sampling:
    """The sampling fields of a request, validated; max_tokens None: the rest of the context."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False

    @classmethod
    def from_body(
        cls, body: dict, default_max_tokens: int | None, max_tokens_field: str = "max_tokens"
    ) -> Sampling:
        n = _number(body, "n", 1, lo=1, integer=True)
        if n != 1:
            raise RequestError(f"'n' must be 1 here, got {n}", param="n", code="unsupported")
        max_tokens = _number(body, max_tokens_field, None, lo=1, integer=True)
        if max_tokens is None and max_tokens_field != "max_tokens":
            max_tokens = _number(body, "max_tokens", None, lo=1, integer=True)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (
            isinstance(stop, list)
            and len(stop) <= 4
            and all(isinstance(s, str) and s for s in stop)
        ):
            raise RequestError(
                f"'stop' must be a string or up to 4 strings, got {stop!r}",
                param="stop",
                code="invalid_value",
            )
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise RequestError(
                f"'ignore_eos' must be a boolean, got {ignore_eos!r}",
                param="ignore_eos",
                code="invalid_type",
            )
        return cls(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=_number(body, "temperature", 1.0, lo=0, hi=2),
            top_p=_number(body, "top_p", 1.0, lo=1e-6, hi=1),
            top_k=_number(body, "top_k", 0, lo=-1, integer=True),
            seed=_number(body, "seed", None, integer=True),
            stop=stop,
            presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2, hi=2),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2, hi=2),
            min_tokens=_number(body, "min_tokens", 0, lo=0, integer=True),
            ignore_eos=ignore_eos,
        )


def _message_text(message: Any, index: int) -> dict[str, str]:
    if not isinstance(message, dict):
        raise RequestError(
            f"messages[{index}] must be an object, got {message!r}",
            param=f"messages[{index}]",
            code="invalid_type",
        )
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(
            f"messages[{index}].role must be one of system, developer, user, "
            f"assistant, tool; got {role!r}",
            param=f"messages[{index}].role",
            code="invalid_value",
        )
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"messages[{index}].content parts must be text parts, got {part!r}",
                    param=f"messages[{index}].content",
                    code="unsupported",
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(
            f"messages[{index}].content must be a string or text parts, got {content!r}",
            param=f"messages[{index}].content",
            code="invalid_type",
        )
    return {"role": role, "content": content}


@dataclass
class Reply:
    """An HTTP answer: a whole body, or (stream) an async iterator of SSE chunks."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else _json(data)) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class _Stats:
    started: float = field(default_factory=time.time)
    requests: int = 0
    errors: int = 0
    client_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=STATS_SAMPLES)
    )
    latency_ms: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=STATS_SAMPLES)
    )
    tokens_per_s: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=STATS_SAMPLES)
    )


def _percentile(samples, q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# ---------------------------------------------------------------------------------------------
# The engine, in the replica


class _EngineLoop:
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
        self._stop.set()
        self.inbox.put(("stop",))
        self.thread.join(timeout)

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
                    RequestError(f"the engine refused the request: {exc}", code="engine_rejected"),
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


def _download_from_mlflow(source: MLflowModelSource) -> Path:
    """Fetch the model version's artifacts once per node; return the folder with config.json."""
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    client = MlflowClient(tracking_uri=source.tracking_uri)
    if source.version.isdigit():
        version = client.get_model_version(source.model_name, source.version)
    else:
        version = client.get_model_version_by_alias(source.model_name, source.version)
    target = MODEL_CACHE_DIR / re.sub(r"[^A-Za-z0-9._-]", "_", source.model_name) / version.version
    if not (target / ".complete").exists():
        partial = target.with_name(f"{target.name}.{uuid.uuid4().hex[:8]}.partial")
        download_artifacts(
            artifact_uri=version.source, dst_path=str(partial), tracking_uri=source.tracking_uri
        )
        (partial / ".complete").touch()
        try:
            partial.rename(target)
        except OSError:  # another replica on this node got there first
            import shutil

            shutil.rmtree(partial, ignore_errors=True)
    configs = sorted(target.rglob("config.json"), key=lambda p: len(p.parts))
    if not configs:
        raise FileNotFoundError(
            f"MLflow model {source.model_name} version {version.version} "
            f"({version.source}) holds no Hugging Face config.json"
        )
    return configs[0].parent


@serve.deployment(name="LLMServer")
class LLMServer:
    """One model version behind OpenAI's /v1/completions and /v1/chat/completions."""

    def __init__(self, args: dict):
        spec = LLMAppArgs.model_validate(args)
        self.version = spec.resolved_version_label()
        self.model_name = spec.resolved_served_model_name()
        self.health_timeout_s = spec.health_check_timeout_s
        self.stats_data = _Stats()
        started = time.monotonic()
        if spec.mlflow is not None:
            model_dir = _download_from_mlflow(spec.mlflow)
        else:
            model_dir = Path(spec.model)
            if not (model_dir / "config.json").exists():
                raise FileNotFoundError(f"model folder {model_dir} has no config.json on this node")
        engine = self._make_engine(model_dir, spec.engine, self.model_name)
        self.max_model_len = engine.model_config.max_model_len
        # A tokenizer of our own: vLLM's detokenizes on the engine thread.
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer.model_max_length = 1 << 30  # lengths are checked against max_model_len
        self.engine_start_s = time.monotonic() - started
        if spec.warmup:
            self._warm_up(engine)
        self.engine = _EngineLoop(engine)
        logger.info(
            "LLM %s (version %s) ready in %.1f s, max_model_len %d",
            self.model_name,
            self.version,
            time.monotonic() - started,
            self.max_model_len,
        )

    @staticmethod
    def _make_engine(model_dir: Path, settings: EngineSettings, served_name: str):
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

    def _warm_up(self, engine) -> None:
        """One chat-templated request straight on the engine, before its thread starts: the
        first request pays for lazy initialisation, not a client."""
        from vllm import SamplingParams

        prompt_ids = (
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": WARMUP_PROMPT}],
                    add_generation_prompt=True,
                    tokenize=False,
                ),
                add_special_tokens=False,
            )
            if self.tokenizer.chat_template
            else self.tokenizer.encode(WARMUP_PROMPT)
        )
        engine.add_request(
            "warmup",
            {"prompt_token_ids": prompt_ids},
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
        )
        deadline = time.monotonic() + self.health_timeout_s
        while engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"warm-up generated nothing in {self.health_timeout_s} s")
            engine.step()

    async def _one_token(self, purpose: str) -> int:
        from vllm import SamplingParams

        prompt_ids = self.tokenizer.encode(WARMUP_PROMPT)
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
        tokens = 0
        async for output in self.engine.generate(
            f"{purpose}-{uuid.uuid4().hex}", prompt_ids, params
        ):
            tokens += len(output.outputs[0].token_ids)
        if tokens != 1:
            raise RuntimeError(f"{purpose}: the engine generated {tokens} tokens, not 1")
        return tokens

    # --- Serve hooks ----------------------------------------------------------------------

    async def check_health(self) -> None:
        """Serve's health check: the engine generates one token in time, or this raises."""
        if not self.engine.alive():
            raise RuntimeError(f"vLLM engine loop is down: {self.engine.failure!r}")
        await asyncio.wait_for(self._one_token("health"), timeout=self.health_timeout_s * 0.8)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()

    # --- HTTP, three ways in ----------------------------------------------------------------

    async def __call__(self, request):
        """Direct HTTP through Serve's proxy (when the app has a route)."""
        from starlette.responses import Response, StreamingResponse

        path = request.url.path
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        reply = await self._respond(
            request.method, path, dict(request.headers), await request.body()
        )
        # Serve's proxy answers with X-Request-Id itself: the one it put on the request (the
        # client's, or a new one), which is the id used here.
        reply.headers.pop(REQUEST_ID_HEADER.lower(), None)
        if reply.stream is not None:
            return StreamingResponse(
                reply.stream,
                status_code=reply.status,
                headers=reply.headers,
                media_type="text/event-stream",
            )
        return Response(reply.body, status_code=reply.status, headers=reply.headers)

    async def handle_http(self, request: dict) -> dict:
        """For the router's DeploymentHandle: {"method", "path", "query", "headers", "body"}
        in, {"status", "headers", "body"} out (a streamed answer is gathered whole)."""
        reply = await self._respond(
            request.get("method", "POST"),
            request.get("path", "/"),
            request.get("headers") or {},
            request.get("body") or b"",
        )
        body = reply.body
        if reply.stream is not None:
            body = b"".join([chunk async for chunk in reply.stream])
        return {"status": reply.status, "headers": reply.headers, "body": body}

    async def handle_http_stream(self, request: dict):
        """Streaming twin of handle_http (call with handle.options(stream=True)): first
        {"status", "headers"}, then the body as bytes chunks (SSE for "stream": true)."""
        reply = await self._respond(
            request.get("method", "POST"),
            request.get("path", "/"),
            request.get("headers") or {},
            request.get("body") or b"",
        )
        yield {"status": reply.status, "headers": reply.headers}
        if reply.stream is not None:
            async for chunk in reply.stream:
                yield chunk
        elif reply.body:
            yield reply.body

    async def stats(self, reset: bool = False) -> dict:
        """Counters and latency samples since start (or the last reset), for canary analysis."""
        data = self.stats_data
        if reset:
            self.stats_data = _Stats()
        summary = {
            "version": self.version,
            "model": self.model_name,
            "since": data.started,
            "requests": data.requests,
            "errors": data.errors,
            "client_errors": data.client_errors,
            "prompt_tokens": data.prompt_tokens,
            "completion_tokens": data.completion_tokens,
            "engine_start_s": round(self.engine_start_s, 3),
        }
        for name in ("ttft_ms", "latency_ms", "tokens_per_s"):
            samples = list(getattr(data, name))
            summary[name] = {
                "p50": _percentile(samples, 0.5),
                "p99": _percentile(samples, 0.99),
                "count": len(samples),
                "samples": samples,
            }
        return summary

    # --- The OpenAI surface -----------------------------------------------------------------

    def _headers(self, request_id: str, content_type: str = "application/json") -> dict:
        return {
            "content-type": content_type,
            VERSION_HEADER.lower(): self.version,
            REQUEST_ID_HEADER.lower(): request_id,
        }

    def _error(self, error: RequestError, request_id: str) -> Reply:
        if error.status >= 500:
            self.stats_data.errors += 1
        else:
            self.stats_data.client_errors += 1
        return Reply(error.status, self._headers(request_id), _json(error.body()))

    async def _respond(self, method: str, path: str, headers: dict, body: bytes) -> Reply:
        headers = {k.lower(): v for k, v in headers.items()}
        given = headers.get(REQUEST_ID_HEADER.lower(), "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        path = "/" + path.strip("/")
        try:
            if path.endswith("/v1/models") or path.endswith("/models"):
                return Reply(
                    200,
                    self._headers(request_id),
                    _json(
                        {
                            "object": "list",
                            "data": [
                                {
                                    "id": self.model_name,
                                    "object": "model",
                                    "owned_by": "prefect-ray-lifecycle",
                                    "max_model_len": self.max_model_len,
                                    "version": self.version,
                                }
                            ],
                        }
                    ),
                )
            if path.endswith("/health"):
                if not self.engine.alive():
                    raise RequestError("engine is down", status=503, kind="server_error")
                return Reply(200, self._headers(request_id), _json({"status": "ok"}))
            if path.endswith("/chat/completions"):
                chat = True
            elif path.endswith("/completions"):
                chat = False
            else:
                raise RequestError(
                    f"no route {path!r}: use /v1/completions or /v1/chat/completions",
                    status=404,
                    code="not_found",
                )
            if method.upper() != "POST":
                raise RequestError(
                    f"{path} takes POST, not {method}", status=405, code="method_not_allowed"
                )
            self.stats_data.requests += 1
            payload = self._parse(body)
            return await self._complete(payload, chat, request_id)
        except RequestError as error:
            return self._error(error, request_id)
        except Exception as exc:
            logger.exception("request %s failed", request_id)
            return self._error(
                RequestError(
                    f"internal error: {exc}", status=500, kind="server_error", code="internal_error"
                ),
                request_id,
            )

    @staticmethod
    def _parse(body: bytes) -> dict:
        try:
            payload = json.loads(body or b"")
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise RequestError(
                f"the body must be a JSON object, got {type(payload).__name__}", code="invalid_json"
            )
        return payload

    def _prompt_ids(self, payload: dict, chat: bool) -> list[int]:
        if chat:
            messages = payload.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(
                    "'messages' is required: a non-empty list of {role, content}",
                    param="messages",
                    code="missing_required_parameter",
                )
            turns = [_message_text(m, i) for i, m in enumerate(messages)]
            if not self.tokenizer.chat_template:
                raise RequestError(
                    f"{self.model_name} has no chat template: use /v1/completions",
                    param="messages",
                    code="unsupported",
                )
            text = self.tokenizer.apply_chat_template(
                turns, add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise RequestError(
                    f"'prompt' token ids must lie in [0, {vocab})",
                    param="prompt",
                    code="invalid_value",
                )
            return prompt
        if prompt is None or prompt == "" or prompt == []:
            raise RequestError(
                "'prompt' is required: a non-empty string or token ids",
                param="prompt",
                code="missing_required_parameter",
            )
        raise RequestError(
            f"'prompt' must be one string or one list of token ids (no batches "
            f"here), got {type(prompt).__name__}",
            param="prompt",
            code="invalid_type",
        )

    async def _complete(self, payload: dict, chat: bool, request_id: str) -> Reply:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        model = payload.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(
                f"the model {model!r} does not exist here; this app serves {self.model_name!r}",
                param="model",
                code="model_not_found",
                status=404,
            )
        stream = payload.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(
                f"'stream' must be a boolean, got {stream!r}", param="stream", code="invalid_type"
            )
        include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        sampling = Sampling.from_body(
            payload,
            None if chat else DEFAULT_COMPLETION_MAX_TOKENS,
            "max_completion_tokens" if chat else "max_tokens",
        )
        prompt_ids = self._prompt_ids(payload, chat)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"the prompt is {len(prompt_ids)} tokens; this model's maximum context length "
                f"is {self.max_model_len} tokens, which leaves no room to generate",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else room
        if max_tokens > room:
            raise RequestError(
                f"'max_tokens' is too large: {max_tokens}. This model's maximum context length "
                f"is {self.max_model_len} tokens and your request has {len(prompt_ids)} input "
                f"tokens ({max_tokens} > {self.max_model_len} - {len(prompt_ids)})",
                param="max_tokens",
                code="context_length_exceeded",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            stop=sampling.stop or None,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            min_tokens=min(sampling.min_tokens, max_tokens),
            ignore_eos=sampling.ignore_eos,
            # Deltas for whole answers too: time to first token is measured either way.
            output_kind=RequestOutputKind.DELTA,
        )
        call = _Call(self, request_id, chat, prompt_ids, params, include_usage)
        if stream:
            return Reply(200, self._headers(request_id, "text/event-stream"), stream=call.sse())
        return Reply(200, self._headers(request_id), _json(await call.whole()))


class _Call:
    """One completion request through the engine, as one JSON body or as SSE chunks."""

    def __init__(
        self,
        server: LLMServer,
        request_id: str,
        chat: bool,
        prompt_ids: list[int],
        params,
        include_usage: bool,
    ):
        self.server, self.request_id, self.chat = server, request_id, chat
        self.prompt_ids, self.params, self.include_usage = prompt_ids, params, include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.completion_tokens = 0

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.server.model_name,
            "system_fingerprint": self.server.version,
        }

    def _usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": self.completion_tokens,
            "total_tokens": len(self.prompt_ids) + self.completion_tokens,
        }

    async def _outputs(self):
        engine_id = f"{self.request_id}-{uuid.uuid4().hex[:8]}"
        async for output in self.server.engine.generate(engine_id, self.prompt_ids, self.params):
            completion = output.outputs[0]
            if completion.token_ids and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.completion_tokens += len(completion.token_ids)
            yield completion

    def _record(self) -> None:
        stats = self.server.stats_data
        done = time.perf_counter()
        stats.prompt_tokens += len(self.prompt_ids)
        stats.completion_tokens += self.completion_tokens
        stats.latency_ms.append((done - self.started) * 1000)
        if self.first_token_at is not None:
            stats.ttft_ms.append((self.first_token_at - self.started) * 1000)
        if self.completion_tokens and done > self.started:
            stats.tokens_per_s.append(self.completion_tokens / (done - self.started))

    async def whole(self) -> dict[str, Any]:
        texts, finish_reason = [], None
        try:
            async for completion in self._outputs():
                texts.append(completion.text)
                finish_reason = completion.finish_reason or finish_reason
        except RequestError:
            raise
        except Exception as exc:
            raise RequestError(
                f"generation failed: {exc}", status=500, kind="server_error", code="engine_error"
            ) from exc
        self._record()
        text = "".join(texts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._envelope(chunk=False), "choices": [choice], "usage": self._usage()}

    def _chunk(
        self, delta_text: str | None, finish_reason: str | None, role: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta_text is not None:
                delta["content"] = delta_text
            choice["delta"] = delta
        else:
            choice["text"] = delta_text or ""
        chunk = {**self._envelope(chunk=True), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            if self.chat:
                yield _sse(self._chunk("", None, role=True))
            async for completion in self._outputs():
                if completion.text or completion.finish_reason:
                    yield _sse(self._chunk(completion.text, completion.finish_reason))
            self._record()
            if self.include_usage:
                yield _sse({**self._envelope(chunk=True), "choices": [], "usage": self._usage()})
        except Exception as exc:
            error = (
                exc
                if isinstance(exc, RequestError)
                else RequestError(
                    f"generation failed: {exc}",
                    status=500,
                    kind="server_error",
                    code="engine_error",
                )
            )
            if error.status >= 500:
                self.server.stats_data.errors += 1
            else:
                self.server.stats_data.client_errors += 1
            yield _sse(error.body())
        yield SSE_DONE
