"""Hugging Face model folders where they are needed: a folder every node reads, a pyarrow
filesystem URI of one, or an MLflow model version (its artifacts are such a folder), fetched
once per node into a local cache; and the checks a fine-tune base must pass before any Ray
work (a causal LM with a tokenizer, with a context as long as the sequences asked for)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from prefect_ray_lifecycle.workloads.llm.config import MLflowModelSource

__all__ = [
    "DEFAULT_MODEL_CACHE",
    "MODEL_CACHE_ENV",
    "ModelLocation",
    "causal_lm_problem",
    "context_problem",
    "download_from_mlflow",
    "local_model",
    "model_cache_dir",
]

MODEL_CACHE_ENV = "RLT_LLM_MODEL_CACHE"
DEFAULT_MODEL_CACHE = "/tmp/rlt-llm-models"
COMPLETE_MARKER = ".complete"
# config.json keys that hold a model's longest sequence, by model family.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def model_cache_dir() -> Path:
    """Where a node keeps model folders fetched from MLflow or a URI: $RLT_LLM_MODEL_CACHE or
    /tmp."""
    return Path(os.environ.get(MODEL_CACHE_ENV, DEFAULT_MODEL_CACHE))


def _fetch_once(target: Path, fetch: Callable[[Path], None]) -> Path:
    """`fetch(partial)` into a fresh folder renamed to `target`, unless a complete copy is
    there already; concurrent fetches on one node leave one copy."""
    if not (target / COMPLETE_MARKER).exists():
        partial = target.with_name(f"{target.name}.{uuid.uuid4().hex[:8]}.partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        fetch(partial)
        (partial / COMPLETE_MARKER).touch()
        try:
            partial.rename(target)
        except OSError:  # another process on this node got there first
            shutil.rmtree(partial, ignore_errors=True)
    return target


def _hf_folder(root: Path, what: str) -> Path:
    configs = sorted(root.rglob("config.json"), key=lambda p: len(p.parts))
    if not configs:
        raise FileNotFoundError(f"{what} holds no Hugging Face config.json")
    return configs[0].parent


def download_from_mlflow(source: MLflowModelSource) -> Path:
    """Fetch the model version's artifacts once per node; return the folder with config.json."""
    # Lazy: mlflow is heavy and needed only where an MLflow version is used.
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    client = MlflowClient(tracking_uri=source.tracking_uri)
    if source.version.isdigit():
        version = client.get_model_version(source.model_name, source.version)
    else:
        version = client.get_model_version_by_alias(source.model_name, source.version)
    folder = re.sub(r"[^A-Za-z0-9._-]", "_", source.model_name)
    # Keyed by where the version's files are, not by its number alone: a name deleted and
    # registered again starts at version 1 anew, and another MLflow server has its own
    # version 1 of the same name; either served the first copy this node had fetched.
    where = hashlib.sha1(f"{source.tracking_uri}\n{version.source}".encode()).hexdigest()[:12]
    target = _fetch_once(
        model_cache_dir() / folder / f"{version.version}-{where}",
        lambda partial: download_artifacts(
            artifact_uri=version.source, dst_path=str(partial), tracking_uri=source.tracking_uri
        ),
    )
    return _hf_folder(
        target, f"MLflow model {source.model_name} version {version.version} ({version.source})"
    )


def _download_uri(uri: str) -> Path:
    import pyarrow.fs

    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)

    def fetch(partial: Path) -> None:
        partial.mkdir(parents=True)
        pyarrow.fs.copy_files(
            path,
            str(partial),
            source_filesystem=filesystem,
            destination_filesystem=pyarrow.fs.LocalFileSystem(),
        )

    key = hashlib.sha1(uri.rstrip("/").encode()).hexdigest()[:16]
    return _hf_folder(_fetch_once(model_cache_dir() / "uri" / key, fetch), f"model URI {uri}")


class ModelLocation(BaseModel):
    """A Hugging Face model folder: a path every node reads, a pyarrow filesystem URI of one,
    or an MLflow model version whose artifacts are one (as LLM versions are registered)."""

    path: str | None = Field(
        default=None,
        description="A folder every Ray node reads (a shared volume), or a pyarrow filesystem "
        "URI of one (s3://bucket/model, file:///...); fetched once per node.",
    )
    mlflow: MLflowModelSource | None = Field(
        default=None, description="Or an MLflow model version (number or alias) to fetch."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelLocation:
        if (self.path is None) == (self.mlflow is None):
            raise ValueError(
                "give exactly one model source: 'path' (a folder or URI) or "
                "'mlflow' ({tracking_uri, model_name, version})"
            )
        return self

    @property
    def label(self) -> str:
        if self.mlflow is not None:
            return f"MLflow model {self.mlflow.model_name} version {self.mlflow.version}"
        return str(self.path)


def local_model(location: ModelLocation) -> Path:
    """The model's folder on this node (fetched once per node when it is not a path here)."""
    if location.mlflow is not None:
        return download_from_mlflow(location.mlflow)
    if "://" in location.path:
        return _download_uri(location.path)
    return Path(location.path).expanduser()


def _config(folder: Path) -> dict | str:
    """The folder's config.json, or why it has none."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return f"{folder} has no config.json (not a Hugging Face model folder)"
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        return f"{config_file} is not JSON ({error})"


def causal_lm_problem(folder: Path) -> str | None:
    """Why `folder` is no causal LM to fine-tune (no config, not *ForCausalLM, no tokenizer),
    or None."""
    config = _config(folder)
    if isinstance(config, str):
        return config
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForCausalLM") for a in architectures):
        return (
            f"{folder} is not a causal language model (architectures: "
            f"{architectures or 'none'}, model_type: {config.get('model_type')!r}); "
            "a fine-tune needs a *ForCausalLM"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return f"{folder} has no tokenizer ({' or '.join(TOKENIZER_FILES)})"
    return None


def context_problem(folder: Path, seq_len: int) -> str | None:
    """Why sequences of `seq_len` tokens do not fit the model's context, or None (also when
    its config states no limit)."""
    config = _config(folder)
    if isinstance(config, str):
        return config
    for key in CONTEXT_KEYS:
        if isinstance(config.get(key), int):
            if seq_len > config[key]:
                return f"{seq_len} tokens is over the model's limit of {config[key]} ({key})"
            return None
    return None
