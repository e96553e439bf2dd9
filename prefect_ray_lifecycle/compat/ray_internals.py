"""Every private Ray name the project relies on, and nothing else.

Each function says what it relies on and the Ray version it was checked against; an upgrade
that removes one fails tests/test_compat.py, naming the symbol (`SYMBOLS` lists them all).
Imports nothing from Prefect: Serve replicas, the router and the LLM venv load it, and the
task runner's worker setup hook imports it in every worker of a job. Ray loads lazily.

Checked against Ray 2.60.0.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from prefect_ray_lifecycle.compat import Symbol

__all__ = [
    "SYMBOLS",
    "actor_class",
    "built_deployments",
    "dashboard_url",
    "forget_serve_client",
    "internal_kv_del",
    "internal_kv_put",
    "is_script_mode",
    "is_worker_mode",
    "job_placement_groups",
    "quiet_train_report_logs",
    "refresh_auth_token",
    "remote_function_name",
    "reset_tune_registry_prefix",
    "serve_app_configs",
    "serve_client",
    "serve_client_if_running",
    "stdstream_handler",
    "task_attempt_number",
    "task_option_names",
    "train_controller_env",
    "train_preemption_fallback_deadline_s",
    "wrap_remote_submit",
]

# Every private name used below: tests/test_compat.py resolves each one and fails naming it
# when an upgrade removed or moved it.
SYMBOLS: tuple[Symbol, ...] = (
    Symbol("ray._private.worker", "global_worker"),
    Symbol("ray.actor", "ActorHandle._ray_actor_creation_function_descriptor", instance=True),
    Symbol("ray._private.worker", "Worker.mode", instance=True),
    Symbol("ray._private.worker", "Worker.core_worker", instance=True),
    Symbol("ray._raylet", "CoreWorker.get_current_task_attempt_number"),
    Symbol("ray._private.worker", "WORKER_MODE"),
    Symbol("ray._private.worker", "SCRIPT_MODE"),
    Symbol("ray._private.worker", "get_dashboard_url"),
    Symbol("ray._private.ray_logging", "global_worker_stdstream_dispatcher.add_handler"),
    Symbol("ray._private.ray_logging", "global_worker_stdstream_dispatcher.remove_handler"),
    Symbol("ray._common.ray_option_utils", "task_options"),
    Symbol("ray._raylet", "Config.initialize"),
    Symbol("ray._raylet", "AuthenticationTokenLoader.instance"),
    Symbol("ray._raylet", "AuthenticationTokenLoader.reset_cache"),
    Symbol("ray.experimental.internal_kv", "_internal_kv_put"),
    Symbol("ray.experimental.internal_kv", "_internal_kv_del"),
    Symbol("ray.remote_function", "RemoteFunction._remote"),
    Symbol("ray.remote_function", "RemoteFunction._function_descriptor", instance=True),
    Symbol("ray.remote_function", "RemoteFunction._function_name", instance=True),
    Symbol("ray.serve.context", "_connect"),
    Symbol("ray.serve.context", "_disconnect"),
    Symbol("ray.serve.context", "_get_global_client"),
    Symbol("ray.serve._private.client", "ServeControllerClient._controller", instance=True),
    Symbol("ray.serve._private.client", "ServeControllerClient.shutdown_cached_handles"),
    Symbol("ray.tune.registry", "_global_registry"),
    Symbol("ray.tune.registry", "_Registry._prefix", instance=True),
    Symbol("ray.train.v2._internal.constants", "HEALTH_CHECK_INTERVAL_S_ENV_VAR"),
    Symbol("ray.train.v2._internal.constants", "PREEMPTION_POLL_INTERVAL_S_ENV_VAR"),
    Symbol("ray.train.v2._internal.constants", "ENV_VARS_TO_PROPAGATE"),
    Symbol("ray.train.v2._internal.constants", "DEFAULT_PREEMPTION_DEADLINE_S"),
    Symbol("ray.train.v2._internal.execution.context", "logger"),
    Symbol("ray._common.utils", "import_attr"),
    Symbol("ray.serve._private.api", "call_user_app_builder_with_args_if_necessary"),
    Symbol("ray.serve._private.build_app", "build_app"),
)

SUBMIT_WRAPPED = "_prl_wraps_submit"  # marks our wrapper on RemoteFunction._remote


def _module(name: str) -> Any:
    """A Ray submodule, with Ray itself imported first: importing a private submodule before
    the package can run into a half-initialised `ray` (seen with ray._common.ray_option_utils)."""
    import ray  # noqa: F401

    return importlib.import_module(name)


def _global_worker() -> Any:
    return _module("ray._private.worker").global_worker


def task_attempt_number() -> int:
    """Which attempt of the running Ray task this is (0 first; a re-run after a system failure
    counts up). Relies on `global_worker.core_worker.get_current_task_attempt_number()`."""
    return _global_worker().core_worker.get_current_task_attempt_number()


def is_worker_mode() -> bool:
    """This process is a Ray worker (not a driver, nor a Ray Client). Relies on
    `ray._private.worker.global_worker.mode` and `WORKER_MODE`."""
    worker = _module("ray._private.worker")
    return worker.global_worker.mode == worker.WORKER_MODE


def is_script_mode() -> bool:
    """This process is a driver connected by GCS address (it gets the cluster's log stream;
    a Ray Client process does not). Relies on `global_worker.mode` and `SCRIPT_MODE`."""
    worker = _module("ray._private.worker")
    return worker.global_worker.mode == worker.SCRIPT_MODE


def dashboard_url() -> str | None:
    """The dashboard URL Ray reports for this connection. Relies on
    `ray._private.worker.get_dashboard_url()`."""
    return _module("ray._private.worker").get_dashboard_url()


def stdstream_handler(name: str, handler: Callable[[dict[str, Any]], None] | None) -> None:
    """Add (or with None remove) a handler of the stdout/stderr lines Ray forwards from
    workers to this driver. Relies on `ray._private.ray_logging.
    global_worker_stdstream_dispatcher.add_handler/remove_handler(name[, handler])`."""
    dispatcher = _module("ray._private.ray_logging")
    dispatcher = dispatcher.global_worker_stdstream_dispatcher
    if handler is None:
        dispatcher.remove_handler(name)
    else:
        dispatcher.add_handler(name, handler)


def task_option_names() -> frozenset[str]:
    """Every option `ray.remote` takes for a task. Relies on
    `ray._common.ray_option_utils.task_options` (a dict keyed by option name)."""
    return frozenset(_module("ray._common.ray_option_utils").task_options)


def refresh_auth_token() -> None:
    """Make this process read Ray's token settings again (Ray caches its auth mode and token
    at first use), the way Ray does when it turns token auth on. Relies on
    `ray._raylet.Config.initialize("")` and `AuthenticationTokenLoader.instance().
    reset_cache()`."""
    raylet = _module("ray._raylet")
    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()


def internal_kv_put(key: str, value: bytes, namespace: str) -> None:
    """Put into the cluster's KV store (no public API). Relies on
    `ray.experimental.internal_kv._internal_kv_put(key, value, namespace=)`."""
    kv = _module("ray.experimental.internal_kv")
    kv._internal_kv_put(key, value, namespace=namespace)


def internal_kv_del(key: str, namespace: str) -> bool:
    """Delete from the cluster's KV store; whether the key was there. Relies on
    `ray.experimental.internal_kv._internal_kv_del(key, namespace=)` returning the count."""
    kv = _module("ray.experimental.internal_kv")
    return bool(kv._internal_kv_del(key, namespace=namespace))


def wrap_remote_submit(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace `RemoteFunction._remote` (what `.remote()` and `.options().remote()` of every
    Ray task call) by `wrap(original)`, once per process; False when already wrapped. Relies
    on `ray.remote_function.RemoteFunction._remote(self, args, kwargs, **options)`."""
    remote_function = _module("ray.remote_function").RemoteFunction
    if getattr(remote_function._remote, SUBMIT_WRAPPED, False):
        return False
    wrapped = functools.wraps(remote_function._remote)(wrap(remote_function._remote))
    setattr(wrapped, SUBMIT_WRAPPED, True)
    remote_function._remote = wrapped
    return True


def remote_function_name(remote_function: Any) -> str:
    """The plain name of the function a RemoteFunction runs. Relies on its
    `_function_descriptor.function_name`, else `_function_name` (module-qualified)."""
    name = getattr(remote_function._function_descriptor, "function_name", "") or (
        remote_function._function_name
    )
    return name.rsplit(".", 1)[-1]


def serve_client() -> Any:
    """This driver's Serve controller client, connecting to a running Serve. Relies on
    `ray.serve.context._connect()`."""
    return _module("ray.serve.context")._connect()


def actor_class(handle: Any) -> str | None:
    """`module.Class` of the class an actor was created from, read from its handle (a handle
    of a named actor another layout created carries its methods' signatures only when this
    process can import that class); None where the handle does not say (Ray Client's
    handles). Relies on the handle's `_ray_actor_creation_function_descriptor`
    (module_name, class_name)."""
    descriptor = getattr(handle, "_ray_actor_creation_function_descriptor", None)
    if descriptor is None:
        return None
    return f"{descriptor.module_name}.{descriptor.class_name}"


def serve_client_if_running() -> Any:
    """The Serve client this process already has, or None. Relies on
    `ray.serve.context._get_global_client(raise_if_no_controller_running=False)`."""
    context = _module("ray.serve.context")
    return context._get_global_client(raise_if_no_controller_running=False)


def serve_app_configs() -> dict[str, Any]:
    """Every declaratively deployed app's config by name, as Serve's controller keeps them
    (what `serve deploy` would send back). Relies on the client's `_controller` actor handle
    and its `get_app_configs()` method."""
    import ray

    return ray.get(serve_client()._controller.get_app_configs.remote())


def built_deployments(app_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each deployment of a declarative app entry ({name, import_path, args, ...}) as Serve's
    controller builds it (`build_serve_application`: the import path's builder called with the
    args, then `build_app`), by deployment name, in the schema `serve build` writes
    (ray_actor_options, replicas or autoscaling, health checks). Needs no Ray: what a replica
    would be placed with, read without a cluster. Relies on `ray._common.utils.import_attr`,
    `ray.serve._private.api.call_user_app_builder_with_args_if_necessary` and
    `ray.serve._private.build_app.build_app`."""
    from ray.serve.deployment import deployment_to_schema

    builder = _module("ray._common.utils").import_attr(app_config["import_path"])
    api = _module("ray.serve._private.api")
    app = api.call_user_app_builder_with_args_if_necessary(builder, app_config.get("args"))
    built = _module("ray.serve._private.build_app").build_app(app, name=app_config["name"])
    return {
        deployment.name: deployment_to_schema(deployment).model_dump(exclude_unset=True)
        for deployment in built.deployments
    }


def forget_serve_client() -> None:
    """Shut this driver's cached Serve handles down and forget the controller: after
    ray.shutdown a live handle's metrics push would start a new local Ray in this process.
    Relies on `_get_global_client(...).shutdown_cached_handles()` and
    `ray.serve.context._disconnect()`."""
    context = _module("ray.serve.context")
    client = context._get_global_client(raise_if_no_controller_running=False)
    if client is not None:
        client.shutdown_cached_handles()
    context._disconnect()


def reset_tune_registry_prefix() -> None:
    """Forget the job id Tune's registry cached as its key prefix at first use in this
    process: after a second ray.init (a new job) it would register an env where that job's
    workers never look ("Environment ... doesn't exist"). Relies on
    `ray.tune.registry._global_registry._prefix`."""
    _module("ray.tune.registry")._global_registry._prefix = None


def train_controller_env(health_check_s: float, preemption_poll_s: float) -> dict[str, str]:
    """Environment variables that set how often a Ray Train V2 controller polls its workers
    and how often its preemption watcher polls for drained nodes; set them in the driver's
    environment before `fit()`, which hands them to the controller and its workers. Relies on
    `ray.train.v2._internal.constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR` (default 2 s) and
    `PREEMPTION_POLL_INTERVAL_S_ENV_VAR` (default 5 s), both in `ENV_VARS_TO_PROPAGATE`.
    Checked against Ray 2.60.0: each worker holds one unread `ray.train.report` (a queue of
    size 1 the controller drains once per poll), so a loop reporting faster than the poll
    interval waits for it."""
    constants = _module("ray.train.v2._internal.constants")
    names = (
        constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR,
        constants.PREEMPTION_POLL_INTERVAL_S_ENV_VAR,
    )
    if not set(names) <= constants.ENV_VARS_TO_PROPAGATE:
        raise RuntimeError(f"Ray Train no longer hands {names} to its controller")
    return {names[0]: f"{health_check_s:g}", names[1]: f"{preemption_poll_s:g}"}


def train_preemption_fallback_deadline_s() -> float:
    """How long after a preemption is first seen Ray Train restarts the run when the drain
    gave no deadline. Relies on `ray.train.v2._internal.constants.
    DEFAULT_PREEMPTION_DEADLINE_S` (120 s in Ray 2.60.0), which the controller's
    `_is_preemption_deadline_exceeded` uses."""
    return float(_module("ray.train.v2._internal.constants").DEFAULT_PREEMPTION_DEADLINE_S)


def job_placement_groups() -> dict[str, dict[str, Any]]:
    """The connected job's placement groups that are not removed, by id (hex), as
    `ray.util.placement_group_table()` describes them. Relies on Ray's id layout: a group's id
    ends with the id of the job that created it (`PlacementGroupID.of(job_id)`; checked
    against Ray 2.60.0, where the table names no creator)."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    return {
        group_id: info
        for group_id, info in ray.util.placement_group_table().items()
        if group_id.endswith(job) and info["state"] != "REMOVED"
    }


def quiet_train_report_logs() -> None:
    """Keep a Ray Train worker from logging one INFO line per `ray.train.report` ("Reporting
    training result ..."). Relies on `ray.train.v2._internal.execution.context.logger`, which
    Ray 2.60.0 names by its file path (`logging.getLogger(__file__)`), not `ray.train...`: it
    escapes the `ray.train` logger that RunConfig's LoggingConfig(log_level) filters, and
    reaches the worker's root console handler."""
    import logging

    logging.getLogger(_module("ray.train.v2._internal.execution.context").logger.name).setLevel(
        logging.WARNING
    )
