"""Jobs for ``test_defer.py``: gradient accumulation with deferred reduction on a real mesh.

``fpar.launch`` unpickles its function by module name, so the jobs live here at module level.
Every job returns plain values per rank (gradients of replicated parameters are the same on
every rank), or the error a misuse raised, so the test compares them with references computed
in the test process.
"""

from __future__ import annotations

import torch

import fpar
from fpar import P
from fpar._dist import buckets

D, H, D_OUT = 128, 1024, 128  # w1 and w2 are 1 MiB each in float64: two gradient buckets
ROWS = 16  # global batch rows (8 per rank, 2 per microbatch with n_micro=4)
N_MICRO = 4


def problem() -> dict:
    """Parameters and the global batch (float64), the same on every rank."""
    g = torch.Generator().manual_seed(3)
    params = {
        "w1": torch.randn(D, H, dtype=torch.float64, generator=g) / D**0.5,
        "b1": torch.randn(H, dtype=torch.float64, generator=g),
        "w2": torch.randn(H, D_OUT, dtype=torch.float64, generator=g) / H**0.5,
    }
    x = torch.randn(ROWS, D, dtype=torch.float64, generator=g)
    y = torch.randn(ROWS, D_OUT, dtype=torch.float64, generator=g)
    return {"params": params, "x": x, "y": y}


def mlp_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-device mean squared error of a 2-layer MLP, averaged over the data axis."""
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return fpar.pmean(((h @ params["w2"] - y) ** 2).mean(), "data")


def _two_losses(params: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """The MLP loss, and a second output that alone uses ``u``."""
    other = fpar.pmean((x[:, :5] * params["u"]).sum(), "data")
    return mlp_loss({k: v for k, v in params.items() if k != "u"}, x, y), other


def unsharded_grad(prob: dict) -> dict:
    """The reference: the gradient of the mean loss over the whole batch, in one process."""

    def loss(params):
        h = torch.tanh(prob["x"] @ params["w1"] + params["b1"])
        return ((h @ params["w2"] - prob["y"]) ** 2).mean()

    return torch.func.grad(loss)(prob["params"])


def _setup():
    mesh = fpar.make_mesh((-1,), ("data",))
    prob = problem()
    f = fpar.shard(mlp_loss, mesh, (P(), P("data"), P("data")), P())
    x, y = fpar.device_put((prob["x"], prob["y"]), mesh, P("data"))
    return mesh, prob["params"], f, x, y


def _micro(t: torch.Tensor, i: int) -> torch.Tensor:
    return t.chunk(N_MICRO)[i]


def accumulate_job() -> dict:
    """``fpar.optim.accumulate`` (deferred) against a plain loop (every microbatch reduced)."""
    mesh, params, f, x, y = _setup()

    def grad_fn(p, batch):
        return torch.func.grad_and_value(f)(p, *batch)

    acc = fpar.optim.accumulate(grad_fn, N_MICRO, mesh, (P("data"), P("data")))
    steps = []
    applied, original = [], buckets._Defer.apply
    buckets._Defer.apply = lambda *a: applied.append(a[1]) or original(*a)
    try:
        for _ in range(3):  # step 0 traces each signature's first call; later steps are warm
            fpar.reset_comm_stats()
            g, loss = acc(params, (x, y))
            steps.append({"grads": g, "loss": loss, "stats": fpar.comm_stats(), "functions": list(applied)})
            applied.clear()
    finally:
        buckets._Defer.apply = original
    # a parameter that only an output the loss ignores uses: its deferred slot (the gradient is
    # reduced over "data") never receives a cotangent
    two = fpar.shard(_two_losses, mesh, (P(), P("data"), P("data")), (P(), P()))
    acc_u = fpar.optim.accumulate(
        lambda p, batch: torch.func.grad_and_value(lambda p, x, y: two(p, x, y)[0])(p, *batch),
        N_MICRO,
        mesh,
        (P("data"), P("data")),
    )
    with_u = {**params, "u": torch.ones(5, dtype=torch.float64)}
    unused_grads = [acc_u(with_u, (x, y))[0] for _ in range(3)]
    fpar.reset_comm_stats()
    plain = None
    for i in range(N_MICRO):
        gi = torch.func.grad(f)(params, _micro(x, i), _micro(y, i))
        plain = gi if plain is None else {k: plain[k] + gi[k] for k in gi}
    plain_stats = fpar.comm_stats()
    # .backward() into .grad, with the context by hand
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    f(leaves, _micro(x, 0), _micro(y, 0)).backward()  # this signature's traced first call
    for t in leaves.values():
        t.grad = None
    with fpar.defer_reduction():
        for i in range(N_MICRO - 1):
            f(leaves, _micro(x, i), _micro(y, i)).backward()
    after_deferred = {k: v.grad for k, v in leaves.items()}
    f(leaves, _micro(x, N_MICRO - 1), _micro(y, N_MICRO - 1)).backward()
    # torch.func.grad under the context by hand: real zeros, which the caller may write into
    # (accumulate gets expanded zeros it skips; neither they nor a sum of them leave it)
    with fpar.defer_reduction():
        g0 = torch.func.grad(f)(params, _micro(x, 0), _micro(y, 0))
    writable = all(t.add_(1).eq(1).all().item() for t in g0.values())
    gn = torch.func.grad(f)(params, _micro(x, 1), _micro(y, 1))
    # A signature's first (traced) call inside the context defers like a steady call, so the step
    # it starts adds the microbatches in the steady steps' order: bitwise equal (a resumed run's
    # first step traces, the uninterrupted run's same step does not)
    fresh = fpar.shard(mlp_loss, mesh, (P(), P("data"), P("data")), P())
    first_steps = []
    for _ in range(2):
        for t in leaves.values():
            t.grad = None
        with fpar.defer_reduction():
            for i in range(N_MICRO - 1):
                fresh(leaves, _micro(x, i), _micro(y, i)).backward()
        fresh(leaves, _micro(x, N_MICRO - 1), _micro(y, N_MICRO - 1)).backward()
        first_steps.append({k: v.grad.clone() for k, v in leaves.items()})
    returned = steps[-1]["grads"]
    return {
        "unused": unused_grads,
        "direct_zeros_writable": writable,
        "direct_sum": {k: (g0[k] - 1 + gn[k]) / 2 for k in gn},
        "returned_writable": all(t.stride() != (0,) * t.dim() and t.add_(0) is t for t in returned.values()),
        "steps": steps,
        "plain": {k: v / N_MICRO for k, v in plain.items()},
        "plain_stats": plain_stats,
        "backward": {k: v.grad / N_MICRO for k, v in leaves.items()},
        "after_deferred": after_deferred,
        "first_steps": first_steps,
    }


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # the test pins type and message
        return type(e).__name__, str(e)
    return None


def misuse_job() -> dict:
    """Each misuse of deferral, and the error it raises (the same on every rank)."""
    mesh, params, f, x, y = _setup()
    grad = torch.func.grad(f)
    grad(params, _micro(x, 0), _micro(y, 0))  # warm both signatures: later calls run fast plans
    f({k: v.clone().requires_grad_() for k, v in params.items()}, _micro(x, 0), _micro(y, 0)).backward()
    out = {}

    def in_place():
        p = {k: v.clone() for k, v in params.items()}
        with fpar.defer_reduction():
            grad(p, _micro(x, 0), _micro(y, 0))
        p["w1"].add_(1.0)
        grad(p, _micro(x, 1), _micro(y, 1))

    out["in_place"] = _error(in_place)

    def never_final():
        with fpar.defer_reduction():
            grad(params, _micro(x, 0), _micro(y, 0))
        with fpar.defer_reduction():  # the next step, without the last call of the previous one
            grad(params, _micro(x, 1), _micro(y, 1))

    out["never_final"] = _error(never_final)

    def final_backward_first():
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        with fpar.defer_reduction():
            early = f(leaves, _micro(x, 0), _micro(y, 0))
        last = f(leaves, _micro(x, 1), _micro(y, 1))
        last.backward()
        early.backward()

    out["final_backward_first"] = _error(final_backward_first)

    def new_tensors_each_microbatch():
        def grad_fn(p, batch):
            cast = {k: v * 1.0 for k, v in p.items()}  # new tensors per microbatch
            return grad(cast, *batch), torch.zeros(())

        fpar.optim.accumulate(grad_fn, N_MICRO, mesh, (P("data"), P("data")))(params, (x, y))

    out["new_tensors"] = _error(new_tensors_each_microbatch)
    rank = torch.distributed.get_rank()

    def ranks_disagree():  # rank 0 defers one more microbatch than the others
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        with fpar.defer_reduction():
            for i in range(2 if rank == 0 else 1):
                f(leaves, _micro(x, i), _micro(y, i)).backward()
        f(leaves, _micro(x, 2), _micro(y, 2)).backward()

    out["ranks_disagree"] = _error(ranks_disagree)

    def ranks_disagree_accumulate():  # 4 microbatches on rank 0, 2 of the same size on the others
        n = N_MICRO if rank == 0 else 2
        rows = x.shape[0] * n // N_MICRO
        fpar.optim.accumulate(
            lambda p, batch: torch.func.grad_and_value(f)(p, *batch), n, mesh, (P("data"), P("data"))
        )(params, (x[:rows], y[:rows]))

    out["ranks_disagree_accumulate"] = _error(ranks_disagree_accumulate)

    def after_errors():  # the state is clean again: a correct step works
        with fpar.defer_reduction():
            g0 = grad(params, _micro(x, 0), _micro(y, 0))
        g1 = grad(params, _micro(x, 1), _micro(y, 1))
        return {k: g0[k] + g1[k] for k in g0}

    out["recovered"] = after_errors()
    out["recovered_plain"] = {
        k: a + b
        for (k, a), b in zip(
            grad(params, _micro(x, 0), _micro(y, 0)).items(),
            grad(params, _micro(x, 1), _micro(y, 1)).values(),
        )
    }
    return out


def reuse_job() -> dict:
    """Steps whose deferred sums reuse the plan's kept buffers, while earlier steps' gradients live.

    Each step scales the inputs differently, so a buffer handed out while a previous step's
    gradients still view it would show up as that step's gradients changing.  Both forms: the
    ``.backward()`` one (``_Defer``) and ``fpar.optim.accumulate``'s (per-tensor hooks, and the
    means it returns, kept in its own buffers).
    """
    mesh, params, f, x, y = _setup()
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}

    def backward_step(scale: float) -> dict:
        for t in leaves.values():
            t.grad = None
        with fpar.defer_reduction():
            for i in range(N_MICRO - 1):
                f(leaves, _micro(x, i) * scale, _micro(y, i)).backward()
        f(leaves, _micro(x, N_MICRO - 1) * scale, _micro(y, N_MICRO - 1)).backward()
        return {k: v.grad for k, v in leaves.items()}

    acc = fpar.optim.accumulate(
        lambda p, batch: torch.func.grad_and_value(f)(p, *batch), N_MICRO, mesh, (P("data"), P("data"))
    )
    backward_step(1.0)  # the signature's traced first call
    acc(params, (x, y))
    # Gradients dropped before the next step: its sums land in the same memory (no fresh pages).
    ptrs, acc_ptrs = [], []
    for _ in range(2):
        g = backward_step(1.0)
        ptrs.append({k: v.data_ptr() for k, v in g.items()})
        del g
        g = acc(params, (x, y))[0]
        acc_ptrs.append({k: v.data_ptr() for k, v in g.items()})
        del g
    scales = (1.0, 0.5, 2.0)
    held = [backward_step(s) for s in scales]  # every step's gradients held while the next ones run
    held_acc = [acc(params, (x * s, y))[0] for s in scales]
    return {
        "scales": scales,
        "backward": [{k: v / N_MICRO for k, v in g.items()} for g in held],
        "accumulate": held_acc,
        "same_memory": ptrs[0] == ptrs[1],
        "accumulate_same_memory": acc_ptrs[0] == acc_ptrs[1],
    }


def run(jobs: list) -> list:
    """Run the named jobs in order (one launch for all of them)."""
    return [globals()[name]() for name in jobs]
