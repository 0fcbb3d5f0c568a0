"""Programs for the multi-process tier (``test_dist.py``), written once for both backends.

Spawned processes unpickle their function by module name, so everything ``fpar.launch`` runs lives
here at module level. Each *job* is a function of plain data (mesh axes as an ordered dict, spec
entries as tuples, step lists as tuples) that builds its meshes with :func:`mesh_for`: inside an
``fpar.launch`` worker that is a real mesh (one process per device), in the test process it is
the in-process mesh. So the test runs the very same job in-process and on ``n`` processes and
compares:

* a :class:`Blk` result is *this rank's block* of a value laid out by its spec entries (in-process:
  the global value); the test slices the in-process value with the rank's mesh coordinates;
* any other tensor is a value every rank holds in full (a replicated output, a gathered tensor);
* anything else (comm_stats dicts, messages) is compared as is.

:func:`run_jobs` runs a list of jobs in one launch (spawning is the slow part on 2 cores) and
returns per job ``("ok", result)`` or ``("error", type, message, traceback)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import traceback
from typing import Any

import optree
import torch
import torch.distributed as dist

import fpar
from fpar import P
from fpar._dist import pending

F64 = torch.float64


@dataclasses.dataclass
class Blk:
    """This rank's block of a value whose layout is ``entries`` (spec entries); global in-process."""

    t: torch.Tensor
    entries: tuple


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_MESHES: dict = {}


def mesh_for(axes: dict[str, int]) -> fpar.Mesh:
    """The mesh ``{name: size}``: real inside a launched worker, in-process otherwise (cached)."""
    key = (tuple(axes), tuple(axes.values()), dist.is_available() and dist.is_initialized())
    if key not in _MESHES:
        _MESHES[key] = fpar.make_mesh(tuple(axes.values()), tuple(axes))
    return _MESHES[key]


def spec(entries) -> fpar.P:
    return P(*entries)


def _names(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def global_shape_of(t: torch.Tensor, entries, mesh: fpar.Mesh) -> tuple[int, ...]:
    """The global shape of ``t`` (a block on a real mesh, already global in-process)."""
    if mesh.backend == "local":
        return tuple(t.shape)
    shape = list(t.shape)
    for d, e in enumerate(entries):
        shape[d] *= math.prod(mesh.shape[a] for a in _names(e))
    return tuple(shape)


def randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=F64)


# ----------------------------------------------------------------------------------------------
# A tiny step language for per-device programs (the format of tests/strategies.py's Program.steps,
# plus axis_size and psum of a Python number).


def run_steps(steps, x, w=None):
    if w is not None:
        x = x * w
    for step in steps:
        kind = step[0]
        if kind in ("psum", "pmean", "pmax", "pmin"):
            x = getattr(fpar, kind)(x, step[1])
        elif kind == "all_gather":
            x = fpar.all_gather(x, step[1], axis=step[2], tiled=step[3])
        elif kind == "psum_scatter":
            x = fpar.psum_scatter(x, step[1], scatter_dimension=step[2], tiled=step[3])
        elif kind == "ppermute":
            x = fpar.ppermute(x, step[1], step[2])
        elif kind == "all_to_all":
            x = fpar.all_to_all(x, step[1], step[2], step[3], tiled=step[4])
        elif kind == "axis_index_mul":
            x = x * (fpar.axis_index(step[1]) + 1)
        elif kind == "axis_size_mul":
            x = x * fpar.axis_size(step[1])
        elif kind == "psum_const":  # psum of a Python number is the axis size
            x = x * fpar.psum(1, step[1]) / fpar.pmean(2.0, step[1])
        elif kind == "unsqueeze":
            x = x[None]
        elif kind == "sin":
            x = torch.sin(x)
        elif kind == "square":
            x = x * x
        elif kind == "tanh":
            x = torch.tanh(x)
        elif kind == "affine":
            x = 1.5 * x + 0.25
        else:
            raise ValueError(f"unknown step {step!r}")
    return x


def program(axes, steps, use_w, in_entries, out_entries, x, w=None, check_rep=True, seed=7):
    """Value, gradients (input and replicated ``w``) and comm_stats of one per-device program.

    The scalar differentiated is ``sum(out * r)`` for a fixed random global ``r``; on a real mesh
    each rank sums its own block of ``out * r``, so the sum over ranks' blocks is the global
    scalar and each rank's gradient is its block of the global gradient.
    """
    mesh = mesh_for(axes)
    in_spec, out_spec = spec(in_entries), spec(out_entries)

    def per_device(*args):
        return run_steps(steps, *args)

    if use_w:
        f = fpar.shard(per_device, mesh, in_specs=(in_spec, P()), out_specs=out_spec, check_rep=check_rep)
        args = (fpar.device_put(x, mesh, in_spec), w)
    else:
        f = fpar.shard(per_device, mesh, in_specs=in_spec, out_specs=out_spec, check_rep=check_rep)
        args = (fpar.device_put(x, mesh, in_spec),)
    out = f(*args)
    r = fpar.device_put(randn(global_shape_of(out, out_entries, mesh), seed), mesh, out_spec)

    def loss(*a):
        return (f(*a) * r).sum()

    fpar.reset_comm_stats()
    grads = torch.func.grad(loss, argnums=tuple(range(len(args))))(*args)
    stats = fpar.comm_stats()
    result = {"out": Blk(out, tuple(out_entries)), "gx": Blk(grads[0], tuple(in_entries)), "stats": stats}
    if use_w:
        result["gw"] = Blk(grads[1], ())
    return result


def program_backward(axes, steps, in_entries, out_entries, x, seed=7):
    """The same through ``.backward()`` and ``torch.func.vjp`` (no ``w``)."""
    mesh = mesh_for(axes)
    in_spec, out_spec = spec(in_entries), spec(out_entries)

    def per_device(a):
        return run_steps(steps, a)

    f = fpar.shard(per_device, mesh, in_specs=in_spec, out_specs=out_spec)
    # a leaf of its own: in-process device_put gives x itself, whose requires_grad_ would change the
    # caller's x (the test's kwargs, pickled later to the real mesh, where its slice is then no leaf)
    xb = fpar.device_put(x, mesh, in_spec).detach().requires_grad_(True)
    out = f(xb)
    r = fpar.device_put(randn(global_shape_of(out, out_entries, mesh), seed), mesh, out_spec)
    (out * r).sum().backward()
    _, vjp = torch.func.vjp(f, xb.detach())
    (g_vjp,) = vjp(r)
    return {"backward": Blk(xb.grad, tuple(in_entries)), "vjp": Blk(g_vjp, tuple(in_entries))}


def program_jvp(axes, steps, in_entries, out_entries, x, seed=8):
    """Forward mode: ``torch.func.jvp`` of the sharded function (tangent: a random global value)."""
    mesh = mesh_for(axes)
    in_spec = spec(in_entries)
    f = fpar.shard(lambda a: run_steps(steps, a), mesh, in_specs=in_spec, out_specs=spec(out_entries))
    xb = fpar.device_put(x, mesh, in_spec)
    tb = fpar.device_put(randn(tuple(x.shape), seed), mesh, in_spec)
    out, tangent = torch.func.jvp(f, (xb,), (tb,))
    return {"out": Blk(out, tuple(out_entries)), "tangent": Blk(tangent, tuple(out_entries))}


def grad_of_grad(axes, steps, in_entries, out_entries, x, seed=9):
    """A Hessian-vector product through the collectives: grad of <grad of <sin(f(x)), r>, v>."""
    mesh = mesh_for(axes)
    in_spec, out_spec = spec(in_entries), spec(out_entries)
    f = fpar.shard(lambda a: run_steps(steps, a), mesh, in_specs=in_spec, out_specs=out_spec)
    xb = fpar.device_put(x, mesh, in_spec)
    out = f(xb)
    r = fpar.device_put(randn(global_shape_of(out, out_entries, mesh), seed), mesh, out_spec)
    v = fpar.device_put(randn(tuple(x.shape), seed + 1), mesh, in_spec)

    def loss(a):
        return (torch.sin(f(a)) * r).sum()

    hvp = torch.func.grad(lambda a: (torch.func.grad(loss)(a) * v).sum())(xb)
    return {"grad": Blk(torch.func.grad(loss)(xb), tuple(in_entries)), "hvp": Blk(hvp, tuple(in_entries))}


def axis_info(axes, ax_list):
    """axis_index (int64, per device) and axis_size (a Python int) for each axis_name."""
    mesh = mesh_for(axes)
    names = tuple(axes)
    sizes = []

    def per_device(t):
        sizes.append([fpar.axis_size(ax) for ax in ax_list])
        return torch.stack([fpar.axis_index(ax) for ax in ax_list])[None] + t

    f = fpar.shard(per_device, mesh, P(names), P(names))
    out = f(fpar.device_put(torch.zeros(mesh.size, len(ax_list), dtype=torch.int64), mesh, P(names)))
    return {"index": Blk(out, (names,)), "sizes": sizes[0], "size_type": type(sizes[0][0]).__name__}


# ----------------------------------------------------------------------------------------------
# Whole training steps


MLP_SPECS = {"w1": (None, "tensor"), "b1": ("tensor",), "w2": ("tensor", None), "b2": ()}


def mlp_loss(params, x, y):
    """Megatron MLP: column-parallel w1, row-parallel w2 (psum over tensor), mean over data."""
    h = torch.tanh(x @ params["w1"] + params["b1"])
    out = fpar.psum(h @ params["w2"], "tensor") + params["b2"]
    return fpar.pmean(((out - y) ** 2).mean(), "data")


def mlp_loss_unsharded(params, x, y):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return (((h @ params["w2"] + params["b2"]) - y) ** 2).mean()


def mlp_inits(d, h, c):
    return {
        "w1": fpar.normal((d, h), std=d**-0.5, dtype=F64),
        "b1": fpar.uniform((h,), low=-0.1, high=0.1, dtype=F64),
        "w2": fpar.normal((h, c), std=h**-0.5, dtype=F64),
        "b2": fpar.zeros((c,), dtype=F64),
    }


def mlp_data(steps, batch, d, c, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, batch, d, generator=g, dtype=F64), torch.randn(
        steps, batch, c, generator=g, dtype=F64
    )


def train_mlp(axes, steps=3, lr=0.2, d=6, h=8, c=3, batch=8, seed=0, mesh_shape=None):
    """SGD on the data x tensor MLP: per step the loss, gathered params and (step 0) grads/stats.

    ``mesh_shape``: build the mesh with ``make_mesh(mesh_shape, ("data", "tensor"))`` instead
    (e.g. ``(-1, 4)``, inferred from the world size on a real mesh).
    """
    if mesh_shape is not None:  # -1 from the world size (real mesh) or from the device count
        mesh = fpar.make_mesh(
            mesh_shape, ("data", "tensor"), devices=None if rank_world() else math.prod(axes.values())
        )
    else:
        mesh = mesh_for(axes)
    specs = {k: spec(v) for k, v in MLP_SPECS.items()}
    params = fpar.init(mlp_inits(d, h, c), mesh, specs, seed=seed)
    xs, ys = mlp_data(steps, batch, d, c, seed + 1)
    step_fn = torch.func.grad_and_value(fpar.shard(mlp_loss, mesh, (specs, P("data"), P("data")), P()))
    out: dict[str, Any] = {"mesh": dict(mesh.shape), "losses": [], "params": []}
    for s in range(steps):
        x, y = fpar.device_put((xs[s], ys[s]), mesh, P("data"))
        fpar.reset_comm_stats()
        grads, loss = step_fn(params, x, y)
        if s == 0:
            out["stats"] = fpar.comm_stats()
            out["grads0"] = {k: Blk(g, MLP_SPECS[k]) for k, g in grads.items()}
        params = optree.tree_map(lambda p, g: p - lr * g, params, grads)
        out["losses"].append(loss.detach())
        out["params"].append(fpar.gather(params, mesh, specs))
    out["final_blocks"] = {k: Blk(v, MLP_SPECS[k]) for k, v in params.items()}
    return out


def rank_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0


def dp_loss(w, x, y):
    return fpar.pmean(((x @ w - y) ** 2).mean(), "data")


def dp_step(n, d=5, k=3, batch_per_device=2, seed=3):
    """Pure data parallel on a ("data",) mesh: a P() parameter's gradient and the traffic it costs."""
    mesh = mesh_for({"data": n})
    w = randn((d, k), seed)
    x, y = randn((n * batch_per_device, d), seed + 1), randn((n * batch_per_device, k), seed + 2)
    f = fpar.shard(dp_loss, mesh, (P(), P("data"), P("data")), P())
    xb, yb = fpar.device_put((x, y), mesh, P("data"))
    fpar.reset_comm_stats()
    g, loss = torch.func.grad_and_value(f)(w, xb, yb)
    stats = fpar.comm_stats()
    return {
        "grad": Blk(g, ()),
        "loss": loss.detach(),
        "stats": stats,
        "w_bytes": w.numel() * w.element_size(),
    }


def replicated_output_grad(axes, rows_per_device=2):
    """A P() output (a psum of every device's sum): d/dx is all ones, not ones * n_processes."""
    mesh = mesh_for(axes)
    names = tuple(axes)
    x = randn((rows_per_device * mesh.size, 3), 5)

    def total(a):
        return fpar.psum(a.sum(), names)

    f = fpar.shard(total, mesh, P(names), P())
    xb = fpar.device_put(x, mesh, P(names))
    g = torch.func.grad(f)(xb)
    xr = xb.clone().requires_grad_(True)
    f(xr).backward()
    return {"value": f(xb), "grad": Blk(g, (names,)), "backward": Blk(xr.grad, (names,))}


# ----------------------------------------------------------------------------------------------
# Errors: identical on every rank, before any communication; shape disagreement between ranks


def _ident(t):
    return t


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return (type(e).__name__, str(e))
    return None


def error_attempts(mesh, names):
    """Calls that must raise; name -> thunk. ``names``: the mesh axes; blocks are 2 x 4."""
    a0 = names[0]
    x = torch.ones(2, 4, dtype=F64)
    return {
        "in_unknown_axis": lambda: fpar.shard(_ident, mesh, P("nope"), P())(x),
        "out_unknown_axis": lambda: fpar.shard(_ident, mesh, P(), P("nope"))(x),
        "in_axis_twice": lambda: fpar.shard(_ident, mesh, P(a0, a0), P())(x),
        "in_too_long": lambda: fpar.shard(_ident, mesh, P(None, None, a0), P())(x),
        "not_a_tensor": lambda: fpar.shard(_ident, mesh, P(), P())(3.0),
        "out_too_long": lambda: fpar.shard(lambda t: t.sum(), mesh, P(), P(None))(x),
        "replication": lambda: fpar.shard(lambda t: t * fpar.axis_index(a0), mesh, P(), P())(x),
        "unbound_axis": lambda: fpar.shard(lambda t: fpar.psum(t, "nope"), mesh, P(), P())(x),
        "outside_shard": lambda: fpar.psum(x, a0),
        "psum_scatter_divisible": lambda: fpar.shard(
            lambda t: fpar.psum_scatter(t[:, :3], a0, scatter_dimension=1, tiled=True), mesh, P(), P(a0)
        )(x),
        "psum_scatter_untiled": lambda: fpar.shard(
            lambda t: fpar.psum_scatter(t[:, :3], a0, scatter_dimension=1), mesh, P(), P(a0)
        )(x),
        "all_to_all_divisible": lambda: fpar.shard(
            lambda t: fpar.all_to_all(t[:, :3], a0, 1, 0, tiled=True), mesh, P(), P(a0)
        )(x),
        "all_gather_out_of_range": lambda: fpar.shard(
            lambda t: fpar.all_gather(t, a0, axis=3), mesh, P(), P(None, a0)
        )(x),
        "ppermute_unique": lambda: fpar.shard(
            lambda t: fpar.ppermute(t, a0, [(0, 1), (1, 1)]), mesh, P(), P(a0)
        )(x),
        "ppermute_range": lambda: fpar.shard(lambda t: fpar.ppermute(t, a0, [(0, 7)]), mesh, P(), P(a0))(x),
        "all_to_all_untiled": lambda: fpar.shard(
            lambda t: fpar.all_to_all(t[:, :3], a0, 1, 0), mesh, P(), P(a0)
        )(x),
        "unbound_tuple_axis": lambda: fpar.shard(lambda t: fpar.all_gather(t, (a0, "nope")), mesh, P(), P())(
            x
        ),
        "prefix": lambda: fpar.shard(_ident, mesh, (P(), P()), P())(x),
    }


# Errors raised at the call boundary, which must not communicate (one rank alone may raise them).
PRE_COMMUNICATION = (
    "in_unknown_axis",
    "out_unknown_axis",
    "in_axis_twice",
    "in_too_long",
    "not_a_tensor",
    "prefix",
)


def _psum_all(mesh, names):
    f = fpar.shard(lambda t: fpar.psum(t, names), mesh, P(), P())
    return f(torch.ones(2, dtype=F64))


def errors(axes):
    """Every error on every rank; then the pre-communication ones on rank 0 alone, then a psum.

    If one of those called alone by rank 0 communicated, the ranks would fall out of step and the
    final psum would fail or time out instead of returning the mesh size.
    """
    mesh = mesh_for(axes)
    names = tuple(axes)
    attempts = error_attempts(mesh, names)
    out: dict[str, Any] = {"all": {k: _catch(v) for k, v in attempts.items()}}
    out["sync1"] = _psum_all(mesh, names)
    if rank() == 0:
        out["rank0_alone"] = {k: _catch(attempts[k]) for k in PRE_COMMUNICATION}
    out["sync2"] = _psum_all(mesh, names)
    return out


def mismatch(axes):
    """Ranks passing blocks of different shapes / dtypes / specs: ValueError on every rank."""
    mesh = mesh_for(axes)
    names = tuple(axes)
    r = rank()
    out = {}

    def psum_of(x, s=None):
        return fpar.shard(lambda t: fpar.psum(t, names), mesh, P(names) if s is None else s, P())(x)

    out["shape"] = _catch(lambda: psum_of(torch.ones(2 + (r == 1), 3, dtype=F64)))
    out["rank"] = _catch(lambda: psum_of(torch.ones(*((2, 3) if r != 1 else (2, 3, 1)), dtype=F64)))
    out["dtype"] = _catch(lambda: psum_of(torch.ones(2, 3, dtype=torch.float32 if r == 1 else F64)))
    out["spec"] = _catch(lambda: psum_of(torch.ones(2, 2, dtype=F64), P(names) if r != 1 else P(None, names)))
    # a different out_spec with check_rep=False (the value varies: P(names) returns every block)
    out["out_spec"] = _catch(
        lambda: fpar.shard(lambda t: t * 2, mesh, P(names), P(names) if r != 1 else P(), check_rep=False)(
            torch.ones(2, 3, dtype=F64)
        )
    )
    # after the cache is warm: rank 1 alone calls with a new shape
    warm = fpar.shard(lambda t: fpar.psum(t, names), mesh, P(names), P())
    for _ in range(2):
        warm(torch.ones(2, 3, dtype=F64))
    # (rank 0's planned call sends its check without waiting: the error comes at the first use)
    out["warm"] = _catch(lambda: warm(torch.ones(2 + (r == 1), 3, dtype=F64)).tolist())
    # gradients enabled on some ranks only: their backwards would send different messages
    w = torch.ones(3, dtype=F64, requires_grad=True)
    dp = fpar.shard(lambda w, x: fpar.psum((x * w).sum(), names), mesh, (P(), P(names)), P())
    for _ in range(2):
        dp(w, torch.ones(2, 3, dtype=F64)).backward()

    def no_grad_on_rank_1():
        with torch.no_grad() if r == 1 else contextlib.nullcontext():
            loss = dp(w, torch.ones(2, 3, dtype=F64))
        if r != 1:
            loss.backward()
        loss.item()  # (rank 1's planned call sends its check without waiting: read it here)

    out["grad_mode"] = _catch(no_grad_on_rank_1)
    # a parameter that requires grad on some ranks only: their gradient buckets would differ
    two = fpar.shard(
        lambda w, v, x: fpar.psum((x * w).sum() + (x * v).sum(), names), mesh, (P(), P(), P(names)), P()
    )
    frozen = torch.ones(3, dtype=F64, requires_grad=r != 1)
    out["requires_grad"] = _catch(lambda: two(frozen, w, torch.ones(2, 3, dtype=F64)).backward())
    # a different bucket size: the ranks' gradient all-reduces would not pair
    sized = fpar.shard(
        lambda w, x: fpar.psum((x * w).sum(), names), mesh, (P(), P(names)), P(), bucket_mb=1.0 + r
    )
    out["bucket_mb"] = _catch(lambda: sized(w, torch.ones(2, 3, dtype=F64)).backward())
    out["sync"] = _psum_all(mesh, names)  # still in step afterwards
    return out


def _dp_mlp(params, x, y):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return fpar.pmean(((h @ params["w2"] - y) ** 2).mean(), "data")


def _megatron(w_in, w_out, v, x):
    """Column then row parallel over 'tensor'; w_out (replicated) is used after the psum only."""
    h = torch.tanh(x @ w_in)  # x replicated over 'tensor', w_in split: a pvary use of x
    y = fpar.psum(h @ v, "tensor")  # replicated over 'tensor' again
    return fpar.pmean((y @ w_out).sum(), "data")  # w_out: invariant use only, never summed


def fast_paths(axes):
    """Steady-state real-mesh calls (plan cached) under every way of taking a gradient.

    Each function is called three times (the first call traces and plans); gradients by
    ``torch.func.grad``, ``torch.autograd.grad`` and ``.backward()`` into existing ``.grad``,
    with several gradient buckets (``bucket_mb`` tiny) and one; a Megatron-style weight used
    only after a psum (no all-reduce); a mixed use; a complex parameter; a closure-captured one.
    """
    mesh = mesh_for(axes)
    d, h, c, rows = 4, 6, 3, 2 * mesh.shape["data"]
    inits = {"w1": randn((d, h), 1), "b1": randn((h,), 2), "w2": randn((h, c), 3)}
    x, y = randn((rows, d), 4), randn((rows, c), 5)
    xl, yl = fpar.device_put((x, y), mesh, P("data"))
    out: dict[str, Any] = {}
    for name, mb in (("one_bucket", 25.0), ("buckets", 1e-5)):
        f = fpar.shard(_dp_mlp, mesh, (P(), P("data"), P("data")), P(), bucket_mb=mb)
        got = [torch.func.grad(f)(inits, xl, yl) for _ in range(3)]
        out[f"{name}_func_grad"] = got[-1]
        leaves = {k: v.clone().requires_grad_() for k, v in inits.items()}
        for _ in range(3):
            g = torch.autograd.grad(f(leaves, xl, yl), list(leaves.values()))
        out[f"{name}_autograd_grad"] = dict(zip(leaves, g))
        for _ in range(3):  # .backward() accumulates into .grad: 3 x the gradient
            f(leaves, xl, yl).backward()
        out[f"{name}_backward"] = {k: v.grad for k, v in leaves.items()}
    # grad of grad through the bucketed reduction
    f = fpar.shard(_dp_mlp, mesh, (P(), P("data"), P("data")), P())
    # .backward() of the loss (on a real mesh an unsettled Pending, which makes its own seed)
    # with a seed given and a retained graph; with a subset of the inputs
    seeded = {k: v.clone().requires_grad_() for k, v in inits.items()}
    subset = {k: v.clone().requires_grad_() for k, v in inits.items()}
    for _ in range(3):
        for p in (*seeded.values(), *subset.values()):
            p.grad = None
        loss = f(seeded, xl, yl)
        loss.backward(torch.tensor(2.0), retain_graph=True)
        loss.backward()  # the retained graph again, seeded with 1: 3 x the gradient in all
        f(subset, xl, yl).backward(inputs=[subset["w1"]])
    out["backward_seeded"] = {k: v.grad for k, v in seeded.items()}
    out["backward_inputs"] = {k: v.grad for k, v in subset.items()}

    def gnorm(p):
        g = torch.func.grad(f)(p, xl, yl)
        return sum((t * t).sum() for t in g.values())

    out["grad_of_grad"] = [torch.func.grad(gnorm)(inits) for _ in range(3)][-1]
    leaves = {k: v.clone().requires_grad_() for k, v in inits.items()}
    ps = list(leaves.values())
    for _ in range(3):  # the same, by plain autograd: create_graph, then a second backward
        g1 = torch.autograd.grad(f(leaves, xl, yl), ps, create_graph=True)
        gg = torch.autograd.grad(sum((t * t).sum() for t in g1), ps)
    out["double_backward"] = dict(zip(leaves, gg))
    for _ in range(3):  # plain autograd over torch.func.grad
        gf = torch.autograd.grad(gnorm(leaves), ps)
    out["autograd_of_func_grad"] = dict(zip(leaves, gf))
    loss = f(leaves, xl, yl)
    first = torch.autograd.grad(loss, ps, retain_graph=True)
    second = torch.autograd.grad(loss, ps)  # the same graph again: its buckets reduce again
    out["retained"] = (dict(zip(leaves, first)), dict(zip(leaves, second)))
    # evaluation of the trained signature (leaves that require grad) with gradients disabled:
    # no graph, so nothing to reduce (this crashed on a real mesh before, in the bucket hooks)
    with torch.no_grad():
        out["no_grad"] = [f(leaves, xl, yl) + 0 for _ in range(2)]
    with torch.inference_mode():
        out["inference_mode"] = f(leaves, xl, yl) + 0
    for p in ps:
        p.grad = None
    f(leaves, xl, yl).backward()  # and training goes on after it
    out["after_no_grad"] = {k: v.grad for k, v in leaves.items()}
    if "tensor" in axes:
        t = mesh.shape["tensor"]
        w_in, w_out, v = randn((d, 2 * t), 6), randn((c, 2), 7), randn((2 * t, c), 8)
        specs = (P(None, "tensor"), P(), P("tensor"), P("data"))
        meg = fpar.shard(_megatron, mesh, specs, P())
        args = (fpar.device_put(w_in, mesh, specs[0]), w_out, fpar.device_put(v, mesh, specs[2]), xl)
        g = [torch.func.grad(meg, argnums=(0, 1, 2))(*args) for _ in range(3)][-1]
        out["megatron"] = (Blk(g[0], (None, ("tensor",))), g[1], Blk(g[2], (("tensor",),)))
    # mixed: w meets the split batch and also reaches the (replicated) output directly

    def mixed(w, x):
        return fpar.psum((x * w).sum(), "data") + w.sum()

    fm = fpar.shard(mixed, mesh, (P(), P("data")), P())
    w = randn((d,), 9)
    out["mixed"] = [torch.func.grad(fm)(w, xl) for _ in range(3)][-1]
    # complex parameter, data parallel
    wc = torch.complex(randn((d,), 10), randn((d,), 11))

    def cplx(w, x):
        return fpar.pmean(((x.to(w.dtype) @ w).abs() ** 2).mean(), "data")

    fc = fpar.shard(cplx, mesh, (P(), P("data")), P())
    out["complex"] = [torch.func.grad(fc)(wc, xl) for _ in range(3)][-1]
    # a closure-captured replicated parameter
    wcap = randn((d,), 12).requires_grad_()
    fcap = fpar.shard(lambda x: fpar.pmean((x @ wcap).sum(), "data"), mesh, P("data"), P())
    for _ in range(3):
        (gcap,) = torch.autograd.grad(fcap(xl), [wcap])
    out["captured"] = gcap
    # a loss whose carried pmean the function itself reads (squares it): on a real mesh the traced
    # call sees the read, so planned calls wait for the sum there (a plain tensor, which a
    # compiled f can go on with, where a loss returned as it is stays a Pending); second order too
    seen: list[type] = []

    def squared(params, x, y):
        loss = _dp_mlp(params, x, y)
        seen.append(type(loss))
        return loss * loss

    fs = fpar.shard(squared, mesh, (P(), P("data"), P("data")), P())
    leaves = {k: v.clone().requires_grad_() for k, v in inits.items()}
    ps = list(leaves.values())
    for _ in range(4):
        g1 = torch.autograd.grad(fs(leaves, xl, yl), ps, create_graph=True)
        gg = torch.autograd.grad(sum((t * t).sum() for t in g1), ps)
    out["read_inside_grad"] = dict(zip(leaves, g1))
    out["read_inside_double_backward"] = dict(zip(leaves, gg))
    out["read_inside_func_grad"] = [torch.func.grad(fs)(inits, xl, yl) for _ in range(3)][-1]
    if mesh.backend != "local" and mesh.axis_names == ("data",):  # (a pmean over every axis is carried)
        assert pending.Pending not in seen, seen
    return out


# ----------------------------------------------------------------------------------------------
# Meshes, layouts, init, DTensor


def meshes(world):
    """make_mesh on a real mesh: -1 from the world size, size mismatches, backend='local'."""
    out: dict[str, Any] = {}
    m = fpar.make_mesh((-1, 2), ("data", "tensor"))
    out["infer"] = (dict(m.shape), m.backend, m.size)
    out["infer_first"] = dict(fpar.make_mesh((2, -1), ("a", "b")).shape)
    out["too_big"] = _catch(lambda: fpar.make_mesh((world + 1,), ("i",)))
    out["too_small"] = _catch(lambda: fpar.make_mesh((1,), ("i",))) if world > 1 else None
    out["devices"] = _catch(lambda: fpar.make_mesh((-1,), ("i",), devices=2 * world))
    out["not_divide"] = _catch(lambda: fpar.make_mesh((-1, 3), ("a", "b")))
    out["local"] = local_mesh_program()
    return out


def local_mesh_program():
    """backend="local" (inside a process group too): an in-process mesh, global values in and out."""
    local = fpar.make_mesh((2, 2), ("a", "b"), backend="local")
    x = randn((4, 6), 11)
    f = fpar.shard(
        lambda t: fpar.all_gather(fpar.psum(torch.sin(t), "a") * (fpar.axis_index("b") + 1), "b", tiled=True),
        local,
        P("a", "b"),
        P("b"),
    )
    fpar.reset_comm_stats()
    value = f(x)
    return {
        "backend": local.backend,
        "eq": local == fpar.make_mesh((2, 2), ("a", "b"), backend="local"),
        "value": value,
        "stats": fpar.comm_stats(),
        "grad": torch.func.grad(lambda t: (f(t) ** 2).sum())(x),
        "to_dtensor": _catch(lambda: fpar.to_dtensor(x, local, P())),
    }


LAYOUTS = [
    (),
    ("a",),
    (None, "b"),
    ("a", "b"),
    ("b", "a"),
    (("a", "b"),),
    (("b", "a"), None),
    (None, ("a", "b")),
]


def layouts(axes):
    """device_put -> gather round trips for several specs (and a pytree), and gather's gradient."""
    mesh = mesh_for(axes)
    x = randn((8, 12), 21)
    out: dict[str, Any] = {}
    for entries in LAYOUTS:
        b = fpar.device_put(x, mesh, spec(entries))
        out[entries] = {"block": Blk(b, entries), "gathered": fpar.gather(b, mesh, spec(entries))}
    tree = {"u": x, "v": [x[:4], x[:, :4]]}
    specs = {"u": P("a", "b"), "v": [P(), P(None, ("b", "a"))]}
    blocks = fpar.device_put(tree, mesh, specs)
    out["tree_blocks"] = {"u": Blk(blocks["u"], ("a", "b")), "v1": Blk(blocks["v"][1], (None, ("b", "a")))}
    out["tree_gathered"] = fpar.gather(blocks, mesh, specs)
    # gather is differentiable: the gradient of sum(gather(b) * r) is this rank's block of r
    r = randn((8, 12), 22)
    b = fpar.device_put(x, mesh, P("a", "b"))
    out["gather_grad"] = Blk(
        torch.func.grad(lambda t: (fpar.gather(t, mesh, P("a", "b")) * r).sum())(b), ("a", "b")
    )
    return out


INIT_LAYOUTS = [
    {"w": (), "m": (), "b": ()},
    {"w": ("a", "b"), "m": (None, ("a", "b")), "b": ("a",)},
    {"w": (("b", "a"),), "m": ("b", "a"), "b": ("b",)},
    {"w": (None, "a"), "m": (("a", "b"), None), "b": ()},
]


def init_inits():
    return {
        "w": fpar.normal((264, 8), std=0.5, mean=1.0, dtype=F64),  # crosses 128-element tiles
        "m": fpar.uniform((8, 264), low=-2.0, high=3.0),  # float32, crosses tiles on dim 1
        "b": fpar.full((8,), 0.25, dtype=F64),
        "z": {"zeros": fpar.zeros((3,)), "ones": fpar.ones((2, 2), dtype=F64)},
    }


def init_values(axes, seed=5):
    """fpar.init under several layouts: blocks and gathered global values."""
    mesh = mesh_for(axes)
    out = []
    for layout in INIT_LAYOUTS:
        specs = {k: spec(v) for k, v in layout.items()}
        specs["z"] = P()
        params = fpar.init(init_inits(), mesh, specs, seed=seed)
        out.append(
            {
                "blocks": {k: Blk(params[k], layout[k]) for k in layout},
                "gathered": fpar.gather(params, mesh, specs),
            }
        )
    return out


def dtensors(axes):
    """to_dtensor / from_dtensor round trips, full_tensor, redistribution, mesh-order rule."""
    from torch.distributed.tensor import DTensor

    mesh = mesh_for(axes)
    x = randn((8, 12), 31)
    out: dict[str, Any] = {}
    for entries, other in [(("a", "b"), (None, ("a", "b"))), ((), ("b",)), ((("a", "b"),), ("a",))]:
        b = fpar.device_put(x, mesh, spec(entries))
        dt = fpar.to_dtensor(b, mesh, spec(entries))
        out[entries] = {
            "is_dtensor": isinstance(dt, DTensor),
            "shape": tuple(dt.shape),
            "full": dt.full_tensor(),
            "back": Blk(fpar.from_dtensor(dt, mesh, spec(entries)), entries),
            "other": Blk(fpar.from_dtensor(dt, mesh, spec(other)), other),
        }
    b = fpar.device_put(x, mesh, P(("b", "a")))
    out["not_mesh_order"] = _catch(lambda: fpar.to_dtensor(b, mesh, P(("b", "a"))))
    return out


# ----------------------------------------------------------------------------------------------
# Failure behaviour (each its own launch)


def raise_on_rank(bad: int):
    """Rank ``bad`` raises before a collective the others are already waiting in."""
    mesh = fpar.make_mesh((-1,), ("i",))
    if rank() == bad:
        raise ValueError(f"deliberate failure on rank {bad}")
    return _psum_all(mesh, ("i",))


def hang_on_rank(bad: int, seconds: float):
    """Rank ``bad`` stalls; the others' collective must give up after the launch timeout."""
    mesh = fpar.make_mesh((-1,), ("i",))
    if rank() == bad:
        time.sleep(seconds)
    t0 = time.monotonic()
    try:
        return _psum_all(mesh, ("i",))
    except Exception as e:
        raise RuntimeError(f"collective gave up after {time.monotonic() - t0:.1f}s: {e}") from e


def exit_on_rank(bad: int, code: int):
    """Rank ``bad`` dies without a Python exception."""
    mesh = fpar.make_mesh((-1,), ("i",))
    if rank() == bad:
        os._exit(code)
    return _psum_all(mesh, ("i",))


# ----------------------------------------------------------------------------------------------
# The batch runner


JOBS = {
    f.__name__: f
    for f in (
        program,
        program_backward,
        program_jvp,
        grad_of_grad,
        axis_info,
        train_mlp,
        dp_step,
        replicated_output_grad,
        errors,
        mismatch,
        fast_paths,
        meshes,
        layouts,
        init_values,
        dtensors,
    )
}


def run_jobs(jobs: list[tuple[str, str, dict]]) -> dict[str, tuple]:
    """Run ``[(case_id, job_name, kwargs), ...]``; per case ``("ok", result)`` or an error record."""
    results: dict[str, Any] = {"_times": {}}
    for case_id, name, kwargs in jobs:
        t0 = time.perf_counter()
        try:
            results[case_id] = ("ok", JOBS[name](**kwargs))
        except Exception as e:  # noqa: BLE001 - reported by the test that owns the case
            results[case_id] = ("error", type(e).__name__, str(e), traceback.format_exc())
        results["_times"][case_id] = time.perf_counter() - t0
    return results


def bucket_order(behind: bool) -> dict:
    """When each gradient bucket's all-reduce starts, relative to the backward of the first layer.

    A two-layer MLP whose second layer fills the first (1 MB) bucket, under ``.backward()`` and
    ``torch.func.grad`` (the input's gradient hook marks the first layer).  With no rank behind
    (the check the loss carries has arrived before the backward starts) that bucket's
    all-reduce must start as soon as its gradients exist, before the first layer.  With rank 1
    starting each call 0.3 s late (``behind``), the check is still on its way when rank 0's
    bucket is ready: it is held, rank 0's backward goes on to the first layer and the
    all-reduce goes after.  Either way the gradients are the full batch's.
    """
    import torch.nn.functional as F

    mesh = fpar.make_mesh((dist.get_world_size(),), ("data",))
    d = 512  # w2: 512 x 512 float32 = 1 MB, the first bucket's cap
    params = fpar.init({"w1": fpar.normal((d, 8)), "w2": fpar.normal((d, d))}, mesh, P(), seed=0)
    x_full = randn((2 * mesh.size, 8), 1).float()
    x = fpar.device_put(x_full, mesh, P("data"))
    events: list = []

    def local(p, x):
        return F.linear(torch.relu(F.linear(x, p["w1"])), p["w2"]).square().mean()

    f = fpar.shard(lambda p, x: fpar.pmean(local(p, x), "data"), mesh, (P(), P("data")), P())

    def marked(p, x):
        x.register_hook(lambda g: events.append("first layer"))
        out = f(p, x)
        while not behind and pending.in_flight():
            time.sleep(0.001)
        return out

    full = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    torch.stack([local(full, rows) for rows in x_full.chunk(mesh.size)]).mean().backward()
    original = dist.all_reduce

    def all_reduce(t, *args, **kwargs):
        events.append(t.numel())
        return original(t, *args, **kwargs)

    out = {}
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    for how in ("backward", "func_grad"):
        for _ in range(2):  # the second call runs the cached plan
            events.clear()
            for t in leaves.values():
                t.grad = None
            dist.barrier()
            if behind and dist.get_rank() == 1:
                time.sleep(0.3)
            dist.all_reduce = all_reduce
            try:
                if how == "backward":
                    marked(leaves, x.detach().requires_grad_()).backward()
                    got = {k: t.grad for k, t in leaves.items()}
                else:
                    got = torch.func.grad(marked, argnums=(0, 1))(params, x)[0]
            finally:
                dist.all_reduce = original
        out[how] = {
            "events": list(events),
            "close": all(torch.allclose(got[k], full[k].grad, rtol=1e-5, atol=1e-6) for k in full),
        }
    return out


def low_precision_buckets():
    """The bucketed gradient all-reduce of fp16/bf16 replicated parameters (cached-plan calls).

    Rank 0's gradient is 1, the others' a quarter of the dtype's spacing at 1: summed in the
    dtype, pair by pair, every partial sum rounds back to 1; fpar's rule (float32, rounded once)
    gives the next value above 1.
    """
    n = dist.get_world_size()
    mesh = fpar.make_mesh((n,), ("data",))
    out = {}
    for dtype, small in ((torch.bfloat16, 2.0**-9), (torch.float16, 2.0**-12)):
        rows = torch.full((n, 8), small, dtype=dtype)
        rows[0] = 1.0
        w = torch.ones(8, dtype=dtype)
        f = fpar.shard(lambda w, x: fpar.psum((w * x).sum(), "data"), mesh, (P(), P("data")), P())
        x = fpar.device_put(rows, mesh, P("data"))
        grads = [torch.func.grad(f)(w, x) for _ in range(3)]  # the first traced, then cached
        out[str(dtype)] = grads
    return out


def _dp_loss2(w, x):
    return fpar.pmean(((x @ w["a"]).tanh() @ w["b"]).square().mean(), "data")


def _tp_loss2(w, x):
    return fpar.psum((x @ w["a"]).tanh() @ w["b"], "data").square().mean()


def jacobians():
    """jacrev and hessian through a sharded function, first (traced) and cached-plan calls.

    Data parallel (replicated weights: the gradient buckets under vmap and forward mode) and
    Megatron-style (a psum): gathered results, comparable with the in-process mesh.
    """
    world = rank_world()
    mesh = fpar.make_mesh((world,) if world else (2,), ("data",))
    w = {"a": randn((4, 6), 21), "b": randn((6, 3), 22)}
    x = randn((8, 4), 23)
    out = {}
    cases = (
        ("dp", _dp_loss2, {"a": P(), "b": P()}, P("data")),
        ("tp", _tp_loss2, {"a": P(None, "data"), "b": P("data", None)}, P()),
    )
    for name, f, wspec, xspec in cases:
        sf = fpar.shard(f, mesh, (wspec, xspec), P())
        wb, xb = fpar.device_put(w, mesh, wspec), fpar.device_put(x, mesh, xspec)
        for call in range(2):
            out[f"{name} jacrev {call}"] = fpar.gather(
                torch.func.jacrev(lambda w, sf=sf, xb=xb: sf(w, xb))(wb), mesh, wspec
            )
            if name == "dp":  # replicated a: the whole Hessian on every rank
                out[f"{name} hessian {call}"] = torch.func.hessian(
                    lambda a, sf=sf, wb=wb, xb=xb: sf({"a": a, "b": wb["b"]}, xb)
                )(wb["a"])
                # forward over reverse without vmap: the bucket all-reduce's own jvp rule
                grad_a = torch.func.grad(lambda a, sf=sf, wb=wb, xb=xb: sf({"a": a, "b": wb["b"]}, xb))
                out[f"{name} hvp {call}"] = torch.func.jvp(grad_a, (wb["a"],), (torch.ones_like(wb["a"]),))[1]
    return out
