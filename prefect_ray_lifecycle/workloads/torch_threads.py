"""torch's intra-op threads held to a few for a while, in the process that evaluates."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(count: int = 1) -> Iterator[None]:
    """torch on `count` threads for a while (then as it was). A small model's forward pass is
    a few small matrices: with torch's default of a thread per core, each op waits until every
    one of its threads gets a core, so on a busy machine 5 greedy CartPole episodes took 129 s
    (22 s of CPU, spinning) where one thread took 2.3 s (2 cores, a test suite beside it).
    Ray workers already get OMP_NUM_THREADS from their num_cpus; a flow's own process does
    not."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
