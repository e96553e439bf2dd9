"""The promotion policy: a pure decision, tested without any service."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class EvalProtocol:
    """How a policy was scored: same environment, env_config, held-out seed and episodes."""

    environment: str
    episodes: int
    seed: int
    env_config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> EvalProtocol:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Score:
    """One model version's evaluation under a protocol."""

    version: str
    mean_return: float
    std_return: float
    protocol: EvalProtocol


@dataclass(frozen=True)
class Verdict:
    promote: bool
    reason: str


def decide_promotion(challenger: Score, champion: Score | None, margin: float) -> Verdict:
    """Promote when there is no champion, or when the challenger's mean return beats the
    champion's by more than `margin` under the same evaluation protocol."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if champion is None:
        return Verdict(
            True,
            f"no champion yet; challenger v{challenger.version} scores "
            f"{challenger.mean_return:.2f}",
        )
    _check_same_protocol(challenger, champion)
    gain = challenger.mean_return - champion.mean_return
    comparison = (
        f"challenger v{challenger.version} {challenger.mean_return:.2f} vs champion "
        f"v{champion.version} {champion.mean_return:.2f} (margin {margin:g})"
    )
    if gain > margin:
        return Verdict(True, f"better by {gain:.2f}: {comparison}")
    return Verdict(False, f"not better by more than the margin: {comparison}")


# -- LLM versions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LLMScore:
    """One LLM version's held-out evaluation under a protocol (workloads.llm.evaluate)."""

    version: str
    exact_match: float
    perplexity: float
    protocol: Any

    def describe(self) -> str:
        return (
            f"v{self.version} exact match {self.exact_match:.2f}, perplexity {self.perplexity:.2f}"
        )


def decide_llm_promotion(
    challenger: LLMScore,
    champion: LLMScore | None,
    margin: float,
    perplexity_margin: float,
) -> Verdict:
    """Promote when there is no champion; or when, under the same protocol, the challenger's
    greedy exact match beats the champion's by more than `margin` (a share of prompts); or
    when its exact match is no lower and its perplexity is lower by more than
    `perplexity_margin` (a share of the champion's). Anything else keeps the champion."""
    if margin < 0 or not 0 <= perplexity_margin < 1:
        raise ValueError(
            f"margin must be >= 0 and perplexity_margin in [0, 1), got {margin}, "
            f"{perplexity_margin}"
        )
    if champion is None:
        return Verdict(True, f"no champion yet; challenger {challenger.describe()}")
    _check_same_protocol(challenger, champion)
    gain = challenger.exact_match - champion.exact_match
    drop = 1 - challenger.perplexity / champion.perplexity
    comparison = (
        f"challenger {challenger.describe()} vs champion {champion.describe()} (margins: exact "
        f"match {margin:g}, perplexity {perplexity_margin:.0%})"
    )
    if gain > margin:
        return Verdict(True, f"exact match better by {gain:.2f}: {comparison}")
    if gain >= 0 and drop > perplexity_margin:
        return Verdict(True, f"perplexity {drop:.0%} lower at no lower exact match: {comparison}")
    return Verdict(False, f"not better by a margin: {comparison}")


def _check_same_protocol(challenger: Score | LLMScore, champion: Score | LLMScore) -> None:
    """Scores under different protocols are not comparable: refuse, naming both."""
    if champion.protocol != challenger.protocol:
        raise ValueError(
            f"champion v{champion.version} and challenger v{challenger.version} were scored "
            f"under different protocols ({champion.protocol} vs {challenger.protocol}); "
            f"score both under one protocol first"
        )
