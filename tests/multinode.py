"""A real second Ray node beside the session's head (deployments.worker_node), for tests that
place work on it through its custom resource (WORKER_RESOURCE), not by luck."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from deployments.testing.stack import Stack
from deployments.worker_node import WORKER_RESOURCE, WorkerNode, join

__all__ = ["WORKER_CPUS", "WORKER_RESOURCE", "second_node"]

WORKER_CPUS = 2


@contextlib.contextmanager
def second_node(stack: Stack, name: str = "w2") -> Iterator[WorkerNode]:
    """A worker node of WORKER_CPUS CPUs (and as many WORKER_RESOURCE) joined to the stack's
    head, stopped by pid when the block ends; `name` is its state folder (short: Ray's unix
    sockets live under it)."""
    with join(
        stack.ray_address,
        stack.ray_dashboard_url,
        stack.state_dir / "ray_auth_token",
        stack.state_dir / name,
        cpus=WORKER_CPUS,
    ) as node:
        yield node
