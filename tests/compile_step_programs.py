"""Programs for ``test_compile_step.py``: a whole training step under ``torch.compile(fullgraph=True)``.

Spawned processes import their function by module name, so what ``fpar.launch`` runs lives here.
Each program trains a small GPT (``fpar.ops.gpt_loss``, data x tensor) for a few steps twice from
the same parameters: eagerly, and with the step compiled whole (the sharded loss, its backward
and an ``fpar.optim`` AdamW update in one graph), after one eager step that plans the sharded
call's signature.  It returns the largest differences of the losses and parameters (float64).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import fpar
import fpar.ops as ops
import fpar.optim as fo
from fpar import P

F64 = torch.float64
V, D, L, T, B, HEADS, STEPS = 32, 16, 1, 8, 4, 4, 3


def _autograd_ops_traced(program):
    """Run ``program`` with Dynamo's ``trace_autograd_ops`` on (``loss.backward()`` inside a
    compiled step), restoring it after: left on, it changed how later tests' eager ZeRO steps ran
    in the same pytest process."""

    @functools.wraps(program)
    def run(*args, **kwargs):
        import torch._dynamo

        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return program(*args, **kwargs)

    return run


def _setup(shape):
    mesh = fpar.make_mesh(shape, ("data", "tensor"))
    specs = ops.gpt_specs(L, "tensor")
    params = fpar.init(ops.init_gpt(V, D, L, T, dtype=F64), mesh, specs, seed=0)

    def per_device(params, ids, targets):
        loss = ops.gpt_loss(params, ids, targets, axis="tensor", n_heads=HEADS).mean()
        return fpar.pmean(loss, "data")

    loss_fn = fpar.shard(per_device, mesh, (specs, P("data"), P("data")), P())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    if dist.is_initialized():  # this process's rows of the batch
        data = mesh._dist.coords["data"]
        ids, targets = ids.chunk(shape[0])[data], targets.chunk(shape[0])[data]
    return params, loss_fn, ids, targets


def _make_step(loss_fn, opt, form: str):
    def step(params, state, ids, targets):
        leaves, treedef = torch.utils._pytree.tree_flatten(params)
        loss = loss_fn(params, ids, targets)
        if form == "backward":
            loss.backward()
            grads = [p.grad for p in leaves]
        else:
            grads = list(torch.autograd.grad(loss, leaves))
        grads = torch.utils._pytree.tree_unflatten(grads, treedef)
        updates, state = opt.update(grads, state, params)
        new = fo.apply_updates(params, updates)
        with torch.no_grad():
            for p, q in zip(leaves, torch.utils._pytree.tree_leaves(new)):
                p.copy_(q)
                p.grad = None
        return loss.detach(), state

    return step


def _train(params, loss_fn, ids, targets, form: str, compiled: bool, backend: str):
    params = torch.utils._pytree.tree_map(lambda t: t.detach().clone().requires_grad_(), params)
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    step = _make_step(loss_fn, opt, form)
    losses = []
    for i in range(STEPS):
        if compiled and i > 0:  # step 0 eager: it plans the sharded call's signature
            if i == 1:
                step = torch.compile(step, backend=backend, fullgraph=True)
        loss, state = step(params, state, ids, targets)
        losses.append(loss)
    return params, losses


def _diff(a, b) -> float:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(la, lb))


@_autograd_ops_traced
def run_gpt_steps(
    cases=(((2, 1), "backward"), ((1, 2), "autograd_grad")), backend: str = "aot_eager"
) -> dict:
    """Per (mesh shape, form): the largest |eager - compiled| of the losses and of the parameters,
    and how far the steps moved the parameters."""
    import torch._dynamo

    out = {}
    for shape, form in cases:
        params, loss_fn, ids, targets = _setup(shape)
        torch._dynamo.reset()
        pe, le = _train(params, loss_fn, ids, targets, form, False, backend)
        pc, lc = _train(params, loss_fn, ids, targets, form, True, backend)
        out[(shape, form)] = (_diff(le, lc), _diff(pe, pc), _diff(pe, params))
    return out


@_autograd_ops_traced
def run_refusals(backend: str = "aot_eager") -> dict:
    """What a compiled step does where it cannot be one graph: the error, or the right answer."""
    import torch._dynamo

    out = {}
    n = dist.get_world_size() if dist.is_initialized() else 2
    mesh = fpar.make_mesh((n,), ("data",))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(D, D, dtype=F64, generator=g)
    x = torch.randn(B * n, D, dtype=F64, generator=g)
    if dist.is_initialized():
        x = x.chunk(n)[dist.get_rank()]

    def per_device(w, x):
        return fpar.pmean(torch.tanh(x @ w).pow(2).mean(), "data")

    loss = fpar.shard(per_device, mesh, (P(), P("data")), P())

    def grad_step(w, x):
        return torch.autograd.grad(loss(w, x), [w])[0]

    def attempt(name, fn):
        try:
            out[name] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - the test names the form that raised
            out[name] = ("error", type(e).__name__, str(e))

    wr = w.clone().requires_grad_()
    # 1. fullgraph before any eager call: refused, saying to run one step eagerly first
    torch._dynamo.reset()
    attempt("unplanned", lambda: torch.compile(grad_step, backend=backend, fullgraph=True)(wr, x))
    want = grad_step(wr, x)  # the eager call (it plans the signature)
    # 2. without fullgraph the unplanned call is a graph break that runs eagerly, then recompiles
    # whole; with trace_autograd_ops on, torch would trace the backward of that eager call's result
    # and make no gradient (silently), so fpar refuses it
    torch._dynamo.reset()
    loss2 = fpar.shard(per_device, mesh, (P(), P("data")), P())
    stepped = torch.compile(lambda w, x: torch.autograd.grad(loss2(w, x), [w])[0], backend=backend)
    with torch._dynamo.config.patch(trace_autograd_ops=False):
        attempt(
            "graph_break_then_whole",
            lambda: max(float((stepped(wr, x) - want).abs().max()) for _ in range(3)),
        )
    torch._dynamo.reset()
    loss3 = fpar.shard(per_device, mesh, (P(), P("data")), P())

    def backward_step(w, x):
        loss3(w, x).backward()
        return w.grad

    attempt("backward_traced", lambda: torch.compile(backward_step, backend=backend)(wr, x))
    # 3. planned: fullgraph compiles the whole step (the gradient all-reduce inside the graph)
    torch._dynamo.reset()
    whole = torch.compile(grad_step, backend=backend, fullgraph=True)
    attempt("planned_fullgraph", lambda: max(float((whole(wr, x) - want).abs().max()) for _ in range(2)))
    # 4. torch.func.grad under compile: fullgraph is refused; without it, the right gradient (eager)
    torch._dynamo.reset()
    attempt(
        "func_grad_fullgraph",
        lambda: torch.compile(torch.func.grad(loss), backend=backend, fullgraph=True)(w, x),
    )
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=False):  # on, it is refused (as in 2.)
        attempt(
            "func_grad",
            lambda: max(
                float((torch.compile(torch.func.grad(loss), backend=backend)(w, x) - want).abs().max())
                for _ in range(2)
            ),
        )
    return out


@_autograd_ops_traced
def run_zero_steps(stages=(0, 1, 2, 3), n_micro: dict | None = None, once: tuple = ()) -> dict:
    """ZeRO ``zero_step`` trained eagerly and compiled whole (after one eager step), per stage.

    ``n_micro``: microbatches per step by stage (default 1; ``zero_step`` accumulates them inside
    the compiled graph).  ``once``: stages also run with ``reduce_once=True`` in 2 microbatches
    (keyed ``"<stage> once"``).

    On a real mesh (data=2 x tensor=1: this process's rows) or in-process (data=2 x tensor=2).
    Per stage: the largest |eager - compiled| of the losses and of the whole parameters, how far
    the steps moved the parameters, and the ``_c10d_functional`` ops of the compiled forward and
    backward graphs (a real mesh: stage 3's gathers and reduce-scatters are in them).
    """
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    real = dist.is_initialized()
    mesh = fpar.make_mesh((2, 1) if real else (2, 2), ("data", "tensor"))
    specs = {"w1": P(None, "tensor"), "w2": P("tensor", None)}

    def loss_fn(params, batch):
        x, y = batch
        out = fpar.psum(torch.relu(x @ params["w1"]) @ params["w2"], "tensor")
        return ((out - y) ** 2).mean()

    g = torch.Generator().manual_seed(0)
    init = {
        "w1": torch.randn(16, 32, generator=g, dtype=F64) * 0.3,
        "w2": torch.randn(32, 16, generator=g, dtype=F64) * 0.3,
    }
    batch = (torch.randn(8, 16, generator=g, dtype=F64), torch.randn(8, 16, generator=g, dtype=F64))
    if real:
        batch = tuple(t.chunk(2)[dist.get_rank()] for t in batch)
    opt = fo.adamw(1e-2)
    out = {}
    for stage, reduce_once in [(s, False) for s in stages] + [(s, True) for s in once]:
        layout = fo.zero_layout(init, mesh, specs, stage=stage)
        micro = 2 if reduce_once else (n_micro or {}).get(stage, 1)
        step = fo.zero_step(
            loss_fn, opt, layout, batch_specs=P("data"), n_micro=micro, reduce_once=reduce_once
        )
        runs, ops = [], set()

        def record(gm, _inputs, ops=ops):
            ops.update(str(n.target) for n in gm.graph.nodes if "c10d_functional" in str(n.target))
            return gm.forward

        for compiled in (False, True):
            torch._dynamo.reset()
            params, state = fo.zero_init(opt, init, layout)
            fn, losses = step, []
            for i in range(STEPS):
                if compiled and i == 1:  # step 0 eager: it plans (checks) the sharded calls
                    fn = torch.compile(
                        step, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True
                    )
                params, state, metrics = fn(params, state, batch)
                losses.append(metrics["loss"])
            runs.append((losses, fo.zero_params(params, layout)))
        (le, pe), (lc, pc) = runs
        out[f"{stage} once" if reduce_once else stage] = (
            _diff(le, lc),
            _diff(pe, pc),
            _diff(pe, fo.zero_params(fo.zero_init(opt, init, layout)[0], layout)),
            sorted(ops),
        )
    if real:  # the first eager step ran without trace_autograd_ops: its form planned nothing to trace
        torch._dynamo.reset()
        layout = fo.zero_layout(init, mesh, specs, stage=3)
        step = fo.zero_step(loss_fn, opt, layout, batch_specs=P("data"))
        params, state = fo.zero_init(opt, init, layout)
        with torch._dynamo.config.patch(trace_autograd_ops=False):
            params, state, _ = step(params, state, batch)
        try:
            torch.compile(step, backend="aot_eager", fullgraph=True)(params, state, batch)
            out["unplanned"] = ("ok",)
        except Exception as e:  # noqa: BLE001 - the test reads the error
            out["unplanned"] = ("error", type(e).__name__, str(e))
    return out


@_autograd_ops_traced
def run_block_steps(cases=("moe", "gpt_dropout"), backend: str = "aot_eager") -> dict:
    """A transformer block of ``fpar.ops`` in a sharded loss, trained eagerly and compiled whole.

    The mesh is data=2 x tensor=2 in-process, data=1 x tensor=2 on 2 processes.  Cases:
    ``"moe"``: ``fpar.ops.moe_block`` with every expert on every device (``axis=None``), each
    expert's hidden dim split over ``"tensor"`` (a real mesh routes with exact counts eagerly,
    static slots compiled); ``"gpt_dropout"``: ``fpar.ops.dropout`` with a spec, then
    ``fpar.ops.gpt_block``'s dropout with no ``batch_axes`` (inferred from what the input varies
    over).  Per case: the largest |eager - compiled| of the losses and of the parameters, and how
    far the steps moved the parameters.  Every step draws new dropout masks (its own key).
    """
    import torch._dynamo

    from fpar.random import fold_in
    from fpar.random import key as random_key

    real = dist.is_initialized()
    shape = (1, 2) if real else (2, 2)
    mesh = fpar.make_mesh(shape, ("data", "tensor"))
    rate = 0.25
    out = {}
    for case in cases:
        block = ops.init_gpt_block(D, dtype=F64)
        block_specs = ops.gpt_block_specs("tensor")
        if case == "moe":
            del block["mlp"], block_specs["mlp"]
            block["moe"] = ops.init_moe(D, 2 * D, 4, std=0.3, dtype=F64)
            block_specs["moe"] = ops.moe_specs(None, tensor_axis="tensor")
        # a column-parallel head, its squared outputs summed over "tensor" (a vocab-parallel loss's
        # form: a real mesh plans the call fast, its input's uses all summed the same way)
        inits = {"block": block, "head": fpar.normal((D, D), std=D**-0.5, dtype=F64)}
        specs = {"block": block_specs, "head": P(None, "tensor")}

        def per_device(params, x, key, case=case):
            w = params["block"]
            if case == "moe":
                h = ops.moe_block(w, x, axis="tensor", n_heads=HEADS, moe=dict(top_k=2))[0]
            else:
                h = ops.dropout(fold_in(key, 0), x, rate, spec=P("data"))
                h = ops.gpt_block(w, h, axis="tensor", n_heads=HEADS, dropout=rate, key=fold_in(key, 1))
            sq = fpar.psum(((h @ params["head"]) ** 2).sum(), "tensor")
            return fpar.pmean(sq / h.numel() / D, "data")

        loss_fn = fpar.shard(per_device, mesh, (specs, P("data"), P()), P())
        init = fpar.init(inits, mesh, specs, seed=3)
        g = torch.Generator().manual_seed(2)
        x = torch.randn(2 * shape[0], T, D, generator=g, dtype=F64)
        if real:
            x = x.chunk(shape[0])[mesh._dist.coords["data"]]

        def step(params, x, key, loss_fn=loss_fn):
            leaves = torch.utils._pytree.tree_leaves(params)
            loss = loss_fn(params, x, key)
            loss.backward()
            with torch.no_grad():
                for p in leaves:
                    p.sub_(0.5 * p.grad)
                    p.grad = None
            return loss.detach()

        runs = []
        for compiled in (False, True):
            torch._dynamo.reset()
            params = torch.utils._pytree.tree_map(lambda t: t.detach().clone().requires_grad_(), init)
            fn, losses = step, []
            for i in range(STEPS):
                if compiled and i == 1:  # step 0 eager: it plans (checks) the sharded call
                    fn = torch.compile(step, backend=backend, fullgraph=True)
                losses.append(fn(params, x, fold_in(random_key(7), i)))
            runs.append((losses, params))
        (le, pe), (lc, pc) = runs
        out[case] = (_diff(le, lc), _diff(pe, pc), _diff(pe, init))
    return out


def run_expert_parallel_refusal(backend: str = "aot_eager") -> dict:
    """A real mesh's expert-parallel ``fpar.ops.moe`` (exact counts) under ``torch.compile``: the
    fullgraph error, and without ``fullgraph`` the largest |compiled - eager| of the gradient
    (the call runs eagerly at a graph break)."""
    import torch._dynamo

    mesh = fpar.make_mesh((dist.get_world_size(),), ("expert",))
    g = torch.Generator().manual_seed(0)
    params = {
        "router": torch.randn(D, 4, generator=g, dtype=F64),
        "w_in": torch.randn(4, D, 2 * D, generator=g, dtype=F64) * 0.3,
        "w_out": torch.randn(4, 2 * D, D, generator=g, dtype=F64) * 0.3,
    }
    x = torch.randn(4 * dist.get_world_size(), D, generator=g, dtype=F64)
    params = fpar.device_put(params, mesh, ops.moe_specs("expert"))
    x = fpar.device_put(x, mesh, P("expert"))

    def f(params, x):
        y, aux = ops.moe(params, x, top_k=2, axis="expert")
        return fpar.psum((y**2).sum(), "expert") + aux

    loss = fpar.shard(f, mesh, (ops.moe_specs("expert"), P("expert")), P())
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}

    def grad_step(leaves, x):
        return torch.autograd.grad(loss(leaves, x), list(leaves.values()))

    want = grad_step(leaves, x)  # eager: plans the signature
    out = {}
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        try:
            torch.compile(grad_step, backend=backend, fullgraph=True)(leaves, x)
            out["fullgraph"] = ("ok",)
        except Exception as e:  # noqa: BLE001 - the test reads the error
            out["fullgraph"] = ("error", type(e).__name__, str(e))
    torch._dynamo.reset()
    got = torch.compile(grad_step, backend=backend)(leaves, x)
    out["graph_break"] = _diff(want, got)
    return out
