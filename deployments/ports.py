"""Ports on 127.0.0.1 for the local services and the test stacks: picked free, and claimed
until the process that picked them exits."""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import tempfile
from pathlib import Path

from deployments.processes import process_running

HOST = "127.0.0.1"

# A port picked here stays unbound until its service starts (Serve's proxy binds its port
# only when a test first starts Serve), so nothing else may be handed it meanwhile: not by
# this process (a Ray head's dashboard port, placed at a fixed offset, once landed on the
# Serve port picked before it, and every test after that on the stack failed), nor by another
# one picking ports at the same time (two test workers starting their stacks). A claim is a
# file named after the port, holding the claimant's pid; a dead claimant's claim is void.
PORT_CLAIMS = Path(tempfile.gettempdir()) / "rlt-ports"
_claimed: set[int] = set()


def claim(port: int) -> bool:
    """Claim `port` for this process; False when this or another live process holds it."""
    if port in _claimed:
        return False
    PORT_CLAIMS.mkdir(exist_ok=True)
    path = PORT_CLAIMS / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text() or "0")
            except (OSError, ValueError):
                owner = 0
            if owner == 0 or process_running(owner):  # 0: a claim being written
                return False
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as claim:
            claim.write(str(os.getpid()))
        if not _claimed:
            atexit.register(_release_claims, os.getpid())
        _claimed.add(port)
        return True
    return False


def _release_claims(pid: int) -> None:
    if os.getpid() != pid:  # a forked child inherits the hook, not the claims
        return
    for port in _claimed:
        with contextlib.suppress(OSError):
            if (PORT_CLAIMS / str(port)).read_text() == str(pid):
                (PORT_CLAIMS / str(port)).unlink()


def free_port() -> int:
    """A free port on 127.0.0.1 that nobody else picking ports here has claimed."""
    while True:
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if claim(port):
            return port


def free_ports_besides(taken: set[int], count: int) -> list[int]:
    chosen: list[int] = []
    while len(chosen) < count:
        port = free_port()
        if port not in taken and port not in chosen:
            chosen.append(port)
    return chosen


def free_ports(count: int, spacing: int = 0) -> list[int]:
    """Distinct free ports on 127.0.0.1; with `spacing`, port+spacing is free too (for Ray's
    dashboard, which `Service` places at a fixed offset from the GCS port)."""
    chosen: list[int] = []
    while len(chosen) < count:
        port = free_port()
        if port in chosen or port + spacing > 65535:
            continue
        if spacing and (
            port + spacing in chosen or not port_free(port + spacing) or not claim(port + spacing)
        ):
            continue
        chosen.append(port)
    return chosen


def port_free(port: int) -> bool:
    """Whether `port` on HOST can be bound now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True
