"""The pure rules of who answers a request during a rollout, and of the shadow's judgement:
sticky sessions by a stable hash, a tester's header, the shadow's comparison of two answers
and its verdict, the router config's shadow, testers and approval records, reconcile's step
for a rollout that died waiting for approval, and the gates' new settings. No services."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefect_ray_lifecycle.control.canary import (
    ShadowThresholds,
    early_shadow_failure,
    judge_shadow,
)
from prefect_ray_lifecycle.control.convergence import Observed, next_step, router_kept
from prefect_ray_lifecycle.tasks.rollout.config import Gates
from prefect_ray_lifecycle.workloads.http import BadRequest
from prefect_ray_lifecycle.workloads.serve.policy import Faults
from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig, Shadow, Target
from prefect_ray_lifecycle.workloads.serve.shadow import (
    BATCH_ROWS,
    QUEUE_SIZE,
    Copy,
    Mirror,
    ShadowTally,
    batches,
    compare,
    greedy_llm_request,
    summarize_shadow,
)
from prefect_ray_lifecycle.workloads.serve.traffic import (
    MAX_SESSION_KEY,
    canary_choice,
    episode_key,
    session_key,
    sticky_draw,
    token_digest,
)

TARGET = {
    "app": "m-v1",
    "version": "1",
    "model": {"name": "m", "version": "1", "tracking_uri": "http://127.0.0.1:5000"},
}
CANDIDATE = {**TARGET, "app": "m-v2", "version": "2"}


def request(headers=None, body: bytes = b"{}") -> dict:
    return {"method": "POST", "path": "/", "headers": headers or {}, "body": body}


# ---- sticky sessions ------------------------------------------------------------------------


def test_a_session_draw_is_the_same_in_every_process():
    """BLAKE2b, not hash(): another interpreter (another PYTHONHASHSEED) draws the same."""
    here = [sticky_draw("7", f"session:{i}") for i in range(5)]
    code = (
        "from prefect_ray_lifecycle.workloads.serve.traffic import sticky_draw;"
        "print([sticky_draw('7', f'session:{i}') for i in range(5)])"
    )
    there = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=".",
    ).stdout
    assert json.loads(there) == here
    assert all(0 <= d < 1 for d in here)


def test_sessions_move_only_towards_the_candidate_as_its_share_grows_and_split_by_weight():
    draws = [sticky_draw("2", f"session:user-{i}") for i in range(4000)]
    at_10 = {i for i, d in enumerate(draws) if d < 0.1}
    at_50 = {i for i, d in enumerate(draws) if d < 0.5}
    assert at_10 <= at_50  # nobody on the candidate at 10% is moved back to live at 50%
    assert abs(len(at_10) / 4000 - 0.1) < 0.02 and abs(len(at_50) / 4000 - 0.5) < 0.03
    # Another candidate draws afresh: not the same sessions every rollout.
    again = {i for i in range(4000) if sticky_draw("3", f"session:user-{i}") < 0.1}
    assert len(again & at_10) < len(at_10) / 2


def test_session_keys_come_from_the_header_or_a_policys_episode_id():
    assert session_key(request({"x-session-id": "abc"})) == "session:abc"
    assert session_key(request({"x-session-id": ""})) is None
    assert session_key(request()) is None
    with pytest.raises(BadRequest, match="X-Session-Id must be at most") as refused:
        session_key(request({"x-session-id": "x" * (MAX_SESSION_KEY + 1)}))
    assert refused.value.status == 400
    assert episode_key(b'{"observation": [0, 0, 0, 0], "episode_id": "ep-1"}') == "episode:ep-1"
    assert episode_key(b'{"episode_id": 42}') == "episode:42"
    for odd in (b'{"episode_id": true}', b'{"episode_id": 1.5}', b'{"episode_id": ""}'):
        assert episode_key(odd) is None  # the policy answers these with its 422
    assert episode_key(b'{"episode_id": [') is None  # not JSON: the version's own 400
    assert episode_key(b'["episode_id"]') is None


def test_a_tester_header_is_honoured_only_where_the_route_lets_testers_in():
    always = request({"x-canary": "Always"})
    assert canary_choice(always, "off") is None
    assert canary_choice(always, "on") == "always"
    assert canary_choice(request({"x-canary": "never"}), "on") == "never"
    assert canary_choice(request(), "on") is None
    with pytest.raises(BadRequest, match="X-Canary must be one of always, never"):
        canary_choice(request({"x-canary": "sometimes"}), "on")
    assert canary_choice(request({"x-canary": "sometimes"}), "off") is None  # ignored
    digest = token_digest("s3cret")
    assert canary_choice(request({"x-canary": "always"}), "token", digest) is None
    wrong = {"x-canary": "always", "x-canary-token": "guess"}
    assert canary_choice(request(wrong), "token", digest) is None
    right = {"x-canary": "always", "x-canary-token": "s3cret"}
    assert canary_choice(request(right), "token", digest) == "always"


# ---- the shadow's comparison ----------------------------------------------------------------


def test_policy_answers_compare_row_by_row_with_their_total_variation_distance():
    live = {"actions": [0, 1, 1, 0], "probabilities": [[0.9, 0.1], [0.2, 0.8]] * 2}
    same = compare("policy", live, live)
    assert (same.rows, same.agreed, same.tvd_rows) == (4, 4, 4) and same.tvd_sum == 0
    other = {"actions": [0, 0, 1, 0], "probabilities": [[0.9, 0.1], [0.6, 0.4]] * 2}
    pair = compare("policy", live, other)
    assert (pair.rows, pair.agreed) == (4, 3)
    assert pair.tvd_sum == pytest.approx(0.4 + 0.4)
    no_probabilities = compare("policy", {"actions": [[0.5, 1.0]]}, {"actions": [[0.5, 1.0]]})
    assert (no_probabilities.agreed, no_probabilities.tvd_rows) == (1, 0)
    for bad in (None, {"actions": [0]}, {"actions": "x"}):
        with pytest.raises(ValueError):
            compare("policy", live, bad)


def test_llm_answers_compare_by_exact_match_and_common_token_prefix():
    pair = compare("llm", {"token_ids": [5, 6, 7, 8]}, {"token_ids": [5, 6, 9]})
    assert (pair.agreed, pair.prefix, pair.longest) == (0, 2, 4)
    assert compare("llm", {"token_ids": [1, 2]}, {"token_ids": [1, 2]}).agreed == 1
    with pytest.raises(ValueError):
        compare("llm", {"token_ids": [1]}, {})


def test_only_greedy_llm_requests_are_mirrored_and_a_stream_is_mirrored_whole():
    greedy = request(
        body=b'{"prompt": "hi", "temperature": 0, "stream": true, "stream_options": {}}'
    )
    copy = greedy_llm_request(greedy)
    assert json.loads(copy["body"]) == {"prompt": "hi", "temperature": 0}
    whole = request(body=b'{"prompt": "hi", "temperature": 0}')
    assert greedy_llm_request(whole) is whole
    for body in (b'{"prompt": "hi"}', b'{"prompt": "hi", "temperature": 0.7}', b"[", b"[1]"):
        assert greedy_llm_request(request(body=body)) is None


def test_tallies_summarize_agreement_errors_and_both_sides_latency():
    first, second = ShadowTally(), ShadowTally()
    first.add(compare("policy", {"actions": [0, 1]}, {"actions": [0, 0]}), 1.0, 5.0, "policy")
    first.add(None, 2.0, 10_000.0, "policy")  # a timeout: an error, never compared
    second.add(compare("policy", {"actions": [1]}, {"actions": [1]}), 3.0, 7.0, "policy")
    second.dropped = 4
    figures = summarize_shadow([first.as_tuple(), second.as_tuple()])
    assert (figures["copies"], figures["compared"], figures["errors"]) == (3, 2, 1)
    assert figures["agreement"] == pytest.approx(2 / 3) and figures["exact_match"] == 0.5
    assert figures["dropped"] == 4 and figures["tvd"] is None
    assert figures["live_p50_ms"] == 2.0 and figures["candidate_p99_ms"] == 10_000.0
    assert summarize_shadow([])["agreement"] is None


def shadow_figures(copies=100, errors=0, agreement=1.0, ours=10.0, theirs=10.0):
    return {
        "copies": copies,
        "errors": errors,
        "rows": copies - errors,
        "agreement": agreement,
        "candidate_p99_ms": ours,
        "live_p99_ms": theirs,
    }


@pytest.mark.parametrize(
    "figures, ok, words",
    [
        (None, None, "0 shadow copies, fewer than the 20"),
        (shadow_figures(copies=19), None, "fewer than the 20"),
        (shadow_figures(errors=2), False, "shadow error rate 2.0% (2 of 100)"),
        (shadow_figures(agreement=0.7), False, "agreement with live 70.0% over 100 answers"),
        (shadow_figures(ours=100.0), False, "shadow p99 100.0 ms is over 3x live's 10.0 ms"),
        (shadow_figures(agreement=0.995), True, "agreement 99.5%"),
    ],
)
def test_judge_shadow(figures, ok, words):
    verdict = judge_shadow(figures, ShadowThresholds(min_requests=20, min_agreement=0.99))
    assert verdict.ok is ok and words in verdict.reason, verdict


def test_an_llm_shadow_reports_agreement_beside_its_noise_floor_without_judging_it():
    thresholds = ShadowThresholds(min_requests=5, min_agreement=None)
    verdict = judge_shadow(shadow_figures(agreement=0.4), thresholds, {"agreement": 0.9})
    assert verdict.ok is True
    assert "agreement 40.0% (reported, not judged) (noise floor 90.0%)" in verdict.reason
    assert early_shadow_failure(shadow_figures(copies=9, errors=9), thresholds) is None
    assert early_shadow_failure(shadow_figures(copies=10, errors=5), thresholds).ok is False


def test_the_mirror_admits_its_share_within_its_rate_cap_and_drops_what_its_queue_cannot_hold():
    mirror = Mirror(send=None)
    assert sum(mirror.admit(Shadow(1.0, 5.0)) for _ in range(100)) == 5  # a burst of 5
    live = Target.parse(TARGET)

    async def fill():
        async def never(*_):
            await asyncio.sleep(3600)

        mirror.send = never
        for _ in range(QUEUE_SIZE + 30):
            mirror.offer(Copy(live, "candidate", {}, None, 1.0, 1.0))
        await asyncio.sleep(0)
        mirror.task.cancel()

    asyncio.run(fill())
    taken = mirror.take()
    # The sender holds IN_FLIGHT copies, the queue QUEUE_SIZE; the rest were dropped, counted.
    assert taken[("1", "candidate")][2] == mirror.dropped_total > 0


def policy_copy(rows: int, role: str = "candidate", seed: int = 0, target=CANDIDATE) -> Copy:
    """A copy as the router makes it: live's extras carry its actions (the sign of each row's
    first value) and the observations it parsed."""
    observations = np.random.default_rng(seed).uniform(-1, 1, (rows, 4)).astype("<f4")
    live = {
        "actions": [int(row[0] > 0) for row in observations],
        "observations": observations.tobytes(),
    }
    sent = {**request(body=b'{"observations": "as the user sent them"}'), "shadow": True}
    return Copy(Target.parse(target), role, sent, live, 3.0, 1.0)


def test_a_policys_copies_share_calls_by_app_and_role_within_the_row_and_byte_caps():
    bare = Copy(Target.parse(CANDIDATE), "candidate", {}, None, 1.0, 1.0)  # no observations
    copies = [policy_copy(1), policy_copy(4, "noise_floor", target=TARGET), bare, policy_copy(2)]
    copies.append(policy_copy(3, "noise_floor", target=TARGET))
    calls = batches(copies, max_bytes=1 << 20)
    assert [[copies.index(c) for c in call] for call in calls] == [[0, 3], [1, 4], [2]]
    # A call never exceeds the body limit (16 bytes a row here) nor BATCH_ROWS.
    small = batches([policy_copy(2, seed=i) for i in range(5)], max_bytes=16 * 4)
    assert [len(call) for call in small] == [2, 2, 1]
    assert len(batches([policy_copy(BATCH_ROWS // 2 + 1) for _ in range(2)], 1 << 30)) == 2


def test_batched_copies_are_compared_row_by_row_and_a_failed_batch_is_sent_again_one_by_one():
    def run(fail_batches: bool) -> tuple[list[dict], dict]:
        calls: list[dict] = []

        async def send(target, req, timeout_s):  # a candidate acting as live does, on row 1
            calls.append(req)
            if req["headers"].get("content-type") == "application/octet-stream":
                if fail_batches:
                    return {"status": 500}
                rows = np.frombuffer(req["body"], dtype="<f4").reshape(-1, 4)
            else:  # a single copy is sent as the user sent it: answer from live's own record
                rows = np.frombuffer(copies[len(calls) - 2].live["observations"], "<f4")
                rows = rows.reshape(-1, 4)
            actions = [int(row[0] > 0) for row in rows]
            actions[0] = 1 - actions[0]  # disagrees on each call's first row
            return {"status": 200, "shadow": {"actions": actions, "probabilities": None}}

        mirror = Mirror(send)
        copies = [policy_copy(rows, seed=rows) for rows in (3, 1, 4)]

        async def go():
            for copy in copies:
                mirror.offer(copy)
            for _ in range(200):
                await asyncio.sleep(0.01)
                if mirror.sent_total == len(copies):
                    break
            mirror.task.cancel()

        asyncio.run(go())
        return calls, summarize_shadow(list(mirror.take().values()))

    calls, figures = run(fail_batches=False)
    assert len(calls) == 1 and len(calls[0]["body"]) == 8 * 16  # 8 rows, one call
    assert (figures["copies"], figures["errors"], figures["rows"]) == (3, 0, 8)
    assert figures["agreement"] == 7 / 8  # only the batch's first row differed
    calls, figures = run(fail_batches=True)
    assert len(calls) == 4  # the batch, then each copy alone, as the user sent it
    assert all(call["body"].startswith(b'{"observations"') for call in calls[1:])
    assert (figures["copies"], figures["errors"], figures["rows"]) == (3, 0, 8)
    assert figures["agreement"] == 5 / 8  # each single call's first row differed


# ---- the router's config --------------------------------------------------------------------


def shadowing(**overrides):
    return {
        "live": TARGET,
        "candidate": CANDIDATE,
        "shadow": {"share": 1.0, "max_per_s": 50, "noise_floor": True},
        "rollout": {"holder": "run-1", "stage": "shadow", "version": "2"},
        **overrides,
    }


def test_shadow_testers_and_approval_records_round_trip():
    digest = token_digest("t")
    for value in (
        shadowing(testers={"mode": "token", "token_sha256": digest}),
        {
            "live": TARGET,
            "candidate": CANDIDATE,
            "candidate_weight": 0.5,
            "rollout": {
                "holder": "run-1",
                "stage": "canary",
                "version": "2",
                "approval": {"point": "before_swap", "weight": 0.5, "since": 3.0},
            },
        },
    ):
        config = RouterConfig.parse(value)
        assert RouterConfig.parse(config.as_dict()) == config
    # A record written before approvals, shadows and testers still parses.
    old = {"live": TARGET, "rollout": {"holder": "r", "stage": "bake", "version": "1"}}
    assert RouterConfig.parse(old).testers.mode == "off"


@pytest.mark.parametrize(
    "config, message",
    [
        (shadowing(candidate_weight=0.1), "answers no user"),
        (shadowing(rollout={"holder": "r", "stage": "canary", "version": "2"}), "shadow stage"),
        (shadowing(shadow={"share": 0, "max_per_s": 1}), "share in (0, 1]"),
        (shadowing(testers={"mode": "token"}), "token_sha256"),
        (shadowing(testers={"mode": "maybe"}), "testers' mode"),
        (
            {
                "live": TARGET,
                "rollout": {
                    "holder": "r",
                    "stage": "bake",
                    "version": "1",
                    "approval": {"point": "before_swap", "weight": 0.5},
                },
            },
            "only in its canary",
        ),
    ],
)
def test_unsafe_shadow_tester_and_approval_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RouterConfig.parse(config)


@pytest.mark.parametrize(
    ("status", "kept"),
    [
        ("HEALTHY", True),
        ("DeploymentStatus.HEALTHY", True),
        ("UPDATING", True),  # a new config being applied: it answers meanwhile
        ("DeploymentStatus.UPSCALING", True),
        ("DOWNSCALING", True),
        ("UNHEALTHY", False),  # ends in "HEALTHY": it used to count as healthy
        ("DeploymentStatus.UNHEALTHY", False),
        ("DEPLOY_FAILED", False),
        (None, False),
    ],
)
def test_reconcile_keeps_a_router_that_is_only_changing_and_rebuilds_a_broken_one(status, kept):
    """A router that answered with its config is kept while Serve applies a new one or scales
    it; unhealthy or failed, reconcile deploys the route afresh (restore)."""
    assert router_kept(status) is kept
    live = RouterConfig.parse({"live": {"app": "m-v1", "version": "1"}})
    seen = Observed(
        router=live, router_healthy=router_kept(status), holder="h", champion="1", live="1"
    )
    assert next_step(seen).kind == ("in_sync" if kept else "restore")


def test_reconcile_asks_again_for_a_rollout_that_died_waiting_for_approval():
    waiting = RouterConfig.parse(
        {
            "live": TARGET,
            "candidate": CANDIDATE,
            "candidate_weight": 0.5,
            "rollout": {
                "holder": "dead",
                "stage": "canary",
                "version": "2",
                "approval": {"point": "after_step", "weight": 0.5},
            },
        }
    )
    seen = Observed(router=waiting, router_healthy=True, holder="me", champion="2", live="1")
    step = next_step(seen)
    assert (step.kind, step.version) == ("reapprove", "2") and "asking again" in step.reason
    shadow = RouterConfig.parse(
        shadowing(rollout={"holder": "dead", "stage": "shadow", "version": "2"})
    )
    step = next_step(
        Observed(router=shadow, router_healthy=True, holder="me", champion="2", live="1")
    )
    assert step.kind == "withdraw" and "during its shadow" in step.reason


def test_gates_name_a_bad_approval_or_tester_setting():
    assert Gates(approval="after_step", approval_step=0.1).asks_after(0.1)
    with pytest.raises(ValueError, match="approval_step among canary_steps"):
        Gates(approval="after_step", approval_step=0.3)
    with pytest.raises(ValueError, match="tester_token_secret"):
        Gates(tester_header="token")
    gates = Gates(min_agreement=0.9, min_llm_agreement=None)
    assert gates.shadow_thresholds("policy").min_agreement == 0.9
    assert gates.shadow_thresholds("llm").min_agreement is None
    assert (gates.noise_floor("llm"), gates.noise_floor("policy")) == (True, False)


# ---- what a policy answers for a comparison ------------------------------------------------


def test_a_policy_answers_a_shadow_with_its_probabilities_and_a_drill_disagrees_on_a_share(core):
    rows = np.random.default_rng(1).uniform(-0.5, 0.5, (400, 4)).tolist()
    body = json.dumps({"observations": rows}).encode()
    plain = core.answer(request({"content-type": "application/json"}, body))
    assert "shadow" not in plain and "probabilities" not in json.loads(plain["body"])
    asked = core.answer({**request({"content-type": "application/json"}, body), "shadow": True})
    extras = asked["shadow"]
    assert extras["actions"] == json.loads(asked["body"])["actions"]
    assert all(abs(sum(p) - 1) < 1e-5 for p in extras["probabilities"])
    drilled = core.answer(
        {**request({"content-type": "application/json"}, body), "shadow": True}, disagree=0.3
    )
    pair = compare("policy", extras, drilled["shadow"])
    assert 0.6 < pair.agreed / pair.rows < 0.8  # about 30% of rows answered otherwise
    again = core.answer(
        {**request({"content-type": "application/json"}, body), "shadow": True}, disagree=0.3
    )
    assert again["shadow"]["actions"] == drilled["shadow"]["actions"]  # the same rows each time
    assert Faults.parse({"disagree_rate": 0.3}).disagree_rate == 0.3
    with pytest.raises(ValueError):
        Faults.parse({"disagree_rate": 1.5})


@pytest.mark.parametrize("episode", [True, 1.5, "", "x" * (MAX_SESSION_KEY + 1), [1], {"a": 1}])
def test_a_bad_episode_id_is_a_422_naming_it(core, episode):
    body = json.dumps({"observation": [0.0] * 4, "episode_id": episode}).encode()
    answer = core.answer(request({"content-type": "application/json"}, body))
    assert answer["status"] == 422 and "episode_id" in json.loads(answer["body"])["error"]


@settings(max_examples=200, deadline=None)
@given(
    form=st.dictionaries(
        st.sampled_from(["decision", "reason", "name", "extra"]),
        st.none() | st.booleans() | st.integers() | st.text(max_size=600),
        max_size=4,
    )
)
def test_the_approval_form_takes_a_decision_a_reason_and_a_name_or_names_what_is_wrong(form):
    """What the Prefect UI's form (or deployments.approve) may send: valid, or a validation
    error naming the field (Prefect's server checks the same schema before resuming)."""
    from pydantic import ValidationError

    from prefect_ray_lifecycle.tasks.rollout.approval import ApprovalInput

    try:
        answer = ApprovalInput.model_validate(form)
    except ValidationError as error:
        assert {str(e["loc"][0]) for e in error.errors()} <= set(form) | {
            "decision",
            "reason",
            "name",
        }
        return
    assert answer.decision in ("approve", "abort") and answer.reason and answer.name
    assert set(form) == {"decision", "reason", "name"}
