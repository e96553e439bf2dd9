"""Canary, bake and shadow analysis: a version's request figures judged against thresholds and
against the live version, and a shadow's comparison of the candidate's answers with live's.
Pure functions over the router's figures (workloads.serve.route_state), and the verdict a
failed gate raises."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

MIN_BASELINE_REQUESTS = 20


class GateFailed(RuntimeError):
    """A rollout gate said no; `stage` names the gate and the message the reason."""

    def __init__(self, stage: str, reason: str, figures: dict[str, Any] | None = None):
        super().__init__(f"{stage}: {reason}")
        self.stage = stage
        self.reason = reason
        self.figures = figures or {}

    def __reduce__(self):
        return (GateFailed, (self.stage, self.reason, self.figures))


@dataclass(frozen=True)
class Thresholds:
    max_error_rate: float = 0.01
    max_p99_ms: float = 1000.0
    max_p99_ratio: float = 3.0  # candidate p99 against live p99
    min_requests: int = 0
    # Added to the ratio's bound: the canary share crosses to another app while live traffic
    # may be answered in the router's own process, and tiny models' p99s are mostly noise.
    p99_slack_ms: float = 50.0

    def __post_init__(self):
        if not 0.0 <= self.max_error_rate <= 1.0:
            raise ValueError(f"max_error_rate must be within [0, 1], got {self.max_error_rate}")
        if (
            self.max_p99_ms <= 0
            or self.max_p99_ratio < 1.0
            or self.min_requests < 0
            or self.p99_slack_ms < 0
        ):
            raise ValueError(f"thresholds out of range: {self}")


@dataclass(frozen=True)
class Judgement:
    ok: bool | None  # None: inconclusive (too few requests to judge)
    reason: str


def judge(
    candidate: dict[str, Any] | None, live: dict[str, Any] | None, thresholds: Thresholds
) -> Judgement:
    """Judge a version's figures ({requests, errors, error_rate, p99_ms}) for one window."""
    requests = int(candidate["requests"]) if candidate else 0
    if requests == 0 or requests < thresholds.min_requests:
        return Judgement(
            None,
            f"{requests} request(s), fewer than the "
            f"{max(thresholds.min_requests, 1)} needed to judge",
        )
    if too_many := _error_failure(candidate, thresholds):
        return too_many
    rate = int(candidate["errors"]) / requests
    p99 = candidate.get("p99_ms")
    if p99 is not None and p99 > thresholds.max_p99_ms:
        return Judgement(False, f"p99 latency {p99:.1f} ms is above {thresholds.max_p99_ms:g} ms")
    baseline = (
        live.get("p99_ms") if live and live.get("requests", 0) >= MIN_BASELINE_REQUESTS else None
    )
    if _slower(p99, baseline, thresholds.max_p99_ratio, thresholds.p99_slack_ms):
        return Judgement(
            False,
            f"p99 latency {p99:.1f} ms is over {thresholds.max_p99_ratio:g}x "
            f"the live version's {baseline:.1f} ms + "
            f"{thresholds.p99_slack_ms:g} ms",
        )
    latency = f", p99 {p99:.1f} ms" if p99 is not None else ""
    return Judgement(True, f"{requests} requests, error rate {rate:.1%}{latency}")


def judge_llm(
    candidate: dict[str, Any] | None,
    live: dict[str, Any] | None,
    max_ttft_ms: float,
    min_tokens_per_s_ratio: float,
) -> str | None:
    """Why an LLM candidate fails on time to first token or tokens/s, or None. Figures are
    {ttft_p99_ms, tokens_per_s_p50} of one replica each."""
    if not candidate or candidate["ttft_p99_ms"] is None:
        return None
    if candidate["ttft_p99_ms"] > max_ttft_ms:
        return (
            f"time to first token p99 {candidate['ttft_p99_ms']:.0f} ms is above {max_ttft_ms:g} ms"
        )
    ours, theirs = candidate["tokens_per_s_p50"], (live or {}).get("tokens_per_s_p50")
    if ours is not None and theirs and ours < min_tokens_per_s_ratio * theirs:
        return f"{ours:.0f} tokens/s is below {min_tokens_per_s_ratio:g}x live's {theirs:.0f}"
    return None


def early_failure(
    candidate: dict[str, Any] | None, thresholds: Thresholds, min_requests: int = 10
) -> Judgement | None:
    """A failure already certain mid-window: enough requests and too many errors."""
    if not candidate or candidate["requests"] < max(min_requests, thresholds.min_requests):
        return None
    return _error_failure(candidate, thresholds)


def _error_failure(candidate: dict[str, Any], thresholds: Thresholds) -> Judgement | None:
    return _too_many_errors(
        int(candidate["requests"]), int(candidate["errors"]), thresholds.max_error_rate
    )


def _slower(ours: float | None, theirs: float | None, ratio: float, slack_ms: float) -> bool:
    """A p99 over `ratio` times another's plus `slack_ms` (never when either is unknown)."""
    return ours is not None and theirs is not None and ours > theirs * ratio + slack_ms


def _too_many_errors(
    requests: int, errors: int, max_error_rate: float, what: str = "error rate"
) -> Judgement | None:
    rate = errors / requests
    if rate > max_error_rate:
        return Judgement(
            False, f"{what} {rate:.1%} ({errors} of {requests}) is above {max_error_rate:.1%}"
        )
    return None


@dataclass(frozen=True)
class ShadowThresholds:
    min_requests: int = 20  # copies answered (or failed) before a judgement
    min_agreement: float | None = 0.99  # None: agreement is reported, never judged
    max_error_rate: float = 0.01
    max_p99_ratio: float = 3.0  # candidate p99 against live's on the same requests
    p99_slack_ms: float = 50.0

    def __post_init__(self):
        agreement = self.min_agreement
        if (
            self.min_requests < 1
            or (agreement is not None and not 0.0 <= agreement <= 1.0)
            or not 0.0 <= self.max_error_rate <= 1.0
            or self.max_p99_ratio < 1.0
            or self.p99_slack_ms < 0
        ):
            raise ValueError(f"shadow thresholds out of range: {self}")


def judge_shadow(
    candidate: dict[str, Any] | None,
    thresholds: ShadowThresholds,
    noise_floor: dict[str, Any] | None = None,
) -> Judgement:
    """Judge the shadow's figures of a candidate (workloads.serve.shadow.summarize_shadow):
    its errors, its agreement with live (rows for a policy, whole completions for an LLM),
    and its p99 against live's on the same requests. `noise_floor`, the live version's own
    app against live, is named beside the agreement, never judged."""
    copies = int((candidate or {}).get("copies", 0))
    if copies < thresholds.min_requests:
        return Judgement(
            None, f"{copies} shadow copies, fewer than the {thresholds.min_requests} needed"
        )
    errors = int(candidate["errors"])
    if failed := _too_many_errors(copies, errors, thresholds.max_error_rate, "shadow error rate"):
        return failed
    agreement = candidate.get("agreement")
    floor = (noise_floor or {}).get("agreement")
    against = f" (noise floor {floor:.1%})" if floor is not None else ""
    if (
        thresholds.min_agreement is not None
        and agreement is not None
        and agreement < thresholds.min_agreement
    ):
        return Judgement(
            False,
            f"agreement with live {agreement:.1%} over {candidate['rows']} answers is below "
            f"{thresholds.min_agreement:.1%}{against}",
        )
    ours, theirs = candidate.get("candidate_p99_ms"), candidate.get("live_p99_ms")
    if _slower(ours, theirs, thresholds.max_p99_ratio, thresholds.p99_slack_ms):
        return Judgement(
            False,
            f"shadow p99 {ours:.1f} ms is over {thresholds.max_p99_ratio:g}x live's "
            f"{theirs:.1f} ms on the same requests + {thresholds.p99_slack_ms:g} ms",
        )
    shown = "n/a" if agreement is None else f"{agreement:.1%}"
    judged = "" if thresholds.min_agreement is not None else " (reported, not judged)"
    return Judgement(
        True,
        f"{copies} copies, agreement {shown}{judged}{against}, error rate {errors / copies:.1%}",
    )


def early_shadow_failure(
    candidate: dict[str, Any] | None, thresholds: ShadowThresholds, min_requests: int = 10
) -> Judgement | None:
    """A shadow failure already certain mid-stage: enough copies and too many errors."""
    copies = int((candidate or {}).get("copies", 0))
    if copies < max(min_requests, 1) or candidate["errors"] / copies <= thresholds.max_error_rate:
        return None
    return judge_shadow(candidate, replace(thresholds, min_requests=1, min_agreement=None))
