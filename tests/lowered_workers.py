"""Workers of ``test_lowered.py``: a real-mesh call under ``torch.func.grad``, lowered or not.

Each returns plain Python values and tensors (the test compares them with references computed in
the test process).  ``level`` is what ``maybe_current_level()`` reads inside the sharded
function: ``None`` where the call was lowered to plain autograd, the transform's level where not.
"""

from __future__ import annotations

import torch
from harness import peak_bytes
from torch._C._functorch import maybe_current_level

import fpar
from fpar import P
from fpar._dist.pending import Pending


def _data(seed: int = 0, d: int = 16, b: int = 8):
    g = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(d, d, generator=g, dtype=torch.float64) * 0.3,
        "b": torch.randn(d, generator=g, dtype=torch.float64),
    }
    x = torch.randn(b, d, generator=g, dtype=torch.float64)
    y = torch.randn(b, d, generator=g, dtype=torch.float64)
    return params, x, y


def reference(params, x, y, scale: float = 1.0):
    """The unsharded loss, aux and gradients of ``lowered_run``'s function (its mean over the batch)."""

    def loss(p):
        h = torch.tanh(x @ p["w"] + p["b"])
        return ((h - y) ** 2).mean() * scale, h.sum()

    grads, (value, aux) = torch.func.grad_and_value(loss, has_aux=True)(params)
    return value, aux, grads


def lowered_run():
    """grad_and_value (has_aux, a non-differentiated argument) three times, under no_grad, under nn.Parameters."""
    mesh = fpar.make_mesh((2,), ("data",))
    params, x, y = _data()
    levels = []

    def loss(p, x, y, scale):
        levels.append(maybe_current_level())
        h = torch.tanh(x @ p["w"] + p["b"])
        return fpar.pmean(((h - y) ** 2).mean() * scale, "data"), fpar.psum(h.sum(), "data")

    f = fpar.shard(loss, mesh, (P(), P("data"), P("data"), P()), (P(), P()))
    xs, ys = fpar.device_put(x, mesh, P("data")), fpar.device_put(y, mesh, P("data"))
    scale = torch.tensor(0.5, dtype=torch.float64)
    step = torch.func.grad_and_value(lambda p: f(p, xs, ys, scale), has_aux=True)
    got, pending = [], []
    for _ in range(3):
        grads, (value, aux) = step(params)
        pending.append(type(value) is Pending)  # a planned call's loss comes back unsettled (an alias)
        got.append((grads, float(value), float(aux)))

    # the call under torch.no_grad inside the transform: a constant there (no graph below either)
    def quiet(p):
        with torch.no_grad():
            value, _ = f(p, xs, ys, scale)
        return value + (p["w"] ** 2).sum()

    got.append((torch.func.grad(quiet)(params), None, None))
    # parameters autograd records outside the transform: not lowered (its results stay differentiable)
    leaves = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    grads, _ = step(leaves)
    outer = {k: v.requires_grad for k, v in grads.items()}
    got.append(({k: v.detach() for k, v in grads.items()}, None, None))
    return levels, pending, got, outer


def captured_run():
    """A sharded function that reads a differentiated tensor it was not given (a captured one)."""
    mesh = fpar.make_mesh((2,), ("data",))
    params, x, _ = _data(1)
    held: dict = {}
    levels = []

    def varying(w, x):  # the captured tensor meets the split batch
        levels.append(maybe_current_level())
        return fpar.pmean(torch.tanh(x @ (w + held["c"])).square().mean(), "data")

    def replicated(w, x):  # it meets replicated values only
        levels.append(maybe_current_level())
        return (x @ (w + held["c"])).sin().sum()

    fv = fpar.shard(varying, mesh, (P(), P("data")), P())
    fr = fpar.shard(replicated, mesh, (P(), P()), P())
    xs = fpar.device_put(x, mesh, P("data"))

    def lv(w):
        held["c"] = w * 2
        return fv(w, xs)

    def lr(w):
        held["c"] = w * 2
        return fr(w, x)

    out = []
    for fn in (lv, lr):
        for _ in range(2):
            out.append(torch.func.grad(fn)(params["w"]))
    return levels, out


def vjp_run():
    """torch.func.vjp through a sharded call (not lowered: its vjp_fn may be called again)."""
    mesh = fpar.make_mesh((2,), ("data",))
    params, x, _ = _data(2)
    levels = []

    def f(w, x):
        levels.append(maybe_current_level())
        return torch.tanh(x @ w)

    sf = fpar.shard(f, mesh, (P(), P("data")), P("data"))
    xs = fpar.device_put(x, mesh, P("data"))
    ct = torch.ones(x.shape[0] // 2, x.shape[1], dtype=torch.float64)
    out = []
    for _ in range(2):
        _, vjp_fn = torch.func.vjp(lambda w: sf(w, xs), params["w"])
        out.append((vjp_fn(ct)[0], vjp_fn(ct * 2)[0]))
    return levels, out


def memory_run(layers: int = 8, d: int = 64, b: int = 512):
    """Peak bytes of a deep MLP's step by torch.func.grad and by .backward(), the same sharded loss."""
    mesh = fpar.make_mesh((2,), ("data",))
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(d, d, generator=g) * d**-0.5 for _ in range(layers)]
    x = fpar.device_put(torch.randn(b, d, generator=g), mesh, P("data"))

    def loss(ws, x):
        h = x
        for w in ws:
            h = torch.tanh(h @ w)
        return fpar.pmean(h.square().mean(), "data")

    f = fpar.shard(loss, mesh, (P(), P("data")), P())
    grad = torch.func.grad(f)
    leaves = [w.clone().requires_grad_() for w in ws]

    def backward():
        f(leaves, x).backward()
        got = [w.grad for w in leaves]
        for w in leaves:
            w.grad = None
        return got

    by_grad, by_backward = grad(ws, x), backward()  # plans made, buffers kept
    assert all(torch.allclose(a, c) for a, c in zip(by_grad, by_backward))
    return peak_bytes(lambda: grad(ws, x)), peak_bytes(backward)
