"""The train/eval split: which split a key belongs to, and the split column the pipeline's
batches carry to the writer (eval rows first in each batch, so each split is a run of rows)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SPLIT_COLUMN = "split"
SPLITS = ("train", "eval")
# Hash space for the split: a key goes to eval when its hash falls below ratio * this.
SPLIT_BUCKETS = 2**32


def in_eval(keys: pa.Array | pa.ChunkedArray, eval_fraction: float) -> np.ndarray:
    """True for the keys that go to eval, from a hash of the key: stable across runs, batches,
    processes and machines (pandas' hash_array is seeded with a fixed key). Integer keys hash
    as int64 (fast, vectorised); others hash as their text; null keys hash like 0 or ''."""
    # pandas only inside Ray Data workers: the flow process plans without loading it.
    import pandas as pd

    if pa.types.is_integer(keys.type):
        values = pc.fill_null(keys.cast(pa.int64()), 0).to_numpy()
    else:
        values = (
            pc.fill_null(pc.cast(keys, pa.string()), "")
            .to_numpy(zero_copy_only=False)
            .astype(object)
        )
    return pd.util.hash_array(values) % SPLIT_BUCKETS < eval_fraction * SPLIT_BUCKETS


def split_of(keys: pa.Array | pa.ChunkedArray, eval_fraction: float) -> pa.Array:
    """'train' or 'eval' per key (see in_eval)."""
    return pc.if_else(pa.array(in_eval(keys, eval_fraction), pa.bool_()), SPLITS[1], SPLITS[0])


def split_labels(is_eval: np.ndarray) -> pa.DictionaryArray:
    """The split column for rows flagged eval or not: indices into SPLITS."""
    return pa.DictionaryArray.from_arrays(pa.array(is_eval.astype(np.int8)), pa.array(SPLITS))


def split_runs(table: pa.Table) -> Iterator[tuple[str, pa.Table]]:
    """(split, rows) for each run of rows of one split, without the split column: slices of
    `table`, nothing copied. A table without the column is all train."""
    if SPLIT_COLUMN not in table.column_names or table.num_rows == 0:
        yield SPLITS[0], table
        return
    column = table[SPLIT_COLUMN]
    data = table.drop_columns([SPLIT_COLUMN])
    flags = np.concatenate([_eval_flags(chunk) for chunk in column.chunks if len(chunk)])
    bounds = np.concatenate([[0], np.flatnonzero(flags[1:] != flags[:-1]) + 1, [len(flags)]])
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        yield SPLITS[int(flags[start])], data.slice(int(start), int(end - start))


def _eval_flags(chunk: pa.Array) -> np.ndarray:
    if pa.types.is_dictionary(chunk.type):  # as split_labels made it: indices into SPLITS
        names = np.array([v == SPLITS[1] for v in chunk.dictionary.to_pylist()], dtype=bool)
        return names[chunk.indices.to_numpy(zero_copy_only=False)]
    return pc.equal(chunk, SPLITS[1]).to_numpy(zero_copy_only=False)  # decoded on the way
