"""Flow runs whose process died are marked Crashed, so nothing waits on them: swept at once
when the local worker starts (`mark_dead_runs_crashed`), and by the server for runs whose
heartbeats stopped (`ensure_crash_detection`, an automation). Kept by deployments.setup."""

from __future__ import annotations

from deployments import processes

# A run of this project's flows that sent no heartbeat for this long (three of Prefect's
# default beats), nor ended, is marked Crashed: its process died (a lost machine) and nothing
# else would say so. A stack restarted here is swept at once instead (mark_dead_runs_crashed).
SILENT_RUN_S = 600
CRASH_AUTOMATION = "mark-silent-flow-runs-crashed"
FLOW_NAMES = (
    "data-prep",
    "tune-sweep",
    "register-and-promote",
    "serve-rollout",
    "reconcile",
    "train-and-ship",
    "ray-smoke",
    "ray-fan-out",
    "llm-finetune",
    "llm-sweep",
    "register-llm",
    "llm-train-and-ship",
    "rollout-approval",  # a paused approval beats too (its process waits, alive)
)


def ensure_crash_detection(silent_s: float = SILENT_RUN_S) -> str:
    """The automation that marks a flow run Crashed when its heartbeats stopped before it
    ended (a Prefect proactive trigger per flow run). Its Crashed event then starts what
    prefect.yaml says follows a crash (reconcile, for a rollout or reconcile run), and the
    server frees the run's deployment concurrency slot."""
    from prefect.automations import Automation
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    ended = ["Completed", "Failed", "Cancelled", "Crashed", "Cancelling"]
    wanted = Automation(
        name=CRASH_AUTOMATION,
        description="A flow run whose heartbeats stopped before it ended is marked Crashed "
        "(kept by deployments.setup).",
        trigger=EventTrigger(
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAMES},
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in ended)},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=silent_s,
        ),
        actions=[
            ChangeFlowRunState(
                state="CRASHED",
                message=f"no heartbeat for {silent_s:g} s: its process died before it ended",
            )
        ],
    )
    try:
        found = Automation.read(name=CRASH_AUTOMATION)
    except ValueError:  # none by that name
        found = None
    if found is None:
        wanted.create()
        return f"automation {CRASH_AUTOMATION}: created"
    found.trigger, found.actions, found.description = (
        wanted.trigger,
        wanted.actions,
        wanted.description,
    )
    found.enabled = True
    found.update()
    return f"automation {CRASH_AUTOMATION}: in line"


def mark_dead_runs_crashed(pool: str, worker_name: str) -> list[str]:
    """The pool's flow runs that are not over but whose process on this machine is gone (a
    stopped stack, a killed worker, a reboot), and their subflows, marked Crashed. Their
    Crashed events start what follows a crash (reconcile), and the server frees their
    deployment concurrency slots. Run before the worker `worker_name` starts; returns what it
    marked."""
    import socket

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    unfinished = FlowRunFilterState(
        type=FlowRunFilterStateType(
            any_=[StateType.RUNNING, StateType.PENDING, StateType.CANCELLING, StateType.PAUSED]
        )
    )
    host = socket.gethostname()
    marked = []
    with get_client(sync_client=True) as client:
        others = [
            worker.name
            for worker in client.read_workers_for_work_pool(pool)
            if worker.name != worker_name and str(worker.status).upper().endswith("ONLINE")
        ]
        if others:  # their runs' pids are theirs, on their machines
            return [f"dead runs not swept: other workers of {pool} are online ({others})"]
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=unfinished),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
        )
        dead = [run for run in runs if _process_gone(run, host)]
        children = (
            client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    state=unfinished,
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[r.id for r in dead]),
                )
            )
            if dead
            else []
        )
        for run in [*dead, *children]:
            message = "its process is gone (found when the worker started)"
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
            marked.append(f"{run.name} ({run.id}) marked Crashed: {message}")
    return marked


def _process_gone(run, host: str) -> bool:
    """A run's process (the worker records it as host:pid) is gone from this machine; a pid
    that now belongs to another process counts as gone. Runs elsewhere, suspended ones and
    ones not started yet are left to their own machine and Prefect."""
    state = run.state
    if state is not None and state.is_paused() and state.state_details.pause_reschedule:
        return False  # suspended: no process is meant to be alive
    where, _, pid = (run.infrastructure_pid or "").rpartition(":")
    if where not in ("", host) or not pid.isdigit():  # a process worker records the bare pid
        return False
    try:
        env = processes.environ(int(pid))
    except FileNotFoundError:
        return True
    except OSError:  # alive, but not ours to read: leave it
        return False
    return env.get("PREFECT__FLOW_RUN_ID") != str(run.id)
