"""Closed-loop load through the router during four rollouts, the cost and verdicts of the
shadow stage and of sticky sessions, and steady-state throughput through the router versus
straight to the version's own app, in one run on one cluster.

    python -m benchmarks.serve_swap [--threads 4] [--steady-s 10] [--shadow-s 8]

(a) a good rollout, (b) a candidate whose health check fails after it looked healthy,
(c) a candidate erroring on half its requests (aborted at the canary), (d) a degradation
injected after the swap (rolled back). Each reports the answers users got (`non_2xx`) and how
many of them the router answered from the previous version after the candidate failed them
(`fallbacks`).
(e) `shadow`: open-loop load at half the router's measured capacity, with every request
copied to an identical candidate (share 1.0) and without, in alternating windows: users'
p50 and p99 each way (`user_p99_ratio`, goal <= 1.05), the shadow's `agreement` and its
`dropped_copies`. (f) `shadow_reject`: a candidate that answers differently on 30% of
inputs, rejected at its shadow stage under load: `candidate_answers_to_users` (goal 0).
(g) `sticky`: a few hundred sessions through two canary steps on a route with two router
replicas: `sessions_switched` within a step (goal 0, fallbacks excluded) and `session_share`
against each step's weight.
Then the router (hosting the live version in process) and a direct route to the same
version's app are loaded in turn, alternating over `--rounds`; medians reported.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

from deployments.testing.load import ClosedLoop, OpenLoop
from prefect_ray_lifecycle.workloads.figures import percentile

ROUTE = "bench"
DIRECT = "bench-direct"
STICKY = "bench-sticky"
SHADOW_CANDIDATE = "bench-shadow-candidate"
SESSIONS = 200
VERSIONS = 8


def steady(port: int, path: str, threads: int, seconds: float) -> tuple[float, float]:
    with ClosedLoop(port, path, threads) as load:
        time.sleep(1)  # warm
        mark = time.time()
        time.sleep(seconds)
    window = [a for a in load.answers if a.at >= mark and a.status == 200]
    return len(window) / seconds, percentile([a.latency_ms for a in window], 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3, help="steady-state rounds (>= 3)")
    parser.add_argument(
        "--shadow-s", type=float, default=8.0, help="each shadow-on and shadow-off window"
    )
    args = parser.parse_args(argv)

    from deployments.testing.stack import pointed_at, temporary_stack

    with temporary_stack(ray_num_cpus=4, prefix="bench-serve-") as stack:
        with pointed_at(stack):
            result = run(stack, args.threads, args.steady_s, max(3, args.rounds), args.shadow_s)
    print(json.dumps(result))
    return 0


def observations(n: int) -> tuple[bytes, dict[str, str]]:
    """Varied CartPole observations (four per request): agreement on one input proves little."""
    import numpy as np

    rng = np.random.default_rng(n)
    return json.dumps({"observations": rng.uniform(-0.5, 0.5, (4, 4)).tolist()}).encode(), {}


def sessions(n: int) -> tuple[bytes, dict[str, str]]:
    """The n-th request of SESSIONS interleaved sessions (X-Session-Id)."""
    body, _ = observations(n)
    return body, {"X-Session-Id": f"s{n % SESSIONS}"}


def window_latencies(load: OpenLoop, skip_s: float = 1.0) -> tuple[float, float]:
    """p50 and p99 of a window's 200 answers, after its first `skip_s` seconds."""
    first = min((a.at for a in load.answers), default=0.0)
    kept = [a.latency_ms for a in load.answers if a.status == 200 and a.at >= first + skip_s]
    return percentile(kept, 0.5), percentile(kept, 0.99)


def shadow_cost(
    port: int, name: str, live: str, shadow_s: float, rounds: int, share: float = 0.5
) -> dict[str, Any]:
    """Users' latency with every request copied to an identical candidate, against the same
    open-loop load (`share` of the measured capacity) without copies, in alternating windows.
    Both kinds of window run under a held rollout with the candidate in place, its config
    applied on every router replica before the window starts: stage `shadow` with the copies,
    without them a canary at weight 0 (no user traffic to the candidate, no copies), so that
    only the copies differ."""
    from deployments.testing import drive
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.workloads.serve.route_state import route_shadow
    from prefect_ray_lifecycle.workloads.serve.router_config import Shadow, Target

    capacity, _ = steady(port, f"/{ROUTE}", 4, 5.0)
    rate = capacity * share
    router = serve_control.current_router(ROUTE)
    candidate = Target(live, SHADOW_CANDIDATE, "policy", router.live.model)
    shadow = Shadow(1.0, max_per_s=rate * 2)  # the cap above the load: every request copied
    on, off, since = [], [], time.time()
    for round_ in range(rounds):
        for copying in (round_ % 2 == 0, round_ % 2 == 1):
            held = (
                drive.held(ROUTE, candidate=candidate, shadow=shadow, rollout={"stage": "shadow"})
                if copying
                else drive.held(
                    ROUTE, candidate=candidate, candidate_weight=0.0, rollout={"stage": "canary"}
                )
            )
            with held, OpenLoop(port, f"/{ROUTE}", rate, requests=observations) as load:
                time.sleep(shadow_s)
            (on if copying else off).append(window_latencies(load))
    figures = route_shadow(ROUTE, since)["candidate"].get(live) or {}
    p99_on, p99_off = (statistics.median(r[1] for r in runs) for runs in (on, off))
    return {
        "capacity_rps": round(capacity, 1),
        "offered_rps": round(rate, 1),
        "user_p50_ms": round(statistics.median(r[0] for r in off), 2),
        "user_p50_ms_shadowed": round(statistics.median(r[0] for r in on), 2),
        "user_p99_ms": round(p99_off, 2),
        "user_p99_ms_shadowed": round(p99_on, 2),
        "user_p99_ratio": round(p99_on / p99_off, 3),
        "copies": figures.get("copies", 0),
        "agreement": figures.get("agreement"),
        "dropped_copies": figures.get("dropped", 0),
        "rounds": rounds,
    }


def sticky_sessions(result: Any, load: ClosedLoop, steps: list[float]) -> dict[str, Any]:
    """Sessions that saw two versions within one canary step (fallbacks excluded), and the
    share of sessions on the candidate in each step."""
    from deployments.testing.watch import sessions_per_step, stage_windows

    names = [f"canary {w:.0%}" for w in steps]
    windows = stage_windows(result.timeline, names)
    seen, fallbacks = sessions_per_step(load.answers, windows, lambda a: a.session)
    version = result.version
    return {
        "sessions": SESSIONS,
        "requests": len(load.answers),
        "sessions_switched": sum(
            1 for versions in seen.values() for v in versions.values() if len(v) > 1
        ),
        "fallbacks_excluded": fallbacks,
        "session_share": {
            name: {
                "weight": weight,
                "share": round(
                    sum(v == {version} for v in seen[name].values()) / max(len(seen[name]), 1), 3
                ),
                "sessions_seen": len(seen[name]),
            }
            for name, weight in zip(names, steps, strict=True)
        },
    }


def run(stack, threads: int, steady_s: float, rounds: int, shadow_s: float) -> dict[str, Any]:
    from mlflow import MlflowClient
    from ray.rllib.algorithms.ppo import PPOConfig

    from prefect_ray_lifecycle.blocks import MLflowServer
    from prefect_ray_lifecycle.control import registry, serve_control
    from prefect_ray_lifecycle.flows.rollout import RolloutFailed, serve_rollout
    from prefect_ray_lifecycle.tasks.rollout.config import Drill, Gates, Serving
    from prefect_ray_lifecycle.workloads.constants import POLICY_DEPLOYMENT

    cluster = stack.ray_cluster()
    server = MLflowServer(tracking_uri=stack.mlflow_uri)
    client = MlflowClient(stack.mlflow_uri)
    name = f"bench-{uuid.uuid4().hex[:6]}"
    gates = Gates(
        health_timeout_s=180,
        stability_window_s=4,
        canary_steps=[0.1, 0.5],
        canary_hold_s=4,
        canary_min_requests=10,
        bake_s=8,
        bake_window_s=2,
        max_error_rate=0.02,
        max_p99_ms=5000,
        p99_slack_ms=1000,
    )
    serving = Serving(num_cpus=0.25, health_check_period_s=1, router_num_cpus=0.25)
    port = stack.serve_port
    figures: dict[str, Any] = {}

    with cluster.connect():
        algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).build_algo()
        checkpoint = algo.save(str(stack.state_dir / "checkpoint")).checkpoint.path
        algo.stop()
        for trial in range(VERSIONS):
            registry.register_checkpoint(
                client,
                name=name,
                checkpoint=checkpoint,
                experiment_name="bench",
                trial_key_value=f"{name}-{trial}",
                observation_size=4,
            )
        serve_control.start(cluster.serve_host, port)

        def rollout_with(
            version: int,
            gates: Gates,
            drill: Drill | None = None,
            route: str = ROUTE,
            serving: Serving = serving,
        ):
            """The rollout's result, or None when it was rejected or rolled back."""
            try:
                return serve_rollout(
                    model_name=name,
                    version=str(version),
                    route=route,
                    gates=gates,
                    serving=serving,
                    drill=drill,
                    ray_cluster=cluster,
                    mlflow_server=server,
                )
            except RolloutFailed:
                return None

        def rollout(version: int, drill: Drill | None = None, expect_failure: bool = False):
            result = rollout_with(version, gates, drill)
            if result is None and not expect_failure:
                raise RuntimeError(f"the rollout of v{version} failed")
            return result

        rollout(1)
        with ClosedLoop(port, f"/{ROUTE}", threads) as load:
            rollout(2)
        figures["good"] = load.summary()

        with ClosedLoop(port, f"/{ROUTE}", threads) as load:
            rollout(3, Drill(faults={"fail_health_after_s": 2}), expect_failure=True)
        figures["failed_health"] = load.summary()

        with ClosedLoop(port, f"/{ROUTE}", threads) as load:
            rollout(4, Drill(faults={"error_rate": 0.5}), expect_failure=True)
        # The canary's window: from the candidate's first attempt to its last.
        tried = [a for a in load.answers if "4" in (a.version, a.fallback_from)]
        during = [a for a in load.answers if tried and tried[0].at <= a.at <= tried[-1].at]
        figures["canary_abort"] = {
            **load.summary(),
            "candidate_failures_answered_by_live": sum(
                1 for a in load.answers if a.fallback_from == "4" and a.status == 200
            ),
            "canary_share": round(len(tried) / max(len(during), 1), 3),
            "canary_s": round(tried[-1].at - tried[0].at, 2) if tried else 0.0,
        }

        with ClosedLoop(port, f"/{ROUTE}", threads) as load:
            rollout(5, Drill(after_swap={"error_rate": 1.0}), expect_failure=True)
            time.sleep(1)
        failing = [a.at for a in load.answers if a.fallback_from == "5" or a.status != 200]
        figures["rollback"] = {
            **load.summary(),
            "seconds_to_rollback": round(max(failing) - min(failing), 2) if failing else None,
        }

        live = registry.resolve_alias(client, name, registry.LIVE).version
        runtime_env = serve_control.app_configs()[serve_control.version_app_name(name, live)][
            "runtime_env"
        ]

        def second_app(app: str, route_prefix: str | None = None) -> None:
            """Another app of the live version (the shadow's identical candidate, or the
            steady state's direct route)."""
            config = serve_control.version_app_config(
                app,
                {"name": name, "version": live, "tracking_uri": stack.mlflow_uri},
                serving.version_options(),
                {},
                runtime_env,
            )
            if route_prefix:
                config = {**config, "route_prefix": route_prefix}
            serve_control.apply({app: config})
            if not serve_control.wait_stable(
                app, POLICY_DEPLOYMENT, timeout_s=180, window_s=1
            ).healthy:
                raise RuntimeError(f"the app {app} did not start")

        # (e) The shadow's cost to users, with an identical candidate.
        second_app(SHADOW_CANDIDATE)
        # At least 5 rounds: a window's p99 is its ~6th-slowest answer, noisy on a busy machine.
        figures["shadow"] = shadow_cost(port, name, live, shadow_s, max(5, rounds))
        serve_control.apply(deletes={SHADOW_CANDIDATE})

        # (f) A candidate that answers differently: rejected at shadow, seen by no user.
        shadow_gates = gates.model_copy(
            update={"shadow_share": 1.0, "shadow_hold_s": 4, "shadow_min_requests": 30}
        )
        with ClosedLoop(port, f"/{ROUTE}", threads, requests=observations) as load:
            promoted = rollout_with(6, shadow_gates, Drill(faults={"disagree_rate": 0.3}))
        tags = client.get_model_version(name, "6").tags
        figures["shadow_reject"] = {
            **load.summary(),
            "rejected_at": tags.get(f"{registry.TAG}.rollout.stage"),
            "agreement": float(tags.get(f"{registry.TAG}.rollout.shadow_agreement", "nan")),
            "candidate_answers_to_users": sum(1 for a in load.answers if a.version == "6"),
            "outcome": "rejected" if promoted is None else "promoted",
        }

        # (g) Sticky sessions through two canary steps, two router replicas.
        sticky_serving = serving.model_copy(update={"router_replicas": 2})
        steps = [0.2, 0.5]
        rollout_with(1, gates, route=STICKY, serving=sticky_serving)
        with ClosedLoop(port, f"/{STICKY}", threads, requests=sessions) as load:
            result = rollout_with(
                7,
                gates.model_copy(update={"canary_steps": steps, "canary_hold_s": 12}),
                route=STICKY,
                serving=sticky_serving,
            )
        figures["sticky"] = sticky_sessions(result, load, steps)
        serve_control.delete_route(STICKY, name)

        # Steady state: the router hosts v2 in process; a second app of v2 gets its own route.
        second_app(DIRECT, f"/{DIRECT}")
        serve_control.wait_router(
            ROUTE,
            serve_control.router_status(ROUTE, 1)[0]["config"]["generation"],
            inline_version=live,
            timeout_s=120,
        )
        router_runs, direct_runs = [], []
        for round_ in range(rounds):  # alternate which goes first
            sides = [(router_runs, ROUTE), (direct_runs, DIRECT)]
            for runs, path in sides if round_ % 2 == 0 else reversed(sides):
                runs.append(steady(port, f"/{path}", threads, steady_s))
        serve_control.apply(
            deletes={
                a
                for a in serve_control.app_configs()
                if a.startswith(name) or a in (DIRECT, serve_control.router_app_name(ROUTE))
            }
        )

    router_rps = statistics.median(r[0] for r in router_runs)
    direct_rps = statistics.median(r[0] for r in direct_runs)
    return {
        **figures,
        "router_vs_direct_throughput": round(router_rps / direct_rps, 3),
        "router_rps": round(router_rps, 1),
        "direct_rps": round(direct_rps, 1),
        "router_p50_ms": round(statistics.median(r[1] for r in router_runs), 2),
        "direct_p50_ms": round(statistics.median(r[1] for r in direct_runs), 2),
        "rounds": rounds,
    }


if __name__ == "__main__":
    raise SystemExit(main())
