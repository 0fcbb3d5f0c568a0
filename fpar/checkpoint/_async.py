"""Saves that do not stop the step: a snapshot in host memory, written by a background thread.

``save(..., blocking=False)`` checks the tree and agrees with the other processes on the calling
thread (one tiny all-gather, as a blocking save's first), copies this process's blocks to host
memory, and returns a ``PendingSave``; a thread then writes the blocks and commits.  The thread
never calls a collective: gloo collectives from two threads on one process group are unsafe, so
the processes agree through the shared filesystem alone:

1. every process writes its block file ``g<gen>-p<proc>.safetensors`` (atomically: temporary
   name, fsync, rename), so the file's existence is its marker;
2. process 0 waits until every block file the save names exists (the list follows from the
   specs and the mesh), then writes ``metadata.json``: the commit, the moment the checkpoint
   becomes the latest one (``latest_step``, ``load``); it then removes older files and steps;
3. every other process waits until ``metadata.json`` names this save's generation.

A process whose write fails writes ``g<gen>-p<proc>.failed`` instead, so the others stop waiting
and fail too; a process that dies leaves the save uncommitted and the others give up after
``COMMIT_TIMEOUT`` seconds.  Either way the previous checkpoint stays the latest.  The next
``save`` (blocking or not) first waits for this one and raises its error on every process,
through its agreement; ``wait()`` raises it too.  At exit the process waits for its save.

Process 0 enters the next save's agreement only after its commit (and the clean-up that follows
it), so no process starts writing a newer save while an older one's clean-up runs.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable

from . import _io

__all__ = ["COMMIT_TIMEOUT", "PendingSave", "settle", "start", "wait"]

COMMIT_TIMEOUT = 1800.0  # seconds a process waits for the others' files (torch's default group timeout)


class PendingSave:
    """A checkpoint being written in the background by ``fpar.checkpoint.save(..., blocking=False)``.

    Attributes:
      path: the checkpoint directory being written.
    """

    def __init__(self, path: str, work: Callable[[], None]):
        self.path = path
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._run, args=(work,), name="fpar-checkpoint", daemon=False)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # kept for the caller: raised by wait() or the next save
            self._error = e

    def done(self) -> bool:
        """Whether the background write has ended (committed, or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Block until the checkpoint is committed; return its directory.

        Raises:
          the background write's error (once; later calls return quietly), e.g. a
          ``CheckpointError`` when another process failed or died before the commit.
        """
        self._thread.join()
        with _lock:
            if self in _pending:
                _pending.remove(self)
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"PendingSave({self.path!r}, {state})"


_lock = threading.Lock()
_pending: list[PendingSave] = []  # this process's background save, at most one
_hooked = [False]


def start(path: str, work: Callable[[], None]) -> PendingSave:
    """Run ``work`` (write, then commit) in a background thread; the process waits for it at exit."""
    with _lock:
        if not _hooked[0]:
            atexit.register(_at_exit)
            _hooked[0] = True
        handle = PendingSave(path, work)
        _pending[:] = [handle]
    return handle


def settle() -> BaseException | None:
    """Wait for this process's background save; return its error (reported once) instead of raising it."""
    with _lock:
        handle = _pending[-1] if _pending else None
    if handle is None:
        return None
    try:
        handle.wait()
    except BaseException as e:
        return e
    return None


def wait() -> str | None:
    """Wait until this process's background save (if any) has committed; raise its error.

    Returns:
      The directory of the checkpoint waited for, or ``None`` if none was being written.
    """
    with _lock:
        handle = _pending[-1] if _pending else None
    return None if handle is None else handle.wait()


def _at_exit() -> None:
    try:
        wait()
    except BaseException as e:  # never lost: the interpreter is exiting, so say it on stderr
        print(
            f"fpar.checkpoint: the background save failed at exit: {type(e).__name__}: {e}", file=sys.stderr
        )


# The filesystem agreement ---------------------------------------------------------------------------


def wait_for_files(target: str, files: set[str], gen: int, timeout: float) -> None:
    """Process 0: wait until every block file of save ``gen`` exists in ``target``, or fail."""
    _poll(target, gen, timeout, lambda: files.issubset(_names(target)), f"the block files {sorted(files)}")


def wait_for_commit(target: str, gen: int, timeout: float) -> None:
    """Every other process: wait until ``metadata.json`` in ``target`` names generation ``gen``."""
    _poll(target, gen, timeout, lambda: _io.committed_generation(target) == gen, "process 0's commit")


def _poll(target: str, gen: int, timeout: float, ready: Callable[[], bool], what: str) -> None:
    from ._format import CheckpointError

    deadline, pause = time.monotonic() + timeout, 0.001
    while not ready():
        failed = _io.failures(target, gen)
        if failed:
            proc, message = failed[0]
            raise CheckpointError(
                f"fpar.checkpoint.save({target!r}): process {proc} failed to write its blocks ({message}); "
                f"the save was not committed and the previous checkpoint stays the latest."
            )
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"fpar.checkpoint.save({target!r}): waited {timeout:g} s for {what} of the background save "
                f"(generation {gen}); a process died or stopped before writing. The save was not "
                f"committed and the previous checkpoint stays the latest."
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _names(target: str) -> set[str]:
    try:
        return set(os.listdir(target))
    except FileNotFoundError:
        return set()
