"""The control loop healing itself (#26), measured on one temporary stack under closed-loop
load: each fault the suite tests, once, counted and timed.

    python -m benchmarks.heal

- `router_replica_kill_non_2xx`, `router_replica_inflight_at_kill`: one of the router's two
  replicas killed (kill -9) in a canary: the answers that failed, and the requests in flight
  at the kill (goal: the first no more than the second);
- `prefect_outage_non_2xx`: the Prefect server stopped for 30 s in a canary (goal 0), and how
  the rollout ended;
- `mlflow_outage_non_2xx`: MLflow stopped in a canary until the swap gave up on `live` (goal
  0); then MLflow back and one reconcile: whether the router and `live` agree;
- `ray_restart_to_restored_s`: the Ray head stopped and started while v1 serves the deployed
  `policy` route: seconds from the stop until the route answers v1 again, with nobody acting
  (the route watch and its trigger; goal <= 60);
- `stack_restart_to_rolled_out_s`: the whole stack (worker, Prefect, MLflow, receiver, Ray)
  stopped in a canary and started again: seconds from the next champion move to that version
  live and answering (goal: not null).
Its peer: the same route at rest under the same load (`at_rest_non_2xx`). Last line: one JSON
object.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import uuid
from typing import Any

from benchmarks._output import strict_json
from deployments import local
from deployments.testing import drive
from deployments.testing.fast import FAST_SERVING, ONE_STEP_CANARY
from deployments.testing.load import LOAD_PAUSE_S, ClosedLoop
from deployments.testing.stack import deployed, start_all, stop_all
from deployments.testing.watch import FAST_POLL_S, route_status, started_run, wait_for

WATCHED = "cartpole-ppo"  # the model prefect.yaml's champion trigger rolls out, on /policy
FAULTS_ROUTE = "heal"
OUTAGE_S = 30
GATES = {**ONE_STEP_CANARY, "health_timeout_s": 180, "canary_hold_s": 6, "canary_max_wait_s": 180}


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    from deployments.testing.stack import pointed_at, temporary_stack

    with temporary_stack(ray_num_cpus=4, prefix="bench-heal-") as stack, pointed_at(stack):
        figures = run(stack)
    print(strict_json(figures))
    return 0


def run(stack) -> dict[str, Any]:
    from mlflow import MlflowClient

    client = MlflowClient(stack.mlflow_uri)
    checkpoint = _checkpoint(stack)
    faulted = f"heal-{uuid.uuid4().hex[:6]}"
    for name, count in ((faulted, 4), (WATCHED, 3)):
        for n in range(count):
            _register(client, name, checkpoint, n)
    parameters = {"reconcile/reconcile": _fast(), "serve-rollout/serve-rollout": _fast()}
    figures: dict[str, Any] = {}
    with deployed(stack, routes=("policy", FAULTS_ROUTE), parameters=parameters):
        figures |= _faults_in_a_canary(stack, client, faulted)
        figures |= _restarts(stack, client)
    return figures


def _fast() -> dict[str, Any]:
    return {"gates": GATES, "serving": FAST_SERVING}


def _checkpoint(stack) -> str:
    from ray.rllib.algorithms.ppo import PPOConfig

    with stack.ray_cluster().connect():
        algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).build_algo()
        try:
            return algo.save(str(stack.state_dir / "checkpoint")).checkpoint.path
        finally:
            algo.stop()


def _register(client, name: str, checkpoint: str, n: int) -> None:
    from prefect_ray_lifecycle.control import registry

    registry.register_checkpoint(
        client,
        name=name,
        checkpoint=checkpoint,
        experiment_name="heal",
        trial_key_value=f"{name}-{n}",
        observation_size=4,
    )


def _load(stack, route: str, threads: int = 2) -> ClosedLoop:
    return ClosedLoop(stack.serve_port, f"/{route}", threads=threads, pause_s=LOAD_PAUSE_S)


def _in_canary(stack, route: str, running) -> bool:
    if running.done():
        running.result()  # a rollout that ended before its canary: its error
        raise RuntimeError("the rollout ended before its canary")
    try:
        return route_status(stack.serve_port, route)["candidate_share"] > 0
    except OSError:
        return False


def _faults_in_a_canary(stack, client, name: str) -> dict[str, Any]:
    """A router replica killed, Prefect down and MLflow down, each in a canary of `name` on
    FAULTS_ROUTE (flows in this process, two router replicas)."""
    from prefect_ray_lifecycle.blocks import MLflowServer
    from prefect_ray_lifecycle.control import registry, serve_control
    from prefect_ray_lifecycle.flows.reconcile import reconcile
    from prefect_ray_lifecycle.flows.rollout import serve_rollout
    from prefect_ray_lifecycle.tasks.rollout.config import Gates, Serving

    cluster = stack.ray_cluster()
    gates = Gates(**GATES)
    common = dict(
        model_name=name,
        route=FAULTS_ROUTE,
        serving=Serving(**FAST_SERVING, router_replicas=2),
        ray_cluster=cluster,
        mlflow_server=MLflowServer(tracking_uri=stack.mlflow_uri),
    )
    figures: dict[str, Any] = {}
    with cluster.connect():
        serve_control.start(cluster.serve_host, cluster.serve_port)
        serve_rollout(version="1", gates=gates, **common)
        with _load(stack, FAULTS_ROUTE) as rest:
            time.sleep(OUTAGE_S / 3)
        figures["at_rest_non_2xx"] = len(rest.failed())

        canary = gates.model_copy(update={"canary_min_requests": 40})
        with _load(stack, FAULTS_ROUTE, threads=4) as users:
            with drive.rolling_out(version="2", gates=canary, **common) as running:
                wait_for(
                    "v2's canary",
                    lambda: _in_canary(stack, FAULTS_ROUTE, running),
                    300,
                    every=FAST_POLL_S,
                )
                pids = drive.router_pids(FAULTS_ROUTE)
                os.kill(pids[sorted(pids)[0]], signal.SIGKILL)
                killed = time.time()
                figures["router_replica_kill_outcome"] = running.result(timeout=600).outcome
        held = [a for a in users.answers if a.at - a.latency_ms / 1000 < killed <= a.at]
        figures["router_replica_kill_non_2xx"] = len(users.failed())
        figures["router_replica_inflight_at_kill"] = len(held)

        long_canary = gates.model_copy(update={"canary_hold_s": OUTAGE_S + 15})
        prefect = stack.service("prefect")
        with _load(stack, FAULTS_ROUTE) as users:
            with drive.rolling_out(version="3", gates=long_canary, **common) as running:
                wait_for(
                    "v3's canary",
                    lambda: _in_canary(stack, FAULTS_ROUTE, running),
                    300,
                    every=FAST_POLL_S,
                )
                local.stop(prefect)
                time.sleep(OUTAGE_S)
                assert local.start(prefect).startswith("started")
                figures["prefect_outage_outcome"] = _outcome(running)
        figures["prefect_outage_non_2xx"] = len(users.failed())

        mlflow = stack.service("mlflow")
        with _load(stack, FAULTS_ROUTE) as users:
            with drive.rolling_out(version="4", gates=gates, **common) as running:
                wait_for(
                    "v4's canary",
                    lambda: _in_canary(stack, FAULTS_ROUTE, running),
                    300,
                    every=FAST_POLL_S,
                )
                local.stop(mlflow)
                figures["mlflow_outage_outcome"] = _outcome(running)
            assert local.start(mlflow).startswith("started")
            again = reconcile(model_name=name, route=FAULTS_ROUTE, gates=gates, **_rest(common))
        figures["mlflow_outage_non_2xx"] = len(users.failed())
        live = registry.resolve_alias(client, name, registry.LIVE)
        router = serve_control.current_router(FAULTS_ROUTE)
        figures["mlflow_outage_reconcile"] = again.action
        figures["mlflow_outage_router_and_live_agree"] = (
            live is not None and router.live is not None and router.live.version == live.version
        )
        from deployments import route_watch

        route_watch.removed(FAULTS_ROUTE)
        serve_control.delete_route(FAULTS_ROUTE, name)
        serve_control.release()
    return figures


def _rest(common: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in common.items() if k not in ("model_name", "route")}


def _outcome(running) -> str:
    try:
        return running.result(timeout=900).outcome
    except Exception as error:  # the rollout's end is a figure here, not a failure
        return f"{type(error).__name__}: {str(error)[:160]}"


def _restarts(stack, client) -> dict[str, Any]:
    """The deployed /policy route: its Ray head restarted, then the whole stack mid-canary."""
    from prefect.client.orchestration import get_client

    from prefect_ray_lifecycle.control import registry

    def serves(version: str) -> bool:
        try:
            return route_status(stack.serve_port, "policy")["config"]["live"]["version"] == version
        except Exception:  # still coming up
            return False

    figures: dict[str, Any] = {}
    with get_client(sync_client=True) as prefect:
        moved = time.time()
        client.set_registered_model_alias(WATCHED, registry.CHAMPION, "1")
        first = started_run(prefect, "reconcile/reconcile", moved, timeout=300)
        wait_for(
            "v1 is live",
            lambda: prefect.read_flow_run(first.id).state.is_final(),
            300,
            every=FAST_POLL_S,
        )
        wait_for("the route serves v1", lambda: serves("1"), 60, every=FAST_POLL_S)
        time.sleep(5)  # the rollout's own heartbeat has reached Prefect's triggers
        head = stack.service("ray")
        with _load(stack, "policy") as users:
            local.stop(head)
            stopped = time.monotonic()
            local.start(head)
            wait_for("the route serves v1 again", lambda: serves("1"), 600, every=0.5)
            figures["ray_restart_to_restored_s"] = round(time.monotonic() - stopped, 1)
        figures["ray_restart_non_2xx"] = len(users.failed())

        client.set_registered_model_alias(WATCHED, registry.CHAMPION, "2")
        with _load(stack, "policy"):
            wait_for("v2's canary", lambda: _share(stack) > 0, 300, every=FAST_POLL_S)
        stop_all(stack)
        start_all(stack)
    with get_client(sync_client=True):
        moved = time.monotonic()
        client.set_registered_model_alias(WATCHED, registry.CHAMPION, "3")

        def rolled_out() -> bool:
            live = registry.resolve_alias(client, WATCHED, registry.LIVE)
            return live is not None and live.version == "3" and serves("3")

        try:
            with _load(stack, "policy"):
                wait_for(
                    "v3 is rolled out after the restart",
                    _quietly(rolled_out),
                    600,
                    every=FAST_POLL_S,
                )
            figures["stack_restart_to_rolled_out_s"] = round(time.monotonic() - moved, 1)
        except AssertionError:
            figures["stack_restart_to_rolled_out_s"] = None
    return figures


def _share(stack) -> float:
    try:
        return route_status(stack.serve_port, "policy")["candidate_share"]
    except OSError:
        return 0.0


def _quietly(check):
    def run() -> bool:
        try:
            return check()
        except Exception:  # MLflow or the route still coming up
            return False

    return run


if __name__ == "__main__":
    raise SystemExit(main())
