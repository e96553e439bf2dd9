"""The lifecycle slice `make demo` runs until the pipeline flow lands: a small PPO sweep on
CartPole, then registration and promotion of its best trial. Prints a JSON summary last.

Run by deployments.demo in a process pointed at the local services.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from blocks import MLflowServer, RayCluster
from flows.register import RegistrationRequest, register_and_promote
from flows.tune_sweep import tune_sweep
from tasks.register import EvaluationSummary
from tasks.tune import StopConditions, SweepConfig

MODEL_NAME = "cartpole-ppo"
EVALUATION_EPISODES = 10
# Small enough for a first run on 2 CPUs, long enough to reach a good policy.
DEMO_SWEEP = SweepConfig(num_samples=2, max_concurrent_trials=2,
                         stop=StopConditions(episode_return=450.0, sweep_seconds=300))


def main(state_dir: str, mlflow_uri: str) -> int:
    sweep = tune_sweep(sweep=DEMO_SWEEP, ray_cluster=RayCluster(),
                       storage_root=str(Path(state_dir) / "sweeps"),
                       evaluation_episodes=EVALUATION_EPISODES)
    evaluation = sweep.evaluation
    registration = register_and_promote(
        RegistrationRequest(
            model_name=MODEL_NAME, checkpoint=sweep.checkpoint_path,
            experiment_path=sweep.experiment_path, trial_id=str(sweep.metrics["trial_id"]),
            environment=DEMO_SWEEP.environment, env_config=DEMO_SWEEP.env_config,
            evaluation_episodes=EVALUATION_EPISODES, evaluation_seed=DEMO_SWEEP.seed,
            evaluation=EvaluationSummary(mean_return=evaluation.mean_return,
                                         std_return=evaluation.std_return,
                                         episodes=evaluation.episodes, seed=DEMO_SWEEP.seed),
            best_config=sweep.best_config,
            metrics={k: float(v) for k, v in sweep.metrics.items()
                     if isinstance(v, (int, float)) and v is not None},
            trials=[t.model_dump() for t in sweep.trials]),
        MLflowServer(tracking_uri=mlflow_uri))
    print(json.dumps({"sweep_flow_run": sweep.metrics.get("flow_run_id"),
                      "eval_return_mean": evaluation.mean_return,
                      "trials": len(sweep.trials), **registration.model_dump()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
