"""An LLM's lifecycle to its route, on the session's services: llm-train-and-ship with a Tune
sweep of 2 trials (1 Train worker each, on 2 CPUs) registers its best trial as an LLM version
with its route, kind and serving settings kept with the model; then a policy's champion is
moved too, and reconcile, run as the champion-moved trigger runs it (with only the model's
name), rolls each out on its own route: the LLM through vLLM on /llm-ship, the policy on
/policy; a reconcile after that finds the LLM's route in sync. One sweep, and no canary
(first rollouts), to stay inside the suite's time. (The pipeline's own rollout, `ship`, is
train-and-ship's shipping step, run by test_pipeline_deployment.)"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient
from tune_results import result_lines

from deployments.testing import drive
from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.llm_finetune import FineTuneParams
from prefect_ray_lifecycle.flows.llm_pipeline import llm_train_and_ship
from prefect_ray_lifecycle.flows.reconcile import reconcile
from prefect_ray_lifecycle.flows.register import RegistrationRequest, register_and_promote
from prefect_ray_lifecycle.tasks.finetune.config import LLMSweepSettings
from prefect_ray_lifecycle.tasks.register import EvaluationSummary
from prefect_ray_lifecycle.tasks.rollout.config import Gates, LLMServing, Serving
from prefect_ray_lifecycle.workloads.constants import (
    LLM_DEPLOYMENT,
    ROUTER_DEPLOYMENT,
    VERSION_HEADER,
    llm_python,
)
from prefect_ray_lifecycle.workloads.llm import corpus
from prefect_ray_lifecycle.workloads.llm.tiny import build_tiny_llm

pytestmark = [pytest.mark.llm, pytest.mark.slow]

LLM_ROUTE, POLICY_ROUTE = "llm-ship", "policy"
TOTAL_STEPS = 40
SWEEP = LLMSweepSettings(
    # One rate the tiny Llama learns from, one it barely moves at: ASHA may stop the second.
    search_space={"learning_rate": {"grid": [5e-3, 1e-5]}, "warmup_steps": {"choice": [4, 8]}},
    num_samples=1,
    grace_period_steps=10,
)
LLM = LLMServing(
    engine={"max_model_len": 128, "kv_cache_memory_bytes": 64 << 20, "dtype": "float32"},
    num_cpus=0.5,
    python=str(Path(llm_python())),
    health_check_period_s=2,
    host_in_router=False,  # one engine on the route, not two
)
SERVING = Serving(num_cpus=0.1, router_num_cpus=0.1, health_check_period_s=1)
GATES = Gates(
    health_timeout_s=240,
    stability_window_s=2,
    smoke_max_latency_ms=20000,
    max_ttft_ms=20000,
    max_p99_ms=20000,
)


@pytest.fixture(scope="module")
def shipped(stack, tmp_path_factory):
    """llm-train-and-ship with a sweep, ship off: trained, registered, promoted (the model's
    first version), nothing rolled out; the routes and models go at the end."""
    work = tmp_path_factory.mktemp("ship")
    corpus.write_corpus(work / "corpus", 1500, seed=1)
    params = FineTuneParams(
        data={"source": str(work / "corpus"), "output": str(work / "prepared"), "split_key": "id"},
        base={"path": str(build_tiny_llm(work / "tiny"))},
        training={
            "total_steps": TOTAL_STEPS,
            "warmup_steps": 4,
            "eval_every_steps": 10,
            "checkpoint_every_steps": 20,
        },
        # Each trial: a 0.25-CPU actor and one 0.75-CPU Train worker; two trials fit 2 CPUs.
        resources={"workers": 1, "cpus_per_worker": 0.75},
        storage_root=str(work / "runs"),
    )
    names = {"llm": f"chat-{uuid.uuid4().hex[:6]}", "policy": f"policy-{uuid.uuid4().hex[:6]}"}
    cluster, server = stack.ray_cluster(), MLflowServer(tracking_uri=stack.mlflow_uri)
    try:
        result = llm_train_and_ship(
            params=params,
            sweep=SWEEP,
            model_name=names["llm"],
            route=LLM_ROUTE,
            ship=False,
            llm=LLM,
            serving=SERVING,
            ray_cluster=cluster,
            mlflow_server=server,
        )
        yield {"result": result, "names": names, "cluster": cluster, "server": server}
    finally:
        with cluster.connect():
            serve_control.start(cluster.serve_host, cluster.serve_port)
            serve_control.delete_route(LLM_ROUTE, names["llm"])
            serve_control.delete_route(POLICY_ROUTE, names["policy"])
            serve_control.release()
        client = MlflowClient(stack.mlflow_uri)
        for name in names.values():
            if client.search_registered_models(f"name = '{name}'"):
                client.delete_registered_model(name)


def trial_spans(experiment: Path) -> list[tuple[float, float]]:
    """(start, end) of each Tune trial of `experiment`, from the results Tune wrote."""
    spans = []
    for results in sorted(experiment.glob("*/result.json")):
        reports = result_lines(results.parent)
        assert reports, f"{results} holds no report"
        start = min(r["timestamp"] - r["time_total_s"] for r in reports)
        spans.append((start, max(r["timestamp"] for r in reports)))
    return spans


def test_a_sweep_of_two_trials_on_two_cpus_registers_its_best_trial(stack, shipped):
    result = shipped["result"]
    sweep = result.sweep
    print("sweep:", sweep.model_dump_json(include={"trials", "max_concurrent_trials"}))
    # Both trials at once, each a 0.25-CPU actor and one 0.75-CPU worker: 2 CPUs together.
    assert sweep.max_concurrent_trials == 2
    assert len(sweep.trials) == 2 and all(t.status == "TERMINATED" for t in sweep.trials)
    # And they ran at once: from Tune's own results, each trial's time (its start, from its
    # first report's timestamp less its time_total_s, to its last report) overlaps the
    # other's: 32-49 s of their 33-51 s in three runs here. One at a time, none would.
    spans = trial_spans(Path(sweep.experiment_path))
    assert len(spans) == 2 and max(s for s, _ in spans) < min(e for _, e in spans), spans
    assert {t.config["learning_rate"] for t in sweep.trials} == {5e-3, 1e-5}
    # The best trial's best checkpoint is what was registered, with its trial and step.
    best = min(
        (t for t in sweep.trials if t.best_eval_loss is not None), key=lambda t: t.best_eval_loss
    )
    assert result.trial_id == best.trial_id == sweep.best.trial_id
    assert best.config["learning_rate"] == 5e-3
    version = MlflowClient(stack.mlflow_uri).get_model_version(result.model_name, result.version)
    assert version.tags["lifecycle.tune.trial_id"] == best.trial_id
    assert version.tags["lifecycle.train.checkpoint_step"] == str(sweep.best_step)
    assert result.promoted and result.promotion_reason.startswith("no champion yet")
    assert not result.shipped and result.reason == "ship is false: no rollout"
    # The fine-tune moved the held-out figures (both measured the same way).
    before, after = result.base_evaluation, result.evaluation
    assert after.perplexity < before.perplexity and after.exact_match >= before.exact_match


def test_a_policy_and_an_llm_champion_each_reach_their_own_route(stack, shipped, checkpoints):
    names, cluster, server = shipped["names"], shipped["cluster"], shipped["server"]
    llm_version = shipped["result"].version
    # The LLM's champion moved when it was registered; now a policy's moves too.
    policy = register_and_promote(
        RegistrationRequest(
            model_name=names["policy"],
            checkpoint=checkpoints["good"],
            experiment_path="/tmp/experiments/ship",
            trial_id="t1",
            evaluation=EvaluationSummary(mean_return=500, std_return=0, episodes=10, seed=0),
            route=POLICY_ROUTE,
        ),
        mlflow_server=server,
    )
    assert policy.promoted
    # What the champion-moved trigger starts, in the order the moves came: a reconcile run
    # per model, given only the model's name (its deployment adds the blocks and gates).
    runs = {
        "llm": reconcile(
            model_name=names["llm"], gates=GATES, ray_cluster=cluster, mlflow_server=server
        ),
        # The policy has no recorded serving settings: the deployment's (faster health
        # checks) instead of the defaults.
        "policy": reconcile(
            model_name=names["policy"],
            gates=GATES,
            serving=SERVING,
            ray_cluster=cluster,
            mlflow_server=server,
        ),
    }
    for kind, version in (("llm", llm_version), ("policy", policy.version)):
        assert runs[kind].action == "restored" and runs[kind].live == version, runs[kind]
        assert runs[kind].rollout.outcome == "first_rollout"
    assert runs["llm"].rollout.route == LLM_ROUTE and runs["policy"].rollout.route == POLICY_ROUTE
    # The ended rollouts hold nothing: a later reconcile (the interval one, the next move)
    # finds the LLM's route in sync. A first LLM rollout the router does not host left a bake
    # record once, and the next reconcile took it for a rollout that died mid-bake.
    with cluster.connect():
        router = serve_control.current_router(LLM_ROUTE)
        serve_control.release()
    assert router.live.version == llm_version and router.rollout is None, router
    again = reconcile(
        model_name=names["llm"], gates=GATES, ray_cluster=cluster, mlflow_server=server
    )
    assert again.action == "in_sync" and again.live == llm_version and again.rollout is None

    base = f"http://127.0.0.1:{stack.serve_port}"

    def complete(max_tokens: int = 3) -> requests.Response:
        return requests.post(
            f"{base}/{LLM_ROUTE}/v1/completions",
            json={
                "model": names["llm"],
                "prompt": "flow task model version canary: count on from 41",
                "max_tokens": max_tokens,
                "temperature": 0,
            },
            timeout=60,
        )

    # host_in_router=false: the router hosts no engine, and every request is forwarded to
    # the version's app, whose own engine counts each one (the router's counts none).
    with cluster.connect():
        router = serve_control.handle(serve_control.router_app_name(LLM_ROUTE), ROUTER_DEPLOYMENT)
        app = serve_control.handle(
            serve_control.version_app_name(names["llm"], llm_version), LLM_DEPLOYMENT
        )
        assert router.status.remote().result(timeout_s=30)["inline_version"] is None
        before = app.stats.remote().result(timeout_s=30)["requests"]
        answers = [complete() for _ in range(3)]
        after = app.stats.remote().result(timeout_s=30)["requests"]
        assert router.llm_stats.remote(llm_version).result(timeout_s=30) is None
        serve_control.release()
    assert after == before + 3, (before, after)
    for answer in answers:
        assert answer.status_code == 200 and answer.headers[VERSION_HEADER] == llm_version

    # A route that still carries such a record (left before the fix) is put right: the
    # version keeps the route, nothing to fall back to, and the record goes.
    with cluster.connect():
        serve_control.start(cluster.serve_host, cluster.serve_port)
        dead = drive.leave_record(LLM_ROUTE, "bake")
        serve_control.release()
    healed = reconcile(
        model_name=names["llm"], gates=GATES, ray_cluster=cluster, mlflow_server=server
    )
    assert healed.action == "recovered" and healed.live == llm_version, healed
    assert healed.rollout.outcome == "rebaked" and dead in healed.rollout.reason, healed.rollout
    with cluster.connect():
        router = serve_control.current_router(LLM_ROUTE)
        serve_control.release()
    assert router.live.version == llm_version and router.rollout is None, router

    answer = complete()
    assert answer.status_code == 200 and answer.headers[VERSION_HEADER] == llm_version
    print("the fine-tuned version answers:", answer.json()["choices"][0]["text"])
    action = requests.post(
        f"{base}/{POLICY_ROUTE}", json={"observation": [0.01, 0.02, 0.03, 0.04]}, timeout=30
    )
    assert action.status_code == 200 and action.headers[VERSION_HEADER] == policy.version
    client = MlflowClient(stack.mlflow_uri)
    for kind, version in (("llm", llm_version), ("policy", policy.version)):
        assert registry.resolve_alias(client, names[kind], registry.LIVE).version == version
    assert registry.serving_tags(client, names["llm"])["kind"] == "llm"
    assert registry.serving_tags(client, names["policy"])["kind"] == "policy"
