"""Prefect tasks for MLflow registration and promotion. Each is idempotent, so the only
retries (on connection errors to MLflow, with backoff) are safe."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.runtime import flow_run, task_run
from prefect.utilities.urls import url_for
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry
from prefect_ray_lifecycle.control.promotion import (
    EvalProtocol,
    LLMScore,
    Score,
    Verdict,
    decide_llm_promotion,
    decide_promotion,
)
from prefect_ray_lifecycle.tasks._base import mlflow_task
from prefect_ray_lifecycle.workloads.constants import PROJECT_ROOT
from prefect_ray_lifecycle.workloads.llm.evaluate import LLMEvalProtocol

# The evaluation a version was scored with, and its figures (RL: mean/std return; LLM: exact
# match and perplexity), kept on the version: a later promotion under the same protocol reads
# them instead of evaluating again.
PROTOCOL_TAG = f"{registry.TAG}.eval.protocol"
EXACT_MATCH_TAG = f"{registry.TAG}.eval.exact_match"
PERPLEXITY_TAG = f"{registry.TAG}.eval.perplexity"


def recorded_protocol(text: str | None) -> EvalProtocol | LLMEvalProtocol | None:
    """The protocol a version's tag records (an RL or an LLM one), or None."""
    if not text:
        return None
    try:
        data = json.loads(text)
        if data.get("kind") == "llm":
            return LLMEvalProtocol.from_json(text)
        return EvalProtocol.from_json(text)
    except (TypeError, ValueError):  # written by something else: evaluate again
        return None


class EvaluationSummary(BaseModel):
    mean_return: float = Field(description="Mean greedy return over the held-out episodes.")
    std_return: float = Field(description="Standard deviation of those returns.")
    episodes: int = Field(ge=1, description="Held-out episodes played.")
    seed: int = Field(description="Base seed of the held-out episodes.")


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=PROJECT_ROOT,
            text=True,
            capture_output=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def lineage_tags(
    experiment_path: str, trial_id: str, protocol: EvalProtocol, dataset_fingerprint: str | None
) -> dict[str, str]:
    tags = {
        f"{registry.TAG}.prefect.flow_run_id": str(flow_run.id or ""),
        # Prefect's runtime ui_url points at /flow-runs/..., a path the OSS UI does not route.
        f"{registry.TAG}.prefect.flow_run_url": str(url_for("flow-run", obj_id=flow_run.id) or ""),
        f"{registry.TAG}.prefect.task_run_id": str(task_run.id or ""),
        f"{registry.TAG}.tune.experiment_path": experiment_path,
        f"{registry.TAG}.tune.trial_id": trial_id,
        f"{registry.TAG}.git_commit": git_commit(),
        PROTOCOL_TAG: protocol.to_json(),
    }
    if dataset_fingerprint:
        tags[f"{registry.TAG}.dataset.fingerprint"] = dataset_fingerprint
    return tags


@task
def evaluate(checkpoint: str, protocol: EvalProtocol) -> EvaluationSummary:
    """Greedy episodes of the checkpoint's RLModule on the protocol's held-out seeds."""
    from prefect_ray_lifecycle.workloads.rl.rllib import evaluate_checkpoint

    registry.check_checkpoint(checkpoint)
    result = evaluate_checkpoint(
        checkpoint,
        protocol.environment,
        protocol.env_config,
        episodes=protocol.episodes,
        seed=protocol.seed,
    )
    return EvaluationSummary(
        mean_return=result.mean_return,
        std_return=result.std_return,
        episodes=protocol.episodes,
        seed=protocol.seed,
    )


@mlflow_task
def register(
    mlflow_server: MLflowServer,
    *,
    model_name: str,
    checkpoint: str,
    experiment_path: str,
    trial_id: str,
    protocol: EvalProtocol,
    evaluation: EvaluationSummary,
    best_config: dict[str, Any],
    metrics: dict[str, float],
    trials: list[dict[str, Any]],
    dataset_fingerprint: str | None,
    mlflow_experiment: str,
    create_model: bool,
) -> registry.Registration:
    """Register the trial's checkpoint once; a retry or a second call returns the same version."""
    from prefect_ray_lifecycle.workloads.rl.rllib import make_env

    env = make_env(protocol.environment, protocol.env_config)
    observation_size = int(env.observation_space.shape[0])
    env.close()
    tags = lineage_tags(experiment_path, trial_id, protocol, dataset_fingerprint)
    description = (
        f"RLlib policy from Tune trial {trial_id} of {experiment_path}, registered "
        f"by Prefect flow run {flow_run.id}; greedy return "
        f"{evaluation.mean_return:.1f} ± {evaluation.std_return:.1f} over "
        f"{evaluation.episodes} held-out episodes."
    )
    with mlflow_server.session() as client:
        result = registry.register_checkpoint(
            client,
            name=model_name,
            checkpoint=checkpoint,
            experiment_name=mlflow_experiment,
            trial_key_value=registry.trial_key(experiment_path, trial_id, checkpoint),
            params=best_config,
            metrics={
                **metrics,
                "eval_mean_return": evaluation.mean_return,
                "eval_std_return": evaluation.std_return,
            },
            tags={
                **tags,
                f"{registry.TAG}.eval.mean_return": f"{evaluation.mean_return:.6g}",
                f"{registry.TAG}.eval.std_return": f"{evaluation.std_return:.6g}",
            },
            description=description,
            artifacts={"trials.json": trials, "evaluation.json": evaluation.model_dump()},
            observation_size=observation_size,
            create_model=create_model,
        )
    return result


def _score(client, tracking_uri: str, version, protocol) -> Score | LLMScore:
    """A version's score under `protocol`: from its tags when it was scored that way, else
    by evaluating it again (an RLModule on the protocol's seeds, an LLM on its held-out
    prompts)."""
    import mlflow

    from prefect_ray_lifecycle.workloads.rl.policy_model import ARTIFACT_KEY

    tags = version.tags
    same = recorded_protocol(tags.get(PROTOCOL_TAG)) == protocol
    if isinstance(protocol, LLMEvalProtocol):
        if same:
            return LLMScore(
                version.version,
                float(tags[EXACT_MATCH_TAG]),
                float(tags[PERPLEXITY_TAG]),
                protocol,
            )
        from prefect_ray_lifecycle.workloads.llm.config import MLflowModelSource
        from prefect_ray_lifecycle.workloads.llm.evaluate import evaluate_model
        from prefect_ray_lifecycle.workloads.llm.models import download_from_mlflow

        folder = download_from_mlflow(
            MLflowModelSource(
                tracking_uri=tracking_uri, model_name=version.name, version=version.version
            )
        )
        found = evaluate_model(folder, protocol)
        return LLMScore(version.version, found.exact_match, found.perplexity, protocol)
    if same:
        return Score(
            version.version,
            float(tags[f"{registry.TAG}.eval.mean_return"]),
            float(tags[f"{registry.TAG}.eval.std_return"]),
            protocol,
        )
    model_dir = Path(
        mlflow.artifacts.download_artifacts(artifact_uri=version.source, tracking_uri=tracking_uri)
    )
    summary = evaluate.fn(str(model_dir / "artifacts" / ARTIFACT_KEY), protocol)
    return Score(version.version, summary.mean_return, summary.std_return, protocol)


def _figures(side: str, score: Score | LLMScore | None, llm: bool) -> dict[str, Any]:
    """A score's figures as verdict tags: `<side>_mean_return`, or an LLM's
    `<side>_exact_match` and `<side>_perplexity` ("none" without a score)."""
    if llm:
        return {
            f"{side}_exact_match": score.exact_match if score else "none",
            f"{side}_perplexity": score.perplexity if score else "none",
        }
    return {f"{side}_mean_return": score.mean_return if score else "none"}


@mlflow_task
def promote(
    mlflow_server: MLflowServer,
    *,
    model_name: str,
    version: str,
    protocol: EvalProtocol | LLMEvalProtocol,
    margin: float,
    perplexity_margin: float = 0.0,
) -> Verdict:
    """Challenger in; champion moves only if the policy says so (for LLM versions, the LLM
    policy on exact match and perplexity: control.promotion). Idempotent."""
    actor = f"prefect flow run {flow_run.id}"
    with mlflow_server.session() as client:
        candidate = client.get_model_version(model_name, version)
        champion = registry.resolve_alias(client, model_name, registry.CHAMPION)
        if champion is not None and champion.version == candidate.version:
            return Verdict(True, f"v{version} is already the champion")
        registry.move_alias(
            client, model_name, registry.CHALLENGER, version, reason="registered", actor=actor
        )
        uri = mlflow_server.tracking_uri
        challenger_score = _score(client, uri, candidate, protocol)
        champion_score = _score(client, uri, champion, protocol) if champion else None
        llm = isinstance(protocol, LLMEvalProtocol)
        if llm:
            verdict = decide_llm_promotion(
                challenger_score, champion_score, margin, perplexity_margin
            )
        else:
            verdict = decide_promotion(challenger_score, champion_score, margin)
        record = {
            "verdict": "promoted" if verdict.promote else "rejected",
            "reason": verdict.reason,
            **_figures("challenger", challenger_score, llm),
            "champion_version": champion.version if champion else "none",
            **_figures("champion", champion_score, llm),
            "decided_by": actor,
        }
        registry.tag_verdict(client, model_name, version, "promotion", record)
        if verdict.promote:
            registry.move_alias(
                client, model_name, registry.CHAMPION, version, reason=verdict.reason, actor=actor
            )
            registry.remove_alias(client, model_name, registry.CHALLENGER)
    get_run_logger().info("%s v%s: %s", model_name, version, verdict.reason)
    return verdict


@mlflow_task
def record_place(
    mlflow_server: MLflowServer,
    model_name: str,
    route: str,
    kind: str,
    settings: dict[str, Any] | None = None,
) -> None:
    """Keep with the registered model where it is served (route, kind, serving settings):
    a later `champion` move, which names only the model, reaches reconcile with them."""
    with mlflow_server.session() as client:
        registry.set_serving_tags(client, model_name, route, kind, settings)
