"""fpar.plan against what it predicts: step time here, Llama-70B on paper, and a search's cost.

    python bench/plan.py time     # hardware="this": predicted vs measured step time, 2 and 4 gloo processes
    python bench/plan.py llama    # Llama-70B-shaped on 1024 "h100-sxm": layouts, seconds per estimate
    python bench/plan.py search   # fpar.plan.search over Llama-70B's layouts on 1,024 GPUs: wall time, layouts/min
    python bench/plan.py memory   # model states and activations against the published formulas
    python bench/plan.py published  # the published runs of docs/plan.md's table (minutes each)
    python bench/plan.py published --retime  # the same from their stored traces (seconds)

``time`` runs the same step (fpar.plan.model_step: a small Llama, TP+SP, ZeRO, pipeline; float32)
on a real mesh of gloo processes and on an abstract mesh under ``estimate(hardware="this")``
(this machine's matmul FLOP/s, copy bandwidth, per-op overhead and gloo's alpha/beta, measured
first), and prints predicted / measured medians.  Run it on an idle machine.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch

import fpar
import fpar.plan as plan

SMALL = plan.Model("small", 256, 4, 8, 4, 768, 4096, 128)
TIME_CASES = [  # (name, layout) on 2 and 4 processes
    ("dp", plan.Layout(data=2, zero=0, microbatches=1, batch=8)),
    ("tp", plan.Layout(data=1, tensor=2, zero=0, microbatches=1, batch=8)),
    ("zero1 dp x tp", plan.Layout(data=2, tensor=2, zero=1, microbatches=1, batch=8)),
    ("pipeline", plan.Layout(pipeline=2, data=1, zero=0, microbatches=4, batch=8)),
    ("pipeline x tp", plan.Layout(pipeline=2, tensor=2, zero=0, microbatches=4, batch=8)),
]


def _real_step_seconds(layout_fields: dict, repeats: int) -> float:
    layout = plan.Layout(**layout_fields)
    mesh = fpar.make_mesh((layout.pipeline, layout.data, layout.tensor), ("pipeline", "data", "tensor"))
    step, args = plan.model_step(SMALL, layout, mesh, dtype=torch.float32)
    for _ in range(2):
        out = step(*args)
        del out
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        t = time.perf_counter()
        out = step(*args)
        loss = out[-1] if isinstance(out, tuple) else None
        if isinstance(loss, torch.Tensor):
            float(loss)  # the step is done when its loss is
        times.append(time.perf_counter() - t)
        del out
    return statistics.median(times)


def bench_time(rounds: int = 3, repeats: int = 7) -> None:
    """Predicted / measured step time, ``rounds`` times: each round measures "this" afresh.

    The machine itself moves between a calibration and a run (a shared VM), so one round says
    little; the median of the rounds' ratios is the figure.
    """
    from fpar.plan._hardware import measure_this

    ratios: dict = {name: [] for name, _ in TIME_CASES}
    for r in range(rounds):
        hw = measure_this(estimate=plan.estimate)
        print(f"round {r + 1}: hardware 'this':", *hw.describe(), sep="\n  ")
        print(
            f"\n{'case':<16}{'devices':>8}{'predicted ms':>14}{'measured ms':>13}{'ratio':>8}   compute / exposed comm / bubble ms"
        )
        for name, layout in TIME_CASES:
            step, args = plan.model_step(SMALL, layout, dtype=torch.float32)
            est = plan.estimate(step, *args, hardware=hw)
            fields = dataclasses.asdict(layout)
            measured = statistics.median(
                fpar.launch(_real_step_seconds, layout.devices, fields, repeats, timeout=600.0)
            )
            ratios[name].append(est.step_time / measured)
            tb = est.time_breakdown
            print(
                f"{name:<16}{layout.devices:>8}{est.step_time * 1e3:>14.1f}{measured * 1e3:>13.1f}{est.step_time / measured:>8.2f}"
                f"   {tb['compute'] * 1e3:.0f} / {tb['exposed_comm'] * 1e3:.0f} / {tb['bubble'] * 1e3:.0f}",
                flush=True,
            )
        print()
    print(f"{'case':<16}{'median ratio':>13}   rounds")
    for name, rs in ratios.items():
        inside = "inside" if 0.8 <= statistics.median(rs) <= 1.2 else "OUTSIDE"
        print(
            f"{name:<16}{statistics.median(rs):>13.2f}   {' '.join(f'{x:.2f}' for x in rs)}   {inside} +-20 %"
        )


LLAMA_LAYOUTS = [
    plan.Layout(pipeline=4, data=32, tensor=8, zero=1, microbatches=8, batch=256, remat=True),
    plan.Layout(pipeline=8, data=16, tensor=8, zero=1, microbatches=8, batch=256, remat=False),
    plan.Layout(pipeline=2, data=64, tensor=8, zero=1, microbatches=4, batch=256, remat=True),
    plan.Layout(pipeline=4, data=64, tensor=4, zero=0, microbatches=4, batch=256, remat=True),
]


def bench_llama() -> None:
    model = plan.MODELS["llama-70b"]
    print(f"{model.name}: {model.n_params / 1e9:.2f}B parameters, seq {model.seq}, on 1024 x h100-sxm")
    results = []
    for layout in LLAMA_LAYOUTS:
        t = time.perf_counter()
        step, args = plan.model_step(model, layout)
        est = plan.estimate(step, *args)
        r = plan.Result(layout, est, time.perf_counter() - t)
        results.append(r)
        print(f"  {layout.describe()}: estimated in {r.seconds:.1f} s", flush=True)
    results.sort(key=lambda r: r.estimate.step_time)
    print()
    print(plan.ranking(results, tokens_per_step=256 * model.seq))
    print(f"\nseconds per estimate: {', '.join(f'{r.seconds:.1f}' for r in results)}")
    print(f"\n{results[0].estimate}")
    path = os.environ.get("PLAN_PNG")
    if path:
        results[0].estimate.plot(path)
        print(f"picture: {path}")


TRACES = os.path.join(os.path.dirname(__file__), "plan_published")  # each run's recorded ops and messages


def _published_one(name: str) -> dict:
    """Estimate one published run (minutes); store its trace; return its record."""
    import gzip
    import json

    from fpar.plan import _published, _trace

    run = next(r for r in _published.RUNS if r.name == name)
    t = time.perf_counter()
    step, args = plan.model_step(run.model, run.layout)
    est = plan.estimate(step, *args, hardware=run.hardware)
    seconds = time.perf_counter() - t
    os.makedirs(TRACES, exist_ok=True)
    with gzip.open(os.path.join(TRACES, _published.slug(run) + ".json.gz"), "wt") as f:
        json.dump(_trace.dump(est), f, separators=(",", ":"))
    return {**_published.record(est, run), "estimate_seconds": seconds}


def bench_published(names: list[str], retime: bool = False) -> None:
    """The published runs (docs/plan.md's table) into bench/plan_published.json and the page.

    Estimates each run (minutes; its trace stored in bench/plan_published/), or with
    ``--retime`` times the stored traces again with today's time model (seconds).
    """
    import gzip
    import json
    from concurrent.futures import ProcessPoolExecutor

    from fpar.plan import _published

    path = os.path.join(os.path.dirname(__file__), "plan_published.json")
    records = json.load(open(path)) if os.path.exists(path) else {}
    runs = [r for r in _published.RUNS if not names or r.name in names]
    if retime:
        for run in runs:
            trace = os.path.join(TRACES, _published.slug(run) + ".json.gz")
            if not os.path.exists(trace):
                print(
                    f"{run.name}: no trace; estimate it first (python bench/plan.py published '{run.name}')"
                )
                records.pop(run.name, None)  # a record no trace re-derives is not shown
                continue
            with gzip.open(trace, "rt") as f:
                est = _published.retimed(run, json.load(f))
            seconds = records.get(run.name, {}).get("estimate_seconds")
            records[run.name] = {**_published.record(est, run), "estimate_seconds": seconds}
    else:
        with ProcessPoolExecutor(min(len(runs), os.cpu_count() or 1)) as pool:
            for run, got in zip(runs, pool.map(_published_one, [r.name for r in runs])):
                records[run.name] = got
                print(f"{run.name}: estimated in {got['estimate_seconds']:.0f} s", flush=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1, sort_keys=True)
        f.write("\n")
    table = _published.render(records)
    doc = os.path.join(os.path.dirname(__file__), "..", "docs", "plan.md")
    text = open(doc).read()
    begin, end = _published.BEGIN, _published.END
    if begin in text:
        head, rest = text.split(begin)
        text = head + begin + "\n" + table + "\n" + end + rest.split(end)[1]
        open(doc, "w").write(text)
    print(table)
    for run in runs:
        got = records.get(run.name)
        if got:
            losses = ", ".join(f"{k} {v:.1%}" for k, v in got["losses"].items())
            print(f"\n{run.name}: MFU {got['mfu']:.1%}, HFU {got['hfu']:.1%}; {losses}")
        trace = os.path.join(TRACES, _published.slug(run) + ".json.gz")
        if got and run.layout.tensor > 1 and os.path.exists(trace):
            with gzip.open(trace, "rt") as f:
                est = _published.retimed(run, _sixteen_bit_sums(json.load(f)))
            pred = _published.record(est, run)["predicted_tflops"]
            print(
                f"  with its tensor-parallel sums in 16 bits (Megatron's): {pred:.0f} ({pred / run.published_tflops:.2f})"
            )


def _sixteen_bit_sums(trace: dict) -> dict:
    """A trace whose tensor-axis sums carry half their bytes: fpar sums bf16 in float32, Megatron in bf16."""
    for k in trace["kinds"]:
        if k[0] == "comm" and k[1] in ("psum", "psum_scatter") and k[2] == ["tensor"]:
            k[3] //= 2
    return trace


SEARCH = (
    dict(  # Llama-70B on 1,024 H100s: pipeline x tensor x data x interleaving x microbatch x ZeRO x remat
        pipeline=[1, 4, 8],
        tensor=[8],
        virtual=[1, 2],
        micro_batch=[1, 2],
        zero=[0, 1, 3],
        remat=[False, True],
        batch=[256],
    )
)


def bench_search() -> None:
    """fpar.plan.search over SEARCH: the ranking, its wall time and layouts per minute."""
    model = plan.MODELS["llama-70b"]
    t = time.perf_counter()
    results = plan.search(
        lambda layout: plan.model_step(model, layout),
        1024,
        "h100-sxm",
        model=model,
        keep_dropped=True,
        **SEARCH,
    )
    seconds = time.perf_counter() - t
    print(plan.ranking(results, tokens_per_step=256 * model.seq))
    print(
        f"\n{len(results)} layouts in {seconds:.0f} s on {os.cpu_count()} CPUs: "
        f"{len(results) / seconds * 60:.1f} layouts per minute ({seconds / max(len(results), 1):.1f} s each)"
    )
    path = os.environ.get("PLAN_PNG")
    kept = [r for r in results if r.dropped is None]
    if path and kept:
        kept[0].estimate.plot(path)
        print(f"picture of the best: {path}")


def bench_memory() -> None:
    """Model states against ZeRO's formulas; one layer's activations against Korthikanti et al.'s."""
    base = plan.MODELS["llama-70b"]
    for zero in (0, 1):
        model = dataclasses.replace(base, n_layers=4)
        layout = plan.Layout(pipeline=2, data=32, tensor=8, zero=zero, microbatches=2, batch=64)
        step, args = plan.model_step(model, layout)
        est = plan.estimate(step, *args)
        c = est.devices[0]
        psi = c.state_bytes["params"] / 4
        want = 12 * psi if zero == 0 else 4 * psi + 8 * psi / layout.data
        got = c.state_bytes["params"] + c.state_bytes["optimizer"]
        print(
            f"zero={zero}: params+AdamW {got / 2**30:.3f} GiB, formula {want / 2**30:.3f} GiB ({got / want - 1:+.2%})"
        )
    # activations of one layer: the difference between 4 and 2 layers per stage, one microbatch in flight
    s, b = base.seq, 1
    for t in (8,):
        peaks, states, weights, saved = [], [], [], []
        for layers in (2, 4):
            model = dataclasses.replace(base, n_layers=layers)
            layout = plan.Layout(pipeline=1, data=1, tensor=t, zero=0, microbatches=1, batch=b)
            step, args = plan.model_step(model, layout)
            c = plan.estimate(step, *args).devices[0]
            peaks.append(c.peak_bytes)
            saved.append(c.saved_activations)
            # model states: float32 weights, their float32 gradients, AdamW's m and v
            states.append(2 * c.state_bytes["params"] + c.state_bytes["optimizer"])
            weights.append(c.state_bytes["params"] / 2)  # the bfloat16 copies each layer's matmuls keep
        per_layer = (peaks[1] - peaks[0]) / 2
        act = (saved[1] - saved[0]) / 2  # what the forward keeps for the backward, per layer
        h, a = base.d_model, base.n_heads
        # Korthikanti et al. 2022 (TP + SP, 16-bit): s b h (34 + 5 a s / h) / t, written for GPT-3's block
        gpt = s * b * h * (34 + 5 * a * s / h) / t
        flash = s * b * h * 34 / t  # the same with the attention scores not kept (flash attention)
        print(
            f"tensor={t}: one Llama-70B layer adds {per_layer / 2**20:.1f} MiB at the peak: model states "
            f"{(states[1] - states[0]) / 2 / 2**20:.1f}; the forward keeps {act / 2**20:.1f} MiB for the backward "
            f"(of which bf16 weight copies {(weights[1] - weights[0]) / 2 / 2**20:.1f})"
        )
        print(
            f"  Korthikanti's GPT-3 block: {gpt / 2**20:.1f} MiB with the s x s scores, {flash / 2**20:.1f} MiB "
            f"without (flash); activations / that = {act / flash:.2f} (a Llama block is not GPT-3's: see bench/README)"
        )
        # Megatron-LM's Llama layer with fused RMSNorm and SwiGLU, flash attention, SP: the norms' and
        # matmuls' inputs, q, k and v, attention's output, SwiGLU's gate and up and the down input
        g, f = base.n_kv_heads / base.n_heads, base.d_ffn / h
        fused = s * b * h * (4 * 2 + 2 + 4 * g + 2 + 6 * f) / t
        weights_only = act - (weights[1] - weights[0]) / 2
        print(
            f"  Megatron-LM's Llama layer (fused kernels): {fused / 2**20:.1f} MiB; fpar's activations less the "
            f"weight copies {weights_only / 2**20:.1f} MiB = {weights_only / fused:.3f} of it"
        )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "time"
    if what == "time" and len(sys.argv) > 2:  # python bench/plan.py time ROUNDS
        bench_time(int(sys.argv[2]))
        sys.exit()
    if what == "published":  # python bench/plan.py published [--retime] [RUN NAME ...]
        rest = sys.argv[2:]
        bench_published([n for n in rest if n != "--retime"], retime="--retime" in rest)
        sys.exit()
    {"time": bench_time, "llama": bench_llama, "search": bench_search, "memory": bench_memory}[what]()
