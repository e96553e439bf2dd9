"""An LLM's lifecycle to its route, on the session's services: llm-train-and-ship with a Tune
sweep of 2 trials (1 Train worker each, on 2 CPUs) registers its best trial as an LLM version
with its route, kind and serving settings kept with the model, and rolls it out itself
through vLLM on /llm-ship; then a policy's champion is moved too, and reconcile, run as the
champion-moved trigger runs it (with only the model's name), finds each model's own route:
the LLM's in sync, the policy rolled out on /policy. One sweep, and no canary (first
rollouts), to stay inside the suite's time."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.flows.llm_finetune import FineTuneParams
from prefect_ray_lifecycle.flows.llm_pipeline import llm_train_and_ship
from prefect_ray_lifecycle.flows.reconcile import reconcile
from prefect_ray_lifecycle.flows.register import RegistrationRequest, register_and_promote
from prefect_ray_lifecycle.tasks.finetune.config import LLMSweepSettings
from prefect_ray_lifecycle.tasks.register import EvaluationSummary
from prefect_ray_lifecycle.tasks.rollout.config import Gates, LLMServing, Serving
from prefect_ray_lifecycle.workloads.constants import VERSION_HEADER, llm_python
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
    """llm-train-and-ship with a sweep: trained, registered, promoted (the model's first
    version) and rolled out by the pipeline; the routes and models go at the end."""
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
            ship=True,
            gates=GATES,
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


def test_a_sweep_of_two_trials_on_two_cpus_registers_its_best_trial(stack, shipped):
    result = shipped["result"]
    sweep = result.sweep
    print("sweep:", sweep.model_dump_json(include={"trials", "max_concurrent_trials"}))
    # Both trials at once, each a 0.25-CPU actor and one 0.75-CPU worker: 2 CPUs together.
    assert sweep.max_concurrent_trials == 2
    assert len(sweep.trials) == 2 and all(t.status == "TERMINATED" for t in sweep.trials)
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
    # The pipeline rolled its version out itself (the route served nothing yet).
    assert result.shipped and result.served_version == result.version, result.reason
    assert result.rollout.outcome == "first_rollout" and result.rollout.route == LLM_ROUTE
    assert result.route_url.endswith(f"/{LLM_ROUTE}")
    # The ended rollout holds nothing: no record of it stays on the route's router (a first
    # LLM rollout the router does not host left a bake record once, and the next reconcile
    # took it for a rollout that died mid-bake).
    with shipped["cluster"].connect():
        router = serve_control.current_router(LLM_ROUTE)
        serve_control.release()
    assert router.live.version == result.version and router.rollout is None, router
    # The fine-tune moved the held-out figures (both measured the same way).
    before, after = result.base_evaluation, result.evaluation
    assert after.perplexity < before.perplexity and after.exact_match >= before.exact_match


def test_a_policy_and_an_llm_champion_each_reach_their_own_route(stack, shipped, checkpoints):
    names, cluster, server = shipped["names"], shipped["cluster"], shipped["server"]
    llm_version = shipped["result"].version
    # The LLM's champion moved when it was registered and went out with the pipeline; now a
    # policy's moves too.
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
    # Each found its model's own route from the model's tags: the LLM's already serves its
    # champion; the policy's served nothing and gets its first rollout.
    assert runs["llm"].action == "in_sync" and runs["llm"].live == llm_version, runs["llm"]
    assert runs["llm"].rollout is None
    policy_run = runs["policy"]
    assert policy_run.action == "restored" and policy_run.live == policy.version, policy_run
    assert policy_run.rollout.outcome == "first_rollout"
    assert policy_run.rollout.route == POLICY_ROUTE

    base = f"http://127.0.0.1:{stack.serve_port}"
    answer = requests.post(
        f"{base}/{LLM_ROUTE}/v1/completions",
        json={
            "model": names["llm"],
            "prompt": "flow task model version canary: count on from 41",
            "max_tokens": 3,
            "temperature": 0,
        },
        timeout=60,
    )
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
