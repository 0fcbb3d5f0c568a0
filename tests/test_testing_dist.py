"""fpar.testing on a real mesh: ``distributed`` runs bodies on gloo processes; ``assert_equivalent``
places global inputs and gathers results there, and locates bugs exactly as in-process."""

from __future__ import annotations

import os
import time

import pytest
import torch

import fpar
from fpar import P
from fpar.testing import assert_equivalent, distributed

pytestmark = pytest.mark.multiprocess


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


ROW_SPECS = (P(None, "tensor"), P("tensor"))


def _pytree_layout(mesh):
    """A pytree of parameters (column- then row-split) and a replicated batch: values and
    gradients w.r.t. every leaf on the real mesh (the bug catalogue runs in the test below)."""
    x = _rand(4, 6, seed=1)
    params = {"w1": _rand(6, 8, seed=3), "w2": _rand(8, 6, seed=4)}

    def mlp(p, x):
        return fpar.psum(torch.tanh(x @ p["w1"]) @ p["w2"], "tensor")

    assert_equivalent(
        lambda p, x: torch.tanh(x @ p["w1"]) @ p["w2"],
        mlp,
        mesh,
        ({"w1": P(None, "tensor"), "w2": P("tensor")}, P()),
        P(),
        params,
        x,
    )


def _collective_sample():
    """A few programs ``prog(c, x)`` over a 2-device axis: (name, prog, block shape, out varies)."""
    n = 2
    return [
        ("psum", lambda c, x: c.psum(x, "tensor"), (2, 3), False),
        ("pmean", lambda c, x: c.pmean(x, "tensor"), (2, 3), False),
        ("pmax", lambda c, x: c.pmax(x, "tensor"), (2, 3), False),
        ("all_gather", lambda c, x: c.all_gather(x, "tensor", axis=1, tiled=True), (2, 3), True),
        (
            "psum_scatter",
            lambda c, x: c.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True),
            (2, 2 * n),
            True,
        ),
        ("ppermute", lambda c, x: c.ppermute(x, "tensor", [(0, 1), (1, 0)]), (2, 3), True),
        ("all_to_all", lambda c, x: c.all_to_all(x, "tensor", 1, 0, tiled=True), (2, 2 * n), True),
    ]


def _draw(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-5, 6, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype)


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)


def _collectives_on_every_dtype(mesh):
    """Every collective of the sample on every dtype: the real mesh against the reference."""
    from harness import FPAR
    from reference import shard_reference

    local = fpar.make_mesh((2,), ("tensor",), backend="local")
    for name, prog, block, varies in _collective_sample():
        for dtype in DTYPES:
            x = _draw((2 * block[0], *block[1:]), dtype, seed=len(name))
            out = P("tensor") if varies else P()

            def per_device(x, prog=prog):
                return prog(FPAR, x)

            per_device.__name__ = f"{name}_{dtype}"
            reference = shard_reference(prog, {"tensor": 2}, P("tensor"), out)
            try:
                reference(x)
            except RuntimeError:  # torch has no such op for this dtype (amax of bool): fpar neither
                for m in (local, mesh):
                    with pytest.raises(RuntimeError):
                        fpar.shard(per_device, m, P("tensor"), out)(fpar.device_put(x, m, P("tensor")))
                continue
            assert_equivalent(reference, per_device, mesh, P("tensor"), out, x)


def _matmul_routing_sample(mesh):
    """Each matmul/linear call form once, cycling through column-, row- (with psum) and
    batch-split layouts, float32 under autocast, bfloat16, float16 and int64, with and without a
    bias: the real mesh against the reference."""
    from harness import FPAR
    from reference import shard_reference
    from test_reference_dtypes import FORMS, product

    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float32)
    cases = [
        (form, ("column", "row", "batch")[i % 3], dtypes[i % len(dtypes)], i % 2 == 0)
        for i, form in enumerate(FORMS)
    ]
    # the weight and bias by keyword, replicated, meeting a split batch (implicit pvary of both)
    cases += [("linear-kw", "batch", torch.float32, True), ("linear-kw", "batch", torch.bfloat16, True)]
    for form, layout, dtype, bias in cases:
        autocast = dtype == torch.float32
        bias = bias and dtype.is_floating_point
        lead = (2,) if form in ("batched @", "broadcast @") else ()
        x_shape, w_shape = (*lead, 4, 4), ((2,) if form == "batched @" else ()) + (4, 6)
        pad_x, pad_w = (None,) * len(lead), (None,) * (len(w_shape) - 2)
        x_spec, w_spec, out_spec = {
            "column": (P(), P(*pad_w, None, "tensor"), P(*pad_x, None, "tensor")),
            "row": (P(*pad_x, None, "tensor"), P(*pad_w, "tensor"), P()),
            "batch": (P(*pad_x, "tensor"), P(), P(*pad_x, "tensor")),
        }[layout]
        b_spec = P("tensor") if layout == "column" else P()

        def prog(c, x, w, b, layout=layout, form=form, autocast=autocast):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = product(x, w, None if layout == "row" else b, form)
            if layout == "row":
                y = c.psum(y, "tensor")
                if b is not None:
                    y = y + b.to(y.dtype)
            return y

        def per_device(x, w, b, prog=prog):
            return prog(FPAR, x, w, b)

        per_device.__name__ = f"{form}_{layout}_{dtype}{'_autocast' if autocast else ''}"
        specs = (x_spec, w_spec, b_spec if bias else None)
        args = (_draw(x_shape, dtype, 1), _draw(w_shape, dtype, 2), _draw((6,), dtype, 3) if bias else None)
        low = torch.bfloat16 if autocast else dtype
        rtol, atol = fpar.testing.default_tolerance(low)
        reference = shard_reference(prog, {"tensor": 2}, specs, out_spec)
        assert_equivalent(reference, per_device, mesh, specs, out_spec, *args, rtol=2 * rtol, atol=8 * atol)


@distributed(2, timeout=150)
def test_kit_and_reference_sample_on_real_mesh():
    """One launch (processes are slow to start): a pytree layout, then a sample of the
    in-process property suite on gloo processes against the independent reference: every
    collective of the sample on float32, bfloat16, float16, int64, int32 and bool; each matmul and
    F.linear call form (by keyword too) under autocast and in low precision."""
    mesh = fpar.make_mesh((2,), ("tensor",))
    assert mesh.backend == "dist"
    _pytree_layout(mesh)
    _collectives_on_every_dtype(mesh)
    _matmul_routing_sample(mesh)


class _CountPlans:
    """Counts, on this process, the real-mesh plan caches built (``DistShard``) and traced calls."""

    def __enter__(self):
        from fpar._dist.shard import DistShard

        self.cls, self.shards, self.first = DistShard, [], 0
        self.init, self.first_call = DistShard.__init__, DistShard._first
        counter = self

        def init(shard, *args, **kwargs):
            counter.shards.append(shard)
            counter.init(shard, *args, **kwargs)

        def first(shard, *args, **kwargs):
            counter.first += 1
            return counter.first_call(shard, *args, **kwargs)

        DistShard.__init__, DistShard._first = init, first
        return self

    def __exit__(self, *exc):
        self.cls.__init__, self.cls._first = self.init, self.first_call


def _complex_parameter_gradients(mesh):
    """A replicated complex weight meeting a split batch: its implicit pvary sums its gradient
    over 'tensor', in the traced first call and in the fast later calls."""
    w = torch.complex(_rand(6, seed=3), _rand(6, seed=4))
    x = _rand(4, 6, seed=1)

    def complex_loss(w, x):
        return fpar.psum(((x.to(w.dtype) @ w).abs() ** 2).sum(), "tensor")

    def reference(w, x):
        return ((x.to(w.dtype) @ w).abs() ** 2).sum()

    assert_equivalent(reference, complex_loss, mesh, (P(), P("tensor")), P(), w, x)
    wr = w.clone().requires_grad_()
    (want,) = torch.autograd.grad(reference(wr, x), wr)
    with _CountPlans() as count:
        sharded = fpar.shard(complex_loss, mesh, (P(), P("tensor")), P())
        for call in range(3):
            wc = w.clone().requires_grad_()
            (got,) = torch.autograd.grad(sharded(wc, fpar.device_put(x, mesh, P("tensor"))), wc)
            torch.testing.assert_close(got, want, msg=lambda m, call=call: f"call {call}: {m}")
    (shard,) = count.shards
    assert count.first == 1 and [p.fast for p in shard.plans.values()] == [True]


def kw_layer(x, w, *, scale, bias, tag):
    """Row-parallel, with a keyword tensor used before the psum (its gradient is summed over
    'tensor') and one after it (not summed), and a static keyword."""
    assert tag == "kw"
    return fpar.psum((x * scale) @ w, "tensor") + bias


def _keyword_arguments(real, local):
    """Keyword arguments on the real mesh: values and gradients equal the in-process mesh's and
    the unsharded function's; the second call with the same keywords reuses the plan (fast)."""
    x, w, scale, bias = _rand(4, 6, seed=1), _rand(6, 5, seed=2), _rand(4, 1, seed=5), _rand(5, seed=6)
    ct = _rand(4, 5, seed=7)
    leaves = [t.clone().requires_grad_() for t in (x, w, scale, bias)]
    want = (leaves[0] * leaves[2]) @ leaves[1] + leaves[3]
    want_grads = torch.autograd.grad(want, leaves, ct)

    def run(sharded, mesh):
        xb, wb = (fpar.device_put(t, mesh, s).detach().requires_grad_() for t, s in zip((x, w), ROW_SPECS))
        s, b = scale.clone().requires_grad_(), bias.clone().requires_grad_()
        out = sharded(xb, wb, scale=s, bias=b, tag="kw")
        grads = list(torch.autograd.grad(out, [xb, wb, s, b], ct))
        if mesh.backend == "dist":
            grads[:2] = [fpar.gather(g, mesh, spec) for g, spec in zip(grads[:2], ROW_SPECS)]
        return out.detach(), grads

    in_process = run(fpar.shard(kw_layer, local, ROW_SPECS, P()), local)
    torch.testing.assert_close(in_process[0], want.detach())
    for g, r, name in zip(in_process[1], want_grads, ("x", "w", "scale", "bias")):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"in-process gradient w.r.t. {name}: {m}")
    with _CountPlans() as count:
        sharded = fpar.shard(kw_layer, real, ROW_SPECS, P())
        for call in range(2):
            out, grads = run(sharded, real)
            torch.testing.assert_close(out, in_process[0], rtol=1e-12, atol=1e-12)
            for g, r, name in zip(grads, in_process[1], ("x", "w", "scale", "bias")):
                torch.testing.assert_close(
                    g, r, rtol=1e-12, atol=1e-12, msg=lambda m, c=call, n=name: f"call {c}, {n}: {m}"
                )
        # the positional call's cache, and one per keyword signature: the second call hit it
        assert len(count.shards) == 2 and count.first == 1, (count.shards, count.first)
        assert [p.fast for p in count.shards[1].plans.values()] == [True]


def _calls_without_gradients_are_planned_fast(real, local):
    """A replicated input used both ways (met by the split batch, and plainly) makes the plan
    keep its sums at the uses: such a signature stays traced.  A call nothing can differentiate
    (no input requires grad, no torch.func transform: an optimizer update) is planned fast
    anyway, with the same values; a later call whose input requires grad is a signature of its
    own, traced, with the right gradient; and a closure-captured weight that requires grad keeps
    a no-grad call traced (a later call differentiates it)."""
    w, x = _rand(6, seed=2), _rand(4, 6, seed=1)
    want = (x * w).sum() + w.sum()

    def mixed(w, x):
        return fpar.psum((x * w).sum(), "tensor") + w.sum()

    xb = fpar.device_put(x, real, P("tensor"))
    with _CountPlans() as count:
        sharded = fpar.shard(mixed, real, (P(), P("tensor")), P())
        for _ in range(3):
            torch.testing.assert_close(sharded(w, xb), want, rtol=1e-12, atol=1e-12)
        assert [p.fast for p in count.shards[0].plans.values()] == [True]
        wr = w.clone().requires_grad_()
        for _ in range(2):
            (g,) = torch.autograd.grad(sharded(wr, xb), [wr])
            torch.testing.assert_close(g, x.sum(0) + 1, rtol=1e-12, atol=1e-12)
        assert [p.fast for p in count.shards[0].plans.values()] == [True, False]
        assert count.first == 2

    captured = w.clone().requires_grad_()
    with _CountPlans() as count:
        closure = fpar.shard(lambda x: mixed(captured, x), real, P("tensor"), P())
        with torch.no_grad():
            torch.testing.assert_close(closure(xb), want, rtol=1e-12, atol=1e-12)
        assert [p.fast for p in count.shards[0].plans.values()] == [False]
        (g,) = torch.autograd.grad(closure(xb), [captured])
        torch.testing.assert_close(g, x.sum(0) + 1, rtol=1e-12, atol=1e-12)
    in_process = fpar.shard(mixed, local, (P(), P("tensor")), P())(w, fpar.device_put(x, local, P("tensor")))
    torch.testing.assert_close(in_process, want, rtol=1e-12, atol=1e-12)


def _low_precision_rule(mesh):
    """fp16/bf16 sums and means over devices accumulate in float32 and round once, on the real
    mesh as in-process: a pmean whose sum overflows fp16 but whose mean fits returns the mean."""
    local = fpar.make_mesh((2,), ("tensor",), backend="local")
    for dtype in (torch.float16, torch.bfloat16):
        big = torch.full((2, 3), 40000.0 if dtype == torch.float16 else 3e38, dtype=dtype)
        mean = fpar.shard(lambda x: fpar.pmean(x, "tensor"), mesh, P("tensor"), P())
        assert torch.equal(mean(fpar.device_put(big, mesh, P("tensor"))), big[:1])
        x = _rand(2, 8, seed=3, dtype=dtype) * 100 + 1
        for name, prog, out in (
            ("psum", lambda x: fpar.psum(x, "tensor"), P()),
            ("pmean", lambda x: fpar.pmean(x, "tensor"), P()),
            (
                "psum_scatter",
                lambda x: fpar.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True),
                P(None, "tensor"),
            ),
        ):
            blocks = fpar.device_put(x, mesh, P("tensor"))
            got = fpar.gather(fpar.shard(prog, mesh, P("tensor"), out)(blocks), mesh, out)
            want = fpar.shard(prog, local, P("tensor"), out)(x)
            assert torch.equal(got, want), (name, dtype, got, want)


@distributed(2, timeout=150)
def test_kit_catches_layout_bugs_on_real_mesh_as_in_process():
    """The issue's "done when" on a real mesh: a missing psum, pmean for psum, a wrong custom
    backward, a value bug on one device and a gradient bug on one block are each caught with the
    same message as in-process; then complex parameters, keyword arguments, calls without
    gradients (planned fast), the low-precision rule and bf16/fp16 layers (MLP, ring attention, vocab CE) near the float32 model."""
    from layout_bugs import check_catches, without_numbers

    real = fpar.make_mesh((2,), ("tensor",))
    local = fpar.make_mesh((2,), ("tensor",), backend="local")
    assert real.backend == "dist" and local.backend == "local"
    assert without_numbers(check_catches(real)) == without_numbers(check_catches(local))
    _complex_parameter_gradients(real)
    _keyword_arguments(real, local)
    _calls_without_gradients_are_planned_fast(real, local)
    _low_precision_rule(real)
    from test_reference_dtypes import check_low_precision_layers

    for dtype in (torch.float16, torch.bfloat16):
        check_low_precision_layers(real, dtype)


@distributed(2, timeout=60)
def _rank1_raises():
    fpar.make_mesh((2,), ("tensor",))
    if torch.distributed.get_rank() == 1:
        raise ValueError("only rank 1 fails")


@distributed(2, timeout=4)
def _hangs():
    fpar.make_mesh((2,), ("tensor",))
    pids = os.environ["FPAR_TEST_PIDS"]
    with open(os.path.join(pids, str(torch.distributed.get_rank())), "w") as f:
        f.write(str(os.getpid()))
    if torch.distributed.get_rank() == 0:
        time.sleep(600)
    torch.distributed.barrier()


def test_distributed_names_the_failing_rank():
    with pytest.raises(fpar.LaunchError) as info:
        _rank1_raises()
    msg = str(info.value)
    assert msg.startswith("fpar.testing.distributed(_rank1_raises): ")
    assert "rank 1" in msg and "ValueError: only rank 1 fails" in msg


def test_distributed_timeout_stops_a_hang(tmp_path, monkeypatch):
    monkeypatch.setenv("FPAR_TEST_PIDS", str(tmp_path))  # the processes inherit it
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        _hangs()
    assert time.monotonic() - start < 60
    msg = str(info.value)
    assert msg.startswith(
        "fpar.testing.distributed(_hangs): the body did not finish within 4s on 2 processes"
    )
    assert "--- rank 0 ---" in msg and "_hangs" in msg
    pids = [int((tmp_path / str(r)).read_text()) for r in range(2)]
    assert not [pid for pid in pids if _running(pid)]  # no process outlives the call


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_distributed_rejects_local_functions():
    with pytest.raises(TypeError, match="define it at the top level of a module"):

        @distributed(2)
        def body():
            pass
