"""How long the tune-sweep flow's default PPO config takes to solve CartPole here, against a
raw RLlib `algo.train()` loop with the same config and seed, in one run.

The flow side: one trial of the flow's default hyperparameters (no search: the default search
space only varies the learning rate), stopped at a mean episode return of 450, the default
env-step budget or a wall-time cap for busy machines. The raw side: the same RLlib config
(built by workloads.rl.rllib with the sweep's seed and hyperparameters) trained in a plain loop on
a plain `ray.init` of the same size, stopped at the same conditions. Both are timed end to end,
from before Ray starts until the checkpoint has been evaluated: the same RLModule-only
evaluation (rllib.evaluate_checkpoint, the same episodes and held-out seeds) on both sides,
inside the flow's sweep task and after the raw loop's `ray.shutdown()`. `--rounds` rounds
(3 by default) alternate which side goes first; medians are reported. A local Prefect server
is started first, outside the timing. Last line: one JSON object with `ratio` (flow seconds
over raw seconds) and `solved` for each side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

TARGET_RETURN = 450.0


def sweep_config(target_return: float, max_seconds: float):
    from prefect_ray_lifecycle.tasks.tune.config import SweepConfig

    return SweepConfig(
        search_space={},
        num_samples=1,
        scheduler={"kind": "fifo"},
        stop={"episode_return": target_return, "sweep_seconds": max_seconds},
    )


def run_flow(sweep, num_cpus: int, episodes: int, storage: Path) -> dict:
    from prefect_ray_lifecycle.blocks import RayCluster
    from prefect_ray_lifecycle.flows.tune_sweep import tune_sweep

    start = time.perf_counter()
    result = tune_sweep(
        sweep=sweep,
        ray_cluster=RayCluster(num_cpus=num_cpus),
        storage_root=str(storage),
        evaluation_episodes=episodes,
    )
    seconds = time.perf_counter() - start
    best_return = result.metrics["best_return"]
    return {
        "solved": bool(best_return >= sweep.stop.episode_return),
        "seconds": round(seconds, 1),
        "env_steps": int(result.metrics["env_steps"]),
        "iterations": int(result.metrics["iterations"]),
        "best_training_return": round(float(best_return), 1),
        "eval_return_mean": round(result.evaluation.mean_return, 1),
    }


def run_raw(sweep, num_cpus: int, episodes: int, storage: Path) -> dict:
    """The peer: the same config and seed, `algo.train()` until a stop condition holds."""
    import ray

    from prefect_ray_lifecycle.workloads.rl import rllib

    stop = sweep.stop
    start = time.perf_counter()
    ray.init(num_cpus=num_cpus, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    try:
        config = rllib.build_config(
            sweep.algorithm,
            sweep.environment,
            sweep.env_config,
            rllib.TrialResources(),
            sweep.seed,
            sweep.hyperparameters,
        )
        algo = config.build_algo()
        try:
            best_return, iterations, env_steps = float("-inf"), 0, 0
            while True:
                result = algo.train()
                iterations += 1
                episode_return = result["env_runners"].get("episode_return_mean")
                if episode_return is not None:
                    best_return = max(best_return, episode_return)
                env_steps = int(result[rllib.ENV_STEPS_METRIC])
                if (
                    best_return >= stop.episode_return
                    or (stop.env_steps and env_steps >= stop.env_steps)
                    or time.perf_counter() - start >= stop.sweep_seconds
                ):
                    break
            checkpoint = algo.save(str(storage / "raw")).checkpoint.path
        finally:
            algo.stop()
    finally:
        ray.shutdown()
    evaluation = rllib.evaluate_checkpoint(
        checkpoint, sweep.environment, sweep.env_config, episodes=episodes, seed=sweep.seed
    )
    seconds = time.perf_counter() - start
    return {
        "solved": bool(best_return >= stop.episode_return),
        "seconds": round(seconds, 1),
        "env_steps": env_steps,
        "iterations": iterations,
        "best_training_return": round(float(best_return), 1),
        "eval_return_mean": round(evaluation.mean_return, 1),
    }


def medians(runs: list[dict]) -> dict:
    """One side's rounds: medians of its figures, every round's seconds, solved in each."""
    return {
        "solved": all(run["solved"] for run in runs),
        "seconds": round(statistics.median(run["seconds"] for run in runs), 1),
        "env_steps": int(statistics.median(run["env_steps"] for run in runs)),
        "iterations": int(statistics.median(run["iterations"] for run in runs)),
        "eval_return_mean": round(statistics.median(run["eval_return_mean"] for run in runs), 1),
        "rounds_seconds": [run["seconds"] for run in runs],
        "rounds_env_steps": [run["env_steps"] for run in runs],
        "rounds_solved": [run["solved"] for run in runs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=900,
        help="wall-time cap for each side (a side stops there unsolved)",
    )
    parser.add_argument("--episodes", type=int, default=10, help="evaluation episodes")
    parser.add_argument(
        "--target-return",
        type=float,
        default=TARGET_RETURN,
        help="mean training return that counts as solved (lower it for a quick check run)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both sides (>= 3)")
    args = parser.parse_args(argv)

    # Import what both sides use before any timing: neither pays the other's imports.
    from prefect.logging.handlers import APILogWorker

    import prefect_ray_lifecycle.flows.tune_sweep  # noqa: F401
    import prefect_ray_lifecycle.workloads.rl.rllib  # noqa: F401
    from benchmarks._prefect import prefect_api

    sweep = sweep_config(args.target_return, args.max_seconds)
    work = Path(tempfile.mkdtemp(prefix="bench-cartpole-"))
    runs: dict[str, list[dict]] = {"flow": [], "raw": []}
    try:
        with prefect_api():
            for round_ in range(args.rounds):
                # The order alternates round by round, so drift in load falls on both.
                for side in ("flow", "raw") if round_ % 2 == 0 else ("raw", "flow"):
                    storage = work / f"{side}-{round_}"
                    run = run_flow if side == "flow" else run_raw
                    runs[side].append(run(sweep, args.num_cpus, args.episodes, storage))
            # The flow's last logs go out while the benchmark's Prefect server still runs.
            APILogWorker.drain_all(timeout=30)
        print(
            json.dumps(
                {
                    "target_return": args.target_return,
                    "max_seconds": args.max_seconds,
                    "num_cpus": args.num_cpus,
                    "hyperparameters": sweep.hyperparameters,
                    "seed": sweep.seed,
                    "runs": runs,
                }
            )
        )
        flow, raw = medians(runs["flow"]), medians(runs["raw"])
        print(
            json.dumps(
                {
                    "ratio": round(flow["seconds"] / raw["seconds"], 3),
                    "flow": flow,
                    "raw": raw,
                    "rounds": args.rounds,
                    "statistic": "median",
                }
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
