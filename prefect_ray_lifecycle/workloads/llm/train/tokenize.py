"""Text into fixed-length training blocks, in Ray Data `map_batches` tasks: each batch's texts
(a text column, or prompt + completion) are tokenized with the base model's tokenizer, joined
with its end-of-sequence token and cut into blocks of `seq_len` tokens; a batch's last partial
block is dropped. Each block carries an id (a hash of its tokens), so that a resumed run can
count the blocks it trains on twice.

`pack_files` reads the parquet files itself (pyarrow, chunk by chunk) from a dataset of their
paths: Ray 2.60's `read_parquet` lists files by starting 32 footer-reading actors on every
execution (RAY_DATA_PARQUET_FOOTER_NUM_ACTORS), 14 s on two busy CPUs for a handful of files."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from prefect_ray_lifecycle.workloads.llm.models import ModelLocation, local_model

__all__ = ["BLOCK_ID", "INPUT_IDS", "PATH", "block_ids", "pack_batch", "pack_files", "pack_ids"]

PATH = "path"

INPUT_IDS = "input_ids"
BLOCK_ID = "block_id"


@functools.lru_cache(maxsize=4)
def _tokenizer(location_json: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(local_model(ModelLocation.model_validate_json(location_json)))
    )


def pack_ids(sequences: list[list[int]], eos_id: int, seq_len: int) -> np.ndarray:
    """Token sequences joined, each ended by `eos_id`, cut into rows of `seq_len`."""
    stream = [token for sequence in sequences for token in (*sequence, eos_id)]
    rows = len(stream) // seq_len
    return np.asarray(stream[: rows * seq_len], dtype=np.int32).reshape(rows, seq_len)


def block_ids(blocks: np.ndarray) -> np.ndarray:
    """A 64-bit id per block from its tokens."""
    return np.asarray(
        [
            int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little") >> 1
            for row in blocks
        ],
        dtype=np.int64,
    )


def _texts(batch: dict[str, Any], layout: str, columns: list[str]) -> list[str]:
    def column(name: str) -> list[str]:
        return ["" if value is None else str(value) for value in batch[name]]

    if layout == "text":
        return column(columns[0])
    prompts, completions = column(columns[0]), column(columns[1])
    return [p + c for p, c in zip(prompts, completions, strict=True)]


def pack_batch(
    batch: dict[str, Any], *, base: str, seq_len: int, layout: str, columns: list[str]
) -> dict[str, np.ndarray]:
    """A Ray Data batch (numpy format) of text rows -> {input_ids: (n, seq_len) int32,
    block_id: (n,) int64}. `base` is the ModelLocation as JSON (hashable for the cache)."""
    tokenizer = _tokenizer(base)
    encoded = tokenizer(_texts(batch, layout, columns), add_special_tokens=False)["input_ids"]
    blocks = pack_ids(encoded, tokenizer.eos_token_id, seq_len)
    return {INPUT_IDS: blocks, BLOCK_ID: block_ids(blocks)}


def pack_files(
    batch: dict[str, Any],
    *,
    folder: str,
    base: str,
    seq_len: int,
    layout: str,
    columns: list[str],
    chunk_rows: int,
) -> Iterator[dict[str, np.ndarray]]:
    """A Ray Data batch of parquet file paths (on `folder`'s filesystem: a path or a pyarrow
    URI) -> their texts as blocks, `chunk_rows` rows packed together at a time."""
    import pyarrow.parquet as pq

    from prefect_ray_lifecycle.workloads.data.source import filesystem_and_path

    filesystem, _ = filesystem_and_path(folder)
    for path in batch[PATH]:
        with filesystem.open_input_file(str(path)) as stream:
            for chunk in pq.ParquetFile(stream).iter_batches(chunk_rows, columns=columns):
                rows = {name: chunk.column(name).to_pylist() for name in columns}
                yield pack_batch(rows, base=base, seq_len=seq_len, layout=layout, columns=columns)
