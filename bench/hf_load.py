"""Peak host memory per process while loading a >= 1 GB checkpoint onto 4 processes.

Two ways to get a tensor-parallel Hugging Face model onto ``tensor=4`` gloo processes:

* **fpar**: ``fpar.hf.from_pretrained(path, mesh)``: the model on ``meta``, each process reading
  only its blocks with safetensors slices (one whole tensor's pages mapped at a time);
* **transformers**: ``AutoModelForCausalLM.from_pretrained(path)`` in every process, the whole
  model (what a user does before ``fpar.ops.tensor_parallel`` or DTensor's ``parallelize_module``
  without transformers' own ``tp_plan``), then ``tensor_parallel`` and its blocks kept.

The checkpoint is written first to a temporary directory (a random-init float32 Llama-shaped
model, ~266M parameters = 1.06 GB, 2 shard files) and removed at the end.  Each process reads
its peak resident set (``VmHWM`` of ``/proc/self/status``, reset with ``clear_refs`` after the
imports, so it is the peak of the load alone plus the interpreter); ``VmRSS`` before the load is
the interpreter with torch, fpar and transformers imported.  One run; both printed per rank, and
the ratio of the peaks and of the growth.  Not a test.

Run:
    python bench/hf_load.py                 # 4 processes, ~1.06 GB fp32
    python bench/hf_load.py --layers 8      # a smaller model
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

import fpar

NPROCS = 4


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """Make VmHWM start from the current resident set (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def load(path: str, how: str) -> dict:
    """One process: import, reset the peak, load, report (MB)."""
    import transformers  # noqa: F401  (imported before the baseline on both sides)

    mesh = fpar.make_mesh((NPROCS,), ("tensor",))
    torch.distributed.barrier()
    reset_peak()
    before = status_kb("VmRSS")
    t0 = time.perf_counter()
    if how == "fpar":
        _, params, _ = fpar.hf.from_pretrained(path, mesh)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        apply_fn, whole, specs = fpar.ops.tensor_parallel(model, mesh)
        params = fpar.device_put(whole, mesh, specs)
        del model, whole, apply_fn
    seconds = time.perf_counter() - t0
    held = sum(t.numel() * t.element_size() for t in params.values())
    torch.distributed.barrier()
    return {
        "before": before / 1024,
        "peak": status_kb("VmHWM") / 1024,
        "held": held / 2**20,
        "seconds": seconds,
    }


def write_checkpoint(path: str, layers: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size="600MB")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=17)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fpar-hf-load-")
    try:
        path = os.path.join(tmp, "llama")
        n = write_checkpoint(path, args.layers)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        print(f"checkpoint: Llama-shaped, {n / 1e6:.0f}M parameters, float32, {size / 2**30:.2f} GiB on disk")
        print(f"{NPROCS} gloo processes, mesh tensor={NPROCS}; MB per process (VmRSS before, VmHWM peak)\n")
        results = {}
        for how in ("fpar", "transformers"):
            results[how] = fpar.launch(load, NPROCS, path, how, timeout=900.0)
        print(f"{'':14s} {'rank':>4s} {'before':>8s} {'peak':>8s} {'growth':>8s} {'held':>8s} {'load s':>7s}")
        for how, ranks in results.items():
            for r, x in enumerate(ranks):
                growth = x["peak"] - x["before"]
                print(
                    f"{how:14s} {r:4d} {x['before']:8.0f} {x['peak']:8.0f} {growth:8.0f} {x['held']:8.0f} "
                    f"{x['seconds']:7.1f}"
                )
        worst = {how: max(x["peak"] for x in ranks) for how, ranks in results.items()}
        growth = {how: max(x["peak"] - x["before"] for x in ranks) for how, ranks in results.items()}
        print(
            f"\nlargest peak per process: fpar {worst['fpar']:.0f} MB, transformers {worst['transformers']:.0f} MB "
            f"(fpar / transformers = {worst['fpar'] / worst['transformers']:.2f}); growth while loading: "
            f"fpar {growth['fpar']:.0f} MB, transformers {growth['transformers']:.0f} MB "
            f"(ratio {growth['fpar'] / growth['transformers']:.2f})"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
