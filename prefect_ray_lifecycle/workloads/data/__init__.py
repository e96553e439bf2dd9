"""Dataset prep on Ray Data: source files, schema, per-file checks, the pipeline, the split,
publishing."""

from prefect_ray_lifecycle.workloads.data.checks import (
    QUARANTINE_DIR,
    FileCheck,
    check_file,
    start_checks,
)
from prefect_ray_lifecycle.workloads.data.pipeline import (
    PipelineSpec,
    RowFilter,
    StagedCounts,
    TransformContractError,
    load_transform,
    run_pipeline,
    transform_source,
)
from prefect_ray_lifecycle.workloads.data.publish import (
    discard,
    publish,
    read_manifest,
    staging_path,
)
from prefect_ray_lifecycle.workloads.data.schema import resolve_schema, summarize_source
from prefect_ray_lifecycle.workloads.data.source import (
    SourceError,
    SourceFiles,
    content_fingerprint,
    filesystem_and_path,
    resolve_source,
    to_uri,
)
from prefect_ray_lifecycle.workloads.data.splits import split_of

__all__ = [
    "QUARANTINE_DIR",
    "FileCheck",
    "PipelineSpec",
    "RowFilter",
    "SourceError",
    "SourceFiles",
    "StagedCounts",
    "TransformContractError",
    "check_file",
    "content_fingerprint",
    "discard",
    "filesystem_and_path",
    "load_transform",
    "publish",
    "read_manifest",
    "resolve_schema",
    "resolve_source",
    "run_pipeline",
    "split_of",
    "staging_path",
    "start_checks",
    "summarize_source",
    "to_uri",
    "transform_source",
]
