"""The same Tune sweep and Ray Data prep on one Ray node and on two nodes with the same total
CPUs, plus the sweep through Ray Client (`ray://`) against the same sweep by GCS address.

One node: a `ray start --head` offering --cpus CPUs. Two nodes: a head offering --cpus minus
--worker-cpus, and a worker node (deployments.worker_node) offering --worker-cpus. Each run
goes through the project's flows on a RayCluster block pointed at the head: `tune-sweep` (the
4-trial PPO CartPole sweep of benchmarks.tune_overhead, FIFO, a fixed number of iterations)
and `data-prep` (benchmarks.data_prep's generated parquet, tokenized). Ray's start is outside
the timing; a local Prefect server is started first. The configurations alternate order round
by round; medians are reported.

Both nodes run on this one machine and share its cores, so the two-node figures measure the
cost of spreading work over two raylets (scheduling, object transfers, a second runtime_env
setup), not a speed-up. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from deployments import local, ports
from deployments.worker_node import join

NOTE = (
    "one machine: both nodes share its cores, so the two-node times show the overhead of "
    "spreading work over two raylets, not a speed-up"
)


@contextlib.contextmanager
def cluster(state_dir: Path, head_cpus: int, worker_cpus: int = 0) -> Iterator[dict]:
    """A head (and a worker node when worker_cpus) on free ports; the block's fields, and the
    head's Ray Client address."""
    (port,) = ports.free_ports(1, spacing=local.RAY_DASHBOARD_PORT - local.DEFAULT_PORTS["ray"])
    (head,) = local.services(state_dir, {"ray": port}, ("ray",), ray_num_cpus=head_cpus)
    # A Ray Client connection starts a server process per client on the head; on a busy
    # machine that takes longer than the head's default 30 s wait.
    head = dataclasses.replace(
        head, extra_env=(("RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S", "120"),)
    )
    outcome = local.start(head)
    if not outcome.startswith("started"):
        raise RuntimeError(f"ray head: {outcome}")
    try:
        argv = local.running(head)["argv"]
        client = f"ray://{local.HOST}:{argv[argv.index('--ray-client-server-port') + 1]}"
        block = {"address": head.url, "auth_token": head.ray_token()}
        dashboard = f"http://{local.HOST}:{head.dashboard_port}"
        with contextlib.ExitStack() as nodes:
            if worker_cpus:
                nodes.enter_context(
                    join(head.url, dashboard, head.ray_token_file, state_dir / "w2", worker_cpus)
                )
            yield {"block": block, "client": client}
    finally:
        local.stop(head)


def sweep(block: dict, storage: Path, iterations: int) -> float:
    from benchmarks.tune_overhead import TRIALS, sweep_config
    from prefect_ray_lifecycle.blocks import RayCluster
    from prefect_ray_lifecycle.flows.tune_sweep import tune_sweep

    start = time.perf_counter()
    result = tune_sweep(
        sweep=sweep_config(iterations),
        ray_cluster=RayCluster(**block),
        storage_root=str(storage),
        evaluation_episodes=1,
    )
    elapsed = time.perf_counter() - start
    assert len(result.trials) == TRIALS and {t.iterations for t in result.trials} == {iterations}
    return elapsed


def prep(block: dict, source: Path, output: Path, rows: int) -> float:
    from benchmarks.data_prep import flow_params
    from prefect_ray_lifecycle.blocks import RayCluster
    from prefect_ray_lifecycle.flows.data_prep import data_prep

    # A fresh output each time: the same output would be a cache hit.
    params = flow_params(source, output)
    start = time.perf_counter()
    result = data_prep(params, ray_cluster=RayCluster(**block))
    elapsed = time.perf_counter() - start
    assert result.rows_train + result.rows_eval == rows and not result.cache_hit, result
    return elapsed


def client_pairs(state: Path, args: argparse.Namespace, times: dict[str, list[float]]):
    """The sweep by GCS address and through ray://, on one head, the order alternating round
    by round; the Ray Client error, if any."""
    with cluster(state, args.cpus) as ray:
        via = {"by_address": ray["block"], "ray_client": {**ray["block"], "address": ray["client"]}}
        for round_ in range(args.rounds):
            for how in via if round_ % 2 == 0 else list(via)[::-1]:
                try:
                    elapsed = sweep(via[how], state / f"{how}-{round_}", args.iterations)
                except Exception as error:  # reported in the JSON, not fatal
                    if how == "by_address":
                        raise
                    return f"{type(error).__name__}: {error}"[:300]
                times.setdefault(f"sweep_{how}", []).append(elapsed)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cpus", type=int, default=4, help="CPUs of the cluster, in total")
    parser.add_argument("--worker-cpus", type=int, default=2, help="CPUs of the second node")
    parser.add_argument("--iterations", type=int, default=5, help="iterations per trial")
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds (>= 3); layouts alternate first"
    )
    parser.add_argument("--no-client", action="store_true", help="skip the ray:// sweep")
    args = parser.parse_args(argv)
    if not 0 < args.worker_cpus < args.cpus:
        parser.error("--worker-cpus must be between 0 and --cpus")

    # Imports before any timing.
    import prefect_ray_lifecycle.flows.data_prep  # noqa: F401
    import prefect_ray_lifecycle.flows.tune_sweep  # noqa: F401
    from benchmarks._prefect import prefect_api
    from benchmarks.data_prep import generate
    from benchmarks.tune_overhead import TRIALS, drain_prefect

    # Short: Ray's unix sockets live under the nodes' temp dirs.
    work = Path(tempfile.mkdtemp(prefix="bso-", dir="/tmp"))
    layouts = {
        "one_node": (args.cpus, 0),
        "two_nodes": (args.cpus - args.worker_cpus, args.worker_cpus),
    }
    times: dict[str, list[float]] = {}
    client_error = None
    try:
        generate(work / "source", args.rows, args.files)
        with prefect_api():
            for round_ in range(args.rounds):
                order = list(layouts) if round_ % 2 == 0 else list(layouts)[::-1]
                for layout in order:
                    state = work / f"{layout[:3]}{round_}"
                    with cluster(state, *layouts[layout]) as ray:
                        times.setdefault(f"sweep_{layout}", []).append(
                            sweep(ray["block"], state / "sweeps", args.iterations)
                        )
                        times.setdefault(f"prep_{layout}", []).append(
                            prep(ray["block"], work / "source", state / "prepared", args.rows)
                        )
            if not args.no_client:
                # Last: a failed Ray Client connection can leave this process's Ray unusable.
                client_error = client_pairs(work / "client", args, times)
            drain_prefect()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    median = {key: statistics.median(values) for key, values in times.items()}
    print(json.dumps({"runs": {k: [round(t, 2) for t in v] for k, v in times.items()}}))

    def pair(kind: str) -> dict:
        one, two = median[f"{kind}_one_node"], median[f"{kind}_two_nodes"]
        return {
            "one_node_s": round(one, 2),
            "two_nodes_s": round(two, 2),
            "ratio": round(two / one, 3),
        }

    client = {"error": client_error} if client_error else None
    if client is None and "sweep_ray_client" in median:
        by_address, through = median["sweep_by_address"], median["sweep_ray_client"]
        client = {
            "by_address_s": round(by_address, 2),
            "ray_client_s": round(through, 2),
            "ratio": round(through / by_address, 3),
        }
    print(
        json.dumps(
            {
                "cpus": {"one_node": [args.cpus], "two_nodes": list(layouts["two_nodes"])},
                "sweep": {"trials": TRIALS, "iterations": args.iterations, **pair("sweep")},
                "data_prep": {"rows": args.rows, **pair("prep")},
                "ray_client": client,
                "rounds": args.rounds,
                "statistic": "median",
                "machine_cpus": os.cpu_count(),
                "note": NOTE,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
