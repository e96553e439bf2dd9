"""The serving settings the tests' rollouts share: a tenth of a CPU per replica (a 4-CPU test
head holds a router and several versions at once) and health checks every second, so that a
replica that dies or hangs is noticed within seconds. Gates differ per test and stay with it."""

from __future__ import annotations

__all__ = ["FAST_SERVING", "ONE_STEP_CANARY"]

# As `Serving` fields: `Serving(**FAST_SERVING)`, or as a deployment's `serving` parameter.
FAST_SERVING: dict[str, float] = {
    "num_cpus": 0.1,
    "router_num_cpus": 0.1,
    "health_check_period_s": 1,
    "health_check_timeout_s": 5,
}

# A one-step canary that decides within seconds of its five requests, as a deployment's `gates`
# parameter: the stack-restart tests and benchmarks.heal stop the stack in it.
ONE_STEP_CANARY: dict[str, object] = {
    "health_timeout_s": 120,
    "stability_window_s": 2,
    "canary_steps": [0.5],
    "canary_hold_s": 3,
    # Without load a canary waits for its requests: the stack is stopped while it waits.
    "canary_min_requests": 5,
    "canary_max_wait_s": 120,
    "bake_s": 3,
    "bake_window_s": 2,
    "max_error_rate": 0.05,
    "max_p99_ms": 5000,
    "p99_slack_ms": 3000,
    "lease_s": 5,
}
