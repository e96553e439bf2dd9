"""Ray options declared on a Prefect task's function, read by the runner at submit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from prefect_ray_lifecycle.compat import ray_internals

RAY_OPTIONS_ATTRIBUTE = "__ray_options__"

F = TypeVar("F", bound=Callable[..., Any])


def ray_options(**options: Any) -> Callable[[F], F]:
    """Ray resources and options for one Prefect task, on the task itself:

        @task
        @ray_options(num_cpus=2, memory=2 * 1024**3, runtime_env={"env_vars": {"A": "1"}})
        def train(...): ...

    Any `ray.remote` option is accepted (num_cpus, num_gpus, memory, resources, runtime_env,
    scheduling_strategy, ...). prefect-ray's `remote_options` context still wins over these.
    """
    unknown = set(options) - ray_internals.task_option_names()
    if unknown:
        raise ValueError(f"unknown Ray task options: {sorted(unknown)}")
    if "num_returns" in options:
        raise ValueError(
            "num_returns is the task runner's own: a task run's Ray task returns its final "
            "state and its log lines"
        )

    def attach(fn: F) -> F:
        setattr(fn, RAY_OPTIONS_ATTRIBUTE, dict(options))
        return fn

    return attach
