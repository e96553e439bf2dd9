"""Shared by the chart tests: a PNG's size from its header, and a small synthetic sweep."""

from __future__ import annotations

import struct
from pathlib import Path

from prefect_ray_lifecycle.tasks.charts import PNG_MAGIC, save_png
from prefect_ray_lifecycle.tasks.tune.chart import STOPPED_EARLY, STOPPED_ERROR, draw_sweep
from prefect_ray_lifecycle.tasks.tune.sweep import EvaluationReport, TrialSummary


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which a valid PNG has first."""
    assert data[:8] == PNG_MAGIC, data[:8]
    assert data[12:16] == b"IHDR", data[12:16]
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def trial(trial_id: str, lr: float, iterations: int, stopped: str, **fields) -> TrialSummary:
    return TrialSummary(
        trial_id=trial_id,
        status=fields.pop("status", "TERMINATED"),
        config={"lr": lr},
        best_return=fields.pop("best_return", 0.0),
        env_steps=iterations * 1000,
        iterations=iterations,
        checkpoint=None,
        stopped=stopped,
        **fields,
    )


def synthetic_sweep():
    """Four trials: the winner (its return goal met at iteration 6), two ASHA cut at their
    rungs (2 and 4), one that failed at iteration 3; points every 1000 env steps."""
    trials = [
        trial("aaaaa_00000", 3e-4, 6, "stop condition (episode_return)", best_return=460.0),
        trial("aaaaa_00001", 1e-4, 2, STOPPED_EARLY),
        trial("aaaaa_00002", 2e-4, 4, STOPPED_EARLY),
        trial("aaaaa_00003", 9e-4, 3, STOPPED_ERROR, status="ERROR", error="boom"),
    ]
    slopes = {"aaaaa_00000": 75.0, "aaaaa_00001": 10.0, "aaaaa_00002": 30.0, "aaaaa_00003": 20.0}
    curves = {
        t.trial_id: [
            {"iteration": i, "env_steps": 1000 * i, "return": 10.0 + slopes[t.trial_id] * i}
            for i in range(1, t.iterations + 1)
        ]
        for t in trials
    }
    evaluation = EvaluationReport(
        episodes=5, mean_return=480.0, std_return=20.0, returns=[500.0] * 4 + [400.0], seeds=[0]
    )
    return trials, curves, "aaaaa_00000", evaluation


def synthetic_chart(path: Path) -> Path:
    trials, curves, best, evaluation = synthetic_sweep()
    figure = draw_sweep(
        trials,
        curves,
        best,
        evaluation,
        "env_runners/episode_return_mean",
        experiment="/tmp/synthetic/sweep",
    )
    return save_png(figure, path)
