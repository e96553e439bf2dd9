"""What Tune wrote of a trial: its reports, one JSON object a line in the trial's result.json."""

from __future__ import annotations

import json
from pathlib import Path


def result_lines(trial_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]
