"""The rollout chart draws what it is given: a line per version and figure, a boundary per
stage, the gates' thresholds; and tasks.charts writes a PNG of sensible size. The charts
attached by real flow runs are checked in test_rollout.py and test_tune_sweep.py."""

from __future__ import annotations

import struct

from prefect_ray_lifecycle.tasks.charts import PNG_MAGIC, artifact_key, save_png
from prefect_ray_lifecycle.tasks.rollout.chart import draw_rollout

T0 = 1_700_000_000.0
THRESHOLDS = {"max_error_rate": 0.05, "max_p99_ms": 800.0, "max_p99_ratio": 2.0, "p99_slack_ms": 50}


def point(at: float, rate: float, error_rate: float, p99: float | None) -> dict:
    return {"at": T0 + at, "requests_per_s": rate, "error_rate": error_rate, "p99_ms": p99}


def rollout_data() -> dict:
    return {
        "title": "Rollout of m v2 on /r",
        "started": T0,
        "candidate": "2",
        "live": "1",
        "series": {
            "1": [point(s, 10.0, 0.0, 20.0) for s in range(10)],
            "2": [point(s, 3.0, 0.5, 30.0) for s in range(4, 10)] + [point(10, 1.0, 1.0, None)],
        },
        "stages": [
            {"at": T0 + 3, "stage": "health", "outcome": "passed"},
            {"at": T0 + 4, "stage": "smoke", "outcome": "passed"},
            {"at": T0 + 9, "stage": "canary 30%", "outcome": "failed"},
        ],
        "thresholds": THRESHOLDS,
    }


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_the_rollout_chart_draws_each_version_stage_and_threshold(tmp_path):
    figure = draw_rollout(rollout_data())
    rate, errors, p99 = figure.axes
    lines = {axes: {line.get_label(): line for line in axes.get_lines()} for axes in figure.axes}
    for axes in (rate, errors):
        assert {"v1 (live)", "v2 (candidate)"} <= set(lines[axes])
    # v2's points, placed at seconds since the start; its p99 skips the bucket without one.
    assert list(lines[rate]["v2 (candidate)"].get_xdata()) == [4, 5, 6, 7, 8, 9, 10]
    assert list(lines[errors]["v2 (candidate)"].get_ydata())[-1] == 1.0
    assert list(lines[p99]["v2 (candidate)"].get_xdata()) == [4, 5, 6, 7, 8, 9]
    assert list(lines[errors]["gate: max 0.05"].get_ydata()) == [0.05, 0.05]
    assert list(lines[p99]["gate: max 800 ms"].get_ydata()) == [800, 800]
    relative = lines[p99]["gate: live p99 x ratio + slack"]
    assert set(relative.get_ydata()) == {2.0 * 20.0 + 50}
    labels = [text.get_text() for text in rate.texts]
    assert labels == ["health: passed", "smoke: passed", "canary 30%: failed"]
    boundaries = [line for line in p99.get_lines() if line.get_label().startswith("_")]
    assert sorted(line.get_xdata()[0] for line in boundaries) == [3, 4, 9]
    width, height = png_size(save_png(figure, tmp_path / "rollout.png"))
    assert 800 <= width <= 3000 and 500 <= height <= 3000


def test_a_chart_without_traffic_still_draws_its_stages_and_says_so():
    data = {**rollout_data(), "series": {}, "live": None}
    texts = [text.get_text() for text in draw_rollout(data).axes[0].texts]
    assert texts == [
        "health: passed",
        "smoke: passed",
        "canary 30%: failed",
        "no requests through the router during this rollout",
    ]


def test_stages_that_ended_together_share_one_label():
    stages = [
        {"at": T0 + 15.1, "stage": "health", "outcome": "passed"},
        {"at": T0 + 15.2, "stage": "smoke", "outcome": "passed"},
        {"at": T0 + 20.0, "stage": "router", "outcome": "created"},
    ]
    figure = draw_rollout({**rollout_data(), "stages": stages})
    labels = [text.get_text() for text in figure.axes[0].texts]
    assert labels == ["health: passed, smoke: passed", "router: created"]


def test_artifact_keys_are_what_prefect_accepts():
    assert artifact_key("rollout", "policy", "CartPole_PPO.v2") == "rollout-policy-cartpole-ppo-v2"
    assert (
        artifact_key("rollout-chart", "llm-test", "chat-1a2b") == "rollout-chart-llm-test-chat-1a2b"
    )
