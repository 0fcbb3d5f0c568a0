"""``distributed(nprocs)``: run a test body on local gloo processes forming a real mesh.

Built on ``fpar.launch``: the decorated function is found again in each process by its module
and name (the decorator replaces the module attribute, so the original cannot be pickled by
reference), and run there with the default process group up.  A watchdog in each process
(``faulthandler.dump_traceback_later``) stops a body that hangs anywhere, even in a C call holding
the GIL, and leaves its stack in a file the parent shows.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable

__all__ = ["distributed"]


def distributed(
    nprocs: int, timeout: float = 120
) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """Decorate a function so that calling it runs its body on ``nprocs`` local gloo processes.

    Inside the body ``fpar.make_mesh`` builds a real mesh (one process per device).  The
    function must be defined at the top level of an importable module (a pytest file is).  If
    any process raises, the call fails in the parent with ``fpar.LaunchError`` naming the rank
    and showing its traceback; if the body has not finished on every process after ``timeout``
    seconds, every process is stopped and the call fails with ``TimeoutError`` showing where each
    one was.  No process outlives the call.

    A test decorated this way takes no arguments.  A helper may take some: the call's
    arguments (picklable, e.g. drawn by hypothesis in the parent) are passed to the body on
    every process, so every rank runs the same example, and the call returns rank 0's result
    (``None`` for a body that returns nothing, as a test's must).  The decorator may also be
    applied where it is called, ``distributed(n)(fn)(*args)``, to a module-level ``fn``.

    Args:
      nprocs: the number of processes (the mesh's device count).
      timeout: seconds the body may run, on every process together.

    Example:
      >>> @fpar.testing.distributed(2)
      ... def test_row_parallel():
      ...     mesh = fpar.make_mesh((2,), ("tensor",))
      ...     fpar.testing.assert_equivalent(torch.matmul, row_parallel, mesh,
      ...                                    (P(None, "tensor"), P("tensor")), P(), x, w)
      >>> def sum_of_ranks(scale):           # module level; arguments from the parent
      ...     mesh = fpar.make_mesh((2,), ("data",))
      ...     ones = fpar.device_put(torch.ones(2), mesh, P("data"))
      ...     return float(fpar.shard(lambda x: fpar.psum(x * scale, "data"), mesh, P("data"), P())(ones))
      >>> fpar.testing.distributed(2)(sum_of_ranks)(3.0)   # rank 0's result
      6.0
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"fpar.testing.distributed: nprocs must be a positive int, got {nprocs!r}.")
    if not timeout > 0:
        raise ValueError(f"fpar.testing.distributed: timeout must be positive seconds, got {timeout!r}.")

    def decorate(fn: Callable[..., object]) -> Callable[..., object]:
        if "<locals>" in fn.__qualname__:
            raise TypeError(
                f"fpar.testing.distributed: {fn.__qualname__} is defined inside a function; define "
                f"it at the top level of a module so each process can import it."
            )
        module = sys.modules.get(fn.__module__)
        source = getattr(module, "__file__", None)

        @functools.wraps(fn)
        def run(*args: object, **kwargs: object) -> object:
            from .._dist import LaunchError, launch

            with tempfile.TemporaryDirectory(prefix="fpar-distributed-") as tmp:
                start = time.monotonic()
                try:
                    results = launch(
                        _body,
                        nprocs,
                        fn.__module__,
                        fn.__qualname__,
                        source,
                        timeout,
                        tmp,
                        args,
                        kwargs,
                        timeout=timeout,
                    )
                except LaunchError as e:
                    stacks = _stacks(tmp, nprocs)
                    if stacks:
                        raise TimeoutError(
                            f"fpar.testing.distributed({fn.__qualname__}): the body did not finish "
                            f"within {timeout:g}s on {nprocs} processes (ran {time.monotonic() - start:.0f}s); "
                            f"every process was stopped. Where each one was:\n{stacks}"
                        ) from None
                    raise LaunchError(f"fpar.testing.distributed({fn.__qualname__}): {e}") from None
            return results[0]

        run.__wrapped_body__ = fn  # found by the processes, which import the module again
        return run

    return decorate


def _body(
    module_name: str,
    qualname: str,
    source: str | None,
    timeout: float,
    tmp: str,
    args: tuple = (),
    kwargs: dict | None = None,
) -> object:
    """Runs in each process: arm the watchdog, find the undecorated function, call it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    stack_file = open(os.path.join(tmp, f"rank{rank}.stack"), "w")  # noqa: SIM115 - open until exit
    faulthandler.dump_traceback_later(timeout, exit=True, file=stack_file)
    try:
        return _find(module_name, qualname, source)(*args, **(kwargs or {}))
    finally:
        faulthandler.cancel_dump_traceback_later()
        stack_file.close()
        os.remove(stack_file.name)


def _find(module_name: str, qualname: str, source: str | None) -> Callable:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if source is None:
            raise
        spec = importlib.util.spec_from_file_location(module_name, source)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped_body__", obj)


def _stacks(tmp: str, nprocs: int) -> str:
    """The watchdog's dumps of the processes that timed out, or '' if none did."""
    out = []
    for r in range(nprocs):
        path = os.path.join(tmp, f"rank{r}.stack")
        if os.path.exists(path):
            with open(path) as f:
                text = f.read().strip()
            if text:
                out.append(f"--- rank {r} ---\n{text}")
    return "\n".join(out)
