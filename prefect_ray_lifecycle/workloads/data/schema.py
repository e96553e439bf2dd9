"""The schema rows are checked against: inferring it from a cheap look at the source, and
casting columns to it while noting the values that do not fit."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from prefect_ray_lifecycle.workloads.data.source import SourceError, SourceFiles

COLUMN_TYPES: dict[str, pa.DataType] = {
    "int64": pa.int64(),
    "float64": pa.float64(),
    "string": pa.string(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}


def type_name(arrow_type: pa.DataType) -> str | None:
    """The project's name for an arrow type, or None when it has none."""
    if pa.types.is_integer(arrow_type):
        return "int64"
    if pa.types.is_floating(arrow_type):
        return "float64"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_timestamp(arrow_type):
        return "timestamp"
    return None


@dataclass(frozen=True)
class SourceSummary:
    """What a cheap look at the source showed: its columns (in order, with types as read from
    the first file) and whether any file holds a row."""

    columns: dict[str, pa.DataType]
    has_rows: bool


def _first_json_objects(filesystem: pafs.FileSystem, path: str, limit: int) -> list[dict]:
    rows: list[dict] = []
    with filesystem.open_input_stream(path) as stream:
        for line in io.TextIOWrapper(stream, encoding="utf-8"):
            if line.strip():
                try:
                    value = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(value, dict):
                    rows.append(value)
                if len(rows) >= limit:
                    break
    return rows


def _json_type(values: list[Any]) -> pa.DataType:
    # Mixed JSON types (a bad row among good ones) read as text; validation sorts them out.
    try:
        return pa.array(values).type
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.string()


def skip_malformed(row: Any) -> str:
    """CSV invalid-row handler: the per-file check already quarantined these lines."""
    return "skip"


def summarize_source(files: SourceFiles) -> SourceSummary:
    """Columns and emptiness from parquet footers, CSV headers or the first JSON lines."""
    fs = files.filesystem
    if files.format == "parquet":
        metas = [pq.ParquetFile(fs.open_input_file(p)).metadata for p in files.paths]
        schema = metas[0].schema.to_arrow_schema()
        return SourceSummary({f.name: f.type for f in schema}, any(m.num_rows for m in metas))
    if files.format == "csv":
        columns: dict[str, pa.DataType] = {}
        has_rows = False
        for i, path in enumerate(files.paths):
            if not fs.get_file_info(path).size:
                continue
            with fs.open_input_stream(path) as stream:
                reader = pacsv.open_csv(
                    stream,
                    read_options=pacsv.ReadOptions(block_size=1 << 20),
                    parse_options=pacsv.ParseOptions(invalid_row_handler=skip_malformed),
                )
                if not columns:
                    columns = {f.name: f.type for f in reader.schema}
                try:
                    has_rows = has_rows or reader.read_next_batch().num_rows > 0
                except StopIteration:
                    pass
            if columns and has_rows and i > 0:
                break
        return SourceSummary(columns, has_rows)
    for path in files.paths:
        rows = _first_json_objects(fs, path, 1000)
        if rows:
            names = list(dict.fromkeys(name for row in rows for name in row))
            return SourceSummary({n: _json_type([r.get(n) for r in rows]) for n in names}, True)
    return SourceSummary({}, False)


def resolve_schema(
    summary: SourceSummary,
    expected: dict[str, str] | None,
    required: Iterable[str] = (),
    also_needed: Iterable[str] = (),
) -> dict[str, str]:
    """The schema rows are checked against: the expected one, or the first file's own.
    Raises SourceError naming any column the source or the schema lacks."""
    if expected is None:
        schema = {}
        for name, arrow_type in summary.columns.items():
            if (tname := type_name(arrow_type)) is None:
                raise SourceError(
                    f"column {name!r} has type {arrow_type}, which has no checked "
                    f"type; give an expected schema that leaves it out"
                )
            schema[name] = tname
    else:
        unknown_types = {c: t for c, t in expected.items() if t not in COLUMN_TYPES}
        if unknown_types:
            raise SourceError(f"unknown column types {unknown_types}; use {list(COLUMN_TYPES)}")
        missing = [c for c in expected if c not in summary.columns]
        if missing:
            raise SourceError(
                f"expected schema names columns {missing} that the source does not "
                f"have; its columns are {list(summary.columns)}"
            )
        schema = dict(expected)
    for name in (*required, *also_needed):
        if name not in schema:
            raise SourceError(f"column {name!r} is not in the schema {list(schema)}")
    return schema


def _convert_one(value: str, tname: str) -> Any:
    text = value.strip()
    if tname == "int64":
        return int(text)
    if tname == "float64":
        return float(text)
    if tname == "bool":
        return {"true": True, "false": False, "1": True, "0": False}[text.lower()]
    raise ValueError(tname)


def _cast_strings(strings: pa.Array, tname: str) -> tuple[pa.Array, list[int]]:
    """Cast a string array; return the cast array and the indexes that would not parse."""
    target = COLUMN_TYPES[tname]
    if tname == "string":
        return strings, []
    if tname == "timestamp":
        # pandas only inside Ray Data workers: the flow process plans without loading it.
        import pandas as pd

        parsed = pd.to_datetime(
            pd.Series(strings.to_pandas()), format="ISO8601", utc=True, errors="coerce"
        )
        bad = [
            int(i)
            for i in (parsed.isna() & strings.is_valid().to_numpy(zero_copy_only=False))
            .to_numpy()
            .nonzero()[0]
        ]
        return pa.array(parsed, type=target, from_pandas=True), bad
    trimmed = pc.utf8_trim_whitespace(strings)
    if tname == "bool":
        trimmed = pc.utf8_lower(trimmed)
    try:
        return pc.cast(trimmed, target), []
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    values, bad = [], []
    for i, value in enumerate(strings.to_pylist()):
        if value is None:
            values.append(None)
            continue
        try:
            values.append(_convert_one(value, tname))
        except (ValueError, KeyError, OverflowError):
            values.append(None)
            bad.append(i)
    try:
        return pa.array(values, type=target), bad
    except OverflowError:  # an int64 overflow: pa.array reports it for the whole array
        ok = [v if v is None or -(2**63) <= v < 2**63 else None for v in values]
        bad = sorted(
            set(bad) | {i for i, v in enumerate(values) if v is not None and ok[i] is None}
        )
        return pa.array(ok, type=target), bad


def cast_column(column: pa.Array, tname: str) -> tuple[pa.Array, list[int]]:
    """`column` as the schema type, with the indexes of values that cannot be that type."""
    target = COLUMN_TYPES[tname]
    if column.type == target:
        return column, []
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        try:
            return pc.cast(column, target, safe=True), []
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            column = pc.cast(column, pa.string())
    return _cast_strings(column.cast(pa.string()), tname)


def parse_json_lines(
    lines: pa.Array, schema: dict[str, str]
) -> tuple[pa.Table, dict[int, tuple[str, str]]]:
    """JSON lines to a table of strings per schema column (non-strings as their JSON text),
    and the lines that are not JSON objects."""
    columns: dict[str, list[str | None]] = {c: [] for c in schema}
    bad: dict[int, tuple[str, str]] = {}
    for i, line in enumerate(lines.to_pylist()):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except ValueError as error:
            bad[i] = ("unparsable line", str(error))
            row = {}
        for name, values in columns.items():
            value = row.get(name)
            values.append(value if value is None or isinstance(value, str) else json.dumps(value))
    return pa.table({c: pa.array(v, type=pa.string()) for c, v in columns.items()}), bad
