"""`make demo`: start the local services, run the end-to-end slice that exists, say where to look.

Until the pipeline (train -> register -> roll out) lands, the slice is: the block types
registered in Prefect; `ray-smoke` fanning 20 Prefect tasks out on an embedded Ray; a small
PPO sweep on CartPole; its best trial registered in MLflow and promoted to `champion` if it
beats the current one; and a prediction from `models:/cartpole-ppo@champion` in a fresh process.
A second `make demo` reuses the running services and trains a new challenger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deployments import local

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PREDICT = """
import json, numpy as np, mlflow, gymnasium as gym
model = mlflow.pyfunc.load_model("models:/cartpole-ppo@champion")
env = gym.make("CartPole-v1")
obs = np.stack([env.reset(seed=s)[0] for s in range(4)]).astype("float32")
print(json.dumps(np.asarray(model.predict(obs)).tolist()))
"""


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

    print("== running flows tune-sweep and register-and-promote: PPO on CartPole (a few minutes)")
    mlflow_url = next(s.url for s in services if s.name == "mlflow")
    lifecycle = subprocess.run([python, "-m", "deployments.demo_run",
                                str(local.DEFAULT_STATE_DIR), mlflow_url],
                               env=env, cwd=PROJECT_ROOT, capture_output=True, text=True)
    if lifecycle.returncode != 0:
        print(lifecycle.stdout[-4000:], lifecycle.stderr[-4000:], sep="\n", file=sys.stderr)
        return lifecycle.returncode
    registered = json.loads(lifecycle.stdout.strip().splitlines()[-1])

    print("== asking models:/cartpole-ppo@champion for actions, in a fresh process")
    predict = subprocess.run([python, "-c", PREDICT], env=env, cwd=PROJECT_ROOT,
                             capture_output=True, text=True)
    if predict.returncode != 0:
        print(predict.stderr[-4000:], file=sys.stderr)
        return predict.returncode
    actions = predict.stdout.strip().splitlines()[-1]

    prefect_url = next(s.url for s in services if s.name == "prefect")
    verdict = "promoted to champion" if registered["promoted"] else "kept as challenger"
    version_url = (f"{mlflow_url}/#/models/{registered['model_name']}/versions/"
                   f"{registered['version']}")
    print(f"""
== done: {report['tasks']} task runs completed on Ray in {len(report['worker_pids'])} worker \
processes, all recorded in the local Prefect server ({report['temporary_servers']} temporary \
servers started by workers).
   Sweep: {registered['trials']} trials; best checkpoint scores \
{registered['eval_return_mean']:.1f} on held-out episodes.
   MLflow: {registered['model_name']} v{registered['version']} \
({'new' if registered['created'] else 'already registered'}), {verdict}: {registered['reason']}
   models:/{registered['model_name']}@champion answers 4 CartPole observations with {actions}

Where to look:
  Prefect flow runs  {prefect_url}/runs
  ray-smoke run      {report['flow_run_url']}
  MLflow model       {version_url}
  Ray dashboard      the embedded Ray lives only for its flow run; run `python -m
                     deployments.local up --ray` for a lasting head at http://127.0.0.1:8265
Stop the services: python -m deployments.local down
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
