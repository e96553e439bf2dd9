"""reconcile: make what is served follow what is wanted.

`champion` is the version people (or the promotion policy) want served; `live` is what the
route serves. When they differ, and the champion has not already failed a rollout, run
serve_rollout for it; otherwise do nothing. Run on a schedule, this is how a promotion made
by hand in the MLflow UI reaches production, health-gated.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from pydantic import BaseModel

from blocks import MLflowServer, RayCluster
from flows.register import DEFAULT_MODEL_NAME
from flows.rollout import RolloutResult, serve_rollout
from tasks.serve_config import Gates, Serving
from workloads import registry

FAILED_VERDICTS = ("rejected", "rolled_back")


class ReconcileResult(BaseModel):
    action: str  # "rolled_out", "in_sync", "no_champion" or "skipped_failed"
    reason: str
    champion: str | None = None
    live: str | None = None
    rollout: RolloutResult | None = None


@flow(name="reconcile")
def reconcile(
    model_name: str = DEFAULT_MODEL_NAME,
    route: str = "policy",
    gates: Gates | None = None,
    serving: Serving | None = None,
    ray_cluster: RayCluster | None = None,
    mlflow_server: MLflowServer | None = None,
) -> ReconcileResult:
    """Roll the `champion` version out when it differs from `live`, unless it already failed
    a rollout (move `champion` to another version, or delete the version's
    `lifecycle.rollout.verdict` tag, to try again).

    Args:
        model_name: Registered model in MLflow.
        route: The Serve route that serves the model.
        gates: Gate settings for the rollout, when one is needed.
        serving: Serving settings for the rollout, when one is needed.
        ray_cluster: The Ray cluster that serves the route.
        mlflow_server: The MLflow server; the local one (http://127.0.0.1:5000) when empty.
    """
    logger = get_run_logger()
    server = mlflow_server or MLflowServer()
    with server.session() as client:
        champion = registry.resolve_alias(client, model_name, registry.CHAMPION)
        live = registry.resolve_alias(client, model_name, registry.LIVE)
    live_version = live.version if live else None
    if champion is None:
        logger.info("%s has no champion: nothing to serve", model_name)
        return ReconcileResult(action="no_champion", reason="no champion", live=live_version)
    if champion.version == live_version:
        logger.info("%s v%s is champion and live: in sync", model_name, live_version)
        return ReconcileResult(
            action="in_sync",
            reason="champion is live",
            champion=champion.version,
            live=live_version,
        )
    verdict = champion.tags.get(f"{registry.TAG}.rollout.verdict")
    if verdict in FAILED_VERDICTS:
        why = champion.tags.get(f"{registry.TAG}.rollout.reason", "")
        logger.warning(
            "champion v%s already failed a rollout (%s: %s); v%s keeps serving",
            champion.version,
            verdict,
            why,
            live_version,
        )
        return ReconcileResult(
            action="skipped_failed",
            reason=f"{verdict}: {why}",
            champion=champion.version,
            live=live_version,
        )
    logger.info("champion v%s differs from live v%s: rolling out", champion.version, live_version)
    result = serve_rollout(
        model_name=model_name,
        version=champion.version,
        route=route,
        gates=gates,
        serving=serving,
        ray_cluster=ray_cluster,
        mlflow_server=server,
    )
    return ReconcileResult(
        action="rolled_out",
        reason=result.outcome,
        champion=champion.version,
        live=result.version,
        rollout=result,
    )
