"""The MLflow pyfunc form of a trained RLlib policy: the RLModule alone, observations in,
greedy actions out. Serve replicas and `mlflow.pyfunc.load_model` both load it; no Algorithm,
no env runners and no Ray cluster are needed to act."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow.pyfunc

from prefect_ray_lifecycle.workloads.rl.rllib import load_policy, module_path

# Artifact key under which the model keeps its RLModule, laid out like an Algorithm checkpoint
# (learner_group/learner/rl_module/<module>) so the sweep's evaluation reads it unchanged.
ARTIFACT_KEY = "policy_checkpoint"


def copy_module_only(
    checkpoint: str | Path, target: str | Path, module_id: str = "default_policy"
) -> Path:
    """Copy just the RLModule of an Algorithm checkpoint (no optimizer or env-runner state)
    into `target`, keeping the checkpoint's layout; returns `target`."""
    source = module_path(checkpoint, module_id)
    relative = source.relative_to(Path(checkpoint))
    destination = Path(target) / relative
    shutil.copytree(source, destination)
    return Path(target)


class RLModulePolicy(mlflow.pyfunc.PythonModel):
    """Greedy actions for a batch of observations, from the RLModule only."""

    def __init__(self, module_id: str = "default_policy"):
        self.module_id = module_id
        self._module = None

    def load_context(self, context) -> None:
        self._module = load_policy(context.artifacts[ARTIFACT_KEY], self.module_id)

    def predict(self, context, model_input, params=None):
        import numpy as np
        import torch
        from ray.rllib.core.columns import Columns

        if self._module is None:
            self.load_context(context)
        observations = np.asarray(model_input, dtype=np.float32)
        if observations.ndim == 1:
            observations = observations[None]
        with torch.no_grad():
            out = self._module.forward_inference({Columns.OBS: torch.from_numpy(observations)})
        dist_cls = self._module.get_inference_action_dist_cls()
        dist = dist_cls.from_logits(out[Columns.ACTION_DIST_INPUTS])
        return np.asarray(dist.to_deterministic().sample().numpy())
