"""train_and_ship: the model lifecycle as one flow run of subflows.

(data_prep) -> tune_sweep (sweep, then a held-out evaluation of the best checkpoint)
-> register_and_promote (registered once, challenger, champion only if better)
-> serve_rollout (health, smoke, canary, swap, bake) when the new version became champion,
or when nothing serves the route yet. Otherwise the live version keeps serving and the
result says why. Every parameter is in the Prefect run form.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.data_prep import DataPrepParams, data_prep
from prefect_ray_lifecycle.flows.register import (
    DEFAULT_MLFLOW_EXPERIMENT,
    DEFAULT_MODEL_NAME,
    RegistrationRequest,
    register_and_promote,
)
from prefect_ray_lifecycle.flows.rollout import RolloutResult, serve_rollout
from prefect_ray_lifecycle.flows.tune_sweep import tune_sweep
from prefect_ray_lifecycle.tasks import lineage
from prefect_ray_lifecycle.tasks._base import mlflow_task
from prefect_ray_lifecycle.tasks.params import Text
from prefect_ray_lifecycle.tasks.register import EvaluationSummary
from prefect_ray_lifecycle.tasks.rollout.claim import holding_route
from prefect_ray_lifecycle.tasks.rollout.config import Gates, Serving
from prefect_ray_lifecycle.tasks.tune.config import (
    DEFAULT_STORAGE_ROOT,
    StopConditions,
    SweepConfig,
)
from prefect_ray_lifecycle.workloads.constants import VERSION_HEADER

# Two PPO trials on 2 CPUs, each stopped at a training return of 450: held-out greedy returns
# of 490-500 in about a minute (make demo's measurements); a sweep never runs past 10 minutes.
# Built without SweepConfig's check, which imports RLlib and torch to read PPO's config fields
# (1.6 s in every process that imports this module: `prefect deploy --all`, the LLM
# pipeline's flow runs); test_tune_sweep runs the check.
DEFAULT_SWEEP = SweepConfig.model_construct(
    num_samples=2,
    max_concurrent_trials=2,
    stop=StopConditions(episode_return=450.0, sweep_seconds=600),
)


class ShippedVersion(BaseModel):
    """What a train-and-ship run ends with, whatever it trained: the version it registered,
    its promotion, and what its route serves afterwards."""

    model_name: str
    version: str = Field(description="The version this run registered.")
    promoted: bool = Field(description="Whether it is the champion now.")
    promotion_reason: str
    shipped: bool = Field(description="Whether a rollout ran (and passed its gates).")
    reason: str = Field(description="Why it was, or was not, rolled out.")
    served_version: str | None = Field(description="What the route serves at the end.")
    route_url: str | None = None
    rollout: RolloutResult | None = None
    model_version_url: str
    dataset_fingerprint: str | None = None


class PipelineResult(ShippedVersion):
    eval_mean_return: float = Field(description="Its greedy return on held-out episodes.")
    sweep_flow_run_id: str | None = None


@task(cache_policy=NO_CACHE)
def served_version(route_url: str) -> str | None:
    """The version the route serves (its X-Model-Version), or None when nothing serves it."""
    request = urllib.request.Request(route_url, method="GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.headers.get(VERSION_HEADER)
    except urllib.error.HTTPError as error:  # the router answers GET with 405 and the header
        return error.headers.get(VERSION_HEADER)
    except (urllib.error.URLError, OSError):
        return None


@mlflow_task
def tag_lineage(
    mlflow_server: MLflowServer, model_name: str, version: str, sweep_flow_run_id: str | None
) -> None:
    """The version points back at this pipeline run and at the sweep's flow run."""
    tune = {"flow_run_id": sweep_flow_run_id or ""}
    if sweep_flow_run_id:
        tune["flow_run_url"] = str(url_for("flow-run", obj_id=sweep_flow_run_id) or "")
    with mlflow_server.session() as client:
        registry.tag_verdict(
            client,
            model_name,
            version,
            "pipeline",
            {
                "flow_run_id": str(flow_run.id or ""),
                "flow_run_url": str(url_for("flow-run", obj_id=flow_run.id) or ""),
            },
        )
        registry.tag_verdict(client, model_name, version, "tune", tune)


@mlflow_task
def champion_version(mlflow_server: MLflowServer, model_name: str) -> str | None:
    with mlflow_server.session() as client:
        found = registry.resolve_alias(client, model_name, registry.CHAMPION)
    return found.version if found else None


def registration_request(
    model_name: str,
    swept: Any,
    sweep: SweepConfig,
    evaluation_episodes: int,
    dataset: Any,
) -> RegistrationRequest:
    """What register-and-promote needs of the sweep: its best checkpoint, its trial and the
    held-out evaluation, with the dataset it trained on."""
    evaluation = swept.evaluation
    return RegistrationRequest(
        model_name=model_name,
        checkpoint=swept.checkpoint_path,
        experiment_path=swept.experiment_path,
        trial_id=str(swept.metrics["trial_id"]),
        environment=sweep.environment,
        env_config=sweep.env_config,
        evaluation_episodes=evaluation_episodes,
        evaluation_seed=sweep.seed,
        evaluation=EvaluationSummary(
            mean_return=evaluation.mean_return,
            std_return=evaluation.std_return,
            episodes=evaluation.episodes,
            seed=sweep.seed,
        ),
        best_config=swept.best_config,
        metrics={
            k: float(v)
            for k, v in swept.metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        },
        trials=[t.model_dump() for t in swept.trials],
        dataset_fingerprint=dataset.fingerprint if dataset else None,
        sweep_chart=swept.chart_path,
    )


def rollout_decision(
    version: str,
    promoted: bool,
    champion: str | None,
    served: str | None,
    route: str,
    why: str = "",
) -> tuple[str | None, str]:
    """Which version to roll out (None: none), and why (`why`: the promotion verdict)."""
    why = f" ({why})" if why else ""
    if promoted:
        return version, f"v{version} was promoted to champion{why}"
    if served is None and champion is not None:
        return champion, (
            f"v{version} was not promoted{why}; nothing serves /{route} yet: "
            f"rolling out champion v{champion}"
        )
    if served is None:
        return None, f"v{version} was not promoted{why} and there is no champion to serve"
    return None, f"v{version} was not promoted{why}; v{served} keeps serving /{route}"


def ship_registered(
    registered: Any,
    *,
    model_name: str,
    route: str,
    cluster: RayCluster,
    server: MLflowServer,
    **rollout: Any,
) -> tuple[RolloutResult | None, str | None, str]:
    """Roll out what `rollout_decision` picks for a registered version (the version when it
    was promoted; the champion when nothing serves the route yet; else nothing), with the
    route already held by the caller. Returns the rollout (None: none ran), the version the
    route serves afterwards and why. `rollout`: serve_rollout's other arguments. A rejected
    or rolled-back rollout raises RolloutFailed, and the caller's run fails too."""
    served = served_version(f"{cluster.serve_url}/{route}")
    champion = None if registered.promoted else champion_version(server, model_name)
    target, reason = rollout_decision(
        registered.version, registered.promoted, champion, served, route, registered.reason
    )
    get_run_logger().info("rollout: %s", reason)
    if target is None:
        return None, served, reason
    result = serve_rollout(
        model_name=model_name,
        version=target,
        route=route,
        ray_cluster=cluster,
        mlflow_server=server,
        **rollout,
    )
    return (
        result,
        result.version,
        (f"{reason}; rollout: {result.outcome} ({result.reason}) by flow run {result.flow_run_id}"),
    )


@flow(name="train-and-ship", log_prints=True)
def train_and_ship(
    model_name: Text = DEFAULT_MODEL_NAME,
    route: Text = "policy",
    sweep: SweepConfig = DEFAULT_SWEEP,
    evaluation_episodes: Annotated[int, Field(ge=1, le=1000)] = 10,
    margin: Annotated[float, Field(ge=0)] = 0.0,
    ship: bool = True,
    gates: Gates | None = None,
    serving: Serving | None = None,
    data: DataPrepParams | None = None,
    storage_root: Text = DEFAULT_STORAGE_ROOT,
    mlflow_experiment: Text = DEFAULT_MLFLOW_EXPERIMENT,
    ray_cluster: RayCluster | None = None,
    mlflow_server: MLflowServer | None = None,
) -> PipelineResult:
    """Train a policy with a Tune sweep, evaluate it, register it, promote it if it beats the
    champion, and roll it out to a Serve route through the rollout gates.

    Args:
        model_name: Registered model in MLflow that receives the new version.
        route: The Serve route (URL prefix /<route>) the champion is rolled out to.
        sweep: The Tune sweep: algorithm, environment, search space, trials, stop conditions.
            The default (2 PPO trials on CartPole) reaches a held-out return near 500 on 2
            CPUs in a few minutes.
        evaluation_episodes: Held-out greedy episodes that score the new version and the
            champion (the same seeds for both).
        margin: How much higher than the champion's the new version's mean return must be
            for a promotion.
        ship: Roll out when the new version is promoted (or nothing serves the route yet);
            false: train, register and promote only.
        gates: Health, smoke, canary and bake settings of the rollout.
        serving: Replicas and CPUs of the version's Serve app and of the router.
        data: A dataset to prepare with Ray Data first (data-prep); the sweep's environment
            reads its train split (`<output>/train`, named in the sweep's env_config); the
            experiment and model version record it. Empty: no dataset (e.g. CartPole).
        storage_root: Folder shared by every Ray node where sweeps keep their trials and
            checkpoints.
        mlflow_experiment: MLflow experiment that holds the registration runs.
        ray_cluster: The Ray cluster to train and serve on; it must have an address (a
            cluster that outlives the run) when ship is true.
        mlflow_server: The MLflow server; the local one (http://127.0.0.1:5000) when empty.
    """
    cluster, server = ray_cluster or RayCluster(), mlflow_server or MLflowServer()
    registry.validate_model_name(model_name)
    if ship:
        serve_control.validate_route(route)
        if cluster.is_embedded:
            raise ValueError(
                "train_and_ship rolls out to Ray Serve, which needs a cluster that "
                "outlives the flow run: give ray_cluster an address (or set ship "
                "to false to train, register and promote only)"
            )

    dataset = data_prep(data, ray_cluster=cluster) if data is not None else None
    swept = tune_sweep(
        sweep=sweep,
        ray_cluster=cluster,
        storage_root=storage_root,
        evaluation_episodes=evaluation_episodes,
        asset_deps=[dataset.asset_key] if dataset else None,
    )
    evaluation = swept.evaluation
    sweep_run = str(swept.metrics.get("flow_run_id") or "") or None
    print(
        f"sweep: {len(swept.trials)} trials; best checkpoint scores "
        f"{evaluation.mean_return:.1f} ± {evaluation.std_return:.1f} on "
        f"{evaluation.episodes} held-out episodes"
    )

    request = registration_request(model_name, swept, sweep, evaluation_episodes, dataset)
    request.route = route if ship else None
    route_url = f"{cluster.serve_url}/{route}" if ship else None
    rollout: RolloutResult | None = None
    served = None
    # Shipping: the route is held from the promotion on, so the reconcile that a `champion`
    # move triggers waits for this run's rollout and then finds the route in sync: one
    # rollout per promotion, by this run.
    lease_s = (gates or Gates()).lease_s
    with holding_route(cluster, route, lease_s) if ship else contextlib.nullcontext():
        registered = register_and_promote(
            request, mlflow_server=server, margin=margin, mlflow_experiment=mlflow_experiment
        )
        version = registered.version
        tag_lineage(server, model_name, version, sweep_run)
        print(
            f"{model_name} v{version}: "
            f"{'promoted to champion' if registered.promoted else 'not promoted'}: "
            f"{registered.reason}"
        )
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
            )
    shipped = rollout is not None

    result = PipelineResult(
        model_name=model_name,
        version=version,
        eval_mean_return=evaluation.mean_return,
        promoted=registered.promoted,
        promotion_reason=registered.reason,
        shipped=shipped,
        reason=reason,
        served_version=served,
        route_url=route_url,
        rollout=rollout,
        model_version_url=lineage.model_version_url(server, model_name, version),
        sweep_flow_run_id=sweep_run,
        dataset_fingerprint=dataset.fingerprint if dataset else None,
    )
    _summarise(result, sweep.environment)
    return result


def _summarise(result: PipelineResult, environment: str) -> None:
    lines = [
        f"## {result.model_name} v{result.version}",
        f"- held-out return: **{result.eval_mean_return:.1f}**",
        f"- promotion: {'champion' if result.promoted else 'not promoted'} "
        f"({result.promotion_reason})",
        f"- rollout: {result.reason}",
        *(
            [f"- rolled out by: [serve-rollout]({result.rollout.flow_run_url})"]
            if result.rollout and result.rollout.flow_run_url
            else []
        ),
        f"- MLflow: {result.model_version_url}",
    ]
    if result.route_url:
        lines.append(
            f"- served: `{result.route_url}` answers with "
            f"{VERSION_HEADER}: {result.served_version or 'nothing'}"
        )
        if environment == "CartPole-v1":
            body = json.dumps({"observation": [0.01, -0.02, 0.03, 0.04]})
            lines.append(
                f"\n```\ncurl -si -XPOST {result.route_url} -H 'content-type: "
                f"application/json' -d '{body}'\n```"
            )
    create_markdown_artifact(
        key="train-and-ship",
        markdown="\n".join(lines),
        description=f"{result.model_name} v{result.version}: {result.reason}",
    )
