"""Hypothesis strategies: meshes, specs that fit shapes, and random collective programs.

Meshes and spec entries come from the public kit (``fpar.testing.strategies``); this file adds
what only fpar's own tests need: shapes drawn with their specs, and random collective programs.

A *mesh* is an ordered ``{name: size}`` dict (1–8 devices, 1–3 axes). A *program* is a
:class:`Program`: a list of steps applied to one local block ``x`` (optionally first multiplied by a
replicated parameter ``w``), generated so that every step's shape preconditions hold. While drawing,
the generator tracks the block shape and the set of mesh axes the value *varies* over, by the
contract's static rules (split input / axis_index / all_gather / psum_scatter / ppermute /
all_to_all over an axis make it varying; psum / pmean / pmax / pmin over it make it replicated),
so it can draw an ``out_specs`` that check_rep accepts (or, for the error test, one it must reject).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from hypothesis import strategies as st

from fpar.testing import strategies as fst
from fpar.testing.strategies import spec_entries

AXIS_NAME_SETS = (("a", "b", "c"), ("x", "y", "z"))
MAX_NUMEL = 192  # keep blocks small: the suite must stay fast on 2 cores
MAX_RANK = 4


# ----------------------------------------------------------------------------------------------
# Meshes and specs


@st.composite
def meshes(draw, max_devices: int = 8) -> dict[str, int]:
    """An ordered ``{name: size}`` (the reference's mesh) drawn by ``fpar.testing.strategies.meshes``."""
    pool = draw(st.sampled_from(AXIS_NAME_SETS))
    return dict(draw(fst.meshes(max_devices, axis_names=pool)).shape)


def names_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def split_counts(mesh: dict[str, int], entries: tuple, rank: int) -> list[int]:
    counts = [math.prod(mesh[n] for n in names_of(e)) for e in entries]
    return counts + [1] * (rank - len(counts))


@st.composite
def sharded_shapes(draw, mesh: dict[str, int], *, min_rank=1, max_rank=3, max_block=6):
    """``(global_shape, spec_entries)`` with every split dim evenly divisible.

    Block sizes come from (2, 1, 3, 4, 6): multiples of the usual axis sizes, so that
    psum_scatter / all_to_all (which need a dim divisible by, or equal to, an axis size) are often
    applicable to the block.
    """
    rank = draw(st.integers(min_rank, max_rank))
    entries = draw(spec_entries(mesh, rank))
    counts = split_counts(mesh, entries, rank)
    shape = []
    for c in counts:
        budget = max(1, min(max_block, MAX_NUMEL // max(1, math.prod(shape) * c)))
        shape.append(c * draw(st.sampled_from([b for b in (2, 1, 3, 4, 6) if b <= budget])))
    return tuple(shape), entries


@st.composite
def axis_args(draw, mesh: dict[str, int]):
    """An axis_name argument: a single name, or a tuple of 1..all names in random order."""
    order = draw(st.permutations(list(mesh)))
    k = draw(st.integers(1, len(order)))
    if k == 1 and draw(st.booleans()):
        return order[0]
    return tuple(order[:k])


def axis_size(mesh: dict[str, int], axis_name) -> int:
    return math.prod(mesh[n] for n in names_of(axis_name))


# ----------------------------------------------------------------------------------------------
# Programs

UNARY = ("sin", "square", "tanh", "affine")
REDUCE = ("psum", "pmean", "pmax", "pmin")


def _unary(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "sin":
        return torch.sin(x)
    if kind == "square":
        return x * x
    if kind == "tanh":
        return torch.tanh(x)
    return 1.5 * x + 0.25


@dataclasses.dataclass(frozen=True)
class Program:
    """Steps applied to the local block; ``use_w``: multiply by a replicated ``w`` first."""

    steps: tuple
    use_w: bool
    in_shape: tuple
    in_entries: tuple
    out_local_shape: tuple
    varying: frozenset  # mesh axes the result varies over (contract's static rules)

    def __call__(self, c, x, w=None):
        if self.use_w:
            x = x * w
        for step in self.steps:
            kind = step[0]
            if kind in REDUCE:
                x = getattr(c, kind)(x, step[1])
            elif kind == "all_gather":
                x = c.all_gather(x, step[1], axis=step[2], tiled=step[3])
            elif kind == "psum_scatter":
                x = c.psum_scatter(x, step[1], scatter_dimension=step[2], tiled=step[3])
            elif kind == "ppermute":
                x = c.ppermute(x, step[1], step[2])
            elif kind == "all_to_all":
                x = c.all_to_all(x, step[1], step[2], step[3], tiled=step[4])
            elif kind == "axis_index_mul":
                x = x * (c.axis_index(step[1]) + 1)
            elif kind == "unsqueeze":
                x = x[None]
            else:
                x = _unary(kind, x)
        return x


@st.composite
def perms(draw, n: int):
    """A ppermute perm on ``n`` devices: a shift, a full permutation, or a partial one."""
    how = draw(st.sampled_from(["shift", "permutation", "partial"]))
    if how == "shift":
        k = draw(st.integers(0, max(0, n - 1)))
        return tuple((i, (i + k) % n) for i in range(n))
    p = draw(st.permutations(range(n)))
    pairs = tuple((i, p[i]) for i in range(n))
    if how == "partial":
        keep = draw(st.lists(st.sampled_from(range(n)), min_size=1, max_size=n, unique=True))
        pairs = tuple(pairs[i] for i in sorted(keep))
    return pairs


@st.composite
def _step(draw, mesh: dict[str, int], shape: tuple):
    """One step valid for a block of ``shape``: ``(step, new_shape, adds_varying, removes_varying)``."""
    ax = draw(axis_args(mesh))
    n = axis_size(mesh, ax)
    names = frozenset(names_of(ax))
    rank = len(shape)
    numel = math.prod(shape)
    options = ["ppermute", *REDUCE, "axis_index_mul", "unary"]
    if rank and any(s % n == 0 for s in shape):
        options[:0] = ["psum_scatter", "all_to_all"]
    if numel * n <= MAX_NUMEL and rank + 1 <= MAX_RANK:
        options.insert(0, "all_gather")
    kind = draw(st.sampled_from(options))
    if kind in REDUCE:
        return (kind, ax), shape, frozenset(), names
    if kind == "ppermute":
        return ("ppermute", ax, draw(perms(n))), shape, names, frozenset()
    if kind == "axis_index_mul":
        return ("axis_index_mul", ax), shape, names, frozenset()
    if kind == "unary":
        return (draw(st.sampled_from(UNARY)),), shape, frozenset(), frozenset()
    if kind == "all_gather":
        tiled = rank > 0 and draw(st.booleans())
        if tiled:
            d = draw(st.integers(0, rank - 1))
            new = shape[:d] + (shape[d] * n,) + shape[d + 1 :]
        else:
            d = draw(st.integers(0, rank))
            new = shape[:d] + (n,) + shape[d:]
        return ("all_gather", ax, d, tiled), new, names, frozenset()
    dims = [d for d in range(rank) if shape[d] % n == 0]
    exact = [d for d in dims if shape[d] == n]  # the untiled forms need dim == n: favour them
    d = draw(st.sampled_from(exact if exact and draw(st.booleans()) else dims))
    tiled = shape[d] != n or draw(st.booleans())
    if kind == "psum_scatter":
        new = shape[:d] + (shape[d] // n,) + shape[d + 1 :] if tiled else shape[:d] + shape[d + 1 :]
        return ("psum_scatter", ax, d, tiled), new, names, frozenset()
    # all_to_all
    if tiled:
        c = draw(st.integers(0, rank - 1))
        new = list(shape)
        new[d] //= n
        new[c] *= n  # numel unchanged
        return ("all_to_all", ax, d, c, True), tuple(new), names, frozenset()
    reduced = shape[:d] + shape[d + 1 :]
    c = draw(st.integers(0, rank - 1))
    new = reduced[:c] + (n,) + reduced[c:]
    return ("all_to_all", ax, d, c, False), new, names, frozenset()


@st.composite
def programs(draw, mesh: dict[str, int], *, max_steps=4, shape_and_entries=None):
    """A random :class:`Program` over ``mesh`` with a drawn input shape and in_spec entries."""
    if shape_and_entries is None:
        shape_and_entries = draw(sharded_shapes(mesh, min_rank=1, max_rank=2))
    in_shape, in_entries = shape_and_entries
    rank = len(in_shape)
    counts = split_counts(mesh, in_entries, rank)
    local = tuple(s // c for s, c in zip(in_shape, counts))
    varying = frozenset(n for e in in_entries for n in names_of(e))
    steps = []
    for _ in range(draw(st.sampled_from([k for k in (3, 2, 1, 0, 4) if k <= max_steps]))):
        step, local, add, remove = draw(_step(mesh, local))
        steps.append(step)
        varying = (varying - remove) | add
    if not local:  # a rank-0 block cannot carry an out_spec entry
        steps.append(("unsqueeze",))
        local = (1,)
    return Program(
        steps=tuple(steps),
        use_w=draw(st.booleans()),
        in_shape=in_shape,
        in_entries=in_entries,
        out_local_shape=local,
        varying=varying,
    )


@st.composite
def out_entries(draw, mesh: dict[str, int], prog: Program, *, valid: bool = True):
    """Out spec entries for ``prog``'s result.

    ``valid=True``: mentions every axis the result varies over (plus random others), so
    check_rep accepts it. ``valid=False``: leaves out at least one varying axis (needs one).
    """
    rank = len(prog.out_local_shape)
    if valid:
        return draw(spec_entries(mesh, rank, require=prog.varying))
    left_out = draw(st.sampled_from(sorted(prog.varying)))
    sub = {k: v for k, v in mesh.items() if k != left_out}
    require = prog.varying - {left_out}
    return draw(spec_entries(sub, rank, require=require)) if sub else ()
