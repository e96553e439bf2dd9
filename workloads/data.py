"""Ray Data pipeline pieces for dataset prep: finding and fingerprinting a source, per-file
checks, row validation with a quarantine, a stable hash split, and atomic publishing.

Imports nothing from Prefect: the batch functions run inside Ray Data workers on any cluster.
Bad rows never crash a job; each lands in the quarantine with a stable `reason` (what kind of
problem, in which column: the thing to count) and a `detail` (the offending value or message).
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import inspect
import io
import json
import os
import posixpath
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

COLUMN_TYPES: dict[str, pa.DataType] = {
    "int64": pa.int64(),
    "float64": pa.float64(),
    "string": pa.string(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}
EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
}
SPLIT_COLUMN = "split"
SPLITS = ("train", "eval")
QUARANTINE_DIR = "quarantine"
MANIFEST = "_manifest.json"
QUARANTINE_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("row", pa.string()),
    ]
)
# Hash space for the split: a key goes to eval when its hash falls below ratio * this.
SPLIT_BUCKETS = 2**32
HASH_CHUNK_BYTES = 4 << 20
# Reasons kept in a summary (and in an error message) so a reader sees the first problems.
FIRST_REASONS = 5


class SourceError(ValueError):
    """The source or the schema is unusable; raised before any Ray work."""


class TransformContractError(RuntimeError):
    """A transform broke its contract (one output row per input row); fails the whole job."""


# --------------------------------------------------------------------------- source


@dataclass(frozen=True)
class SourceFiles:
    """The files a source names, on one pyarrow filesystem, all of one format."""

    source: str
    filesystem: pafs.FileSystem
    path: str  # the source's path on `filesystem`, glob included
    paths: tuple[str, ...]
    format: str

    @property
    def uri(self) -> str:
        """The source as a URI, for lineage (`file:///...` for local files)."""
        return to_uri(self.filesystem, self.path)


def _has_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def to_uri(filesystem: pafs.FileSystem, path: str) -> str:
    if isinstance(filesystem, pafs.LocalFileSystem):
        return "file://" + os.path.abspath(path)
    return f"{filesystem.type_name}://{path.lstrip('/')}"


def filesystem_and_path(location: str) -> tuple[pafs.FileSystem, str]:
    """A local path or any pyarrow filesystem URI, as (filesystem, path)."""
    if "://" in location:
        glob_at = min((location.find(c) for c in "*?[" if c in location), default=-1)
        if glob_at >= 0:  # from_uri rejects some glob characters; resolve the prefix only
            head = location[:glob_at]
            base, _, partial = head.rpartition("/")
            filesystem, path = pafs.FileSystem.from_uri(base + "/")
            return filesystem, posixpath.join(path, partial + location[glob_at:])
        return pafs.FileSystem.from_uri(location)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))


def _data_files(filesystem: pafs.FileSystem, base: str) -> list[pafs.FileInfo]:
    selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
    return [
        info
        for info in filesystem.get_file_info(selector)
        if info.type == pafs.FileType.File
        and not any(
            part.startswith(("_", ".")) for part in posixpath.relpath(info.path, base).split("/")
        )
    ]


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """Shell-glob match by path segment: `*` stays inside a segment, `**` spans any number."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return (
        bool(parts)
        and fnmatch.fnmatchcase(parts[0], pattern[0])
        and _glob_match(parts[1:], pattern[1:])
    )


def resolve_source(source: str) -> SourceFiles:
    """The files behind a path, glob or URI; raises SourceError when there are none."""
    filesystem, path = filesystem_and_path(source)
    if _has_glob(path):
        base = path[: min(path.find(c) for c in "*?[" if c in path)].rpartition("/")[0] or "/"
        pattern = path.strip("/").split("/")
        infos = [
            i
            for i in _data_files(filesystem, base)
            if _glob_match(i.path.strip("/").split("/"), pattern)
        ]
    else:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise SourceError(f"source {source!r} does not exist")
        infos = [info] if info.type == pafs.FileType.File else _data_files(filesystem, path)
        if info.type == pafs.FileType.Directory:
            infos = [i for i in infos if posixpath.splitext(i.path)[1].lower() in EXTENSIONS]
    if not infos:
        raise SourceError(f"source {source!r} matched no files")
    formats = {EXTENSIONS.get(posixpath.splitext(i.path)[1].lower()) for i in infos}
    if None in formats or len(formats) != 1:
        kinds = sorted({posixpath.splitext(i.path)[1] or "(none)" for i in infos})
        raise SourceError(
            f"source {source!r} must hold files of one format (.parquet, .csv or "
            f".jsonl); found extensions {kinds}"
        )
    return SourceFiles(
        source=source,
        filesystem=filesystem,
        path=path,
        paths=tuple(sorted(i.path for i in infos)),
        format=formats.pop(),
    )


def _file_digest(filesystem: pafs.FileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with filesystem.open_input_stream(path) as stream:
        while chunk := stream.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def content_fingerprint(
    files: SourceFiles, transform_source: str, parameters: dict[str, Any]
) -> str:
    """sha256 over the files' bytes (in path order), the transform's source and the parameters
    that shape the output: same inputs, same fingerprint, wherever the files live."""
    with ThreadPoolExecutor(4) as pool:  # hashlib releases the GIL on large buffers
        digests = list(pool.map(lambda p: _file_digest(files.filesystem, p), files.paths))
    outer = hashlib.sha256()
    for value in (
        files.format,
        *digests,
        transform_source,
        json.dumps(parameters, sort_keys=True, default=str),
    ):
        outer.update(value.encode())
        outer.update(b"\0")
    return outer.hexdigest()


# --------------------------------------------------------------------------- schema


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


def summarize_source(files: SourceFiles) -> SourceSummary:
    """Columns and emptiness from parquet footers, CSV headers or the first JSON lines."""
    import pyarrow.csv as pacsv

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
                    parse_options=pacsv.ParseOptions(invalid_row_handler=_skip_malformed),
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


# --------------------------------------------------------------------------- per-file checks


@dataclass(frozen=True)
class FileCheck:
    """One source file: its rows, and how many went to the quarantine before the pipeline."""

    path: str
    rows: int
    quarantined: int
    readable_by_pipeline: bool


def _quarantine_table(
    source: str | None, reasons: list[str], details: list[str], rows: list[str]
) -> pa.Table:
    return pa.table(
        {"source": [source] * len(reasons), "reason": reasons, "detail": details, "row": rows},
        schema=QUARANTINE_SCHEMA,
    )


def write_quarantine(
    filesystem: pafs.FileSystem, directory: str, table: pa.Table, name: str
) -> None:
    if table.num_rows:
        filesystem.create_dir(directory, recursive=True)
        pq.write_table(table, posixpath.join(directory, f"{name}.parquet"), filesystem=filesystem)


def _row_json(row: dict[str, Any]) -> str:
    return json.dumps(row, default=str, sort_keys=True)


def check_file(
    filesystem: pafs.FileSystem,
    path: str,
    file_format: str,
    schema: dict[str, str],
    quarantine_dir: str,
) -> FileCheck:
    """Count a file's rows and quarantine what the pipeline cannot read: every row of a file
    that lacks a schema column, and CSV lines with the wrong number of fields."""
    import pyarrow.csv as pacsv

    name = "file-" + hashlib.sha256(path.encode()).hexdigest()[:16]
    if file_format == "json":
        with filesystem.open_input_stream(path) as stream:
            rows = sum(1 for line in io.TextIOWrapper(stream, encoding="utf-8") if line.strip())
        return FileCheck(path, rows, 0, True)

    malformed: list[pacsv.InvalidRow] = []
    if file_format == "parquet":
        parquet = pq.ParquetFile(filesystem.open_input_file(path))
        columns, rows = parquet.schema_arrow.names, parquet.metadata.num_rows
        table = None
    else:

        def keep_malformed(row: pacsv.InvalidRow) -> str:
            malformed.append(row)
            return "skip"

        if filesystem.get_file_info(path).size == 0:
            return FileCheck(path, 0, 0, False)
        with filesystem.open_input_stream(path) as stream:
            table = pacsv.read_csv(
                stream,
                parse_options=pacsv.ParseOptions(invalid_row_handler=keep_malformed),
                convert_options=pacsv.ConvertOptions(
                    column_types={c: pa.string() for c in schema}, strings_can_be_null=True
                ),
            )
        columns, rows = table.column_names, table.num_rows + len(malformed)

    missing = [c for c in schema if c not in columns]
    if missing:
        table = table if table is not None else pq.read_table(path, filesystem=filesystem)
        reason = f"missing column {missing[0]!r}"
        details = f"file lacks columns {missing}"
        write_quarantine(
            filesystem,
            quarantine_dir,
            _quarantine_table(
                path,
                [reason] * table.num_rows,
                [details] * table.num_rows,
                [_row_json(r) for r in table.to_pylist()],
            ),
            name,
        )
        quarantined = table.num_rows
    else:
        quarantined = 0
    if malformed:
        write_quarantine(
            filesystem,
            quarantine_dir,
            _quarantine_table(
                path,
                ["malformed CSV row"] * len(malformed),
                [
                    f"line {r.number}: expected {r.expected_columns} fields, got {r.actual_columns}"
                    for r in malformed
                ],
                [r.text for r in malformed],
            ),
            name + "-malformed",
        )
        quarantined += len(malformed)
    return FileCheck(path, rows, quarantined, readable_by_pipeline=not missing and rows > 0)


# --------------------------------------------------------------------------- rows


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


def split_of(keys: pa.Array | pa.ChunkedArray, eval_fraction: float) -> pa.Array:
    """'train' or 'eval' per key, from a hash of the key: stable across runs, batches,
    processes and machines (pandas' hash_array is seeded with a fixed key). Integer keys hash
    as int64 (fast, vectorised); others hash as their text; null keys hash like 0 or ''."""
    import pandas as pd

    if pa.types.is_integer(keys.type):
        values = pc.fill_null(keys.cast(pa.int64()), 0).to_numpy()
    else:
        values = (
            pc.fill_null(pc.cast(keys, pa.string()), "")
            .to_numpy(zero_copy_only=False)
            .astype(object)
        )
    is_eval = pd.util.hash_array(values) % SPLIT_BUCKETS < eval_fraction * SPLIT_BUCKETS
    return pc.if_else(pa.array(is_eval, pa.bool_()), "eval", "train")


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
    index: list[int],
) -> list[pa.Table]:
    """Transform `table`; when it raises, bisect to the rows that make it raise and record
    them in `bad` (keyed by `index`, their rows in the batch). Returns the good outputs."""
    if table.num_rows == 0:
        return []
    try:
        out = _to_arrow(fn(_to_format(table, spec.batch_format), **spec.transform_kwargs))
    except Exception as error:  # noqa: BLE001 - any error of user code marks its rows
        if table.num_rows == 1:
            bad[index[0]] = (f"transform raised {type(error).__name__}", str(error)[:500])
            return []
        half = table.num_rows // 2
        return apply_transform(fn, table.slice(0, half), spec, bad, index[:half]) + apply_transform(
            fn, table.slice(half), spec, bad, index[half:]
        )
    if out.num_rows != table.num_rows:
        raise TransformContractError(
            f"transform {spec.transform!r} returned {out.num_rows} rows for {table.num_rows}; "
            f"a transform must return one row per input row (filter with `filters`)"
        )
    return [
        out.append_column(SPLIT_COLUMN, split_of(table[spec.split_key], spec.eval_fraction))
        if spec.split_key
        else out
    ]


def prepare_batch(
    batch: pa.Table, spec: PipelineSpec, filesystem: pafs.FileSystem, quarantine_dir: str
) -> pa.Table:
    """One Ray Data batch: parse, validate, filter, transform and split; bad rows go to a
    quarantine file, good rows come back with their split."""
    bad: dict[int, tuple[str, str]] = {}
    raw = batch
    if spec.format == "json":
        raw, bad = parse_json_lines(batch["text"].combine_chunks(), spec.schema)
    typed = validate(raw, spec, bad)
    keep = pa.array([i not in bad for i in range(typed.num_rows)]) if bad else None
    for row_filter in spec.filters:
        mask = pc.fill_null(row_filter.mask(typed), False)
        keep = mask if keep is None else pc.and_(keep, mask)
    positions = (
        list(range(typed.num_rows))
        if keep is None
        else [int(i) for i in keep.to_numpy(zero_copy_only=False).nonzero()[0]]
    )
    good = typed if keep is None else typed.take(pa.array(positions, pa.int64()))
    if spec.transform:
        outputs = apply_transform(load_transform(spec.transform), good, spec, bad, positions)
    elif good.num_rows:
        outputs = [
            good.append_column(SPLIT_COLUMN, split_of(good[spec.split_key], spec.eval_fraction))
            if spec.split_key
            else good
        ]
    else:
        outputs = []
    if bad:
        order = sorted(bad)
        rows = (
            batch["text"].take(order).to_pylist()
            if spec.format == "json"
            else [_row_json(r) for r in batch.take(order).to_pylist()]
        )
        table = _quarantine_table(
            None, [bad[i][0] for i in order], [bad[i][1] for i in order], rows
        )
        # Named by content, so a retried Ray task rewrites its file instead of adding one.
        digest = hashlib.sha256(str(batch.num_rows).encode())
        for value in rows:
            digest.update(value.encode())
        write_quarantine(filesystem, quarantine_dir, table, "rows-" + digest.hexdigest()[:24])
    if not outputs:
        return _empty_like(typed)
    return pa.concat_tables(outputs, promote_options="default")


def _empty_like(typed: pa.Table) -> pa.Table:
    # A batch without good rows: an empty table the writer skips.
    return typed.slice(0, 0).append_column(SPLIT_COLUMN, pa.array([], pa.string()))


# --------------------------------------------------------------------------- pipeline


def _skip_malformed(row: Any) -> str:
    # The per-file check already quarantined these lines; the pipeline only skips them.
    return "skip"


def read_dataset(filesystem: pafs.FileSystem, paths: list[str], spec: PipelineSpec):
    """A Ray Dataset over the files, with schema columns read as the pipeline expects."""
    import pyarrow.csv as pacsv
    import ray.data

    if spec.format == "parquet":
        return ray.data.read_parquet(
            paths, filesystem=filesystem, columns=list(spec.schema), partitioning=None
        )
    if spec.format == "csv":
        return ray.data.read_csv(
            paths,
            filesystem=filesystem,
            partitioning=None,
            parse_options=pacsv.ParseOptions(invalid_row_handler=_skip_malformed),
            convert_options=pacsv.ConvertOptions(
                column_types={c: pa.string() for c in spec.schema},
                include_columns=list(spec.schema),
                strings_can_be_null=True,
            ),
        )
    return ray.data.read_text(paths, filesystem=filesystem)


@dataclass(frozen=True)
class StagedCounts:
    """What a pipeline left in its staging folder."""

    rows_train: int
    rows_eval: int
    rows_quarantined: int
    reasons: dict[str, int]
    first_reasons: list[str]
    schema: dict[str, str]


def _parquet_files(filesystem: pafs.FileSystem, directory: str) -> list[str]:
    return sorted(i.path for i in _data_files(filesystem, directory) if i.path.endswith(".parquet"))


def _rows(filesystem: pafs.FileSystem, files: list[str]) -> int:
    return sum(pq.ParquetFile(filesystem.open_input_file(p)).metadata.num_rows for p in files)


def summarize_staging(filesystem: pafs.FileSystem, staging: str) -> StagedCounts:
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
    """Read, prepare and write the dataset into `staging` (train/, eval/, quarantine/); must
    run where Ray is initialised. Files the per-file checks rejected are left out."""
    quarantine_dir = posixpath.join(staging, QUARANTINE_DIR)
    data_dir = posixpath.join(staging, "_data")
    if paths:
        dataset = read_dataset(filesystem, paths, spec).map_batches(
            prepare_batch,
            batch_format="pyarrow",
            zero_copy_batch=True,
            fn_kwargs={
                "spec": spec,
                "filesystem": output_filesystem,
                "quarantine_dir": quarantine_dir,
            },
        )
        dataset.write_parquet(data_dir, filesystem=output_filesystem, partition_cols=[SPLIT_COLUMN])
    for split in SPLITS:
        written = posixpath.join(data_dir, f"{SPLIT_COLUMN}={split}")
        target = posixpath.join(staging, split)
        if output_filesystem.get_file_info(written).type == pafs.FileType.Directory:
            output_filesystem.move(written, target)
        else:
            output_filesystem.create_dir(target, recursive=True)
    output_filesystem.delete_dir_contents(data_dir, missing_dir_ok=True)
    if output_filesystem.get_file_info(data_dir).type == pafs.FileType.Directory:
        output_filesystem.delete_dir(data_dir)
    if not _parquet_files(output_filesystem, quarantine_dir):
        # An empty file keeps the folder readable as a (zero-row) quarantine table.
        output_filesystem.create_dir(quarantine_dir, recursive=True)
        pq.write_table(
            QUARANTINE_SCHEMA.empty_table(),
            posixpath.join(quarantine_dir, "empty.parquet"),
            filesystem=output_filesystem,
        )
    return summarize_staging(output_filesystem, staging)


# --------------------------------------------------------------------------- publishing


def staging_path(output: str) -> str:
    """A hidden sibling of `output`: same folder, so the final move is a rename."""
    parent, name = posixpath.split(output.rstrip("/"))
    return posixpath.join(parent, f".{name}.staging-{uuid.uuid4().hex[:12]}")


def read_manifest(filesystem: pafs.FileSystem, output: str) -> dict[str, Any] | None:
    """The manifest of a published dataset, or None when there is none."""
    path = posixpath.join(output, MANIFEST)
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as stream:
        return json.loads(stream.read())


def publish(
    filesystem: pafs.FileSystem, staging: str, output: str, manifest: dict[str, Any]
) -> None:
    """Write the manifest last, then move the staged folder into place. Readers see the old
    dataset or the new one, never a mix (one rename on a local or POSIX filesystem)."""
    with filesystem.open_output_stream(posixpath.join(staging, MANIFEST)) as out:
        out.write(json.dumps(manifest, indent=2, sort_keys=True).encode())
    filesystem.create_dir(posixpath.dirname(output.rstrip("/")), recursive=True)
    if filesystem.get_file_info(output).type == pafs.FileType.NotFound:
        filesystem.move(staging, output)
        return
    replaced = staging.replace(".staging-", ".replaced-")
    filesystem.move(output, replaced)
    filesystem.move(staging, output)
    filesystem.delete_dir(replaced)


def discard(filesystem: pafs.FileSystem, staging: str) -> None:
    """Remove a staging folder that will not be published (no-op when it is gone)."""
    if filesystem.get_file_info(staging).type == pafs.FileType.Directory:
        filesystem.delete_dir(staging)
