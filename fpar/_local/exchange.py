"""In-process exchanges: what each collective does to the stacked blocks of every device.

Every function here takes ``x`` of shape ``(N, *B, *L)``: the blocks of the ``N`` devices of one
(combined) mesh axis stacked on dim 0, then ``nb = len(B)`` batch dims that the collective maps
over (other mesh axes, user ``vmap``s), then the per-device logical shape ``L``.  It returns
``(N, *B, *L_out)`` for a result that varies over the axis, or ``(*B, *L_out)`` for one that is
replicated over it.  These are ordinary differentiable torch ops, so the gradient of a sharded
function is exact by construction: sum over dim 0 transposes to a broadcast, a move of dims
transposes to the inverse move, an index to a scatter.
"""

from __future__ import annotations

import torch

from .._spec import PartitionSpec, check_spec, global_shape
from .._sums import widened

__all__ = ["EXCHANGES", "LocalBackend", "vmap_dims"]

Tensor = torch.Tensor


LOW_PRECISION = (torch.float16, torch.bfloat16)
"""Dtypes the reductions accumulate in float32 (fpar's rule, docs/concepts.md, "Low precision"),
unless ``fpar.low_precision_sums("native")`` (``fpar/_sums.py``)."""


def _reduce(x: Tensor, kind: str) -> Tensor:
    """Reduce over dim 0 (sum, mean, max or min).

    fp16/bf16 sums and means accumulate in float32 and round once to the input dtype; a mean divides every block by the device count in float32 before summing, so it
    does not overflow where the mean fits (the real mesh follows the same rule).  Under
    ``low_precision_sums("native")`` a mean divides every block first too, in its own dtype
    (as DDP's and Megatron-LM's gradient averaging), then sums.
    """
    if kind == "sum":
        if x.dtype == torch.bool:  # as in JAX: psum of bools counts them
            return x.to(torch.int32).sum(0, dtype=torch.int32)
        if widened(x.dtype):
            return x.sum(0, dtype=torch.float32).to(x.dtype)
        if x.dtype in LOW_PRECISION:  # fpar.low_precision_sums("native"): rank order, each step rounded
            return _folded(x)
        return x.sum(0, dtype=x.dtype)
    if kind == "mean":
        if widened(x.dtype):  # each block divided first: bf16 has float32's range
            return (x.to(torch.float32) / x.shape[0]).sum(0).to(x.dtype)
        if x.dtype in LOW_PRECISION:  # native: each block divided first, then summed in rank order
            return _folded(x / x.shape[0])
        return x.sum(0) / x.shape[0] if not x.is_floating_point() else x.mean(0)
    # amax/amin split the gradient evenly between ties, which is the rule fpar promises.
    return x.amax(0) if kind == "max" else x.amin(0)


def _folded(x: Tensor) -> Tensor:
    """The blocks' sum in their own dtype, added in rank order (each addition rounded)."""
    acc = x[0]
    for k in range(1, x.shape[0]):
        acc = acc + x[k]
    return acc


def psum(x: Tensor, nb: int) -> Tensor:
    return _reduce(x, "sum")


def pmean(x: Tensor, nb: int) -> Tensor:
    return _reduce(x, "mean")


def pmax(x: Tensor, nb: int) -> Tensor:
    return _reduce(x, "max")


def pmin(x: Tensor, nb: int) -> Tensor:
    return _reduce(x, "min")


def all_gather(x: Tensor, nb: int, axis: int, tiled: bool) -> Tensor:
    n = x.shape[0]
    g = x.movedim(0, nb + axis)  # the N blocks now sit at logical dim `axis`
    if tiled:
        g = g.flatten(nb + axis, nb + axis + 1)
    return g.unsqueeze(0).expand(n, *g.shape)  # every device holds the same gathered value


def all_gather_invariant(x: Tensor, nb: int, axis: int, tiled: bool) -> Tensor:
    g = x.movedim(0, nb + axis)  # one gathered value, replicated: no per-device dim
    return g.flatten(nb + axis, nb + axis + 1) if tiled else g


def psum_scatter(x: Tensor, nb: int, scatter_dimension: int, tiled: bool) -> Tensor:
    n = x.shape[0]
    s = _reduce(x, "sum")
    d = nb + scatter_dimension
    if tiled:
        s = s.unflatten(d, (n, s.shape[d] // n))
    return s.movedim(d, 0)  # device k keeps chunk k


def ppermute(x: Tensor, nb: int, perm: tuple[tuple[int, int], ...]) -> Tensor:
    n = x.shape[0]
    src_of = [n] * n  # index n selects a zero block: devices that receive nothing get zeros
    for src, dst in perm:
        src_of[dst] = src
    if n in src_of:
        x = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    if src_of == list(range(n)):
        return x[:n]
    return x[torch.tensor(src_of, device=x.device)]


def all_to_all(x: Tensor, nb: int, split_axis: int, concat_axis: int, tiled: bool) -> Tensor:
    n = x.shape[0]
    s = 1 + nb + split_axis
    if tiled:
        x = x.unflatten(s, (n, x.shape[s] // n))
    t = x.movedim(s, 0)  # (N_dst, N_src, *B, *L'): chunk j of every source, for device j
    t = t.movedim(1, 1 + nb + concat_axis)  # sources, in order, at the concat dim
    if tiled:
        t = t.flatten(1 + nb + concat_axis, 2 + nb + concat_axis)
    return t


def pvary(x: Tensor, nb: int) -> Tensor:
    return x  # already one (equal) block per device


EXCHANGES = {
    "pvary": (pvary, True),
    "psum": (psum, False),
    "pmean": (pmean, False),
    "pmax": (pmax, False),
    "pmin": (pmin, False),
    "all_gather": (all_gather, True),
    "all_gather_invariant": (all_gather_invariant, False),
    "psum_scatter": (psum_scatter, True),
    "ppermute": (ppermute, True),
    "all_to_all": (all_to_all, True),
}
"""kind -> (exchange, whether the result varies over the axis)."""


def make_exchange(mesh):
    """Return ``exchange(op, x)`` for the in-process ``mesh``.

    ``x`` has one leading dim per axis of ``op`` in the order ``op.explicit`` lists them; the
    exchange regroups them into one combined dim in the order the user wrote the axes (major to
    minor), runs the collective, and restores the layout of the leading dims for a varying result.
    """

    def exchange(op, x: Tensor) -> Tensor:
        k = len(op.axes)
        order = [op.explicit.index(a) for a in op.axes]
        if order != list(range(k)):
            x = x.permute(*order, *range(k, x.dim()))
        if k > 1:
            x = x.flatten(0, k - 1)
        fn, varying = EXCHANGES[op.kind]
        y = fn(x, op.nbatch, *op.params)
        if varying and k > 1:
            y = y.unflatten(0, [mesh.shape[a] for a in op.axes])
            if order != list(range(k)):
                y = y.permute(*[op.axes.index(a) for a in op.explicit], *range(k, y.dim()))
        return y

    return exchange


class LocalBackend:
    """The in-process mesh: global tensors in and out, every device's block computed at once."""

    name = "local"

    def __init__(self, mesh):
        self.mesh = mesh
        self.exchange = make_exchange(mesh)

    def check_input(self, spec: PartitionSpec, x: Tensor, where: str) -> None:
        check_spec(spec, tuple(x.shape), self.mesh.shape, where=where)

    def split(self, x: Tensor, spec: PartitionSpec) -> tuple[Tensor, list]:
        """View ``x`` with each split dim cut into (axis sizes..., block): no copy."""
        shape, label = [], []
        entries = spec.normalized()
        for d, size in enumerate(x.shape):
            entry = entries[d] if d < len(entries) else ()
            n = 1
            for a in entry:
                shape.append(self.mesh.shape[a])
                label.append(a)
                n *= self.mesh.shape[a]
            shape.append(size // n)
            label.append(None)
        return x.reshape(shape), label

    def before(self, call, checked) -> None:
        pass  # one process: nothing to agree on

    def token_and_index(self, device=None) -> tuple[Tensor, list[Tensor]]:
        """The mesh token and each axis's coordinates, on the inputs' device."""
        token = torch.zeros(self.mesh.axis_sizes, device=device)
        return token, [torch.arange(n, device=device) for n in self.mesh.axis_sizes]

    def output(
        self, t: Tensor, spec: PartitionSpec, present: list[str], replicated: tuple[str, ...] = ()
    ) -> Tensor:
        """The global tensor from ``t``: one leading dim per axis in ``present``, then the block.

        (``replicated``: named axes the value does not vary over; vmap expanded it there, and the
        expand's backward already sums, so nothing more is needed in-process.)
        """
        named = spec.axes()
        for k in reversed(range(len(present))):
            if present[k] not in named:  # check_rep=False: keep the block at coordinate 0
                t = t.select(k, 0)
        present = [a for a in present if a in named]
        k = len(present)
        block = tuple(t.shape[k:])
        entries = spec.normalized()
        perm = []
        for d in range(t.dim() - k):
            for a in entries[d] if d < len(entries) else ():
                perm.append(present.index(a))
            perm.append(k + d)
        if perm != list(range(len(perm))):
            t = t.permute(perm)
        return t.reshape(global_shape(spec, block, self.mesh.shape))


def vmap_dims(axes: tuple, labels: list) -> list[tuple]:
    """Each mesh level's vmap ``in_dims``.

    The views' split dims (``LocalBackend.split``'s labels), then the token (batched at every
    level) and one coordinate per axis (batched at its own).
    """
    level_dims = []
    labels = [list(lab) for lab in labels]
    for i, a in enumerate(axes):
        dims = []
        for lab in labels:
            dims.append(lab.index(a) if a in lab else None)
            if a in lab:
                lab.remove(a)
        level_dims.append((*dims, 0, *[0 if j == i else None for j in range(len(axes))]))
    return level_dims
