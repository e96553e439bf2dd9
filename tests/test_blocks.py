"""Blocks: save, load, register, and reject bad values naming the field."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from pydantic import ValidationError

from prefect_ray_lifecycle.blocks import MLflowServer, RayCluster


@pytest.mark.parametrize(
    "address",
    [
        "",
        "auto",
        "127.0.0.1:6379",
        "ray://head.svc:10001",
        "[::1]:6379",
        "ray-head-0.ray.svc.cluster.local:6379",
    ],
)
def test_ray_addresses_accepted(address):
    assert RayCluster(address=address).address == address


@pytest.mark.parametrize(
    "address",
    [
        "http://127.0.0.1:6379",
        "127.0.0.1",
        "host:0",
        "host:99999",
        "ray://:10001",
        "300.1.1.1:6379",
        "a b:1",
    ],
)
def test_malformed_ray_address_names_field_and_value(address):
    with pytest.raises(ValidationError) as error:
        RayCluster(address=address)
    message = str(error.value)
    assert "address" in message and repr(address) in message


def test_bad_runtime_env_and_cpus_are_rejected():
    with pytest.raises(ValidationError, match="env_vars"):
        RayCluster(runtime_env={"env_vars": {"A": 1}})
    with pytest.raises(ValidationError, match="num_cpus"):
        RayCluster(num_cpus=0)


@pytest.mark.parametrize(
    "field,value",
    [
        ("tracking_uri", "127.0.0.1:5000"),
        ("tracking_uri", "http://"),
        ("registry_uri", "ftp://x"),
        ("tracking_uri", "http://host:notaport"),
    ],
)
def test_malformed_mlflow_uri_names_field_and_value(field, value):
    with pytest.raises(ValidationError) as error:
        MLflowServer(**{field: value})
    assert field in str(error.value) and repr(value) in str(error.value)


def test_registry_defaults_to_tracking_uri():
    server = MLflowServer(tracking_uri="http://127.0.0.1:5123/")
    assert server.registry_uri == server.tracking_uri == "http://127.0.0.1:5123"


def test_blocks_save_and_load_through_the_prefect_api(stack):
    name = f"test-{uuid.uuid4().hex[:8]}"
    stack.ray_cluster(runtime_env={"env_vars": {"A": "1"}}).save(name)
    MLflowServer(tracking_uri=stack.mlflow_uri, token="s3cr3t-token").save(name)

    ray_cluster = RayCluster.load(name)
    mlflow_server = MLflowServer.load(name)
    assert ray_cluster.address == stack.ray_address
    assert ray_cluster.auth_token.get_secret_value() == stack.ray_token
    assert ray_cluster.project_runtime_env()["env_vars"]["A"] == "1"
    assert mlflow_server.registry_uri == stack.mlflow_uri
    assert mlflow_server.token.get_secret_value() == "s3cr3t-token"
    # The secret never shows in the block's printable forms.
    assert "s3cr3t-token" not in repr(mlflow_server)
    assert "s3cr3t-token" not in mlflow_server.model_dump_json()


def test_mlflow_session_talks_to_the_server_and_restores_the_token(stack, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
    import os

    server = MLflowServer(tracking_uri=stack.mlflow_uri, token="t0ken")
    with server.session() as client:
        assert os.environ["MLFLOW_TRACKING_TOKEN"] == "t0ken"
        experiment = client.get_experiment_by_name("Default")
        assert experiment is not None
    assert "MLFLOW_TRACKING_TOKEN" not in os.environ


def test_blocks_register_with_the_prefect_cli(stack, prefect_client):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "block",
            "register",
            "-m",
            "prefect_ray_lifecycle.blocks",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    slugs = {block_type.slug for block_type in prefect_client.read_block_types()}
    assert {"ray-cluster", "mlflow-server"} <= slugs
    schema = prefect_client.read_block_schema_by_checksum(RayCluster._calculate_schema_checksum())
    for field in ("address", "namespace", "runtime_env", "num_cpus", "auth_token", "dashboard_url"):
        assert schema.fields["properties"][field].get("description"), field


def test_a_ray_client_connection_whose_server_failed_to_start_is_tried_again_with_backoff(
    monkeypatch, tmp_path
):
    """Ray Client's head starts one server process per connection; on a busy head that start
    can fail (`ConnectionAbortedError: ... Starting Ray client server failed`). Only that
    failure, only through ray://, is tried again, after a reset, with the pause doubling;
    the last failure quotes the head's client server log when it is on this machine, and
    anything else surfaces as it is."""
    from prefect_ray_lifecycle.blocks import ray_cluster

    pauses: list[float] = []
    monkeypatch.setattr(ray_cluster.time, "sleep", pauses.append)
    logs = tmp_path / "session_2026-12-01_00-00-00_000000_1" / "logs"
    logs.mkdir(parents=True)
    (logs / "ray_client_server_23000.err").write_text("boot\nOSError: no space left on device\n")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    failed = ConnectionAbortedError(
        "Initialization failure from server:\nRuntimeError: Starting Ray client server "
        "failed. See ray_client_server_23000.err for detailed logs."
    )
    calls, resets = [], []

    def flaky(failures: int, error: BaseException = failed):
        def connect():
            calls.append(1)
            if len(calls) <= failures:
                raise error
            return "connected"

        return connect

    address = "ray://127.0.0.1:10001"
    attempts = ray_cluster.CLIENT_ATTEMPTS
    assert ray_cluster.retry_client_start(
        flaky(attempts - 1), address, lambda: resets.append(1)
    ) == ("connected")
    assert (len(calls), len(resets)) == (attempts, attempts - 1)
    first = ray_cluster.CLIENT_RETRY_PAUSE_S
    assert pauses == [first * 2**n for n in range(attempts - 1)]

    calls.clear()
    with pytest.raises(ConnectionAbortedError, match="no space left on device") as raised:
        ray_cluster.retry_client_start(flaky(attempts), address, lambda: None)
    assert f"{attempts} times" in str(raised.value) and len(calls) == attempts
    # The proxier's other way to lose the server it just started: its process is a zombie.
    gone = ConnectionAbortedError(
        "Initialization failure from server:\nTraceback (most recent call last):\n  File "
        '"ray/util/client/server/proxier.py", line 396, in start_specific_server\n    cmd = '
        "psutil_proc.cmdline()\npsutil.ZombieProcess: PID still exists but it's a zombie"
    )
    calls.clear()
    assert ray_cluster.retry_client_start(flaky(1, gone), address, lambda: None) == "connected"
    assert len(calls) == 2
    for connect, where in (
        (flaky(1), "127.0.0.1:6379"),  # not Ray Client
        (flaky(1, ConnectionAbortedError("auth failed")), address),  # another failure
    ):
        calls.clear()
        with pytest.raises(ConnectionAbortedError):
            ray_cluster.retry_client_start(connect, where, lambda: None)
        assert len(calls) == 1
