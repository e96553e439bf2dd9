"""Processes by pid, from /proc: whether one runs, when it started, whether a group lives,
what environment it started with. Used to stop only what was started (`deployments.local`,
`deployments.worker_node`), to tell a live port claimant from a dead one (`deployments.ports`),
to tell a flow run's own process from a recycled pid (`deployments.crashes`), and by the tests
that check what a Ray worker or replica was started with."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def process_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` runs (zombies aside)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(proc.name)) == pgid and process_running(int(proc.name)):
                    return True
    return False


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, as text); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (starttime) counted after the parenthesised command name.
    return stat.rsplit(")", 1)[1].split()[19]


def environ(pid: int) -> dict[str, str]:
    """The environment `pid` started with; OSError when it is gone or not ours to read."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.partition("=")[::2] for item in raw.split("\0") if item)
