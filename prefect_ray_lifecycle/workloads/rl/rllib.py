"""RLlib pieces of a Tune sweep: environments, the algorithm config and its search space from
plain data, one trial's resource request, and the RLModule-only evaluation of a checkpoint.

Imports nothing from Prefect: the env creators run in Ray workers, and the evaluation is the
one registration and promotion reuse.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect_ray_lifecycle.compat import ray_internals
from prefect_ray_lifecycle.workloads.torch_threads import torch_threads

SEARCH_SPACE_KINDS = ("uniform", "loguniform", "choice", "randint", "grid")
# Where RLlib's new API stack reports a trial's mean episode return and its env steps.
RETURN_METRIC = "env_runners/episode_return_mean"
ENV_STEPS_METRIC = "num_env_steps_sampled_lifetime"
# Held-out evaluation seeds start far from the training seeds (seed + env runner index), so
# no evaluation episode repeats a training one. Registration's protocol depends on it.
EVAL_SEED_OFFSET = 1_000_000


# --- environments ---------------------------------------------------------------------------


def _creator_spec(environment: str) -> tuple[str, str] | None:
    """(module, function) when `environment` names a `module:function` env creator; None for
    a Gymnasium id (including Gymnasium's own "module:EnvId-v0" form)."""
    module_name, sep, attr = environment.rpartition(":")
    if (
        not sep
        or not attr.isidentifier()
        or not all(part.isidentifier() for part in module_name.split("."))
    ):
        return None
    return module_name, attr


def is_creator(environment: str) -> bool:
    """Whether `environment` names a `module:function` env creator (else a Gymnasium id)."""
    return _creator_spec(environment) is not None


def load_creator(environment: str) -> Callable[[Mapping[str, Any]], Any]:
    """Import the `module:function` env creator in this process. Raises ValueError naming the
    module (not importable here) or the function (missing or not callable)."""
    spec = _creator_spec(environment)
    if spec is None:
        raise ValueError(f"environment {environment!r} is not a 'module:function' env creator")
    module_name, attr = spec
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"environment {environment!r}: module {module_name!r} is not importable "
            f"({type(error).__name__}: {error})"
        ) from None
    creator = getattr(module, attr, None)
    if not callable(creator):
        raise ValueError(f"environment {environment!r}: {module_name} has no callable {attr!r}")
    return creator


def creator_problem(environment: str) -> str | None:
    """Why this process cannot load the env creator `environment` names, or None when it can
    (or when `environment` is a Gymnasium id). Run in a Ray worker, it checks the cluster."""
    if not is_creator(environment):
        return None
    try:
        load_creator(environment)
    except ValueError as error:
        return str(error)
    return None


class EnvCreator:
    """A `module:function` env creator imported where an env is built (a trial, on any node),
    never in the driver: the module only has to reach the cluster, e.g. through runtime_env."""

    def __init__(self, environment: str):
        self.environment = environment

    def __call__(self, env_config: Mapping[str, Any]):
        return load_creator(self.environment)(env_config)


def make_env(environment: str, env_config: Mapping[str, Any] | None = None):
    """Build one env the way RLlib does: `module:function` creators get env_config, Gymnasium
    ids get it as keyword arguments."""
    import gymnasium as gym

    if is_creator(environment):
        return load_creator(environment)(dict(env_config or {}))
    return gym.make(environment, **dict(env_config or {}))


def register_environment(environment: str) -> str:
    """Make `environment` known to RLlib on every worker of the connected cluster; return the
    name to give `AlgorithmConfig.environment`. Raises ValueError for an unknown Gymnasium id;
    a `module:function` creator is only imported where envs are built (see creator_problem)."""
    import gymnasium as gym
    from ray.tune import register_env

    if is_creator(environment):
        # Ray 2.60 caches the first job id as the registry's key prefix for the life of the
        # process; after a second ray.init (a new job) it would register where that job's
        # workers never look ("Environment ... doesn't exist").
        ray_internals.reset_tune_registry_prefix()
        register_env(environment, EnvCreator(environment))
        return environment
    try:
        gym.spec(environment)
    except Exception as error:  # gymnasium raises several error types for unknown ids
        raise ValueError(
            f"environment {environment!r} is neither a registered Gymnasium id "
            f"nor a 'module:function' env creator ({error})"
        ) from None
    return environment


# --- a fault-injecting env for drills and tests ------------------------------------------------


def flaky_cartpole(env_config: Mapping[str, Any]):
    """CartPole whose first `failures` creations raise: proves trial retries (max_failures).
    Creations are counted as marker files in `marker_dir`, so the count survives a trial
    restart in a fresh actor."""
    import gymnasium as gym

    marker_dir = Path(env_config["marker_dir"])
    marker_dir.mkdir(parents=True, exist_ok=True)
    done = len(list(marker_dir.glob("failure-*")))
    if done < int(env_config.get("failures", 1)):
        (marker_dir / f"failure-{done + 1}").touch()
        raise RuntimeError(f"injected env failure {done + 1} of {env_config.get('failures', 1)}")
    return gym.make("CartPole-v1")


# --- algorithm config and search space -------------------------------------------------------


def algorithm_class(algorithm: str):
    """The RLlib Algorithm class for a registered name such as 'PPO'."""
    from ray.rllib.algorithms.registry import ALGORITHMS

    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"algorithm {algorithm!r} is not an RLlib algorithm; "
            f"known: {', '.join(sorted(ALGORITHMS))}"
        )
    return ALGORITHMS[algorithm]()[0]


@dataclass(frozen=True)
class TrialResources:
    """What one trial asks for."""

    env_runners: int = 0
    cpus_per_env_runner: float = 1
    cpus: float = 1  # the trial's main process (Algorithm and its local learner)
    gpus: float = 0  # for the learner
    # Custom Ray resources of the main process and of each env runner, e.g. {"worker_node": 1}
    custom: Mapping[str, float] = field(default_factory=dict)


def config_fields(config) -> set[str]:
    """Names a config dict may set: `to_dict()` keys, with private fields that have a public
    property (e.g. `_train_batch_size_per_learner`) under their public name."""
    fields = set(config.to_dict())
    return fields | {k[1:] for k in fields if k.startswith("_") and hasattr(config, k[1:])}


def param_space(config, search_space: Mapping[str, Any]) -> dict[str, Any]:
    """Tune's param_space: the config as a dict, with the searched fields replaced."""
    space = {k: v for k, v in config.to_dict().items() if k.lstrip("_") not in search_space}
    return {**space, **search_space}


def build_config(
    algorithm: str,
    env_name: str,
    env_config: Mapping[str, Any],
    resources: TrialResources,
    seed: int,
    fixed: Mapping[str, Any],
):
    """The algorithm's config with its env, resources, seed and fixed hyperparameters.

    Every env runner's envs, and torch, are seeded from `seed` (RLlib adds the env runner's
    index), so a trial with the same config replays the same episodes."""
    config = algorithm_class(algorithm).get_default_config()
    unknown = sorted(set(fixed) - config_fields(config))
    if unknown:
        raise ValueError(f"fixed hyperparameter {unknown[0]!r} is not a {algorithm} config field")
    config = (
        config.environment(env_name, env_config=dict(env_config))
        .env_runners(
            num_env_runners=resources.env_runners,
            num_cpus_per_env_runner=resources.cpus_per_env_runner,
            custom_resources_per_env_runner=dict(resources.custom),
        )
        .learners(num_learners=0, num_gpus_per_learner=resources.gpus)
        .resources(
            num_cpus_for_main_process=resources.cpus,
            custom_resources_for_main_process=dict(resources.custom),
        )
        .debugging(seed=seed)
    )
    config.update_from_dict(dict(fixed))
    return config


def _numbers(key: str, kind: str, args: Any, integers: bool = False) -> tuple[float, float]:
    kinds = (int,) if integers else (int, float)
    if (
        not isinstance(args, list | tuple)
        or len(args) != 2
        or not all(isinstance(a, kinds) and not isinstance(a, bool) for a in args)
    ):
        what = "integers" if integers else "numbers"
        raise ValueError(f"search space key {key!r}: {kind} takes [low, high] {what}, got {args!r}")
    low, high = args
    if not low < high:
        raise ValueError(f"search space key {key!r}: {kind} needs low < high, got {args!r}")
    return low, high


def parse_search_space(spec: Mapping[str, Any], allowed: set[str] | None = None) -> dict[str, Any]:
    """Turn `{"lr": {"loguniform": [1e-4, 1e-3]}, ...}` into Tune search-space objects.

    Raises ValueError naming the key for an unknown kind, malformed bounds, or (when
    `allowed` is given) a key that is not a config field."""
    from ray import tune

    if not isinstance(spec, Mapping):
        raise ValueError(f"search space must map config keys to {{kind: args}}, got {spec!r}")
    space: dict[str, Any] = {}
    for key, entry in spec.items():
        if allowed is not None and key not in allowed:
            raise ValueError(f"search space key {key!r} is not a config field of the algorithm")
        if not isinstance(entry, Mapping) or len(entry) != 1:
            raise ValueError(
                f"search space key {key!r}: expected one of "
                f"{{kind: args}} with kind in {SEARCH_SPACE_KINDS}, got {entry!r}"
            )
        ((kind, args),) = entry.items()
        if kind in ("uniform", "loguniform"):
            low, high = _numbers(key, kind, args)
            if kind == "loguniform" and low <= 0:
                raise ValueError(
                    f"search space key {key!r}: loguniform needs low > 0, got {args!r}"
                )
            space[key] = (tune.uniform if kind == "uniform" else tune.loguniform)(low, high)
        elif kind == "randint":
            low, high = _numbers(key, kind, args, integers=True)
            space[key] = tune.randint(int(low), int(high))  # high is exclusive, as in Tune
        elif kind in ("choice", "grid"):
            if not isinstance(args, list | tuple) or not args:
                raise ValueError(
                    f"search space key {key!r}: {kind} takes a non-empty list, got {args!r}"
                )
            space[key] = (tune.choice if kind == "choice" else tune.grid_search)(list(args))
        else:
            raise ValueError(
                f"search space key {key!r}: unknown kind {kind!r}; use one of {SEARCH_SPACE_KINDS}"
            )
    return space


def resource_request(config) -> dict[str, float]:
    """The resources one trial of `config` reserves (its placement group, summed)."""
    request = config.algo_class.default_resource_request(config).required_resources
    return {name: amount for name, amount in request.items() if amount}


def unschedulable_reason(
    request: Mapping[str, float], available: Mapping[str, float]
) -> str | None:
    """Why a trial asking `request` can never start on a cluster with `available` in total,
    or None when it fits. A pure verdict: Tune would leave such a trial PENDING for ever."""
    missing = {
        name: amount for name, amount in request.items() if available.get(name, 0) + 1e-9 < amount
    }
    if not missing:
        return None
    asked = ", ".join(f"{name}={amount:g}" for name, amount in sorted(request.items()))
    has = ", ".join(f"{name}={available.get(name, 0):g}" for name in sorted(missing))
    return (
        f"one trial asks for {asked}, but the whole Ray cluster has {has}: "
        f"its trials would stay PENDING for ever"
    )


# --- evaluation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation:
    """Greedy episodes of a policy on held-out seeds."""

    episodes: int
    mean_return: float
    std_return: float
    returns: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)


def module_path(checkpoint: str | Path, module_id: str = "default_policy") -> Path:
    """Where an Algorithm checkpoint keeps one RLModule's own checkpoint."""
    from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_LEARNER_GROUP, COMPONENT_RL_MODULE

    path = (
        Path(checkpoint)
        / COMPONENT_LEARNER_GROUP
        / COMPONENT_LEARNER
        / COMPONENT_RL_MODULE
        / module_id
    )
    if not path.is_dir():
        raise FileNotFoundError(f"{checkpoint} holds no RLModule {module_id!r} (looked in {path})")
    return path


def load_policy(checkpoint: str | Path, module_id: str = "default_policy"):
    """The trained RLModule alone: no Algorithm, no env runners, no Ray needed."""
    from ray.rllib.core.rl_module.rl_module import RLModule

    return RLModule.from_checkpoint(module_path(checkpoint, module_id))


def greedy_action(module, obs) -> Any:
    """The policy's most likely action for one observation."""
    import numpy as np
    import torch
    from ray.rllib.core.columns import Columns

    batch = {Columns.OBS: torch.as_tensor(np.asarray(obs)[None], dtype=torch.float32)}
    with torch.no_grad():
        out = module.forward_inference(batch)
    dist = module.get_inference_action_dist_cls().from_logits(out[Columns.ACTION_DIST_INPUTS])
    return dist.to_deterministic().sample()[0].numpy()


def evaluate_checkpoint(
    checkpoint: str | Path,
    environment: str,
    env_config: Mapping[str, Any] | None = None,
    episodes: int = 10,
    seed: int = 0,
    max_steps: int = 10_000,
) -> Evaluation:
    """Load only the RLModule from `checkpoint` and run greedy episodes on held-out seeds."""
    if episodes < 1:
        raise ValueError(f"episodes must be at least 1, got {episodes}")
    module = load_policy(checkpoint)
    env = make_env(environment, env_config)
    seeds = [seed + EVAL_SEED_OFFSET + i for i in range(episodes)]
    returns = []
    try:
        with torch_threads(1):
            for episode_seed in seeds:
                obs, _ = env.reset(seed=episode_seed)
                total, steps, done = 0.0, 0, False
                while not done and steps < max_steps:
                    obs, reward, terminated, truncated, _ = env.step(greedy_action(module, obs))
                    total += float(reward)
                    steps += 1
                    done = terminated or truncated
                returns.append(total)
    finally:
        env.close()
    mean = sum(returns) / len(returns)
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / len(returns))
    return Evaluation(
        episodes=episodes, mean_return=mean, std_return=std, returns=returns, seeds=seeds
    )
