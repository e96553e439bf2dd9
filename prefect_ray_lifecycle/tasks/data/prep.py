"""Prefect tasks for dataset prep. Each wraps one coarse unit: look at the source (no Ray),
check the files and run the one Ray Data pipeline (on Ray, driven from the flow process),
publish the staged dataset as a Prefect asset."""

from __future__ import annotations

import posixpath
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.assets import Asset, AssetProperties, add_asset_metadata, materialize
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.ray_runner.lineage import job_config, link_flow_run
from prefect_ray_lifecycle.tasks.data.config import DatasetPlan, DatasetResult, Verdict
from prefect_ray_lifecycle.workloads.data.checks import QUARANTINE_DIR
from prefect_ray_lifecycle.workloads.data.pipeline import (
    StagedCounts,
    load_transform,
    run_pipeline,
    transform_source,
)
from prefect_ray_lifecycle.workloads.data.publish import discard, publish, read_manifest
from prefect_ray_lifecycle.workloads.data.schema import resolve_schema, summarize_source
from prefect_ray_lifecycle.workloads.data.source import (
    SourceError,
    SourceFiles,
    content_fingerprint,
    filesystem_and_path,
    resolve_source,
    to_uri,
)


class TooManyBadRows(RuntimeError):
    """The quarantine holds more than the allowed share of the source's rows."""


def judge_bad_rows(
    rows_in: int,
    quarantined: int,
    max_bad_fraction: float,
    reasons: dict[str, int],
    first_reasons: list[str],
) -> Verdict:
    """Pass when the quarantined share is at most `max_bad_fraction`; the reason says why."""
    share = quarantined / rows_in if rows_in else 0.0
    counts = (
        f"{quarantined} of {rows_in} rows quarantined ({share:.2%}, limit {max_bad_fraction:.2%})"
    )
    if share <= max_bad_fraction:
        return Verdict(passed=True, reason=counts)
    return Verdict(passed=False, reason=f"{counts}; by reason {reasons}; first: {first_reasons}")


def plan_parameters(params: Any) -> dict[str, Any]:
    """The parameters that shape the output, for the fingerprint (the output folder and the
    cluster do not change what is written)."""
    return params.model_dump(mode="json", exclude={"output"})


@task(cache_policy=NO_CACHE)
def plan_dataset(params: Any) -> DatasetPlan:
    """Find the source files, check the schema against them and fingerprint the inputs.
    Runs in the flow process and fails with a clear message before any Ray work."""
    files = resolve_source(params.source)
    summary = summarize_source(files)
    if not summary.has_rows:
        raise SourceError(
            f"source {params.source!r} has no rows ({len(files.paths)} {files.format} files)"
        )
    schema = resolve_schema(
        summary,
        params.expected_schema,
        params.required_columns,
        [params.split_key, *(f.column for f in params.filters)],
    )
    if params.transform is not None:
        load_transform(params.transform)
    output_fs, output_path = filesystem_and_path(params.output)
    output_uri = to_uri(output_fs, output_path)
    Asset(key=output_uri)  # fails now, naming the key, if Prefect cannot take it
    fingerprint = content_fingerprint(
        files, transform_source(params.transform), plan_parameters(params)
    )
    return DatasetPlan(
        source=params.source,
        source_uri=_lineage_key(files),
        format=files.format,
        paths=list(files.paths),
        schema=schema,
        required=list(params.required_columns),
        filters=list(params.filters),
        transform=params.transform,
        transform_kwargs=params.transform_kwargs,
        batch_format=params.transform_batch_format,
        split_key=params.split_key,
        eval_fraction=params.eval_fraction,
        max_bad_fraction=params.max_bad_fraction,
        output=output_path,
        output_uri=output_uri,
        fingerprint=fingerprint,
    )


def _lineage_key(files: SourceFiles) -> str:
    """The source as an asset key; a glob is represented by the folder it searches."""
    uri = files.uri
    while True:
        try:
            return Asset(key=uri).key
        except ValueError:
            parent = uri.rsplit("/", 1)[0]
            if parent == uri or "://" not in parent:
                return to_uri(files.filesystem, posixpath.dirname(files.paths[0]))
            uri = parent


def _output_fs(plan: DatasetPlan):
    return filesystem_and_path(plan.output)[0]


@task(cache_policy=NO_CACHE)
def find_cached(plan: DatasetPlan) -> DatasetResult | None:
    """The published dataset at the output when its fingerprint matches; no Ray involved."""
    manifest = read_manifest(_output_fs(plan), plan.output)
    if not manifest or manifest.get("fingerprint") != plan.fingerprint:
        return None
    return DatasetResult.model_validate({**manifest, "cache_hit": True})


@task(cache_policy=NO_CACHE)
def prepare_dataset(plan: DatasetPlan, staging: str, cluster: RayCluster) -> StagedCounts:
    """Per-file checks (count rows; quarantine files that lack schema columns and malformed
    CSV lines), then the one Ray Data pipeline: read, validate, transform, split, write into
    `staging`. This process drives them, as a Ray Data script would: no Prefect task on a
    fresh Ray worker (seconds of imports) stands between the flow and the pipeline."""
    context = FlowRunContext.get()
    flow_run_id = context.flow_run.id if context and context.flow_run else None
    # The staged dataset is written at the end: publishing it needs no Ray, so it does not
    # wait the second or more a local Ray takes to stop.
    with cluster.connect(
        job_config=job_config(flow_run_id) if flow_run_id else None, stop_in_background=True
    ) as ray_context:
        if flow_run_id:  # the run's id in the job's metadata, the job on the run
            link_flow_run(flow_run_id, cluster, ray_context)
        return run_pipeline(
            filesystem_and_path(plan.source)[0], plan.paths, plan.spec(), staging, _output_fs(plan)
        )


def dataset_result(plan: DatasetPlan, staged: StagedCounts) -> DatasetResult:
    rows_in = staged.rows_in
    return DatasetResult(
        output=plan.output,
        train_path=posixpath.join(plan.output, "train"),
        eval_path=posixpath.join(plan.output, "eval"),
        quarantine_path=posixpath.join(plan.output, QUARANTINE_DIR),
        asset_key=plan.output_uri,
        source=plan.source,
        fingerprint=plan.fingerprint,
        rows_in=rows_in,
        rows_train=staged.rows_train,
        rows_eval=staged.rows_eval,
        rows_quarantined=staged.rows_quarantined,
        rows_filtered=rows_in - staged.rows_train - staged.rows_eval - staged.rows_quarantined,
        reasons=staged.reasons,
        output_schema=staged.schema,
    )


def publish_dataset(plan: DatasetPlan):
    """A task that moves the staged dataset into place and materialises it as an asset."""
    asset = Asset(
        key=plan.output_uri,
        properties=AssetProperties(
            name=posixpath.basename(plan.output.rstrip("/")),
            description=f"Prepared dataset from {plan.source} (train/eval/quarantine parquet).",
        ),
    )

    @materialize(
        asset,
        by="ray-data",
        asset_deps=[plan.source_uri],
        cache_policy=NO_CACHE,
        name="publish-dataset",
    )
    def publish_staged(staging: str, result: DatasetResult) -> DatasetResult:
        publish(_output_fs(plan), staging, plan.output, result.model_dump(mode="json"))
        add_asset_metadata(
            asset,
            {
                "rows_in": result.rows_in,
                "rows_out": result.rows_train + result.rows_eval,
                "rows_train": result.rows_train,
                "rows_eval": result.rows_eval,
                "rows_quarantined": result.rows_quarantined,
                "schema": result.output_schema,
                "fingerprint": result.fingerprint,
                "source": plan.source_uri,
            },
        )
        return result

    return publish_staged


@task(cache_policy=NO_CACHE)
def discard_staging(plan: DatasetPlan, staging: str) -> None:
    """Remove what a run staged but did not publish (no-op after a publish)."""
    discard(_output_fs(plan), staging)


def summarize_dataset(result: DatasetResult) -> None:
    """A table artifact: the dataset's counts, fingerprint and where it lives."""
    rows = [
        {"field": name, "value": str(value)}
        for name, value in (
            ("output", result.output),
            ("source", result.source),
            ("fingerprint", result.fingerprint),
            ("cache hit", result.cache_hit),
            ("rows in", result.rows_in),
            ("rows train", result.rows_train),
            ("rows eval", result.rows_eval),
            ("rows quarantined", result.rows_quarantined),
            ("rows filtered", result.rows_filtered),
            ("reasons", result.reasons),
            ("schema", result.output_schema),
        )
    ]
    create_table_artifact(rows, key="data-prep", description=f"Dataset {result.asset_key}")
