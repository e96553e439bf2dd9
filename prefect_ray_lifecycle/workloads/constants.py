"""Facts shared across the project, each defined once.

Imports nothing heavy: Serve replicas, Ray workers, the flow process and the LLM venv all
load it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "CANARY_HEADER",
    "CANARY_TOKEN_HEADER",
    "FALLBACK_HEADER",
    "LLM_DEPLOYMENT",
    "LLM_PYTHON_ENV",
    "LLM_VENV_PYTHON",
    "POLICY_DEPLOYMENT",
    "PROJECT_NAMESPACE",
    "PROJECT_ROOT",
    "REQUEST_ID_HEADER",
    "ROUTER_DEPLOYMENT",
    "SERVE_NAMESPACE",
    "SESSION_HEADER",
    "SHADOW_KEY",
    "VERSION_HEADER",
    "llm_python",
]

# The checkout this module was loaded from (in a Ray worker: its copy of the shipped package).
PROJECT_ROOT = Path(__file__).resolve().parents[2]
# The Ray namespace of the project's jobs and named actors; Serve keeps its own.
PROJECT_NAMESPACE = "prefect-ray-lifecycle"
SERVE_NAMESPACE = "serve"
# A Ray the project starts (embedded, or `deployments.local`'s head) waits 30 s, Ray 2.60's
# default read from this variable in ray/_private/node.py, for its GCS to write its port,
# then fails: on a busy 2-core machine an embedded start ran past it once. Two minutes,
# unless the user set their own.
GCS_PORT_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"
GCS_PORT_WAIT_S = "120"

# Response headers every route answer carries.
VERSION_HEADER = "X-Model-Version"
REQUEST_ID_HEADER = "X-Request-Id"
FALLBACK_HEADER = "X-Fallback-From"
# Request headers a route reads: a session key (a session stays on one version through a
# canary step), and a tester's choice of version while a rollout holds the route.
SESSION_HEADER = "X-Session-Id"
CANARY_HEADER = "X-Canary"
CANARY_TOKEN_HEADER = "X-Canary-Token"
# The router's request dict key that asks a version for what a shadow comparison needs (its
# greedy actions and probabilities, or its completion's token ids), and the answer dict's key
# (outside the body: users never see it) that carries them.
SHADOW_KEY = "shadow"
# The last item of a version's stream to the router when the stream failed after its first
# byte (the user got an error event): the router counts the failure against that version.
STREAM_FAILED_KEY = "stream_failed"

# Serve deployment names inside the apps this project builds.
POLICY_DEPLOYMENT = "PolicyServer"
LLM_DEPLOYMENT = "LLMServer"
ROUTER_DEPLOYMENT = "Router"

# vLLM's fastapi pin keeps it out of the project's venv: LLM replicas run this python.
LLM_PYTHON_ENV = "RLT_LLM_PYTHON"
LLM_VENV_PYTHON = PROJECT_ROOT / ".venv-llm" / "bin" / "python"


def llm_python(explicit: str | None = None) -> str:
    """The LLM venv's python: `explicit`, else $RLT_LLM_PYTHON, else this checkout's."""
    return explicit or os.environ.get(LLM_PYTHON_ENV) or str(LLM_VENV_PYTHON)
