"""Module-level workers for fpar.launch (picklable): the same programs on a real mesh and in-process."""

from __future__ import annotations

import torch

import fpar
import fpar.ops as ops
from fpar import P

SEQ = P(None, "tensor")
VOCAB, D, LAYERS, T, N_HEADS = 16, 8, 2, 8, 4


def inputs():
    """Global float64 parameters, ids and q/k/v, the same in every process."""
    gen = torch.Generator().manual_seed(0)
    params = fpar.init(
        ops.init_gpt(VOCAB, D, LAYERS, T, dtype=torch.float64),
        fpar.make_mesh((1,), ("t",), backend="local"),
        ops.gpt_specs(LAYERS, "t"),
        seed=1,
    )
    ids = torch.randint(0, VOCAB, (2, T), generator=gen)
    qkv = torch.randn(3, 2, T, 2, 3, generator=gen, dtype=torch.float64)
    return params, ids, qkv


def programs(mesh):
    """Return {name: (loss and grads, traffic or None)} for the GPT (1D and SP) and ring attention on ``mesh``."""
    params, ids, qkv = inputs()
    specs = ops.gpt_specs(LAYERS)
    out = {}
    for sp in (False, True):

        def loss(p, ids, sp=sp):
            return ops.gpt_loss(p, ids, ids, axis="tensor", n_heads=N_HEADS, sequence_parallel=sp).mean()

        f = fpar.shard(loss, mesh, (specs, P()), P())
        placed = fpar.device_put(params, mesh, specs)
        fpar.reset_comm_stats()
        grads, value = torch.func.grad_and_value(f)(placed, ids)
        out[f"gpt sp={sp}"] = (value, fpar.gather(grads, mesh, specs), fpar.comm_stats())
        # The second call runs the real mesh's cached plan (no tracing, bucketed gradient sums).
        grads, value = torch.func.grad_and_value(f)(placed, ids)
        out[f"gpt sp={sp} again"] = (value, fpar.gather(grads, mesh, specs), None)

    # fpar.ops.rms_norm / swiglu (autograd Functions): the replicated weight's gradient is summed
    # over the devices the rows are split over, on the first (traced) call and the planned one
    x = torch.arange(2.0 * T * D, dtype=torch.float64).reshape(2 * T, D).sin()
    w = 1 + torch.arange(D, dtype=torch.float64) / 10

    def lean(x, w):
        return fpar.psum((ops.swiglu(ops.rms_norm(x, w), ops.rms_norm(x.flip(-1))) ** 2).sum(), "tensor")

    f = fpar.shard(lean, mesh, (P("tensor"), P()), P())
    xs = fpar.device_put(x, mesh, P("tensor"))
    for again in ("", " again"):
        fpar.reset_comm_stats()
        (gx, gw), value = torch.func.grad_and_value(f, argnums=(0, 1))(xs, w)
        out["lean" + again] = (
            value,
            (fpar.gather(gx, mesh, P("tensor")), gw),
            None if again else fpar.comm_stats(),
        )

    ring = fpar.shard(lambda q, k, v: ops.ring_attention(q, k, v, axis="tensor"), mesh, (SEQ,) * 3, SEQ)
    q, k, v = fpar.device_put(tuple(qkv), mesh, SEQ)
    fpar.reset_comm_stats()
    o, vjp = torch.func.vjp(ring, q, k, v)
    grads = vjp(torch.ones_like(o))
    out["ring"] = (fpar.gather(o, mesh, SEQ), fpar.gather(grads, mesh, SEQ), fpar.comm_stats())
    return out


def worker():
    """Run ``programs`` on the real mesh of all launched processes."""
    return programs(fpar.make_mesh((-1,), ("tensor",)))


def bucket_order():
    """The gradient-bucket order of a data x tensor GPT step's plan on a real mesh of this launch.

    Every rank must lay its buckets out the same way, whatever its ``PYTHONHASHSEED``.
    """
    from fpar._dist.shard import DistShard

    made = []
    init = DistShard.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    DistShard.__init__ = record
    try:
        # data=2: a sum over an axis of size 1 is none, so only 'data' makes gradient sources
        mesh = fpar.make_mesh((-1, 1), ("data", "tensor"))
        params, ids, _ = inputs()
        specs = ops.gpt_specs(LAYERS)

        def loss(p, ids):
            return fpar.pmean(ops.gpt_loss(p, ids, ids, axis="tensor", n_heads=N_HEADS).mean(), "data")

        f = fpar.shard(loss, mesh, (specs, P("data")), P())
        torch.func.grad(f)(fpar.device_put(params, mesh, specs), fpar.device_put(ids, mesh, P("data")))
    finally:
        DistShard.__init__ = init
    (plan,) = made[0].plans.values()
    return plan.fast, plan.in_order, [plan.in_reduce[i] for i in plan.in_order]


def _saved(f, *args) -> tuple[int, list]:
    """Bytes of the distinct activations autograd keeps for ``f``'s backward on this process, and
    their shapes: not the arguments' own storages, nor scalars (the mesh's device index)."""
    saved: dict = {}

    def pack(t):
        if t.dim():
            saved[t.untyped_storage()._cdata] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t

    leaves = [a.detach().requires_grad_() for a in fpar._tree.tree_flatten(args)[0]]
    args = fpar._tree.tree_unflatten(fpar._tree.tree_flatten(args)[1], leaves)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = f(*args)
    out.sum().backward()
    mine = {a.untyped_storage()._cdata for a in leaves}
    kept = [v for k, v in saved.items() if k not in mine]
    return sum(nbytes for nbytes, _ in kept), sorted(shape for _, shape in kept)


def sp_saved(b: int = 2, t: int = 8, d: int = 8) -> dict:
    """What a LayerNorm then ``sp_mlp`` keeps for the backward on this process (twice: the second
    call is a planned one), and the same layer written with a plain all-gather."""
    mesh = fpar.make_mesh((-1,), ("tensor",))
    p = fpar.init(ops.init_mlp(d, dtype=torch.float64), mesh, ops.mlp_specs(), seed=3)
    x = fpar.device_put(torch.randn(b, t, d, dtype=torch.float64), mesh, SEQ)

    def megatron(p, x):
        return ops.sp_mlp(p, torch.nn.functional.layer_norm(x, x.shape[-1:]), axis="tensor")

    def gathered(p, x):
        h = fpar.all_gather(torch.nn.functional.layer_norm(x, x.shape[-1:]), "tensor", axis=1, tiled=True)
        h = torch.nn.functional.gelu(h @ p["w_in"] + p["b_in"])
        return fpar.psum_scatter(h @ p["w_out"], "tensor", scatter_dimension=1, tiled=True) + p["b_out"]

    out = {}
    for name, fn in (("megatron", megatron), ("gathered", gathered)):
        f = fpar.shard(fn, mesh, (ops.mlp_specs(), SEQ), SEQ)
        out[name] = [_saved(f, p, x) for _ in range(2)]
    return out
