"""Per-file checks and the quarantine. Bad rows never crash a job; each lands in the quarantine
with a stable `reason` (what kind of problem, in which column: the thing to count) and a
`detail` (the offending value or message)."""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

QUARANTINE_DIR = "quarantine"
QUARANTINE_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("row", pa.string()),
    ]
)


@dataclass(frozen=True)
class FileCheck:
    """One source file: its rows, and how many went to the quarantine before the pipeline."""

    path: str
    rows: int
    quarantined: int
    readable_by_pipeline: bool


def quarantine_table(
    source: str | None, reasons: list[str], details: list[str], rows: list[str]
) -> pa.Table:
    """Bad rows as a quarantine table; `source` is the file, or None for pipeline rows."""
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


def row_json(row: dict[str, Any]) -> str:
    """A row as stable JSON text, for the quarantine's `row` column."""
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
            quarantine_table(
                path,
                [reason] * table.num_rows,
                [details] * table.num_rows,
                [row_json(r) for r in table.to_pylist()],
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
            quarantine_table(
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


def start_checks(
    filesystem: pafs.FileSystem,
    paths: list[str],
    file_format: str,
    schema: dict[str, str],
    quarantine_dir: str,
) -> Callable[[], list[FileCheck]]:
    """check_file for every file; call the result for the checks, in path order. Parquet
    files are checked here and now (a check reads only the footer: a Ray task and the wait
    for its worker would cost more); CSV and JSON lines, read whole, as plain Ray tasks
    started in one go (no Prefect in their workers, which the pipeline's Ray Data tasks then
    reuse)."""
    if file_format == "parquet":
        done = check_here(filesystem, paths, file_format, schema, quarantine_dir)
        return lambda: done
    import ray  # only where Ray is initialised; the flow process plans without it

    # Two groups of files per CPU: files of uneven sizes still spread over every CPU.
    tasks = max(1, min(len(paths), int(ray.cluster_resources().get("CPU", 1)) * 2))
    check = ray.remote(check_here)
    refs = [
        check.remote(filesystem, paths[i::tasks], file_format, schema, quarantine_dir)
        for i in range(tasks)
    ]

    def gather() -> list[FileCheck]:
        by_path = {c.path: c for group in ray.get(refs) for c in group}
        return [by_path[p] for p in paths]

    return gather


def check_here(
    filesystem: pafs.FileSystem,
    paths: list[str],
    file_format: str,
    schema: dict[str, str],
    quarantine_dir: str,
) -> list[FileCheck]:
    """check_file for every file in this process, a few at a time (a Ray task's body for
    files read whole)."""
    with ThreadPoolExecutor(8) as pool:
        return list(
            pool.map(
                lambda path: check_file(filesystem, path, file_format, schema, quarantine_dir),
                paths,
            )
        )
