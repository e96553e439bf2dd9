"""The same 4-trial PPO sweep as a raw Tuner script and through the tune-sweep flow, in one run.

Both run on an embedded local Ray of the same size, timed end to end (Ray start included in
both), with the same RLlib config built by workloads.rllib, FIFO scheduling and a fixed
iteration budget so both do the same training. The flow adds what the raw script lacks: the
preflight, the progress callback and its artifact, the trial table and best-trial artifacts,
and a one-episode RLModule evaluation. A local Prefect server is started first, outside the
timing. Sides alternate over --repeats runs each; means are reported. Last line: one JSON
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

TRIALS = 4
HYPERPARAMETERS = {"train_batch_size_per_learner": 500, "minibatch_size": 100, "num_epochs": 3}
SEARCH_SPACE = {"lr": {"grid": [1e-4, 3e-4, 6e-4, 1e-3]}}


def sweep_config(iterations: int):
    from tasks.tune_config import SweepConfig

    return SweepConfig(
        hyperparameters=HYPERPARAMETERS,
        search_space=SEARCH_SPACE,
        num_samples=1,
        scheduler={"kind": "fifo"},
        stop={"training_iterations": iterations, "env_steps": None, "episode_return": None},
    )


def run_raw(storage: Path, num_cpus: int, iterations: int, via_block: bool = False) -> float:
    """The raw Tuner script; `via_block` connects through the RayCluster block instead of a
    bare ray.init, to tell the block's share of the overhead from the flow's."""
    import contextlib

    import ray
    from ray import tune

    from blocks import RayCluster
    from workloads import rllib

    sweep = sweep_config(iterations)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if via_block:
            stack.enter_context(RayCluster(num_cpus=num_cpus).connect())
        else:
            ray.init(num_cpus=num_cpus, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
            stack.callback(ray.shutdown)
        config = rllib.build_config(
            "PPO", "CartPole-v1", {}, rllib.TrialResources(), sweep.seed, HYPERPARAMETERS
        )
        results = tune.Tuner(
            "PPO",
            param_space=rllib.param_space(config, rllib.parse_search_space(SEARCH_SPACE)),
            tune_config=tune.TuneConfig(metric=rllib.RETURN_METRIC, mode="max", num_samples=1),
            run_config=tune.RunConfig(
                name="raw",
                storage_path=str(storage),
                verbose=0,
                stop={"training_iteration": iterations},
                checkpoint_config=tune.CheckpointConfig(
                    num_to_keep=2,
                    checkpoint_score_attribute=rllib.RETURN_METRIC,
                    checkpoint_at_end=True,
                ),
            ),
        ).fit()
        assert len(results) == TRIALS and not results.errors, results.errors
    return time.perf_counter() - start


def run_flow(storage: Path, num_cpus: int, iterations: int) -> float:
    from blocks import RayCluster
    from flows.tune_sweep import tune_sweep

    sweep = sweep_config(iterations)
    start = time.perf_counter()
    result = tune_sweep(
        sweep=sweep,
        ray_cluster=RayCluster(num_cpus=num_cpus),
        storage_root=str(storage),
        evaluation_episodes=1,
    )
    elapsed = time.perf_counter() - start
    assert len(result.trials) == TRIALS
    assert {t.iterations for t in result.trials} == {iterations}
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side")
    parser.add_argument(
        "--raw-via-block",
        action="store_true",
        help="also time the raw script connected through the RayCluster block",
    )
    args = parser.parse_args(argv)

    # Import what both sides use before any timing: neither pays the other's imports.
    import flows.tune_sweep  # noqa: F401
    import workloads.rllib  # noqa: F401
    from benchmarks._prefect import prefect_api

    work = Path(tempfile.mkdtemp(prefix="bench-tune-"))
    try:
        # Sweep for the pair raw, flow, flow, raw, ...: drift in machine load (a shared CI
        # box) falls on both sides alike. Each side reports its mean.
        sides = ["raw", "flow"] + (["raw_block"] if args.raw_via_block else [])
        times: dict[str, list[float]] = {side: [] for side in sides}
        runs = {
            "raw": run_raw,
            "flow": run_flow,
            "raw_block": lambda *a: run_raw(*a, via_block=True),
        }
        with prefect_api():
            for repeat in range(args.repeats):
                for side in sides if repeat % 2 == 0 else sides[::-1]:
                    times[side].append(
                        runs[side](work / f"{side}-{repeat}", args.num_cpus, args.iterations)
                    )
        raw_s = sum(times["raw"]) / len(times["raw"])
        flow_s = sum(times["flow"]) / len(times["flow"])
        print(
            json.dumps(
                {
                    "trials": TRIALS,
                    "iterations": args.iterations,
                    "num_cpus": args.num_cpus,
                    "runs": {k: [round(t, 2) for t in v] for k, v in times.items()},
                }
            )
        )
        print(
            json.dumps(
                {
                    "raw_s": round(raw_s, 2),
                    "flow_s": round(flow_s, 2),
                    "ratio": round(flow_s / raw_s, 3),
                }
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
