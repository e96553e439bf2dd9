"""An OpenAI-compatible LLM app on Ray Serve with vLLM as the engine."""

from workloads.llm.app import IMPORT_PATH, build_llm_app, deploy_llm_app, llm_app_config
from workloads.llm.config import AutoscalingSettings, EngineSettings, LLMAppArgs, MLflowModelSource
from workloads.llm.server import LLMServer

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
