"""Real-mesh regressions: combinations a user reaches first, each once broken under torchrun.

Each body runs on gloo processes (``fpar.testing.distributed``) and compares with the same
program on the in-process mesh of the same shape, computed in every process.
"""

from __future__ import annotations

import pytest
import torch

import fpar
import fpar.optim as fo
from fpar import P
from fpar.testing import distributed

pytestmark = pytest.mark.multiprocess

F64 = torch.float64


def _mixed_specs_update(backend: str, shape: tuple, names: tuple) -> list:
    """AdamW with global-norm clipping over leaves of different specs, two steps (zero stage 0)."""
    mesh = fpar.make_mesh(shape, names, backend=backend)
    g = torch.Generator().manual_seed(0)
    specs = {"stage": P("pipeline", None, "tensor"), "first": P("tensor", None), "bias": P()}
    whole = {
        "stage": torch.randn(2, 3, 4, generator=g, dtype=F64),
        "first": torch.randn(4, 3, generator=g, dtype=F64),
        "bias": torch.randn(3, generator=g, dtype=F64),
    }
    params = fpar.device_put(whole, mesh, specs)
    opt = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(0.1))
    layout = fo.zero_layout(params, mesh, specs, stage=0, data_axis="data")
    params, state = fo.zero_init(opt, params, layout)
    update = fo.zero_update(opt, layout)
    out = []
    for step in range(2):
        grads = fpar.device_put(
            {k: torch.full_like(v, 0.3 * (step + 1)) + v for k, v in whole.items()}, mesh, specs
        )
        params, state = update(grads, state, params)
        out.append(fpar.gather(params, mesh, specs))
    return out


@distributed(2, timeout=120)
def _foreach_over_mixed_specs():
    # torch._foreach_* ops in the optimizer: each element's type is its own, not the union of the
    # list's (an axis of size 1 named by one leaf's spec made every update "vary" over it)
    for shape in ((1, 2, 1), (1, 1, 2)):
        names = ("pipeline", "data", "tensor")
        got = _mixed_specs_update("dist", shape, names)
        want = _mixed_specs_update("local", shape, names)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_optimizer_update_over_leaves_of_different_specs():
    _foreach_over_mixed_specs()


def _deferred_over_size_one(backend: str) -> dict:
    """Two microbatches, the first under defer_reduction, on data=2 x tensor=1.

    The activation ``x`` (split over 'data') is replicated over 'tensor', an axis of size 1, and
    meets the tensor-split weight: a sum over one device is no sum, so ``x`` is no gradient
    source (it was, and its deferral key, a new tensor each microbatch, never matched).
    """
    mesh = fpar.make_mesh((2, 1), ("data", "tensor"), backend=backend)
    g = torch.Generator().manual_seed(1)
    specs = {"a": P(None, "tensor"), "b": P("tensor", None)}
    w = fpar.device_put(
        {"a": torch.randn(3, 4, generator=g, dtype=F64), "b": torch.randn(4, 2, generator=g, dtype=F64)},
        mesh,
        specs,
    )
    xs = [fpar.device_put(torch.randn(4, 3, generator=g, dtype=F64), mesh, P("data")) for _ in range(2)]

    def loss(w, x):
        h = torch.tanh(x @ w["a"])
        return fpar.pmean(fpar.psum(h @ w["b"], "tensor").square().mean(), "data")

    f = fpar.shard(loss, mesh, (specs, P("data")), P())
    grad = torch.func.grad(f, argnums=(0, 1))  # the activation too, as a pipeline stage's
    total = None
    for _step in range(2):  # the second step runs the planned (fast) calls
        with fpar.defer_reduction():
            (g0, dx0) = grad(w, xs[0])
        (g1, dx1) = grad(w, xs[1])
        total = {k: g0[k] + g1[k] for k in g0}
    return fpar.gather((total, dx0, dx1), mesh, (specs, P("data"), P("data")))


@distributed(2, timeout=120)
def _defer_size_one():
    torch.testing.assert_close(
        _deferred_over_size_one("dist"), _deferred_over_size_one("local"), rtol=1e-12, atol=1e-12
    )


def test_deferred_gradients_with_an_axis_of_size_one():
    _defer_size_one()


def _deferred_activation(backend: str) -> list:
    """``.backward()`` over two microbatches, the first under defer_reduction, on tensor=2.

    The sharded function's input ``h`` is an activation (computed from the leaf ``s`` before the
    call), replicated over 'tensor' and meeting the tensor-split weight: its cotangent sum must
    happen in its own call's backward (it flows on to ``s``), never be deferred.  (Deferred, ``s``
    lost the first microbatch's gradient, and the final call, on a new ``h``, never matched.)
    """
    mesh = fpar.make_mesh((1, 2), ("data", "tensor"), backend=backend)
    g = torch.Generator().manual_seed(2)
    specs = {"a": P(None, "tensor"), "b": P("tensor", None)}
    whole = {"a": torch.randn(3, 4, generator=g, dtype=F64), "b": torch.randn(4, 2, generator=g, dtype=F64)}
    w = {k: v.requires_grad_() for k, v in fpar.device_put(whole, mesh, specs).items()}
    s = torch.full((3,), 0.5, dtype=F64, requires_grad=True)
    xs = [fpar.device_put(torch.randn(4, 3, generator=g, dtype=F64), mesh, P("data")) for _ in range(2)]

    def loss(w, h):
        return fpar.pmean(fpar.psum(torch.tanh(h @ w["a"]) @ w["b"], "tensor").square().mean(), "data")

    f = fpar.shard(loss, mesh, (specs, P("data")), P())
    out = []
    for _step in range(3):  # the first call of a signature is traced; later ones are planned
        with fpar.defer_reduction():
            f(w, xs[0] * s).backward()
        f(w, xs[1] * s).backward()
        out.append((fpar.gather({k: v.grad for k, v in w.items()}, mesh, specs), s.grad.clone()))
        for t in (*w.values(), s):
            t.grad = None
    return out


@distributed(2, timeout=120)
def _defer_activation():
    torch.testing.assert_close(
        _deferred_activation("dist"), _deferred_activation("local"), rtol=1e-12, atol=1e-12
    )


def test_an_activation_input_is_never_deferred():
    _defer_activation()


class _Scale(torch.autograd.Function):
    """``x * w`` with a backward of its own: the operands meet inside the forward."""

    generate_vmap_rule = True  # the in-process mesh is vmap

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


def _custom_function(backend: str, how: str) -> list:
    """A replicated weight meets an activation split over 'data' inside a custom Function.

    ``how``: "plain" (the meeting is inside the forward, where autograd records nothing),
    "pvary" (the user makes the weight vary first), "func" (``torch.func.grad``, under which
    torch hands the Function to the tracking mode whole), "no_grad" (values only).
    """
    mesh = fpar.make_mesh((2,), ("data",), backend=backend)
    g = torch.Generator().manual_seed(3)
    w = fpar.device_put(torch.randn(3, generator=g, dtype=F64), mesh, P()).requires_grad_()
    x = fpar.device_put(torch.randn(4, 3, generator=g, dtype=F64), mesh, P("data"))

    def loss(w, x):
        if how == "pvary":
            w = fpar.pvary(w, "data")
        return fpar.psum(_Scale.apply(x, w).square().sum(), "data")

    f = fpar.shard(loss, mesh, (P(), P("data")), P())
    out = []
    for _step in range(2):  # the first call of a signature is traced; the second is planned
        if how == "no_grad":
            with torch.no_grad():
                out.append(f(w, x))
        elif how == "func":
            out.append(torch.func.grad(f)(w, x))
        else:
            f(w, x).backward()
            out.append(w.grad.clone())
            w.grad = None
    return out


@distributed(2, timeout=120)
def _custom_function_sums():
    want = _custom_function("local", "plain")  # the in-process mesh sums w's gradient over 'data'
    for how in ("pvary", "func"):
        torch.testing.assert_close(_custom_function("dist", how), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        _custom_function("dist", "no_grad"), _custom_function("local", "no_grad"), rtol=1e-12, atol=1e-12
    )
    with pytest.raises(ValueError) as info:
        _custom_function("dist", "plain")
    assert str(info.value) == (
        "fpar.shard(loss): inside a custom torch.autograd.Function's forward, mul combines a value "
        "replicated over ('data',) whose gradient is summed over them with one varying over ('data',). "
        "Autograd records nothing inside that forward, so on a real mesh the Function's backward would "
        "return the replicated value's gradient without its sum over ('data',) (the in-process mesh "
        "sums it). Make the value vary before the Function: pass fpar.pvary(value, ('data',)) to it, "
        "or combine the two in an op of their own before the call."
    )


def test_a_custom_function_mixing_replicated_and_varying_values_sums_or_is_refused():
    # Once silently wrong: fpar.ops.rms_norm's custom Function met a replicated weight inside its
    # forward, and a real mesh's gradient missed its sum over 'tensor' (finetune_hf --pp 2)
    _custom_function_sums()


@distributed(2, timeout=120)
def _one_buffer_forms():
    # The all-gather's and reduce-scatter's one-buffer forms (every gather, and the reduce-scatter
    # off gloo: NCCL and fpar.plan's simulation) against the per-block list forms, on every dim.
    import torch.distributed as dist

    from fpar._dist.exchange import _gather_one_buffer, _scatter_one_buffer

    fpar.make_mesh((2,), ("x",))
    group, rank = dist.group.WORLD, dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 4, 2, generator=g, dtype=F64)
    for d in range(3):
        blocks = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(blocks, x, group=group)
        torch.testing.assert_close(
            _gather_one_buffer(x, d, True, 2, group), torch.cat(blocks, d), rtol=0, atol=0
        )
        torch.testing.assert_close(
            _gather_one_buffer(x, d, False, 2, group), torch.stack(blocks, d), rtol=0, atol=0
        )
        y = torch.randn(4, 6, 2, generator=g, dtype=F64).movedim(0, d)  # dim d of size 4, not contiguous
        for tiled in (True, False):
            z = y if tiled else y.narrow(d, 0, 2)
            chunks = [c.contiguous() for c in z.chunk(2, d)]
            want = torch.empty_like(chunks[0])
            dist.reduce_scatter(want, chunks, group=group)
            want = want if tiled else want.squeeze(d)
            torch.testing.assert_close(_scatter_one_buffer(z, d, tiled, 2, group), want, rtol=0, atol=0)


def test_one_buffer_gather_and_reduce_scatter_equal_the_per_block_forms():
    _one_buffer_forms()
