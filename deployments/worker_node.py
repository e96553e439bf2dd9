"""A worker node that joins a running Ray head on this machine: `ray start --address HEAD
--block` with its own temp dir, CPUs and custom resources, stopped by pid. Tests and benchmarks
use it for a real second node; on a real cluster KubeRay's worker groups do this (see
docs/kuberay.md)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deployments.local import RAY_ADDRESS_ENV, node_env_defaults
from deployments.ports import HOST, free_ports
from deployments.processes import group_alive

# The custom resource a joined node offers (one per CPU), so work is placed on it by name.
WORKER_RESOURCE = "worker_node"
JOIN_TIMEOUT_S = 90.0
OBJECT_STORE_BYTES = 200 * 1024**2


@dataclass(frozen=True)
class WorkerNode:
    process: subprocess.Popen
    temp_dir: Path
    node_id: str
    log_file: Path

    def raylet_pid(self) -> int:
        """The node's raylet: the `raylet` child of the `ray start --block` process."""
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.process.pid and name == "raylet":
                return int(proc.name)
        raise LookupError(f"no raylet under pid {self.process.pid}; see {self.log_file}")


def _state_api(dashboard_url: str, token: str, query: str) -> list[dict]:
    request = urllib.request.Request(
        f"{dashboard_url}/api/v0/{query}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["data"]["result"]["result"]


def alive_nodes(dashboard_url: str, token: str) -> list[dict]:
    """The cluster's alive nodes, from the head's state API."""
    nodes = _state_api(dashboard_url, token, "nodes?limit=1000&detail=true")
    return [node for node in nodes if node["state"] == "ALIVE"]


def alive_actors(dashboard_url: str, token: str, class_name: str) -> list[dict]:
    """The cluster's alive actors of one class (with pid and node_id), from the state API."""
    query = (
        "actors?limit=1000&detail=true&filter_keys=class_name&filter_predicates=%3D"
        f"&filter_values={class_name}"
    )
    return [a for a in _state_api(dashboard_url, token, query) if a["state"] == "ALIVE"]


@contextlib.contextmanager
def join(
    address: str,
    dashboard_url: str,
    token_file: Path,
    temp_dir: Path,
    cpus: int = 2,
    resources: dict[str, float] | None = None,
) -> Iterator[WorkerNode]:
    """Start a node that offers `cpus` CPUs, no GPU, and `resources` (default: WORKER_RESOURCE,
    one per CPU); wait until the head lists it; stop it when the block ends. Its workers see
    only what Ray ships them: PYTHONPATH is not passed on. `temp_dir` must be short (Ray's
    unix sockets live under it)."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    log_file = temp_dir.with_suffix(".log")
    token = token_file.read_text().strip()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env.update(
        RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file)
    )
    node_env_defaults(env)  # see deployments.local
    env[RAY_ADDRESS_ENV] = address  # its workers' own cluster: see deployments.local
    argv = [str(Path(sys.executable).parent / "ray"), "start", "--block"]
    argv += ["--address", address, "--node-ip-address", HOST]
    argv += ["--temp-dir", str(temp_dir), "--num-cpus", str(cpus), "--num-gpus", "0"]
    argv += ["--resources", json.dumps(resources or {WORKER_RESOURCE: cpus})]
    argv += ["--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
    # The default agent port (52365) would collide with another node on this machine.
    argv += ["--dashboard-agent-listen-port", str(free_ports(1)[0])]
    before = {node["node_id"] for node in alive_nodes(dashboard_url, token)}
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            argv,
            env=env,
            cwd=temp_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            joined = [n for n in alive_nodes(dashboard_url, token) if n["node_id"] not in before]
            if joined:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_file.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the worker node did not join {address}: {tail}")
            time.sleep(0.3)
        yield WorkerNode(process, temp_dir, joined[0]["node_id"], log_file)
    finally:
        stop(process)


PREEMPTION = "DRAIN_NODE_REASON_PREEMPTION"


def drain(
    address: str, node_id: str, deadline_s: int, env: dict[str, str], message: str = "spot reclaim"
) -> None:
    """`ray drain-node` with the preemption reason and a deadline: the notice a cloud's Spot
    reclaim gives through the autoscaler. Ray never kills the node itself; the caller does,
    after the deadline (stop)."""
    argv = [str(Path(sys.executable).parent / "ray"), "drain-node", "--address", address]
    argv += ["--node-id", node_id, "--reason", PREEMPTION, "--reason-message", message]
    argv += ["--deadline-remaining-seconds", str(deadline_s)]
    done = subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise RuntimeError(f"ray drain-node failed: {done.stdout}{done.stderr}")


def stop(process: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM to the node's process group (ray start, raylet, its workers), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and group_alive(process.pid):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(0.2)
        if not group_alive(process.pid):
            return
