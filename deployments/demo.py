"""`make demo`: start the local services, run the end-to-end slice that exists, say where to look.

Until the pipeline (train -> register -> roll out) lands, the slice is the foundation's: the
RayCluster block types registered in Prefect, and `ray-smoke` fanning 20 Prefect tasks out on
an embedded Ray, every task run recorded in the local Prefect server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deployments import local

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    if local.main(["up"]) != 0:
        return 1
    services = local.services()
    env = {**os.environ, **local.environment(services)}
    python = sys.executable

    print("\n== registering block types (RayCluster, MLflowServer) with the Prefect server")
    subprocess.run([python, "-m", "prefect", "block", "register", "-m", "blocks"],
                   env=env, cwd=PROJECT_ROOT, check=True, stdout=subprocess.DEVNULL)

    print("== running flow ray-smoke: 20 Prefect tasks on an embedded Ray")
    run = subprocess.run([python, "-m", "flows.ray_smoke", "--tasks", "20"], env=env,
                         cwd=PROJECT_ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout[-4000:], run.stderr[-4000:], sep="\n", file=sys.stderr)
        return run.returncode
    report = json.loads(run.stdout.strip().splitlines()[-1])

    prefect_url = next(s.url for s in services if s.name == "prefect")
    mlflow_url = next(s.url for s in services if s.name == "mlflow")
    print(f"""
== done: {report['tasks']} task runs completed on Ray in {len(report['worker_pids'])} worker \
processes, all recorded in the local Prefect server ({report['temporary_servers']} temporary \
servers started by workers).

Where to look:
  Prefect flow run   {report['flow_run_url']}
  Prefect UI         {prefect_url}
  MLflow UI          {mlflow_url}   (models appear once the registration flow lands)
  Ray dashboard      the embedded Ray lives only for its flow run; run `python -m
                     deployments.local up --ray` for a lasting head at http://127.0.0.1:8265
Stop the services: python -m deployments.local down
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
