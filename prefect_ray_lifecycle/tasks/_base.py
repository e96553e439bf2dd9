"""What the task packages share: the task decorator for MLflow calls, which retries only what
can succeed on retry (MLflow unreachable), never a user error."""

from __future__ import annotations

import requests
from mlflow.exceptions import MlflowException
from prefect import task

__all__ = ["MLFLOW_RETRIES", "MLFLOW_RETRY_DELAYS", "is_connection_error", "mlflow_task"]

# Two minutes in all: an MLflow server restarting on a busy machine took longer than the 30 s
# that [2, 4, 8, 16] gave (the outage test failed so: every retry used up before it answered).
MLFLOW_RETRY_DELAYS = [2, 4, 8, 16, 30, 60]
MLFLOW_RETRIES = len(MLFLOW_RETRY_DELAYS)
_CONNECTION_MARKERS = (
    "Max retries exceeded",
    "Connection refused",
    "Connection aborted",
    "Failed to establish a new connection",
    "Read timed out",
)


def is_connection_error(error: BaseException) -> bool:
    """True when MLflow could not be reached (worth a retry); False for a user error."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (requests.ConnectionError, requests.Timeout, ConnectionError)):
            return True
        if isinstance(current, MlflowException) and any(
            marker in str(current) for marker in _CONNECTION_MARKERS
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def _retry_on_connection_error(task, task_run, state) -> bool:
    try:
        state.result()
    except Exception as error:  # the task's own exception, re-raised by result()
        return is_connection_error(error)
    return False


mlflow_task = task(
    retries=MLFLOW_RETRIES,
    retry_delay_seconds=MLFLOW_RETRY_DELAYS,
    retry_condition_fn=_retry_on_connection_error,
)
