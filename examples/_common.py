"""Plumbing shared by ``train_gpt.py`` and ``train_vit.py``: command line, mesh, meters, checkpoints, plot.

Nothing here is model-specific.  The examples keep what they teach (the model in pipeline
pieces, the training loop) in their own file; this file holds what every training script needs
around it:

* ``start``: torchrun detection (``WORLD_SIZE`` set -> ``fpar.init_distributed()``), threads, and
  rank-0-only printing (``say``);
* ``add_args`` / ``build_mesh``: the parallel layout, from ``--parallel "pipeline=2,data=2,tensor=2"``,
  ``--pp/--dp/--tp``, a Colossal-AI style ``--config`` (``fpar.mesh_from_config``) or
  ``--single-device``; the mesh axes are always named ``pipeline``, ``data``, ``tensor``;
* ``peak_flops``, ``Bar`` (tqdm), ``comm_bytes``: throughput, MFU (per-device peak) and traffic meters;
* ``save`` / ``restore``: ``fpar.checkpoint`` in the *model* layout (layers stacked on one dim
  split over ``pipeline``), so a run can resume on any layout, ``--single-device`` included;
* ``plot_losses``: the loss-curve PNG (matplotlib if installed).
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import runpy
import sys
import time
from pathlib import Path

import optree
import torch

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from fpar import P

AXES = ("pipeline", "data", "tensor")  # mesh order: stages outermost, tensor ranks adjacent
PIPE, DATA, TENSOR = AXES
DTYPES = {"float32": torch.float32, "float64": torch.float64}


# Processes and printing -------------------------------------------------------------------------


def start(threads: int) -> int:
    """Join torchrun's process group if this is a torchrun worker; set threads; return the rank."""
    if threads > 0:
        # Tiny ops: intra-op threads only add synchronisation (on a busy 2-core machine a step
        # took ~10x longer with 2 threads than with 1).
        torch.set_num_threads(threads)
    if "WORLD_SIZE" in os.environ:  # launched by torchrun: one process per device
        fpar.init_distributed(backend="gloo")  # the examples keep their tensors on the CPU
        return torch.distributed.get_rank()
    return 0


def entry(main) -> None:
    """Run ``main()`` as a script: under torchrun, a raised error goes to torchrun's error file.

    torch's ``record`` writes it there, so the job's summary names the first failing rank's
    exception instead of only its exit code. The file is written whole or not at all (see
    ``_whole_error_file``).
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main, error_handler=_whole_error_file())()


def _whole_error_file():
    """torch's error handler, writing its file under another name and renaming it into place.

    torch's own handler opens the file for writing and then dumps the JSON. When one rank is
    killed, its peer fails on the lost connection and starts writing its file, and torchrun's
    agent, seeing the killed rank, sends the peer SIGTERM: killed between the open and the
    dump, it leaves an empty file, and the agent itself crashes reading it
    (``JSONDecodeError``) instead of restarting the job. A rename is atomic: the agent reads the
    whole report or finds none.
    """
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class WholeErrorFile(ErrorHandler):
        writing: str | None = None

        def _get_error_file_path(self) -> str | None:
            return self.writing or super()._get_error_file_path()

        def record_exception(self, e: BaseException) -> None:
            final = super()._get_error_file_path()
            if not final:
                return super().record_exception(e)
            self.writing = f"{final}.{os.getpid()}.partial"
            try:
                super().record_exception(e)
            finally:
                self.writing = None
            os.replace(f"{final}.{os.getpid()}.partial", final)

    return WholeErrorFile()


def rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def say(*args, quiet: bool = False) -> None:
    """Print on rank 0 only."""
    if not quiet and rank() == 0:
        print(*args, flush=True)


# Command line and mesh --------------------------------------------------------------------------


def add_args(ap: argparse.ArgumentParser, *, steps: int, batch: int, lr: float, warmup: int) -> None:
    g = ap.add_argument_group("parallelism")
    g.add_argument("--parallel", help='e.g. "pipeline=2,data=2,tensor=2" (data=-1: inferred)')
    g.add_argument("--pp", type=int, help="pipeline stages (default 2 when any of --pp/--dp/--tp is given)")
    g.add_argument(
        "--dp", type=int, help="data-parallel size (-1, the default with --pp/--tp: devices / (pp * tp))"
    )
    g.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel size, Megatron 1D (default 2 with --pp; what is left with --dp)",
    )
    g.add_argument("--devices", type=int, default=8, help="in-process devices (torchrun: the world size)")
    g.add_argument(
        "--config",
        help="Colossal-AI style parallel config: a .py file defining `parallel = dict(...)`, or inline "
        "\"dict(pipeline=2, tensor=dict(size=2, mode='1d'))\"; built by fpar.mesh_from_config",
    )
    g.add_argument("--single-device", action="store_true", help="a 1-device mesh: no parallelism")
    g.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "zb"), help="pipeline schedule")
    g.add_argument("--microbatches", type=int, help="per step (default: 2 x stages; 1 on one stage)")
    t = ap.add_argument_group("training")
    t.add_argument("--steps", type=int, default=steps)
    t.add_argument("--batch", type=int, default=batch, help="global batch per step")
    t.add_argument("--lr", type=float, default=lr, help="peak learning rate (warmup, then cosine to lr/10)")
    t.add_argument("--warmup", type=int, default=warmup, help="warmup steps")
    t.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    o = ap.add_argument_group("checkpoints and output")
    o.add_argument("--ckpt-dir", help="run directory for checkpoints and the loss plot")
    o.add_argument("--ckpt-every", type=int, default=100, help="save every N steps (0: only at the end)")
    o.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    o.add_argument("--stop-after", type=int, help="stop after this step, as if interrupted (try --resume)")
    o.add_argument("--plot", help="loss-curve PNG (default: <ckpt-dir>/loss.png; 'none' to skip)")
    o.add_argument("--peak-tflops", type=float, help="peak FLOP/s for MFU (default: measured at start)")
    o.add_argument("--log-every", type=int, default=25, help="print a line every N steps")
    o.add_argument("--quiet", action="store_true", help="print nothing (tests)")


def parse_parallel(text: str) -> dict:
    """``"pipeline=2,data=2,tensor=2"`` (also ``pp=``, ``dp=``, ``tp=``) -> ``{pipeline, data, tensor}``."""
    alias = {
        "pipeline": PIPE,
        "pipe": PIPE,
        "pp": PIPE,
        "data": DATA,
        "dp": DATA,
        "tensor": TENSOR,
        "tp": TENSOR,
    }
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if key.strip() not in alias or not value.strip().lstrip("-").isdigit():
            raise SystemExit(f"--parallel: expected e.g. 'pipeline=2,data=2,tensor=2', got {item!r}")
        out[alias[key.strip()]] = int(value)
    return out


def parse_config(text: str) -> dict:
    """A Colossal-AI ``parallel`` dict: from a ``.py`` config file, or an inline literal / ``dict(...)``."""
    if text.endswith(".py") and Path(text).is_file():
        return runpy.run_path(text)["parallel"]  # a config file is code, as in Colossal-AI

    def value(node):  # literals and dict(key=...) calls only: nothing is executed
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            return {kw.arg: value(kw.value) for kw in node.keywords}
        if isinstance(node, ast.Dict):
            return {value(k): value(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)

    tree = ast.parse(text.strip().removeprefix("parallel").lstrip(" ="), mode="eval")
    return value(tree.body)


def build_mesh(args) -> fpar.Mesh:
    """The (pipeline, data, tensor) mesh the flags ask for: in-process, or real under torchrun."""
    real = torch.distributed.is_available() and torch.distributed.is_initialized()
    devices = None if real else args.devices
    if args.single_device:
        if real:
            raise SystemExit("--single-device is for one process; run it without torchrun")
        return fpar.make_mesh((1, 1, 1), AXES)
    if args.config:
        mesh = fpar.mesh_from_config(parse_config(args.config), devices=devices)
        extra = [a for a in mesh.axis_names if a not in AXES]
        if extra:
            raise SystemExit(f"--config: this example runs Megatron 1D tensor parallelism; got axes {extra}")
        if mesh.axis_names == AXES:
            return mesh
        # mesh_from_config leaves out axes of size 1; the example always names all three.
        return fpar.make_mesh(tuple(mesh.shape.get(a, 1) for a in AXES), AXES, devices=devices)
    world = torch.distributed.get_world_size() if real else args.devices
    if args.parallel or any(v is not None for v in (args.pp, args.dp, args.tp)):
        sizes = flag_sizes(args, world)
    else:
        sizes = default_layout(world)
    shape = tuple(sizes[a] for a in AXES)
    return fpar.make_mesh(shape, AXES, devices=devices if -1 in shape else None)


def default_layout(devices: int) -> dict:
    """The layout with no flags: every axis that fits gets 2 devices, data first, then pipeline,
    then tensor; data takes whatever is left.  8 devices: 2 x 2 x 2; 4 (``torchrun
    --nproc-per-node 4``): pipeline=2, data=2, so the data axis is exercised; 2: data=2.
    """
    sizes, rest = {}, devices
    for axis in (DATA, PIPE, TENSOR):
        sizes[axis] = 2 if rest % 2 == 0 else 1
        rest //= sizes[axis]
    sizes[DATA] *= rest
    return sizes


def _given(value, default: int) -> int:
    return default if value is None else value


def flag_sizes(args, devices: int) -> dict:
    """The sizes ``--pp/--dp/--tp`` and ``--parallel`` ask for on ``devices`` devices.

    An axis not given is 2, data -1 (what the others leave); but with data given and tensor not,
    tensor takes what is left (``--pp 2 --dp 2``: tensor 1 on 4 devices, 2 on 8).
    """
    given = parse_parallel(args.parallel or "")
    sizes = {PIPE: _given(args.pp, 2), DATA: _given(args.dp, -1), TENSOR: _given(args.tp, 2), **given}
    pd = sizes[PIPE] * sizes[DATA]
    if args.tp is None and TENSOR not in given and sizes[PIPE] > 0 and sizes[DATA] > 0 and devices % pd == 0:
        sizes[TENSOR] = devices // pd
    return sizes


def microbatches(args, mesh: fpar.Mesh) -> int:
    p = mesh.shape[PIPE]
    m = args.microbatches or (2 * p if p > 1 else 1)
    if args.batch % (m * mesh.shape[DATA]):
        raise SystemExit(
            f"--batch {args.batch} must divide into {m} microbatches x data={mesh.shape[DATA]} (the layout "
            f"{dict(mesh.shape)} of {mesh.size} devices); give a --batch that does, or a --parallel layout "
            f"or world size whose data axis divides it"
        )
    return m


def stacked_specs(specs, pipe_dim: bool = True):
    """Specs of a block's parameters stacked ``[stages, layers per stage, ...]`` (or ``[layers, ...]``)."""
    lead = (PIPE, None) if pipe_dim else (None,)
    return tree_map_specs(lambda s: P(*lead, *s), specs)


def tree_map_specs(fn, specs):
    return optree.tree_map(fn, specs, is_leaf=lambda s: isinstance(s, P), none_is_leaf=True)


# Meters -------------------------------------------------------------------------------------------


def measure_peak_flops(dtype: torch.dtype, seconds: float = 0.3) -> float:
    """FLOP/s of a square fp matmul on this process's threads: the 'peak' MFU is measured against."""
    n = 512
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm up
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - t0)


def peak_flops(args, mesh: fpar.Mesh, dtype: torch.dtype) -> float:
    """The peak FLOP/s MFU is measured against: one device's peak x the devices computing at once.

    One device's peak is ``--peak-tflops``, or a matmul measured by rank 0 alone (the others wait,
    so it is not a share of a contended core) and broadcast.  In-process every virtual device
    shares this process's threads: one device.  On a real mesh, processes that share cores do not
    add peak: at most ``cores // threads`` of them compute at once (4 processes on 2 cores are 2
    devices' worth, not 4).
    """
    return device_peak_flops(args, dtype) * parallel_devices(args, mesh)


def device_peak_flops(args, dtype: torch.dtype) -> float:
    """One device's peak FLOP/s: ``--peak-tflops``, or measured on rank 0 alone and broadcast."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return measure_peak_flops(dtype)
    peak = torch.tensor([measure_peak_flops(dtype) if dist.get_rank() == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(peak, src=0)
    return float(peak)


def parallel_devices(args, mesh: fpar.Mesh) -> int:
    """How many devices compute at once: 1 in-process; on a real mesh, processes up to the cores."""
    if mesh.backend != "dist":
        return 1
    if args.peak_tflops:
        return mesh.size
    return max(1, min(mesh.size, _cores() // max(1, torch.get_num_threads())))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def flops_note(args, mesh: fpar.Mesh, peak: float | None = None) -> str:
    """How the peak was obtained: one device's peak (from the total ``peak``, if given) and the devices counted."""
    k = parallel_devices(args, mesh)
    per = f"{peak / k / 1e9:.1f} GFLOP/s per device, " if peak else ""
    if args.peak_tflops:
        source = f"--peak-tflops {args.peak_tflops} per device"
    else:
        source = f"measured: {args.dtype} 512x512 matmul, {torch.get_num_threads()} thread(s), rank 0 alone"
    if mesh.backend != "dist":
        return f"{per}{source}; in-process: all {mesh.size} virtual devices share it"
    shared = f", {mesh.size} processes share {_cores()} cores" if k < mesh.size else ""
    return f"{per}{source}; x {k} devices computing at once{shared}"


def mfu(flops_per_step: float, seconds: float, peak: float) -> float:
    return flops_per_step / seconds / peak if seconds > 0 and peak > 0 else math.nan


def comm_bytes(p2p: int = 0) -> dict[str, int]:
    """Bytes sent per device since the last reset, summed over collectives, per mesh axis (group).

    ``fpar.comm_stats`` counts collectives; the pipeline executor's point-to-point sends are not
    in it, so the caller passes their bytes (``p2p``), reported as ``"pipeline p2p"``.
    """
    out = {axes: sum(v["bytes"] for v in kinds.values()) for axes, kinds in fpar.comm_stats().items()}
    if p2p:
        out[PIPE + " p2p"] = p2p
    return out


def p2p_bytes(mesh: fpar.Mesh, rows: int, per_row: int, itemsize: int) -> int:
    """The pipeline's point-to-point bytes per step, counted like ``comm_bytes`` counts collectives.

    Each microbatch's activation goes forward and its gradient back over each of the ``S - 1``
    stage boundaries; ``rows`` is this device's rows over all microbatches (batch / data), of
    ``per_row`` elements.  In-process ``fpar.comm_stats`` adds up the stages (each stage's shard
    records one device's traffic), so this is the sum over the stages too; on a real mesh it is
    this process's stage's: forward sends unless last, backward sends unless first.
    """
    stages, block = mesh.shape[PIPE], rows * per_row * itemsize
    if mesh.backend == "local":
        return 2 * (stages - 1) * block
    s = rank() // (mesh.size // stages)  # ranks are laid out in mesh order, pipeline outermost
    return block * ((s < stages - 1) + (s > 0))


COMM_NOTE = {
    "local": "per device, the pipeline stages' devices added up (fpar.comm_stats, in-process)",
    "dist": "sent by rank 0 (a stage-0 device)",
}


def fmt_comm(comm: dict[str, int]) -> str:
    parts = [f"{axes} {fmt_bytes(b)}" for axes, b in comm.items()]
    return ", ".join(parts) + f" (total {fmt_bytes(sum(comm.values()))})"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def fmt_si(x: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(x) < 1000 or unit == "T":
            return f"{x:.1f}{unit}"
        x /= 1000
    raise AssertionError


def interactive() -> bool:
    """Whether a progress bar can redraw in place: a terminal on both streams, or a notebook."""
    if "ipykernel" in sys.modules:  # Jupyter: tqdm.auto draws a widget, no carriage returns
        return True
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


class Bar:
    """The progress bar (rank 0): ``tqdm.auto`` in a terminal or a notebook; plain lines elsewhere.

    Written to a file or a pipe (``> log``, ``| tee``, torchrun's per-rank logs) there is no bar:
    a bar redraws with carriage returns, which fill a log. Only the logged lines (``write``, one
    per logging interval) print there. Without tqdm installed (it comes with
    ``pip install fpar[examples]``) only the logged lines print too.
    """

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled = enabled and rank() == 0
        self.bar = None
        if self.enabled and interactive():
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, mininterval=0.1)

    def update(self, step: int, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(step + 1 - self.bar.n)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# Checkpoints --------------------------------------------------------------------------------------
# The pipeline holds each block parameter stacked [stages, layers per stage, ...] with spec
# P("pipeline", None, ...).  With one model chunk per stage (1F1B, GPipe, ZB-H1) that is the
# model's layers in order, so a checkpoint stores [layers, ...] with spec P("pipeline", ...):
# the same global tensor whatever the layout, and fpar.checkpoint.load reshards it on resume.


def _to_model(tree, specs):
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)
    flat_specs = optree.broadcast_prefix(specs, tree, is_leaf=lambda s: isinstance(s, P), none_is_leaf=True)
    out_leaves, out_specs = [], []
    for x, s in zip(leaves, flat_specs):
        if isinstance(s, P) and len(s) >= 2 and s[0] == PIPE and s[1] is None:
            x, s = x.flatten(0, 1), P(PIPE, *list(s)[2:])
        out_leaves.append(x)
        out_specs.append(s)
    return optree.tree_unflatten(treedef, out_leaves), optree.tree_unflatten(treedef, out_specs)


def save(
    ckpt_dir: str,
    step: int,
    params,
    opt_state,
    losses: list[float],
    mesh,
    pspecs,
    sspecs,
    *,
    key=None,
    blocking: bool = True,
):
    """Save parameters, optimizer state and the loss history at ``step`` (a collective on a real mesh).

    ``key``: the run's ``fpar.random`` key (dropout), stored so that a resumed run draws the same masks.
    ``blocking=False``: write in the background (``fpar.checkpoint.save``'s), returning its handle.
    """
    tree, specs = _to_model({"params": params, "opt": opt_state}, {"params": pspecs, "opt": sspecs})
    tree["losses"] = torch.tensor(losses, dtype=torch.float64)
    specs["losses"] = P()
    if key is not None:
        tree["key"], specs["key"] = key, P()
    return fpar.checkpoint.save(ckpt_dir, tree, mesh, specs, step=step, keep=2, blocking=blocking)


def restore(ckpt_dir: str, params, opt_state, mesh, pspecs, sspecs, *, key=None):
    """Load the newest checkpoint onto this mesh: ``(step, params, opt_state, losses)``.

    With ``key`` (the run's ``fpar.random`` key, saved by ``save(..., key=)``) the stored key is
    appended: ``(step, params, opt_state, losses, key)``.
    """
    step = fpar.checkpoint.latest_step(ckpt_dir)
    like, specs = _to_model({"params": params, "opt": opt_state}, {"params": pspecs, "opt": sspecs})
    like["losses"], specs["losses"] = None, P()  # any length: None in like= gives only the structure
    if key is not None:
        like["key"], specs["key"] = key, P()
    try:
        got = fpar.checkpoint.load(ckpt_dir, mesh, specs, step=step, like=like)
    except fpar.checkpoint.CheckpointError as e:
        raise SystemExit(
            f"--resume: the checkpoint of step {step} in {ckpt_dir} was written by another model or "
            f"configuration, so this run cannot continue from it. Use another --ckpt-dir, or start "
            f"without --resume.\n({e})"
        ) from None
    # back to [stages, layers per stage, ...]: the shapes of the tree we were given
    want = optree.tree_leaves({"params": params, "opt": opt_state}, none_is_leaf=True)
    have, treedef = optree.tree_flatten({"params": got["params"], "opt": got["opt"]}, none_is_leaf=True)
    leaves = [h.reshape(w.shape) if isinstance(h, torch.Tensor) else h for h, w in zip(have, want)]
    tree = optree.tree_unflatten(treedef, leaves)
    if key is not None:
        return step, tree["params"], tree["opt"], got["losses"].tolist(), got["key"]
    return step, tree["params"], tree["opt"], got["losses"].tolist()


# ZeRO state in the model layout --------------------------------------------------------------------
# fpar.optim's ZeRO stages 1-3 keep each optimizer-state leaf (and, at stage 3, each parameter) as
# this data rank's chunk: its block flattened, zero-padded and cut into `data` pieces.  Chunks
# depend on the layout, so the flagship checkpoints the model layout (the blocks the chunks come
# from) and cuts chunks again after loading: a run can resume with another data size or
# pipeline depth.  The pipeline's backward already sums each gradient over `data` (the loss is
# `pmean`'d), so a ZeRO step takes each rank's chunk of that sum (`to_chunks`).

_TAG = 1_000_003  # fake sizes that tell which state leaf mirrors which parameter


def mirrors(opt, params) -> list[int]:
    """For each leaf of ``opt.init(params)``: the index of the parameter it mirrors, or -1."""
    leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
    fake = optree.tree_unflatten(
        treedef, [torch.empty((_TAG + i,), device="meta") for i in range(len(leaves))]
    )
    out = []
    for x in optree.tree_leaves(opt.init(fake), none_is_leaf=True):
        i = x.shape[0] - _TAG if isinstance(x, torch.Tensor) and x.dim() == 1 else -1
        out.append(i if 0 <= i < len(leaves) else -1)
    return out


def _chunk(block: torch.Tensor, n: int) -> torch.Tensor:
    """This data rank's chunk of a block that is the same on every data rank (inside fpar.shard)."""
    c = -(-block.numel() // n)
    flat = block.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(n * c - flat.numel())]) if n * c > flat.numel() else flat
    return flat.reshape(n, c).index_select(0, fpar.axis_index(DATA).reshape(1)).squeeze(0)


def _unchunk(chunk: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The whole block from every data rank's chunk (inside fpar.shard; all-gathered over data)."""
    return fpar.all_gather_invariant(chunk, DATA, tiled=True)[: math.prod(shape)].reshape(shape)


def block_shapes(tree, mesh: fpar.Mesh, specs) -> list[tuple]:
    """Each leaf's per-device block shape (a real mesh's tensors are blocks already)."""
    leaves = optree.tree_leaves(tree, none_is_leaf=True)
    flat = optree.broadcast_prefix(specs, tree, is_leaf=lambda s: isinstance(s, P), none_is_leaf=True)
    out = []
    for x, s in zip(leaves, flat):
        shape = list(x.shape)
        if mesh.backend != "dist":
            for d, entry in enumerate(s.normalized()):
                shape[d] //= math.prod(mesh.shape[a] for a in entry)
        out.append(tuple(shape))
    return out


def to_chunks(tree, mesh: fpar.Mesh, specs, chunk_specs, which: list[int] | None = None):
    """Blocks (laid out by ``specs``) -> this rank's chunks (``chunk_specs``); ``which``: leaves to cut."""
    n = mesh.shape[DATA]

    def per_device(tree):
        leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)
        cut = range(len(leaves)) if which is None else [k for k, i in enumerate(which) if i >= 0]
        leaves = [_chunk(x, n) if k in set(cut) else x for k, x in enumerate(leaves)]
        return optree.tree_unflatten(treedef, leaves)

    return fpar.shard(per_device, mesh, (specs,), chunk_specs)(tree)


def from_chunks(tree, mesh: fpar.Mesh, chunk_specs, specs, shapes: list[tuple], which: list[int]):
    """The inverse of ``to_chunks``: ``shapes[which[k]]`` is the block shape of chunk leaf ``k``."""

    def per_device(tree):
        leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)
        leaves = [_unchunk(x, shapes[i]) if i >= 0 else x for x, i in zip(leaves, which)]
        return optree.tree_unflatten(treedef, leaves)

    return fpar.shard(per_device, mesh, (chunk_specs,), specs)(tree)


# Plot ---------------------------------------------------------------------------------------------


def plot_losses(losses: list[float], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say(f"(matplotlib is not installed: no loss plot; pip install matplotlib to get {path})")
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1, alpha=0.5, label="loss")
    k = max(1, len(losses) // 20)
    if len(losses) > k:
        smooth = [
            sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1])
            for i in range(len(losses))
        ]
        ax.plot(range(1, len(losses) + 1), smooth, lw=2, label=f"mean of {k}")
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"loss curve: {path}")
