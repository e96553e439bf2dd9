"""The pipeline's writer: the rows of each split into their own parquet folder. Ray Data's
partitioned write groups and copies every row; here each split is a run of rows (see
splits.py), written as zero-copy slices. Loads Ray Data: imported where the pipeline runs."""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from ray.data import Datasink
from ray.data.block import Block, BlockAccessor

from prefect_ray_lifecycle.workloads.data.splits import SPLITS, split_runs


class SplitParquetSink(Datasink[None]):
    """Rows of each split into `<directory>/<split>/`, one file per split and write task,
    named by the task's index so that a retried task rewrites its own files."""

    def __init__(self, directory: str, filesystem: pafs.FileSystem):
        self.directory = directory
        self.filesystem = filesystem
        self.write_id = uuid.uuid4().hex[:12]

    def write(self, blocks: Iterable[Block], ctx) -> None:
        runs: dict[str, list[pa.Table]] = {split: [] for split in SPLITS}
        for block in blocks:
            for split, rows in split_runs(BlockAccessor.for_block(block).to_arrow()):
                if rows.num_rows:
                    runs[split].append(rows)
        for split, tables in runs.items():
            if tables:
                folder = posixpath.join(self.directory, split)
                self.filesystem.create_dir(folder, recursive=True)
                pq.write_table(
                    pa.concat_tables(tables, promote_options="default"),
                    posixpath.join(folder, f"{self.write_id}-{ctx.task_idx:06d}.parquet"),
                    filesystem=self.filesystem,
                )
