"""Programs for tests/test_dist_faults.py, run on a real mesh by ``fpar.launch`` (importable)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import fpar
from fpar import P
from fpar._dist import agreement as dist_shard
from fpar._dist import pending

F64 = torch.float64


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return (type(e).__name__, str(e))
    return None


def _loss(w, x):
    return fpar.pmean(((x @ w) ** 2).mean(), "data")


def _sent(fn) -> list[int]:
    """Bytes of every buffer ``fn`` hands to ``dist.all_reduce`` (fpar calls it through the module)."""
    sizes, original = [], dist.all_reduce

    def wrapped(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = wrapped
    try:
        fn()
    finally:
        dist.all_reduce = original
    return sizes


def agreement_cases() -> dict:
    """Steady-state messages, mismatches after warm-up, a rank failing before its first collective."""
    mesh = fpar.make_mesh((2,), ("data",))
    r = dist.get_rank()
    out: dict = {}
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 2, generator=gen, dtype=F64), torch.randn(4, 3, generator=gen, dtype=F64)
    xl = fpar.device_put(x, mesh, P("data"))
    grad = torch.func.grad(fpar.shard(_loss, mesh, (P(), P("data")), P()))
    grad(w, xl)  # traced: plans the signature
    out["grad"] = grad(w, xl)
    out["dp_sent"] = _sent(lambda: grad(w, xl))
    local = fpar.shard(lambda t: t * 2, mesh, P("data"), P("data"))
    local(xl)
    out["local_sent"] = _sent(lambda: local(xl))
    out["local"] = local(xl)

    # after the cache is warm, rank 1 alone changes dtype: the carried check catches it
    loss = fpar.shard(_loss, mesh, (P(), P("data")), P())
    loss(w, xl)
    loss(w, xl)
    # (rank 0's planned call sends its check without waiting: the error comes at the first use)
    out["warm_dtype"] = _catch(lambda: float(loss(w.float(), xl.float()) if r == 1 else loss(w, xl)))

    # the same under torch.func.grad with rank 1 behind: rank 0's bucket rides in the call's
    # first message, with the check (its resend held in case some rank's did not ride), the
    # error comes on every rank, nothing is sent again (and the ranks stay in step: "sync" below)
    holds, hold = [], pending.hold
    reduced, all_reduce = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        reduced.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    def counted(send):
        holds.append(send)
        hold(send)

    def behind():
        if r == 1:
            time.sleep(0.3)
            return grad(w.float(), xl.float())
        return grad(w, xl)

    pending.hold, dist.all_reduce = counted, counting
    try:
        out["warm_dtype_grad"] = _catch(behind)
    finally:
        pending.hold, dist.all_reduce = hold, all_reduce
    out["held"] = len(holds)
    out["held_sent"] = reduced

    # rank 1's function raises before its first collective on a warm plan: rank 0 must not wait
    state = {"boom": False}

    def fragile(w, x):
        if state["boom"]:
            raise ZeroDivisionError("deliberate failure inside the function")
        return _loss(w, x)

    f = fpar.shard(fragile, mesh, (P(), P("data")), P())
    f(w, xl)
    state["boom"] = r == 1
    out["raised_before"] = _catch(lambda: f(w, xl).item())
    state["boom"] = False
    out["after_raise"] = f(w, xl)

    # one rank carries its block in the check, the other sends the check alone: the carried sum
    # is discarded and the collective runs as usual (values still right)
    g = fpar.shard(_loss, mesh, (P(), P("data")), P())
    g(w, xl)
    cap = dist_shard._CAP_BYTES
    dist_shard._CAP_BYTES = 0 if r == 1 else cap
    try:
        out["partial"] = g(w, xl).clone()  # read here (a detached loss is still in flight)
        out["partial_sent"] = _sent(lambda: g(w, xl).clone())
    finally:
        dist_shard._CAP_BYTES = cap
    out["loss"] = loss(w, xl)
    out["sync"] = fpar.shard(lambda t: fpar.psum(t, "data"), mesh, P(), P())(torch.ones(2, dtype=F64))
    return out


def riding_cases() -> dict:
    """The first gradient bucket riding in the call's first message, and when it cannot."""
    mesh = fpar.make_mesh((2,), ("data",))
    r = dist.get_rank()
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(16, 8, generator=gen), torch.randn(6, 16, generator=gen)
    xl = fpar.device_put(x, mesh, P("data"))
    f = fpar.shard(_loss, mesh, (P(), P("data")), P())
    out: dict = {}

    def stepper(w, xl):
        leaf = w.clone().requires_grad_()

        def step(read_early: bool = False):
            leaf.grad = None
            loss = f(leaf, xl)
            early = loss.item() if read_early else None
            loss.backward()
            return loss.item(), early, leaf.grad.clone()

        return step

    def wire():
        dtype, size = mesh._dist.root.wires[frozenset({"data"})].now
        return str(dtype), size

    step = stepper(w, xl)
    out["first"] = [step(), step()]  # traced; planned (its verdict grows the wire)
    out["wire"] = wire()
    got = []
    out["steady_sent"] = _sent(lambda: got.append(step()))
    out["steady"] = got[-1]
    # rank 0 reads its loss before the backward: its first message goes without the bucket, so
    # the bucket does not ride on any rank and every rank sends it again
    out["early_sent"] = _sent(lambda: got.append(step(read_early=r == 0)))
    out["early"] = got[-1]
    out["after_early_sent"] = _sent(lambda: got.append(step()))
    out["after_early"] = got[-1]
    # a float64 signature on the same mesh: the wire turns float64 (the float32 one fits in it)
    step64 = stepper(w.double(), xl.double())
    out["f64"] = [step64(), step64(), step64()]
    out["wire64"] = wire()
    out["f32_again"] = [step(), step()]
    out["wire_again"] = wire()

    # another collective between a call's forward and its backward (a second sharded call, a
    # pipeline's next microbatch): the waiting first message goes alone, and from then on this
    # plan sends it in the forward (no waiting for bucket 0 that costs a round trip a call)
    other = fpar.shard(lambda t: fpar.psum(t, "data"), mesh, P(), P())
    one = torch.ones(2)
    other(one)
    leaf = w.clone().requires_grad_()

    def interleaved():
        leaf.grad = None
        loss = f(leaf, xl)
        total = other(one)
        loss.backward()
        return loss.item(), total.clone(), leaf.grad.clone()

    out["interleaved_sent"] = [_sent(lambda: got.append(interleaved())) for _ in range(2)]
    out["interleaved"] = got[-2:]
    out["lone_sent"] = _sent(lambda: got.append(step()))
    out["lone"] = got[-1]
    for _ in range(dist_shard._WINDOW):
        step()
    out["wire_after"] = wire()  # nothing wants the room any more: back to the smallest wire
    return out


def carried_sum_plain_autograd() -> dict:
    """Plain autograd of planned calls whose first psum/pmean carries the check: no custom
    Function in the forward (the sum's history is an add, ``exchange._carried_plain``), first
    order by ``.backward()``, and a second order through the sum's cotangent (``grad_outputs``
    that require grad, ``create_graph``), which needs pvary's transpose (a psum)."""
    from fpar._dist import exchange

    mesh = fpar.make_mesh((2,), ("data",))
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 2, generator=gen, dtype=F64), torch.randn(4, 3, generator=gen, dtype=F64)
    u = torch.randn(3, 2, generator=gen, dtype=F64)
    xl = fpar.device_put(x, mesh, P("data"))
    out = {}
    for name, (local, plain) in _carried_losses().items():
        if plain is None:
            continue
        f = fpar.shard(local, mesh, (P(), P("data")), P())
        leaf = w.clone().requires_grad_()
        f(leaf, xl).backward()  # the first call of a signature plans it
        leaf.grad = None
        applied, original = [], exchange._Exchange.apply
        exchange._Exchange.apply = lambda *a, seen=applied, apply=original: seen.append(a[1]) or apply(*a)
        try:
            loss = f(leaf, xl)
        finally:
            exchange._Exchange.apply = original
        loss.backward()
        v = torch.tensor(1.7, dtype=F64, requires_grad=True)
        (g,) = torch.autograd.grad(f(leaf, xl), leaf, grad_outputs=v, create_graph=True)
        (dv,) = torch.autograd.grad((g * u).sum(), v)
        out[name] = {
            "functions": applied,
            "lazy": type(loss).__name__,
            "value": loss.detach().clone(),
            "grad": leaf.grad.clone(),
            "dv": dv,
        }
    return out


def random_schedules(seeds: list[int], length: int) -> dict:
    """Random sequences of data-parallel calls on one mesh, the same on every rank except where a
    rank reads its loss before the backward (drawn per rank): plain and ``torch.func.grad``
    steps, an early read, another sharded call between a forward and its backward, a float64
    signature, a forward never run backward, two meshes' worth of shapes.  Returns every loss
    and gradient, for the test to compare with the unsharded function."""
    import random

    mesh = fpar.make_mesh((2,), ("data",))
    r = dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    ws = {n: torch.randn(n, 4, generator=gen) for n in (8, 40)}  # a bucket under / over 64 elements
    xs = {n: torch.randn(6, n, generator=gen) for n in (8, 40)}
    f = fpar.shard(_loss, mesh, (P(), P("data")), P())
    other = fpar.shard(lambda t: fpar.psum(t, "data"), mesh, P(), P())
    out: dict = {}
    for seed in seeds:
        same, mine = random.Random(seed), random.Random(seed * 1000 + r)
        got = []
        for _ in range(length):
            n = same.choice((8, 40))
            dtype = same.choice((torch.float32, torch.float32, torch.float64))
            w, x = ws[n].to(dtype), fpar.device_put(xs[n].to(dtype), mesh, P("data"))
            action = same.choice(("backward", "func_grad", "between", "no_backward"))
            early = mine.random() < 0.3
            if action == "func_grad":
                g, loss = torch.func.grad_and_value(f)(w, x)
                got.append((n, str(dtype), float(loss), g))
                continue
            leaf = w.clone().requires_grad_()
            loss = f(leaf, x)
            value = loss.item() if early else None
            if action == "between":
                total = other(torch.ones(3, dtype=dtype))
                assert torch.equal(total, torch.full((3,), 2.0, dtype=dtype)), total
            if action == "no_backward":
                got.append((n, str(dtype), loss.item(), None))
                continue
            loss.backward()
            assert value is None or value == loss.item()
            got.append((n, str(dtype), loss.item(), leaf.grad))
        out[seed] = got
    return out


def dp_steps(steps: int) -> float:
    """A few warm data-parallel steps (bucketed async all-reduces), then a clean exit."""
    mesh = fpar.make_mesh((2,), ("data",))
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 2, generator=gen, dtype=F64), torch.randn(4, 3, generator=gen, dtype=F64)
    xl = fpar.device_put(x, mesh, P("data"))
    grad = torch.func.grad(fpar.shard(_loss, mesh, (P(), P("data")), P()))
    for _ in range(steps):
        w = w - 0.1 * grad(w, xl)
    f = fpar.shard(_loss, mesh, (P(), P("data")), P())
    leaf = w.clone().requires_grad_()
    for _ in range(3):  # planned, with the first bucket riding in the first message
        f(leaf, xl).backward()
    f(leaf, xl)  # a graph never run backward: its first message still waits for the bucket
    return float(w.sum())


def pending_cases() -> dict:
    """A planned call's loss, sent without waiting (fpar/_dist/pending.py), read every way a user
    reads a loss; and the gradient buckets' reused buffers."""
    import datetime
    import io

    mesh = fpar.make_mesh((2,), ("data",))
    r = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 2, generator=gen, dtype=F64), torch.randn(4, 3, generator=gen, dtype=F64)
    xl = fpar.device_put(x, mesh, P("data"))
    f = fpar.shard(_loss, mesh, (P(), P("data")), P())
    f(w.clone().requires_grad_(), xl)  # traced: plans the signature (requires_grad is part of it)
    out: dict = {}

    # Rank 1 enters its call only once rank 0's has returned: a forward that waited on the loss
    # pmean would deadlock here (until the store's timeout).
    store = dist.distributed_c10d._get_default_store()
    if r == 1:
        store.wait(["pending-returned"], datetime.timedelta(seconds=20))
    wl = w.clone().requires_grad_()
    loss = f(wl, xl)
    if r == 0:
        store.set("pending-returned", "1")
    loss.backward()  # reads only the loss's shape
    out["lazy"] = type(loss).__name__
    out["backward_grad"] = wl.grad.clone()
    saved = io.BytesIO()
    torch.save(loss, saved)
    saved.seek(0)
    out["reads"] = {
        "item": loss.item(),
        "float": float(loss),
        "times_two": (loss * 2).detach(),
        "tolist": loss.tolist(),
        "format": f"{loss:.6f}",
        "deepcopy": __import__("copy").deepcopy(loss.detach()),
        "numpy": float(loss.detach().numpy()),
        "repr": repr(loss.detach()),
        "saved": torch.load(saved),
    }
    grad, value = torch.func.grad_and_value(f)(w, xl)
    out["value"] = value.detach().clone()
    out["grad"] = grad.clone()

    # Buffers: a gradient still held is never overwritten by the next call; a dropped one's
    # buffer is reused.
    g = torch.func.grad(f)
    g(w, xl)
    held = g(w, xl)
    kept = held.clone()
    other = g(2 * w, xl)
    out["held_intact"] = torch.equal(held, kept)
    out["other"] = other.clone()
    ptr = other.data_ptr()
    del held, other
    again = g(w, xl)
    out["reused"] = again.data_ptr() == ptr
    out["again"] = again.clone()
    # .backward() twice without zeroing: .grad (a view of the first call's buffer) accumulates
    wl = w.clone().requires_grad_()
    f(wl, xl).backward()
    f(wl, xl).backward()
    out["accumulated"] = wl.grad.clone()
    return out


def _carried_losses():
    """Sharded losses whose first collective is a small psum/pmean over every axis (carried by
    the call's first message), each with its unsharded twin."""

    def head(w, x):
        return (x @ w) ** 2  # per-row terms, (rows, 2)

    return {
        "pmean": (lambda w, x: fpar.pmean(head(w, x).mean(), "data"), lambda w, x: head(w, x).mean()),
        "psum": (lambda w, x: fpar.psum(head(w, x).sum(), "data"), lambda w, x: head(w, x).sum()),
        # a vector rides along, and the function goes on with the sum
        "vector": (
            lambda w, x: (
                (fpar.pmean(head(w, x).mean(0), "data") * torch.tensor([1.0, -3.0], dtype=F64)).sum() + 1
            ),
            lambda w, x: (head(w, x).mean(0) * torch.tensor([1.0, -3.0], dtype=F64)).sum() + 1,
        ),
        # an infinite loss stays exactly inf (not inf - inf = nan through the history's add)
        "inf": (lambda w, x: fpar.pmean(head(w, x).mean() * float("inf"), "data"), None),
    }


def carried_sum_under_grad() -> dict:
    """``torch.func.grad`` of planned calls whose first psum/pmean carries the check: the sum
    comes back unsettled, with its history given by plain ops (``exchange._pending_sum``), no
    custom Function (~0.4 ms each under functorch)."""
    from fpar._dist import exchange

    mesh = fpar.make_mesh((2,), ("data",))
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 2, generator=gen, dtype=F64), torch.randn(4, 3, generator=gen, dtype=F64)
    xl = fpar.device_put(x, mesh, P("data"))
    out = {}
    for name, (local, _) in _carried_losses().items():
        g = torch.func.grad_and_value(fpar.shard(local, mesh, (P(), P("data")), P()))
        g(w, xl)  # the first call of a signature plans it (and waits)
        applied, original = [], exchange._Exchange.apply
        exchange._Exchange.apply = lambda *a, seen=applied, apply=original: seen.append(a[1]) or apply(*a)
        try:
            grad, value = g(w, xl)
        finally:
            exchange._Exchange.apply = original
        out[name] = {"functions": applied, "lazy": type(value).__name__, "value": value.clone(), "grad": grad}
    return out
