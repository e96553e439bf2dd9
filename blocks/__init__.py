"""Prefect Blocks: connections and secrets only.

Register them with `prefect block register -m blocks`.
"""

from blocks.mlflow_server import MLflowServer
from blocks.mlflow_webhook import MLflowWebhook
from blocks.ray_cluster import RayCluster

__all__ = ["MLflowServer", "MLflowWebhook", "RayCluster"]
