"""Canary judgement and router/fault config validation: the pure parts of a rollout."""

from __future__ import annotations

import pickle
import re

import pytest

from prefect_ray_lifecycle.control.canary import (
    GateFailed,
    Judgement,
    Thresholds,
    early_failure,
    judge,
    judge_llm,
)
from prefect_ray_lifecycle.workloads.constants import LLM_DEPLOYMENT, POLICY_DEPLOYMENT
from prefect_ray_lifecycle.workloads.serve.policy import Faults, serving_options
from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig, Target

LIVE = {"requests": 400, "errors": 0, "p99_ms": 10.0}


def figures(requests, errors=0, p99=10.0):
    return {"requests": requests, "errors": errors, "p99_ms": p99}


@pytest.mark.parametrize(
    "candidate, ok, words",
    [
        (None, None, "0 request(s)"),
        (figures(4), None, "fewer than the 5"),
        (figures(100, errors=2), False, "error rate 2.0% (2 of 100)"),
        (figures(100, errors=1), True, "error rate 1.0%"),
        (figures(100, p99=1200.0), False, "above 1000 ms"),
        (figures(100, p99=81.0), False, "over 3x the live version's 10.0 ms + 50 ms"),
        (figures(100, p99=79.0), True, "p99 79.0 ms"),
    ],
)
def test_judge(candidate, ok, words):
    verdict = judge(candidate, LIVE, Thresholds(max_error_rate=0.01, min_requests=5))
    assert verdict.ok is ok and words in verdict.reason


def test_a_thin_baseline_is_not_compared():
    verdict = judge(figures(100, p99=500.0), figures(5, p99=1.0), Thresholds())
    assert verdict == Judgement(True, "100 requests, error rate 0.0%, p99 500.0 ms")


def test_early_failure_needs_enough_requests_and_only_counts_errors():
    thresholds = Thresholds(max_error_rate=0.05)
    assert early_failure(figures(9, errors=9), thresholds) is None
    assert early_failure(figures(10, errors=5), thresholds).ok is False
    assert early_failure(figures(50, p99=5000.0), thresholds) is None


def llm_figures(ttft_p99_ms, tokens_per_s_p50):
    return {"ttft_p99_ms": ttft_p99_ms, "tokens_per_s_p50": tokens_per_s_p50}


@pytest.mark.parametrize(
    "candidate, live, words",
    [
        (None, llm_figures(100.0, 50.0), None),
        (llm_figures(None, None), llm_figures(100.0, 50.0), None),
        (llm_figures(6000.0, 50.0), None, "time to first token p99 6000 ms is above 5000 ms"),
        (llm_figures(100.0, 20.0), llm_figures(100.0, 50.0), "20 tokens/s is below 0.5x live's 50"),
        (llm_figures(100.0, 30.0), llm_figures(100.0, 50.0), None),
        (llm_figures(100.0, 20.0), None, None),
        (llm_figures(100.0, 20.0), llm_figures(100.0, None), None),
    ],
)
def test_judge_llm(candidate, live, words):
    reason = judge_llm(candidate, live, max_ttft_ms=5000.0, min_tokens_per_s_ratio=0.5)
    assert reason == words


def test_gate_failed_pickles_with_its_figures():
    failure = pickle.loads(pickle.dumps(GateFailed("canary", "too slow", {"weight": 0.1})))
    assert (failure.stage, failure.reason, failure.figures) == (
        "canary",
        "too slow",
        {"weight": 0.1},
    )
    assert str(failure) == "canary: too slow"


def test_bad_thresholds_are_rejected():
    with pytest.raises(ValueError):
        Thresholds(max_error_rate=1.5)
    with pytest.raises(ValueError):
        Thresholds(max_p99_ratio=0.5)


TARGET = {
    "app": "m-v1",
    "version": "1",
    "model": {"name": "m", "version": "1", "tracking_uri": "http://127.0.0.1:5000"},
}


@pytest.mark.parametrize(
    "config, message",
    [
        ({"candidate_weight": 0.2}, "no candidate"),
        ({"live": TARGET, "candidate": TARGET, "candidate_weight": 1.5}, "within [0, 1]"),
        ({"live": {"app": "x"}}, "needs app and version"),
        (
            {"live": {**TARGET, "model": {**TARGET["model"], "version": "champion"}}},
            "never an alias",
        ),
        ({"inline_live": True, "live": {"app": "x", "version": "1"}}, "model spec"),
        ({"weights": {}}, "unknown router config fields"),
        ({"live": TARGET, "timeout_s": 0}, "timeout_s must be positive"),
    ],
)
def test_bad_router_configs_are_named(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RouterConfig.parse(config)


def test_router_config_round_trips():
    config = RouterConfig.parse(
        {
            "live": TARGET,
            "candidate": {**TARGET, "app": "m-v2", "version": "2"},
            "candidate_weight": 0.1,
            "generation": 7,
            "rollout": {"holder": "run-1", "stage": "canary", "version": "2", "started_at": 5.0},
        }
    )
    assert RouterConfig.parse(config.as_dict()) == config
    baking = {
        "live": {**TARGET, "app": "m-v2", "version": "2"},
        "previous": TARGET,
        "rollout": {"holder": "run-1", "stage": "bake", "version": "2"},
    }
    assert RouterConfig.parse(RouterConfig.parse(baking).as_dict()) == RouterConfig.parse(baking)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"live": TARGET, "candidate": {**TARGET, "version": "2"}}, "canary rollout record"),
        (
            {
                "live": TARGET,
                "candidate": {**TARGET, "version": "2"},
                "rollout": {"holder": "r", "stage": "canary", "version": "3"},
            },
            "canary rollout record",
        ),
        ({"live": TARGET, "previous": TARGET}, "only during a bake"),
        ({"live": TARGET, "rollout": {"holder": "r", "stage": "soak", "version": "1"}}, "stage"),
    ],
)
def test_a_candidate_or_previous_without_its_rollout_record_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig.parse(config)


def test_a_target_kind_names_its_deployment_and_old_configs_still_parse():
    assert Target.parse(TARGET).kind == "policy"
    assert Target.parse(TARGET).deployment == POLICY_DEPLOYMENT
    old_llm = Target.parse({"app": "l-v1", "version": "1", "deployment": LLM_DEPLOYMENT})
    assert (old_llm.kind, old_llm.deployment) == ("llm", LLM_DEPLOYMENT)
    assert Target.parse(old_llm.as_dict()) == old_llm
    with pytest.raises(ValueError, match="kind"):
        Target.parse({"app": "x", "version": "1", "kind": "tts"})
    with pytest.raises(ValueError, match="model spec"):  # nothing to build its engine from
        RouterConfig.parse({"inline_live": True, "live": old_llm.as_dict()})


def test_an_llm_target_carries_the_app_args_the_router_hosts_it_by():
    args = {"model": "/models/tiny", "version_label": "3", "engine": {"max_model_len": 128}}
    live = Target.parse({"app": "chat-v3", "version": "3", "kind": "llm", "model": args})
    # Parsed as the app parses them, so the router builds the very engine the app runs.
    assert live.model["engine"]["max_model_len"] == 128 and live.model["warmup"] is True
    config = RouterConfig.parse({"inline_live": True, "live": live.as_dict()})
    assert config.inline_live and RouterConfig.parse(config.as_dict()) == config
    for bad, field in (({"version_label": "3"}, "model source"), ({**args, "engine": 1}, "engine")):
        with pytest.raises(ValueError, match=field):
            Target.parse({"app": "chat-v3", "version": "3", "kind": "llm", "model": bad})


def test_an_llm_drill_slows_tokens_and_fits_only_an_llm_version():
    from prefect_ray_lifecycle.tasks.rollout.config import Drill
    from prefect_ray_lifecycle.workloads.llm import llm_app_config
    from prefect_ray_lifecycle.workloads.llm.config import LLMFaults

    assert LLMFaults.parse({"token_delay_ms": 250}).token_delay_ms == 250
    assert LLMFaults.parse(None) == LLMFaults(
        token_delay_ms=0, stream_refuse_rate=0, stream_break_after_tokens=0
    )
    streams = LLMFaults.parse({"stream_refuse_rate": 0.5, "stream_break_after_tokens": 2})
    assert (streams.stream_refuse_rate, streams.stream_break_after_tokens) == (0.5, 2)
    for bad in (
        {"token_delay_ms": -1},
        {"token_delay_ms": 250, "error_rate": 0.5},
        {"stream_refuse_rate": 1.5},
        {"stream_break_after_tokens": -1},
    ):
        with pytest.raises(ValueError):
            LLMFaults.parse(bad)
    Drill(faults={"stream_refuse_rate": 0.5}).check_kind("llm")
    with pytest.raises(ValueError, match="faults of an LLM version"):
        Drill(faults={"stream_break_after_tokens": 2}).check_kind("policy")
    with pytest.raises(ValueError, match="error_rate"):  # a policy's fault among an LLM's
        Drill(faults={"token_delay_ms": 10, "error_rate": 0.1})
    Drill(faults={"token_delay_ms": 10}).check_kind("llm")
    Drill(faults={"error_rate": 0.5}).check_kind("policy")
    with pytest.raises(ValueError, match="faults of an LLM version"):
        Drill(faults={"token_delay_ms": 10}).check_kind("policy")
    with pytest.raises(ValueError, match="error_rate"):
        Drill(faults={"error_rate": 0.5}).check_kind("llm")
    with pytest.raises(ValueError, match="policy versions only"):
        Drill(after_swap={"error_rate": 1.0}).check_kind("llm")
    # The drill reaches the version's server as its user_config (reconfigure), none by default.
    args = {"model": "/models/tiny", "version_label": "3"}
    (entry,) = llm_app_config("chat-v3", args, faults={"token_delay_ms": 10})["deployments"]
    none = {"token_delay_ms": 0.0, "stream_refuse_rate": 0.0, "stream_break_after_tokens": 0}
    faults = {**none, "token_delay_ms": 10.0}
    assert entry == {"name": LLM_DEPLOYMENT, "user_config": {"faults": faults}}
    (entry,) = llm_app_config("chat-v3", args)["deployments"]
    assert entry["user_config"] == {"faults": none}


def test_faults_and_serving_options_are_validated():
    assert Faults.parse({"error_rate": 0.5}).error_rate == 0.5
    for bad in ({"error_rate": 2}, {"latency_ms": -1}, {"explode": True}):
        with pytest.raises(ValueError):
            Faults.parse(bad)
    assert serving_options({"num_cpus": 0.5, "num_replicas": 2}) == {
        "ray_actor_options": {"num_cpus": 0.5},
        "num_replicas": 2,
    }
    with pytest.raises(ValueError, match="unknown serving options"):
        serving_options({"replicas": 2})
    with pytest.raises(ValueError, match="num_replicas"):
        serving_options({"num_replicas": 0})


def test_the_router_runs_two_replicas_where_the_cluster_has_several_nodes():
    from prefect_ray_lifecycle.tasks.rollout.config import Serving

    auto = Serving(router_num_cpus=0.1)
    assert auto.router_options(alive_nodes=1) == {"num_replicas": 1, "num_cpus": 0.1}
    assert auto.router_options(alive_nodes=3)["num_replicas"] == 2
    assert Serving(router_replicas=3).router_options(alive_nodes=1)["num_replicas"] == 3
    assert Serving(router_replicas=1).router_options(alive_nodes=3)["num_replicas"] == 1
    # A router hosting an LLM engine loads one per replica: one unless asked for more.
    assert auto.router_options(alive_nodes=3, hosts_engine=True)["num_replicas"] == 1
    two = Serving(router_replicas=2).router_options(alive_nodes=3, hosts_engine=True)
    assert two["num_replicas"] == 2
