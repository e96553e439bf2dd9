"""The LLM lifecycle's pure pieces, without services: held-out metrics, the evaluation
protocol as a version records it, lineage tags, registration requests, the sweep's shares of
the cluster and its choice of trial."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from prefect_ray_lifecycle.tasks.finetune.evaluate import LLMEvaluationSummary
from prefect_ray_lifecycle.tasks.finetune.register import LLMLineage, llm_lineage_tags
from prefect_ray_lifecycle.workloads.llm import corpus
from prefect_ray_lifecycle.workloads.llm.evaluate import (
    LLMEvalProtocol,
    LLMEvaluationSettings,
    exact_match,
    held_out_examples,
    perplexity,
)


def test_exact_match_and_perplexity():
    assert exact_match([" 82 83 84", "b c d "], [" 82 83 84", " b c e"]) == 0.5
    assert exact_match(["x"], ["x"]) == 1.0
    with pytest.raises(ValueError, match="2 answers for 1 references"):
        exact_match(["a", "b"], ["a"])
    assert perplexity(math.log(1024) * 10, 10) == pytest.approx(1024)
    with pytest.raises(ValueError, match="no tokens"):
        perplexity(1.0, 0)


def test_the_protocol_names_its_prompts_and_round_trips(tmp_path):
    protocol = LLMEvaluationSettings(examples=20, seed=3).protocol()
    assert LLMEvalProtocol.from_json(protocol.to_json()) == protocol
    assert json.loads(protocol.to_json())["kind"] == "llm"
    prompts = held_out_examples(protocol)
    assert prompts == held_out_examples(protocol) and len(prompts) == 20
    trained = {e.prompt for e in corpus.examples(2000, seed=3)}
    assert not {e.prompt for e in prompts} & trained  # never a training prompt
    with pytest.raises(ValueError, match=r"evaluation.tasks: must be some of"):
        LLMEvaluationSettings(tasks=["sort"]).protocol()
    with pytest.raises(ValueError, match=r"evaluation.held_out: '/nowhere.jsonl' is not a file"):
        LLMEvaluationSettings(held_out="/nowhere.jsonl").protocol()
    # A file of held-out rows: the protocol names its content, so an edited file is another.
    rows = tmp_path / "held-out.jsonl"
    rows.write_text('{"prompt": "a: count on from 10", "completion": " 11 12 13"}\n')
    first = LLMEvaluationSettings(held_out=str(rows)).protocol()
    assert [e.completion for e in held_out_examples(first)] == [" 11 12 13"]
    rows.write_text('{"prompt": "a: count on from 20", "completion": " 21 22 23"}\n')
    assert LLMEvaluationSettings(held_out=str(rows)).protocol() != first
    rows.write_text('{"question": "?"}\n')
    with pytest.raises(ValueError, match="needs `prompt` and `completion` in every row"):
        held_out_examples(LLMEvaluationSettings(held_out=str(rows)).protocol())


def test_lineage_tags_name_the_runs_the_checkpoint_the_data_and_the_base():
    evaluation = LLMEvaluationSummary(
        perplexity=2.5,
        exact_match=0.96,
        examples=50,
        tokens=850,
        protocol=LLMEvalProtocol(50).to_json(),
    )
    lineage = LLMLineage(
        train_run="/runs/fr-0/finetune",
        checkpoint="/runs/fr-0/finetune/checkpoint-000160-final",
        checkpoint_step=160,
        finetune_flow_run_id="fr-0",
        dataset_fingerprint="abc123",
        base="/models/tiny",
    )
    tags = llm_lineage_tags(
        lineage,
        flow_run_id="fr-1",
        flow_run_url="http://prefect/runs/flow-run/fr-1",
        task_run_id="tr-1",
        commit="deadbeef",
        evaluation=evaluation,
    )
    assert tags["lifecycle.train.checkpoint_step"] == "160"
    assert tags["lifecycle.train.flow_run_id"] == "fr-0"
    assert tags["lifecycle.prefect.flow_run_id"] == "fr-1"
    assert tags["lifecycle.dataset.fingerprint"] == "abc123"
    assert tags["lifecycle.base"] == "/models/tiny"
    assert tags["lifecycle.eval.exact_match"] == "0.96"
    assert json.loads(tags["lifecycle.eval.protocol"])["kind"] == "llm"
    # Facts not known are left out, not written empty.
    assert "lifecycle.base.version" not in tags and "lifecycle.tune.trial_id" not in tags


def test_a_registration_request_names_a_bad_field():
    from prefect_ray_lifecycle.flows.llm_register import LLMRegistrationRequest

    good = {"checkpoint": "/c", "train_run": "/r"}
    with pytest.raises(ValidationError, match=r"route 'Bad Route' must be lowercase"):
        LLMRegistrationRequest(**good, route="Bad Route")
    with pytest.raises(ValidationError, match=r"model name 'no spaces' is not a valid"):
        LLMRegistrationRequest(**good, model_name="no spaces")
    assert LLMRegistrationRequest(**good).serving_settings() is None
    settings = LLMRegistrationRequest(**good, llm={"num_cpus": 0.5}).serving_settings()
    assert settings["llm"]["num_cpus"] == 0.5 and "router_num_cpus" in settings["serving"]


def test_the_sweep_runs_as_many_trials_at_once_as_their_workers_fit():
    from prefect_ray_lifecycle.workloads.llm.train.sweep import sweep_concurrency

    # 2 CPUs: two trials of a 0.25-CPU actor and one 0.75-CPU worker; one of a 1-CPU
    # worker (1.25 each); one of two workers; none of three.
    assert sweep_concurrency(2, 1, 0.75, trials=2, requested=None, trial_cpus=0.25) == (2, None)
    assert sweep_concurrency(2, 1, 1, trials=2, requested=None, trial_cpus=0.25) == (1, None)
    assert sweep_concurrency(2, 2, 0.75, trials=4, requested=None, trial_cpus=0.25) == (1, None)
    assert sweep_concurrency(4, 1, 0.75, trials=4, requested=3, trial_cpus=0.25) == (3, None)
    assert sweep_concurrency(4, 1, 0.75, trials=1, requested=None, trial_cpus=0.25) == (1, None)
    count, problem = sweep_concurrency(2, 3, 0.75, trials=2, requested=None, trial_cpus=0.25)
    assert count == 0 and "sweep.trial_cpus 0.25 + resources.workers 3 x" in problem


def test_the_best_checkpoint_of_all_trials_wins():
    from prefect_ray_lifecycle.workloads.llm.train.sweep import TrialCheckpoint, best_checkpoint

    kept = [
        TrialCheckpoint("a", 1.2, "/a/40", 40),
        TrialCheckpoint("b", 0.9, "/b/60", 60),
        TrialCheckpoint("b", None, "/b/20", 20),  # no eval loss: not ranked
        TrialCheckpoint("c", 0.5, None, 80),  # evicted: not there
    ]
    assert best_checkpoint(kept).path == "/b/60"
    assert best_checkpoint([]) is None


def test_sweep_settings_name_what_they_cannot_search():
    from prefect_ray_lifecycle.tasks.finetune.config import LLMSweepSettings

    with pytest.raises(ValidationError, match=r"searches learning_rate, warmup_steps only"):
        LLMSweepSettings(search_space={"lr": {"choice": [1e-3]}})
    with pytest.raises(ValidationError, match=r"loguniform needs low > 0"):
        LLMSweepSettings(search_space={"learning_rate": {"loguniform": [0, 1]}})
    sweep = LLMSweepSettings(search_space={"warmup_steps": {"choice": [5, 40]}})
    assert "may pick 40, not below training.total_steps 40" in sweep.warmup_problem(40)
    assert sweep.warmup_problem(41) is None
    grid = {"learning_rate": {"grid": [1e-3, 2e-3, 3e-3]}, "warmup_steps": {"grid": [1, 2]}}
    assert LLMSweepSettings(search_space=grid, num_samples=2).trial_count() == 12
    floats = LLMSweepSettings(search_space={"warmup_steps": {"uniform": [1, 5]}})
    assert "steps are whole" in floats.warmup_problem(100)


def test_every_parameter_of_the_llm_flows_is_described_for_the_ui():
    from prefect_ray_lifecycle.flows.llm_pipeline import llm_train_and_ship
    from prefect_ray_lifecycle.flows.llm_register import register_llm_and_promote
    from prefect_ray_lifecycle.flows.llm_sweep import llm_sweep
    from tests.schema_checks import undescribed

    for flow in (llm_sweep, register_llm_and_promote, llm_train_and_ship):
        assert undescribed(flow) == [], flow.name
