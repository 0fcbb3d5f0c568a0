"""``python -m fpar.plan``: rank layouts of a Llama-shaped model on N devices of a given hardware.

Example::

    python -m fpar.plan --model llama-70b --devices 1024 --hardware h100-sxm --batch 256
    python -m fpar.plan --model tiny            # 4 devices of h100-sxm, batch 8
    python -m fpar.plan --model tiny --devices 8 --hardware this --batch 16
"""

from __future__ import annotations

import argparse
import sys
import time

from ._hardware import PRESETS
from ._models import MODELS, model_step
from ._search import ranking, search

# Where the command line leaves them out: a cluster-sized search for the large models; for ``tiny``
# (4 layers, 2 kv heads) a search of a few devices that its heads and layers divide.
_DEFAULTS: dict[str | None, dict] = {
    None: {"devices": 1024, "batch": 256, "tensor": [4, 8], "pipeline": [2, 4, 8]},
    "tiny": {"devices": 4, "batch": 8, "tensor": [1, 2], "pipeline": [1, 2]},
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, search the layouts, print the ranking; the exit status."""
    ap = argparse.ArgumentParser(prog="python -m fpar.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-70b", choices=sorted(MODELS), help="the model's shape")
    ap.add_argument("--devices", type=int, default=None, help="how many devices (default: the model's)")
    ap.add_argument("--hardware", default="h100-sxm", help=f"one of {sorted(PRESETS) + ['this']}")
    ap.add_argument(
        "--batch", type=int, default=None, help="global batch, in sequences (default: the model's)"
    )
    ap.add_argument(
        "--tensor", type=_ints, default=None, help="tensor sizes to try, e.g. 4,8 (default: the model's)"
    )
    ap.add_argument(
        "--pipeline", type=_ints, default=None, help="pipeline sizes to try (default: the model's)"
    )
    ap.add_argument("--zero", type=_ints, default=[0, 1], help="ZeRO stages to try")
    ap.add_argument("--microbatches", type=_ints, default=[8], help="microbatch counts to try")
    ap.add_argument(
        "--micro-batch",
        type=_ints,
        default=None,
        help="sequences per microbatch to try (instead of --microbatches)",
    )
    ap.add_argument(
        "--virtual", type=_ints, default=[1], help="model chunks per stage to try (interleaved 1F1B)"
    )
    ap.add_argument(
        "--group",
        type=_ints,
        default=None,
        help="interleaved 1F1B's microbatches a group to try, beside the default (the pipeline size; "
        "Megatron-LM's microbatch_group_size_per_vp_stage): lets --microbatches be other than a multiple",
    )
    ap.add_argument("--remat", default="both", choices=["yes", "no", "both"], help="recompute activations")
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedules to try, e.g. 1f1b,gpipe,zb")
    ap.add_argument("--top", type=int, default=10, help="rows of the ranking to print")
    ap.add_argument("--all", action="store_true", help="also list the layouts dropped, and why")
    args = ap.parse_args(argv)
    model = MODELS[args.model]
    for name, value in _DEFAULTS.get(args.model, _DEFAULTS[None]).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    remat = {"yes": [True], "no": [False], "both": [False, True]}[args.remat]
    print(
        f"{model.name}: d={model.d_model} layers={model.n_layers} heads={model.n_heads} kv_heads={model.n_kv_heads} "
        f"ffn={model.d_ffn} vocab={model.vocab} seq={model.seq}, {model.n_params / 1e9:.2f}B parameters; "
        f"batch {args.batch} sequences on {args.devices} x {args.hardware}",
        flush=True,
    )
    start = time.perf_counter()
    try:
        results = search(
            lambda layout: model_step(model, layout),
            args.devices,
            args.hardware,
            model=model,
            keep_dropped=args.all,
            pipeline=args.pipeline,
            tensor=args.tensor,
            zero=args.zero,
            **(
                {"micro_batch": args.micro_batch} if args.micro_batch else {"microbatches": args.microbatches}
            ),
            virtual=args.virtual,
            group=[None, *(args.group or [])],
            remat=remat,
            schedule=args.schedule.split(","),
            batch=[args.batch],
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fits = [r for r in results if r.dropped is None]
    print(
        f"{len(results)} layouts estimated in {time.perf_counter() - start:.0f} s; {len(fits)} fit memory\n"
    )
    shown = fits[: args.top] + ([r for r in results if r.dropped is not None] if args.all else [])
    print(ranking(shown, tokens_per_step=args.batch * model.seq))
    if fits:
        print(f"\nthe fastest layout in full:\n{fits[0].estimate}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
