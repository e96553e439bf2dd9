"""A fan-out of small Prefect tasks on Ray: proves the cluster connection carries Prefect.

Each task reports which Prefect API it recorded itself in, whether its worker had to start a
temporary Prefect server, and where it imported the project's packages from (the cluster's
copy shipped through runtime_env, or the flow's own checkout).
"""

from __future__ import annotations

import os
from typing import Annotated

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.compat import prefect_internals
from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner


class WorkerProbe(BaseModel):
    index: int
    pid: int
    prefect_api_url: str | None
    temporary_server: bool
    workloads_path: str


class RaySmokeReport(BaseModel):
    tasks: int = Field(description="Task runs that completed on Ray.")
    worker_pids: list[int] = Field(description="Distinct Ray worker processes that ran them.")
    prefect_api_urls: list[str | None] = Field(description="Distinct APIs the workers used.")
    temporary_servers: int = Field(description="Workers that started a temporary server.")
    workloads_paths: list[str] = Field(description="Where workers imported `workloads` from.")
    fan_out_flow_run_id: str = Field(description="The flow run that holds the task runs.")
    flow_run_url: str | None = Field(description="This flow run in the Prefect UI.")


@task
def probe(index: int) -> WorkerProbe:
    """Report what this Ray worker sees of Prefect and of the project."""
    from prefect.settings import get_current_settings

    from prefect_ray_lifecycle import workloads

    temporary = prefect_internals.temporary_server_running()
    return WorkerProbe(
        index=index,
        pid=os.getpid(),
        prefect_api_url=get_current_settings().api.url,
        temporary_server=temporary,
        workloads_path=workloads.__file__,
    )


@flow(name="ray-fan-out")
def fan_out(tasks: int) -> tuple[str, list[WorkerProbe]]:
    """Run `tasks` probes on this flow's task runner; return this flow run's id and results."""
    from prefect.runtime import flow_run

    return flow_run.id, [future.result() for future in probe.map(range(tasks))]


@flow(name="ray-smoke", log_prints=True)
def ray_smoke(
    tasks: Annotated[int, Field(ge=1, le=1000)] = 20,
    ray_cluster: RayCluster | None = None,
) -> RaySmokeReport:
    """Fan `tasks` Prefect tasks out on the Ray cluster and summarise what the workers saw.

    Args:
        tasks: How many Prefect tasks to fan out on Ray (1-1000).
        ray_cluster: Where to run; an embedded local Ray when empty. Over Ray Client
            (ray://) the flow run's log says what that connection cannot carry.
    """
    from prefect.runtime import flow_run
    from prefect.utilities.urls import url_for

    cluster = ray_cluster or RayCluster()
    run_id, probes = fan_out.with_options(task_runner=RayClusterTaskRunner(cluster))(tasks)
    report = RaySmokeReport(
        tasks=len(probes),
        worker_pids=sorted({p.pid for p in probes}),
        prefect_api_urls=sorted({p.prefect_api_url for p in probes}, key=str),
        temporary_servers=sum(p.temporary_server for p in probes),
        workloads_paths=sorted({p.workloads_path for p in probes}),
        fan_out_flow_run_id=str(run_id),
        flow_run_url=url_for("flow-run", obj_id=flow_run.id),
    )
    create_markdown_artifact(
        key="ray-smoke",
        markdown=(
            f"**{report.tasks} tasks** on Ray ({cluster.address or 'embedded'}), "
            f"{len(report.worker_pids)} worker processes, "
            f"{report.temporary_servers} temporary Prefect servers.\n\n"
            f"Prefect API seen by workers: {', '.join(map(str, report.prefect_api_urls))}"
        ),
        description="What the Ray workers saw of Prefect",
    )
    print(report.model_dump_json())
    return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=ray_smoke.__doc__)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument(
        "--address",
        default="",
        help="Ray address: host:port (GCS), ray://host:port (Ray Client); embedded Ray when empty",
    )
    args = parser.parse_args()
    result = ray_smoke(tasks=args.tasks, ray_cluster=RayCluster(address=args.address))
    print(result.model_dump_json())
