"""register-llm: a fine-tune's checkpoint becomes a registered, promotable LLM version.

The RL path's registration for LLM versions: the same idempotent registry, aliases and
verdict tags (control.registry), the same promotion task (tasks.register.promote), with the
LLM's own evaluation (held-out perplexity and greedy exact match, workloads.llm.evaluate)
and promotion policy (control.promotion.decide_llm_promotion). Before the promotion the
model's route, kind ("llm") and serving settings are kept with it, so its `champion` move
(which names only the model) starts a gated LLM rollout on that route through reconcile.
Every input is checked before anything is written; a failed registration moves no alias.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from pydantic import BaseModel, Field, field_validator

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.register import (
    DEFAULT_MLFLOW_EXPERIMENT,
    RegistrationChart,
    RegistrationResult,
    finish_registration,
)
from prefect_ray_lifecycle.tasks.finetune.evaluate import (
    LLMEvaluationSummary,
    evaluate_llm,
    publish_evaluation,
)
from prefect_ray_lifecycle.tasks.finetune.register import LLMLineage, register_llm
from prefect_ray_lifecycle.tasks.params import Text
from prefect_ray_lifecycle.tasks.register import record_place
from prefect_ray_lifecycle.tasks.rollout.config import LLMServing, Serving
from prefect_ray_lifecycle.workloads.llm.evaluate import LLMEvaluationSettings
from prefect_ray_lifecycle.workloads.llm.train.state import read_state

__all__ = [
    "DEFAULT_LLM_MODEL_NAME",
    "DEFAULT_LLM_ROUTE",
    "DEFAULT_PERPLEXITY_MARGIN",
    "LLMRegistrationRequest",
    "LLMRegistrationResult",
    "register_llm_and_promote",
]

DEFAULT_LLM_MODEL_NAME = "tiny-llama-count"
DEFAULT_LLM_ROUTE = "llm"
# A challenger that answers no better must be at least this much less perplexed to win.
DEFAULT_PERPLEXITY_MARGIN = 0.05
LOSS_CHART_PATH = "charts/loss.png"


class LLMRegistrationRequest(BaseModel):
    """What to register: one fine-tune checkpoint (a Hugging Face folder), where it came
    from, how to score it, and where it is served."""

    model_name: Text = Field(DEFAULT_LLM_MODEL_NAME, description="Registered model in MLflow.")
    checkpoint: str = Field(
        description="The checkpoint's folder on this machine (the fine-tune's "
        "best_checkpoint_local): config, weights and tokenizer at its top level."
    )
    train_run: str = Field(description="The Ray Train run (or Tune trial) it belongs to.")
    trial_id: str | None = Field(None, description="The Tune trial, when a sweep chose it.")
    checkpoint_step: int | None = Field(
        None, ge=0, description="Its optimizer step; empty: read from its trainer_state/."
    )
    finetune_flow_run_id: str | None = Field(
        None, description="The llm-finetune (or sweep) flow run that trained it."
    )
    dataset_fingerprint: str | None = Field(None, description="The prepared dataset's hash.")
    base: str = Field("", description="The base model it was fine-tuned from, as people name it.")
    base_version: str | None = Field(
        None, description="The base's MLflow model version (name/version), when it was one."
    )
    evaluation: LLMEvaluationSettings = Field(
        default_factory=LLMEvaluationSettings,
        description="The held-out prompts the challenger and the champion are both scored on.",
    )
    challenger_evaluation: LLMEvaluationSummary | None = Field(
        None,
        description="The checkpoint's evaluation already made under the same protocol (the "
        "fine-tune's); evaluated again when empty or under another protocol.",
    )
    loss_chart: str | None = Field(
        None, description="The fine-tune's loss chart (a PNG here), logged on the version's run."
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Training settings, logged.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Training figures.")
    route: Text = Field(
        DEFAULT_LLM_ROUTE,
        description="The Serve route the model is served on (URL prefix /<route>), kept with "
        "the registered model with its kind and serving settings before any promotion, so "
        "that its `champion` move reaches that route as an LLM rollout.",
    )
    llm: LLMServing | None = Field(
        None,
        description="vLLM engine, replicas and venv of its app, kept with the model for the "
        "rollouts reconcile runs; empty: what it last had, else the defaults.",
    )
    serving: Serving | None = Field(
        None, description="Router replicas and CPUs, kept the same way; empty: the defaults."
    )

    @field_validator("model_name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return registry.validate_model_name(value)

    @field_validator("route")
    @classmethod
    def _check_route(cls, value: str) -> str:
        return serve_control.validate_route(value)

    def serving_settings(self) -> dict[str, Any] | None:
        if self.llm is None and self.serving is None:
            return None
        return {
            "serving": (self.serving or Serving()).model_dump(mode="json"),
            "llm": (self.llm or LLMServing()).model_dump(mode="json"),
        }


class LLMRegistrationResult(RegistrationResult):
    evaluation: LLMEvaluationSummary = Field(description="The challenger's held-out figures.")
    route: str = Field(description="The route its champion move rolls it out to.")


def _step(request: LLMRegistrationRequest) -> int | None:
    if request.checkpoint_step is not None:
        return request.checkpoint_step
    try:
        return read_state(request.checkpoint).step
    except (OSError, ValueError, TypeError):  # a folder from elsewhere: no training state
        return None


@flow(name="register-llm")
def register_llm_and_promote(
    request: LLMRegistrationRequest,
    mlflow_server: MLflowServer | None = None,
    margin: float = 0.0,
    perplexity_margin: float = DEFAULT_PERPLEXITY_MARGIN,
    create_model: bool = True,
    mlflow_experiment: Text = DEFAULT_MLFLOW_EXPERIMENT,
) -> LLMRegistrationResult:
    """Register a fine-tune checkpoint in MLflow (once) as an LLM version served on
    `request.route`, make it the challenger, and promote it to champion when it beats the
    champion on the same held-out evaluation (control.promotion.decide_llm_promotion).

    Args:
        request: The checkpoint, its lineage, the evaluation, the route and serving settings.
        mlflow_server: The MLflow server; the local one (http://127.0.0.1:5000) when empty.
        margin: How much higher (a share of prompts) the challenger's exact match must be.
        perplexity_margin: Or, at no lower exact match, how much lower its perplexity must be
            (a share of the champion's).
        create_model: Create the registered model when it does not exist yet.
        mlflow_experiment: MLflow experiment that holds the registration runs.
    """
    server = mlflow_server or MLflowServer()
    # Everything checked before anything is written.
    try:
        protocol = request.evaluation.protocol()
    except ValueError as error:
        raise registry.RegistrationError(f"request.{error}") from None
    if margin < 0 or not 0 <= perplexity_margin < 1:
        raise registry.RegistrationError(
            f"margin must be >= 0 (got {margin}) and perplexity_margin in [0, 1) "
            f"(got {perplexity_margin})"
        )
    registry.check_llm_folder(request.checkpoint)
    evaluation = request.challenger_evaluation
    if evaluation is None or evaluation.eval_protocol != protocol:
        evaluation = evaluate_llm(request.checkpoint, protocol)
    step = _step(request)
    registration = register_llm(
        server,
        model_name=request.model_name,
        lineage=LLMLineage(
            train_run=request.train_run,
            checkpoint=request.checkpoint,
            checkpoint_step=step,
            finetune_flow_run_id=request.finetune_flow_run_id,
            dataset_fingerprint=request.dataset_fingerprint,
            base=request.base,
            base_version=request.base_version,
            trial_id=request.trial_id,
        ),
        evaluation=evaluation,
        params=request.params,
        metrics=request.metrics,
        mlflow_experiment=mlflow_experiment,
        create_model=create_model,
    )
    # Before the promotion: its champion move must find the route, the kind and the settings.
    record_place(server, request.model_name, request.route, "llm", request.serving_settings())
    version = registration.version
    publish_evaluation(
        {f"{request.model_name} v{version}": evaluation},
        "llm-registration-evaluation",
        f"Held-out evaluation of {request.model_name} v{version}",
    )
    chart = None
    if request.loss_chart and Path(request.loss_chart).is_file():
        chart = RegistrationChart(
            request.loss_chart,
            LOSS_CHART_PATH,
            "loss-chart",
            "Loss chart",
            f"The fine-tune behind {request.model_name} v{version}",
        )
    verdict = finish_registration(
        server,
        registration,
        model_name=request.model_name,
        chart=chart,
        promotion={
            "protocol": protocol,
            "margin": margin,
            "perplexity_margin": perplexity_margin,
        },
        experiment_path=request.train_run,
        metadata={
            "checkpoint_step": step,
            "exact_match": evaluation.exact_match,
            "perplexity": evaluation.perplexity,
            "dataset_fingerprint": request.dataset_fingerprint,
            "route": request.route,
        },
        served_on=request.route,
        not_promoted="challenger, not promoted",
        lineage_kinds={"what": "a fine-tuned causal LM", "source": "the Ray Train run"},
        description="MLflow registration and promotion verdict of an LLM version",
    )
    return LLMRegistrationResult(
        model_name=request.model_name,
        version=version,
        created=registration.created,
        promoted=verdict.promote,
        reason=verdict.reason,
        model_uri=registration.model_uri,
        evaluation=evaluation,
        route=request.route,
    )
