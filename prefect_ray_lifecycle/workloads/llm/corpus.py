"""Generated fine-tune corpora with a pattern the tiny Llama (workloads.llm.tiny) can learn on
two CPUs: prompts whose answer follows from the prompt, so a held-out prompt has one right
answer that greedy decoding can be scored against (exact match, the next issue's evaluation).

Templates (`TASKS`), each a prompt and a completion:
- "count": `<noise words>: count on from k` -> ` l m n` (the next three letters of LETTERS,
  or the next three numbers). Each answer token follows from the token before it, which the
  tiny model learns in about 100 steps of 16 x 128 tokens (measured on one CPU thread in 6 s:
  greedy exact match on 50 of 50 held-out prompts, training loss 6.9 -> 1.0; what remains
  is the noise words, drawn at random).
- "copy" and "reverse": `<noise>: copy k a m` -> ` k a m` (or reversed). They need attention
  across the prompt, which the tiny model does not learn in minutes (measured: copy 0 of 50
  after 2500 steps): there for larger bases, and as a negative control.

Noise words vary the prompt so that held-out prompts are new text: training prompts carry 1
to 4 noise words, held-out prompts (`held_out=True`) carry 5, so no held-out prompt is ever
a training prompt. Rows are written as JSON lines or parquet, as {id, prompt, completion} or
{id, text}, ready for the data-prep flow (split_key "id").
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "HELD_OUT_NOISE_WORDS",
    "LETTERS",
    "TASKS",
    "TRAIN_NOISE_WORDS",
    "Example",
    "examples",
    "write_corpus",
]

# Single tokens of the tiny Llama's BPE when preceded by a space (" k"), as are 10..99.
LETTERS = tuple("bcdfghklmnprstvwz")
NOISE = (
    "ray serve flow task model version canary router replica token prompt champion "
    "challenger rollout health latency batch cluster policy checkpoint metric"
).split()
TRAIN_NOISE_WORDS = (1, 4)
HELD_OUT_NOISE_WORDS = 5
COUNT_STEPS = 3
Layout = Literal["prompt_completion", "text"]
Format = Literal["jsonl", "parquet"]


@dataclass(frozen=True)
class Example:
    """One templated prompt and the completion that follows from it."""

    task: str
    prompt: str
    completion: str

    @property
    def text(self) -> str:
        return self.prompt + self.completion


def _noise(rng: random.Random, held_out: bool) -> str:
    count = HELD_OUT_NOISE_WORDS if held_out else rng.randint(*TRAIN_NOISE_WORDS)
    return " ".join(rng.choice(NOISE) for _ in range(count))


def _count(rng: random.Random, held_out: bool) -> Example:
    noise = _noise(rng, held_out)
    if rng.random() < 0.5:
        start = rng.randrange(len(LETTERS))
        answer = [LETTERS[(start + k) % len(LETTERS)] for k in range(1, COUNT_STEPS + 1)]
        return Example("count", f"{noise}: count on from {LETTERS[start]}", _spaced(answer))
    number = rng.randrange(10, 100 - COUNT_STEPS)
    answer = [str(number + k) for k in range(1, COUNT_STEPS + 1)]
    return Example("count", f"{noise}: count on from {number}", _spaced(answer))


def _letters(rng: random.Random) -> list[str]:
    return [rng.choice(LETTERS) for _ in range(rng.randint(3, 5))]


def _copy(rng: random.Random, held_out: bool) -> Example:
    word = _letters(rng)
    return Example("copy", f"{_noise(rng, held_out)}: copy {' '.join(word)}", _spaced(word))


def _reverse(rng: random.Random, held_out: bool) -> Example:
    word = _letters(rng)
    return Example(
        "reverse", f"{_noise(rng, held_out)}: reverse {' '.join(word)}", _spaced(word[::-1])
    )


def _spaced(tokens: Sequence[str]) -> str:
    return "".join(f" {t}" for t in tokens)


TASKS: dict[str, Callable[[random.Random, bool], Example]] = {
    "count": _count,
    "copy": _copy,
    "reverse": _reverse,
}


def examples(
    n: int, seed: int = 0, tasks: Sequence[str] = ("count",), held_out: bool = False
) -> list[Example]:
    """`n` examples drawn from `tasks` in turn, the same for the same seed."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise ValueError(f"tasks must be some of {sorted(TASKS)}, got {list(tasks)}")
    rng = random.Random(f"{seed}-{'held-out' if held_out else 'train'}")
    return [TASKS[tasks[i % len(tasks)]](rng, held_out) for i in range(n)]


def _row(index: int, example: Example, layout: Layout) -> dict[str, str]:
    if layout == "text":
        return {"id": f"ex-{index:07d}", "text": example.text}
    return {"id": f"ex-{index:07d}", "prompt": example.prompt, "completion": example.completion}


def write_corpus(
    folder: str | Path,
    n: int,
    seed: int = 0,
    tasks: Sequence[str] = ("count",),
    layout: Layout = "prompt_completion",
    fmt: Format = "jsonl",
    files: int = 2,
) -> list[Path]:
    """Write `n` training examples as `files` files of JSON lines or parquet under `folder`
    (created); returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [_row(i, e, layout) for i, e in enumerate(examples(n, seed, tasks))]
    paths = []
    for part in range(files):
        chunk = rows[part::files]
        path = folder / f"part-{part:03d}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps(row) + "\n" for row in chunk))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(chunk), path)
        paths.append(path)
    return paths
