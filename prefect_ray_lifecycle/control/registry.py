"""A small MLflow registry API: idempotent registration of a trial's checkpoint, aliases that
keep their history, and verdict tags. Used by registration, promotion, rollout and reconcile.

MLflow facts this works around: `register_model` always makes a new version (mlflow#19036),
so versions carry a trial key and are looked up by it; MLflow keeps no alias history
(mlflow#2169), so each move is appended to a registered-model tag; search results may omit
aliases (mlflow#16734), so aliases are always read with get_model_version_by_alias.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

TAG = "lifecycle"  # prefix of every tag this project writes
TRIAL_KEY_TAG = f"{TAG}.trial_key"
HISTORY_LIMIT = 50  # alias moves kept per alias (a tag value holds at most 5,000 characters)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}$")

_NONE: Mapping[str, Any] = MappingProxyType({})
MODEL_ARTIFACT_PATH = "policy"  # the pyfunc model inside its registration run
LLM_ARTIFACT_PATH = "hf"  # an LLM version's Hugging Face folder inside its run
POLICY_MODEL_DESCRIPTION = "RLlib policies registered by prefect-ray-lifecycle from Tune sweeps."
LLM_MODEL_DESCRIPTION = (
    "Causal LMs fine-tuned with Ray Train by prefect-ray-lifecycle (Hugging Face folders)."
)
CHAMPION, CHALLENGER, LIVE = "champion", "challenger", "live"


class RegistrationError(ValueError):
    """Bad input to registration: nothing was registered."""


def validate_model_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise RegistrationError(
            f"model name {name!r} is not a valid registered model name: use letters, digits, "
            f"'_', '.', '-' (starting with a letter or digit, at most 255 characters)"
        )
    return name


def trial_key(experiment_path: str, trial_id: str, checkpoint: str) -> str:
    """Identity of one trial's checkpoint: the same trial registered twice gets one version."""
    raw = f"{experiment_path.rstrip('/')}|{trial_id}|{Path(checkpoint).name}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _is_missing(error: MlflowException) -> bool:
    return error.error_code == "RESOURCE_DOES_NOT_EXIST"


def find_version(client: MlflowClient, name: str, key: str) -> ModelVersion | None:
    try:
        found = client.search_model_versions(
            f"name = '{name}' and tags.`{TRIAL_KEY_TAG}` = '{key}'"
        )
    except MlflowException as error:
        if _is_missing(error):
            return None
        raise
    return min(found, key=lambda v: int(v.version)) if found else None


def ensure_model(client: MlflowClient, name: str, create: bool, description: str = "") -> None:
    try:
        client.get_registered_model(name)
    except MlflowException as error:
        if not _is_missing(error):
            raise
        if not create:
            raise RegistrationError(
                f"registered model {name!r} does not exist (create_model is off)"
            ) from error
        try:
            client.create_registered_model(
                name, description=description or POLICY_MODEL_DESCRIPTION
            )
        except MlflowException as race:
            if race.error_code != "RESOURCE_ALREADY_EXISTS":
                raise


def resolve_alias(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    """The version an alias points at, or None when the alias is not set."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as error:
        if _is_missing(error) or error.error_code == "INVALID_PARAMETER_VALUE":
            return None
        raise


def alias_history(client: MlflowClient, name: str, alias: str) -> list[dict[str, Any]]:
    tags = client.get_registered_model(name).tags
    return json.loads(tags.get(f"{TAG}.alias_history.{alias}", "[]"))


def move_alias(
    client: MlflowClient, name: str, alias: str, version: str, *, reason: str, actor: str = ""
) -> str | None:
    """Point `alias` at `version`, record the move in the alias's history and the previous
    holder on the version; returns the previous version (None if the alias was unset)."""
    previous = resolve_alias(client, name, alias)
    previous_version = previous.version if previous else None
    client.set_registered_model_alias(name, alias, version)
    history = alias_history(client, name, alias)
    history.append(
        {
            "version": str(version),
            "previous": previous_version,
            "reason": reason,
            "by": actor,
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
    )
    client.set_registered_model_tag(
        name, f"{TAG}.alias_history.{alias}", json.dumps(history[-HISTORY_LIMIT:])
    )
    client.set_model_version_tag(
        name, version, f"{TAG}.previous_{alias}", previous_version or "none"
    )
    return previous_version


def remove_alias(client: MlflowClient, name: str, alias: str) -> None:
    try:
        client.delete_registered_model_alias(name, alias)
    except MlflowException as error:
        if not _is_missing(error):
            raise


def tag_verdict(
    client: MlflowClient, name: str, version: str, stage: str, verdict: Mapping[str, Any]
) -> None:
    """Record a gate's verdict on a version: `lifecycle.<stage>.<key>` tags. A verdict (a
    `verdict` key) replaces the previous one whole (no stale `stage` or `reason` of an older
    verdict stays behind) and gets `lifecycle.<stage>.at`, when it was given (UTC, ISO 8601):
    MLflow does not move a version's last_updated_timestamp for a tag."""
    stamped = dict(verdict)
    prefix = f"{TAG}.{stage}."
    if "verdict" in stamped:
        if not stamped.get("at"):
            stamped["at"] = datetime.now(UTC).isoformat(timespec="milliseconds")
        for key in client.get_model_version(name, version).tags:
            if key.startswith(prefix) and key.removeprefix(prefix) not in stamped:
                client.delete_model_version_tag(name, version, key)
    for key, value in stamped.items():
        text = value if isinstance(value, str) else json.dumps(value)
        client.set_model_version_tag(name, version, f"{TAG}.{stage}.{key}", text[:5000])


# Where a model is served, kept with the registered model: a `champion` move (which carries
# only the model's name) reaches reconcile, which reads its route and kind from here.
ROUTE_TAG = f"{TAG}.serving.route"
KIND_TAG = f"{TAG}.serving.kind"
SETTINGS_TAG = f"{TAG}.serving.settings"  # JSON: the rollout's serving/llm settings


def serving_tags(client: MlflowClient, name: str) -> dict[str, Any]:
    """{"route", "kind", "settings"} a model was registered or last rolled out with (each
    None when unknown, e.g. a model registered before these tags or outside the project)."""
    try:
        tags = client.get_registered_model(name).tags or {}
    except MlflowException as error:
        if _is_missing(error):
            return {"route": None, "kind": None, "settings": None}
        raise
    settings = tags.get(SETTINGS_TAG)
    return {
        "route": tags.get(ROUTE_TAG),
        "kind": tags.get(KIND_TAG),
        "settings": json.loads(settings) if settings else None,
    }


def set_serving_tags(
    client: MlflowClient,
    name: str,
    route: str,
    kind: str,
    settings: dict[str, Any] | None = None,
) -> None:
    """Record where `name` is served: its route, kind and (optionally) serving settings."""
    client.set_registered_model_tag(name, ROUTE_TAG, route)
    client.set_registered_model_tag(name, KIND_TAG, kind)
    if settings is not None:
        client.set_registered_model_tag(name, SETTINGS_TAG, json.dumps(settings, sort_keys=True))


def check_checkpoint(checkpoint: str) -> None:
    """Fail with a clear message unless the checkpoint's RLModule loads."""
    from prefect_ray_lifecycle.workloads.rl.rllib import load_policy

    if not Path(checkpoint).is_dir():
        raise RegistrationError(f"checkpoint {checkpoint!r} does not exist")
    try:
        load_policy(checkpoint)
    except Exception as error:  # corrupt or foreign: say so before anything is written
        raise RegistrationError(
            f"checkpoint {checkpoint!r} does not load as an RLModule: "
            f"{type(error).__name__}: {error}"
        ) from error


@dataclass(frozen=True)
class Registration:
    name: str
    version: str
    run_id: str
    model_uri: str
    created: bool  # False when the trial was already registered


def register_checkpoint(
    client: MlflowClient,
    *,
    name: str,
    checkpoint: str,
    experiment_name: str,
    trial_key_value: str,
    observation_size: int,
    params: Mapping[str, Any] = _NONE,
    metrics: Mapping[str, float] = _NONE,
    tags: Mapping[str, str] = _NONE,
    description: str = "",
    artifacts: Mapping[str, Any] = _NONE,
    create_model: bool = True,
) -> Registration:
    """Log the checkpoint's RLModule as a pyfunc model in an MLflow run and register it as a
    version of `name`, once per trial key. Safe to call again after any failure."""
    validate_model_name(name)
    check_checkpoint(checkpoint)

    def log_policy(run_id: str) -> str:
        import mlflow
        import numpy as np
        from mlflow.models import infer_signature

        from prefect_ray_lifecycle.control.shipping import RAY_SIDE, package_part
        from prefect_ray_lifecycle.workloads.rl.policy_model import (
            ARTIFACT_KEY,
            RLModulePolicy,
            copy_module_only,
        )

        example = np.zeros((2, observation_size), dtype=np.float32)
        with tempfile.TemporaryDirectory() as folder:
            module_only = copy_module_only(checkpoint, Path(folder) / "policy_checkpoint")
            policy = RLModulePolicy()
            actions = policy.predict(_Context({ARTIFACT_KEY: str(module_only)}), example)
            # Saved locally, then logged through this client: no process-global MLflow URI
            # or active run is touched, so sessions against different servers can't mix.
            mlflow.pyfunc.save_model(
                path=Path(folder) / MODEL_ARTIFACT_PATH,
                python_model=policy,
                artifacts={ARTIFACT_KEY: str(module_only)},
                # The Ray side of the package travels with the model: a process without
                # this project loads it from the model's own copy.
                code_paths=[str(package_part(RAY_SIDE))],
                signature=infer_signature(example, actions),
                input_example=example,
                pip_requirements=_requirements(),
            )
            client.log_artifacts(
                run_id, str(Path(folder) / MODEL_ARTIFACT_PATH), MODEL_ARTIFACT_PATH
            )
        return f"runs:/{run_id}/{MODEL_ARTIFACT_PATH}"

    return _register_version(
        client,
        name=name,
        experiment_name=experiment_name,
        trial_key_value=trial_key_value,
        log_model=log_policy,
        params=params,
        metrics=metrics,
        tags=tags,
        description=description,
        artifacts=artifacts,
        create_model=create_model,
        model_description=POLICY_MODEL_DESCRIPTION,
    )


def check_llm_folder(folder: str) -> None:
    """Fail with a clear message unless `folder` is a Hugging Face causal LM with a tokenizer
    (what the LLM app serves)."""
    from prefect_ray_lifecycle.workloads.llm.models import causal_lm_problem

    if not Path(folder).is_dir():
        raise RegistrationError(f"checkpoint {folder!r} does not exist")
    if problem := causal_lm_problem(Path(folder)):
        raise RegistrationError(f"checkpoint: {problem}")


def register_llm_folder(
    client: MlflowClient,
    *,
    name: str,
    checkpoint: str,
    experiment_name: str,
    trial_key_value: str,
    params: Mapping[str, Any] = _NONE,
    metrics: Mapping[str, float] = _NONE,
    tags: Mapping[str, str] = _NONE,
    description: str = "",
    artifacts: Mapping[str, Any] = _NONE,
    create_model: bool = True,
) -> Registration:
    """Log a fine-tune checkpoint's Hugging Face folder (its top level: config, weights,
    tokenizer; not its `trainer_state/`) as the artifacts `hf/` of an MLflow run and register
    it as a version of `name`, once per trial key: the folder the LLM app downloads and vLLM
    loads as it is. Safe to call again after any failure."""
    validate_model_name(name)
    check_llm_folder(checkpoint)

    def log_folder(run_id: str) -> str:
        source = Path(checkpoint)
        with tempfile.TemporaryDirectory() as scratch:
            staged = Path(scratch) / LLM_ARTIFACT_PATH
            staged.mkdir()
            for entry in source.iterdir():  # the served files only: no optimizer state
                if entry.is_file():
                    (staged / entry.name).symlink_to(entry.resolve())
            client.log_artifacts(run_id, str(staged), LLM_ARTIFACT_PATH)
        return f"{client.get_run(run_id).info.artifact_uri}/{LLM_ARTIFACT_PATH}"

    return _register_version(
        client,
        name=name,
        experiment_name=experiment_name,
        trial_key_value=trial_key_value,
        log_model=log_folder,
        params=params,
        metrics=metrics,
        tags=tags,
        description=description,
        artifacts=artifacts,
        create_model=create_model,
        model_description=LLM_MODEL_DESCRIPTION,
    )


def _register_version(
    client: MlflowClient,
    *,
    name: str,
    experiment_name: str,
    trial_key_value: str,
    log_model: Callable[[str], str],
    params: Mapping[str, Any],
    metrics: Mapping[str, float],
    tags: Mapping[str, str],
    description: str,
    artifacts: Mapping[str, Any],
    create_model: bool,
    model_description: str,
) -> Registration:
    """One run per trial key holding the model (`log_model(run_id)` -> its source URI) and
    one version of `name` per trial key: a second call, or one after a failure at any point,
    finds what the first left and finishes it."""
    ensure_model(client, name, create_model, model_description)
    if existing := find_version(client, name, trial_key_value):
        return Registration(name, existing.version, existing.run_id, existing.source, False)

    experiment = client.get_experiment_by_name(experiment_name)
    experiment_id = (
        experiment.experiment_id if experiment else client.create_experiment(experiment_name)
    )
    runs = client.search_runs(
        [experiment_id], f"tags.`{TRIAL_KEY_TAG}` = '{trial_key_value}'", max_results=1
    )
    run = (
        runs[0]
        if runs
        else client.create_run(
            experiment_id,
            run_name=f"{name}-{trial_key_value[:8]}",
            tags={**tags, TRIAL_KEY_TAG: trial_key_value},
        )
    )
    run_id = run.info.run_id
    model_uri = run.data.tags.get(f"{TAG}.model_uri") if runs else None

    if model_uri is None:
        for key, value in params.items():  # a value that is not text is logged as JSON
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            client.log_param(run_id, key, text[:6000])
        for key, value in metrics.items():
            client.log_metric(run_id, key, float(value))
        for file_name, content in artifacts.items():
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / file_name
                path.write_text(
                    content
                    if isinstance(content, str)
                    else json.dumps(content, indent=1, default=str)
                )
                client.log_artifact(run_id, str(path))
        model_uri = log_model(run_id)
        client.set_tag(run_id, f"{TAG}.model_uri", model_uri)
        client.set_terminated(run_id)

    version = client.create_model_version(
        name,
        source=model_uri,
        run_id=run_id,
        description=description,
        tags={**tags, TRIAL_KEY_TAG: trial_key_value},
    )
    _wait_ready(client, name, version.version)
    return Registration(name, version.version, run_id, model_uri, True)


class _Context:
    def __init__(self, artifacts: dict[str, str]):
        self.artifacts = artifacts


def _requirements() -> list[str]:
    from importlib.metadata import version

    return [
        f"mlflow=={version('mlflow')}",
        f"ray[rllib]=={version('ray')}",
        f"torch=={version('torch')}",
        f"gymnasium=={version('gymnasium')}",
        "numpy",
    ]


def _wait_ready(client: MlflowClient, name: str, version: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get_model_version(name, version).status
        if status == "READY":
            return
        if status == "FAILED_REGISTRATION":
            raise RuntimeError(f"MLflow failed to register {name} v{version}")
        time.sleep(0.5)
    raise TimeoutError(f"{name} v{version} not READY after {timeout}s")
