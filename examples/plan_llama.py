"""Plan Llama-70B-shaped training on 1,024 H100s from a laptop: memory, traffic and time per layout.

Each layout's whole training step (fpar.plan.model_step: Megatron TP + sequence parallel, ZeRO,
fpar's pipeline executor, per-layer recomputation; float32 master weights, bfloat16 compute,
flash attention) runs on an abstract mesh of 1,024 devices under fpar.plan.estimate: no
processes, no memory.  The example prints the ranked layouts and the best one's table, and
draws it.

    python examples/plan_llama.py                      # four layouts of Llama-70B, ~1 min each here
    python examples/plan_llama.py --model tiny --devices 8 --hardware this   # seconds; checkable here
    python -m fpar.plan --model llama-70b --devices 1024 --pipeline 2,4,8 --tensor 4,8   # a search
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py, next to this file
import _common as C  # noqa: E402

import fpar.plan as plan  # noqa: E402

LAYOUTS = {  # (pipeline, tensor, zero, microbatches, remat); data = devices / (pipeline x tensor)
    "llama-70b": [(4, 8, 1, 8, True), (8, 8, 1, 8, False), (2, 8, 1, 4, True), (4, 4, 0, 4, True)],
    "tiny": [(2, 2, 1, 4, False), (1, 2, 1, 2, False), (2, 1, 0, 4, True), (1, 1, 1, 1, False)],
}


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-70b", choices=sorted(plan.MODELS))
    ap.add_argument("--devices", type=int, default=1024)
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument(
        "--batch", type=int, default=None, help="global batch in sequences (default: 256, tiny: 16)"
    )
    ap.add_argument("--plot", default="plan_llama.png", help="where to draw the best layout ('' for none)")
    args = ap.parse_args(argv)
    model = plan.MODELS[args.model]
    batch = args.batch or (16 if args.model == "tiny" else 256)
    print(
        f"{model.name}: {model.n_params / 1e9:.2f}B parameters, seq {model.seq}, batch {batch} sequences, "
        f"{args.devices} x {args.hardware}"
    )
    results = []
    for p, t, zero, m, remat in LAYOUTS.get(args.model, LAYOUTS["tiny"]):
        if args.devices % (p * t):
            continue
        layout = plan.Layout(
            pipeline=p,
            data=args.devices // (p * t),
            tensor=t,
            zero=zero,
            microbatches=m,
            batch=batch,
            remat=remat,
        )
        start = time.perf_counter()
        try:
            step, args_ = plan.model_step(model, layout)
        except ValueError as e:  # a layout that does not divide this model or batch
            print(f"  {layout.describe()}: skipped ({e})")
            continue
        est = plan.estimate(step, *args_, hardware=args.hardware)
        results.append(plan.Result(layout, est, time.perf_counter() - start))
        print(
            f"  {layout.describe()}: {est.peak_bytes / 2**30:.1f} GiB, {est.step_time:.3f} s per step "
            f"(estimated in {results[-1].seconds:.1f} s)",
            flush=True,
        )
    results.sort(key=lambda r: (not r.estimate.fits, r.estimate.step_time))
    print()
    print(plan.ranking(results, tokens_per_step=batch * model.seq))
    if results:
        best = results[0].estimate
        print(f"\n{best}")
        if args.plot:
            C.say(f"picture: {best.plot(args.plot)}")
    return results


if __name__ == "__main__":
    main()
