"""register_and_promote: a sweep's best checkpoint becomes a registered, promotable version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field, field_validator

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry
from prefect_ray_lifecycle.control.promotion import EvalProtocol, Verdict
from prefect_ray_lifecycle.tasks import charts, lineage
from prefect_ray_lifecycle.tasks.params import Text
from prefect_ray_lifecycle.tasks.register import (
    EvaluationSummary,
    evaluate,
    promote,
    record_place,
    register,
)

DEFAULT_MODEL_NAME = "cartpole-ppo"
DEFAULT_MLFLOW_EXPERIMENT = "prefect-ray-lifecycle"
SWEEP_CHART_PATH = "charts/sweep.png"


class RegistrationRequest(BaseModel):
    """What to register: one Tune trial's checkpoint, and how to score it."""

    model_name: Text = Field(DEFAULT_MODEL_NAME, description="Registered model name in MLflow.")
    checkpoint: str = Field(description="Path of the trial's Algorithm checkpoint.")
    experiment_path: str = Field(description="The Tune experiment the trial belongs to.")
    trial_id: Text = Field(
        description="The Tune trial id; with the experiment, the identity "
        "that makes registration idempotent."
    )
    environment: str = Field(
        "CartPole-v1",
        description="Gymnasium id or `module:function` env creator used for evaluation.",
    )
    env_config: dict[str, Any] = Field(
        default_factory=dict, description="env_config passed to the env creator."
    )
    evaluation_episodes: int = Field(
        10, ge=1, le=1000, description="Held-out greedy episodes per evaluation."
    )
    evaluation_seed: int = Field(
        0,
        description="Base seed of the held-out episodes; champion "
        "and challenger are scored on the same seeds.",
    )
    evaluation: EvaluationSummary | None = Field(
        None,
        description="The sweep's evaluation of this checkpoint under the same protocol; "
        "evaluated again when empty.",
    )
    best_config: dict[str, Any] = Field(
        default_factory=dict, description="The trial's config, logged as params."
    )
    metrics: dict[str, float] = Field(
        default_factory=dict, description="The trial's final metrics."
    )
    trials: list[dict[str, Any]] = Field(
        default_factory=list, description="The sweep's trial table, logged as an artifact."
    )
    dataset_fingerprint: str | None = Field(
        None, description="Fingerprint of the training data, when there was a data prep."
    )
    sweep_chart: str | None = Field(
        None,
        description="The sweep's chart (a PNG file on this machine, tune-sweep's chart_path), "
        "logged on the version's MLflow run and shown on this flow run.",
    )
    route: Text | None = Field(
        None,
        description="The Serve route the model is served on, kept with the registered model "
        "before any promotion, so that its `champion` move reaches that route; empty: "
        "whatever it was last rolled out with.",
    )

    @field_validator("model_name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return registry.validate_model_name(value)

    @property
    def protocol(self) -> EvalProtocol:
        return EvalProtocol(
            self.environment, self.evaluation_episodes, self.evaluation_seed, self.env_config
        )


class RegistrationResult(BaseModel):
    model_name: str
    version: str
    created: bool = Field(description="False when the trial was already registered.")
    promoted: bool
    reason: str
    model_uri: str


@dataclass(frozen=True)
class RegistrationChart:
    """A chart to log on a new version's MLflow run and show on the flow run."""

    path: str
    artifact_path: str  # on the version's run
    kind: str  # the artifact key's start: "sweep-chart", "loss-chart"
    label: str  # how the registration artifact links it
    description: str


def finish_registration(
    server: MLflowServer,
    registration: registry.Registration,
    *,
    model_name: str,
    chart: RegistrationChart | None,
    promotion: dict[str, Any],
    experiment_path: str,
    metadata: dict[str, Any],
    served_on: str | None = None,
    not_promoted: str = "not promoted",
    lineage_kinds: dict[str, str] | None = None,
    description: str = "MLflow registration and promotion verdict",
) -> Verdict:
    """What every registration does once its version exists: log its chart on the version's
    run (never failing the flow: a broken chart is a warning), promote it or not
    (tasks.register.promote with `promotion`: its protocol and margins), record it in the
    lineage with the verdict, and say both in the `registration` artifact."""
    version = registration.version
    get_run_logger().info(
        "%s %s v%s",
        "Registered" if registration.created else "Already registered",
        model_name,
        version,
    )
    chart_url = None
    if chart is not None:
        chart_url = charts.publish_file(
            chart.path,
            server=server,
            run_id=registration.run_id,
            artifact_path=chart.artifact_path,
            key=charts.artifact_key(chart.kind, model_name),
            description=chart.description,
        )
    verdict = promote(server, model_name=model_name, version=version, **promotion)
    lineage.record_model_version(
        server,
        model_name,
        version,
        experiment_path=experiment_path,
        metadata={
            **metadata,
            "promoted": verdict.promote,
            "reason": verdict.reason,
            "model_uri": registration.model_uri,
        },
        **(lineage_kinds or {}),
    )
    place = f", served on `/{served_on}`" if served_on else ""
    create_markdown_artifact(
        key="registration",
        markdown=(
            f"**{model_name} v{version}** "
            f"({'new' if registration.created else 'already registered'}){place}: "
            f"{'promoted to champion' if verdict.promote else not_promoted}: "
            f"{verdict.reason}\n\nModel: {lineage.model_version_url(server, model_name, version)}"
            + (f"\n\n{chart.label}: [{chart.artifact_path}]({chart_url})" if chart_url else "")
        ),
        description=description,
    )
    return verdict


@flow(name="register-and-promote")
def register_and_promote(
    request: RegistrationRequest,
    mlflow_server: MLflowServer | None = None,
    margin: float = 0.0,
    create_model: bool = True,
    mlflow_experiment: Text = DEFAULT_MLFLOW_EXPERIMENT,
) -> RegistrationResult:
    """Register a trial's checkpoint in MLflow (once), make it the challenger, and promote it
    to champion when it beats the champion on the same evaluation protocol.

    Args:
        request: The trial's checkpoint, its lineage and the evaluation protocol.
        mlflow_server: The MLflow server; the local one (http://127.0.0.1:5000) when empty.
        margin: How much higher the challenger's mean return must be to be promoted.
        create_model: Create the registered model when it does not exist yet.
        mlflow_experiment: MLflow experiment that holds the registration runs.
    """
    server = mlflow_server or MLflowServer()
    protocol = request.protocol
    evaluation = request.evaluation
    if evaluation is None or (evaluation.episodes, evaluation.seed) != (
        protocol.episodes,
        protocol.seed,
    ):
        evaluation = evaluate(request.checkpoint, protocol)
    registration = register(
        server,
        model_name=request.model_name,
        checkpoint=request.checkpoint,
        experiment_path=request.experiment_path,
        trial_id=request.trial_id,
        protocol=protocol,
        evaluation=evaluation,
        best_config=request.best_config,
        metrics=request.metrics,
        trials=request.trials,
        dataset_fingerprint=request.dataset_fingerprint,
        mlflow_experiment=mlflow_experiment,
        create_model=create_model,
    )
    if request.route:  # before the promotion: its champion move must find the route
        record_place(server, request.model_name, request.route, "policy")
    chart = None
    if request.sweep_chart:
        chart = RegistrationChart(
            request.sweep_chart,
            SWEEP_CHART_PATH,
            "sweep-chart",
            "Sweep chart",
            f"The Tune sweep behind {request.model_name} v{registration.version}",
        )
    verdict = finish_registration(
        server,
        registration,
        model_name=request.model_name,
        chart=chart,
        promotion={"protocol": protocol, "margin": margin},
        experiment_path=request.experiment_path,
        metadata={
            "trial_id": request.trial_id,
            "eval_mean_return": evaluation.mean_return,
            "dataset_fingerprint": request.dataset_fingerprint,
        },
    )
    return RegistrationResult(
        model_name=request.model_name,
        version=registration.version,
        created=registration.created,
        promoted=verdict.promote,
        reason=verdict.reason,
        model_uri=registration.model_uri,
    )
