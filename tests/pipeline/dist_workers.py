"""Jobs for the real-mesh pipeline tests, run the same way in a launched worker and in-process.

``fpar.launch`` unpickles its function by module name, so everything it runs lives here at
module level.  A job builds its mesh with ``fpar.make_mesh``: a real mesh inside a launched
worker (one process per device), the in-process mesh in the test process.  Every result is a
value every rank holds in full (losses, gathered gradients, stats), or ``None`` where a rank
does not own it, so the test compares rank by rank with the in-process run.
"""

from __future__ import annotations

import contextlib
import traceback

import pipe_models as M
import torch
import torch.distributed as dist

import fpar
import fpar.pipeline as pp
from fpar import P
from fpar._tree import tree_flatten, tree_map

_MESHES: dict = {}


def mesh_for(axes: tuple) -> fpar.Mesh:
    """The mesh ``((name, size), ...)``, cached (building a real mesh creates process groups)."""
    key = (axes, dist.is_available() and dist.is_initialized())
    if key not in _MESHES:
        _MESHES[key] = fpar.make_mesh(tuple(s for _, s in axes), tuple(n for n, _ in axes))
    return _MESHES[key]


def _pipe_coord(mesh: fpar.Mesh) -> int | None:
    return mesh._dist.coords["pipe"] if mesh.backend == "dist" else None


def exec_job(
    axes: tuple,
    name: str,
    p: int,
    m: int,
    v: int,
    device: str = "cpu",
    batch: int = 4,
    compiled: bool = False,
    remat: bool = False,
) -> dict:
    """One step of the executor: loss, gathered gradients, and the measured stats.

    ``remat``: the stage function recomputes its block in the backward (the values are the same).

    ``compiled``: the stage function is compiled (``torch.compile``, ``aot_eager``); three steps run
    (the first eager inside, planning its sharded call) and the last one is returned.
    """
    mesh = mesh_for(axes)
    prob = tree_map(lambda t: t.to(device), M.problem(p, m, v, batch=batch))
    fns = M.stage_fns(mesh, remat=remat)
    spec = M.stage_spec(mesh)
    rows = P(None, "data") if "data" in mesh.shape else P()
    params = {
        "stages": fpar.device_put(pp.stage_major(prob["stages"], p, v, layout=M.layout(name)), mesh, spec),
        "first": prob["first"],
        "last": prob["last"],
    }
    xs, ts = fpar.device_put(prob["xs"], mesh, rows), fpar.device_put(prob["ts"], mesh, rows)
    stage = fns["stage"]
    if compiled:
        import torch._dynamo

        torch._dynamo.reset()
        stage = torch.compile(stage, backend="aot_eager")
    step = pp.pipeline(stage, M.schedule(name, p, m, v), mesh, loss=fns["loss"], first=fns["first"])
    for _ in range(2 if compiled else 0):
        step(params, xs, ts)
    res = step(params, xs, ts)
    coord = _pipe_coord(mesh)
    owns_first, owns_last = coord in (None, 0), coord in (None, (p * v - 1) % p)
    s = res.stats
    return {
        "loss": res.loss,
        "stages": fpar.gather(res.grads["stages"], mesh, spec),
        "first": res.grads["first"] if owns_first else None,
        "last": res.grads["last"] if owns_last else None,
        "stats": (s.makespan, s.busy, s.peak_stash, s.peak_inbox),
    }


def big_exec_job(axes: tuple, name: str, p: int, m: int, v: int, device: str = "cpu") -> dict:
    """``exec_job`` with 16 MB activations: over NCCL, more than its buffers hold, so a send
    completes only once its peer's receive runs (a pair posting send-first on both ends would
    deadlock)."""
    return exec_job(axes, name, p, m, v, device, batch=1 << 19)


def scan_job(axes: tuple, p: int, m: int, v: int) -> dict:
    """gpipe_scan inside fpar.shard: loss and gathered gradients."""
    mesh = mesh_for(axes)
    prob = M.problem(p, m, v)
    fns = M.make_fns(mesh.axis_names)
    spec = M.stage_spec(mesh)

    def loss(w, h_MBD, t_MBO, head):
        ys = pp.gpipe_scan(fns["stage"], w, h_MBD)
        return ((ys @ head - t_MBO) ** 2).mean()

    sharded = fpar.shard(loss, mesh, (spec, P(), P(), P()), P())
    stages = fpar.device_put(pp.stage_major(prob["stages"], p, v), mesh, spec)
    h = prob["first"]["emb"][prob["xs"]]
    value = sharded(stages, h, prob["ts"], prob["last"]["head"])
    grads = torch.func.grad(sharded, argnums=(0, 1))(stages, h, prob["ts"], prob["last"]["head"])
    return {"loss": value, "stages": fpar.gather(grads[0], mesh, spec), "h": grads[1]}


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


def run_jobs_on_cuda(jobs: list) -> list:
    """``run_jobs`` with every executor job on this rank's CUDA device; results back on the CPU."""
    if dist.is_available() and dist.is_initialized():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    out = run_jobs([(kind, (*args, "cuda")) for kind, args in jobs])
    return [(status, tree_map(_cpu, got) if status == "ok" else got) for status, got in out]


def run_jobs(jobs: list) -> list:
    """Run jobs in order; per job ("ok", result) or ("error", traceback text)."""
    out = []
    for kind, args in jobs:
        try:
            out.append(("ok", globals()[kind](*args)))
        except Exception:  # report, so the test shows which job failed on which rank
            out.append(("error", traceback.format_exc()))
    return out


def mismatch_job() -> dict:
    """Ranks that run different steps (schedule, microbatch count): the error each rank raises,
    then a step all ranks run alike (the state is clean after the error)."""
    mesh = mesh_for((("pipe", 2),))
    me = mesh._dist.coords["pipe"]
    out = {}
    for case, (name, m) in {"schedule": ("gpipe", 4), "microbatches": ("1f1b", 2)}.items():
        prob = M.problem(2, 4, 1)
        fns = M.stage_fns(mesh)
        params = {
            "stages": fpar.device_put(pp.stage_major(prob["stages"], 2, 1), mesh, M.stage_spec(mesh)),
            "first": prob["first"],
            "last": prob["last"],
        }
        name, m = (name, m) if me == 1 else ("1f1b", 4)
        step = pp.pipeline(
            fns["stage"], M.schedule(name, 2, m, 1), mesh, loss=fns["loss"], first=fns["first"]
        )
        try:
            step(params, prob["xs"][:m], prob["ts"][:m])
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    # rank 1 alone passes 3 microbatches to a 4-microbatch schedule: its own check raises first
    step = pp.pipeline(fns["stage"], M.schedule("1f1b", 2, 4, 1), mesh, loss=fns["loss"], first=fns["first"])
    try:
        step(params, prob["xs"][: 4 - me], prob["ts"][: 4 - me])
        out["one_rank_raises"] = None
    except (ValueError, RuntimeError) as e:
        out["one_rank_raises"] = (type(e).__name__, str(e))
    out["after"] = exec_job((("pipe", 2),), "1f1b", 2, 4, 1)
    return out


def early_sends(name: str, p: int, m: int, v: int) -> int:
    """How many BW input gradients this rank posted before running their W (``_early_sender``)."""
    from fpar.pipeline import _run_dist

    count = [0]
    original = _run_dist.DistDriver._early_sender

    def counting(self, actions, sending, early):
        send = original(self, actions, sending, early)
        if send is None:
            return None

        def counted(j, c, dx):
            sent = send(j, c, dx)
            count[0] += sent
            return sent

        return counted

    _run_dist.DistDriver._early_sender = counting
    try:
        exec_job((("pipe", p),), name, p, m, v)
    finally:
        _run_dist.DistDriver._early_sender = original
    return count[0]


def held_rows(name: str, p: int, m: int, v: int) -> dict:
    """Steps of one pipeline whose stacked gradient rows are kept between steps: gradients the
    caller still holds are never written by a later step; dropped, their buffers are reused."""
    axes = (("pipe", p),)
    mesh = mesh_for(axes)
    prob = M.problem(p, m, v)
    fns, spec = M.stage_fns(mesh), M.stage_spec(mesh)
    stages = pp.stage_major(prob["stages"], p, v, layout=M.layout(name))

    def params(scale: float) -> dict:
        scaled = tree_map(lambda t: t * scale, stages)
        return {"stages": fpar.device_put(scaled, mesh, spec), "first": prob["first"], "last": prob["last"]}

    xs, ts = fpar.device_put(prob["xs"], mesh, P()), fpar.device_put(prob["ts"], mesh, P())
    step = pp.pipeline(fns["stage"], M.schedule(name, p, m, v), mesh, loss=fns["loss"], first=fns["first"])
    first = step(params(1.0), xs, ts).grads["stages"]
    kept = tree_map(torch.clone, first)
    second = step(params(0.5), xs, ts).grads["stages"]
    # gathered from copies: gloo's worker thread can hold a collective's input a moment after the
    # wait returns, and a buffer still held then is (rightly) not reused by the next step
    out = {
        "intact": all(torch.equal(a, b) for a, b in zip(tree_flatten(first)[0], tree_flatten(kept)[0])),
        "first": fpar.gather(tree_map(torch.clone, first), mesh, spec),
        "second": fpar.gather(tree_map(torch.clone, second), mesh, spec),
    }
    ptrs = [t.data_ptr() for t in tree_flatten(second)[0]]
    del first, second
    third = step(params(0.5), xs, ts).grads["stages"]
    out["reused"] = [t.data_ptr() for t in tree_flatten(third)[0]] == ptrs
    out["third"] = fpar.gather(third, mesh, spec)
    return out


class _OneHandle:
    """What NCCL's ``batch_isend_irecv`` returns: one handle for the whole batch."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def batched_job(axes: tuple, name: str, p: int, m: int, v: int) -> dict:
    """``exec_job`` with p2p posted as a coalescing backend (NCCL) gets it, on gloo: every
    ``p2p(wait=False)`` is one ``batch_isend_irecv`` that returns one handle for the batch.
    Also counts the batches that held both sends and receives (neighbours' crossing traffic)."""
    from fpar._dist import groups

    crossing = [0]
    original_batch, original_coalesces = dist.batch_isend_irecv, groups._coalesces

    def one_handle(ops):
        kinds = {op.op for op in ops}
        crossing[0] += dist.isend in kinds and dist.irecv in kinds
        return [_OneHandle(original_batch(ops))]

    dist.batch_isend_irecv, groups._coalesces = one_handle, lambda group, device: True
    try:
        out = exec_job(axes, name, p, m, v)
    finally:
        dist.batch_isend_irecv, groups._coalesces = original_batch, original_coalesces
    out["crossing"] = crossing[0]
    return out


def cast_job(axes: tuple, name: str, p: int, m: int, v: int, shared: bool, release: bool = True) -> dict:
    """A bfloat16 pipeline over float32 master weights: loss, gathered gradients, and the step's peak bytes.

    Every chunk casts its weights with ``w.to(torch.bfloat16)`` (``shared``: the executor's one
    cast per step) or ``w.to(torch.bfloat16, copy=True)`` (not a cast it shares: one per
    microbatch in flight, as a stage function that casts without the executor would hold).
    ``forward_peak``: the most bytes the step had made and not freed at the end of a chunk's
    forward; ``cast_bytes``: one chunk's bfloat16 weights; ``table_bytes``: the embedding table's
    bfloat16 cast on this rank (indexing does not save it: shared, it is held for the step, where
    a cast per microbatch is freed at once).  ``release=False``: the stash keeps each chunk's
    output values, as it did before ``Stage._release``; ``out_bytes``: one chunk output's bytes.
    """
    from unittest import mock

    from fpar.pipeline import _stage
    from fpar.plan._record import Recorder

    mesh = mesh_for(axes)
    g = torch.Generator().manual_seed(0)
    d, h, batch, bf16 = 32, 128, 2, torch.bfloat16
    stages = {
        "a": torch.randn(p * v, d, h, generator=g) * 0.2,
        "b": torch.randn(p * v, h, d, generator=g) * 0.2,
    }
    first, last = {"emb": torch.randn(11, d, generator=g)}, {"head": torch.randn(d, 3, generator=g)}
    xs, ts = torch.randint(0, 11, (m, batch), generator=g), torch.randn(m, batch, 3, generator=g)

    def cast(w):
        return w.to(bf16) if shared else w.to(bf16, copy=True)

    live: list = []  # the step's bytes alive at the end of each chunk's forward

    def block(w, x):
        y = x + torch.tanh(x @ cast(w["a"])) @ cast(w["b"])
        if rec.measuring:
            live.append(rec.total)
        return y

    def embed(w, ids):
        return cast(w["emb"])[ids]

    def loss(w, x, t):
        return ((x.float() @ w["head"] - t) ** 2).mean()

    rec = Recorder({})
    rec.measuring = False
    others = tuple(a for a in mesh.axis_names if a != "pipe")
    spec = {"a": P("pipe"), "b": P("pipe")}
    if others:  # the stage functions are shards over the other axes (replicated weights)
        sub = mesh.submesh(others)
        block = fpar.shard(block, sub, ({"a": P(), "b": P()}, P()), P())
        embed = fpar.shard(embed, sub, ({"emb": P()}, P()), P())
        loss = fpar.shard(loss, sub, ({"head": P()}, P(), P()), P())
    params = {
        "stages": fpar.device_put(pp.stage_major(stages, p, v), mesh, spec),
        "first": first,
        "last": last,
    }
    step = pp.pipeline(block, M.schedule(name, p, m, v), mesh, loss=loss, first=embed)
    keep = mock.patch.object(_stage, "_release", lambda y: None)
    with rec, contextlib.nullcontext() if release else keep:
        step(params, xs, ts)  # plans the sharded calls
        rec.start()
        rec.measuring = True
        res = step(params, xs, ts)
        peak = rec.peak
    coord = _pipe_coord(mesh)
    return {
        "loss": res.loss,
        "stages": fpar.gather(res.grads["stages"], mesh, spec),
        "first": res.grads["first"] if coord in (None, 0) else None,
        "last": res.grads["last"] if coord in (None, (p * v - 1) % p) else None,
        "peak": peak,
        "forward_peak": max(live),
        "cast_bytes": 2 * d * h * 2,
        "out_bytes": batch * d * 2,
        "table_bytes": first["emb"].numel() * 2 if coord in (None, 0) else 0,
    }


def zero_pipeline_job(
    axes: tuple, name: str, p: int, m: int, v: int, stage: int, once: bool = True, reshard: bool = False
) -> dict:
    """``fpar.optim.zero_pipeline`` at ZeRO ``stage``: its gradient chunks, and the chunks of the plain step's.

    Both gathered to whole (``layout.grad_specs``), with the losses: equal on both meshes.
    ``data_ops``: the collectives the ZeRO step ran over the data axis.  ``once``: its
    ``reduce_once`` (False: each chunk's gradient reduced as its backward ends); ``reshard``: its
    ``reshard_after_forward`` (each chunk gathered for its own actions; ``gathers`` counts them).
    """
    import fpar.optim as fo

    mesh = mesh_for(axes)
    prob = M.problem(p, m, v)
    fns = M.stage_fns(mesh)
    specs = {"stages": M.stage_spec(mesh), "first": {"emb": P()}, "last": {"head": P()}}
    rows = P(None, "data") if "data" in mesh.shape else P()
    stacked = pp.stage_major(prob["stages"], p, v, layout=M.layout(name))
    params = fpar.device_put({"stages": stacked, "first": prob["first"], "last": prob["last"]}, mesh, specs)
    xs, ts = fpar.device_put(prob["xs"], mesh, rows), fpar.device_put(prob["ts"], mesh, rows)
    layout = fo.zero_layout(params, mesh, specs, stage=stage)
    zparams, _ = fo.zero_init(fo.sgd(0.1), params, layout)
    step = pp.pipeline(fns["stage"], M.schedule(name, p, m, v), mesh, loss=fns["loss"], first=fns["first"])
    run = fo.zero_pipeline(step, layout, reduce_once=once, reshard_after_forward=reshard)
    run(zparams, xs, ts)  # the first call plans the sharded calls
    fpar.reset_comm_stats()
    got = run(zparams, xs, ts)
    comm = fpar.comm_stats()
    plain = step(params, xs, ts)
    chunks = fpar.shard(
        lambda g: fo._zero._map(fo._zero._own_chunk, g, layout), mesh, (specs,), layout.grad_specs
    )(plain.grads)
    return {
        "loss": got.loss,
        "plain_loss": plain.loss,
        "chunks": fpar.gather(got.grads, mesh, layout.grad_specs),
        "plain_chunks": fpar.gather(chunks, mesh, layout.grad_specs),
        "data_ops": sorted(comm.get("data", {})),
        "scatters": comm.get("data", {}).get("psum_scatter", {}).get("calls", 0),
        "gathers": comm.get("data", {}).get("all_gather_invariant", {}).get("calls", 0),
    }


def model_step_job(
    kind: str, zero: int, dtype: str = "float64", once: bool | None = None, virtual: int = 1
) -> list:
    """Three steps of ``fpar.plan.model_step`` on pipeline=2 x data=2: the losses.

    A GPT's head is tied to its embedding (``tied=``), so ZeRO inside the pipeline sums the two
    uses' chunks; each step's loss depends on the updates before it.  ``dtype``: the compute
    dtype (``"bfloat16"``: float32 masters cast once a step, or at ZeRO-3 gathered in bfloat16).
    ``once``: the layout's ``reduce_once`` (False: each chunk's gradient reduced as its backward
    ends); ``virtual``: chunks a stage (interleaved 1F1B above 1).
    """
    import fpar.plan as plan

    model = plan.Model(f"small-{kind}", 32, 4, 2, 2, 64, 48, 8, kind, "eager")  # no vmap of flash
    layout = plan.Layout(
        pipeline=2, data=2, zero=zero, microbatches=2, batch=8, reduce_once=once, virtual=virtual
    )
    mesh = mesh_for((("pipeline", 2), ("data", 2), ("tensor", 1)))
    step, args = plan.model_step(model, layout, mesh, dtype=getattr(torch, dtype))
    params, state, xs, ys = args
    losses = []
    for _ in range(3):
        (params, state), loss = step(params, state, xs, ys)
        losses.append(float(loss))
    return losses


def rows_job(axes: tuple, name: str, p: int, m: int, v: int, how: str) -> dict:
    """Chunks of 3 stacked layers, taken by ``unbind``, ``w[i]`` or ``select``: plain and ZeRO-2 pipeline gradients.

    On a real mesh a deferred call adds each layer's gradient into the step's sum as its backward
    ends (``fpar/pipeline/_unstack.py``).  ``"index"`` leaves layer 1 unused (its rows' gradient is
    zero); ``"select"`` also uses ``w["b"]`` whole (a cotangent besides the rows').  Returns the
    loss and gathered stage gradients of the plain pipeline and of the unpipelined model, and the
    ZeRO-2 chunks beside the plain gradients' chunks.
    """
    import fpar.optim as fo

    mesh = mesh_for(axes)
    g = torch.Generator().manual_seed(1)
    L, n, d, h = p * v, 3, M.D, M.H
    prob = M.problem(p, m, v)
    stages = {
        "a": torch.randn(L, n, d, h, dtype=M.F64, generator=g) * 0.4,
        "b": torch.randn(L, n, h, d, dtype=M.F64, generator=g) * 0.4,
    }

    def layers(w: dict) -> list:
        if how == "unbind":
            return list(zip(w["a"].unbind(0), w["b"].unbind(0)))
        if how == "index":
            return [(w["a"][i], w["b"][i]) for i in (0, 2)]
        return [(w["a"].select(0, i), w["b"].select(0, -1 - i)) for i in range(n)]

    def block(w: dict, x: torch.Tensor) -> torch.Tensor:
        for a, b in layers(w):
            x = x + torch.tanh(x @ a) @ b
        return x + 0.01 * w["b"].sum() if how == "select" else x

    fns = M.make_fns(("data",))
    sub = mesh.submesh(tuple(a for a in mesh.axis_names if a != "pipe"))
    stage = fpar.shard(block, sub, ({"a": P(), "b": P()}, P("data")), P("data"))
    first = fpar.shard(fns["first"], sub, ({"emb": P()}, P("data")), P("data"))
    loss = fpar.shard(fns["loss"], sub, ({"head": P()}, P("data"), P("data")), P())
    specs = {"stages": {"a": P("pipe"), "b": P("pipe")}, "first": {"emb": P()}, "last": {"head": P()}}
    rows = P(None, "data")
    params = {"stages": pp.stage_major(stages, p, v), "first": prob["first"], "last": prob["last"]}
    params = fpar.device_put(params, mesh, specs)
    xs, ts = fpar.device_put(prob["xs"], mesh, rows), fpar.device_put(prob["ts"], mesh, rows)
    step = pp.pipeline(stage, M.schedule(name, p, m, v), mesh, loss=loss, first=first)
    layout = fo.zero_layout(params, mesh, specs, stage=2)
    run = fo.zero_pipeline(step, layout)
    step(params, xs, ts)  # the first calls plan the sharded calls
    run(params, xs, ts)
    plain, zero = step(params, xs, ts), run(params, xs, ts)
    chunks = fpar.shard(
        lambda g: fo._zero._map(fo._zero._own_chunk, g, layout), mesh, (specs,), layout.grad_specs
    )(plain.grads)

    def reference(st: dict) -> torch.Tensor:
        total = 0.0
        for j in range(m):
            x = prob["first"]["emb"][prob["xs"][j]]
            for k in range(L):
                x = block({"a": st["a"][k], "b": st["b"][k]}, x)
            total = total + ((x @ prob["last"]["head"] - prob["ts"][j]) ** 2).mean()
        return total / m

    ref_loss = reference(stages)
    ref_grads = torch.func.grad(reference)(stages)
    return {
        "loss": plain.loss,
        "stages": fpar.gather(plain.grads["stages"], mesh, specs["stages"]),
        "ref_loss": ref_loss,
        "ref_stages": pp.stage_major(ref_grads, p, v),
        "chunks": fpar.gather(zero.grads, mesh, layout.grad_specs),
        "plain_chunks": fpar.gather(chunks, mesh, layout.grad_specs),
    }
