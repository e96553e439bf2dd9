"""Data prep through the flow vs the equivalent raw Ray Data script, at two sizes, in one run.

Both tokenize the same generated parquet dataset with workloads.data.transforms.tokenize_text on
an embedded local Ray of the same size, timed end to end, like for like: from before Ray starts
until it has stopped (the raw script's `ray.shutdown()` returned; the flow, which stops its
Ray in the background while it publishes, returned and its Ray has stopped): `flow_s`, `raw_s`
and `ratio`. `flow_s_until_flow_end` and `ratio_until_flow_end` stop the flow's clock when its
run returns, its Ray maybe still stopping.
The flow adds what the raw script lacks: fingerprinting, per-file checks, row
validation and quarantine, the hash split, atomic publish, the asset and artifact. A local
Prefect server is started first and each side runs once on a small dataset, all outside the
timing, so that no round pays a process's first imports. Each round runs both sides, the
order alternating round by round, so drift in machine load falls on both; medians over the
rounds are reported, with the flow's time split at its prepare_dataset task run: before it
(engine, plan and fingerprint, cache check), the task (Ray start, checks, pipeline: what
the raw script does) and after it (verdict, publish, artifact, flow end).
Last line: one JSON object, `rows`/`ratio` for --rows and `rows_10m`/`ratio_10m` for
--large-rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DEFAULT_ROWS = 2_000_000
DEFAULT_LARGE_ROWS = 10_000_000
DEFAULT_FILES = 8
WARMUP_ROWS = 20_000
MAX_LENGTH = 64
TOKENIZE = "prefect_ray_lifecycle.workloads.data.transforms:tokenize_text"


def generate(directory: Path, rows: int, files: int) -> None:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = np.array(["ray", "data", "prefect", "flow", "token", "model", "batch", "train"])
    per_file = -(-rows // files)
    for i in range(files):
        ids = np.arange(i * per_file, min(rows, (i + 1) * per_file))
        picks = words[rng.integers(0, len(words), size=(len(ids), 6))]
        text = [" ".join(row) for row in picks]
        pq.write_table(
            pa.table({"id": ids, "text": text, "score": rng.random(len(ids))}),
            directory / f"part-{i:03d}.parquet",
        )


def run_raw(source: Path, output: Path, num_cpus: int) -> float:
    import ray

    from prefect_ray_lifecycle.workloads.data.transforms import tokenize_text

    start = time.perf_counter()
    ray.init(num_cpus=num_cpus, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    try:
        (
            ray.data.read_parquet(str(source))
            .map_batches(
                tokenize_text, batch_format="pyarrow", fn_kwargs={"max_length": MAX_LENGTH}
            )
            .write_parquet(str(output))
        )
    finally:
        ray.shutdown()
    return time.perf_counter() - start


def flow_params(source: Path, output: Path):
    """The flow's parameters for the generated dataset: the raw script's work, as a flow."""
    from prefect_ray_lifecycle.flows.data_prep import DataPrepParams

    return DataPrepParams(
        source=str(source),
        output=str(output),
        split_key="id",
        expected_schema={"id": "int64", "text": "string", "score": "float64"},
        required_columns=["text"],
        transform=TOKENIZE,
        transform_kwargs={"max_length": MAX_LENGTH},
        transform_batch_format="pyarrow",
    )


def run_flow(source: Path, output: Path, num_cpus: int) -> tuple[dict[str, float], dict]:
    """The flow's wall time, split at its prepare_dataset task run's start and end; and its
    result."""
    from prefect_ray_lifecycle.blocks import RayCluster
    from prefect_ray_lifecycle.control.ray_shutdown import wait_for_shutdown
    from prefect_ray_lifecycle.flows.data_prep import data_prep

    params = flow_params(source, output)
    start = time.perf_counter()
    began = time.time()
    state = data_prep(params, ray_cluster=RayCluster(num_cpus=num_cpus), return_state=True)
    elapsed = time.perf_counter() - start
    # The flow's Ray stops in the background while it publishes; reported apart, and waited
    # for before anything else starts Ray in this process.
    wait_for_shutdown()
    with_ray_stopped = time.perf_counter() - start
    result = state.result()
    task_start, task_end = prepare_task_span(state.state_details.flow_run_id)
    stages = {
        "until_flow_end": elapsed,
        "total": with_ray_stopped,
        "before_prepare": task_start - began,
        "prepare": task_end - task_start,
        "after_prepare": began + elapsed - task_end,
    }
    return stages, result.model_dump()


def prepare_task_span(flow_run_id, timeout: float = 20.0) -> tuple[float, float]:
    """Start and end (epoch seconds) of the flow run's prepare_dataset task run; Prefect
    records task runs from events, so they may land a moment after the flow returns."""
    from prefect.client.orchestration import get_client

    from benchmarks._prefect import task_runs_named
    from deployments.testing.watch import wait_for

    with get_client(sync_client=True) as client:

        def finished() -> list:
            runs = task_runs_named(client, flow_run_id, "prepare_dataset")
            return [r for r in runs if r.end_time]

        (run,) = wait_for("the prepare_dataset task run is recorded", finished, timeout, 0.5)
    return run.start_time.timestamp(), run.end_time.timestamp()


def output_rows(path: Path) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in sorted(path.rglob("*.parquet")))


def measure(work: Path, rows: int, args: argparse.Namespace) -> dict:
    """Medians of `args.rounds` rounds of both sides on a dataset of `rows` rows."""
    source = work / f"source-{rows}"
    generate(source, rows, args.files)
    raw_times: list[float] = []
    flow_stages: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for side in ("raw", "flow") if round_ % 2 == 0 else ("flow", "raw"):
            # A fresh output each time: the same output would be a flow cache hit.
            output = work / f"{side}-out"
            if side == "raw":
                raw_times.append(run_raw(source, output, args.num_cpus))
                assert output_rows(output) == rows
            else:
                stages, result = run_flow(source, output, args.num_cpus)
                assert result["rows_train"] + result["rows_eval"] == rows, result
                assert not result["cache_hit"], result
                for stage, seconds in stages.items():
                    flow_stages.setdefault(stage, []).append(seconds)
            shutil.rmtree(output)
    shutil.rmtree(source)
    print(
        f"{rows} rows: raw_s {[round(t, 2) for t in raw_times]}, flow_s "
        f"{ {k: [round(t, 2) for t in v] for k, v in flow_stages.items()} }",
        file=sys.stderr,
    )
    raw_s = statistics.median(raw_times)
    flow_s = statistics.median(flow_stages.pop("total"))  # until its Ray has stopped, as raw's
    flow_end_s = statistics.median(flow_stages.pop("until_flow_end"))
    return {
        "rows": rows,
        "raw_s": round(raw_s, 2),
        "flow_s": round(flow_s, 2),
        "ratio": round(flow_s / raw_s, 3),
        "flow_s_until_flow_end": round(flow_end_s, 2),
        "ratio_until_flow_end": round(flow_end_s / raw_s, 3),
        "rows_per_s": round(rows / flow_s),
        "flow_stages_s": {k: round(statistics.median(v), 2) for k, v in flow_stages.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="the reference size")
    parser.add_argument(
        "--large-rows",
        type=int,
        default=DEFAULT_LARGE_ROWS,
        help="the large size, reported as rows_10m/ratio_10m (0: skip it)",
    )
    parser.add_argument("--files", type=int, default=DEFAULT_FILES)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both sides (>= 3)")
    args = parser.parse_args(argv)

    # Imports outside the timing, as `import ray` is for the raw script.
    import prefect_ray_lifecycle.flows.data_prep  # noqa: F401
    from benchmarks._prefect import prefect_api

    work = Path(tempfile.mkdtemp(prefix="bench-data-prep-"))
    try:
        with prefect_api():
            warmup = work / "warmup"
            generate(warmup, WARMUP_ROWS, 2)
            run_raw(warmup, work / "warmup-raw", args.num_cpus)
            run_flow(warmup, work / "warmup-flow", args.num_cpus)
            figures = measure(work, args.rows, args)
            if args.large_rows:
                large = measure(work, args.large_rows, args)
                figures.update({f"{k}_10m": v for k, v in large.items()})
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)  # before the server goes: its last logs go there
        print(json.dumps({**figures, "rounds": args.rounds, "statistic": "median"}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
