"""Bytes a parameter at a pipelined step's peak, ZeRO 0, 1 and 3 inside the pipeline, on 4 gloo processes.

The step is ``fpar.plan.model_step``'s: a Llama-shaped model cut into 2 stages of 1F1B over 8
microbatches (pipeline=2 x data=2), bfloat16 compute on float32 master weights, AdamW updated in
place.  ZeRO-1 and ZeRO-3 run inside the pipeline through ``fpar.optim.zero_pipeline`` (each
stage's gradients reduce-scattered over data once a step; ZeRO-3 keeps chunks between steps and
gathers a stage in bfloat16 once a step).  A small sequence, so that model states dwarf
activations.  One more row: ZeRO-0 with the stage functions' bfloat16 casts made per
microbatch, as before the executor shared one per step (``fpar/pipeline/_casts.py``).  And
ZeRO-3 reducing each chunk's gradient as its backward ends (``Layout(reduce_once=False)``,
``zero_pipeline(..., reduce_once=False)``): its float32 gradient is its chunk of the sum and the
one model chunk in flight, 2 + 16/N + 4/v with ``v`` chunks a stage (``--virtual``, interleaved
1F1B): the stage's whole float32 gradient no longer, once ``v`` is above 1.  And ZeRO-3 gathering
each chunk for its own forward and backward (``Layout(reshard_after_forward=True)``): the
running chunk and the next one's prefetch in bfloat16, 2 min(2, v)/v + 4 + 12/N.

Measured independently of fpar's bookkeeping: torch's CPU allocator events under
``torch.profiler``, summed in time order over two steps from the bytes the step's arguments hold
(so buffers a step keeps for the next count too); the peak over the second step, per rank.
Beside it, ``fpar.plan.estimate``'s prediction for the same step, and the formula per parameter
of a stage, N the data size (float32 masters and gradients, AdamW's two float32 moments, one
bfloat16 copy of the stage's weights): ZeRO-0 4 + 4 + 8 + 2 = 18; ZeRO-1 in a pipeline (the
gradient is summed whole over the microbatches, then reduce-scattered) 4 + 4 + 8/N + 2; ZeRO-3
(bfloat16 gathered, float32 gradients) 2 + 4 + 12/N.  Activations come on top.

Run:
    python bench/pipeline_memory.py                 # d=512, 8 layers (33.8M parameters)
    python bench/pipeline_memory.py --dim 256 --layers 4
    python bench/pipeline_memory.py --virtual 4        # interleaved 1F1B, 4 chunks a stage
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
from pathlib import Path

import torch

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from zero import allocation_events, held_bytes

import fpar.plan as plan

N, P_STAGES = 2, 2
CASES = (
    ("0", 0),
    ("0, a cast per microbatch", 0),
    ("1", 1),
    ("3", 3),
    ("3, reduced each microbatch", 3),
    ("3, resharded after forward", 3),
)
EACH = "each microbatch"  # the case reducing each chunk's gradient as its backward ends
RESHARD = "resharded"  # the case gathering each chunk for its own actions (reshard_after_forward)


def formula(zero: int, n: int = N, each_v: int = 0, reshard_v: int = 0) -> float:
    """Bytes a parameter of a stage; ``each_v``: ZeRO-3 reducing each of a stage's ``v`` chunks as it
    ends; ``reshard_v``: ZeRO-3 gathering each of ``v`` chunks for its own actions (two at once:
    the running one and the next one's prefetch)."""
    if each_v:
        return 2 + 16 / n + 4 / each_v
    if reshard_v:
        return 2 * min(2, reshard_v) / reshard_v + 4 + 12 / n
    return {0: 18.0, 1: 10 + 8 / n, 3: 6 + 12 / n}[zero]


def model(cfg: dict) -> plan.Model:
    d = cfg["dim"]
    return plan.Model("bench", d, cfg["layers"], 8, 8, 4 * d, cfg["vocab"], cfg["seq"])


def layout(zero: int, cfg: dict, each: bool = False, reshard: bool = False) -> plan.Layout:
    return plan.Layout(
        pipeline=P_STAGES,
        data=N,
        zero=zero,
        microbatches=8,
        batch=16,
        virtual=cfg["virtual"],
        reduce_once=False if each else None,
        reshard_after_forward=reshard,
    )


def peak_over_two_steps(step, args) -> int:
    """Bytes at the second step's peak: the arguments' bytes plus the running sum of every allocation since."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    held = held_bytes(*args)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(*args)
        gc.collect()
        with record_function("measured step"):
            step(*args)
    allocs, start = allocation_events(prof)
    running = peak = held
    for t, size in allocs:
        running += size
        if t >= start:
            peak = max(peak, running)
    return peak


def worker(cfg: dict) -> dict:
    from fpar.pipeline import _casts

    torch.set_num_threads(1)
    mesh = fpar.make_mesh((P_STAGES, N, 1), ("pipeline", "data", "tensor"), backend="dist")
    out = {}
    for name, zero in CASES:
        shared = _casts.Casts.__call__
        if "per microbatch" in name:  # the executor shares no cast: each microbatch makes its own
            _casts.Casts.__call__ = lambda self, func, args, kwargs: None
        try:
            step, args = plan.model_step(model(cfg), layout(zero, cfg, EACH in name, RESHARD in name), mesh)
            out[name] = peak_over_two_steps(step, args)
        finally:
            _casts.Casts.__call__ = shared
        del step, args
    out["coords"] = dict(mesh._dist.coords)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--virtual", type=int, default=1, help="chunks a stage (interleaved 1F1B above 1)")
    cfg = vars(parser.parse_args(argv))
    m = model(cfg)
    per_stage = (m.n_params - 2 * m.vocab * m.d_model) / P_STAGES  # the layers' parameters a stage holds
    print(
        f"# Pipelined step memory: Llama-shaped d={cfg['dim']} L={cfg['layers']} seq={cfg['seq']}, "
        f"{m.n_params / 1e6:.1f}M parameters, pipeline={P_STAGES} x data={N}, 1F1B over 8 microbatches "
        f"({cfg['virtual']} chunks a stage), "
        f"bf16 compute, AdamW in place; 4 gloo processes; torch {torch.__version__}, {platform.machine()}"
    )
    ranks = fpar.launch(worker, N * P_STAGES, cfg, timeout=1200.0)
    print(
        "| ZeRO | stage | measured B/param (data ranks) | fpar.plan B/param | formula | measured / formula |"
    )
    print("|---|---|---|---|---|---|")
    for name, zero in CASES:
        each, reshard = EACH in name, RESHARD in name
        est = plan.estimate(
            *_abstract(zero, cfg, shared="per microbatch" not in name, each=each, reshard=reshard)
        )
        for s in range(P_STAGES):
            got = [r[name] / per_stage for r in ranks if r["coords"]["pipeline"] == s]
            planned = [c.peak_bytes for c in est.devices if c.coords.get("pipeline", 0) == s]
            want = formula(
                zero, each_v=cfg["virtual"] if each else 0, reshard_v=cfg["virtual"] if reshard else 0
            )
            print(
                f"| {name} | {s} | {', '.join(f'{g:.2f}' for g in got)} | "
                f"{max(planned) / per_stage:.2f} | {want:.1f} | {max(got) / want:.2f} |"
            )


def _abstract(zero: int, cfg: dict, shared: bool, each: bool = False, reshard: bool = False):
    from fpar.pipeline import _casts

    step, args = plan.model_step(model(cfg), layout(zero, cfg, each, reshard))
    if shared:
        return (step, *args)
    saved = _casts.Casts.__call__
    _casts.Casts.__call__ = lambda self, func, args, kwargs: None

    def unshared(*a):
        _casts.Casts.__call__ = lambda self, func, args, kwargs: None
        try:
            return step(*a)
        finally:
            _casts.Casts.__call__ = saved

    _casts.Casts.__call__ = saved
    return (unshared, *args)


if __name__ == "__main__":
    main()
