"""The same 4-trial PPO sweep as a raw Tuner script and through the tune-sweep flow, in one run.

Both run on an embedded local Ray of the same size, timed end to end (Ray start included in
both), with the same RLlib config built by workloads.rl.rllib, FIFO scheduling and a fixed
iteration budget so both do the same training. The flow adds what the raw script lacks: the
preflight, the progress callback and its artifact, the trial table and best-trial artifacts,
and a one-episode RLModule evaluation. A local Prefect server is started first, and each side
runs once (a warm-up sweep of --warmup-iterations), all outside the timing, so that no counted
round pays a process's first imports, compiles or caches. Each round runs both sides, the
order alternating round by round (raw first, then flow first, ...), so drift in machine load
falls on both; medians over the rounds are reported, with the flow's time split into its
stages (from its Prefect task run): the engine before the sweep task, the sweep task (Ray
start, preflight, Tune, evaluation, Ray shutdown) and what follows it (the experiment asset,
the flow's end). Last line: one JSON object.
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

TRIALS = 4
HYPERPARAMETERS = {"train_batch_size_per_learner": 500, "minibatch_size": 100, "num_epochs": 3}
SEARCH_SPACE = {"lr": {"grid": [1e-4, 3e-4, 6e-4, 1e-3]}}


def sweep_config(iterations: int):
    from prefect_ray_lifecycle.tasks.tune.config import SweepConfig

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

    from prefect_ray_lifecycle.blocks import RayCluster
    from prefect_ray_lifecycle.workloads.rl import rllib

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


def run_flow_stages(storage: Path, num_cpus: int, iterations: int) -> dict[str, float]:
    """The flow's wall time, split at its sweep task run's start and end."""
    from prefect.client.orchestration import get_client

    from benchmarks._prefect import task_runs_named
    from deployments.testing.watch import wait_for
    from prefect_ray_lifecycle.blocks import RayCluster
    from prefect_ray_lifecycle.flows.tune_sweep import tune_sweep

    sweep = sweep_config(iterations)
    start = time.perf_counter()
    began = time.time()
    result = tune_sweep(
        sweep=sweep,
        ray_cluster=RayCluster(num_cpus=num_cpus),
        storage_root=str(storage),
        evaluation_episodes=1,
    )
    elapsed = time.perf_counter() - start
    ended = began + elapsed
    assert len(result.trials) == TRIALS
    assert {t.iterations for t in result.trials} == {iterations}
    with get_client(sync_client=True) as client:

        def finished() -> list:  # task runs are recorded from events, a moment later
            runs = task_runs_named(client, result.metrics["flow_run_id"], "run-tune-sweep")
            return [r for r in runs if r.end_time]

        (sweep_run,) = wait_for("the sweep's task run is recorded", finished, 60, 0.5)
    task_start = sweep_run.start_time.timestamp()
    task_end = sweep_run.end_time.timestamp()
    return {
        "total": elapsed,
        "before_sweep_task": task_start - began,
        "sweep_task": task_end - task_start,
        "after_sweep_task": ended - task_end,
    }


def drain_prefect() -> None:
    """Send queued logs and events while the benchmark's Prefect server still runs."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (EventsWorker, APILogWorker):
        worker.drain_all(timeout=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both sides (>= 3)")
    parser.add_argument(
        "--warmup-iterations",
        type=int,
        default=1,
        help="iterations of the uncounted warm-up sweep of each side (0: no warm-up)",
    )
    parser.add_argument(
        "--raw-via-block",
        action="store_true",
        help="also time the raw script connected through the RayCluster block",
    )
    args = parser.parse_args(argv)

    # Import what both sides use before any timing: neither pays the other's imports.
    import prefect_ray_lifecycle.flows.tune_sweep  # noqa: F401
    import prefect_ray_lifecycle.workloads.rl.rllib  # noqa: F401
    from benchmarks._prefect import prefect_api

    work = Path(tempfile.mkdtemp(prefix="bench-tune-"))
    try:
        sides = ["raw", "flow"] + (["raw_block"] if args.raw_via_block else [])
        times: dict[str, list[float]] = {side: [] for side in sides}
        stages: dict[str, list[float]] = {}
        with prefect_api():
            if args.warmup_iterations:
                for side in sides:
                    storage = work / f"warmup-{side}"
                    if side == "flow":
                        run_flow_stages(storage, args.num_cpus, args.warmup_iterations)
                    else:
                        run_raw(storage, args.num_cpus, args.warmup_iterations, side == "raw_block")
            for round_ in range(args.rounds):
                for side in sides if round_ % 2 == 0 else sides[::-1]:
                    storage = work / f"{side}-{round_}"
                    if side == "flow":
                        split = run_flow_stages(storage, args.num_cpus, args.iterations)
                        times[side].append(split.pop("total"))
                        for stage, seconds in split.items():
                            stages.setdefault(stage, []).append(seconds)
                    else:
                        via_block = side == "raw_block"
                        times[side].append(
                            run_raw(storage, args.num_cpus, args.iterations, via_block)
                        )
            drain_prefect()
        raw_s = statistics.median(times["raw"])
        flow_s = statistics.median(times["flow"])
        print(
            json.dumps(
                {
                    "trials": TRIALS,
                    "iterations": args.iterations,
                    "warmup_iterations": args.warmup_iterations,
                    "num_cpus": args.num_cpus,
                    "runs": {k: [round(t, 2) for t in v] for k, v in times.items()},
                    "flow_stages": {k: [round(t, 2) for t in v] for k, v in stages.items()},
                }
            )
        )
        print(
            json.dumps(
                {
                    "raw_s": round(raw_s, 2),
                    "flow_s": round(flow_s, 2),
                    "ratio": round(flow_s / raw_s, 3),
                    "fixed_cost_s": round(flow_s - raw_s, 2),
                    "flow_stages_s": {k: round(statistics.median(v), 2) for k, v in stages.items()},
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
