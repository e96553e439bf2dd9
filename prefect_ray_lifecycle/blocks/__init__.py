"""Prefect Blocks: connections and secrets only.

Register them with `prefect block register -m prefect_ray_lifecycle.blocks`.
"""

from prefect_ray_lifecycle.blocks.mlflow_server import MLflowServer
from prefect_ray_lifecycle.blocks.mlflow_webhook import MLflowWebhook
from prefect_ray_lifecycle.blocks.ray_cluster import RayCluster

__all__ = ["MLflowServer", "MLflowWebhook", "RayCluster"]
