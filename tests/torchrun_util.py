"""What the torchrun tests share: a free port, a launcher's process tree, and killing all of it.

torchrun starts every worker in a session of its own, so killing the launcher's process group
alone would leave the workers running: ``kill_tree`` kills each descendant's group too.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """``pid``'s direct children (from /proc)."""
    return [c for c, p in _parents().items() if p == pid]


def descendants(pid: int) -> list[int]:
    parent = _parents()
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL the launcher ``pid`` and every process below it, with their process groups."""
    for p in [*descendants(pid), pid]:
        try:
            os.killpg(p, signal.SIGKILL)  # p leads its group (the launcher, a worker)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _parents() -> dict[int, int]:
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    return parent
