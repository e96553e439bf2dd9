"""The task runner: a prefect-ray RayTaskRunner built from a RayCluster block, and its future.

On top of RayTaskRunner it carries the flow's Prefect API into every Ray worker (settings),
ships each task run's Prefect context once per flow run and keeps it, with an open client, in
each worker (contexts), takes Ray options from the task (options), names Ray work after its
flow and task runs and links the flow run to its Ray job (lineage), posts what Ray tasks log
under their task run (logs), and re-runs a task whose Ray worker crashed as the next attempt
of the same task run (worker).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable
from typing import Any
from uuid import UUID, uuid4

import orjson
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext, SettingsContext
from prefect.exceptions import ObjectNotFound
from prefect.futures import PrefectFuture
from prefect.logging.loggers import get_logger, get_run_logger
from prefect.results import ResultRecord
from prefect.tasks import Task
from prefect.utilities.engine import collect_task_run_inputs_sync
from prefect.utilities.importtools import lazy_import
from prefect_ray.context import RemoteOptionsContext

from prefect_ray_lifecycle.blocks.ray_cluster import RayCluster
from prefect_ray_lifecycle.compat import ray_internals
from prefect_ray_lifecycle.compat.prefect_internals import (
    RayFuture,
    RayRunnerBase,
    flow_run_being_started,
)
from prefect_ray_lifecycle.ray_runner.contexts import ContextShipper
from prefect_ray_lifecycle.ray_runner.lineage import (
    job_config,
    link_flow_run,
    ray_task_name,
)
from prefect_ray_lifecycle.ray_runner.logs import ChildTaskLogs, forward_task_logs, wait_forwarded
from prefect_ray_lifecycle.ray_runner.options import RAY_OPTIONS_ATTRIBUTE
from prefect_ray_lifecycle.ray_runner.settings import prefect_api_url, worker_settings_overrides
from prefect_ray_lifecycle.ray_runner.worker import run_on_ray, worker_setup_hook

# Ray loads on first use (as in prefect-ray): importing a flow module must not pay for it.
ray = lazy_import("ray")

logger = get_logger(__name__)

CRASH_RETRIES = 2  # Ray-level re-runs after a system failure, each recorded in Prefect
CRASH_BACKOFF_S = 1.0  # first re-run waits this long, then twice as long each time
RAY_CLIENT_LIMITS = (
    "Connected through Ray Client: task runs, their states, retries and their own logs are "
    "recorded as usual, but what plain Ray tasks started inside a task run print or log is not "
    "forwarded to it (that needs the driver's Ray log stream, which a Ray Client process does "
    "not get), the Ray job carries no prefect_flow_run_id metadata, and only Ray tasks started "
    "directly by a task run are named after it (Ray Client takes no job config nor worker "
    "setup hook from ray.init). Use the cluster's GCS address (host:port) for those."
)
CRASH_EVENTS_LAG_S = 3.0  # how long a crashed task's last events may take to be recorded
FORWARDED_WAIT_S = 5.0  # at exit, at most this long for returned runs' lines (wait_forwarded)


class RayClusterTaskRunner(RayRunnerBase):
    """A prefect-ray RayTaskRunner on a RayCluster block (an embedded local Ray when None).

    remote_defaults: Ray task options for every task (a task's ray_options and prefect-ray's
    remote_options win over them). crash_retries: how often Ray re-runs a task whose worker
    died, each re-run recorded as the next attempt of the same task run; 0 leaves the task
    run Crashed. crash_backoff_s: the wait before the first re-run, doubled for each next one.
    """

    def __init__(
        self,
        cluster: RayCluster | None = None,
        *,
        remote_defaults: dict[str, Any] | None = None,
        crash_retries: int = CRASH_RETRIES,
        crash_backoff_s: float = CRASH_BACKOFF_S,
    ):
        if crash_retries < 0 or crash_backoff_s < 0:
            raise ValueError(
                f"crash_retries ({crash_retries}) and crash_backoff_s "
                f"({crash_backoff_s}) must be >= 0"
            )
        self.cluster = cluster or RayCluster()
        self.crash_retries = crash_retries
        self.crash_backoff_s = crash_backoff_s
        # Ray only retries system failures by default (retry_exceptions is off), and each
        # re-run is recorded in Prefect by run_on_ray.
        self.remote_defaults = {**(remote_defaults or {}), "max_retries": crash_retries}
        self._shipper: ContextShipper | None = None
        self._remote_functions: dict[bytes, Any] = {}  # by options: Ray exports each once
        self._flow_run_id: UUID | None = None
        self._child_logs = False  # this runner holds a share of ChildTaskLogs' handler
        self._links_flow_run = True  # False in a Ray worker: the driver links the flow run
        self._warn_ray_client = False  # say in the flow run's log what Ray Client lacks
        self._connection: contextlib.ExitStack | None = None  # the block's, in the driver
        self._joined: Any = None  # what ray.init returned when this runner started Ray
        # ray.init's arguments are made when the driver enters the runner (they ship the
        # project's package): copies of the runner in Ray workers never start Ray.
        super().__init__(address=self.cluster.ray_init_address)

    def duplicate(self) -> RayClusterTaskRunner:
        return type(self)(
            self.cluster,
            remote_defaults=self.remote_defaults,
            crash_retries=self.crash_retries,
            crash_backoff_s=self.crash_backoff_s,
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RayClusterTaskRunner)
            and self.cluster == other.cluster
            and self.remote_defaults == other.remote_defaults
            and self.crash_retries == other.crash_retries
        )

    def __enter__(self) -> RayClusterTaskRunner:
        self._remote_functions = {}
        if in_ray_worker():
            # Prefect enters a copy of the flow's runner in each task run's context: Ray, the
            # job and the flow run's links belong to the driver; the shipper is made if used.
            self._links_flow_run = False
            super().__enter__()
            return self
        self._shipper = ContextShipper(worker_settings_overrides(prefect_api_url()))
        # Prefect enters the task runner before it opens the flow run's context: the run
        # being started is read from the engine (None when not found; linked at first submit).
        self._flow_run_id = flow_run_being_started()
        # Ray is joined the block's way (the job's flow run id, the child-task tagging hook in
        # every worker); prefect-ray then finds Ray initialised and only marks itself started.
        self._connection = contextlib.ExitStack()
        try:
            self._joined = self._connection.enter_context(
                self.cluster.connect(
                    job_config=job_config(self._flow_run_id) if self._flow_run_id else None,
                    setup_hook=worker_setup_hook(),
                )
            )
            super().__enter__()
        except BaseException:
            self._connection.close()
            raise
        self._child_logs = ChildTaskLogs.start(self._shipper.worker_settings["api"]["url"])
        self._warn_ray_client = ray.util.client.ray.is_connected()
        if self._flow_run_id is not None:
            self._link_flow_run(self._flow_run_id)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            wait_forwarded(FORWARDED_WAIT_S)
            if self._child_logs and self._flow_run_id is not None:
                ChildTaskLogs.drain(self._flow_run_id)
        finally:
            if self._child_logs:
                self._child_logs = False
                ChildTaskLogs.stop()
            try:
                super().__exit__(*exc_info)
            finally:
                if self._connection is not None:  # leaves Ray if this runner joined it
                    self._connection.close()
                    self._connection = None

    @property
    def uses_ray_client(self) -> bool:
        """The cluster is reached through Ray Client (a ray:// address)."""
        return self.cluster.address.startswith("ray://")

    def _link_flow_run(self, flow_run_id: UUID) -> None:
        link_flow_run(flow_run_id, self.cluster, self._joined)

    @property
    def shipper(self) -> ContextShipper:
        """Ships each submit's Prefect context; made at the first submit in a Ray worker."""
        if not self.started:
            raise RuntimeError("The task runner must be started before submitting work.")
        if self._shipper is None:
            self._shipper = ContextShipper(worker_settings_overrides(prefect_api_url()))
        return self._shipper

    def _remote_function(self, options: dict[str, Any]) -> Any:
        """run_on_ray as a Ray remote function with `options`, made once per distinct options:
        a new one per submit would be pickled and exported to the cluster again each time."""
        try:
            key = orjson.dumps(
                options, option=orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS
            )
        except TypeError:  # options holding objects (a scheduling strategy): not cached
            return ray.remote(**options)(run_on_ray)
        if key not in self._remote_functions:
            self._remote_functions[key] = ray.remote(**options)(run_on_ray)
        return self._remote_functions[key]

    def submit(
        self,
        task: Task[Any, Any],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
        dependencies: dict[str, set[Any]] | None = None,
    ) -> RayFuture[Any]:
        # Mirrors RayTaskRunner.submit, plus: worker settings, Ray-level defaults, and the
        # flow run id in the Ray task name so the dashboard ties each task to its flow run.
        if not self.started:
            raise RuntimeError("The task runner must be started before submitting work.")
        task_run_id = uuid4()
        task_inputs = {
            k: collect_task_run_inputs_sync(v, future_cls=RayFuture) for k, v in parameters.items()
        }
        context = self.shipper.context(task, task_run_id, task_inputs)
        parameters, upstream_refs = self.exchange_futures(parameters)
        options = {
            **self.remote_defaults,
            **getattr(task.fn, RAY_OPTIONS_ATTRIBUTE, {}),
            **RemoteOptionsContext.get().current_remote_options,
            "num_returns": 2,  # the final state, and the run's log lines for this process
        }
        flow_run = FlowRunContext.get()
        flow_run_id = flow_run.flow_run.id if flow_run and flow_run.flow_run else None
        if self._warn_ray_client:
            self._warn_ray_client = False
            # Outside a flow run (a runner used as a library) there is no run logger.
            logger = get_run_logger() if flow_run_id is not None else get_logger(__name__)
            logger.warning(RAY_CLIENT_LIMITS)
        if flow_run_id is not None and self._flow_run_id is None and self._links_flow_run:
            # Not found while entering: linked at the first submit instead.
            self._flow_run_id = flow_run_id
            self._link_flow_run(flow_run_id)
        name = (
            task.name if flow_run_id is None else ray_task_name(task.name, flow_run_id, task_run_id)
        )
        state_ref, lines_ref = (
            self._remote_function(options)
            .options(name=name)
            .remote(
                *upstream_refs,
                task=self.shipper.task(task),
                task_run_id=task_run_id,
                parameters=parameters,
                wait_for=wait_for,
                dependencies=dependencies,
                context=context,
                crash_backoff_s=self.crash_backoff_s,
            )
        )
        forward_task_logs(lines_ref, SettingsContext.get())
        future = CrashRecordingRayFuture(task_run_id=task_run_id, wrapped_future=state_ref)
        future.task = task
        future.flow_run_id = flow_run_id
        return future


def in_ray_worker() -> bool:
    """This process is a Ray worker (not a driver, nor a Ray Client)."""
    return "ray" in sys.modules and ray.is_initialized() and ray_internals.is_worker_mode()


class CrashRecordingRayFuture(RayFuture):
    """A prefect-ray future that, when Ray gives up on a crashed task, also records Crashed in
    the API (stock prefect-ray only keeps it in the flow process, and the UI shows Running,
    or nothing at all when the dead worker never sent its events)."""

    task: Task[Any, Any] | None = None
    flow_run_id: UUID | None = None

    def wait(self, timeout: float | None = None) -> None:
        super().wait(timeout)
        self._record_crash()

    def result(self, timeout: float | None = None, raise_on_failure: bool = True) -> Any:
        if self.final_state is None:
            self.wait(timeout)
        state = self.final_state
        if state is not None and state.is_completed() and isinstance(state.data, ResultRecord):
            # What State.result returns for a result held in memory, without its hop through
            # Prefect's event-loop thread (run_coro_as_sync): about a fifth of the flow
            # process's CPU per task run in a fan-out of quick tasks.
            return state.data.result
        return super().result(timeout=timeout, raise_on_failure=raise_on_failure)

    def _record_crash(self) -> None:
        state = self.final_state
        if state is None or not state.is_crashed() or getattr(self, "_crash_recorded", False):
            return
        self._crash_recorded = True
        try:
            with get_client(sync_client=True) as client:
                if not self._set_state_when_known(client, state):
                    client.create_task_run(
                        self.task,
                        self.flow_run_id,
                        dynamic_key=str(self.task_run_id),
                        id=self.task_run_id,
                        name=f"{self.task.name}-{self.task_run_id.hex[:3]}",
                        state=state,
                    )
        except Exception as error:  # the flow still sees Crashed; only the UI lags
            logger.warning("Could not record Crashed for task run %s: %s", self.task_run_id, error)

    def _set_state_when_known(self, client: Any, state: Any) -> bool:
        """Force `state` on the task run once the API has caught up with the dead worker (its
        Running event recorded: that event also counts the attempt, and an event recorded
        after a newer state is dropped), CRASH_EVENTS_LAG_S at most. False when the API never
        heard of the run."""
        deadline = time.monotonic() + CRASH_EVENTS_LAG_S
        while True:
            try:
                known = client.read_task_run(self.task_run_id)
            except ObjectNotFound:
                known = None
            caught_up = known is not None and known.state is not None and known.state.is_running()
            if caught_up or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if known is None:
            return False
        client.set_task_run_state(self.task_run_id, state, force=True)
        return True
