"""Serving one registered policy version: observations in, greedy actions out.

`PolicyCore` is the model and its HTTP contract, with no Serve in it: the version's own
Serve application (`PolicyServer`) and the router's in-process copy of the live version
both answer through it, so a request gets the same answer and the same errors either way.
A version is always loaded by its number, never by a moving alias.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prefect_ray_lifecycle.workloads.constants import (
    POLICY_DEPLOYMENT,
    SHADOW_KEY,
    VERSION_HEADER,
)
from prefect_ray_lifecycle.workloads.http import (
    JSON_TYPE,
    MAX_BODY_BYTES,
    RAW_TYPE,
    BadRequest,
    describe,
    json_response,
    parse_json,
    request_dict,
    to_response,
)
from prefect_ray_lifecycle.workloads.serve.traffic import check_episode_id, sticky_draw

logger = logging.getLogger("ray.serve")

MAX_BATCH = 4096
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class ModelSpec:
    """Which model version to load, and from where."""

    name: str
    version: str
    tracking_uri: str
    registry_uri: str | None = None

    @classmethod
    def parse(cls, value: dict[str, Any]) -> ModelSpec:
        if not isinstance(value, dict):
            raise ValueError(f"model spec must be a mapping, got {value!r}")
        missing = [k for k in ("name", "version", "tracking_uri") if not value.get(k)]
        if missing:
            raise ValueError(f"model spec {value!r} lacks {', '.join(missing)}")
        version = str(value["version"])
        if not version.isdigit():
            raise ValueError(f"model version must be a number (never an alias), got {version!r}")
        return cls(
            str(value["name"]),
            version,
            str(value["tracking_uri"]),
            value.get("registry_uri") or None,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "tracking_uri": self.tracking_uri,
            "registry_uri": self.registry_uri,
        }


def download_policy(spec: ModelSpec, target: str | Path) -> Path:
    """Download the version's pyfunc model folder into `target`; return its RLModule
    checkpoint folder."""
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from prefect_ray_lifecycle.workloads.rl.policy_model import ARTIFACT_KEY

    client = MlflowClient(tracking_uri=spec.tracking_uri, registry_uri=spec.registry_uri)
    version = client.get_model_version(spec.name, spec.version)
    if version.status != "READY":
        raise RuntimeError(f"{spec.name} v{spec.version} is {version.status}, not READY")
    local = Path(
        download_artifacts(
            artifact_uri=version.source, dst_path=str(target), tracking_uri=spec.tracking_uri
        )
    )
    checkpoint = local / "artifacts" / ARTIFACT_KEY
    if not checkpoint.is_dir():
        raise RuntimeError(
            f"{spec.name} v{spec.version} ({version.source}) holds no "
            f"{ARTIFACT_KEY}: not a policy registered by this project"
        )
    return checkpoint


class PolicyCore:
    """A loaded policy and its request contract (JSON or raw float32 bytes)."""

    def __init__(self, spec: ModelSpec, module: Any = None, max_body_bytes: int = MAX_BODY_BYTES):
        from prefect_ray_lifecycle.workloads.rl.rllib import load_policy

        self.spec = spec
        self.version = spec.version
        self.max_body_bytes = max_body_bytes
        if module is None:
            # Loaded into memory, then the download goes: every replica start (and restart)
            # left its copy of the model in the temp folder (about 130 a full test run).
            with tempfile.TemporaryDirectory(prefix=f"policy-{spec.name}-{spec.version}-") as tmp:
                module = load_policy(download_policy(spec, tmp))
        self.module = module
        space = self.module.observation_space
        self.obs_shape = tuple(int(n) for n in space.shape)
        self.obs_size = int(np.prod(self.obs_shape))
        self.action_space = self.module.action_space
        self._low = np.asarray(space.low, dtype=np.float32)
        self._high = np.asarray(space.high, dtype=np.float32)

    # -- acting -------------------------------------------------------------------------
    def act(self, observations: np.ndarray) -> np.ndarray:
        return self.act_with_probabilities(observations)[0]

    def act_with_probabilities(
        self, observations: np.ndarray, disagree: float = 0.0
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Greedy actions, and each row's action probabilities where the action space is
        discrete (None otherwise). `disagree` (a drill) changes the action of that share of
        observations, the same ones every time (a stable hash of each row)."""
        import torch
        from ray.rllib.core.columns import Columns

        with torch.no_grad():
            out = self.module.forward_inference({Columns.OBS: torch.from_numpy(observations)})
        inputs = out[Columns.ACTION_DIST_INPUTS]
        dist = self.module.get_inference_action_dist_cls().from_logits(inputs)
        actions = dist.to_deterministic().sample().numpy()
        probabilities = None
        choices = getattr(self.action_space, "n", None)
        if choices is not None and inputs.shape[-1] == choices:
            probabilities = torch.softmax(inputs, dim=-1).numpy()
        if disagree and choices is not None:
            for row, observation in enumerate(observations):
                if sticky_draw("drill", observation.tobytes().hex()) < disagree:
                    actions[row] = (actions[row] + 1) % choices
                    if probabilities is not None:
                        probabilities[row] = np.roll(probabilities[row], 1)
        return actions, probabilities

    def probe_observations(self, count: int = 4, seed: int = 0) -> np.ndarray:
        """Observations inside the space (finite bounds clipped), for health and smoke."""
        rng = np.random.default_rng(seed)
        low = np.clip(self._low, -1.0, 1.0)
        high = np.clip(self._high, -1.0, 1.0)
        return rng.uniform(low, high, size=(count, *self.obs_shape)).astype(np.float32)

    def check(self, observations: np.ndarray | None = None) -> list[Any]:
        """Act on observations and verify every action is in the action space."""
        observations = self.probe_observations() if observations is None else observations
        actions = self.act(observations)
        bad = [
            a
            for a in actions
            if not self.action_space.contains(np.asarray(a, dtype=self.action_space.dtype))
        ]
        if len(actions) != len(observations) or bad:
            raise RuntimeError(
                f"v{self.version} gave invalid actions {bad[:3]!r} for "
                f"{len(observations)} probe observations"
            )
        return [_plain(a) for a in actions]

    # -- HTTP contract ------------------------------------------------------------------
    def parse(self, body: bytes, content_type: str) -> tuple[np.ndarray, bool]:
        """Observations as a float32 batch, and whether one observation was sent."""
        if len(body) > self.max_body_bytes:
            raise BadRequest(
                413, f"body of {len(body)} bytes exceeds the limit of {self.max_body_bytes} bytes"
            )
        kind = content_type.split(";")[0].strip().lower()
        if kind == RAW_TYPE:
            return self._parse_raw(body)
        if kind not in ("", JSON_TYPE):
            raise BadRequest(
                415,
                f"content type {kind!r} is not supported: send "
                f"{JSON_TYPE} or {RAW_TYPE} (float32 little-endian)",
            )
        payload = parse_json(body)
        if not isinstance(payload, dict):
            raise BadRequest(422, 'JSON body must be an object like {"observation": [...]}')
        keys = [k for k in ("observation", "observations") if k in payload]
        if len(keys) != 1:
            raise BadRequest(
                422,
                'JSON body must have exactly one of "observation" (one '
                'observation or a batch) or "observations" (a batch)',
            )
        check_episode_id(payload)
        # JSON booleans turn into numbers inside a numeric array: look for them only when the
        # body could hold one.
        maybe_bool = b"true" in body or b"false" in body
        return self._check_array(payload[keys[0]], keys[0], maybe_bool)

    def _parse_raw(self, body: bytes) -> tuple[np.ndarray, bool]:
        row = 4 * self.obs_size
        if not body or len(body) % row:
            raise BadRequest(
                422,
                f"raw body must be float32 observations of shape "
                f"{list(self.obs_shape)} ({row} bytes each); got "
                f"{len(body)} bytes",
            )
        array = np.frombuffer(body, dtype="<f4").reshape(-1, *self.obs_shape)
        # A copy: frombuffer's view of the body is read-only, and torch wants to own it.
        return self._finish(array.copy(), single=len(array) == 1, field="body")

    def _check_array(
        self, value: Any, field_name: str, maybe_bool: bool = True
    ) -> tuple[np.ndarray, bool]:
        try:
            array = np.asarray(value)
        except (ValueError, RecursionError):
            raise BadRequest(
                422,
                f"{field_name} is ragged: every observation must have shape {list(self.obs_shape)}",
            ) from None
        if array.dtype == bool or not np.issubdtype(array.dtype, np.number):
            raise BadRequest(
                422,
                f"{field_name} must hold numbers only (float32); got {describe(value)}",
            )
        single = array.shape == self.obs_shape
        if not single and not (array.shape[1:] == self.obs_shape and len(array)):
            raise BadRequest(
                422,
                f"{field_name} must have shape {list(self.obs_shape)} (or "
                f"[n, {', '.join(map(str, self.obs_shape))}] for a batch); got "
                f"{list(array.shape)}",
            )
        if maybe_bool and _holds_bool(value):
            raise BadRequest(422, f"{field_name} must hold numbers only, not true or false")
        return self._finish(array[None] if single else array, single=single, field=field_name)

    def _finish(self, array: np.ndarray, single: bool, field: str) -> tuple[np.ndarray, bool]:
        """The batch as float32, once its size and values fit."""
        if len(array) > MAX_BATCH:
            raise BadRequest(413, f"batch of {len(array)} observations exceeds {MAX_BATCH}")
        wide = array.astype(np.float64, copy=False)
        if not np.isfinite(wide).all():
            raise BadRequest(422, f"{field} holds NaN or infinite values")
        if (np.abs(wide) > FLOAT32_MAX).any():
            raise BadRequest(422, f"{field} holds values beyond float32's range (±{FLOAT32_MAX:g})")
        return array.astype(np.float32, copy=False), single

    def answer(self, request: dict[str, Any], disagree: float = 0.0) -> dict[str, Any]:
        """Answer one HTTP request given as a dict (see `request_dict`). Asked for a shadow
        comparison (the router's SHADOW_KEY), the answer also carries, outside its body, the
        greedy actions and their probabilities, and the observations as parsed (float32)."""
        headers = request.get("headers", {})
        try:
            if request.get("method", "POST") != "POST":
                raise BadRequest(405, "use POST with an observation")
            observations, single = self.parse(
                request.get("body", b""), headers.get("content-type", JSON_TYPE)
            )
            acted, probabilities = self.act_with_probabilities(observations, disagree)
            actions = [_plain(a) for a in acted]
            body = {"action": actions[0]} if single else {"actions": actions}
            answer = json_response(200, {**body, "model_version": self.version})
            if request.get(SHADOW_KEY):
                answer[SHADOW_KEY] = {
                    "actions": actions,
                    "probabilities": None if probabilities is None else probabilities.tolist(),
                    # as parsed: the shadow sends many copies to the candidate as one batch
                    "observations": observations.astype("<f4", copy=False).tobytes(),
                }
            return answer
        except BadRequest as error:
            return json_response(
                error.status, {"error": error.message, "model_version": self.version}
            )


def _holds_bool(value: Any) -> bool:
    if isinstance(value, list):
        return any(_holds_bool(v) for v in value)
    return isinstance(value, bool)


def _plain(value: Any) -> Any:
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array.tolist()


@dataclass(frozen=True)
class Faults:
    """Faults a drill injects into one version's app, to rehearse the rollout gates:
    `error_rate` of served requests raise (smoke probes are spared, like a model that passes
    its golden set and fails on live traffic); `fail_health_after_s` makes check_health fail
    that long after the config arrives; `latency_ms` is added to every served request;
    `disagree_rate` of observations (always the same ones) get another action than the model
    chose (a discrete action space; smoke probes spared), which only a shadow's comparison
    sees."""

    error_rate: float = 0.0
    fail_health_after_s: float | None = None
    latency_ms: float = 0.0
    disagree_rate: float = 0.0
    since: float = field(default_factory=time.monotonic, compare=False)

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> Faults:
        value = dict(value or {})
        unknown = set(value) - {"error_rate", "fail_health_after_s", "latency_ms", "disagree_rate"}
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}")
        faults = cls(
            float(value.get("error_rate", 0.0)),
            None
            if value.get("fail_health_after_s") is None
            else float(value["fail_health_after_s"]),
            float(value.get("latency_ms", 0.0)),
            float(value.get("disagree_rate", 0.0)),
        )
        if (
            not 0.0 <= faults.error_rate <= 1.0
            or not 0.0 <= faults.disagree_rate <= 1.0
            or faults.latency_ms < 0
            or (faults.fail_health_after_s is not None and faults.fail_health_after_s < 0)
        ):
            raise ValueError(f"fault values out of range: {value!r}")
        return faults

    def as_dict(self) -> dict[str, Any]:
        return {
            "error_rate": self.error_rate,
            "fail_health_after_s": self.fail_health_after_s,
            "latency_ms": self.latency_ms,
            "disagree_rate": self.disagree_rate,
        }


class InjectedFault(RuntimeError):
    pass


# ---- Serve ------------------------------------------------------------------------------
from ray import serve  # noqa: E402  (after the Serve-free part above)


@serve.deployment(
    name=POLICY_DEPLOYMENT,
    max_ongoing_requests=32,
    health_check_period_s=2.0,
    health_check_timeout_s=10.0,
)
class PolicyServer:
    """One policy version as its own Serve application (no route of its own: the router
    reaches it through a handle). Direct HTTP works when the app is given a route."""

    def __init__(self, model: dict[str, Any], max_body_bytes: int = MAX_BODY_BYTES):
        self.core = PolicyCore(ModelSpec.parse(model), max_body_bytes=max_body_bytes)
        self.core.check()  # a version that cannot act never becomes a replica
        self.faults = Faults()
        self.rejected_config: str | None = None

    def reconfigure(self, config: dict[str, Any]) -> None:
        # Never raises (Serve stops a replica whose reconfigure raises) and is idempotent.
        try:
            faults = Faults.parse((config or {}).get("faults"))
        except (TypeError, ValueError) as error:
            self.rejected_config = str(error)
            logger.error("ignored a bad user_config %r: %s", config, error)
            return
        if faults != self.faults:
            self.faults = faults
        self.rejected_config = None

    def check_health(self) -> None:
        limit = self.faults.fail_health_after_s
        if limit is not None and time.monotonic() - self.faults.since >= limit:
            raise RuntimeError(f"v{self.core.version}: health failure injected by a drill")
        self.core.check()

    async def handle_http(self, request: dict[str, Any]) -> dict[str, Any]:
        import asyncio

        faults = self.faults
        if faults.latency_ms:
            await asyncio.sleep(faults.latency_ms / 1000)
        if faults.error_rate and random.random() < faults.error_rate:
            raise InjectedFault(f"v{self.core.version}: error injected by a drill")
        return self.core.answer(request, faults.disagree_rate)

    async def predict(self, observations: list[Any]) -> dict[str, Any]:
        """Smoke probes: act on a batch; raises when an action is invalid."""
        array = np.asarray(observations, dtype=np.float32)
        return {"actions": self.core.check(array), "model_version": self.core.version}

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.core.spec.as_dict(),
            "observation_shape": list(self.core.obs_shape),
            "faults": self.faults.as_dict(),
            "rejected_config": self.rejected_config,
        }

    async def __call__(self, request: Any) -> Any:
        req = await request_dict(request, self.core.max_body_bytes)
        try:
            answer = await self.handle_http(req)
        except InjectedFault as error:
            answer = json_response(500, {"error": str(error)})
        # Serve's proxy answers with the request's X-Request-Id itself.
        answer["headers"][VERSION_HEADER] = self.core.version
        return to_response(answer)


def serving_options(serving: dict[str, Any] | None) -> dict[str, Any]:
    """Serve deployment options from a plain mapping (replicas or autoscaling, CPUs, GPUs,
    custom resources, health-check period and timeout, concurrency). Raises ValueError naming
    a bad key."""
    serving = dict(serving or {})
    allowed = {
        "num_replicas",
        "autoscaling",
        "num_cpus",
        "num_gpus",
        "memory",
        "resources",
        "health_check_period_s",
        "health_check_timeout_s",
        "max_ongoing_requests",
        "graceful_shutdown_timeout_s",
    }
    unknown = set(serving) - allowed
    if unknown:
        raise ValueError(f"unknown serving options {sorted(unknown)}; allowed: {sorted(allowed)}")
    actor = {"num_cpus": float(serving.get("num_cpus", 0.25))}
    if serving.get("num_gpus"):
        actor["num_gpus"] = float(serving["num_gpus"])
    if serving.get("memory"):
        actor["memory"] = int(serving["memory"])
    if any(v < 0 for v in actor.values()):
        raise ValueError(f"resources must not be negative: {actor}")
    custom = dict(serving.get("resources") or {})
    if any(not isinstance(v, int | float) or v < 0 for v in custom.values()):
        raise ValueError(f"custom resources must be non-negative numbers: {custom}")
    options: dict[str, Any] = {
        "ray_actor_options": {**actor, **({"resources": custom} if custom else {})}
    }
    if serving.get("autoscaling"):
        options["autoscaling_config"] = dict(serving["autoscaling"])
    else:
        replicas = int(serving.get("num_replicas", 1))
        if replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {replicas}")
        options["num_replicas"] = replicas
    for key in (
        "health_check_period_s",
        "health_check_timeout_s",
        "max_ongoing_requests",
        "graceful_shutdown_timeout_s",
    ):
        if key in serving:
            value = float(serving[key]) if key.endswith("_s") else int(serving[key])
            if value <= 0:
                raise ValueError(f"{key} must be positive, got {serving[key]!r}")
            options[key] = value
    return options


def build_policy_app(args: dict[str, Any]) -> Any:
    """Application builder (`prefect_ray_lifecycle.workloads.serve.policy:build_policy_app`):
    args are {"model": ModelSpec fields, "serving": serving options, "max_body_bytes": int}."""
    ModelSpec.parse(args.get("model"))
    options = serving_options(args.get("serving"))
    return PolicyServer.options(**options).bind(
        args["model"], int(args.get("max_body_bytes", MAX_BODY_BYTES))
    )
