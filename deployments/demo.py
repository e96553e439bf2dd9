"""`make demo`: the whole lifecycle the way a user runs it, on local services.

Starts (or reuses) a Prefect server, an MLflow server and a Ray head; sets the environment up
(blocks, process work pool, rollout concurrency limit: deployments.setup); deploys
`train-and-ship` and starts (or reuses) a process worker; runs `train-and-ship` through its
deployment (sweep -> evaluate -> register -> promote -> rollout) while every other flow in
prefect.yaml is deployed beside it (what `prefect --no-prompt deploy --all` does, in two
steps); sends a few requests to the served policy; and prints where to look.

A second `make demo` reuses all of it and trains a new challenger: it is promoted, and rolled
out through the canary gates, only if it beats the champion; otherwise the champion keeps
serving.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments import local
from prefect_ray_lifecycle.workloads.constants import PROJECT_ROOT

DEPLOYMENT = "train-and-ship/train-and-ship"
ROUTE = "policy"
MODEL_NAME = "cartpole-ppo"
RUN_TIMEOUT_S = 1800
WATCH_EVERY_S = 1.0  # how often the run and its subflows are read
OBSERVATIONS = [
    [0.01, -0.02, 0.03, 0.04],
    [0.1, 0.5, -0.05, -0.6],
    [-0.1, -0.4, 0.05, 0.7],
    [0.0, 0.2, 0.02, -0.3],
    [0.05, -0.3, -0.08, 0.4],
]


def run(argv: list[str], env: dict[str, str], what: str) -> str:
    done = subprocess.run(argv, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"{what} failed (exit {done.returncode})")
    return done.stdout


def watch(client, flow_run_id: str, timeout: float):
    """Follow the run and its subflows, printing each state change; return the final run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    seen: dict[str, str] = {}
    names: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    while True:
        run = client.read_flow_run(flow_run_id)
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])
            )
        )
        for item in [run, *sorted(children, key=lambda c: c.created)]:
            key = str(item.id)
            if key not in names:
                names[key] = client.read_flow(item.flow_id).name
            state = item.state.name if item.state else "?"
            if seen.get(key) != state:
                seen[key] = state
                print(
                    f"   {time.monotonic() - started:6.0f} s  {names[key]:22} {state}", flush=True
                )
        if run.state is not None and run.state.is_final():
            return run
        if time.monotonic() > deadline:
            raise SystemExit(
                f"{DEPLOYMENT} run {flow_run_id} is still "
                f"{run.state and run.state.name} after {timeout:.0f} s"
            )
        time.sleep(WATCH_EVERY_S)


class Traffic(threading.Thread):
    """A few requests a second to the route while the run goes on, so a challenger's canary
    and bake are judged on real answers; counts answers by status and version."""

    def __init__(self, url: str, pause_s: float = 0.2):
        super().__init__(daemon=True)
        self.url, self.pause_s = url, pause_s
        self.answers: Counter[tuple[int, str | None]] = Counter()
        self.stopping = threading.Event()

    def run(self) -> None:
        from deployments import lineage

        while not self.stopping.wait(self.pause_s):
            answer = lineage.ask(self.url, OBSERVATIONS[len(self.answers) % len(OBSERVATIONS)])
            self.answers[(answer["status"], answer["version"])] += 1

    def report(self) -> str:
        self.stopping.set()
        self.join(timeout=40)
        parts = [
            f"{n} x {status}" + (f" from v{version}" if version else "")
            for (status, version), n in sorted(self.answers.items(), key=str)
        ]
        return ", ".join(parts) or "none"


def summary_of(client, flow_run_id: str) -> str:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    )
    return next((a.description or "" for a in artifacts if a.key == "train-and-ship"), "")


def chart_urls(mlflow_url: str, model_name: str, version: str) -> list[str]:
    """The version's charts on its MLflow run (the sweep's, each rollout's), as URLs."""
    from mlflow import MlflowClient

    from prefect_ray_lifecycle.blocks import MLflowServer
    from prefect_ray_lifecycle.tasks.charts import artifact_url

    client = MlflowClient(mlflow_url)
    run_id = client.get_model_version(model_name, version).run_id
    if not run_id:
        return []
    server = MLflowServer(tracking_uri=mlflow_url)
    return [
        artifact_url(server, run_id, found.path)
        for folder in ("charts", "rollouts")
        for found in client.list_artifacts(run_id, folder)
        if found.path.endswith(".png")
    ]


@dataclass(frozen=True)
class Ready:
    """The local services up, the demo's deployment made and a worker on the pool; every other
    flow of prefect.yaml is being deployed (`others_deployed` waits for them)."""

    environment: Any  # deployments.setup's LocalEnvironment
    prefect_url: str
    deploying_others: Future

    def others_deployed(self) -> None:
        """Wait for the other deployments (SystemExit when `prefect deploy` failed)."""
        deployed = deployed_names(self.deploying_others.result())
        print(f"   meanwhile {len(deployed)} more deployments: {', '.join(deployed)}")

    def run_deployment(self, deployment: str, params: dict) -> tuple[str, str]:
        """What `prefect deployment run <deployment> --params <params>` does (printed, for the
        user to run again), through Prefect's own `run_deployment` in this process, which has
        Prefect imported already: the command's interpreter took 3.7 s here before it sent
        anything. Returns the flow run's id and its UI URL."""
        from prefect.deployments import run_deployment

        from deployments import setup

        print(f"   prefect deployment run {deployment} --params '{json.dumps(params)}'")
        with setup.prefect_api(self.environment.client_env["PREFECT_API_URL"]):
            flow_run = run_deployment(deployment, parameters=params, timeout=0)
        flow_run_id = str(flow_run.id)
        flow_run_url = f"{self.prefect_url}/runs/flow-run/{flow_run_id}"
        print(f"   flow run {flow_run_url}")
        return flow_run_id, flow_run_url


def deployment_names() -> list[str]:
    """The deployments prefect.yaml defines, in its order."""
    import yaml

    with (PROJECT_ROOT / "prefect.yaml").open() as f:
        return [d["name"] for d in yaml.safe_load(f)["deployments"]]


def deployed_names(output: str) -> list[str]:
    """The deployments `prefect deploy` says it made."""
    return sorted(set(re.findall(r"Deployment '([^']+)' successfully", output)))


def prepare(state_dir: Path, deployment: str) -> Ready | None:
    """Start (or reuse) the services and a Ray head, set the environment up, deploy
    `deployment` ("flow/name") and start (or reuse) a process worker, then deploy every other
    flow of prefect.yaml in the background: the run need not wait for the 10 flows it does not
    use (about 10 s here, the imports of every flow). None when the services did not start."""
    if local.main(["up", "--ray", "--state-dir", str(state_dir)]) != 0:
        return None
    from deployments import setup

    environment = setup.local_environment(state_dir)
    os.environ.update(environment.client_env)  # this process talks to them from here on
    env = {**os.environ}
    python = sys.executable
    prefect = str(Path(python).parent / "prefect")
    # deployments.setup's steps run in this process (what `python -m deployments.setup` runs,
    # without a second interpreter importing Prefect and MLflow again: about 2 s here).
    print("\n== setting up the environment (python -m deployments.setup)", flush=True)
    with setup.prefect_api(environment.client_env["PREFECT_API_URL"]):
        for line in setup.prepare(environment):
            print(f"   {line}", flush=True)

    # The worker needs only the pool (set up above), not the deployments: both start at once.
    name = deployment.split("/")[-1]
    others = [other for other in deployment_names() if other != name]
    print(
        f"== deploying {name} (prefect --no-prompt deploy --name {name}) and starting a "
        "process worker for the pool",
        flush=True,
    )
    pool = ThreadPoolExecutor(2)

    def deploy(names: list[str]):
        argv = [prefect, "--no-prompt", "deploy", *(a for n in names for a in ("--name", n))]
        return pool.submit(run, argv, env, "prefect deploy")

    deploying = deploy([name])
    starting = pool.submit(
        setup.start_worker, state_dir, environment.client_env, environment.work_pool
    )
    print(f"   deployed: {', '.join(deployed_names(deploying.result()))}")
    print(f"   {starting.result().strip()}")
    print(
        f"   the other {len(others)} flows deploy meanwhile (together: prefect --no-prompt "
        "deploy --all)",
        flush=True,
    )
    deploying_others = deploy(others)
    pool.shutdown(wait=False)  # the pool's thread ends with that deploy
    prefect_url = environment.client_env["PREFECT_API_URL"].removesuffix("/api")
    return Ready(environment, prefect_url, deploying_others)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=local.DEFAULT_STATE_DIR,
        help="folder for the local services' state (default: .local/)",
    )
    state_dir = parser.parse_args(argv).state_dir.resolve()
    ready = prepare(state_dir, DEPLOYMENT)
    if ready is None:
        return 1
    from deployments import setup

    environment, prefect_url = ready.environment, ready.prefect_url
    mlflow_url = environment.mlflow_uri
    from prefect.client.orchestration import get_client

    params = {"model_name": MODEL_NAME, "route": ROUTE, "storage_root": str(state_dir / "sweeps")}
    print(f"== running {DEPLOYMENT} through its deployment (a few minutes on 2 CPUs)", flush=True)
    flow_run_id, flow_run_url = ready.run_deployment(DEPLOYMENT, params)
    from deployments import lineage

    route_url = f"http://127.0.0.1:{environment.serve_port}/{ROUTE}"
    traffic = Traffic(route_url) if lineage.ask(route_url)["version"] else None
    if traffic is not None:
        print(f"   (meanwhile about 5 requests a second go to {route_url})")
        traffic.start()
    with get_client(sync_client=True) as client:
        final = watch(client, flow_run_id, RUN_TIMEOUT_S)
        outcome = summary_of(client, flow_run_id)
    ready.others_deployed()
    if traffic is not None:
        print(f"   answers during the run: {traffic.report()}")
    if not final.state.is_completed():
        worker_log = setup.worker_service(state_dir).log_file
        print(
            f"\n{DEPLOYMENT} ended {final.state.name}: {final.state.message}\n"
            f"See {flow_run_url} and {worker_log}",
            file=sys.stderr,
        )
        return 1

    print(f"== asking {route_url} for actions", flush=True)
    served = set()
    for observation in OBSERVATIONS:
        started = time.perf_counter()
        answer = lineage.ask(route_url, observation)
        served.add(answer["version"])
        print(
            f"   {observation} -> {answer['status']} action "
            f"{answer['answer'].get('action')} from v{answer['version']} "
            f"({(time.perf_counter() - started) * 1000:.0f} ms)"
        )
    walked = lineage.walk(route_url, MODEL_NAME, mlflow_url)
    registered = re.search(r" v(\d+):", outcome)  # "<model> v<N>: <why shipped or not>"
    version = registered.group(1) if registered else walked["served"]["version"]
    charts = "".join(
        f"  Chart              {url}\n" for url in chart_urls(mlflow_url, MODEL_NAME, version)
    )
    body = json.dumps({"observation": OBSERVATIONS[0]})
    flag = "" if state_dir == local.DEFAULT_STATE_DIR.resolve() else f" --state-dir {state_dir}"
    print(f"""
== done: {outcome}
   {route_url} serves v{", v".join(sorted(v for v in served if v))}; walking back from \
its answer:
   MLflow version     {walked.get("mlflow_version")}
   registered by      {walked.get("registration_flow_run")}
   sweep run          {walked.get("sweep_flow_run")}
   Tune experiment    {walked.get("tune_experiment")} (trial {walked.get("tune_trial")})
   held-out return    {walked.get("eval_mean_return")}

Where to look:
  Prefect flow run   {flow_run_url}
  MLflow version     {mlflow_url}/#/models/{MODEL_NAME}/versions/{version}
{charts}  Ray dashboard      http://127.0.0.1:{local.RAY_DASHBOARD_PORT} (Serve tab: apps and \
replicas)
  Try the endpoint   curl -si -XPOST {route_url} -H 'content-type: application/json' \
-d '{body}'
  Lineage            python -m deployments.lineage --url {route_url}
  The route now      python -m deployments.status --url {route_url}
  Deployments        {prefect_url}/deployments (schedules are off: \
python -m deployments.setup --schedules on)
Stop everything: python -m deployments.setup{flag} --worker stop && \
python -m deployments.local{flag} down --ray
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
