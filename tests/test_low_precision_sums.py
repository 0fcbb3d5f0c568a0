"""``fpar.low_precision_sums``: bf16/fp16 sums over devices in float32 (fpar's rule) or in their own dtype.

The references are computed here, independently of fpar: the blocks' float32 sum rounded once
(the default), their sum added in rank order in bf16 (native, in-process), and the exact float64
sum with the recursive-summation error bound (native, real mesh, whose order of additions is the
collective's).
"""

from __future__ import annotations

import pytest
import torch

import fpar
from fpar import P

BF16 = torch.bfloat16


def _blocks(n: int) -> torch.Tensor:
    """``n`` bf16 blocks of 64 values spanning three decades (sums that round)."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, 64, generator=g) * torch.logspace(0, 3, 64)).to(BF16)


def sums(mode: str, n: int) -> dict:
    """psum, pmean and psum_scatter of ``_blocks(n)`` over an ``n``-device axis, and their traffic."""
    mesh = fpar.make_mesh((n,), ("tensor",))
    x = fpar.device_put(_blocks(n).reshape(1, n * 64), mesh, P(None, "tensor"))

    def per_device(a):
        a = a.reshape(64)
        return fpar.psum(a, "tensor"), fpar.pmean(a, "tensor"), fpar.psum_scatter(a, "tensor", tiled=True)

    f = fpar.shard(per_device, mesh, (P(None, "tensor"),), (P(), P(), P("tensor")))
    with fpar.low_precision_sums(mode):
        fpar.reset_comm_stats()
        out = f(x)
        stats = fpar.comm_stats()
    got = fpar.gather(out, mesh, (P(), P(), P("tensor")))
    return {"psum": got[0], "pmean": got[1], "scatter": got[2], "stats": stats}


def _folded(blocks: torch.Tensor) -> torch.Tensor:
    acc = blocks[0]
    for b in blocks[1:]:
        acc = acc + b  # bf16 + bf16: rounded once per addition
    return acc


def test_default_sums_in_float32_rounded_once_native_in_rank_order():
    for n in (2, 4):
        x = _blocks(n)
        wide = x.float().sum(0).to(BF16)
        got = sums("float32", n)
        assert torch.equal(got["psum"], wide)
        assert torch.equal(got["scatter"], wide)
        assert torch.equal(got["pmean"], (x.float() / n).sum(0).to(BF16))
        native = sums("native", n)
        assert torch.equal(native["psum"], _folded(x))
        assert torch.equal(native["pmean"], _folded(x / n))  # each block divided first, as DDP
        assert torch.equal(native["scatter"], _folded(x))
        # float32 sums go as float32, native ones in bf16: half the bytes
        for kind, entry in got["stats"]["tensor"].items():
            assert native["stats"]["tensor"][kind]["bytes"] * 2 == entry["bytes"], kind
    # over two devices a sum is one addition, rounded once either way: the same bits
    assert torch.equal(sums("native", 2)["psum"], sums("float32", 2)["psum"])
    # over four, a rounding at each step: native differs from the float32 rule somewhere
    assert not torch.equal(sums("native", 4)["psum"], sums("float32", 4)["psum"])


def test_the_setting_is_scoped_by_with_and_global_when_called():
    x = _blocks(4)
    with fpar.low_precision_sums("native"):
        assert torch.equal(sums_now(4), _folded(x))
    assert torch.equal(sums_now(4), x.float().sum(0).to(BF16))
    previous = fpar.low_precision_sums("native")  # called plainly: from now on
    try:
        assert torch.equal(sums_now(4), _folded(x))
    finally:
        previous.__exit__(None, None, None)
    assert torch.equal(sums_now(4), x.float().sum(0).to(BF16))


def sums_now(n: int) -> torch.Tensor:
    """psum of ``_blocks(n)`` with whatever setting is active."""
    mesh = fpar.make_mesh((n,), ("tensor",))
    x = fpar.device_put(_blocks(n), mesh, P("tensor"))
    return fpar.shard(lambda a: fpar.psum(a, "tensor"), mesh, (P("tensor"),), P())(x)[0]


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"fpar.low_precision_sums: mode 'bf16'; use 'float32'"):
        fpar.low_precision_sums("bf16")
    with pytest.raises(ValueError, match=r"fpar.plan: sums='half'; choose 'float32'"):
        fpar.plan.model_step("tiny", fpar.plan.Layout(tensor=2, batch=2, sums="half"))


def tp_mlp(mode: str) -> dict:
    """Loss and gradients of a bf16 tensor-parallel MLP (column then row, a psum over 'tensor')."""
    mesh = fpar.make_mesh((2,), ("tensor",))
    g = torch.Generator().manual_seed(1)
    w1 = (torch.randn(16, 32, generator=g) * 0.3).to(BF16)
    w2 = (torch.randn(32, 16, generator=g) * 0.3).to(BF16)
    x = torch.randn(8, 16, generator=g).to(BF16)
    params = fpar.device_put({"w1": w1, "w2": w2}, mesh, {"w1": P(None, "tensor"), "w2": P("tensor", None)})

    def per_device(p, x):
        h = torch.tanh(x @ p["w1"]) @ p["w2"]
        return (fpar.psum(h, "tensor").float() ** 2).mean()

    f = fpar.shard(per_device, mesh, ({"w1": P(None, "tensor"), "w2": P("tensor", None)}, P()), P())
    with fpar.low_precision_sums(mode):
        fpar.reset_comm_stats()
        grads, loss = torch.func.grad_and_value(f)(params, x)
        stats = fpar.comm_stats()
    grads = fpar.gather(grads, mesh, {"w1": P(None, "tensor"), "w2": P("tensor", None)})
    return {"loss": loss, "grads": grads, "stats": stats}


def fp16_near_max(mode: str, n: int, *, compiled: bool = False) -> dict:
    """psum and pmean over ``n`` devices of fp16 blocks whose sum exceeds fp16's range but whose mean does not.

    ``compiled``: the call compiled whole after an eager one planned it (a real mesh's traced collectives).
    """
    mesh = fpar.make_mesh((n,), ("data",))
    x = torch.tensor([[40000.0, -40000.0, 1.0, 30000.0]] * n, dtype=torch.float16)
    f = fpar.shard(
        lambda a: (fpar.psum(a[0], "data"), fpar.pmean(a[0], "data")), mesh, (P("data"),), (P(), P())
    )
    with fpar.low_precision_sums(mode):
        out = f(fpar.device_put(x, mesh, P("data")))
        if compiled:
            g = torch.compile(f, backend="aot_eager", fullgraph=True)
            out = g(fpar.device_put(x, mesh, P("data")))
        total, mean = fpar.gather(out, mesh, (P(), P()))
    return {"psum": total, "pmean": mean}


@pytest.mark.parametrize("mode", ["float32", "native"])
def test_an_fp16_mean_does_not_overflow_where_it_fits(mode):
    # each block is divided by the device count before the sum, in either mode: the mean of
    # values near fp16's maximum is exact; their sum, which fp16 cannot hold, is inf either way
    got = fp16_near_max(mode, 4)
    assert torch.equal(got["pmean"], torch.tensor([40000.0, -40000.0, 1.0, 30000.0], dtype=torch.float16))
    assert (
        got["psum"][0] == float("inf") and got["psum"][1] == -float("inf") and got["psum"][3] == float("inf")
    )
    assert got["psum"][2] == 4.0


def _sums_on_four(mode: str) -> dict:
    return sums(mode, 4)


@pytest.mark.multiprocess
def test_real_mesh_follows_the_setting():
    # Two processes: both settings give the in-process mesh's bits (psum, pmean, psum_scatter,
    # and a bf16 tensor-parallel MLP's loss and gradients), native sums half the bytes.
    local = {mode: (sums(mode, 2), tp_mlp(mode)) for mode in ("float32", "native")}
    ranks = fpar.launch(_two, 2, timeout=120.0)
    for rank in ranks:
        for mode, (got, mlp) in rank["sums"].items():
            want, want_mlp = local[mode]
            for k in ("psum", "pmean", "scatter"):
                assert torch.equal(got[k], want[k]), (mode, k)
            assert got["stats"] == want["stats"], mode
            assert torch.equal(mlp["loss"], want_mlp["loss"]), mode
            for k in ("w1", "w2"):
                assert torch.equal(mlp["grads"][k], want_mlp["grads"][k]), (mode, k)
            assert mlp["stats"] == want_mlp["stats"], mode
            assert torch.equal(rank["fp16"][mode]["pmean"], fp16_near_max(mode, 2)["pmean"]), mode
            assert torch.equal(rank["fp16"][mode]["psum"], fp16_near_max(mode, 2)["psum"]), mode
            assert torch.equal(rank["fp16_compiled"][mode]["pmean"], fp16_near_max(mode, 2)["pmean"]), mode
    assert (
        local["native"][1]["stats"]["tensor"]["psum"]["bytes"] * 2
        == (local["float32"][1]["stats"]["tensor"]["psum"]["bytes"])
    )
    # Four processes: the float32 rule is bit for bit the in-process mesh's; a native sum adds
    # in the collective's order, each step rounded, within the recursive-summation bound of
    # the exact sum (3 roundings of at most half a bf16 unit of the running |sum|).
    four = fpar.launch(_four, 4, timeout=120.0)
    x = _blocks(4).double()
    bound = 3 * 2.0**-8 * x.abs().sum(0)
    for wide, native in four:
        want = sums("float32", 4)
        for k in ("psum", "pmean", "scatter"):
            assert torch.equal(wide[k], want[k]), k
        assert ((native["psum"].double() - x.sum(0)).abs() <= bound).all()
        assert ((native["scatter"].double() - x.sum(0)).abs() <= bound).all()
        # a native mean: each block divided first (exact: by 4), then the same bound, a quarter of it
        assert ((native["pmean"].double() - x.sum(0) / 4).abs() <= bound / 4).all()
        assert native["stats"] == sums("native", 4)["stats"]


def _two() -> dict:
    modes = ("float32", "native")
    return {
        "sums": {mode: (sums(mode, 2), tp_mlp(mode)) for mode in modes},
        "fp16": {mode: fp16_near_max(mode, 2) for mode in modes},
        "fp16_compiled": {mode: fp16_near_max(mode, 2, compiled=True) for mode in modes},
    }


def _four() -> tuple:
    return sums("float32", 4), sums("native", 4)


def _pieces(piece_bytes: int | None) -> dict:
    """A bf16 block of 8 x 64 per device reduce-scattered, summed and averaged over 2 devices, with
    ``PIECE_BYTES`` set to ``piece_bytes`` (``None``: as it is): results, messages, and the
    largest float32 copy the sums made."""
    from fpar._dist import exchange

    mesh = fpar.make_mesh((2,), ("tensor",))
    x = fpar.device_put(_blocks(16).reshape(8, 2 * 64), mesh, P(None, "tensor"))

    def per_device(a):
        return (
            fpar.psum_scatter(a, "tensor", scatter_dimension=1, tiled=True),
            fpar.psum(a, "tensor"),
            fpar.pmean(a, "tensor"),
        )

    f = fpar.shard(per_device, mesh, (P(None, "tensor"),), (P(None, "tensor"), P(), P()))
    kept = exchange.PIECE_BYTES
    exchange.PIECE_BYTES = kept if piece_bytes is None else piece_bytes
    try:
        fpar.reset_comm_stats()
        out = f(x)
        stats = fpar.comm_stats()
    finally:
        exchange.PIECE_BYTES = kept
    return {"out": fpar.gather(out, mesh, (P(None, "tensor"), P(), P())), "stats": stats}


def _pieces_two() -> tuple:
    return _pieces(None), _pieces(512)


@pytest.mark.multiprocess
def test_a_large_widened_sum_goes_in_pieces_with_the_same_bits():
    # A bf16 sum's float32 copy is made and sent a piece at a time where it exceeds PIECE_BYTES
    # (8 x 64 float32 = 2 KB in pieces of 512 bytes: 4 messages, cut along the unscattered dim):
    # the same bits as whole and as the in-process mesh, the same bytes sent.
    local = _pieces(None)
    x = _blocks(16).reshape(8, 2, 64).float()
    want = x.sum(1).to(BF16)
    assert torch.equal(local["out"][1], want)
    for whole, cut in fpar.launch(_pieces_two, 2, timeout=120.0):
        for got in (whole, cut):
            for a, b in zip(got["out"], local["out"]):
                assert torch.equal(a, b)
        for kind in ("psum_scatter", "psum", "pmean"):
            w, c = whole["stats"]["tensor"][kind], cut["stats"]["tensor"][kind]
            assert c["bytes"] == w["bytes"] and w["calls"] == 1 and c["calls"] == 4, (kind, w, c)


def test_plan_costs_either_setting():
    # fpar.plan.estimate runs the step with its layout's setting: the tensor axis's bf16 sums
    # (sequence parallelism's reduce-scatters) carry half the bytes with native sums; its float32
    # sums (the loss's statistics), its gathers and the data axis's float32 gradient sums do not
    # change.
    got = {}
    for mode in ("float32", "native"):
        layout = fpar.plan.Layout(data=2, tensor=2, batch=4, sums=mode)
        step, args = fpar.plan.model_step("tiny", layout)
        got[mode] = fpar.plan.estimate(step, *args).comm
    wide, native = got["float32"]["tensor"], got["native"]["tensor"]
    assert native["psum_scatter"]["calls"] == wide["psum_scatter"]["calls"] > 0
    assert native["psum_scatter"]["bytes"] * 2 == wide["psum_scatter"]["bytes"]
    assert {k: v for k, v in native.items() if k != "psum_scatter"} == {
        k: v for k, v in wide.items() if k != "psum_scatter"
    }
    assert got["native"]["data"] == got["float32"]["data"]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_call_follows_the_setting():
    # Dynamo guards on the setting: the compiled call traces again when it changes.
    mesh = fpar.make_mesh((4,), ("tensor",))
    x = _blocks(4)
    f = torch.compile(fpar.shard(lambda a: fpar.psum(a, "tensor"), mesh, (P("tensor"),), P()))
    assert torch.equal(f(x)[0], x.float().sum(0).to(BF16))
    with fpar.low_precision_sums("native"):
        assert torch.equal(f(x)[0], _folded(x))
    assert torch.equal(f(x)[0], x.float().sum(0).to(BF16))
