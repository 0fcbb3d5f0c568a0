"""Programs for ``test_compile.py``: every ``torch.compile`` form over ``fpar.shard``, on either mesh.

Spawned processes import their function by module name, so what ``fpar.launch`` runs lives here.
:func:`run_forms` runs in the test process (in-process mesh) and in each of 2 gloo workers (real
mesh: each rank passes its own block of the batch), and returns per form the largest difference
from the *unsharded* function's gradient (or parameters after a few SGD steps), computed by plain
torch autograd in the same process, or the error the form raised.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import fpar
from fpar import P

F64 = torch.float64
D, H, B, STEPS, LR = 8, 16, 12, 3, 0.1


def _real() -> bool:
    return dist.is_available() and dist.is_initialized()


def _data():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(D, H, dtype=F64, generator=g) / D**0.5
    w2 = torch.randn(H, 1, dtype=F64, generator=g) / H**0.5
    x = torch.randn(B, D, dtype=F64, generator=g)
    y = torch.randn(B, 1, dtype=F64, generator=g)
    return w1, w2, x, y


def _unsharded(w1, w2, x, y):
    return ((torch.nn.functional.gelu(x @ w1) @ w2 - y) ** 2).mean()


def _per_device(w1, w2, x, y):
    # the data-parallel loss: its gradient needs the all-reduce of w1's and w2's cotangents
    return fpar.pmean(((torch.nn.functional.gelu(x @ w1) @ w2 - y) ** 2).mean(), "data")


def _tp_per_device(w1, w2, b, x, y):
    # Megatron MLP: w1 split by columns, w2 by rows; the psum sits between two compiled regions,
    # and b (replicated, used after it) gets no all-reduce
    h = torch.nn.functional.gelu(x @ w1) @ w2
    return ((fpar.psum(h, "data") + b - y) ** 2).mean()


def _tp_unsharded(w1, w2, b, x, y):
    return ((torch.nn.functional.gelu(x @ w1) @ w2 + b - y) ** 2).mean()


def _block(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return t.chunk(dist.get_world_size(), dim)[dist.get_rank()] if _real() else t


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _err(got, want) -> float:
    return max(float((g.detach() - w.detach()).abs().max()) for g, w in zip(got, want))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _fpar_frames() -> list[str]:
    """fpar's source files among the frames Dynamo has tried to compile since the last reset."""
    from torch._dynamo import convert_frame

    root = str(Path(fpar.__file__).parent)
    codes = (ref() for ref in convert_frame.input_codes.seen)
    return sorted(
        {c.co_filename[len(root) + 1 :] for c in codes if c is not None and c.co_filename.startswith(root)}
    )


def run_forms(backend: str = "aot_eager") -> dict:
    """Run every form; per form ``("ok", max |difference|, extra)`` or ``("error", type, message)``."""
    torch._dynamo.reset()
    mesh = fpar.make_mesh((dist.get_world_size() if _real() else 2,), ("data",))
    specs = (P(), P(), P("data"), P("data"))
    w1, w2, x, y = _data()
    xb, yb = _block(x), _block(y)
    ref_w = _leaves(w1, w2)
    want = torch.autograd.grad(_unsharded(*ref_w, x, y), ref_w)
    sl = fpar.shard(_per_device, mesh, specs, P())
    out: dict = {}

    def form(name, fn):
        try:
            out[name] = ("ok", *fn())
        except Exception as e:  # noqa: BLE001 - the test names the form that raised
            out[name] = ("error", type(e).__name__, str(e))

    def a_step_backward():
        def step(w1, w2, x, y):
            loss = sl(w1, w2, x, y)
            loss.backward()
            return loss

        ps = _leaves(w1, w2)
        step_c = torch.compile(step, backend=backend)
        for _ in range(2):  # the second call is the real mesh's fast (planned) call
            for p in ps:
                p.grad = None
            step_c(*ps, xb, yb)
        return _err([p.grad for p in ps], want), None

    def a_fullgraph():
        def step(w1, w2, x, y):
            loss = sl(w1, w2, x, y)
            return loss * 2

        torch.compile(step, backend=backend, fullgraph=True)(*_leaves(w1, w2), xb, yb)
        return 0.0, None

    def b_compile_grad():
        g = torch.compile(torch.func.grad(sl, argnums=(0, 1)), backend=backend)
        got = [g(w1, w2, xb, yb) for _ in range(2)][-1]
        return _err(got, want), None

    def c_compiled_per_device():
        before = _graphs()
        inner = fpar.shard(torch.compile(_per_device, backend=backend), mesh, specs, P())
        errs = []
        for _ in range(3):  # traced (eager) first call, then planned calls running compiled f
            ps = _leaves(w1, w2)
            inner(*ps, xb, yb).backward()
            errs.append(_err([p.grad for p in ps], want))
        for _ in range(2):  # torch.func.grad: on a real mesh the call runs below the transform
            # (fpar/_dist/lowered.py), compiled f as under .backward(); in-process f runs eagerly
            # (compiling under the transform would mark _per_device's code skipped, and
            # c_fullgraph's compile of the same code would then not even be attempted)
            errs.append(_err(torch.func.grad(inner, argnums=(0, 1))(w1, w2, xb, yb), want))
        return max(errs), _graphs() - before

    def d_step_with_optimizer():
        inner = fpar.shard(torch.compile(_per_device, backend=backend), mesh, specs, P())

        def step(params, opt):
            opt.zero_grad()
            loss = inner(*params, xb, yb)
            loss.backward()
            opt.step()
            return loss

        ps = _leaves(w1, w2)
        opt = torch.optim.SGD(ps, lr=LR, momentum=0.9)
        step_c = torch.compile(step, backend=backend)
        refs = _leaves(w1, w2)
        ref_opt = torch.optim.SGD(refs, lr=LR, momentum=0.9)
        for _ in range(STEPS):
            step_c(ps, opt)
            ref_opt.zero_grad()
            _unsharded(*refs, x, y).backward()
            ref_opt.step()
        return _err(ps, refs), None

    def c_tensor_parallel():
        b = torch.linspace(-1, 1, 1, dtype=F64)
        refs = _leaves(w1, w2, b)
        tp_want = torch.autograd.grad(_tp_unsharded(*refs, x, y), refs)
        tp_want = (_block(tp_want[0], 1), _block(tp_want[1], 0), tp_want[2])
        before = _graphs()
        inner = fpar.shard(
            torch.compile(_tp_per_device, backend=backend),
            mesh,
            (P(None, "data"), P("data"), P(), P(), P()),
            P(),
        )
        errs = []
        for _ in range(3):
            ps = _leaves(_block(w1, 1), _block(w2, 0), b)
            inner(*ps, x, y).backward()
            errs.append(_err([p.grad for p in ps], tp_want))
        return max(errs), _graphs() - before

    def c_fullgraph():
        inner = fpar.shard(torch.compile(_per_device, backend=backend, fullgraph=True), mesh, specs, P())
        for _ in range(2):  # the real mesh compiles on its second (planned) call
            inner(w1, w2, xb, yb)
        return 0.0, None

    form("a", a_step_backward)
    form("a_fullgraph", a_fullgraph)
    form("b", b_compile_grad)
    form("c", c_compiled_per_device)
    form("c_tp", c_tensor_parallel)
    form("c_fullgraph", c_fullgraph)
    form("d", d_step_with_optimizer)
    # What autograd calls back into fpar from a compiled step's backward (bucket hooks, the
    # collectives' backward, the Pending loss) runs as it is: Dynamo compiled no frame of fpar's.
    out["fpar_frames"] = _fpar_frames()
    return out


def run_compiled_inside(backend: str = "aot_eager") -> tuple:
    """A per-device function that compiles a helper on its first call, in a process that has not
    loaded Dynamo yet (``fpar._compile.eager``: fpar sets no stance before Dynamo is loaded).

    Returns whether Dynamo was loaded before the first call and, over 3 ``loss.backward()`` steps,
    the largest difference of the loss and of the gradients from the unsharded function's."""
    import sys

    loaded_before = "torch._dynamo" in sys.modules
    helper: list = []

    def per_device(w1, w2, x, y):
        if not helper:  # compiled inside the sharded call, on its first call
            helper.append(torch.compile(_unsharded, backend=backend))
        return fpar.pmean(helper[0](w1, w2, x, y), "data")

    mesh = fpar.make_mesh((dist.get_world_size() if _real() else 2,), ("data",))
    loss_fn = fpar.shard(per_device, mesh, (P(), P(), P("data"), P("data")), P())
    w1, w2, x, y = _data()
    ref = _leaves(w1, w2)
    want_loss = _unsharded(*ref, x, y)
    want = torch.autograd.grad(want_loss, ref)
    worst = 0.0
    for _ in range(STEPS):
        got = _leaves(w1, w2)
        loss = loss_fn(*got, _block(x), _block(y))
        loss.backward()
        worst = max(worst, abs(float(loss.detach() - want_loss.detach())), _err([g.grad for g in got], want))
    return loaded_before, worst
