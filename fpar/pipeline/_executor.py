"""Run a schedule: a driver outside ``fpar.shard`` that calls each stage's compute per action.

A per-device SPMD program cannot run different actions on different devices in the same tick,
so the executor drives the pipeline from Python.  Each stage's compute is a function of its
chunk's parameters and one microbatch's activation, typically ``fpar.shard(f,
mesh.submesh(other_axes), ...)``, which brings tensor and data parallelism inside the stage for
free.  One stage's work (forward, B, W, BW) is ``_stage``; the weight-gradient split is ``_split``.

* In-process (``mesh.backend == "local"``, ``_run_local``) the driver loops over ticks and,
  within a tick, over stages; a send hands the tensor to the receiving stage's inbox.
* On a real mesh (``_run_dist``) every rank runs only its own stage's actions and posts that
  tick's sends and receives along the pipe axis without waiting.

Both run exactly the schedule's ticks and report what they ran (``Timeline``): compute ticks
per stage, the peak number of stashed microbatch-chunks (counted on the live stash, not taken
from the schedule), the peak inbox, and measured seconds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._mesh import Mesh
from .._tree import tree_flatten, tree_unflatten
from ._run_dist import DistDriver
from ._run_local import LocalDriver
from ._schedule import Schedule
from ._stage import Fns, StepResult
from ._unreduced import Unreduced
from ._validate import validate

__all__ = ["StepResult", "pipeline"]

Tensor = torch.Tensor
PARAM_KEYS = ("stages", "first", "last")


# API ----------------------------------------------------------------------------------------


def pipeline(
    stage: Callable | Sequence[Callable],
    schedule: Schedule,
    mesh: Mesh,
    *,
    loss: Callable,
    first: Callable | None = None,
    axis: str = "pipe",
    tied: Sequence[tuple[str, str]] | None = None,
) -> Callable[..., StepResult]:
    """Build a training step that runs ``schedule`` over the ``axis`` stages of ``mesh``.

    The model is ``first``, then chunks ``0 .. p v - 1`` of ``stage`` (chunk ``k`` on stage
    ``k % p``), then ``loss``; the step returns the mean loss over the microbatches and its
    gradient, equal to the unpipelined model's.  Stages compose with data and tensor
    parallelism over the other mesh axes: make each function a ``fpar.shard`` over
    ``mesh.submesh(other_axes)``.

    Args:
      stage: ``(chunk_params, h) -> h``: one model chunk; or a list of ``p v`` such functions,
        chunk ``k``'s (in model order) at ``k``, where chunks differ in what they compute (e.g.
        the first and last chunks hold fewer layers, beside the embedding and the head).
      schedule: from ``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, ``zb_h1`` or ``place``;
        validated here.
      mesh: the mesh; ``mesh.shape[axis]`` must be ``schedule.p``.
      loss: ``(last_params, h, target) -> scalar`` after the last chunk, on the last stage
        (replicated over the other axes, e.g. a ``pmean`` over ``"data"``).
      first: optional ``(first_params, x) -> h`` before chunk 0, on stage 0 (e.g. an embedding).
      axis: the pipe mesh axis.
      tied: pairs ``(first_key, last_key)``: ``params["first"][first_key]`` is also ``loss``'s
        parameter ``last_key`` (tied input and output embeddings).  The weight is held once, in
        ``params["first"]`` (every stage holds ``first`` and ``last``: they are replicated over
        the pipe axis), the step passes it to ``loss`` as ``last_key``, and its gradient is the
        sum of both uses, as the unpipelined model's.  Default: what ``loss`` carries as
        ``loss.tied`` (``fpar.hf.pipeline_stages`` sets it for a tied model), else none.

    Returns:
      ``step(params, xs, targets, *, key=None) -> StepResult``.  ``params`` is a dict with ``"stages"`` (every
      leaf stacked on dim 0 in stage-major order, see ``stage_major``: ``p v`` rows in-process,
      this rank's ``v`` rows on a real mesh, i.e. in-spec ``P(axis, ...)``), and optionally
      ``"first"`` and ``"last"``.  ``xs`` and ``targets`` are stacked microbatches ``(m, ...)``
      (on a real mesh, this rank's blocks over the other axes).  ``key`` (optional, a
      ``fpar.random`` key, the same on every rank): microbatch ``j`` gets ``key_j =
      fold_in(key, j)``; ``first`` is called as ``first(first_params, x, key_j)`` and chunk ``k``
      (in model order) as ``stage(chunk_params, h, fold_in(key_j, k))``, so the dropout masks
      differ per microbatch and chunk, and equal the unpipelined model's with those keys.

    Raises:
      ScheduleError: an invalid schedule.
      ValueError: a mesh without ``axis`` or of the wrong size.

    Example:
      >>> sub = mesh.submesh(("tensor",))
      >>> stage = fpar.shard(block, sub, (block_specs, P()), P())
      >>> step = fpar.pipeline.pipeline(stage, fpar.pipeline.one_f_one_b(2, 4), mesh, loss=mse)
      >>> loss, grads, stats = step({"stages": w_stacked}, xs, ys)
    """
    validate(schedule)
    _check_stage(stage, schedule)
    if axis not in mesh.shape:
        raise ValueError(
            f"fpar.pipeline.pipeline: {axis!r} is not an axis of the mesh {mesh.axis_names}; pass "
            f"axis= the name of the pipe axis."
        )
    if mesh.shape[axis] != schedule.p:
        raise ValueError(
            f"fpar.pipeline.pipeline: the schedule has p={schedule.p} stages but mesh axis {axis!r} "
            f"has size {mesh.shape[axis]}; build the schedule for {mesh.shape[axis]} stages."
        )
    fns = Fns(stage, loss, first)
    driver = DistDriver(schedule, mesh, axis, fns) if mesh.backend == "dist" else LocalDriver(schedule, fns)
    ties = tuple(getattr(loss, "tied", ()) if tied is None else tied)

    def run(
        params: dict,
        xs: Tensor,
        targets: Any,
        key: Tensor | None,
        unreduced: str | None,
        accumulate: torch.dtype | None = None,
        each: Any = None,
        gather: Any = None,
        done: Any = None,
    ) -> Any:
        try:
            _check_params(params, xs, targets, schedule, local=mesh.backend != "dist")
            _check_ties(params, ties)
            _check_key(key)
        except Exception:
            if mesh.backend == "dist":
                driver.failed()  # the other ranks raise too, naming this one, instead of waiting
            raise
        run_driver: Callable[..., Any] = driver.run
        if unreduced is not None and isinstance(driver, DistDriver):
            if each is not None and ties:
                each = _TiedEach(params, ties, each)
            run_driver = functools.partial(
                driver.run, unreduced=unreduced, accumulate=accumulate, each=each, gather=gather, done=done
            )
        if not ties:
            return run_driver(params, xs, targets, key)
        last = dict(params["last"])
        for a, b in ties:  # the tied weight, held once in first, is also the loss's parameter b
            last[b] = params["first"][a]
        return _sum_ties(run_driver({**params, "last": last}, xs, targets, key), ties)

    def step(params: dict, xs: Tensor, targets: Any = None, *, key: Tensor | None = None) -> StepResult:
        return run(params, xs, targets, key, None)

    # ``fpar.optim.zero_pipeline``: the same step with the gradients left unreduced over a data axis
    step._unreduced = run  # type: ignore[attr-defined]
    step._mesh, step._axis = mesh, axis  # type: ignore[attr-defined]
    step._schedule, step._ties = schedule, ties  # type: ignore[attr-defined]
    return step


# Error checking and messages ---------------------------------------------------------------


def _check_stage(stage: Any, schedule: Schedule) -> None:
    if callable(stage):
        return
    n = schedule.p * schedule.v
    if not isinstance(stage, (list, tuple)) or len(stage) != n or not all(callable(f) for f in stage):
        got = f"a {type(stage).__name__}"
        if isinstance(stage, (list, tuple)):
            got += f" of {len(stage)}" + ("" if all(callable(f) for f in stage) else " with a non-callable")
        raise TypeError(
            f"fpar.pipeline.pipeline: stage must be a function (one model chunk) or a list of p * v = "
            f"{n} functions (chunk k's at k, in model order), got {got}."
        )


def _sum_ties(result: Any, ties: tuple) -> Any:
    """The tied weight's gradient: its first use's plus the loss's (which is taken out of ``last``).

    On a real mesh both are whole on every rank already (``first`` and ``last`` are replicated
    over the pipe axis), so each rank adds them itself: no message.  Unreduced gradients
    (``Unreduced``) add the same way, part by part: each part's sum over the mesh is linear.
    """
    if isinstance(result, Unreduced):
        return result._replace(
            local=_tied_sum(result.local, ties),
            reduced=_tied_sum(result.reduced, ties),
            axes=_tied_sum(result.axes, ties, lambda a, b: a),  # both uses' sums are over the same axes
        )
    return result._replace(grads=_tied_sum(result.grads, ties))


@dataclasses.dataclass(frozen=True)
class _At:
    """Where a leaf of the step's ``last`` (with the tied weights in it) is in the caller's params."""

    group: str
    leaf: int


class _TiedEach:
    """``each`` named by the caller's params: a tied weight's ``last`` sum is its ``first`` leaf's.

    The driver runs with ``last`` holding the tied weights too (``run`` above), so its ``last``
    leaves are numbered otherwise than the caller's.
    """

    def __init__(self, params: dict, ties: tuple, each: Any):
        first, last = (_labels(params[g], g) for g in ("first", "last"))
        last = dict(last)
        for a, b in ties:
            last[b] = first[a]
        self.at, self.each = tree_flatten(last)[0], each

    def ready(self) -> None:
        self.each.ready()

    def __call__(self, items: list) -> None:
        at = self.at
        self.each(
            [
                (at[j].group, c, at[j].leaf, *rest) if g == "last" else (g, c, j, *rest)
                for g, c, j, *rest in items
            ]
        )


def _labels(tree: Any, group: str) -> Any:
    """``tree`` with each leaf replaced by where it is (an ``_At``, itself a leaf)."""
    leaves, treedef = tree_flatten(tree)
    return tree_unflatten(treedef, [_At(group, j) for j in range(len(leaves))])


def _tied_sum(grads: dict, ties: tuple, add: Callable = lambda g, h: g + h) -> dict:
    first, last = dict(grads["first"]), dict(grads["last"])
    for a, b in ties:
        g, h = first[a], last.pop(b)
        first[a] = h if g is None else (g if h is None else add(g, h))
    return {**grads, "first": first, "last": last}


def _check_ties(params: dict, ties: tuple) -> None:
    api = "fpar.pipeline.pipeline"
    for pair in ties:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"{api}: tied must be pairs (first_key, last_key), got {pair!r}.")
        a, b = pair
        first, last = params.get("first"), params.get("last")
        if not isinstance(first, dict) or a not in first:
            raise ValueError(
                f"{api}: tied weight {a!r} is not a key of params['first']; a tied weight is held once, "
                f"in params['first'], and passed to the loss as its parameter {b!r}."
            )
        if not isinstance(last, dict) or b in last:
            raise ValueError(
                f"{api}: params['last'] holds the tied weight {b!r} itself; a tied weight is held once, "
                f"in params['first'] (as {a!r}), and the step passes it to the loss (a second copy would "
                f"be trained apart from the first)."
            )


def _check_key(key: Any) -> None:
    is_key = isinstance(key, Tensor) and key.dtype == torch.int64 and key.shape == (2,)
    if key is not None and not is_key:
        got = type(key).__name__
        if isinstance(key, Tensor):
            got = f"dtype {key.dtype} and shape {tuple(key.shape)}"
        raise TypeError(
            f"fpar.pipeline.pipeline: step(..., key=) must be a fpar.random key (an int64 tensor of "
            f"shape (2,) from fpar.random.key / fold_in / split), got {got}."
        )


def _check_params(params: Any, xs: Any, targets: Any, schedule: Schedule, *, local: bool) -> None:
    api = "fpar.pipeline.pipeline: step"
    if not isinstance(params, dict) or "stages" not in params:
        raise TypeError(
            f"{api}(params, xs, targets): params must be a dict with key 'stages' (and optionally "
            f"'first', 'last'), got {type(params).__name__}."
        )
    unknown = sorted(set(params) - set(PARAM_KEYS))
    if unknown:
        raise ValueError(f"{api}: params has unknown keys {unknown}; the keys are {PARAM_KEYS}.")
    rows = schedule.p * schedule.v if local else schedule.v
    where = "p * v" if local else "v (this rank's chunks)"
    for t in tree_flatten(params["stages"])[0]:
        if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != rows:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{api}: every leaf of params['stages'] must be stacked on dim 0 over {where} = {rows} "
                f"chunks, got {shape}. Stack the chunks in stage-major order (fpar.pipeline.stage_major) "
                f"and give them the in-spec P(axis, ...)."
            )
    for name, value in (("xs", xs), ("targets", targets)):
        if value is None and name == "targets":
            continue
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != schedule.m:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"{api}: {name} must be the {schedule.m} microbatches stacked on dim 0, got {shape}."
            )
