"""Training steps that run unchanged on an abstract mesh, in-process and on a real mesh.

Each ``build(name, mesh)`` returns ``(step, args)``: the user's whole step (forward, backward,
optimizer update) and the arguments it is called with on that mesh.  Module-level workers for
``fpar.launch`` run a program on a real mesh and report what it sent and held in steady state.
"""

from __future__ import annotations

import gc
import sys
import types
from pathlib import Path

import torch

import fpar
import fpar.ops as ops
import fpar.optim as fo
import fpar.pipeline as pp
import fpar.plan
from fpar import P
from fpar.plan._record import Recorder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

D, H, B = 256, 1024, 16  # the MLP's width, hidden size, global batch
LAYERS = 4  # the *_donate ZeRO programs' layers
SMALL_BUCKET = 2**20  # zero1/2_donate's buckets: one leaf each (a bucket is not most of the model)

# name -> (mesh shape, axis names)
MESHES = {
    "dp": ((2,), ("data",)),
    "zero1": ((2,), ("data",)),
    "zero2": ((2,), ("data",)),
    "zero3": ((2,), ("data",)),
    "zero3_remat": ((2,), ("data",)),
    "zero2_stacked": ((2,), ("data",)),
    "zero3_stacked": ((2,), ("data",)),
    "zero3_micro": ((2,), ("data",)),
    "zero2_once": ((2,), ("data",)),
    "zero3_once": ((2,), ("data",)),
    "zero3_stacked_once": ((2,), ("data",)),
    "zero3_units": ((2,), ("data",)),
    "dp_donate": ((2,), ("data",)),
    "zero1_donate": ((2,), ("data",)),
    "zero2_donate": ((2,), ("data",)),
    "zero3_donate": ((2,), ("data",)),
    "tp": ((2, 2), ("data", "tensor")),
    "sp": ((1, 2), ("data", "tensor")),
    "sp_dots": ((1, 2), ("data", "tensor")),
    "pipeline": ((2, 1, 2), ("pipeline", "data", "tensor")),
    "pipeline_zero1": ((2, 2, 1), ("pipeline", "data", "tensor")),
    "pipeline_zero3": ((2, 2, 1), ("pipeline", "data", "tensor")),
    "pipeline_zero3_each": ((2, 2, 1), ("pipeline", "data", "tensor")),
    "pipeline_zero3_reshard": ((2, 2, 1), ("pipeline", "data", "tensor")),
    "moe": ((2,), ("expert",)),
}


def mesh_for(name: str, kind: str) -> fpar.Mesh:
    """The program's mesh: ``kind`` is ``"abstract"``, ``"local"`` or ``"dist"``."""
    shape, names = MESHES[name]
    if kind == "abstract":
        return fpar.plan.abstract_mesh(shape, names)
    return fpar.make_mesh(shape, names, backend=kind)


def _mlp_loss(params, batch):
    x, y = batch
    h = torch.relu(x @ params["w1"])
    return ((h @ params["w2"] - y) ** 2).mean()


def _layers_loss(params, batch):
    """A residual MLP whose every layer's weights are leaves of their own (FSDP's model: ZeRO-3
    on a real mesh gathers each at its first use and frees it after its last)."""
    x, y = batch
    for i in range(len(params) // 2):
        x = x + torch.relu(x @ params[f"a{i}"]) @ params[f"b{i}"]
    return ((x - y) ** 2).mean()


def _tp_loss(params, batch):
    x, y = batch
    out = ops.mlp(params, x, axis="tensor")
    return ((out - y) ** 2).mean()


def _stacked_loss(params, batch):
    """A residual MLP whose layers are stacked leaves (a scanned model), no recomputation."""
    x, y = batch
    for w, b in zip(params["w"].unbind(0), params["b"].unbind(0)):
        x = x + torch.relu(x @ w + b)
    return ((x - y) ** 2).mean()


def _stacked_remat_loss(params, batch):
    """A residual MLP whose layers are stacked leaves, each layer checkpointed (model_step's form)."""
    x, y = batch
    layer = fo.remat(lambda w, b, h: h + torch.relu(h @ w + b))
    for w, b in zip(params["w"].unbind(0), params["b"].unbind(0)):
        x = layer(w, b, x)
    return ((x - y) ** 2).mean()


ZERO_PROGRAMS = (
    "dp",
    "zero1",
    "zero2",
    "zero3",
    "zero3_remat",
    "zero2_stacked",
    "zero3_stacked",
    "zero3_micro",
    "zero2_once",
    "zero3_once",
    "zero3_stacked_once",
    "zero3_units",
    "dp_donate",
    "zero1_donate",
    "zero2_donate",
    "zero3_donate",
)


def build(name: str, mesh: fpar.Mesh):
    """``(step, args)`` of program ``name`` on ``mesh``."""
    g = torch.Generator().manual_seed(0)
    if name in ZERO_PROGRAMS:
        stage = {
            "dp": 0,
            "dp_donate": 0,
            "zero1": 1,
            "zero2": 2,
            "zero1_donate": 1,
            "zero2_donate": 2,
            "zero2_stacked": 2,
            "zero2_once": 2,
        }.get(name, 3)
        if name in ("zero3_remat", "zero2_stacked", "zero3_stacked", "zero3_stacked_once"):
            # Stacked leaves, taken by rows: ZeRO-3 gathers a layer's rows at a time (with
            # recomputation too); ZeRO-2 reduces each layer's gradient onto its chunk's rank as its
            # backward ends (``_zero_rows``)
            layers = 4
            loss = _stacked_loss if name.startswith("zero3_stacked") else _stacked_remat_loss
            params = {
                "w": torch.randn(layers, D, D, generator=g) * 0.05,
                "b": torch.randn(layers, D, generator=g) * 0.05,
            }
        elif name in ("zero1_donate", "zero2_donate", "zero3_donate", "zero3_units"):
            # 4 layers of leaves of their own: ZeRO-3 gathers a layer at a time; stages 1 and 2
            # reduce-scatter and gather a leaf a bucket
            loss = _layers_loss
            params = {f"a{i}": torch.randn(D, H, generator=g) * 0.05 for i in range(LAYERS)}
            params.update({f"b{i}": torch.randn(H, D, generator=g) * 0.05 for i in range(LAYERS)})
        else:
            loss = _mlp_loss
            params = {
                "w1": torch.randn(D, H, generator=g) * 0.05,
                "w2": torch.randn(H, D, generator=g) * 0.05,
            }
        params = fpar.device_put(params, mesh, P())
        # zero3_units: a unit a layer (a_i and b_i gathered together, two units held at most)
        units = {k: int(k[1:]) for k in params} if name == "zero3_units" else None
        layout = fo.zero_layout(params, mesh, stage=stage, data_axis="data", units=units)
        opt = fo.adamw(1e-3)
        params, state = fo.zero_init(opt, params, layout)
        # zero3_micro: FSDP with gradient accumulation, 2 microbatches a step
        # *_donate: the update writes the parameters and AdamW state in place (what the planner
        # must see on its meta tensors too: one copy of the state, not the old and the new)
        # *_once: 2 microbatches, their gradients summed unreduced and reduce-scattered once
        once = name.endswith("_once")
        micro = 2 if name == "zero3_micro" or once else 1
        donate = name.endswith(("_donate", "_stacked", "_once", "_units"))
        buckets = {"bucket_bytes": SMALL_BUCKET} if name in ("zero1_donate", "zero2_donate") else {}
        step = fo.zero_step(loss, opt, layout, n_micro=micro, donate=donate, reduce_once=once, **buckets)
        batch = fpar.device_put(
            (torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)), mesh, P("data")
        )
        return step, (params, state, batch)
    if name == "tp":
        specs = ops.mlp_specs("tensor")
        params = fpar.init(ops.init_mlp(D, H), mesh, specs, seed=0)
        layout = fo.zero_layout(params, mesh, specs, stage=1, data_axis="data")
        opt = fo.adamw(1e-3)
        params, state = fo.zero_init(opt, params, layout)
        step = fo.zero_step(_tp_loss, opt, layout)
        batch = fpar.device_put(
            (torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)), mesh, P("data")
        )
        return step, (params, state, batch)
    if name == "sp":
        specs = ops.gpt_specs(2, "tensor")
        params = fpar.init(ops.init_gpt(256, 64, 2, 32), mesh, specs, seed=0)

        def loss(params, batch):
            ids, targets = batch
            tok = ops.gpt_loss(params, ids, targets, axis="tensor", n_heads=4, sequence_parallel=True)
            return tok.mean()

        layout = fo.zero_layout(params, mesh, specs, stage=0, data_axis="data")
        opt = fo.adamw(1e-3)
        params, state = fo.zero_init(opt, params, layout)
        step = fo.zero_step(loss, opt, layout)
        ids = torch.randint(0, 256, (8, 32), generator=g)
        batch = fpar.device_put((ids, ids.roll(1, 1)), mesh, P("data"))
        return step, (params, state, batch)
    if name == "sp_dots":
        # sequence-parallel MLPs under save_dots: each keeps its row-parallel product's
        # reduce-scattered block, not the product (fpar/_recompute.py), and the real mesh's
        # recompute sends no reduce-scatter; activations (T = 512) outweigh the parameters
        specs = [ops.mlp_specs("tensor")] * 4
        params = fpar.init([ops.init_mlp(64, 128) for _ in specs], mesh, specs, seed=0)
        block = fo.remat(lambda p, x: x + ops.sp_mlp(p, x, axis="tensor"), policy=fo.save_dots)

        def loss(params, x):
            for p in params:
                x = block(p, x)
            return fpar.pmean((x**2).mean(), ("data", "tensor"))

        layout = fo.zero_layout(params, mesh, specs, stage=0, data_axis="data")
        opt = fo.adamw(1e-3)
        params, state = fo.zero_init(opt, params, layout)
        step = fo.zero_step(loss, opt, layout)
        x = fpar.device_put(torch.randn(8, 512, 64, generator=g), mesh, P("data", "tensor"))
        return step, (params, state, x)
    if name == "pipeline":
        import train_gpt as G

        args = types.SimpleNamespace(d_model=64, layers=4, seq=64, seed=0, heads=4)
        m = 4
        run = G.build_step(mesh, pp.one_f_one_b(2, m), 4, 2)
        params = G.init_params(args, mesh, torch.float32)
        opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-3))
        layout = fo.zero_layout(params, mesh, G.SPECS, stage=0, data_axis="data")
        params, state = fo.zero_init(opt, params, layout)
        update = fo.zero_update(opt, layout)
        ids = torch.randint(0, 256, (m, 8, 64), generator=g)
        xs = fpar.device_put(ids, mesh, P(None, "data"))
        ys = fpar.device_put(ids.roll(1, 2), mesh, P(None, "data"))
        key = fpar.random.key(0)

        def step(params, state, xs, ys, key):
            res = run(params, xs, ys, key)
            return update(res.grads, state, params), res.loss

        return step, (params, state, xs, ys, key)
    if name in ("pipeline_zero1", "pipeline_zero3"):
        # fpar.plan.model_step's pipeline with ZeRO inside (fpar.optim.zero_pipeline): each stage's
        # gradients reduce-scattered over data; ZeRO-3 gathers a stage once a step
        model = fpar.plan.Model("pipe-zero", 128, 4, 4, 4, 384, 256, 32)
        layout = fpar.plan.Layout(pipeline=2, data=2, zero=int(name[-1]), microbatches=4, batch=16)
        return fpar.plan.model_step(model, layout, mesh, dtype=torch.float32)
    if name == "pipeline_zero3_each":
        # interleaved over 2 chunks a stage, each chunk's gradient reduced onto its owners as its
        # backward ends (zero_pipeline's reduce_once=False), in bfloat16 compute: gathered in
        # bfloat16, the sums in float32
        model = fpar.plan.Model("pipe-zero", 128, 4, 4, 4, 384, 256, 32)
        layout = fpar.plan.Layout(
            pipeline=2, data=2, zero=3, microbatches=4, batch=16, virtual=2, reduce_once=False
        )
        return fpar.plan.model_step(model, layout, mesh, dtype=torch.bfloat16)
    if name == "pipeline_zero3_reshard":
        # the same, each chunk gathered for its own forward and backward and freed after
        # (zero_pipeline's reshard_after_forward=True), the gradients reduced once a step
        model = fpar.plan.Model("pipe-zero", 128, 4, 4, 4, 384, 256, 32)
        layout = fpar.plan.Layout(
            pipeline=2, data=2, zero=3, microbatches=4, batch=16, virtual=2, reshard_after_forward=True
        )
        return fpar.plan.model_step(model, layout, mesh, dtype=torch.bfloat16)
    if name == "moe":
        # A balanced router: token i's top-2 experts are i mod E and i + 1 mod E, so every device
        # sends every expert the same number of rows: the routing fpar.plan assumes on paper.
        t, d, h, e = 64, 32, 64, 4
        specs = ops.moe_specs("expert")
        params = {
            "router": torch.eye(d)[:, :e] * 4.0,
            "w_in": torch.randn(e, d, h, generator=g) * 0.1,
            "w_out": torch.randn(e, h, d, generator=g) * 0.1,
        }
        x = torch.zeros(t, d)
        x[torch.arange(t), torch.arange(t) % e] = 2.0
        x[torch.arange(t), (torch.arange(t) + 1) % e] = 1.0
        params = fpar.device_put(params, mesh, specs)
        x = fpar.device_put(x, mesh, P("expert"))

        def loss(p, x):
            y, aux = ops.moe(p, x, top_k=2, axis="expert")
            return fpar.pmean((y**2).mean() + 0.01 * aux, "expert")

        sharded = fpar.shard(loss, mesh, (specs, P("expert")), P())

        def step(params, x):
            grads = torch.func.grad(sharded)(params, x)
            return {k: params[k] - 0.1 * grads[k] for k in params}

        return step, (params, x)
    raise ValueError(name)


class RealRecorder(Recorder):
    """fpar.plan's recorder for a real mesh, noting each meta storage a step makes.

    On a real mesh every storage a step makes is memory but a meta one, which can only be a
    descriptor (a message's shape made to be counted).  ``fpar.plan``, whose every tensor is
    meta, cannot tell one from a buffer and counts it as memory: none may be made.
    """

    def __init__(self) -> None:
        super().__init__({})
        self.meta: list[tuple[int, str]] = []  # (bytes, category) of each meta storage made

    def _add(self, st, category: str) -> None:
        if st.device.type == "meta":
            self.meta.append((st.nbytes(), category))
        super()._add(st, category)


def steady(step, args, *, repeats: int = 3) -> tuple[dict, list[int]]:
    """Run ``step(*args)`` once to plan, then ``repeats`` times: the last call's traffic and each call's peak bytes."""
    rec = RealRecorder()
    peaks = []
    # every object made before the steps frozen: each collection below then scans only what the
    # steps made (0.2 s a collection of the whole heap with torch imported: half the test's time)
    gc.freeze()
    try:
        with rec:
            out = step(*args)
            del out
            gc.collect()
            for _ in range(repeats):
                rec.start()
                fpar.reset_comm_stats()
                out = step(*args)
                del out
                gc.collect()
                peaks.append(rec.peak)
    finally:
        gc.unfreeze()
    assert not rec.meta, f"meta storages made by a step on a real mesh (bytes, category): {rec.meta[:5]}"
    return fpar.comm_stats(), peaks


def real_worker(name: str) -> dict:
    """On a real mesh (``fpar.launch``): this rank's steady-state traffic, peak bytes and coordinates."""
    mesh = mesh_for(name, "dist")
    step, args = build(name, mesh)
    # seven steady steps: a gloo message's buffer is now and then released a step late (one buffer
    # more in that step's peak, measured on zero1 in about a third of the steps), so the median
    # of three could land on it
    comm, peaks = steady(step, args, repeats=7)
    return {"comm": comm, "peaks": peaks, "coords": dict(mesh._dist.coords)}


BY_SIZE = {
    2: (*ZERO_PROGRAMS, "sp", "sp_dots", "moe"),
    4: (
        "tp",
        "pipeline",
        "pipeline_zero1",
        "pipeline_zero3",
        "pipeline_zero3_each",
        "pipeline_zero3_reshard",
    ),
}


def real_programs(size: int) -> dict:
    """On a real mesh of ``size`` processes: every program of that size, one after the other."""
    return {name: real_worker(name) for name in BY_SIZE[size]}
