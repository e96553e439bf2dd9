"""The promotion policy alone: a pure function, no services."""

import pytest

from prefect_ray_lifecycle.control.promotion import (
    EvalProtocol,
    LLMScore,
    Score,
    decide_llm_promotion,
    decide_promotion,
)
from prefect_ray_lifecycle.workloads.llm.evaluate import LLMEvalProtocol

PROTOCOL = EvalProtocol("CartPole-v1", episodes=10, seed=0)


def score(version: str, mean: float, protocol: EvalProtocol = PROTOCOL) -> Score:
    return Score(version, mean, 1.0, protocol)


def test_no_champion_promotes():
    verdict = decide_promotion(score("1", 12.0), None, margin=5.0)
    assert verdict.promote and "no champion" in verdict.reason


@pytest.mark.parametrize(
    "challenger,champion,margin,promote",
    [
        (200.0, 100.0, 0.0, True),
        (200.0, 100.0, 99.0, True),
        (200.0, 100.0, 100.0, False),  # must beat the margin, not meet it
        (100.0, 100.0, 0.0, False),  # a tie keeps the champion
        (90.0, 100.0, 0.0, False),
    ],
)
def test_margin_decides(challenger, champion, margin, promote):
    verdict = decide_promotion(score("2", challenger), score("1", champion), margin)
    assert verdict.promote is promote
    assert "v2" in verdict.reason and "v1" in verdict.reason


def test_different_protocols_are_not_compared():
    other = EvalProtocol("CartPole-v1", episodes=10, seed=7)
    with pytest.raises(ValueError, match="different protocols"):
        decide_promotion(score("2", 200.0), score("1", 100.0, other), margin=0.0)


def test_negative_margin_is_rejected():
    with pytest.raises(ValueError, match="margin"):
        decide_promotion(score("2", 1.0), None, margin=-1.0)


def test_protocol_round_trips_through_its_tag_form():
    protocol = EvalProtocol("pkg.mod:make", episodes=3, seed=5, env_config={"b": 1, "a": [2]})
    assert EvalProtocol.from_json(protocol.to_json()) == protocol


# -- LLM versions: exact match first, perplexity at no lower exact match --------------------

LLM_PROTOCOL = LLMEvalProtocol(examples=50, seed=0, tasks=("count",))


def llm(version: str, exact_match: float, perplexity: float, protocol=LLM_PROTOCOL) -> LLMScore:
    return LLMScore(version, exact_match, perplexity, protocol)


@pytest.mark.parametrize(
    "challenger,champion,promote,why",
    [
        ((0.98, 2.7), (0.0, 1019.0), True, "exact match better by 0.98"),
        ((0.90, 3.0), (0.88, 2.9), False, "not better by a margin"),  # within the margin
        ((0.96, 3.0), (0.88, 2.9), True, "exact match better by 0.08"),
        ((1.0, 2.5), (1.0, 2.7), True, "perplexity 7% lower at no lower exact match"),
        ((1.0, 2.65), (1.0, 2.7), False, "not better by a margin"),  # 2 % lower: not 5 %
        ((0.95, 1.5), (1.0, 2.7), False, "not better by a margin"),  # answers worse
        ((0.0, 1019.0), (0.98, 2.7), False, "not better by a margin"),  # the base: worse
    ],
)
def test_an_llm_challenger_is_promoted_only_when_better_by_a_margin(
    challenger, champion, promote, why
):
    verdict = decide_llm_promotion(
        llm("2", *challenger), llm("1", *champion), margin=0.05, perplexity_margin=0.05
    )
    assert verdict.promote is promote
    assert why in verdict.reason
    assert "challenger v2 exact match" in verdict.reason and "champion v1" in verdict.reason


def test_an_llm_without_champion_is_promoted_and_protocols_must_match():
    assert decide_llm_promotion(llm("1", 0.0, 900.0), None, 0.0, 0.0).promote
    other = LLMEvalProtocol(examples=50, seed=1, tasks=("count",))
    with pytest.raises(ValueError, match="different protocols"):
        decide_llm_promotion(llm("2", 1.0, 2.0), llm("1", 0.0, 9.0, other), 0.0, 0.0)
    with pytest.raises(ValueError, match="perplexity_margin"):
        decide_llm_promotion(llm("2", 1.0, 2.0), None, 0.0, 1.5)


def test_a_version_tag_names_its_protocol_kind():
    from prefect_ray_lifecycle.tasks.register import recorded_protocol

    assert recorded_protocol(LLM_PROTOCOL.to_json()) == LLM_PROTOCOL
    assert recorded_protocol(PROTOCOL.to_json()) == PROTOCOL
    assert recorded_protocol('{"what": 1}') is None and recorded_protocol(None) is None
