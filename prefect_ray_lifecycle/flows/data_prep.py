"""Data prep on Ray: a source of parquet, CSV or JSON lines becomes a validated, transformed,
hash-split parquet dataset, published atomically as a Prefect asset. Bad rows go to a
quarantine beside it; a re-run with the same inputs reuses it without touching Ray."""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.tasks.data.config import (
    DEFAULT_EVAL_FRACTION,
    DEFAULT_MAX_BAD_FRACTION,
    ColumnType,
    DatasetResult,
    RowFilterParam,
)
from prefect_ray_lifecycle.tasks.data.prep import (
    TooManyBadRows,
    dataset_result,
    discard_staging,
    find_cached,
    judge_bad_rows,
    plan_dataset,
    prepare_dataset,
    publish_dataset,
    summarize_dataset,
)
from prefect_ray_lifecycle.workloads.data.publish import staging_path


class DataPrepParams(BaseModel):
    """What to prepare and how."""

    source: str = Field(
        description="Local path, glob, or pyarrow filesystem URI of parquet, "
        "CSV or JSON-lines files (one format per source)."
    )
    output: str = Field(
        description="Folder (path or URI) the dataset is published to; its "
        "train/, eval/ and quarantine/ appear together or not at all."
    )
    split_key: str = Field(
        description="Column whose value is hashed to pick train or eval: "
        "the same key always lands in the same split."
    )
    eval_fraction: float = Field(
        default=DEFAULT_EVAL_FRACTION,
        ge=0.0,
        le=1.0,
        description="Share of keys that go to the eval split.",
    )
    expected_schema: dict[str, ColumnType] | None = Field(
        default=None,
        description="Columns to keep and their types; values that do not parse "
        "as the type are quarantined. Empty: the first file's columns and types.",
    )
    required_columns: list[str] = Field(
        default_factory=list, description="Columns whose nulls send a row to the quarantine."
    )
    filters: list[RowFilterParam] = Field(
        default_factory=list, description="Rows failing any filter are dropped (not bad)."
    )
    transform: str | None = Field(
        default=None,
        description="'module:function' applied to each batch with map_batches, e.g. "
        "'prefect_ray_lifecycle.workloads.data.transforms:tokenize_text'; it must be "
        "importable on the Ray workers.",
    )
    transform_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the transform."
    )
    transform_batch_format: Literal["pandas", "pyarrow"] = Field(
        default="pandas", description="Batch kind the transform takes and returns."
    )
    max_bad_fraction: float = Field(
        default=DEFAULT_MAX_BAD_FRACTION,
        ge=0.0,
        le=1.0,
        description="Largest share of source rows that may be quarantined; past it the run "
        "fails with the counts and first reasons, and publishes nothing.",
    )


@flow(name="data-prep", log_prints=True)
def data_prep(
    params: DataPrepParams,
    ray_cluster: RayCluster | None = None,
) -> DatasetResult:
    """Prepare a dataset on Ray (see DataPrepParams); return where it is and its fingerprint.

    Args:
        params: What to prepare: source, schema, transform, split and output.
        ray_cluster: Where to run; an embedded local Ray when empty.
    """
    plan = plan_dataset(params)
    cached = find_cached(plan)
    if cached is not None:
        print(f"cache hit: {plan.output} already holds fingerprint {plan.fingerprint[:12]}")
        summarize_dataset(cached)
        return cached

    staging = staging_path(plan.output)
    try:
        staged = prepare_dataset(plan, staging, ray_cluster or RayCluster())
        result = dataset_result(plan, staged)
        verdict = judge_bad_rows(
            result.rows_in,
            result.rows_quarantined,
            plan.max_bad_fraction,
            staged.reasons,
            staged.first_reasons,
        )
        if not verdict.passed:
            raise TooManyBadRows(verdict.reason)
        print(verdict.reason)
        result = publish_dataset(plan)(staging, result)
    finally:
        discard_staging(plan, staging)
    summarize_dataset(result)
    return result
