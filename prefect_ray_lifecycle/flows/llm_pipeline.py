"""llm-train-and-ship: an LLM's lifecycle as one flow run of subflows.

llm-finetune (or llm-sweep: a Tune sweep of it) -> register-llm (the best checkpoint scored
against the champion on the same held-out prompts; challenger; champion only when better by
a margin; the route, kind and serving settings kept with the model) -> serve-rollout as an
LLM version (health, smoke, shadow, canary, swap, bake) when it became champion, or when
nothing serves the route yet. train-and-ship's decisions and route hold, for LLMs.
"""

from __future__ import annotations

import contextlib
from typing import Annotated

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import Field

from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.llm_finetune import FineTuneParams, FineTuneResult, llm_finetune
from prefect_ray_lifecycle.flows.llm_register import (
    DEFAULT_LLM_MODEL_NAME,
    DEFAULT_LLM_ROUTE,
    DEFAULT_PERPLEXITY_MARGIN,
    LLMRegistrationRequest,
    LLMRegistrationResult,
    register_llm_and_promote,
)
from prefect_ray_lifecycle.flows.llm_sweep import LLMSweepResult, llm_sweep
from prefect_ray_lifecycle.flows.pipeline import ShippedVersion, ship_registered
from prefect_ray_lifecycle.flows.register import DEFAULT_MLFLOW_EXPERIMENT
from prefect_ray_lifecycle.tasks import lineage
from prefect_ray_lifecycle.tasks.finetune.config import LLMSweepOutcome, LLMSweepSettings
from prefect_ray_lifecycle.tasks.finetune.evaluate import LLMEvaluationSummary
from prefect_ray_lifecycle.tasks.params import Text
from prefect_ray_lifecycle.tasks.rollout.claim import holding_route
from prefect_ray_lifecycle.tasks.rollout.config import Gates, LLMServing, Serving
from prefect_ray_lifecycle.workloads.constants import VERSION_HEADER

__all__ = ["LLMPipelineResult", "llm_train_and_ship", "registration_request"]


class LLMPipelineResult(ShippedVersion):
    base_evaluation: LLMEvaluationSummary | None = Field(description="The base's figures.")
    evaluation: LLMEvaluationSummary = Field(description="The new version's figures.")
    train_flow_run_id: str | None = None
    trial_id: str | None = Field(None, description="The sweep's winning trial, if swept.")
    sweep: LLMSweepOutcome | None = Field(None, description="The sweep's trials, if swept.")


def registration_request(
    params: FineTuneParams,
    trained: FineTuneResult | LLMSweepResult,
    model_name: str,
    route: str,
    llm: LLMServing | None,
    serving: Serving | None,
) -> LLMRegistrationRequest:
    """What register-llm needs of a fine-tune or a sweep: its best checkpoint, where it came
    from, its evaluation, and where it is served."""
    base = params.base.mlflow if params.base is not None else None
    common = dict(
        model_name=model_name,
        finetune_flow_run_id=trained.flow_run_id,
        dataset_fingerprint=trained.dataset_fingerprint,
        base=trained.base_label,
        base_version=f"{base.model_name}/{base.version}" if base else None,
        evaluation=params.evaluation or {},
        challenger_evaluation=trained.evaluation,
        params=params.training.model_dump(mode="json"),
        route=route,
        llm=llm,
        serving=serving,
    )
    if isinstance(trained, LLMSweepResult):
        outcome, best = trained.outcome, trained.outcome.best
        return LLMRegistrationRequest(
            checkpoint=outcome.best_checkpoint_local,
            train_run=best.train_run,
            trial_id=best.trial_id,
            checkpoint_step=outcome.best_step,
            loss_chart=outcome.chart_path,
            metrics={"eval_loss": best.best_eval_loss} if best.best_eval_loss else {},
            **{**common, "params": {**common["params"], **best.config}},
        )
    outcome = trained.outcome
    return LLMRegistrationRequest(
        checkpoint=outcome.best_checkpoint_local,
        train_run=outcome.experiment_path,
        loss_chart=outcome.chart_path,
        metrics={
            k: float(v)
            for k, v in {
                "eval_loss": outcome.best_eval_loss,
                "base_eval_loss": outcome.base_eval_loss,
                "tokens_seen": outcome.tokens_seen,
            }.items()
            if v is not None
        },
        **common,
    )


@flow(name="llm-train-and-ship", log_prints=True)
def llm_train_and_ship(
    params: FineTuneParams,
    sweep: LLMSweepSettings | None = None,
    model_name: Text = DEFAULT_LLM_MODEL_NAME,
    route: Text = DEFAULT_LLM_ROUTE,
    margin: Annotated[float, Field(ge=0)] = 0.0,
    perplexity_margin: Annotated[float, Field(ge=0, lt=1)] = DEFAULT_PERPLEXITY_MARGIN,
    ship: bool = True,
    gates: Gates | None = None,
    llm: LLMServing | None = None,
    serving: Serving | None = None,
    mlflow_experiment: Text = DEFAULT_MLFLOW_EXPERIMENT,
    ray_cluster: RayCluster | None = None,
    mlflow_server: MLflowServer | None = None,
) -> LLMPipelineResult:
    """Fine-tune a causal LM (or sweep its learning rate and warm-up), evaluate it against
    the champion on held-out prompts, register it, promote it if better, and roll it out to
    its Serve route as an LLM version through the rollout gates.

    Args:
        params: The fine-tune: corpus, base, training, resources, storage, evaluation.
        sweep: A Tune sweep of the fine-tune instead of one run; empty: one fine-tune.
        model_name: Registered model in MLflow that receives the new version.
        route: The Serve route (URL prefix /<route>) the model is served on.
        margin: How much higher (a share of prompts) the new version's exact match must be.
        perplexity_margin: Or, at no lower exact match, how much lower its perplexity.
        ship: Roll out when the new version is promoted (or nothing serves the route yet);
            false: train, register and promote only (a champion move still reaches
            reconcile through the trigger where the deployments run).
        gates: Health, smoke, shadow, canary and bake settings of the rollout.
        llm: vLLM engine, replicas and venv of the version's app.
        serving: Router replicas and CPUs.
        mlflow_experiment: MLflow experiment that holds the registration runs.
        ray_cluster: The Ray cluster; it must have an address when ship is true.
        mlflow_server: The MLflow server; the local one (http://127.0.0.1:5000) when empty.
    """
    cluster, server = ray_cluster or RayCluster(), mlflow_server or MLflowServer()
    registry.validate_model_name(model_name)
    serve_control.validate_route(route)
    if ship and cluster.is_embedded:
        raise ValueError(
            "llm_train_and_ship rolls out to Ray Serve, which needs a cluster that outlives "
            "the flow run: give ray_cluster an address (or set ship to false)"
        )
    trained = (
        llm_sweep(params, sweep, ray_cluster=cluster)
        if sweep is not None
        else llm_finetune(params, ray_cluster=cluster)
    )
    request = registration_request(params, trained, model_name, route, llm, serving)
    route_url = f"{cluster.serve_url}/{route}" if ship else None
    rollout, served = None, None
    lease_s = (gates or Gates()).lease_s
    # As train-and-ship: the route is held from the promotion on, so the reconcile that the
    # champion move triggers finds it in sync once this run's rollout is done.
    with holding_route(cluster, route, lease_s) if ship else contextlib.nullcontext():
        registered: LLMRegistrationResult = register_llm_and_promote(
            request,
            mlflow_server=server,
            margin=margin,
            perplexity_margin=perplexity_margin,
            mlflow_experiment=mlflow_experiment,
        )
        version = registered.version
        if not ship:
            reason = "ship is false: no rollout"
        else:
            rollout, served, reason = ship_registered(
                registered,
                model_name=model_name,
                route=route,
                cluster=cluster,
                server=server,
                gates=gates,
                serving=serving,
                kind="llm",
                llm=llm,
            )
    result = LLMPipelineResult(
        model_name=model_name,
        version=version,
        base_evaluation=trained.base_evaluation,
        evaluation=registered.evaluation,
        promoted=registered.promoted,
        promotion_reason=registered.reason,
        shipped=rollout is not None,
        reason=reason,
        served_version=served,
        route_url=route_url,
        rollout=rollout,
        model_version_url=lineage.model_version_url(server, model_name, version),
        train_flow_run_id=trained.flow_run_id,
        dataset_fingerprint=trained.dataset_fingerprint,
        trial_id=request.trial_id,
        sweep=trained.outcome if isinstance(trained, LLMSweepResult) else None,
    )
    _summarise(result)
    return result


def _summarise(result: LLMPipelineResult) -> None:
    before, after = result.base_evaluation, result.evaluation
    lines = [
        f"## {result.model_name} v{result.version}",
        f"- held-out exact match **{after.exact_match:.2f}**, perplexity "
        f"**{after.perplexity:.2f}**"
        + (
            f" (base: {before.exact_match:.2f}, {before.perplexity:.2f})"
            if before is not None
            else ""
        ),
        f"- promotion: {'champion' if result.promoted else 'challenger, not promoted'} "
        f"({result.promotion_reason})",
        f"- rollout: {result.reason}",
        f"- MLflow: {result.model_version_url}",
    ]
    if result.route_url:
        lines.append(
            f"- served: `{result.route_url}` answers with {VERSION_HEADER}: "
            f"{result.served_version or 'nothing'}\n\n```\ncurl -si {result.route_url}"
            f"/v1/completions -H 'content-type: application/json' -d "
            f'\'{{"model": "{result.model_name}", "prompt": "flow: count on from 41", '
            f'"max_tokens": 3, "temperature": 0}}\'\n```'
        )
    create_markdown_artifact(
        key="llm-train-and-ship",
        markdown="\n".join(lines),
        description=f"{result.model_name} v{result.version}: {result.reason}",
    )
