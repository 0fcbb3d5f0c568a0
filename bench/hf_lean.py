"""What a Hugging Face decoder layer keeps for the backward: plain, fpar.hf.lean, fpar.hf.remat, SP.

    python bench/hf_lean.py              # one device
    python bench/hf_lean.py --tensor 2   # per process, 2 gloo processes: TP against TP + SP

A Qwen3-0.6B-shaped model (hidden 1024, MLP 3072, 16 query and 8 kv heads of 128, bf16, eager
attention off: sdpa) built from its config with 2 and 4 layers; one layer's bytes are the
difference, each storage autograd saves counted once, the parameters apart.  Printed in MiB and in
bytes per ``s b h`` (s = 512 tokens, b = 1).
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import fpar
from fpar import P

SEQ, HIDDEN = 512, 1024


def saved_bytes(layers: int, mode: str, mesh=None) -> int:
    cfg = Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=layers,
        vocab_size=1024,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    mesh = mesh if mesh is not None else fpar.make_mesh((1,), ("tensor",))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, sequence_parallel="sp" in mode)
    params = fpar.device_put(params, mesh, specs)
    if "lean" in mode:
        fpar.hf.lean(apply_fn)
    if "remat" in mode:
        fpar.hf.remat(apply_fn)
    loss = fpar.shard(lambda p, x: apply_fn(p, x, labels=x, use_cache=False).loss, mesh, (specs, P()), P())
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    own = {p.untyped_storage().data_ptr() for p in params.values()}
    seen: dict = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 1024, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(params, ids)
    return sum(seen.values())


SP_MODES = ("plain", "sp", "lean", "lean+sp")


def per_process() -> dict:
    """On each of the launched processes: a layer's bytes per mode at tensor = the world size."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    mesh = fpar.make_mesh((dist.get_world_size(),), ("tensor",))
    return {mode: (saved_bytes(4, mode, mesh) - saved_bytes(2, mode, mesh)) / 2 for mode in SP_MODES}


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensor", type=int, default=1, help="tensor-parallel processes (gloo); 1: in this one")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.tensor > 1:  # eager attention (tensor_parallel's): its 16 heads' scores are kept, split
        layers = fpar.launch(per_process, args.tensor, timeout=900)[0]
        print(f"Qwen3-0.6B-shaped layer, bf16, {SEQ} tokens, tensor={args.tensor} (gloo): bytes one process")
        print("keeps for the backward per layer; sp: the norms' and residuals' sequence blocks")
        print("| mode | MiB a layer | bytes / (s b h) | / without SP |")
        print("|---|---|---|---|")
        for mode in SP_MODES:
            base = layers[mode.replace("sp", "plain") if mode == "sp" else mode.replace("+sp", "")]
            print(
                f"| {mode} | {layers[mode] / 2**20:.2f} | {layers[mode] / (SEQ * HIDDEN):.1f} | {layers[mode] / base:.2f} |"
            )
        return
    print(f"Qwen3-0.6B-shaped layer, bf16, {SEQ} tokens: bytes saved for the backward per layer")
    print("| mode | MiB a layer | bytes / (s b h) |")
    print("|---|---|---|")
    for mode in ("plain", "lean", "remat", "lean+remat"):
        layer = (saved_bytes(4, mode) - saved_bytes(2, mode)) / 2
        print(f"| {mode} | {layer / 2**20:.2f} | {layer / (SEQ * HIDDEN):.1f} |")


if __name__ == "__main__":
    main()
