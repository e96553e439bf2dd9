"""The MLflowWebhook block: the shared secret of MLflow's registry webhook, where MLflow
delivers, and what it subscribes to. The receiver verifies deliveries with it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from urllib.parse import urlparse

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

# What the reconcile trigger needs (aliases) and what a version's arrival tells (created).
DEFAULT_EVENTS = (
    "model_version_alias.created",
    "model_version_alias.deleted",
    "model_version.created",
)
SIGNATURE_VERSION = "v1"  # MLflow's X-MLflow-Signature is "v1,<base64 HMAC-SHA256>"
_EVENT = re.compile(r"[a-z_]+\.[a-z_]+")
_WEBHOOK_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


class MLflowWebhook(Block):
    """MLflow's registry webhook to this project's receiver: its URL, events and HMAC secret."""

    _block_type_name = "MLflow Webhook"
    _block_type_slug = "mlflow-webhook"
    _description = (
        "MLflow's model-registry webhook: the HMAC secret MLflow signs deliveries with, the "
        "receiver URL MLflow calls, the events subscribed and the timestamp tolerance."
    )
    _documentation_url = "https://mlflow.org/docs/latest/ml/webhooks"
    _code_example = """
        from prefect_ray_lifecycle.blocks import MLflowWebhook

        webhook = MLflowWebhook.load("BLOCK_NAME")
        webhook.verify(signature, delivery_id, timestamp, body)  # MLflow's X-MLflow-* headers
    """

    secret: SecretStr = Field(
        description=(
            "Shared HMAC-SHA256 secret: MLflow signs every delivery with it and the receiver "
            "verifies the signature. Never logged."
        ),
    )
    url: str = Field(
        default="http://127.0.0.1:4210/mlflow",
        description=(
            "The receiver's URL as MLflow calls it (POST). MLflow accepts https to a public "
            "address by default; http or a private address needs its local-only settings."
        ),
    )
    webhook_name: str = Field(
        default="prefect-ray-lifecycle",
        description="Name of the webhook in MLflow; `deployments.setup` keeps exactly one.",
    )
    max_age_s: int = Field(
        default=300,
        ge=10,
        le=3600,
        description=(
            "Deliveries whose X-MLflow-Timestamp is further than this from the receiver's "
            "clock are rejected; delivery ids are remembered for twice as long (replays)."
        ),
    )
    events: list[str] = Field(
        default_factory=lambda: list(DEFAULT_EVENTS),
        min_length=1,
        description="MLflow events the webhook subscribes to, as 'entity.action'.",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        url = value.strip()
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"url {value!r} is not an http(s) URL with a host")
        return url

    @field_validator("webhook_name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _WEBHOOK_NAME.fullmatch(value):
            raise ValueError(
                f"webhook_name {value!r}: letters, digits, '.', '_' and '-', at most 63 "
                f"characters, starting and ending with a letter or digit"
            )
        return value

    @field_validator("events")
    @classmethod
    def _check_events(cls, value: list[str]) -> list[str]:
        bad = [event for event in value if not _EVENT.fullmatch(event)]
        if bad:
            raise ValueError(f"events {bad!r} are not MLflow events ('entity.action')")
        return list(dict.fromkeys(value))

    def signature(self, delivery_id: str, timestamp: str, body: bytes) -> str:
        """The X-MLflow-Signature MLflow sends for this delivery (mlflow.webhooks.delivery)."""
        signed = f"{delivery_id}.{timestamp}.".encode() + body
        digest = hmac.new(self.secret.get_secret_value().encode(), signed, hashlib.sha256)
        return f"{SIGNATURE_VERSION},{base64.b64encode(digest.digest()).decode()}"

    def verify(self, signature: str, delivery_id: str, timestamp: str, body: bytes) -> bool:
        """Whether `signature` is this delivery's, compared in constant time."""
        expected = self.signature(delivery_id, timestamp, body)
        return hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace"))
