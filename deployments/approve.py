"""Answer a rollout that waits for a person's approval, from a shell (Prefect 3.9.1 has no
`prefect flow-run resume`):

    python -m deployments.approve RUN_ID (--approve | --abort) --reason TEXT --name WHO
                                  [--wait 60]

RUN_ID is the paused `rollout-approval` run, or any run above it: the serve-rollout run (a
deployment run stays Running while its approval subflow is Paused), or the reconcile that
runs it. The answer is what the form in the Prefect UI sends (`resume_flow_run` with its
run_input). A run just paused has not stored its form yet, and Prefect refuses a resume
until it has: this waits up to --wait seconds for the form, then resumes.

Exit status: 0 resumed; 1 Prefect refused the answer; 2 nothing waits for approval there.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Any

__all__ = ["NotWaiting", "main", "resume", "waiting_run"]

NOT_WAITING = 2  # exit status
POLL_S = 0.5


class NotWaiting(Exception):
    """No run at or under RUN_ID waits for approval."""


def waiting_run(client: Any, run_id: uuid.UUID) -> Any | None:
    """The paused run at or under `run_id` whose form Prefect has stored, else None."""
    from prefect_ray_lifecycle.tasks.rollout.claim import run_and_subflows

    for run in run_and_subflows(client, run_id):
        state = run.state
        keyset = state.state_details.run_input_keyset if state and state.is_paused() else None
        if keyset and _form_stored(client, run.id, keyset["schema"]):
            return run
    return None


def _form_stored(client: Any, run_id: uuid.UUID, key: str) -> bool:
    import httpx

    try:
        client.read_flow_run_input(run_id, key)
    except httpx.HTTPStatusError as error:
        if error.response.status_code == 404:  # paused, its form not stored yet
            return False
        raise
    return True


def resume(
    run_id: str | uuid.UUID,
    decision: str,
    reason: str,
    name: str,
    wait_s: float = 60.0,
) -> uuid.UUID:
    """Send the decision to the run waiting at or under `run_id`; the paused run's id.
    NotWaiting when none waits within `wait_s`; RuntimeError when Prefect refuses it."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.flow_runs import resume_flow_run

    run_id = uuid.UUID(str(run_id))
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            try:
                run = waiting_run(client, run_id)
            except ObjectNotFound:
                raise NotWaiting(f"no flow run {run_id}") from None
            if run is not None:
                break
            if time.monotonic() > deadline:
                raise NotWaiting(f"nothing at or under flow run {run_id} waits for approval")
            time.sleep(POLL_S)
    resume_flow_run(run.id, run_input={"decision": decision, "reason": reason, "name": name})
    return run.id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.approve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_id", type=uuid.UUID, help="the rollout's flow run (or one above)")
    decision = parser.add_mutually_exclusive_group(required=True)
    decision.add_argument("--approve", dest="decision", action="store_const", const="approve")
    decision.add_argument("--abort", dest="decision", action="store_const", const="abort")
    parser.add_argument("--reason", required=True, help="why (kept on the model version)")
    parser.add_argument("--name", required=True, help="who decides (kept on the model version)")
    parser.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for the form (%(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        paused = resume(args.run_id, args.decision, args.reason, args.name, args.wait)
    except NotWaiting as error:
        print(f"deployments.approve: {error}", file=sys.stderr)
        return NOT_WAITING
    except Exception as error:  # Prefect refused it (a bad reason or name, a run moved on)
        print(f"deployments.approve: Prefect refused the answer: {error}", file=sys.stderr)
        return 1
    print(f"{args.decision}: sent to flow run {paused}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
