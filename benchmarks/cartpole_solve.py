"""How long the tune-sweep flow's default PPO config takes to solve CartPole here.

One trial of the flow's default hyperparameters (no search: the default search space only
varies the learning rate), stopped at a mean episode return of 450 or the default env-step
budget, with a wall-time cap for busy machines. Reports the flow's wall time, the env steps
the trial sampled, and the mean return of the flow's RLModule-only evaluation on held-out
seeds. A local Prefect server is started first, outside the timing. Last line: one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

TARGET_RETURN = 450.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=900,
        help="wall-time cap for the sweep (the trial stops there unsolved)",
    )
    parser.add_argument("--episodes", type=int, default=10, help="evaluation episodes")
    args = parser.parse_args(argv)

    from benchmarks._prefect import prefect_api
    from blocks import RayCluster
    from flows.tune_sweep import tune_sweep
    from tasks.tune_config import SweepConfig

    sweep = SweepConfig(
        search_space={},
        num_samples=1,
        scheduler={"kind": "fifo"},
        stop={"episode_return": TARGET_RETURN, "sweep_seconds": args.max_seconds},
    )
    work = Path(tempfile.mkdtemp(prefix="bench-cartpole-"))
    try:
        with prefect_api():
            start = time.perf_counter()
            result = tune_sweep(
                sweep=sweep,
                ray_cluster=RayCluster(num_cpus=args.num_cpus),
                storage_root=str(work / "sweeps"),
                evaluation_episodes=args.episodes,
            )
            seconds = time.perf_counter() - start
        best_return = result.metrics["best_return"]
        print(
            json.dumps(
                {
                    "solved": best_return >= TARGET_RETURN,
                    "best_training_return": round(best_return, 1),
                    "iterations": result.metrics["iterations"],
                    "max_seconds": args.max_seconds,
                    "num_cpus": args.num_cpus,
                    "hyperparameters": sweep.hyperparameters,
                }
            )
        )
        print(
            json.dumps(
                {
                    "seconds": round(seconds, 1),
                    "env_steps": result.metrics["env_steps"],
                    "eval_return_mean": round(result.evaluation.mean_return, 1),
                }
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
