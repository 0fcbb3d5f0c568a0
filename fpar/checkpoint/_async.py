"""Saves that do not stop the step: a snapshot in host memory, written by a background thread.

``save(..., blocking=False)`` checks the tree and agrees with the other processes on the calling
thread (one tiny all-gather, as a blocking save's first), copies this process's blocks to host
memory, and returns a ``PendingSave``; a thread then writes the blocks and commits.  The thread
never calls a collective on the training's process groups (gloo collectives from two threads on
one group are unsafe): on a real mesh it uses a gloo group of its own over every process, made
once by the first background save (``side_group``), for two tiny all-gathers:

1. every process writes its block file (atomically: temporary name, fsync, rename), then they
   all-gather whether each write succeeded;
2. if all did, process 0 writes ``metadata.json``: the commit, the moment the checkpoint becomes
   the latest one (``latest_step``, ``load``), then removes older files and steps (``keep=``);
   the processes all-gather whether the commit succeeded, so ``wait()`` returns on every
   process after the commit (and its clean-up), and raises on every process if it failed.

A process that dies makes the others' all-gather fail (its sockets close) instead of waiting,
and the save is not committed: the previous checkpoint stays the latest.  The next ``save``
(blocking or not) first waits for this one and raises its error on every process, through its
agreement; ``wait()`` raises it too.  At exit the process waits for its save (``atexit``).
Every process starts a newer save only after the older one's commit and clean-up, so no
clean-up ever removes a save being written.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable

__all__ = ["COMMIT_TIMEOUT", "PendingSave", "agree", "settle", "side_group", "start", "wait"]

COMMIT_TIMEOUT = 1800.0  # the side group's timeout (torch's default): a process that hangs, not dies


class PendingSave:
    """A checkpoint being written in the background by ``fpar.checkpoint.save(..., blocking=False)``.

    Attributes:
      path: the checkpoint directory being written.
    """

    def __init__(self, path: str, work: Callable[[], None]):
        self.path = path
        self._error: BaseException | None = None
        self._reported = False
        # a daemon: the interpreter would join a plain thread before atexit runs; _at_exit waits
        self._thread = threading.Thread(target=self._run, args=(work,), name="fpar-checkpoint", daemon=True)
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
          Exception: the background write's error, once (later calls return quietly), e.g. a
            ``CheckpointError`` when another process failed before the commit, or the side
            group's error when one died.
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

    Raises:
      Exception: the background save's error (see ``PendingSave.wait``).
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


# The agreement of a background save (its own gloo group) ------------------------------------------

_side: list = [None, None]  # (the default group it was made under, the side group)


def side_group():
    """The gloo group over every process that background saves agree on (made once, on the calling thread).

    Every process makes it at the same point (its first ``save(..., blocking=False)``), as
    ``torch.distributed.new_group`` requires; a new default group (a re-initialised job) gets a
    new one.
    """
    import datetime

    import torch.distributed as dist

    if _side[0] is not dist.group.WORLD:
        timeout = datetime.timedelta(seconds=COMMIT_TIMEOUT)
        _side[:] = [dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout)]
    return _side[1]


def agree(group, proc: int, err: BaseException | None, what: str, where: str) -> None:
    """All-gather over ``group`` whether each process's ``what`` succeeded; raise on every process if not."""
    import torch
    import torch.distributed as dist

    from ._format import CheckpointError

    mine = torch.tensor([proc, 0 if err is None else 1], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if err is not None:
        raise err
    failed = sorted(int(t[0]) for t in every if int(t[1]))
    if failed:
        raise CheckpointError(
            f"fpar.checkpoint.save({where!r}): process {failed[0]} failed in its {what} (its own error says "
            f"why); the save was not committed and the previous checkpoint stays the latest."
        )
