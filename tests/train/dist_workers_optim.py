"""Problems shared by the ``fpar.optim`` tests, and the module-level worker of the real-mesh check.

``fpar.launch`` spawns processes that unpickle their function by module name, so the worker lives
here.  ``zero_runs`` runs in the test process (in-process mesh, global tensors) and in each
launched process (real mesh, this rank's blocks), so the test compares like with like.

Two problems, both float64 by default:

* ``mlp_problem``: a 2-layer MLP on a data-only mesh (every parameter replicated);
* ``tp_problem``: two Megatron MLP blocks (column- then row-parallel, ``psum`` over 'tensor')
  with replicated parameters in between, for a data x tensor mesh.  Two blocks, so that a
  gradient taken *inside* fpar.shard would be wrong for the first one; ZeRO must not rely on it.
"""

from __future__ import annotations

import optree
import torch

import fpar
import fpar.optim as fo
from fpar import P

F64 = torch.float64


def mlp_problem(d_in=4, hidden=8, d_out=3, batch=8, dtype=F64, seed=0):
    """``(params, (x, y))`` of the MLP regression problem, the same on every process."""
    g = torch.Generator().manual_seed(seed)
    params = {
        "w1": torch.randn(d_in, hidden, generator=g, dtype=dtype) / d_in**0.5,
        "b1": torch.randn(hidden, generator=g, dtype=dtype) / 4,
        "w2": torch.randn(hidden, d_out, generator=g, dtype=dtype) / hidden**0.5,
    }
    x = torch.randn(batch, d_in, generator=g, dtype=dtype)
    y = torch.randn(batch, d_out, generator=g, dtype=dtype)
    return params, (x, y)


def mlp_loss(params, batch):
    """Mean squared error of the MLP (per device: over its rows; unsharded: over all)."""
    x, y = batch
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"] - y) ** 2).mean()


TP_SPECS = {
    "a1": P(None, "tensor"),
    "b1": P("tensor", None),
    "g": P(),
    "a2": P(None, "tensor"),
    "b2": P("tensor", None),
    "c": P(),
}


def tp_problem(d=4, hidden=8, batch=8, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    params = {
        "a1": r(d, hidden) / 2,
        "b1": r(hidden, d) / 3,
        "g": r(d),
        "a2": r(d, hidden) / 2,
        "b2": r(hidden, d) / 3,
        "c": r(d) / 4,
    }
    return params, (r(batch, d), r(batch, d))


def tp_loss(p, batch):
    """Per device: two Megatron MLP blocks; the psums make the value replicated over 'tensor'."""
    x, y = batch
    h = fpar.psum(torch.tanh(x @ p["a1"]) @ p["b1"], "tensor") * p["g"]
    out = fpar.psum(torch.tanh(h @ p["a2"]) @ p["b2"], "tensor") + p["c"]
    return ((out - y) ** 2).mean()


def tp_loss_unsharded(p, batch):
    x, y = batch
    h = (torch.tanh(x @ p["a1"]) @ p["b1"]) * p["g"]
    out = torch.tanh(h @ p["a2"]) @ p["b2"] + p["c"]
    return ((out - y) ** 2).mean()


def remat_mlp_loss(params, batch):
    """``mlp_loss`` with its hidden layer checkpointed (replicated weights inside the region)."""
    x, y = batch
    h = fo.remat(lambda w, b, x: torch.tanh(x @ w + b))(params["w1"], params["b1"], x)
    return ((h @ params["w2"] - y) ** 2).mean()


def deep_problem(d=4, layers=3, batch=8, dtype=F64, seed=0):
    """``(params, (x, y))`` of a residual tanh MLP of ``layers`` square layers (for ZeRO-3's
    backward re-gather and its prefetch: every weight but the first is saved by autograd)."""
    g = torch.Generator().manual_seed(seed)
    params = {f"w{i}": torch.randn(d, d, generator=g, dtype=dtype) / d**0.5 for i in range(layers)}
    params.update({f"b{i}": torch.randn(d, generator=g, dtype=dtype) / 4 for i in range(layers)})
    x = torch.randn(batch, d, generator=g, dtype=dtype)
    y = torch.randn(batch, d, generator=g, dtype=dtype)
    return params, (x, y)


def deep_loss(params, batch):
    x, y = batch
    h = x
    for i in range(len(params) // 2):
        h = h + torch.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
    return ((h - y) ** 2).mean()


def stacked_problem(d=4, layers=3, batch=8, dtype=F64, seed=0):
    """``(params, (x, y))`` of ``deep_problem``'s model with its layers stacked: one ``[layers, ...]``
    leaf a weight, as ``fpar.plan.model_step`` and scanned models hold them."""
    params, batch = deep_problem(d, layers, batch, dtype, seed)
    stacked = {k: torch.stack([params[f"{k}{i}"] for i in range(layers)]) for k in ("w", "b")}
    return stacked, batch


def stacked_remat_loss(params, batch):
    """``deep_loss`` over stacked leaves, each layer checkpointed: remat saves each layer's slice
    of every stacked leaf, so ZeRO-3's backward unpacks ``layers`` views of each gathered leaf."""
    x, y = batch
    layer = fo.remat(lambda w, b, h: h + torch.tanh(h @ w + b))
    h = x
    for w, b in zip(params["w"].unbind(0), params["b"].unbind(0)):
        h = layer(w, b, h)
    return ((h - y) ** 2).mean()


def stacked_loss(params, batch):
    """``deep_loss`` over stacked leaves, the weights' rows by ``unbind``, the biases' by indexing."""
    x, y = batch
    h = x
    for i, w in enumerate(params["w"].unbind(0)):
        h = h + torch.tanh(h @ w + params["b"][i])
    return ((h - y) ** 2).mean()


_LOSSES = {
    "mlp": (mlp_problem, mlp_loss),
    "remat": (mlp_problem, remat_mlp_loss),
    "deep": (deep_problem, deep_loss),
    "stacked": (stacked_problem, stacked_remat_loss),
    "stacked_plain": (stacked_problem, stacked_loss),
    "stacked_odd": (lambda: stacked_problem(d=3, layers=5), stacked_loss),  # rows across chunk bounds
    "odd": (lambda: mlp_problem(hidden=5), mlp_loss),  # blocks of odd sizes: padded chunks
}


def zero_runs(jobs):
    """For each ``(stage, steps, loss[, donate[, opt[, n_micro[, reduce_once[, units]]]]])``: train with ZeRO ``stage`` on a data mesh
    of the world's size; ``loss`` is ``"mlp"`` (``mlp_loss``), ``"remat"`` (``remat_mlp_loss``) or
    ``"deep"`` (``deep_loss``); ``donate`` is ``zero_step``'s (default False); ``opt`` is
    ``"adamw"`` (default), ``"sgdm"`` (SGD with momentum and weight decay) or ``"bf16"`` (AdamW
    with bfloat16 compute); ``"odd"`` is ``mlp`` with blocks of odd sizes; ``n_micro`` and
    ``reduce_once`` are zero_step's; ``units``: a layer one ZeRO-3 unit.

    Returns per job: the full parameters after each step, the losses, and the communication
    counts of the first step.
    """
    return [_zero_run(*job) for job in jobs]


def _zero_run(
    stage: int,
    steps: int,
    loss: str = "mlp",
    donate: bool = False,
    opt: str = "adamw",
    n_micro: int = 1,
    reduce_once: bool = False,
    units: bool = False,
):
    problem, loss_fn = _LOSSES[loss]
    params, batch = problem()
    mesh = fpar.make_mesh((-1,), ("data",), devices=_world())
    # units: a layer's parameters one ZeRO-3 unit (the layer's number, the last character of a key)
    by = {k: k[-1] if k[-1].isdigit() else k for k in params} if units else None
    layout = fo.zero_layout(params, mesh, P(), stage=stage, units=by)
    opt = {
        "adamw": lambda: fo.adamw(1e-2, weight_decay=0.1),
        "sgdm": lambda: fo.sgd(1e-2, momentum=0.9, weight_decay=0.1),
        "bf16": lambda: fo.mixed_precision(fo.adamw(1e-2, weight_decay=0.1), compute_dtype=torch.bfloat16),
    }[opt]()
    params, state = fo.zero_init(opt, params, layout)
    batch = fpar.device_put(batch, mesh, P("data"))
    step = fo.zero_step(
        loss_fn, opt, layout, batch_specs=P("data"), donate=donate, n_micro=n_micro, reduce_once=reduce_once
    )
    history, losses, stats = [], [], None
    for i in range(steps):
        fpar.reset_comm_stats()
        before = _buffers(state, params)  # stages 1 and 2 gather the new parameters into the old buffers
        params, state, metrics = step(params, state, batch)
        if donate and mesh.backend == "dist" and _buffers(state, params) != before:
            raise AssertionError("a donated step on the real mesh did not update its state in place")
        if i == 0:
            stats = fpar.comm_stats()
        full = fpar.gather(fo.zero_params(params, layout), mesh, P())
        history.append({k: v.clone() for k, v in full.items()})  # a donated step overwrites params
        losses.append(metrics["loss"])
    return history, losses, stats


def zero3_tp_run(donate: bool, units: bool = False):
    """ZeRO-3 AdamW on a data=2 x tensor=2 mesh with ``tp_loss`` (Megatron blocks split over
    'tensor'): the full parameters after each of 2 steps; ``units``: each Megatron block's
    parameters one ZeRO-3 unit."""
    params, batch = tp_problem()
    mesh = fpar.make_mesh((2, 2), ("data", "tensor"), devices=4)
    if mesh.backend == "dist":
        params = fpar.device_put(params, mesh, TP_SPECS)
    by = {k: k[-1] if k[-1].isdigit() else k for k in TP_SPECS} if units else None
    layout = fo.zero_layout(params, mesh, TP_SPECS, stage=3, units=by)
    opt = fo.adamw(1e-2, weight_decay=0.1)
    params, state = fo.zero_init(opt, params, layout)
    step = fo.zero_step(tp_loss, opt, layout, batch_specs=P("data"), donate=donate)
    batch = fpar.device_put(batch, mesh, P("data"))
    history = []
    for _ in range(2):
        params, state, _ = step(params, state, batch)
        full = fpar.gather(fo.zero_params(params, layout), mesh, TP_SPECS)
        history.append({k: v.clone() for k, v in full.items()})
    return history


def _buffers(*trees) -> list[int]:
    """Addresses of the non-scalar tensors of ``trees`` (what a donated step updates in place)."""
    return [t.data_ptr() for t in optree.tree_leaves(trees) if isinstance(t, torch.Tensor) and t.dim() > 0]


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 2


def _stage3_history(params, batch, loss_of, steps: int, units=None) -> list:
    """ZeRO-3 AdamW on a data mesh of the world's size: the full parameters after each step.

    ``loss_of(mesh)`` makes the loss (it may look at the real mesh's gathered buffers); ``units``
    are ``zero_layout``'s."""
    mesh = fpar.make_mesh((-1,), ("data",), devices=_world())
    layout = fo.zero_layout(params, mesh, P(), stage=3, units=units)
    opt = fo.adamw(1e-2, weight_decay=0.1)
    params, state = fo.zero_init(opt, params, layout)
    batch = fpar.device_put(batch, mesh, P("data"))
    step = fo.zero_step(loss_of(mesh), opt, layout, batch_specs=P("data"))
    history = []
    for _ in range(steps):
        params, state, _ = step(params, state, batch)
        full = fpar.gather(fo.zero_params(params, layout), mesh, P())
        history.append({k: v.clone() for k, v in full.items()})
    return history


def zero3_units_run(layers: int = 6, steps: int = 3):
    """``zero3_lazy_run``'s model with a unit a layer (``w{i}`` and ``b{i}``): per step, the most
    buffers holding values as a layer starts and inside a layer (real mesh; in-process ``None``),
    and the full parameters after each step."""
    params, batch = deep_problem(layers=layers)
    units = {k: int(k[1:]) for k in params}
    resident: list = []

    def loss_of(mesh):
        def loss(p, batch):
            x, y = batch
            at_start, inside = [], []

            def count(into):
                if mesh.backend == "dist":
                    into.append(sum(t.untyped_storage().nbytes() > 0 for t in p.values()))

            h = x
            for i in range(layers):
                count(at_start)
                z = h @ p[f"w{i}"]
                count(inside)
                h = h + torch.tanh(z + p[f"b{i}"])
            resident.append((max(at_start), max(inside)) if at_start else None)
            return ((h - y) ** 2).mean()

        return loss

    return resident, _stage3_history(params, batch, loss_of, steps, units=units)


def zero3_compiled_layer_run() -> str:
    """A layer compiled on its own inside an eager ZeRO-3 step: the error's message (real mesh)."""
    params, batch = deep_problem(layers=2)
    layer = torch.compile(lambda h, w, b: h + torch.tanh(h @ w + b), backend="eager")

    def loss_of(mesh):
        def loss(p, batch):
            x, y = batch
            h = layer(layer(x, p["w0"], p["b0"]), p["w1"], p["b1"])
            return ((h - y) ** 2).mean()

        return loss

    try:
        _stage3_history(params, batch, loss_of, 3)  # the first step of a signature runs f eagerly
    except RuntimeError as e:
        return str(e)
    finally:
        torch._dynamo.reset()
    return "no error"


def zero3_rows_run(layers: int = 6, steps: int = 3, dtype=F64, units=None):
    """ZeRO-3 AdamW over ``stacked_problem``'s leaves (``w[layers, d, d]``, ``b[layers, d]``), each
    layer's rows taken by ``unbind`` (a scanned model): per step, the most rows the loss found holding
    values at once and whether a whole stacked leaf ever held values (real mesh only: each row is
    gathered at its first read and freed after its last; in-process ``None``), and the full
    parameters after each step.  ``units``: ``zero_layout``'s (``"layer"``: ``w`` and ``b`` one unit,
    so row ``r`` of both is one unit).
    """
    params, batch = stacked_problem(layers=layers, dtype=dtype)
    units = {"w": 0, "b": 0} if units == "layer" else units
    resident: list = []

    def loss_of(mesh):
        def loss(p, batch):
            x, y = batch
            rows = list(zip(p["w"].unbind(0), p["b"].unbind(0)))
            held, whole = [], False
            h = x
            for w, b in rows:
                if mesh.backend == "dist":
                    held.append(sum(t.untyped_storage().nbytes() > 0 for row in rows for t in row))
                    whole = whole or any(t.untyped_storage().nbytes() > 0 for t in p.values())
                h = h + torch.tanh(h @ w + b)
            resident.append((max(held), whole) if held else None)
            return ((h - y) ** 2).mean()

        return loss

    return resident, _stage3_history(params, batch, loss_of, steps, units=units)


def zero3_lazy_run(layers: int = 6, steps: int = 3):
    """ZeRO-3 AdamW over ``deep_problem``'s residual layers: per step, the most parameters the loss
    found holding their values at once (real mesh only: there each is gathered at its first read
    and freed after its last; in-process ``None``), and the full parameters after each step.

    The third step's forward reads ``w0`` once more than the others did (``+ 0.0 * w0.sum()``, the
    same values): a forward whose reads depend on values, whose second read of ``w0`` comes after
    the point where the previous forward had freed it.
    """
    params, batch = deep_problem(layers=layers)
    calls, resident = [0], []

    def loss_of(mesh):
        def loss(p, batch):
            x, y = batch
            held = []
            h = x
            for i in range(layers):
                if mesh.backend == "dist":
                    held.append(sum(t.untyped_storage().nbytes() > 0 for t in p.values()))
                z = h @ p[f"w{i}"]
                if i == 0 and calls[0] == 2:
                    z = z + 0.0 * p["w0"].sum()
                h = h + torch.tanh(z + p[f"b{i}"])
            calls[0] += 1
            resident.append(max(held) if held else None)
            return ((h - y) ** 2).mean()

        return loss

    return resident, _stage3_history(params, batch, loss_of, steps)


def zero3_units_backward_run(layers: int = 4, steps: int = 2, units: bool = True):
    """Layers ``h + tanh(h @ u_i) @ v_i`` (both weights saved for the backward), a unit a layer
    (``units``) or a leaf a unit: the most re-gathered parameters the backward held or had in
    flight at once (real mesh; in-process ``None``: nothing is gathered), and the full parameters
    after each step."""
    from fpar.optim import _zero_comm

    g = torch.Generator().manual_seed(0)
    d = 4
    params = {f"u{i}": torch.randn(d, d, generator=g, dtype=F64) / 2 for i in range(layers)}
    params |= {f"v{i}": torch.randn(d, d, generator=g, dtype=F64) / 2 for i in range(layers)}
    batch = (torch.randn(8, d, generator=g, dtype=F64), torch.randn(8, d, generator=g, dtype=F64))
    most = [0]
    unpack = _zero_comm.Regather._unpack

    def watched(self, x):  # what the backward holds as it hands a saved parameter back
        out = unpack(self, x)
        live = sum(p.storage is not None for p in self._params.values()) + len(self._inflight)
        most[0] = max(most[0], live)
        return out

    def loss(p, batch):
        x, y = batch
        h = x
        for i in range(layers):
            h = h + torch.tanh(h @ p[f"u{i}"]) @ p[f"v{i}"]
        return ((h - y) ** 2).mean()

    _zero_comm.Regather._unpack = watched
    try:
        by = {k: int(k[1:]) for k in params} if units else None
        history = _stage3_history(params, batch, lambda mesh: loss, steps, units=by)
    finally:
        _zero_comm.Regather._unpack = unpack
    import torch.distributed as dist

    return (most[0] if dist.is_initialized() else None), history
