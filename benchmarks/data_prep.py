"""Data prep through the flow vs the equivalent raw Ray Data script, in one run.

Both tokenize the same generated parquet dataset with workloads.transforms.tokenize_text on
an embedded local Ray of the same size, timed end to end (Ray start included in both). The
flow adds what the raw script lacks: fingerprinting, per-file checks, row validation and
quarantine, the hash split, atomic publish, the asset and artifact. A local Prefect server
is started first, outside the timing. Last line: one JSON object.
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
DEFAULT_FILES = 8
MAX_LENGTH = 64
TOKENIZE = "workloads.transforms:tokenize_text"


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

    from workloads.transforms import tokenize_text

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


def run_flow(source: Path, output: Path, num_cpus: int) -> tuple[float, dict]:
    # Imports stay outside the timing, as `import ray` does for the raw script.
    from blocks import RayCluster
    from flows.data_prep import DataPrepParams, data_prep
    from ray_runner import RayClusterTaskRunner  # noqa: F401

    params = DataPrepParams(
        source=str(source),
        output=str(output),
        split_key="id",
        expected_schema={"id": "int64", "text": "string", "score": "float64"},
        required_columns=["text"],
        transform=TOKENIZE,
        transform_kwargs={"max_length": MAX_LENGTH},
        transform_batch_format="pyarrow",
    )
    start = time.perf_counter()
    result = data_prep(params, ray_cluster=RayCluster(num_cpus=num_cpus))
    return time.perf_counter() - start, result.model_dump()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS)
    parser.add_argument("--files", type=int, default=DEFAULT_FILES)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="raw/flow pairs, order alternating; the medians are reported",
    )
    args = parser.parse_args(argv)

    from benchmarks._prefect import prefect_api

    work = Path(tempfile.mkdtemp(prefix="bench-data-prep-"))
    try:
        generate(work / "source", args.rows, args.files)
        raw_times, flow_times = [], []
        with prefect_api():
            for i in range(args.repeats):
                for kind in ("raw", "flow") if i % 2 == 0 else ("flow", "raw"):
                    if kind == "raw":
                        raw_times.append(
                            run_raw(work / "source", work / f"raw-out-{i}", args.num_cpus)
                        )
                        raw_rows = pq.read_table(work / f"raw-out-{i}", columns=["id"]).num_rows
                        assert raw_rows == args.rows, (raw_rows, args.rows)
                        continue
                    # A fresh output each time: the same output would be a cache hit.
                    flow_s, result = run_flow(
                        work / "source", work / f"flow-out-{i}", args.num_cpus
                    )
                    flow_times.append(flow_s)
                    flow_rows = result["rows_train"] + result["rows_eval"]
                    assert flow_rows == args.rows and not result["cache_hit"], result
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)  # before the server goes: its last logs go there
        raw_s, flow_s = statistics.median(raw_times), statistics.median(flow_times)
        print(f"raw_s: {raw_times} flow_s: {flow_times}", file=sys.stderr)
        print(
            json.dumps(
                {
                    "rows": args.rows,
                    "raw_s": round(raw_s, 2),
                    "flow_s": round(flow_s, 2),
                    "ratio": round(flow_s / raw_s, 3),
                    "rows_per_s": round(args.rows / flow_s),
                }
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
