"""A person's approval of a rollout: the flow pauses with Prefect's
`pause_flow_run(wait_for_input=...)`, the Prefect UI shows a form (approve or abort, a reason,
a name) under a description that links the rollout's chart so far and its verdicts, and
`python -m deployments.approve` answers it from a shell.

Prefect 3.9.1 fights a paused rollout in three ways, each met here:
- A deployment run's Running -> Paused transition releases its deployment concurrency slot
  and revokes the slot's lease (server/orchestration/core_policy.py,
  ReleaseFlowConcurrencySlots); the engine's renewal of that lease then fails with a 410, and
  it cancels the run (concurrency/_leases.py, flow_engine.py renews for 300 s every 225 s).
  So the pause is taken by a subflow of its own (`rollout-approval`): a subflow has no
  deployment, so pausing it releases nothing, and the deployment run stays Running with its
  slot and its lease (a queued rollout keeps waiting).
- The server's pause expiry marks a run Failed, for good. So Prefect's pause timeout is
  PAUSE_GRACE_S longer than the approval's, and the flow decides the timeout itself: a
  watcher resumes the pause with the timeout's action when the time is up (or aborts it when
  the candidate fails its canary while it waits).
- A resume sent before the pause stored its input schema is refused: the watcher (and
  deployments.approve) retries until it is taken.
The route lease is renewed by the flow process meanwhile (tasks.rollout.claim), so a person
can take their time; a killed paused run still leaves live only, and the route's record
(`approval` on the rollout record) tells reconcile to ask again."""

from __future__ import annotations

import contextvars
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import ray
from prefect import flow, get_run_logger
from prefect.flow_runs import pause_flow_run, resume_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for
from pydantic import Field

from prefect_ray_lifecycle.control.canary import GateFailed, Thresholds, early_failure
from prefect_ray_lifecycle.tasks.rollout import StageResult
from prefect_ray_lifecycle.tasks.rollout.apps import RouteContext
from prefect_ray_lifecycle.tasks.rollout.config import Gates
from prefect_ray_lifecycle.tasks.rollout.record import Timeline
from prefect_ray_lifecycle.workloads.serve.route_state import route_figures
from prefect_ray_lifecycle.workloads.serve.router_config import Approval, Target

__all__ = [
    "APPROVAL_FLOW",
    "PAUSE_GRACE_S",
    "ApprovalInput",
    "ApprovalResult",
    "ask",
    "wait_for_approval",
]

APPROVAL_FLOW = "rollout-approval"
PAUSE_GRACE_S = 600  # Prefect's own pause timeout outlasts ours by this: its expiry fails runs
POLL_S = 2  # how often the paused run looks for a decision
WATCH_S = 1.0  # how often the watcher looks at the clock and the candidate
TIMEOUT_NAME = "serve-rollout (approval timeout)"
GATE_NAME = "serve-rollout (canary gate)"


class ApprovalInput(RunInput):
    """The form a paused rollout shows in the Prefect UI."""

    decision: Literal["approve", "abort"] = Field(
        description="approve: swap the candidate in (or go on to the next canary step); "
        "abort: withdraw it, as a failed gate would."
    )
    reason: str = Field(min_length=1, max_length=500, description="Why; kept on the version.")
    name: str = Field(
        min_length=1,
        max_length=100,
        description="Who decides (Prefect OSS records no approver): kept on the version.",
    )


@dataclass(frozen=True, kw_only=True)
class ApprovalResult(StageResult):
    decision: str
    by: str
    weight: float  # the canary share the candidate kept while it waited
    waited_s: float


@flow(name=APPROVAL_FLOW, flow_run_name="approve {title}", log_prints=True)
def wait_for_approval(
    title: str,
    description: str,
    timeout_s: float,
    on_timeout: Literal["abort", "approve"],
    route: str,
    candidate: str,
    max_error_rate: float,
) -> dict[str, Any]:
    """Pause for a person's decision on `title` (the form's `description` in markdown); after
    `timeout_s` the watcher decides `on_timeout`, and it aborts at once when `candidate`
    errs on the route above `max_error_rate` while it waits. Returns the decision, the
    reason, the name and `by`: "person", "timeout" or "gate"."""
    me = flow_run.id
    started = time.time()
    decided: dict[str, str] = {}
    stop = threading.Event()
    watcher = threading.Thread(
        target=contextvars.copy_context().run,
        args=(_watch, me, started, timeout_s, on_timeout, route, candidate, max_error_rate),
        kwargs={"stop": stop, "decided": decided},
        name=f"approval-watch-{me}",
        daemon=True,
    )
    watcher.start()
    try:
        form = ApprovalInput.with_initial_data(description=description)
        answer = pause_flow_run(
            wait_for_input=form, timeout=int(timeout_s + PAUSE_GRACE_S), poll_interval=POLL_S
        )
    finally:
        stop.set()
        watcher.join(timeout=10)
    return {
        "decision": answer.decision,
        "reason": answer.reason,
        "name": answer.name,
        "by": decided.get("by", "person"),
    }


def _watch(
    me: Any,
    started: float,
    timeout_s: float,
    on_timeout: str,
    route: str,
    candidate: str,
    max_error_rate: float,
    *,
    stop: threading.Event,
    decided: dict[str, str],
) -> None:
    """Resume the pause itself with the timeout's action, or an abort when the candidate
    fails while it waits; a resume that comes before Prefect stored the form is refused, and
    tried again."""
    thresholds = Thresholds(max_error_rate=max_error_rate)
    log = get_run_logger()
    while not stop.wait(WATCH_S):
        decision = None
        if time.time() - started >= timeout_s:
            decision = (
                "timeout",
                {
                    "decision": on_timeout,
                    "reason": f"no decision within {timeout_s:g} s: {on_timeout} "
                    "(Gates.approval_on_timeout)",
                    "name": TIMEOUT_NAME,
                },
            )
        elif ray.is_initialized():  # the rollout's connection (never start a Ray of its own)
            try:
                failing = early_failure(route_figures(route, started).get(candidate), thresholds)
            except Exception:  # the route's state may be restarting: look again next time
                failing = None
            if failing is not None:
                decision = (
                    "gate",
                    {
                        "decision": "abort",
                        "reason": f"the candidate failed while waiting: {failing.reason}",
                        "name": GATE_NAME,
                    },
                )
        if decision is None:
            continue
        try:
            resume_flow_run(me, run_input=decision[1])
        except Exception as error:  # not paused yet, or its form not stored yet
            log.debug("approval watcher could not resume yet: %r", error)
            continue
        decided["by"] = decision[0]
        log.info("approval decided by the %s: %s", decision[0], decision[1]["reason"])
        return


def ask(
    ctx: RouteContext,
    gates: Gates,
    timeline: Timeline,
    live: Target,
    candidate: Target,
    inline_live: bool,
    weight: float,
    point: Literal["before_swap", "after_step"],
) -> ApprovalResult:
    """Wait for a person's approval with the candidate at `weight` (the route's record says
    so, for whoever finds this rollout dead); the result when approved, GateFailed at stage
    `approval` (with the person's reason and name) when aborted or timed out to abort."""
    since = time.time()
    waiting = Approval(point, weight, since)
    ctx.write(
        ctx.config(
            live=live,
            candidate=candidate,
            candidate_weight=weight,
            inline_live=inline_live,
            rollout=ctx.record("canary", candidate.version, approval=waiting),
        )
    )
    where = "before the swap" if point == "before_swap" else f"after the canary at {weight:.0%}"
    timeline.add("approval", "waiting", f"for a person's approval {where}")
    timeline.publish(f"waiting for approval {where}")  # the chart so far, for the form
    title = f"v{candidate.version} on /{ctx.route} {where}"
    get_run_logger().info(
        "waiting for a person's approval: the form is on the subflow run 'approve %s' (this "
        "run's Subflow Runs), or answer with `python -m deployments.approve %s --approve|"
        "--abort --reason ... --name ...`",
        title,
        flow_run.id,
    )
    decided = wait_for_approval(
        title=title,
        description=_description(timeline, title, gates, weight, since),
        timeout_s=gates.approval_timeout_s,
        on_timeout=gates.approval_on_timeout,
        route=ctx.route,
        candidate=candidate.version,
        max_error_rate=gates.max_error_rate,
    )
    ctx.claim.check()
    who = f"{decided['name']}: {decided['reason']}"
    figures = {
        "decision": decided["decision"],
        "by": decided["by"],
        "name": decided["name"],
        "weight": weight,
        "waited_s": round(time.time() - since, 1),
    }
    if decided["decision"] != "approve":
        timed_out = "timed out, " if decided["by"] == "timeout" else ""
        raise GateFailed("approval", f"{timed_out}aborted by {who}", figures)
    return ApprovalResult(
        decision="approve",
        by=decided["name"],
        weight=weight,
        waited_s=figures["waited_s"],
        reason=f"approved by {who}",
    )


def _description(timeline: Timeline, title: str, gates: Gates, weight: float, since: float) -> str:
    """The form's markdown: what is asked, the verdicts so far, the chart so far, and how
    to answer from a shell."""
    deadline = datetime.fromtimestamp(since + gates.approval_timeout_s, UTC)
    # A list, not a table: the form's modal is narrow, and a list wraps.
    verdicts = "\n".join(
        f"- **{e['stage']}** {e['outcome']}: {e['detail']}" for e in timeline.entries
    )
    chart = (
        f"[The rollout's chart so far]({timeline.chart_url})"
        if timeline.chart_url
        else "(no chart could be drawn)"
    )
    run = url_for("flow-run", obj_id=flow_run.id) or str(flow_run.id)
    return (
        f"## Approve {title}?\n\n"
        f"The candidate serves {weight:.0%} of requests while this waits. Decide by "
        f"{deadline.isoformat(timespec='seconds')} (then: {gates.approval_on_timeout}).\n\n"
        f"{verdicts}\n\n{chart}\n\n"
        f"From a shell:\n\n    python -m deployments.approve {flow_run.id} --approve "
        f"--reason '...' --name '...'\n\n(or `--abort`). The rollout's run: {run}"
    )
