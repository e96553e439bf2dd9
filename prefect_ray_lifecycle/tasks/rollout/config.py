"""The typed settings of a Serve rollout: its gates, how a version's app is served (a policy
or an LLM) and the faults of a drill. Flow parameters, so every field is described."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control.canary import ShadowThresholds, Thresholds
from prefect_ray_lifecycle.workloads.constants import llm_python
from prefect_ray_lifecycle.workloads.llm import EngineSettings, LLMAppArgs
from prefect_ray_lifecycle.workloads.llm.config import LLMFaults, engine_runtime_env
from prefect_ray_lifecycle.workloads.serve.policy import Faults, serving_options

__all__ = ["Drill", "Gates", "LLMServing", "Serving"]


class Gates(BaseModel):
    """How a candidate must behave to replace the live version."""

    health_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for the candidate's "
        "replicas to be RUNNING and healthy (Serve has no limit).",
    )
    stability_window_s: float = Field(
        10.0,
        ge=0,
        description="How long every replica must stay "
        "healthy, unreplaced, before the health gate passes.",
    )
    smoke_observations: list[list[float]] = Field(
        default_factory=list,
        description="Golden observations for the smoke gate; empty: "
        "observations sampled inside the model's observation space.",
    )
    smoke_max_latency_ms: float = Field(2000.0, gt=0, description="Slowest smoke answer allowed.")
    canary_steps: list[float] = Field(
        default_factory=lambda: [0.1, 0.5],
        description="Traffic shares sent to the candidate, in order, each a fraction in (0, 1).",
    )
    canary_hold_s: float = Field(20.0, ge=0, description="How long each canary step is held.")
    canary_min_requests: int = Field(
        0,
        ge=0,
        description="Requests the candidate must answer "
        "in a step before it is judged; 0 judges whatever came.",
    )
    canary_max_wait_s: float = Field(
        300.0,
        gt=0,
        description="Longest a step waits for its minimum requests before the rollout is aborted.",
    )
    max_error_rate: float = Field(0.01, ge=0, le=1, description="Highest share of 5xx answers.")
    max_p99_ms: float = Field(1000.0, gt=0, description="Highest p99 latency through the router.")
    max_p99_ratio: float = Field(
        3.0,
        ge=1,
        description="Highest candidate p99 as a multiple of "
        "the live version's, in the same window.",
    )
    p99_slack_ms: float = Field(
        50.0,
        ge=0,
        description="Added to max_p99_ratio x live p99 "
        "before a candidate is judged slower than live.",
    )
    bake_s: float = Field(
        30.0,
        ge=0,
        description="How long the new live version is watched "
        "after the swap; the previous version stays up until it ends.",
    )
    bake_window_s: float = Field(5.0, gt=0, description="Sliding window judged during the bake.")
    request_timeout_s: float = Field(
        10.0, gt=0, description="The router's per-request timeout (504 after it)."
    )
    fallback: bool = Field(
        True,
        description="Answer a request the candidate (or, during the bake, the new version) "
        "fails with a 5xx, a connection error or a timeout once more from the version that "
        "served before it, within the request's timeout; the failure still counts against the "
        "candidate. Turn off when requests are not idempotent.",
    )
    lease_s: float = Field(
        15.0,
        ge=3,
        le=30,
        description="How long the rollout's hold on the route lasts unless renewed (it renews "
        "every third of it while it runs). When it lapses, the router stops sending the "
        "candidate any traffic and the next reconcile may take over.",
    )
    smoke_prompt: str = Field(
        "Hello",
        min_length=1,
        description="LLM versions: the smoke "
        "gate's completion prompt (the answer must not be empty).",
    )
    smoke_max_tokens: int = Field(8, ge=1, description="LLM versions: tokens the smoke asks for.")
    max_ttft_ms: float = Field(
        5000.0, gt=0, description="LLM versions: highest p99 time to first token in a canary step."
    )
    min_tokens_per_s_ratio: float = Field(
        0.5, ge=0, description="LLM versions: lowest candidate tokens/s (p50) as a share of live's."
    )
    # -- shadow: the candidate's answers compared with live's before any user gets one --------
    shadow_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of live requests also sent to the candidate in a shadow stage after "
        "smoke and before the first canary step (users get live's answers only, and never wait "
        "for the copy); 0: no shadow stage. LLM versions: greedy requests (temperature 0) only.",
    )
    shadow_max_per_s: float = Field(
        50.0, gt=0, description="Most copies a second each router replica sends the candidate."
    )
    shadow_hold_s: float = Field(20.0, ge=0, description="How long the shadow stage is held.")
    shadow_min_requests: int = Field(
        20, ge=1, description="Copies the candidate must have answered before it is judged."
    )
    shadow_max_wait_s: float = Field(
        120.0,
        gt=0,
        description="Longest the shadow stage waits for its minimum copies; then `shadow_too_few`.",
    )
    shadow_too_few: Literal["reject", "proceed"] = Field(
        "reject",
        description="When fewer copies than shadow_min_requests came within shadow_max_wait_s: "
        "reject the candidate, or go on to the canary with the figures marked inconclusive.",
    )
    min_agreement: float | None = Field(
        0.99,
        ge=0,
        le=1,
        description="Policies: lowest share of answers (batch rows) whose greedy action is "
        "live's; empty: report only.",
    )
    min_llm_agreement: float | None = Field(
        None,
        ge=0,
        le=1,
        description="LLM versions: lowest share of completions exactly live's; empty (the "
        "default): report only, since a fine-tune is meant to change answers.",
    )
    max_shadow_error_rate: float = Field(
        0.01, ge=0, le=1, description="Highest share of copies the candidate fails."
    )
    max_shadow_p99_ratio: float = Field(
        3.0,
        ge=1,
        description="Highest candidate p99 on the copies as a multiple of live's on the same "
        "requests (plus p99_slack_ms); a policy's copies go in batches, each timed as its batch.",
    )
    shadow_noise_floor: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Also send each copy to the live version's own app and compare that with "
        "live's answer: how often an identical version disagrees (vLLM on CPU is not batch "
        "invariant). auto: LLM versions only.",
    )
    # -- who reaches the candidate on purpose -------------------------------------------------
    tester_header: Literal["off", "on", "token"] = Field(
        "off",
        description="Whether requests with `X-Canary: always` (or `never`) reach the "
        "candidate (or stay off it) while this rollout holds the route: off (the header is "
        "ignored), on, or token (only with `X-Canary-Token` matching tester_token_secret). "
        "Their requests are kept out of the gates' figures.",
    )
    tester_token_secret: str | None = Field(
        None,
        description="The Prefect Secret block holding the testers' token (tester_header "
        "token); the router keeps only its SHA-256.",
    )
    # -- a person's approval in the Prefect UI ------------------------------------------------
    approval: Literal["none", "before_swap", "after_step"] = Field(
        "none",
        description="Pause for a person's approval (a form on the flow run in the Prefect UI, "
        "or `python -m deployments.approve`): none, before the swap, or after the canary step "
        "approval_step. The candidate keeps its share while the rollout waits.",
    )
    approval_step: float | None = Field(
        None, description="approval after_step: the canary step (one of canary_steps) it follows."
    )
    approval_timeout_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="Longest a rollout waits for a decision; then approval_on_timeout.",
    )
    approval_on_timeout: Literal["abort", "approve"] = Field(
        "abort", description="What an approval nobody gave in time means."
    )

    @model_validator(mode="after")
    def _check(self) -> Gates:
        if any(not 0 < s < 1 for s in self.canary_steps):
            raise ValueError(f"canary_steps must be fractions in (0, 1), got {self.canary_steps}")
        if self.canary_steps != sorted(self.canary_steps):
            raise ValueError(f"canary_steps must increase, got {self.canary_steps}")
        for observation in self.smoke_observations:
            if not observation:
                raise ValueError("smoke_observations must not hold an empty observation")
        if self.approval == "after_step" and self.approval_step not in self.canary_steps:
            raise ValueError(
                f"approval after_step needs approval_step among canary_steps "
                f"{self.canary_steps}, got {self.approval_step}"
            )
        if self.tester_header == "token" and not self.tester_token_secret:
            raise ValueError("tester_header token needs tester_token_secret (a Secret block)")
        return self

    def asks_after(self, weight: float) -> bool:
        """Whether the rollout waits for approval once the canary step `weight` passed."""
        return self.approval == "after_step" and self.approval_step == weight

    def shadow_thresholds(self, kind: str) -> ShadowThresholds:
        return ShadowThresholds(
            self.shadow_min_requests,
            self.min_llm_agreement if kind == "llm" else self.min_agreement,
            self.max_shadow_error_rate,
            self.max_shadow_p99_ratio,
            self.p99_slack_ms,
        )

    def noise_floor(self, kind: str) -> bool:
        return self.shadow_noise_floor == "on" or (
            self.shadow_noise_floor == "auto" and kind == "llm"
        )

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(
            self.max_error_rate,
            self.max_p99_ms,
            self.max_p99_ratio,
            self.canary_min_requests,
            self.p99_slack_ms,
        )


# Router replicas where `Serving.router_replicas` is empty and the cluster has several nodes:
# Serve spreads them over nodes, so losing one node leaves a router answering.
AUTO_ROUTER_REPLICAS = 2


class Serving(BaseModel):
    """How a version's Serve application runs (each version is its own app)."""

    num_replicas: int = Field(1, ge=1, description="Replicas when autoscaling is empty.")
    autoscaling: dict[str, Any] | None = Field(
        None,
        description="Serve autoscaling_config "
        "(min_replicas, max_replicas, "
        "target_ongoing_requests, ...).",
    )
    num_cpus: float = Field(0.25, ge=0, description="CPUs per replica (fractions allowed).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (fractions allowed).")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, to place the version's replicas on "
        "the nodes that offer them (e.g. a worker group's {'worker_node': 1}).",
    )
    health_check_period_s: float = Field(2.0, gt=0, description="Serve health-check period.")
    health_check_timeout_s: float = Field(10.0, gt=0, description="Serve health-check timeout.")
    max_ongoing_requests: int = Field(32, ge=1, description="Concurrent requests per replica.")
    router_replicas: int | None = Field(
        None,
        ge=1,
        description="Replicas of the route's router; empty: 2 where the Ray cluster has more "
        "than one alive node (a router replica dies with its node), else 1. An LLM route's "
        "router that hosts the engine takes an LLM replica's resources each: 1 unless set.",
    )
    router_num_cpus: float = Field(0.25, ge=0, description="CPUs per router replica.")

    def version_options(self) -> dict[str, Any]:
        options = self.model_dump(exclude={"router_replicas", "router_num_cpus"}, exclude_none=True)
        for empty in ("num_gpus", "resources"):
            if not options.get(empty):
                options.pop(empty, None)
        serving_options(options)  # raises ValueError naming a bad option
        return options

    def router_options(self, alive_nodes: int = 1, hosts_engine: bool = False) -> dict[str, Any]:
        """The router app's {num_replicas, num_cpus} on a cluster of `alive_nodes` nodes; a
        router that `hosts_engine` (an LLM's) loads one per replica: 1 unless set."""
        several = alive_nodes > 1 and not hosts_engine
        replicas = self.router_replicas or (AUTO_ROUTER_REPLICAS if several else 1)
        return {"num_replicas": replicas, "num_cpus": self.router_num_cpus}


class LLMServing(BaseModel):
    """How an LLM version's Serve application runs (vLLM in the LLM venv's replicas)."""

    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM engine settings: "
        "max_model_len, gpu_memory_utilization, tensor_parallel_size, "
        "enforce_eager, kv_cache_memory_bytes, dtype, extra.",
    )
    num_cpus: float = Field(1.0, ge=0, description="CPUs per replica (fractions allowed).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (fractions allowed).")
    min_replicas: int = Field(1, ge=0, description="Autoscaling floor.")
    max_replicas: int = Field(1, ge=1, description="Autoscaling ceiling.")
    target_ongoing_requests: float = Field(16, gt=0, description="Autoscaling target per replica.")
    python: str | None = Field(
        None,
        description="The LLM venv's python on every node; empty: "
        "$RLT_LLM_PYTHON, else this checkout's .venv-llm/bin/python.",
    )
    health_check_period_s: float = Field(10.0, gt=0, description="Serve health-check period.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="Serve health-check timeout.")
    host_in_router: bool = Field(
        True,
        description="Host the live version in the route's router replicas once it has passed "
        "its gates (no extra hop for its tokens). Each router replica then runs an engine in "
        "the LLM venv and takes an LLM replica's CPUs and GPUs; off: the router forwards every "
        "request to the version's app.",
    )

    def router_serving(
        self, runtime_env: dict[str, Any], router_options: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The runtime_env and options of an LLM route's router: as a policy route's unless
        it hosts the live version, then in the LLM venv with an LLM replica's resources."""
        if not self.host_in_router:
            return runtime_env, router_options
        env = engine_runtime_env(
            EngineSettings.model_validate(self.engine),
            self.python,
            {"env_vars": runtime_env.get("env_vars", {})},
        )
        options = {
            **router_options,
            "num_cpus": max(router_options.get("num_cpus", 0.0), self.num_cpus),
            **({"num_gpus": self.num_gpus} if self.num_gpus else {}),
        }
        return {**runtime_env, **env}, options

    def app_args(self, mlflow_server: MLflowServer, model_name: str, version: str) -> LLMAppArgs:
        actor = {
            "num_cpus": self.num_cpus,
            **({"num_gpus": self.num_gpus} if self.num_gpus else {}),
        }
        return LLMAppArgs(
            mlflow={
                "tracking_uri": mlflow_server.tracking_uri,
                "model_name": model_name,
                "version": str(version),
            },
            served_model_name=model_name,
            version_label=str(version),
            engine=self.engine,
            autoscaling={
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            },
            ray_actor_options=actor,
            # Resolved here: the app is built from a shipped copy of workloads, elsewhere.
            python=llm_python(self.python),
            health_check_period_s=self.health_check_period_s,
            health_check_timeout_s=self.health_check_timeout_s,
        )


class Drill(BaseModel):
    """Faults injected into the candidate to rehearse the gates (a game day)."""

    faults: dict[str, Any] = Field(
        default_factory=dict,
        description="From deployment: error_rate, fail_health_after_s, latency_ms, "
        "disagree_rate (a policy); token_delay_ms, stream_refuse_rate, "
        "stream_break_after_tokens (an LLM).",
    )
    after_swap: dict[str, Any] = Field(
        default_factory=dict,
        description="Applied to the new live version right after the swap (rehearses rollback).",
    )

    @model_validator(mode="after")
    def _check(self) -> Drill:
        if set(self.faults) & set(LLMFaults.model_fields):
            LLMFaults.parse(self.faults)  # an LLM's; unknown (policy) fields are refused
        else:
            Faults.parse(self.faults)
        Faults.parse(self.after_swap)
        return self

    def check_kind(self, kind: str) -> None:
        """ValueError when a fault does not exist for what the route serves."""
        if kind == "llm":
            if self.after_swap:
                raise ValueError("after_swap faults are injected into policy versions only")
            LLMFaults.parse(self.faults)
        elif set(self.faults) & set(LLMFaults.model_fields):
            raise ValueError(f"{sorted(LLMFaults.model_fields)} are faults of an LLM version")
