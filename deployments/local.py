"""Local services for the embedded default: Prefect, a lean MLflow, MLflow's webhook receiver.

`python -m deployments.local up|down|status|env`. Everything binds 127.0.0.1 and keeps its
state under one git-ignored folder (`.local/` by default). `down` stops only what `up`
started: each pid file records the process start time, so a recycled pid is never killed.
A Ray head (`ray start --head --block`) can be managed the same way with `--ray`; the flows
themselves start an embedded Ray when their RayCluster block has no address.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from deployments.ports import HOST, free_ports_besides, port_free
from deployments.processes import group_alive, start_time
from prefect_ray_lifecycle.workloads.constants import GCS_PORT_WAIT_ENV, GCS_PORT_WAIT_S

# deployments/ is this checkout's tooling, not part of the installed package: the services
# it starts from other folders import it from here.
CHECKOUT = Path(__file__).resolve().parent.parent
DEFAULT_STATE_DIR = CHECKOUT / ".local"
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000, "receiver": 4210, "ray": 6379}
RECEIVER_WEBHOOK_PATH = "/mlflow"  # where deployments.receiver takes MLflow's deliveries
RECEIVER_HEALTH_PATH = "/health"
# MLflow caches its webhook list per event (60 s by default): a webhook registered after an
# event of that kind would be skipped for up to a minute.
MLFLOW_WEBHOOK_CACHE_TTL_S = 1
RAY_DASHBOARD_PORT = 8265
# How long an idle worker lives once the node has more workers than CPUs (Ray's default: 1 s).
# Not the soft limit on workers (RAY_num_workers_soft_limit, its CPUs by default): raised, Ray
# 2.60 also starts workers up to it for queued tasks that only the node's CPUs can run, and
# each imports the job's code (200 Prefect task runs on 2 CPUs started 22 workers at 32).
IDLE_WORKER_TTL_ENV, IDLE_WORKER_TTL_MS = "RAY_idle_worker_killing_time_threshold_ms", "300000"
# Ray 2.60's `ray start --block` drains its node on SIGTERM before it stops anything, for up to
# this many seconds (30 by default) so that Serve can move replicas off it: a local node has
# nowhere to move them (its head and proxy stop with it), so every stop sat out the whole
# wait (15 s here, then SIGKILL). Off for the nodes this tooling starts, unless set.
SHUTDOWN_DRAIN_ENV, NO_SHUTDOWN_DRAIN = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0"
# What an idle local stack costs without them, measured with Serve started and nothing else
# running (90 s, 2 cores, the whole machine): 15.0 CPU-s at Ray's defaults, 11.5 with both; a
# test session runs two heads for half an hour, under load. Ray's metrics (every worker
# reports to its node's agent, which exports for Prometheus) are not scraped by anything the
# local stack runs; Serve's controller checks its deployments 10 times a second by default,
# and 4 are enough here (a replica's start or death is seen within 0.25 s; health checks keep
# their own period). Ray starts its workers at niceness 15 (RAY_worker_niceness): on a small
# machine shared with Prefect, MLflow and the flow processes at 0, the work under test
# (replicas, routers, trials, Train workers) then starves behind the harness that polls for
# it wherever the CPUs are saturated (docs/testing.md has the measurements). Here workers run
# at the niceness of what started the node. A node's first driver prestarts a worker per CPU
# for jobs without a runtime env (RAY_JOB_ID ffffffff); every job here has one, so they only
# idled (2 per head): off. Without them a job's first task got two workers started, one never
# used: a node starts RAY_worker_maximum_startup_concurrency at once (its CPUs by default);
# at 1, one (docs/testing.md has the figures). Every node this tooling starts gets all these.
NODE_ENV_DEFAULTS = (
    (SHUTDOWN_DRAIN_ENV, NO_SHUTDOWN_DRAIN),
    ("RAY_enable_metrics_collection", "0"),
    ("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.25"),
    ("RAY_worker_niceness", "0"),
    ("RAY_prestart_worker_first_driver", "0"),
    ("RAY_worker_maximum_startup_concurrency", "1"),
)
# Ray code in a node's workers that looks its own cluster up (the state API: Ray Train V2's
# PlacementGroupCleaner asks it whether a Train controller is alive) finds every GCS on the
# machine and gives up when there are several ("Found multiple active Ray instances"), as with
# a test session's heads. The cleaner then never removes the worker group of a Tune trial that
# ASHA stopped: its CPUs stay reserved after the sweep ends. Each node this tooling starts
# tells its workers (they inherit its environment) which cluster is theirs.
RAY_ADDRESS_ENV = "RAY_ADDRESS"
# Prefect records task runs from their state events, one database write per event by default;
# 20 at a time (or what came within a second) cut a local server's CPU over a 300-task flow
# from 15.8 to 5.3 s (a state can show a second late). Where the user set none.
PREFECT_SERVER_DEFAULTS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "20",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0


def node_env_defaults(env: dict[str, str], more: tuple[tuple[str, str], ...] = ()) -> None:
    """Give a Ray node's environment NODE_ENV_DEFAULTS (and `more`) where the user set none."""
    for key, value in (*NODE_ENV_DEFAULTS, *more):
        env.setdefault(key, value)


class ServiceError(RuntimeError):
    """A local service could not be started or stopped; the message says which and why."""


@dataclass(frozen=True)
class Service:
    name: str
    port: int
    state_dir: Path
    num_cpus: int | None = None  # ray only: logical CPUs the head offers
    prefect_port: int | None = None  # receiver only: the Prefect server it emits events to
    extra_env: tuple[tuple[str, str], ...] = ()  # set last, over the service's own settings

    @property
    def url(self) -> str:
        if self.name == "ray":
            return f"{HOST}:{self.port}"
        return f"http://{HOST}:{self.port}"

    @property
    def health_url(self) -> str:
        if self.name == "prefect":
            return f"{self.url}/api/health"
        if self.name == "mlflow":
            return f"{self.url}/health"
        if self.name == "receiver":
            return f"{self.url}{RECEIVER_HEALTH_PATH}"
        return f"http://{HOST}:{self.dashboard_port}/api/version"

    @property
    def dashboard_port(self) -> int:
        return self.port + (RAY_DASHBOARD_PORT - DEFAULT_PORTS["ray"])

    @property
    def webhook_url(self) -> str:
        """receiver only: the URL MLflow delivers registry webhooks to."""
        return f"{self.url}{RECEIVER_WEBHOOK_PATH}"

    @property
    def ray_token_file(self) -> Path:
        """Ray 2.60 token auth: the head's token, kept with its state (mode 0600)."""
        return self.state_dir / "ray_auth_token"

    def ray_token(self) -> str:
        return _state_secret(self.ray_token_file, lambda: secrets.token_hex(32))

    def mlflow_webhook_key(self) -> str:
        """The Fernet key MLflow encrypts webhook secrets with: without a fixed one it makes a
        new key per start and cannot read the secrets it stored before a restart."""
        key_file = self.state_dir / "mlflow_webhook_key"
        return _state_secret(key_file, lambda: base64.urlsafe_b64encode(os.urandom(32)).decode())

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "pids" / f"{self.name}.json"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "logs" / f"{self.name}.log"

    def command(self) -> tuple[list[str], dict[str, str]]:
        argv, env = self._command()
        return argv, {**env, **dict(self.extra_env)}

    def _command(self) -> tuple[list[str], dict[str, str]]:
        bin_dir = Path(sys.executable).parent
        env = dict(os.environ)
        if self.name == "prefect":
            env.update(
                PREFECT_HOME=str(self.state_dir / "prefect"),
                PREFECT_SERVER_ANALYTICS_ENABLED="false",
                PREFECT_SERVER_API_HOST=HOST,
                PREFECT_UI_API_URL=f"{self.url}/api",
                # Concurrency slots are leases; kept in memory (Prefect's default) they die
                # with the server while the slot counts in its database do not: every slot
                # held at a restart would stay taken for good. On disk they expire instead.
                PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=(
                    "prefect.server.concurrency.lease_storage.filesystem"
                ),
            )
            env = {**PREFECT_SERVER_DEFAULTS, **env}
            env.pop("PREFECT_API_URL", None)
            argv = [str(bin_dir / "prefect"), "server", "start", "--host", HOST]
            return [*argv, "--port", str(self.port)], env
        if self.name == "mlflow":
            root = self.state_dir / "mlflow"
            (root / "artifacts").mkdir(parents=True, exist_ok=True)
            env.update(
                MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
                # Local only: the receiver listens on 127.0.0.1 over http, which MLflow's
                # webhook delivery refuses by default (https to a public address only).
                MLFLOW_WEBHOOK_ALLOWED_SCHEMES="http,https",
                MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS="true",
                MLFLOW_WEBHOOK_CACHE_TTL=str(MLFLOW_WEBHOOK_CACHE_TTL_S),
                MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY=self.mlflow_webhook_key(),
            )
            argv = [str(bin_dir / "mlflow"), "server", "--workers", "1", "--host", HOST]
            argv += ["--port", str(self.port), "--backend-store-uri", f"sqlite:///{root}/mlflow.db"]
            return [*argv, "--artifacts-destination", str(root / "artifacts")], env
        if self.name == "receiver":
            env.update(
                PREFECT_HOME=str(self.state_dir / "prefect"),
                PREFECT_API_URL=f"http://{HOST}:{self.prefect_port}/api",
                PYTHONPATH=os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")])),
            )
            argv = [sys.executable, "-m", "deployments.receiver", "--host", HOST]
            return [*argv, "--port", str(self.port)], env
        ray_tmp = self.state_dir / "ray"
        ray_tmp.mkdir(parents=True, exist_ok=True)
        self.ray_token()
        env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token")
        env.setdefault(GCS_PORT_WAIT_ENV, GCS_PORT_WAIT_S)
        # Ray kills an idle worker after 1 s once the node has more workers than CPUs, and a
        # one-node head with Serve already does (controller, proxy, routers, versions): every
        # Serve app build (one per version rolled out) then started a fresh worker that
        # imported Ray, Serve and the app again, ~1 CPU-s each. Kept idle a while, they are
        # reused.
        node_env_defaults(env, ((IDLE_WORKER_TTL_ENV, IDLE_WORKER_TTL_MS),))
        env["RAY_AUTH_TOKEN_PATH"] = str(self.ray_token_file)
        env.pop("RAY_AUTH_TOKEN", None)  # a client's token in this shell is not the head's
        env[RAY_ADDRESS_ENV] = f"{HOST}:{self.port}"  # for its workers: see RAY_ADDRESS_ENV
        argv = [str(bin_dir / "ray"), "start", "--head", "--block", "--node-ip-address", HOST]
        argv += ["--port", str(self.port), "--dashboard-host", HOST]
        argv += ["--dashboard-port", str(self.dashboard_port), "--temp-dir", str(ray_tmp)]
        # Fixed defaults (10001, 52365) would collide with another head on this machine.
        # Each picked free now, and never one this head takes itself (the kernel may hand
        # out the dashboard's port, which is not bound yet).
        client_port, agent_port = free_ports_besides({self.port, self.dashboard_port}, 2)
        argv += ["--disable-usage-stats", "--ray-client-server-port", str(client_port)]
        argv += ["--dashboard-agent-listen-port", str(agent_port)]
        if self.num_cpus:
            argv += ["--num-cpus", str(self.num_cpus)]
        return argv, env


def services(
    state_dir: Path = DEFAULT_STATE_DIR,
    ports: dict[str, int] | None = None,
    names: Iterable[str] = ("prefect", "mlflow", "receiver"),
    ray_num_cpus: int | None = None,
) -> list[Service]:
    ports = {**DEFAULT_PORTS, **(ports or {})}
    return [
        Service(
            name,
            ports[name],
            Path(state_dir).resolve(),
            num_cpus=ray_num_cpus if name == "ray" else None,
            prefect_port=ports["prefect"] if name == "receiver" else None,
        )
        for name in names
    ]


def _state_secret(path: Path, make: Callable[[], str]) -> str:
    """A secret kept in the state folder (mode 0600), made once by `make()`."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(make())
    return path.read_text().strip()


def _read_pid(service: Service) -> dict | None:
    return _read_pid_file(service.pid_file)


def _read_pid_file(pid_file: Path) -> dict | None:
    try:
        record = json.loads(pid_file.read_text())
    except (OSError, ValueError):
        return None
    if start_time(record["pid"]) != record["start_time"]:
        return None  # dead, or the pid now belongs to someone else
    return record


def answers(service: Service, timeout: float = 2.0) -> bool:
    request = urllib.request.Request(service.health_url)
    if service.name == "ray" and service.ray_token_file.exists():
        request.add_header("Authorization", f"Bearer {service.ray_token()}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _log_tail(service: Service, lines: int = 20) -> str:
    try:
        return "\n".join(service.log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def running(service: Service) -> dict | None:
    """The pid record of the service when a process we started for it still runs."""
    return _read_pid(service)


def launch(service: Service, argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """Start `argv` in its own session, logging to the service's log, and record its pid
    with the process start time (so `stop` never kills a recycled pid)."""
    for folder in (service.pid_file.parent, service.log_file.parent):
        folder.mkdir(parents=True, exist_ok=True)
    with open(service.log_file, "ab") as log:
        process = subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
    service.pid_file.write_text(
        json.dumps(
            {
                "pid": process.pid,
                "start_time": start_time(process.pid),
                "port": service.port,
                "argv": argv,
            }
        )
    )
    return process


def start(service: Service, timeout: float = START_TIMEOUT_S) -> str:
    """Start one service and wait until it answers; a no-op when ours is already up."""
    if _read_pid(service):
        if _wait_ready(service, None, timeout):
            return "already running"
        raise ServiceError(
            f"{service.name} (pid file {service.pid_file}) runs but does not "
            f"answer at {service.health_url}; see {service.log_file}"
        )
    if not port_free(service.port):
        raise ServiceError(
            f"port {service.port} on {HOST}, wanted by the {service.name} service, is in use "
            f"by another process; stop it or choose another port"
        )
    if service.name == "ray" and not port_free(service.dashboard_port):
        raise ServiceError(
            f"port {service.dashboard_port} on {HOST}, wanted by the ray dashboard, is in use "
            f"by another process; stop it or choose another port"
        )
    argv, env = service.command()
    process = launch(service, argv, env, service.state_dir)
    if not _wait_ready(service, process, timeout):
        stop(service)
        raise ServiceError(
            f"{service.name} did not answer at {service.health_url} within "
            f"{timeout:.0f}s; last log lines:\n{_log_tail(service)}"
        )
    return f"started (pid {process.pid})"


def start_together(chosen: list[Service]) -> list[str]:
    """Start the services side by side (none waits on another: the slowest sets the time, not
    their sum) and return what each start said, in order. If one fails, those this call
    started are stopped again, so nothing is left half up, and its ServiceError is raised."""
    with ThreadPoolExecutor(len(chosen)) as pool:
        futures = [pool.submit(start, service) for service in chosen]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for service, future in reversed(list(zip(chosen, futures, strict=True))):
            if future.exception() is None and future.result().startswith("started"):
                stop(service)
        raise failed[0]
    return [future.result() for future in futures]


def _wait_ready(service: Service, process: subprocess.Popen | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if answers(service):
            return True
        if process is not None and process.poll() is not None:
            return False
        time.sleep(0.3)
    return False


def stop(service: Service, timeout: float = STOP_TIMEOUT_S) -> str:
    """Stop the process group that `start` made, if it is still ours."""
    return _stop_pid_file(service.pid_file, timeout)


def stop_recorded(state_dir: Path, timeout: float = STOP_TIMEOUT_S) -> list[str]:
    """Stop every service a pid file in `state_dir` still names (what a caller that died
    before it stopped them left running)."""
    pid_files = sorted((state_dir / "pids").glob("*.json"))
    return [f"{f.stem}: {_stop_pid_file(f, timeout)}" for f in pid_files]


def _stop_pid_file(pid_file: Path, timeout: float) -> str:
    record = _read_pid_file(pid_file)
    if record is None:
        pid_file.unlink(missing_ok=True)
        return "not running"
    pid = record["pid"]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 5)
        while time.monotonic() < deadline and group_alive(pid):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.2)
        if not group_alive(pid):
            break
    pid_file.unlink(missing_ok=True)
    return f"stopped (pid {pid})"


def status(service: Service) -> dict:
    record = _read_pid(service)
    return {
        "service": service.name,
        "url": service.url,
        "pid": record["pid"] if record else None,
        "answers": answers(service),
    }


def environment(chosen: list[Service]) -> dict[str, str]:
    """Client settings for the started services (`eval "$(python -m deployments.local env)"`)."""
    env: dict[str, str] = {}
    for service in chosen:
        if service.name == "prefect":
            env["PREFECT_API_URL"] = f"{service.url}/api"
        elif service.name == "mlflow":
            env["MLFLOW_TRACKING_URI"] = service.url
        elif service.name == "ray":
            env["RAY_ADDRESS"] = service.url
            env["RAY_AUTH_MODE"] = "token"
            env["RAY_AUTH_TOKEN_PATH"] = str(service.ray_token_file)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.local", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="folder for all state, logs and pid files (default: .local/)",
    )
    for name, port in DEFAULT_PORTS.items():
        parser.add_argument(f"--{name}-port", type=int, default=port)
    parser.add_argument(
        "--ray", action="store_true", help="also manage a Ray head (ray start --head) on --ray-port"
    )
    parser.add_argument(
        "--ray-num-cpus",
        type=int,
        default=None,
        help="logical CPUs the Ray head offers (default: the machine's)",
    )
    args = parser.parse_args(argv)
    names = ["prefect", "mlflow", "receiver"] + (["ray"] if args.ray else [])
    ports = {name: getattr(args, f"{name}_port") for name in DEFAULT_PORTS}
    chosen = services(args.state_dir, ports, names, args.ray_num_cpus)
    if args.command == "env":
        for key, value in environment(chosen).items():
            print(f"export {key}={value}")
        return 0
    if args.command == "status":
        rows = [status(service) for service in chosen]
        for row in rows:
            state = "answers" if row["answers"] else "down"
            print(
                f"{row['service']:8} {row['url']:28} {state}"
                + (f" (pid {row['pid']})" if row["pid"] else "")
            )
        return 0 if all(row["answers"] for row in rows) else 1
    if args.command == "down":
        for service in reversed(chosen):
            print(f"{service.name:8} {stop(service)}")
        return 0
    if shutil.which("mlflow", path=str(Path(sys.executable).parent)) is None:
        print("mlflow is not installed in this environment; run `make install`", file=sys.stderr)
        return 2
    try:
        outcomes = start_together(chosen)
    except ServiceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for service, outcome in zip(chosen, outcomes, strict=True):
        print(f"{service.name:8} {service.url:28} {outcome}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
