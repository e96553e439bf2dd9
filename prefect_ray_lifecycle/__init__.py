"""prefect-ray-lifecycle: a model's lifecycle on Ray, with Prefect on top.

Where each line runs tells you its room:
- `flows/`: Prefect flows, each a short story of task calls and decisions.
- `tasks/`: Prefect tasks by concern (`data/`, `tune/`, `rollout/`), with registration,
  lineage, charts and parameter types beside them.
- `ray_runner/`: the Prefect task runner on Ray.
- `blocks/`: Prefect Blocks, connections and secrets only.
- `control/`: what the flow process runs without Prefect: Serve control, the MLflow registry
  and the pure decisions (canary, convergence, promotion).
- `workloads/`: what runs inside Ray: Serve apps and the router, RLlib, Ray Data, vLLM.
- `compat/`: every private Ray or Prefect name the project relies on.
"""

# The package can arrive in parts: a Ray worker gets what runs inside Ray and what the flow's
# tasks import as two runtime_env py_modules, each a folder of this name (control.shipping).
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

__version__ = "0.1.0"
