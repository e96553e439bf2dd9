"""The promotion policy alone: a pure function, no services."""

import pytest

from prefect_ray_lifecycle.control.promotion import EvalProtocol, Score, decide_promotion

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
