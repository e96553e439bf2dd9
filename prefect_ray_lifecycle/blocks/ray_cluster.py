"""The RayCluster block: where Ray work runs, and how this process connects to it."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

from prefect_ray_lifecycle.compat import ray_internals
from prefect_ray_lifecycle.control.ray_shutdown import shutdown_in_background, wait_for_shutdown
from prefect_ray_lifecycle.control.shipping import DRIVER_SIDE, RAY_SIDE, package_part
from prefect_ray_lifecycle.workloads.constants import (
    GCS_PORT_WAIT_ENV,
    GCS_PORT_WAIT_S,
    PROJECT_NAMESPACE,
)

# Never shipped with the project's packages or a runtime_env working_dir (more may be added).
PACKAGE_EXCLUDES = ("__pycache__", "*.pyc")
LOCAL_HOST = "127.0.0.1"
T = TypeVar("T")

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


def _valid_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            return ipaddress.ip_address(host).version == 6
        except ValueError:
            return False
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return bool(_HOSTNAME.match(host))


def parse_address(value: str) -> str:
    """Validate a Ray address; return it stripped. Raises ValueError naming the value."""
    address = value.strip()
    if address in ("", "auto"):
        return address
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if (
        not sep
        or not host
        or not port.isdigit()
        or not 0 < int(port) < 65536
        or not _valid_host(host)
    ):
        raise ValueError(
            f"address {value!r} is not a Ray address: use '' (embedded local Ray), 'auto', "
            f"'host:port' (a `ray start --head` GCS address) or 'ray://host:port' (Ray Client)"
        )
    return address


CLIENT_SERVER_FAILED = "Starting Ray client server failed"
# Ray 2.60's proxier, when the server process it just started for this connection is already
# gone: `psutil.ZombieProcess` from `start_specific_server` (seen on a busy 2-core head).
CLIENT_SERVER_GONE = "start_specific_server"
CLIENT_RETRY_PAUSE_S = 1.0  # doubled after each failed start
CLIENT_ATTEMPTS = 4


def client_server_failed(error: BaseException) -> bool:
    """Ray Client's head could not start this connection's own server process (seen on a
    busy head); a later attempt gets a fresh one."""
    message = str(error)
    return isinstance(error, ConnectionAbortedError) and (
        CLIENT_SERVER_FAILED in message or CLIENT_SERVER_GONE in message
    )


def retry_client_start(connect: Callable[[], T], address: str, reset: Callable[[], None]) -> T:
    """`connect()`; through Ray Client (ray://), tried again with backoff (after `reset()`)
    while the head fails to start the connection's server, up to CLIENT_ATTEMPTS in all.
    The last failure says what the head's client server log says, where this machine can
    read it (a head on this machine), else where that log is."""
    pause = CLIENT_RETRY_PAUSE_S
    for attempt in range(1, CLIENT_ATTEMPTS + 1):
        try:
            return connect()
        except ConnectionAbortedError as error:
            if not address.startswith("ray://") or not client_server_failed(error):
                raise
            if attempt == CLIENT_ATTEMPTS:
                raise ConnectionAbortedError(
                    f"Ray Client at {address} failed to start this connection's server "
                    f"{attempt} times: {_client_server_log(str(error))}"
                ) from error
            logging.getLogger(__name__).warning(
                "Ray Client at %s could not start this connection's server (attempt %d of "
                "%d); trying again in %.0f s",
                address,
                attempt,
                CLIENT_ATTEMPTS,
                pause,
            )
            reset()
            time.sleep(pause)
            pause *= 2
    raise AssertionError("unreachable")


def _client_server_log(message: str, lines: int = 20) -> str:
    """The tail of the client server log Ray's message names, read from this machine's Ray
    sessions when the head is here; else the message and where that log lives."""
    named = re.search(r"ray_client_server_\d+\.err", message)
    if named is None:
        return message
    roots = {os.environ.get("RAY_TMPDIR", ""), "/tmp/ray"} - {""}
    found = [
        path
        for root in roots
        for path in Path(root).glob(f"session_*/logs/{named.group(0)}")
        if path.is_file()
    ]
    if not found:
        return f"{message} (on the head: <its Ray session>/logs/{named.group(0)})"
    newest = max(found, key=lambda path: path.stat().st_mtime)
    tail = newest.read_text(errors="replace").splitlines()[-lines:]
    return f"{newest} says:\n" + "\n".join(tail)


def _forget_serve_handles() -> None:
    """Before leaving Ray: shut this driver's cached Serve handles down and forget the
    controller. A live DeploymentHandle pushes metrics every few seconds; after
    ray.shutdown that push would start a new local Ray in this process (Ray 2.60)."""
    if "ray.serve" not in sys.modules:
        return
    from prefect_ray_lifecycle.control import serve_control

    # Ours too: a handle kept past this connection is bound to its core worker, and the
    # next connection's calls through it never reach a replica ("Timed out resolving to
    # ObjectRef"): a rollout after `with cluster.connect(): serve_control.wait_router(...)`
    # in one process waited 60 s for every router status and failed its canary.
    serve_control.release()
    try:
        ray_internals.forget_serve_client()
    except Exception:  # never mask what the block's user was doing
        pass


class RayCluster(Block):
    """A Ray cluster that flows run on: an embedded local Ray, or an existing cluster by address.

    Connecting through this block ships the project's packages to the cluster; the task
    runner built from it (ray_runner.RayClusterTaskRunner) carries the Prefect API settings
    into every Ray worker, so task runs on Ray are recorded in the same Prefect API as their
    flow run.
    """

    _block_type_name = "Ray Cluster"
    _block_type_slug = "ray-cluster"
    _documentation_url = "https://docs.ray.io/en/latest/cluster/getting-started.html"
    _code_example = """
    from prefect import flow

    from prefect_ray_lifecycle.blocks import RayCluster
    from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner

    ray_cluster = RayCluster.load("BLOCK_NAME")

    @flow(task_runner=RayClusterTaskRunner(ray_cluster))
    def on_ray(): ...
    """
    _description = (
        "Where Ray work runs: an embedded local Ray (empty address) or an existing "
        "cluster ('auto', 'host:port', 'ray://host:port')."
    )

    address: str = Field(
        default="",
        description=(
            "Ray address. Empty: start an embedded local Ray for the flow run (its "
            "dashboard on 127.0.0.1). 'auto': the cluster this machine belongs to. "
            "'host:port': the GCS address of a `ray start --head` cluster. "
            "'ray://host:port': Ray Client."
        ),
    )
    namespace: str = Field(
        default=PROJECT_NAMESPACE,
        min_length=1,
        description="Ray namespace for the job, its named actors and Serve applications.",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Extra Ray runtime_env merged over the project's own (its py_modules are "
            "kept; env_vars and excludes are merged; other keys are added). Ship your own "
            "code (env creators, transforms) with 'working_dir' (a local folder or a URI) "
            "or 'py_modules'."
        ),
    )
    num_cpus: int | None = Field(
        default=None,
        ge=1,
        description="CPUs for the embedded local Ray; ignored when an address is set.",
    )
    auth_token: SecretStr | None = Field(
        default=None,
        description=(
            "Token of a cluster that runs Ray's token authentication (RAY_AUTH_MODE="
            "token, the default for new clusters in Ray 2.60). Empty: Ray's own lookup "
            "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)."
        ),
    )
    dashboard_url: str | None = Field(
        default=None,
        description=(
            "Ray dashboard URL to link from flow runs; found from the connection when empty."
        ),
    )

    serve_host: str = Field(
        default=LOCAL_HOST,
        description=(
            "Host the Serve HTTP proxy binds when this project starts Serve (loopback by default)."
        ),
    )
    serve_port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description="Port of the Serve HTTP proxy; routes are served at http://host:port/<route>.",
    )

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        return parse_address(value)

    @field_validator("runtime_env")
    @classmethod
    def _check_runtime_env(cls, value: dict[str, Any]) -> dict[str, Any]:
        env_vars = value.get("env_vars", {})
        if not isinstance(env_vars, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
        ):
            raise ValueError(f"runtime_env.env_vars must map strings to strings, got {env_vars!r}")
        py_modules = value.get("py_modules", [])
        if not isinstance(py_modules, list):
            raise ValueError(f"runtime_env.py_modules must be a list, got {py_modules!r}")
        excludes = value.get("excludes", [])
        if not isinstance(excludes, list) or not all(isinstance(e, str) for e in excludes):
            raise ValueError(f"runtime_env.excludes must be a list of patterns, got {excludes!r}")
        working_dir = value.get("working_dir")
        if working_dir is not None:
            # A local folder (or .zip) is uploaded from this machine at connect; a URI is
            # fetched by every node itself.
            if not isinstance(working_dir, str) or not working_dir:
                raise ValueError(
                    f"runtime_env.working_dir must be a path or URI, got {working_dir!r}"
                )
            local = Path(working_dir).expanduser()
            if "://" not in working_dir and not (local.is_dir() or local.suffix == ".zip"):
                raise ValueError(
                    f"runtime_env.working_dir {working_dir!r} is neither a folder on this "
                    f"machine nor a .zip or URI"
                )
        return value

    @property
    def serve_url(self) -> str:
        host = LOCAL_HOST if self.serve_host in ("0.0.0.0", "::") else self.serve_host
        return f"http://{host}:{self.serve_port}"

    @property
    def is_embedded(self) -> bool:
        return self.address == ""

    @property
    def ray_init_address(self) -> str:
        # "local" always starts a new local Ray, whatever RAY_ADDRESS says.
        return self.address or "local"

    def project_runtime_env(self) -> dict[str, Any]:
        """The runtime_env for jobs started through this block: the project's package plus
        extras. The package ships in two parts (control.shipping), so a separate cluster can
        import what the flow process pickles by reference, and Serve apps take the Ray side
        alone."""
        extra = dict(self.runtime_env)
        py_modules = [str(package_part(RAY_SIDE)), str(package_part(DRIVER_SIDE))]
        py_modules += [m for m in extra.pop("py_modules", []) if m not in py_modules]
        env_vars = {"RAY_USAGE_STATS_ENABLED": "0", **extra.pop("env_vars", {})}
        excludes = [*PACKAGE_EXCLUDES, *extra.pop("excludes", [])]
        return {"py_modules": py_modules, "env_vars": env_vars, "excludes": excludes, **extra}

    def init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `ray.init` (the address is passed separately)."""
        kwargs: dict[str, Any] = {
            "namespace": self.namespace,
            "runtime_env": self.project_runtime_env(),
            "log_to_driver": True,
        }
        if self.is_embedded:
            os.environ.setdefault(GCS_PORT_WAIT_ENV, GCS_PORT_WAIT_S)
            # Ray maps a loopback node IP to the machine's own, so only the dashboard can be
            # held to 127.0.0.1; core ports rely on Ray's token auth (default in 2.60).
            kwargs.update(dashboard_host=LOCAL_HOST, include_dashboard=True)
            if self.num_cpus:
                kwargs["num_cpus"] = self.num_cpus
        return kwargs

    @contextlib.contextmanager
    def connect(
        self,
        *,
        job_config: Any = None,
        setup_hook: Any = None,
        stop_in_background: bool = False,
    ) -> Iterator[Any]:
        """Connect this process to the cluster for the block's lifetime: the one way the
        project joins Ray (flows, the data task and the task runner alike). Shuts down only
        what it started. Yields the Ray context, or None when Ray was already initialised here
        (a parent flow's connection, used as it is).

        job_config: the Ray JobConfig of the job (e.g. the flow run id in its metadata).
        setup_hook: a worker_process_setup_hook every worker of the job runs at start.
        Ray Client (ray://) takes neither: it sends ray.init's arguments as JSON.
        stop_in_background: stop Ray off the critical path at the end (control.ray_shutdown):
        what follows (publishing, ending the run) need not wait for it."""
        import ray

        wait_for_shutdown()  # a connection still stopping in the background is not one
        if ray.is_initialized():
            yield None
            return
        self.export_auth_token()
        kwargs = self.init_kwargs()
        if not self.address.startswith("ray://"):
            if job_config is not None:
                kwargs["job_config"] = job_config
            if setup_hook is not None:
                kwargs["runtime_env"]["worker_process_setup_hook"] = setup_hook
        context = retry_client_start(
            lambda: ray.init(self.ray_init_address, **kwargs), self.address, ray.shutdown
        )
        try:
            yield context
        finally:
            _forget_serve_handles()
            if stop_in_background:
                shutdown_in_background()
            else:
                ray.shutdown()

    def wait_reachable(self, timeout_s: float, every_s: float = 2.0) -> float:
        """Wait until the cluster's address takes connections (a head that is restarting);
        the seconds waited. Raises ConnectionError naming the address after `timeout_s`.
        Nothing to wait for with an embedded Ray or 'auto'."""
        import socket

        if self.address in ("", "auto"):
            return 0.0
        host, _, port = self.address.removeprefix("ray://").rpartition(":")
        host = host.strip("[]")
        started = time.monotonic()
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=every_s):
                    return time.monotonic() - started
            except OSError as error:
                if time.monotonic() - started >= timeout_s:
                    raise ConnectionError(
                        f"Ray at {self.address} took no connection for {timeout_s:.0f} s: {error}"
                    ) from None
            time.sleep(every_s)

    def export_auth_token(self) -> None:
        """Ray reads its token from the environment only; this process then carries it."""
        if self.auth_token is None:
            return
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = self.auth_token.get_secret_value()
        if "ray" in sys.modules:
            # Ray caches its auth mode and token at first use in a process.
            with contextlib.suppress(ImportError, AttributeError):
                ray_internals.refresh_auth_token()
