"""Prefect assets for the model lifecycle: the Tune experiment, the MLflow model version and
the Serve app and route, each materialised by the flow that made it, with its upstream assets
(dataset -> experiment -> model version -> Serve app -> route) as dependencies.

Keys are computed from what each flow already knows (an experiment path, a model name and
version, a cluster address and app name), so a flow run names its upstream asset without
having seen the upstream run. Prefect records each materialisation as an event
(`prefect.asset.materialization.succeeded`) whose related resources are the upstream assets.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlparse

from prefect.assets import Asset, AssetProperties, add_asset_metadata, materialize
from prefect.cache_policies import NO_CACHE

from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster

# Characters Prefect refuses in an asset key (prefect.types.names.RESTRICTED_ASSET_CHARACTERS).
_RESTRICTED = re.compile(r"[\s#?&%\"'<>\[\]{}|\\^`\x00]")


def _clean(text: str) -> str:
    return _RESTRICTED.sub("_", text)


def experiment_key(experiment_path: str) -> str:
    """A Tune experiment directory (local path or storage URI) as an asset key."""
    path = experiment_path.rstrip("/")
    return _clean(path if "://" in path else f"file://{path}")


def _mlflow_authority(server: MLflowServer) -> str:
    uri = urlparse(server.registry_uri or server.tracking_uri)
    if uri.scheme in ("http", "https"):
        return uri.netloc.rsplit("@", 1)[-1]
    return uri.scheme or "local"


def model_version_key(server: MLflowServer, model_name: str, version: str) -> str:
    return _clean(f"mlflow://{_mlflow_authority(server)}/models/{model_name}/versions/{version}")


def model_version_url(server: MLflowServer, model_name: str, version: str) -> str:
    """The version's page in the MLflow UI."""
    return f"{server.tracking_uri}/#/models/{model_name}/versions/{version}"


def _cluster_authority(cluster: RayCluster) -> str:
    return cluster.address.removeprefix("ray://") or "local"


def serve_app_key(cluster: RayCluster, app: str) -> str:
    return _clean(f"rayserve://{_cluster_authority(cluster)}/apps/{app}")


def serve_route_key(cluster: RayCluster, route: str) -> str:
    return _clean(f"rayserve://{_cluster_authority(cluster)}/routes/{route}")


def record(
    key: str,
    *,
    name: str,
    description: str,
    by: str,
    deps: list[str],
    metadata: dict[str, Any],
    url: str | None = None,
) -> str:
    """Materialise one asset (a task run of its own) that depends on `deps`; returns its key."""
    asset = Asset(
        key=key, properties=AssetProperties(name=name, description=description[:2500], url=url)
    )

    @materialize(
        asset, by=by, asset_deps=[d for d in deps if d], cache_policy=NO_CACHE, name=f"asset-{by}"
    )
    def materialise() -> str:
        add_asset_metadata(asset, {k: v for k, v in metadata.items() if v is not None})
        return key

    return materialise()


def record_experiment(experiment_path: str, *, deps: list[str], metadata: dict[str, Any]) -> str:
    return record(
        experiment_key(experiment_path),
        name=f"Tune experiment {experiment_path.rstrip('/').rsplit('/', 2)[-2]}",
        description=f"Ray Tune sweep at {experiment_path}: trials, checkpoints, results.",
        by="ray-tune",
        deps=deps,
        metadata=metadata,
    )


def record_model_version(
    server: MLflowServer,
    model_name: str,
    version: str,
    *,
    experiment_path: str,
    metadata: dict[str, Any],
    what: str = "an RLlib policy",
    source: str = "a trial of",
) -> str:
    return record(
        model_version_key(server, model_name, version),
        name=f"{model_name} v{version}",
        description=f"MLflow model version {model_name} v{version} ({what}), registered "
        f"from {source} {experiment_path}.",
        by="mlflow",
        deps=[experiment_key(experiment_path)],
        metadata=metadata,
        url=model_version_url(server, model_name, version),
    )


def record_serving(
    cluster: RayCluster,
    server: MLflowServer,
    model_name: str,
    version: str,
    *,
    app: str,
    route: str,
    metadata: dict[str, Any],
) -> list[str]:
    """The version's Serve app (depends on the model version) and the route now serving it
    (depends on the app)."""
    url = f"{cluster.serve_url}/{route}"
    app_key = record(
        serve_app_key(cluster, app),
        name=f"Serve app {app}",
        description=f"Ray Serve application serving {model_name} v{version}.",
        by="ray-serve",
        deps=[model_version_key(server, model_name, version)],
        metadata={**metadata, "model_version": version, "app": app},
    )
    route_key = record(
        serve_route_key(cluster, route),
        name=f"Serve route /{route}",
        description=f"The stable route {url}; answers carry X-Model-Version.",
        by="ray-serve",
        deps=[app_key],
        metadata={**metadata, "model_version": version, "app": app, "url": url},
        url=url,
    )
    return [app_key, route_key]
