"""Starting the processes of a real mesh: ``init_distributed`` (torchrun) and ``launch`` (local)."""

from __future__ import annotations

import datetime
import gc
import io
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import pending
from .groups import is_initialized


def init_distributed(*, backend: str | None = None, timeout: float = 600.0) -> None:
    """Initialise the default process group from torchrun's environment, if not already up.

    Args:
      backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is available, else gloo.
      timeout: seconds a collective may wait for the other ranks before raising, instead of
        hanging when one of them has failed.
    """
    if is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    wait = datetime.timedelta(seconds=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=wait)
        _connected()
        return
    # Under torchrun, each attempt's process groups keep their keys apart in the agent's store,
    # which outlives a restart (--max-restarts): with the same keys a restarted rank reads a dead
    # rank's address and gloo's connect times out (torch 2.13 and 2.14, plain torch alike).
    store, rank, world = next(dist.rendezvous("env://", timeout=wait))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"fpar/attempt{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=wait,
    )
    _connected()


def _connected() -> None:
    """Return only once every rank's gloo group is connected.

    Building a gloo group is not a synchronisation point: a rank whose side of every connection
    is up returns while a peer may still be reading that connection's handshake.  If the first
    rank then runs out of work and exits (a function with no collective, a rank with nothing to
    do), its peer's constructor fails with "connectFullMesh failed ... Connection closed by
    peer" (1 launch in 400 of a function with no collective, on 2 busy cores).  A barrier ends on
    a rank only after each other rank sent its part, which it does after its constructor returned.
    NCCL connects lazily, at the first collective, and needs no such barrier.
    """
    if dist.get_backend() == "gloo":
        dist.barrier()


class LaunchError(RuntimeError):
    """A process started by ``fpar.launch`` failed; the others were stopped."""


def launch(fn: Callable, nprocs: int, *args: Any, timeout: float = 60.0, backend: str = "gloo") -> list:
    """Run ``fn(*args)`` on ``nprocs`` local processes forming a real mesh; return their results.

    For notebooks and tests: no torchrun needed.  Each process joins a process group on
    127.0.0.1 (gloo by default), so ``fpar.make_mesh`` inside ``fn`` builds a real mesh.  If any
    process raises or dies, the others are stopped and ``LaunchError`` names the rank and shows
    its traceback; a collective that waits longer than ``timeout`` seconds raises instead of
    hanging.  On Linux the processes fork from a server that imported torch and fpar once
    (``_context``); each gets the caller's ``sys.path``, environment and directory.

    Args:
      fn: a picklable (module-level) function.
      nprocs: number of processes.
      *args: picklable arguments for ``fn``.
      timeout: seconds before a stuck collective (or the whole run, plus a margin) fails.
      backend: the process-group backend.

    Returns:
      ``[fn's result on rank 0, on rank 1, ...]``.

    Raises:
      LaunchError: a process raised or exited without a result.
    """
    import queue as queue_mod
    import tempfile
    import time

    if nprocs < 1:
        raise ValueError(f"fpar.launch: nprocs must be at least 1, got {nprocs}.")
    _check_launchable(fn)
    ctx, forked = _context(fn, backend)
    if (
        forked
    ):  # the function and its arguments travel pickled, unpickled once the environment is the caller's
        target, head = _forked_worker, (pickle.dumps((fn, args)), dict(os.environ))
    else:
        target, head = _worker, (fn, args)
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fpar-launch-") as tmp:
        q = ctx.Queue()
        procs = [
            ctx.Process(
                target=target,
                args=(*head, r, nprocs, os.path.join(tmp, "store"), timeout, backend, q),
                daemon=True,
            )
            for r in range(nprocs)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout + 60.0
        try:
            while len(results) < nprocs:
                try:
                    r, ok, payload = q.get(timeout=0.2)
                except queue_mod.Empty:
                    dead = [
                        i for i, p in enumerate(procs) if i not in results and p.exitcode not in (None, 0)
                    ]
                    if dead:
                        raise LaunchError(
                            f"fpar.launch: rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                            f"without a result; the other ranks were stopped."
                        ) from None
                    if time.monotonic() > deadline:
                        raise LaunchError(
                            f"fpar.launch: no result after {timeout + 60:.0f}s from ranks "
                            f"{sorted(set(range(nprocs)) - set(results))}; stopped all ranks."
                        ) from None
                    continue
                if not ok:
                    raise LaunchError(_blame(procs, results, r, payload))
                results[r] = torch.load(io.BytesIO(payload), weights_only=False)
            # Every rank has delivered: let each tear its process group down and exit by itself
            # (stopping one mid-teardown can abort it while gloo's threads are still running).
            exit_by = time.monotonic() + 30.0
            for p in procs:
                p.join(timeout=max(0.0, exit_by - time.monotonic()))
            bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if bad:
                raise LaunchError(
                    f"fpar.launch: rank {bad[0][0]} delivered its result but then exited with code "
                    f"{bad[0][1]} (a crash while shutting down)."
                )
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
            q.close()
    return [results[r] for r in range(nprocs)]


def _context(fn: Callable, backend: str):
    """The multiprocessing context of a launch, and whether it forks from a preloaded server.

    On Linux, processes fork from multiprocessing's fork server, which imported torch and fpar
    once: a process starts in a fraction of a second instead of importing torch again (about
    2.5 s for two processes on a 2-core machine, most of a small launch).  The server never
    initialises CUDA or a process group, so a forked process is as clean as a spawned one.  A
    function of the ``__main__`` script, and NCCL (untested here), are spawned as before; so is
    every launch after the caller changed a variable Python reads only when it starts
    (``_AT_START``: a forked process has the server's hash seed whatever ``PYTHONHASHSEED`` says).
    """
    import multiprocessing as mp

    if sys.platform != "linux" or backend == "nccl" or getattr(fn, "__module__", None) == "__main__":
        return mp.get_context("spawn"), False
    at_start = {k: os.environ.get(k) for k in _AT_START}
    if _PRELOADED and _PRELOADED[0] != at_start:
        return mp.get_context("spawn"), False
    ctx = mp.get_context("forkserver")
    if not _PRELOADED:
        # before the server starts; torch._dynamo too: a process that compiles then starts 2.3 s
        # sooner (its import), one that does not 0.05 s later
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "fpar"])
        _PRELOADED.append(at_start)  # the server starts with this environment
    return ctx, True


_PRELOADED: list = []
# Read by the interpreter once, when it starts: a forked process keeps the fork server's.
_AT_START = ("PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONWARNINGS", "PYTHONMALLOC")


def _forked_worker(payload: bytes, env: dict, rank_: int, *rest) -> None:
    """A forked process: the caller's environment, then ``_worker``.

    multiprocessing gives it the caller's ``sys.path`` and working directory, but the environment
    is the fork server's, fixed when it started; the caller may have changed it since.
    """
    os.environ.clear()
    os.environ.update(env)
    # What the server imported (torch, fpar and their modules) is never garbage: frozen, every
    # collection from here on, fpar's at the end and Python's own full ones, scans only what this
    # process makes (0.1-0.2 s a collection of the whole heap). Before unpickling ``fn``'s
    # arguments, so that cycles among them are collected as ever.
    gc.freeze()
    try:
        fn, args = pickle.loads(payload)
    except BaseException:
        rest[-1].put((rank_, False, traceback.format_exc()))
        return
    _worker(fn, args, rank_, *rest)


def _check_launchable(fn: Callable) -> None:
    """Refuse, with the fix, what a spawned process could not run (before starting any)."""
    import multiprocessing as mp
    import sys

    if mp.parent_process() is not None:
        raise RuntimeError(
            "fpar.launch was called while a process it started was importing your script: the "
            "script calls fpar.launch at import time. Put the call under "
            '`if __name__ == "__main__":` (each process re-imports the script to find fn).'
        )
    name = getattr(fn, "__qualname__", "")
    if not callable(fn):
        raise TypeError(f"fpar.launch: fn must be a function, got {fn!r}.")
    if "<lambda>" in name or "<locals>" in name:
        raise TypeError(
            f"fpar.launch: fn {name!r} is a lambda or a function defined inside another function; the "
            f"processes are spawned and must import fn by name. Define it at the top level of a "
            f'module (or of the script, under an `if __name__ == "__main__":` guard) and pass '
            f"its arguments through *args."
        )
    if getattr(fn, "__module__", None) == "__main__":
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        if path is None:
            raise TypeError(
                f"fpar.launch: fn {name!r} is defined in an interactive session (__main__ has no "
                f"file), which spawned processes cannot import. Put it in a module file and import it."
            )
        try:
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
        except OSError:
            return
        if "__main__" not in source:
            raise RuntimeError(
                f'fpar.launch: {path} calls fpar.launch without an `if __name__ == "__main__":` '
                f"guard. Each spawned process re-imports the script to find {name!r}, and would "
                f"launch again. Put the script's top-level code under that guard."
            )


def _blame(procs, results: dict, r: int, payload: str) -> str:
    """The message for a failed launch, naming the rank that failed first.

    When a rank dies without a result (killed, ``os._exit``), its neighbours then fail in a
    collective ("connection reset") and may report first; wait a moment for the dead rank's exit
    code, and blame it.
    """
    import time

    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        dead = [i for i, p in enumerate(procs) if i not in results and i != r and p.exitcode not in (None, 0)]
        if dead:
            return (
                f"fpar.launch: rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a "
                f"result; the other ranks were stopped. Rank {r} then raised:\n{payload}"
            )
        time.sleep(0.05)
    return f"fpar.launch: rank {r} raised; the other ranks were stopped.\n{payload}"


def _worker(fn, args, rank_: int, world: int, store_path: str, timeout: float, backend: str, q) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    os.environ.update(RANK=str(rank_), WORLD_SIZE=str(world), LOCAL_RANK=str(rank_))
    torch.set_num_threads(1)  # several processes share the cores
    try:
        if backend == "nccl":  # one GPU per local rank, before any CUDA tensor exists
            torch.cuda.set_device(rank_ % torch.cuda.device_count())
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=rank_, world_size=world, timeout=datetime.timedelta(seconds=timeout)
        )
        _connected()
        result = fn(*args)
        pending.settle()  # a check still in flight raises here, as a failure of this rank
        buf = io.BytesIO()
        torch.save(result, buf)
        q.put((rank_, True, buf.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        q.put((rank_, False, traceback.format_exc()))
    finally:
        # Drop what still holds collectives' work handles (an unfinished backward's buckets, a
        # traceback's frames) while their process group is alive, then tear it down: no handle
        # outlives its group into interpreter exit.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
