"""The flow's Prefect API, carried into every Ray worker.

Stock prefect-ray serialises the flow's settings context, but when the flow process uses
Prefect's temporary (ephemeral) server that context holds no API URL: each Ray worker then
starts a temporary server of its own (20+ s) and records its task runs there (upstream
PrefectHQ/prefect#18485). The runner resolves the API URL the flow process really uses and
writes it, with ephemeral mode off, into the context each Ray task hydrates, so a worker that
still cannot reach the API fails loudly instead of silently going elsewhere.
"""

from __future__ import annotations

from typing import Any

import prefect.context
from prefect.context import SettingsContext
from prefect.settings import get_current_settings


class PrefectAPIUnavailable(RuntimeError):
    """The flow process has no Prefect API that Ray workers could reach."""


def prefect_api_url() -> str:
    """The API URL this process's Prefect client uses, starting the temporary server if that
    is what the client would do anyway."""
    settings = get_current_settings()
    if settings.api.url:
        return settings.api.url
    if not settings.server.ephemeral.enabled:
        raise PrefectAPIUnavailable(
            "PREFECT_API_URL is not set and ephemeral mode is off: Ray workers would have no "
            "Prefect API to record task runs in"
        )
    # Imported here: the server's import is heavy and only ephemeral mode needs it.
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return server.api_url


def worker_settings_overrides(api_url: str) -> dict[str, Any]:
    """Settings merged into the context every Ray task hydrates."""
    return {"api": {"url": api_url}, "server": {"ephemeral": {"enabled": False}}}


def deep_merge(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    """`base` with `updates` merged in, nested dicts key by key; neither input is changed."""
    merged = dict(base)
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def adopt_flow_settings(settings: SettingsContext) -> None:
    """In a Ray worker: make the flow's settings this process's global ones. The task engine
    enters them per task, but Prefect's background services (the API log worker, the events
    worker) run in their own thread and read the process-global settings: without this they
    have no API URL, start a temporary server, and the task's logs never reach its task run."""
    if prefect.context.GLOBAL_SETTINGS_CONTEXT is not settings:
        prefect.context.GLOBAL_SETTINGS_CONTEXT = settings


def route_events(settings: SettingsContext) -> None:
    """In a Ray worker: send events to the API of `settings`. Prefect keeps one events worker
    per process and client type, connected to the API current when it started; a worker
    shared by flow runs on two APIs would send the second one's task run states to the first.
    Keyed by the API, each gets its own."""
    from prefect.events.clients import PrefectCloudEventsClient, PrefectEventsClient
    from prefect.events.worker import EventsWorker

    api = settings.settings.api
    if api.url.startswith(settings.settings.cloud.api_url):
        key = api.key.get_secret_value() if api.key else None
        EventsWorker.set_client_override(PrefectCloudEventsClient, api_url=api.url, api_key=key)
    else:
        EventsWorker.set_client_override(PrefectEventsClient, api_url=api.url)
