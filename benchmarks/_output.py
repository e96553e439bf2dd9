"""The one JSON line a benchmark ends with."""

from __future__ import annotations

import json
import math


def strict_json(figures: dict) -> str:
    """JSON without NaN (not JSON; Python's json writes it): a figure of a side not run,
    NaN in the arithmetic, is null."""

    def clean(value):
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(figures), allow_nan=False)
