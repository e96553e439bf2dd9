"""The Ray Data pipeline: row validation, filters, the user transform and a stable hash split,
batch by batch, written into a staging folder. The batch functions run inside Ray Data workers
on any cluster."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from prefect_ray_lifecycle.workloads.data.checks import (
    QUARANTINE_DIR,
    QUARANTINE_SCHEMA,
    quarantine_table,
    row_json,
    start_checks,
    write_quarantine,
)
from prefect_ray_lifecycle.workloads.data.schema import (
    cast_column,
    parse_json_lines,
    skip_malformed,
)
from prefect_ray_lifecycle.workloads.data.source import data_files
from prefect_ray_lifecycle.workloads.data.splits import SPLIT_COLUMN, SPLITS, in_eval, split_labels

# Reasons kept in a summary (and in an error message) so a reader sees the first problems.
FIRST_REASONS = 5


class TransformContractError(RuntimeError):
    """A transform broke its contract (one output row per input row); fails the whole job."""


@dataclass(frozen=True)
class RowFilter:
    """Keep rows where `column op value` holds (rows with a null there are dropped)."""

    column: str
    op: str
    value: Any

    OPS = ("==", "!=", "<", "<=", ">", ">=", "in", "not in")

    def mask(self, table: pa.Table) -> pa.Array:
        column = table[self.column]
        functions = {
            "==": pc.equal,
            "!=": pc.not_equal,
            "<": pc.less,
            "<=": pc.less_equal,
            ">": pc.greater,
            ">=": pc.greater_equal,
        }
        if self.op in functions:
            return functions[self.op](column, pa.scalar(self.value, type=column.type))
        values = pa.array(list(self.value), type=column.type)
        matched = pc.is_in(column, value_set=values)
        return matched if self.op == "in" else pc.invert(matched)


@dataclass(frozen=True)
class PipelineSpec:
    """Everything a Ray Data worker needs to prepare a batch; pickled into each task."""

    format: str
    schema: dict[str, str]
    required: tuple[str, ...] = ()
    filters: tuple[RowFilter, ...] = ()
    transform: str | None = None
    transform_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_format: str = "pandas"
    split_key: str | None = None
    eval_fraction: float = 0.1


def load_transform(path: str) -> Callable[..., Any]:
    """`module:function` to the function; raises ValueError naming the path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"transform {path!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"transform {path!r} cannot be loaded: {error}") from error
    if not callable(fn):
        raise ValueError(f"transform {path!r} is not callable")
    return fn


def transform_source(path: str | None) -> str:
    """The source of the transform's whole module: helpers it calls change results too."""
    if path is None:
        return ""
    return inspect.getsource(importlib.import_module(path.partition(":")[0]))


def validate(raw: pa.Table, spec: PipelineSpec, bad: dict[int, tuple[str, str]]) -> pa.Table:
    """Cast `raw` to the schema; record the first problem of each bad row in `bad`."""
    columns = {}
    for name, tname in spec.schema.items():
        column = raw[name].combine_chunks() if isinstance(raw[name], pa.ChunkedArray) else raw[name]
        cast, unparsable = cast_column(column, tname)
        for i in unparsable:
            bad.setdefault(i, (f"wrong type in {name!r}", f"{column[i].as_py()!r} is not {tname}"))
        columns[name] = cast
    typed = pa.table(columns)
    for name in spec.required:
        for i in pc.is_null(typed[name]).to_numpy(zero_copy_only=False).nonzero()[0]:
            bad.setdefault(int(i), (f"null in required column {name!r}", "null"))
    return typed


def _to_format(table: pa.Table, batch_format: str) -> Any:
    return table.to_pandas() if batch_format == "pandas" else table


def _to_arrow(batch: Any) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, dict):
        return pa.table(batch)
    return pa.Table.from_pandas(batch, preserve_index=False)


def apply_transform(
    fn: Callable[..., Any],
    table: pa.Table,
    spec: PipelineSpec,
    bad: dict[int, tuple[str, str]],
    index: np.ndarray,
    offset: int = 0,
) -> list[tuple[int, pa.Table]]:
    """Transform `table`; when it raises, bisect to the rows that make it raise and record
    them in `bad` (keyed by `index`, their rows in the batch). Returns the good outputs, each
    with the offset of its first row in `table`."""
    if table.num_rows == 0:
        return []
    try:
        out = _to_arrow(fn(_to_format(table, spec.batch_format), **spec.transform_kwargs))
    except Exception as error:  # noqa: BLE001 - any error of user code marks its rows
        if table.num_rows == 1:
            bad[int(index[0])] = (f"transform raised {type(error).__name__}", str(error)[:500])
            return []
        half = table.num_rows // 2
        return apply_transform(
            fn, table.slice(0, half), spec, bad, index[:half], offset
        ) + apply_transform(fn, table.slice(half), spec, bad, index[half:], offset + half)
    if out.num_rows != table.num_rows:
        raise TransformContractError(
            f"transform {spec.transform!r} returned {out.num_rows} rows for {table.num_rows}; "
            f"a transform must return one row per input row (filter with `filters`)"
        )
    return [(offset, out)]


def prepare_batch(
    batch: pa.Table, spec: PipelineSpec, filesystem: pafs.FileSystem, quarantine_dir: str
) -> pa.Table:
    """One Ray Data batch: parse, validate, filter, transform and split; bad rows go to a
    quarantine file, good rows come back with their split column, eval rows first."""
    bad: dict[int, tuple[str, str]] = {}
    raw = batch
    if spec.format == "json":
        raw, bad = parse_json_lines(batch["text"].combine_chunks(), spec.schema)
    typed = validate(raw, spec, bad)
    keep = np.ones(typed.num_rows, dtype=bool)
    keep[list(bad)] = False
    for row_filter in spec.filters:
        keep &= pc.fill_null(row_filter.mask(typed), False).to_numpy(zero_copy_only=False)
    is_eval = (
        in_eval(typed[spec.split_key], spec.eval_fraction)
        if spec.split_key
        else np.zeros(typed.num_rows, dtype=bool)
    )
    # Eval rows first: each split is then one run of rows, which the sink writes uncopied.
    positions = np.concatenate([np.flatnonzero(keep & is_eval), np.flatnonzero(keep & ~is_eval)])
    in_order = len(positions) == typed.num_rows and not (is_eval[1:] > is_eval[:-1]).any()
    good = typed if in_order else typed.take(pa.array(positions, pa.int64()))
    good_eval = is_eval[positions]
    if spec.transform:
        fn = load_transform(spec.transform)
        outputs = apply_transform(fn, good, spec, bad, positions)
    else:
        outputs = [(0, good)] if good.num_rows else []
    if bad:
        _quarantine_rows(batch, spec, bad, filesystem, quarantine_dir)
    if not outputs:
        return typed.slice(0, 0).append_column(SPLIT_COLUMN, split_labels(good_eval[:0]))
    return pa.concat_tables(
        [
            out.append_column(SPLIT_COLUMN, split_labels(good_eval[at : at + out.num_rows]))
            for at, out in outputs
        ],
        promote_options="default",
    )


def _quarantine_rows(
    batch: pa.Table,
    spec: PipelineSpec,
    bad: dict[int, tuple[str, str]],
    filesystem: pafs.FileSystem,
    quarantine_dir: str,
) -> None:
    order = sorted(bad)
    rows = (
        batch["text"].take(order).to_pylist()
        if spec.format == "json"
        else [row_json(r) for r in batch.take(order).to_pylist()]
    )
    table = quarantine_table(None, [bad[i][0] for i in order], [bad[i][1] for i in order], rows)
    # Named by content, so a retried Ray task rewrites its file instead of adding one.
    digest = hashlib.sha256(str(batch.num_rows).encode())
    for value in rows:
        digest.update(value.encode())
    write_quarantine(filesystem, quarantine_dir, table, "rows-" + digest.hexdigest()[:24])


def read_dataset(filesystem: pafs.FileSystem, paths: list[str], spec: PipelineSpec):
    """A Ray Dataset over the files, with schema columns read as the pipeline expects."""
    import ray.data  # heavy; the flow process needs it only when the pipeline runs

    if spec.format == "parquet":
        return ray.data.read_parquet(
            paths, filesystem=filesystem, columns=list(spec.schema), partitioning=None
        )
    if spec.format == "csv":
        return ray.data.read_csv(
            paths,
            filesystem=filesystem,
            partitioning=None,
            parse_options=pacsv.ParseOptions(invalid_row_handler=skip_malformed),
            convert_options=pacsv.ConvertOptions(
                column_types={c: pa.string() for c in spec.schema},
                include_columns=list(spec.schema),
                strings_can_be_null=True,
            ),
        )
    return ray.data.read_text(paths, filesystem=filesystem)


@dataclass(frozen=True)
class StagedCounts:
    """What a pipeline read, and what it left in its staging folder."""

    rows_in: int
    rows_train: int
    rows_eval: int
    rows_quarantined: int
    reasons: dict[str, int]
    first_reasons: list[str]
    schema: dict[str, str]


def _parquet_files(filesystem: pafs.FileSystem, directory: str) -> list[str]:
    return sorted(i.path for i in data_files(filesystem, directory) if i.path.endswith(".parquet"))


def _rows(filesystem: pafs.FileSystem, files: list[str]) -> int:
    return sum(pq.ParquetFile(filesystem.open_input_file(p)).metadata.num_rows for p in files)


def summarize_staging(filesystem: pafs.FileSystem, staging: str, rows_in: int) -> StagedCounts:
    """Row counts from parquet footers, and quarantine reasons by count (largest first)."""
    counts = {
        split: _rows(filesystem, _parquet_files(filesystem, posixpath.join(staging, split)))
        for split in SPLITS
    }
    quarantine = pq.read_table(
        posixpath.join(staging, QUARANTINE_DIR), filesystem=filesystem, schema=QUARANTINE_SCHEMA
    )
    reasons: dict[str, int] = {}
    for reason in quarantine["reason"].to_pylist():
        reasons[reason] = reasons.get(reason, 0) + 1
    reasons = dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
    first = sorted(
        zip(
            quarantine["reason"].to_pylist(),
            quarantine["detail"].to_pylist(),
            quarantine["source"].to_pylist(),
            strict=True,
        ),
        key=lambda r: (r[0], r[1], r[2] or ""),
    )
    first_reasons = [f"{r}: {d}" for r, d, _ in first[:FIRST_REASONS]]
    train_files = _parquet_files(filesystem, posixpath.join(staging, "train")) + _parquet_files(
        filesystem, posixpath.join(staging, "eval")
    )
    schema = (
        {}
        if not train_files
        else {
            f.name: str(f.type)
            for f in pq.ParquetFile(filesystem.open_input_file(train_files[0])).schema_arrow
        }
    )
    return StagedCounts(
        rows_in=rows_in,
        rows_train=counts["train"],
        rows_eval=counts["eval"],
        rows_quarantined=quarantine.num_rows,
        reasons=reasons,
        first_reasons=first_reasons,
        schema=schema,
    )


def run_pipeline(
    filesystem: pafs.FileSystem,
    paths: list[str],
    spec: PipelineSpec,
    staging: str,
    output_filesystem: pafs.FileSystem,
) -> StagedCounts:
    """Check every file, then read, prepare and write the dataset into `staging` (train/,
    eval/, quarantine/); the Ray Data driver is the calling process, where Ray is initialised.
    Files the per-file checks reject are left out of the read."""
    quarantine_dir = posixpath.join(staging, QUARANTINE_DIR)
    checked = start_checks(filesystem, paths, spec.format, spec.schema, quarantine_dir)
    # Loads Ray Data (once per process) while any Ray-task checks run.
    from prefect_ray_lifecycle.workloads.data.sink import SplitParquetSink

    checks = checked()
    paths = [c.path for c in checks if c.readable_by_pipeline]
    if paths:
        read_dataset(filesystem, paths, spec).map_batches(
            prepare_batch,
            batch_format="pyarrow",
            zero_copy_batch=True,
            fn_kwargs={
                "spec": spec,
                "filesystem": output_filesystem,
                "quarantine_dir": quarantine_dir,
            },
        ).write_datasink(SplitParquetSink(staging, output_filesystem))
    for split in SPLITS:
        output_filesystem.create_dir(posixpath.join(staging, split), recursive=True)
    if not _parquet_files(output_filesystem, quarantine_dir):
        # An empty file keeps the folder readable as a (zero-row) quarantine table.
        output_filesystem.create_dir(quarantine_dir, recursive=True)
        pq.write_table(
            QUARANTINE_SCHEMA.empty_table(),
            posixpath.join(quarantine_dir, "empty.parquet"),
            filesystem=output_filesystem,
        )
    return summarize_staging(output_filesystem, staging, sum(c.rows for c in checks))
