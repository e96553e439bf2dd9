"""The serving settings the tests' rollouts share: a tenth of a CPU per replica (a 4-CPU test
head holds a router and several versions at once) and health checks every second, so that a
replica that dies or hangs is noticed within seconds. Gates differ per test and stay with it."""

from __future__ import annotations

__all__ = ["FAST_SERVING"]

# As `Serving` fields: `Serving(**FAST_SERVING)`, or as a deployment's `serving` parameter.
FAST_SERVING: dict[str, float] = {
    "num_cpus": 0.1,
    "router_num_cpus": 0.1,
    "health_check_period_s": 1,
    "health_check_timeout_s": 5,
}
