"""The reference transforms for `data_prep`: byte-level tokenization for language-model data
and numeric feature preparation for tabular data.

A transform is `fn(batch, **kwargs) -> batch`: a pandas DataFrame or a pyarrow Table in,
the same kind out, one output row per input row (data_prep quarantines the rows that make it
raise, so raising on a bad row is the way to reject it). Imports nothing from Prefect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3  # byte b has id b + 3, after the special tokens
DEFAULT_MAX_LENGTH = 512


class ByteTokenizer:
    """A byte-level tokenizer (ids = UTF-8 bytes after three special tokens): nothing to
    download or fit, identical on every machine, lossless for any text."""

    vocab_size = 256 + BYTE_OFFSET

    def __init__(self, max_length: int = DEFAULT_MAX_LENGTH, add_special_tokens: bool = True):
        if max_length < (3 if add_special_tokens else 1):
            raise ValueError(f"max_length {max_length} leaves no room for a token")
        self.max_length = max_length
        self.add_special_tokens = add_special_tokens

    def encode_batch(self, texts: Sequence[str | None]) -> pa.ListArray:
        """Token ids per text, truncated to max_length. Raises ValueError on a null text."""
        body = self.max_length - (2 if self.add_special_tokens else 0)
        encoded = []
        for text in texts:
            if not isinstance(text, str):
                raise ValueError(f"text must be a string, got {type(text).__name__}")
            encoded.append(text.encode("utf-8")[:body])
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
        if self.add_special_tokens:
            lengths = lengths + 2
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            values = np.empty(int(offsets[-1]), dtype=np.int32)
            is_body = np.ones(len(values), dtype=bool)
            is_body[offsets[:-1]] = False
            is_body[offsets[1:] - 1] = False
            values[offsets[:-1]] = BOS_ID
            values[offsets[1:] - 1] = EOS_ID
            values[is_body] = ids
        else:
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            values = ids
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values))

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0].as_py()

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - BYTE_OFFSET for i in ids if i >= BYTE_OFFSET).decode(
            "utf-8", errors="replace"
        )


def _as_table(batch: Any) -> tuple[pa.Table, bool]:
    if isinstance(batch, pa.Table):
        return batch, False
    return pa.Table.from_pandas(batch, preserve_index=False), True


def _like_input(table: pa.Table, was_pandas: bool) -> Any:
    return table.to_pandas() if was_pandas else table


def tokenize_text(
    batch: Any,
    text_column: str = "text",
    max_length: int = DEFAULT_MAX_LENGTH,
    add_special_tokens: bool = True,
) -> Any:
    """Add `input_ids` (byte-level token ids) and `num_tokens` for `text_column`."""
    table, was_pandas = _as_table(batch)
    if text_column not in table.column_names:
        raise KeyError(f"text column {text_column!r} is not in the batch {table.column_names}")
    ids = ByteTokenizer(max_length, add_special_tokens).encode_batch(table[text_column].to_pylist())
    table = table.append_column("input_ids", ids).append_column(
        "num_tokens", pc.list_value_length(ids).cast(pa.int32())
    )
    return _like_input(table, was_pandas)


def prepare_numeric(
    batch: Any,
    columns: Sequence[str],
    log_columns: Sequence[str] = (),
    scale: dict[str, Sequence[float]] | None = None,
    impute: float = 0.0,
) -> Any:
    """Add `features` (float32 list, one slot per column plus one missing-flag per column):
    nulls imputed and flagged, `log_columns` as sign(x)*log1p(|x|), then `scale` as
    {column: [mean, std]}. Raises ValueError on an infinite or NaN value."""
    table, was_pandas = _as_table(batch)
    scale = scale or {}
    unknown = [c for c in (*columns, *log_columns, *scale) if c not in table.column_names]
    if unknown:
        raise KeyError(f"columns {unknown} are not in the batch {table.column_names}")
    slots = []
    missing_flags = []
    for name in columns:
        column = table[name].cast(pa.float64())
        missing = column.is_null().to_numpy(zero_copy_only=False)
        values = column.fill_null(impute).to_numpy(zero_copy_only=False).astype(np.float64)
        if not np.isfinite(values).all():
            bad = values[~np.isfinite(values)][0]
            raise ValueError(f"non-finite value {bad} in column {name!r}")
        if name in log_columns:
            values = np.sign(values) * np.log1p(np.abs(values))
        if name in scale:
            mean, std = scale[name]
            values = (values - mean) / (std or 1.0)
        slots.append(values.astype(np.float32))
        missing_flags.append(missing.astype(np.float32))
    matrix = (
        np.stack(slots + missing_flags, axis=1)
        if slots
        else np.zeros((table.num_rows, 0), np.float32)
    )
    width = matrix.shape[1]
    features = pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), width)
    return _like_input(table.append_column("features", features), was_pandas)
