"""The MLflowServer block: tracking and registry URIs, and an optional token."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator, model_validator

if TYPE_CHECKING:
    from mlflow import MlflowClient

_SESSION_ENV = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_HTTP_REQUEST_MAX_RETRIES")
_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "databricks")


def parse_uri(field: str, value: str) -> str:
    """Validate a tracking or registry URI; raises ValueError naming the field and value."""
    uri = value.strip()
    parsed = urlparse(uri)
    if parsed.scheme not in _SCHEMES:
        raise ValueError(
            f"{field} {value!r} is not an MLflow URI: expected one of "
            f"{', '.join(s + '://' for s in _SCHEMES)}"
        )
    if parsed.scheme in ("http", "https"):
        try:
            port = parsed.port
        except ValueError:
            port = -1
        if not parsed.hostname or port == -1:
            raise ValueError(
                f"{field} {value!r} is not an MLflow URI: it needs a host "
                f"(and a valid port, if any), e.g. http://127.0.0.1:5000"
            )
    return uri.rstrip("/")


class MLflowServer(Block):
    """An MLflow tracking and model registry server."""

    _block_type_name = "MLflow Server"
    _block_type_slug = "mlflow-server"
    _description = "An MLflow tracking server and model registry, with an optional token."
    _documentation_url = "https://mlflow.org/docs/latest/"
    _code_example = """
    from prefect_ray_lifecycle.blocks import MLflowServer

    mlflow_server = MLflowServer.load("BLOCK_NAME")
    with mlflow_server.session() as client:  # an MlflowClient, with the block's token
        client.search_registered_models()
    """

    tracking_uri: str = Field(
        default="http://127.0.0.1:5000",
        description="MLflow tracking URI, e.g. http://127.0.0.1:5000 (the local server).",
    )
    registry_uri: str | None = Field(
        default=None,
        description="MLflow model registry URI; the tracking URI when empty.",
    )
    request_retries: int = Field(
        default=2,
        ge=0,
        le=10,
        description=(
            "HTTP retries inside MLflow's client per request (its default, 7, can hang "
            "for minutes); the flows add their own bounded retries on connection "
            "errors on top."
        ),
    )
    token: SecretStr | None = Field(
        default=None,
        description="Bearer token for the server (MLFLOW_TRACKING_TOKEN); never logged.",
    )

    @field_validator("tracking_uri")
    @classmethod
    def _check_tracking(cls, value: str) -> str:
        return parse_uri("tracking_uri", value)

    @field_validator("registry_uri")
    @classmethod
    def _check_registry(cls, value: str | None) -> str | None:
        return None if value in (None, "") else parse_uri("registry_uri", value)

    @model_validator(mode="after")
    def _default_registry(self) -> MLflowServer:
        if self.registry_uri is None:
            self.registry_uri = self.tracking_uri
        return self

    @contextlib.contextmanager
    def session(self) -> Iterator[MlflowClient]:
        """An MlflowClient bound to this server. MLflow reads the token and its retry count
        from the environment per request: both are set for the session, then restored."""
        from mlflow import MlflowClient

        saved_env = {key: os.environ.get(key) for key in _SESSION_ENV}
        if self.token is not None:
            os.environ["MLFLOW_TRACKING_TOKEN"] = self.token.get_secret_value()
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(self.request_retries)
        try:
            yield MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
        finally:
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
