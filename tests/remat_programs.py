"""``fpar.optim.remat`` programs run on both meshes (``test_remat_dist.py``).

``run(shape, names, form)`` builds the mesh (in-process without a process group, the real mesh in
processes started by ``fpar.launch``), runs every program and returns global values and
gradients, and for each program that must be refused the error's type and message.  Module
level, so that ``fpar.launch`` can pickle it.
"""

from __future__ import annotations

import torch

import fpar
import fpar.optim as fo
from fpar import P

F64 = torch.float64


def _tanh_layer(w, x):
    return torch.tanh(x @ w)


def _row_parallel(w1, w2, x):
    # Megatron MLP: column- then row-parallel, the output replicated over 'tensor' by the psum
    return fpar.psum(torch.tanh(x @ w1) @ w2, "tensor")


def _row_scattered(w1, w2, x):
    # Megatron-SP's row-parallel exit: the rows reduce-scattered over 'tensor'
    return fpar.psum_scatter(torch.tanh(x @ w1) @ w2, "tensor", scatter_dimension=0, tiled=True)


def _row_read_twice(w1, w2, x):
    # the row-parallel product is read beside its sum: the forward cannot keep the sum in its place
    y = torch.tanh(x @ w1) @ w2
    return fpar.psum(y, "tensor") + fpar.psum(y * y, "tensor")


def _scaled_by_sum(w, x):
    # w meets only a value already summed over 'data': its gradient needs no sum over 'data'
    return w * fpar.psum(x.sum(0), "data")


def _gathered(w, x):
    # sequence-parallel style: the rows are gathered inside the recomputed region
    return torch.tanh(fpar.all_gather(x, "data", tiled=True) @ w)


def _reads_value(w, x):
    # Python control flow on a tensor's value inside the recomputed function: refused on both meshes
    h = torch.tanh(x @ w)
    return h * 2 if h.sum() > 0 else h


def programs(names):
    """``{name: (loss, in_specs, args)}``: each loss returns a value replicated over every axis."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    data = "data"
    out = {
        # the program: a data-parallel step whose mesh has an axis it never reduces
        "data_parallel": (
            lambda w, x: fpar.pmean(fo.remat(_tanh_layer)(w, x).sum(), data),
            (P(), P(data)),
            (r(4, 4), r(8, 4)),
        ),
        "summed_inside": (
            lambda w, x: fpar.pmean((fo.remat(_scaled_by_sum)(w, x) ** 2).sum(), data),
            (P(), P(data)),
            (r(4), r(8, 4)),
        ),
        # w is used both inside the region (meeting x, so summed over 'data') and outside it
        # (not summed): the plan keeps its sums at the uses, and the recompute must redo them
        "mixed_uses": (
            lambda w, x: fpar.pmean(fo.remat(_tanh_layer)(w, x).sum(), data) + (w**2).sum(),
            (P(), P(data)),
            (r(4, 4), r(8, 4)),
        ),
        "gathered": (
            lambda w, x: fpar.pmean(fo.remat(_gathered)(w, x).sum(), data),
            (P(), P(data)),
            (r(4, 4), r(8, 4)),
        ),
    }
    # selective recomputation: the recompute reuses the matmuls' outputs the forward kept
    out["gathered_dots"] = (
        lambda w, x: fpar.pmean(fo.remat(_gathered, policy=fo.save_dots)(w, x).sum(), data),
        (P(), P(data)),
        (r(4, 4), r(8, 4)),
    )
    if "tensor" in names:
        specs = (P(None, "tensor"), P("tensor", None), P(data))
        out["tensor_parallel"] = (
            lambda w1, w2, x: fpar.pmean((fo.remat(_row_parallel)(w1, w2, x) ** 2).mean(), data),
            specs,
            (r(4, 8), r(8, 4), r(8, 4)),
        )
        # save_dots keeps the row-parallel product's sum in its place (fpar/_recompute.py): the
        # recompute neither multiplies nor communicates again; reduce-scattered too, and not where
        # the product is also read elsewhere
        for name, body, axes, policy in (
            ("dots", _row_parallel, data, fo.save_dots),
            ("scattered", _row_scattered, (data, "tensor"), None),
            ("scattered_dots", _row_scattered, (data, "tensor"), fo.save_dots),  # rows vary over 'tensor'
            ("read_twice_dots", _row_read_twice, data, fo.save_dots),
        ):
            out[f"tensor_parallel_{name}"] = (
                lambda w1, w2, x, body=body, axes=axes, policy=policy: fpar.pmean(
                    (fo.remat(body, policy=policy)(w1, w2, x) ** 2).mean(), axes
                ),
                specs,
                (r(4, 8), r(8, 4), r(8, 4)),
            )
        alternate = fo.remat(_row_parallel, policy=fo.save_alternate_dots)
        out["tensor_parallel_alternate_dots"] = (
            lambda w1, w2, x: fpar.pmean((alternate(w1, w2, x) ** 2).mean(), data),
            specs,
            (r(4, 8), r(8, 4), r(8, 4)),
        )
    return out


def refused(names):
    """A remat output that varies over 'data', returned with an out_spec that leaves 'data' out."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(4, 4, generator=g, dtype=F64), torch.randn(8, 4, generator=g, dtype=F64)
    return lambda w, x: fo.remat(_tanh_layer)(w, x).sum(), (P(), P("data")), (w, x)


def run(shape, names, form):
    """Values, gradients and the steady call's ``comm_stats`` of every program, and the refusals'
    errors, on this process's mesh."""
    mesh = fpar.make_mesh(shape, names)
    results = {}
    for name, (loss, specs, args) in programs(names).items():
        f = fpar.shard(loss, mesh, in_specs=specs, out_specs=P())
        placed = [fpar.device_put(a, mesh, s) for a, s in zip(args, specs)]
        argnums = tuple(range(len(args)))
        for _ in range(2):  # the first (planned) call, then a steady one
            fpar.reset_comm_stats()
            if form == "grad":
                value = f(*placed)
                grads = torch.func.grad(f, argnums=argnums)(*placed)
            else:
                leaves = [a.detach().requires_grad_() for a in placed]
                value = f(*leaves)
                value.backward()
                grads = [a.grad for a in leaves]
        results[name] = (
            fpar.gather(value, mesh, P()).detach().clone(),
            [fpar.gather(gr, mesh, s).clone() for gr, s in zip(grads, specs)],
            fpar.comm_stats(),  # the steady call's messages
        )
    loss, specs, args = refused(names)
    f = fpar.shard(loss, mesh, in_specs=specs, out_specs=P())
    placed = [fpar.device_put(a, mesh, s) for a, s in zip(args, specs)]
    reads = fpar.shard(lambda w, x: fpar.pmean(fo.remat(_reads_value)(w, x).sum(), "data"), mesh, specs, P())
    errors = []
    for g in (f, reads):
        try:
            torch.func.grad(g)(*placed) if form == "grad" else g(*placed)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the test compares what each mesh raised
            errors.append((type(e).__name__, str(e)))
    return results, *errors


def run_many(cases):
    """``run`` for each ``(shape, names, form)``: one launch of processes checks them all."""
    return [run(*case) for case in cases]


def unsharded(shape, names):
    """The same programs' values and gradients computed without fpar (the independent reference)."""
    sizes = dict(zip(names, shape))
    out = {}
    for name, (_, _, args) in programs(names).items():
        leaves = [a.clone().requires_grad_() for a in args]
        if name == "data_parallel":
            w, x = leaves
            value = torch.tanh(x @ w).sum() / sizes["data"]
        elif name == "mixed_uses":
            w, x = leaves
            value = torch.tanh(x @ w).sum() / sizes["data"] + (w**2).sum()
        elif name in ("gathered", "gathered_dots"):
            w, x = leaves
            value = torch.tanh(x @ w).sum()
        elif name == "summed_inside":
            w, x = leaves
            value = ((w * x.sum(0)) ** 2).sum()
        elif name == "tensor_parallel_read_twice_dots":
            w1, w2, x = leaves
            t = sizes["tensor"]
            parts = [torch.tanh(x @ a) @ b for a, b in zip(w1.chunk(t, 1), w2.chunk(t, 0))]
            value = ((sum(parts) + sum(p * p for p in parts)) ** 2).mean()
        else:
            w1, w2, x = leaves
            value = ((torch.tanh(x @ w1) @ w2) ** 2).mean()
        value.backward()
        out[name] = (value.detach(), [a.grad for a in leaves])
    return out
