"""A flow run in a process of its own, as a Prefect worker runs one: an API-created flow run
run by `run_flow` in a new session (a test can kill it with all it started), with this
checkout first on the path; the flow's RayCluster points at the session's head."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["PROJECT_ROOT", "FlowProcess", "result_of", "start_flow_run"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
_STARTED = itertools.count()  # a flow run started twice gets a log of each

RUN_EXISTING_FLOW_RUN = """
import importlib, json, sys
from prefect.client.orchestration import get_client
from prefect.flow_engine import run_flow
from prefect_ray_lifecycle.blocks import RayCluster

entrypoint, flow_run_id, address, token, parameters = sys.argv[1:]
module, name = entrypoint.split(":")
flow = getattr(importlib.import_module(module), name)
with get_client(sync_client=True) as client:
    flow_run = client.read_flow_run(flow_run_id)
parameters = json.loads(parameters)
parameters["ray_cluster"] = RayCluster(address=address, auth_token=token)
print(run_flow(flow, flow_run=flow_run, parameters=parameters).model_dump_json())
"""


class FlowProcess(subprocess.Popen):
    """A flow process whose output goes to a file, read with `output()` (or `communicate`)
    at any time. Not a pipe: nobody reads a pipe while the test waits on the run's progress,
    and a process that has written 64 KiB to a full pipe stops at its next write (a
    fine-tune's Ray Data progress bars, redrawn more often on a slow machine, got there
    before its first step once: no history for 300 s)."""

    def __init__(self, args: list[str], log: Path, **kwargs) -> None:
        self.log = log
        with open(log, "w") as out:
            super().__init__(args, stdout=out, stderr=subprocess.STDOUT, text=True, **kwargs)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def communicate(self, input=None, timeout=None) -> tuple[str, None]:  # noqa: A002
        self.wait(timeout=timeout)
        return self.output(), None


def start_flow_run(
    stack,
    entrypoint: str,
    flow_run_id,
    parameters: dict,
    script: Path,
    env: dict[str, str] | None = None,
) -> FlowProcess:
    """Run the flow run `flow_run_id` of the flow at `entrypoint` ('module:flow') with
    `parameters` (JSON) in a new process and session; `result_of` its output is the result.
    Its output goes beside `script`, to a file named for the script and the flow run."""
    script.write_text(RUN_EXISTING_FLOW_RUN)
    return FlowProcess(
        [
            sys.executable,
            str(script),
            entrypoint,
            str(flow_run_id),
            stack.ray_address,
            stack.ray_token,
            json.dumps(parameters),
        ],
        script.with_name(f"{script.stem}-{flow_run_id}-{os.getpid()}-{next(_STARTED)}.log"),
        cwd=PROJECT_ROOT,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT), **(env or {})},
        start_new_session=True,
    )


def result_of(output: str) -> dict:
    """A flow process's result: its last JSON line. Not its last line: Prefect may log after
    it at exit (on a busy machine "EventsWorker - Still processing items" came last once)."""
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result line in the flow process's output: {output[-3000:]}"
    return json.loads(lines[-1])
