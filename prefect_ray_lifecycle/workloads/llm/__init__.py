"""An OpenAI-compatible LLM app on Ray Serve with vLLM as the engine."""

from prefect_ray_lifecycle.workloads.llm.app import (
    IMPORT_PATH,
    build_llm_app,
    deploy_llm_app,
    llm_app_config,
)
from prefect_ray_lifecycle.workloads.llm.config import (
    AutoscalingSettings,
    EngineSettings,
    LLMAppArgs,
    MLflowModelSource,
)
from prefect_ray_lifecycle.workloads.llm.server import LLMServer

__all__ = [
    "IMPORT_PATH",
    "AutoscalingSettings",
    "EngineSettings",
    "LLMAppArgs",
    "LLMServer",
    "MLflowModelSource",
    "build_llm_app",
    "deploy_llm_app",
    "llm_app_config",
]
