"""`python -m deployments.local up|status|down`: idempotent, clear on a taken port, no orphans."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deployments import local, ports, processes


def _cli(state_dir: Path, *args: str, ports: tuple[int, int, int]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "deployments.local",
            *args,
            "--state-dir",
            str(state_dir),
            "--prefect-port",
            str(ports[0]),
            "--mlflow-port",
            str(ports[1]),
            "--receiver-port",
            str(ports[2]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )


@pytest.mark.services  # starts services of its own
def test_up_twice_status_down_leaves_nothing_running(tmp_path):
    picked = tuple(ports.free_ports(3))
    services = ("prefect", "mlflow", "receiver")
    first = _cli(tmp_path, "up", ports=picked)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("started") == len(services)
    pids = [
        json.loads((tmp_path / "pids" / f"{name}.json").read_text())["pid"] for name in services
    ]
    children = subprocess.run(
        ["pgrep", "-g", ",".join(map(str, pids))], capture_output=True, text=True
    ).stdout.split()
    assert len(children) >= len(services)

    second = _cli(tmp_path, "up", ports=picked)
    assert second.returncode == 0 and second.stdout.count("already running") == len(services)

    status = _cli(tmp_path, "status", ports=picked)
    assert status.returncode == 0
    assert f"http://127.0.0.1:{picked[0]}" in status.stdout and "answers" in status.stdout
    # State stays in the chosen folder.
    assert (tmp_path / "mlflow" / "mlflow.db").exists()
    assert (tmp_path / "prefect").is_dir()

    down = _cli(tmp_path, "down", ports=picked)
    assert down.returncode == 0 and down.stdout.count("stopped") == len(services)
    assert not any(processes.process_running(int(pid)) for pid in children)
    assert not list((tmp_path / "pids").glob("*.json"))

    after = _cli(tmp_path, "status", ports=picked)
    assert after.returncode == 1 and "down" in after.stdout
    assert _cli(tmp_path, "down", ports=picked).stdout.count("not running") == len(services)


@pytest.mark.services
def test_a_port_taken_by_someone_else_is_a_clear_error(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        free, spare = ports.free_ports(2)
        result = _cli(tmp_path, "up", ports=(free, taken, spare))
    # prefect and the receiver were started beside it by this call, then stopped again:
    # nothing half up.
    assert result.returncode == 1
    assert f"port {taken}" in result.stderr and "mlflow" in result.stderr
    assert not list((tmp_path / "pids").glob("*.json"))


def test_down_never_kills_a_process_it_did_not_start(tmp_path):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        service = local.services(tmp_path)[0]
        service.pid_file.parent.mkdir(parents=True)
        # A stale pid file whose pid now belongs to someone else (start time differs).
        service.pid_file.write_text(json.dumps({"pid": bystander.pid, "start_time": "1"}))
        assert local.stop(service) == "not running"
        assert bystander.poll() is None
        assert not service.pid_file.exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_a_port_picked_for_a_service_is_never_picked_again_until_its_claimant_dies(
    tmp_path, monkeypatch
):
    """A picked port stays unbound until its service starts: no later pick, here or in another
    live process, may get it (a stack's dashboard port once landed on its Serve port)."""
    monkeypatch.setattr(ports, "PORT_CLAIMS", tmp_path / "claims")
    monkeypatch.setattr(ports, "_claimed", set())
    picked = ports.free_ports(20, spacing=local.RAY_DASHBOARD_PORT - local.DEFAULT_PORTS["ray"])
    offsets = [p + local.RAY_DASHBOARD_PORT - local.DEFAULT_PORTS["ray"] for p in picked]
    assert not any(ports.claim(port) for port in (*picked, *offsets))  # held, offsets too
    later = ports.free_ports(200)
    assert not set(later) & {*picked, *offsets}
    # Another live process's claim holds; a dead one's does not.
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        with subprocess.Popen([sys.executable, "-c", "pass"]) as ended:
            ended.wait()
        free = [ports.free_port() for _ in range(2)]
        ports._claimed.difference_update(free)
        (tmp_path / "claims" / str(free[0])).write_text(str(alive.pid))
        (tmp_path / "claims" / str(free[1])).write_text(str(ended.pid))
        assert ports.claim(free[0]) is False
        assert ports.claim(free[1]) is True
        alive.kill()
