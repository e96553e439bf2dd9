"""What a GPU changes in our own code, checked on CPU: the Ray options that place an LLM
replica, a policy replica and a router hosting an LLM, read back from the deployments Serve
builds from our app configs; a sweep trial's placement group, from the trainable Tune
schedules; a fine-tune's ScalingConfig, from the TorchTrainer we build. No GPU, cluster or
service needed.

The `gpu` tests at the end run the same paths on a real GPU; where torch sees none they are
skipped, naming the test (tests/conftest.py). No machine of this project has run them yet."""

from __future__ import annotations

import pytest

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.compat import ray_internals
from prefect_ray_lifecycle.tasks.rollout.apps import version_app
from prefect_ray_lifecycle.tasks.rollout.config import LLMServing, Serving
from prefect_ray_lifecycle.workloads.constants import llm_python

MLFLOW = MLflowServer(tracking_uri="http://127.0.0.1:1")  # never reached: nothing is deployed
APP_ENV = {"py_modules": ["gcs://_ray_pkg_workloads.zip"], "env_vars": {"A": "1"}}


def built(config: dict) -> dict[str, dict]:
    """The app config's deployments as Serve's controller builds them, by name; the config is
    first validated by Serve's own schema, and overrides no deployment's options."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate({"applications": [config]})
    for override in config.get("deployments", []):
        assert set(override) <= {"name", "user_config"}, override  # options come from the build
    return ray_internals.built_deployments(config)


def actor_options(config: dict, deployment: str) -> dict:
    return built(config)[deployment]["ray_actor_options"]


# --- Serve: where replicas are placed --------------------------------------------------------


@pytest.mark.parametrize("gpus", [0.0, 0.5, 1.0])
def test_an_llm_replica_asks_ray_for_the_gpus_its_version_is_given(gpus):
    llm = LLMServing(num_cpus=2, num_gpus=gpus, engine={"tensor_parallel_size": 1})
    config, target, _ = version_app("llm", MLFLOW, "chat", "3", Serving(), llm, {}, APP_ENV)
    options = actor_options(config, "LLMServer")
    # No num_gpus at all on CPU: Ray then places the replica on any node with the CPUs.
    assert {k: v for k, v in options.items() if k != "runtime_env"} == {
        "num_cpus": 2.0,
        **({"num_gpus": gpus} if gpus else {}),
    }
    assert options["runtime_env"]["py_executable"] == llm_python()
    # The router's target carries the same options: the router builds its engine from them.
    assert target.model["ray_actor_options"].get("num_gpus", 0) == gpus


def test_a_policy_replica_asks_ray_for_the_gpus_its_version_is_given():
    serving = Serving(num_cpus=0.5, num_gpus=0.25, resources={"worker_node": 1})
    config, _, _ = version_app("policy", MLFLOW, "cartpole", "2", serving, LLMServing(), {}, {})
    assert actor_options(config, "PolicyServer") == {
        "num_cpus": 0.5,
        "num_gpus": 0.25,
        "resources": {"worker_node": 1},
    }
    on_cpu, _, _ = version_app("policy", MLFLOW, "cartpole", "2", Serving(), LLMServing(), {}, {})
    assert "num_gpus" not in actor_options(on_cpu, "PolicyServer")


def test_a_router_hosting_an_llm_takes_an_llm_replicas_gpus_and_venv():
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig

    serving = Serving(router_replicas=2, router_num_cpus=0.25)
    hosting = LLMServing(num_cpus=2, num_gpus=1)
    env, options = hosting.router_serving(APP_ENV, serving.router_options())
    config = serve_control.router_app_config("chat", RouterConfig(), env, options)
    router = built(config)["Router"]
    assert router["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert router["num_replicas"] == 2
    assert config["runtime_env"]["py_executable"] == llm_python()  # the engine's venv
    assert config["runtime_env"]["env_vars"]["A"] == "1"  # the block's env_vars kept

    # Not hosting: the router forwards every request, on a policy router's CPUs, no GPU.
    forwarding = LLMServing(num_cpus=2, num_gpus=1, host_in_router=False)
    env, options = forwarding.router_serving(APP_ENV, serving.router_options())
    config = serve_control.router_app_config("chat", RouterConfig(), env, options)
    assert built(config)["Router"]["ray_actor_options"] == {"num_cpus": 0.25}
    assert config["runtime_env"] == {**APP_ENV, "env_vars": {"MALLOC_ARENA_MAX": "2", "A": "1"}}


# --- Tune and Train: what a trial and a fine-tune reserve -----------------------------------


@pytest.mark.parametrize("gpus", [0.0, 0.5, 1.0])
def test_a_sweep_trial_reserves_its_learners_gpus_in_its_placement_group(gpus):
    from ray.tune.registry import get_trainable_cls

    from prefect_ray_lifecycle.tasks.tune.config import SweepConfig
    from prefect_ray_lifecycle.workloads.rl import rllib

    sweep = SweepConfig(resources={"gpus": gpus, "env_runners": 2, "cpus_per_env_runner": 0.5})
    config = rllib.build_config(
        sweep.algorithm, "CartPole-v1", {}, sweep.resources.to_workload(), 0, {}
    )
    # What Tune asks the trainable for, given a trial's param_space (a plain dict).
    factory = get_trainable_cls(sweep.algorithm).default_resource_request(
        rllib.param_space(config, {})
    )
    main = {"CPU": 1.0, **({"GPU": gpus} if gpus else {})}
    assert factory.bundles == [main, {"CPU": 0.5}, {"CPU": 0.5}]  # the learner is in main
    assert rllib.resource_request(config) == {"CPU": 2.0, **({"GPU": gpus} if gpus else {})}
    reason = rllib.unschedulable_reason(rllib.resource_request(config), {"CPU": 4})
    assert (reason is None) == (gpus == 0), reason
    if gpus:
        assert f"GPU={gpus:g}" in reason and "has GPU=0" in reason


@pytest.mark.parametrize("cluster_gpus, on_gpu", [(0, False), (1, False), (2, True)])
def test_a_finetune_gives_each_worker_a_gpu_only_where_every_worker_gets_one(
    cluster_gpus, on_gpu, tmp_path
):
    from prefect_ray_lifecycle.workloads.llm.models import ModelLocation
    from prefect_ray_lifecycle.workloads.llm.train.loop import EVAL_DATASET, TRAIN_DATASET
    from prefect_ray_lifecycle.workloads.llm.train.settings import (
        FailureSettings,
        ResourceSettings,
        TrainingSettings,
        TrainSpec,
    )
    from prefect_ray_lifecycle.workloads.llm.train.trainer import build_trainer

    resources = ResourceSettings(workers=2, cpus_per_worker=1.5, gpus="auto")
    spec = TrainSpec(
        base=ModelLocation(path=str(tmp_path / "base")),
        training=TrainingSettings(),
        layout="text",
        text_columns=["text"],
        use_gpu=resources.use_gpu(cluster_gpus),  # what the run's preflight decides
    )
    datasets = {TRAIN_DATASET: None, EVAL_DATASET: None}  # never read: nothing is fitted
    trainer = build_trainer(
        spec, datasets, resources, FailureSettings(), str(tmp_path), str(tmp_path / "history")
    )
    scaling = trainer.scaling_config
    worker = {"CPU": 1.5, **({"GPU": 1.0} if on_gpu else {})}
    assert scaling.use_gpu is on_gpu and scaling.num_workers == 2
    assert scaling.total_resources == {k: 2 * v for k, v in worker.items()}
    assert scaling.as_placement_group_factory().bundles[-2:] == [worker, worker]


# --- on a real GPU (skipped, by name, where torch sees none) --------------------------------


@pytest.mark.gpu
def test_this_torch_computes_on_the_gpu():
    """The venv's torch is a CUDA build that reaches the device (`make test CONSTRAINTS=` on a
    GPU machine: constraints/cpu.txt pins the CPU build)."""
    import torch

    assert torch.ones(8, device="cuda").sum().item() == 8


@pytest.mark.gpu
def test_a_ray_task_asking_for_a_gpu_gets_one_that_torch_sees(stack):
    from prefect import flow, task

    from prefect_ray_lifecycle.ray_runner import RayClusterTaskRunner, ray_options

    @task
    @ray_options(num_gpus=1)
    def device() -> tuple[bool, str]:
        import os

        import torch

        return torch.cuda.is_available(), os.environ.get("CUDA_VISIBLE_DEVICES", "")

    @flow(task_runner=RayClusterTaskRunner(stack.ray_cluster()))
    def on_gpu() -> tuple[bool, str]:
        return device.submit().result()

    available, visible = on_gpu()
    assert available and visible, visible


@pytest.mark.gpu
@pytest.mark.slow
def test_a_sweep_trial_with_a_gpu_trains_to_the_end(stack, tmp_path):
    from prefect_ray_lifecycle.flows.tune_sweep import tune_sweep
    from prefect_ray_lifecycle.tasks.tune.config import SweepConfig

    sweep = SweepConfig(
        resources={"gpus": 1},
        hyperparameters={"train_batch_size_per_learner": 256, "minibatch_size": 64},
        scheduler={"kind": "fifo"},
        stop={"training_iterations": 2, "env_steps": None, "episode_return": None},
    )
    # Its placement group holds the GPU (checked above on CPU): it starts only on a GPU node.
    result = tune_sweep(sweep=sweep, ray_cluster=stack.ray_cluster(), storage_root=str(tmp_path))
    assert [(t.status, t.iterations) for t in result.trials] == [("TERMINATED", 2)]
