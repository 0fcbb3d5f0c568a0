"""Tensor-parallel training step of a Hugging Face GPT-2: fpar against DTensor's parallelize_module.

Both sides train the same randomly initialised ``GPT2LMHeadModel`` (float32, eager attention,
dropout off) on the same batch, Megatron-split over 2 gloo processes on this machine, with the
same split: attention (``c_attn`` column-parallel by heads, ``c_proj`` row-parallel) and MLP
(``c_fc`` column, ``c_proj`` row) in every block; embeddings, LayerNorms and the tied head
replicated (DTensor's ``RowwiseParallel`` embedding plus a vocab-parallel loss would need
``loss_parallel`` around HF's loss; the blocks are where the work is):

* **fpar**: ``fpar.ops.tensor_parallel(model, mesh, plan=...)`` on the unmodified model;
  ``torch.func.grad_and_value`` of ``fpar.shard(apply_fn(p, ids, labels=ids).loss)``, and the
  same sharded loss differentiated with ``.backward()`` (fpar supports both).
* **DTensor**: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``.  DTensor's
  styles split ``nn.Linear`` only, so the baseline's ``Conv1D`` layers are replaced by equivalent
  ``nn.Linear`` (transposed weights), ``c_attn``'s rows regrouped per device (each rank's block
  holds its heads of q, k and v, as fpar does) and the attention's ``split_size``/``num_heads``
  set to per-rank sizes: what a user must do by hand for DTensor.  ``loss.backward()``.

Both update with the same plain SGD (``torch._foreach_add_``).  Checked first: the two sides'
losses and updated parameters agree after one step from the same initial values.  Then both are
warmed up and timed interleaved (the order alternates), each full step after a barrier; medians
from rank 0 and the ratio fpar / DTensor (target <= 1.0).  Timings are printed, never asserted.

``--family qwen3``: a Qwen3-shaped model (GQA, per-head q/k norms) with ``plan="auto"`` (its own
transformers plan) against ``parallelize_module`` driven by the same plan, translated by hand to
DTensor's styles (``colwise`` -> ``ColwiseParallel()``, ``rowwise`` -> ``RowwiseParallel()``,
``embedding_rowwise`` -> ``RowwiseParallel(input_layouts=Replicate())``,
``colwise_gather_output`` -> ``ColwiseParallel(output_layouts=Replicate())``,
``replicated_with_grad_allreduce`` -> an all-reduce of those gradients after ``.backward()``).

``--family qwen3_moe --ep``: expert parallelism from the model's own plan.  A Qwen3-MoE (``--experts``
experts a layer, top-2) with its experts split over an ``expert`` axis of the 2 processes
(``fpar.ops.tensor_parallel(model, mesh, expert_axis="expert")``: its ``base_model_ep_plan``; each
(token, choice) pair sent to its expert's device and back with ``all_to_all``), the batch rows
split over the same axis, against what a user runs without expert parallelism: plain PyTorch
data parallelism with every expert on every process (``DistributedDataParallel`` of the same
model, ``loss.backward()``).  Both take the same SGD step; checked first that the losses and an
expert's and an attention weight's update agree.

``--collectives``: the table of collectives per transformer block, fpar's measured with
``fpar.comm_stats()`` (in-process, tensor=2) and transformers' plan's counted per style.

Run:
    python bench/hf_tp.py                            # d=256, 4 layers, batch 8 x 128, 15 repeats
    python bench/hf_tp.py --d-model 512 --repeats 21
    python bench/hf_tp.py --family qwen3
    python bench/hf_tp.py --family qwen3_moe --ep  # experts over expert=2 vs DDP with every expert local
    python bench/hf_tp.py --collectives
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

try:
    import fpar
except ImportError:  # run from a checkout without installing: use the repo's fpar/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fpar
from _common import Record, add_json_arg, interleaved

from fpar import P

NPROCS = 2
LR = 1e-3
PLAN = {
    "*.attn.c_attn": "colwise",
    "*.attn.c_proj": "rowwise",
    "*.mlp.c_fc": "colwise",
    "*.mlp.c_proj": "rowwise",
}


def build(cfg: dict):
    if cfg["family"] == "qwen3":
        return build_qwen3(cfg)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=cfg["vocab"],
        n_positions=cfg["seq"],
        n_embd=cfg["d_model"],
        n_layer=cfg["layers"],
        n_head=cfg["heads"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    model.set_attn_implementation("eager")
    return model


def build_qwen3(cfg: dict, **kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d, heads = cfg["d_model"], cfg["heads"]
    config = Qwen3Config(
        vocab_size=cfg["vocab"],
        max_position_embeddings=cfg["seq"],
        hidden_size=d,
        num_hidden_layers=cfg["layers"],
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, NPROCS),
        head_dim=d // heads,
        intermediate_size=4 * d,
        tie_word_embeddings=False,
        **kw,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def build_qwen3_moe(cfg: dict):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    d, heads = cfg["d_model"], cfg["heads"]
    config = Qwen3MoeConfig(
        vocab_size=cfg["vocab"],
        max_position_embeddings=cfg["seq"],
        hidden_size=d,
        num_hidden_layers=cfg["layers"],
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=d // heads,
        num_experts=cfg["experts"],
        num_experts_per_tok=2,
        moe_intermediate_size=2 * d,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def sgd_step(grad_fn, params: dict, args: tuple, out: dict):
    """fpar's step: ``grad_fn(params, *args) -> (grads, loss)``, then SGD in place; the loss in ``out``."""
    names = list(params)
    plist = [params[k] for k in names]

    def step():
        g, loss = grad_fn(params, *args)
        torch._foreach_add_(plist, [g[k] for k in names], alpha=-LR)
        out["fpar"] = float(loss)

    return step


def backward_sgd_step(loss_fn, groups: list, out: dict, key: str | None, allreduce: tuple = ()):
    """A module's step: ``loss_fn().backward()``, an all-reduce of the gradients of ``allreduce``,
    then SGD in place, one foreach call per group (foreach refuses DTensors mixed with tensors);
    the loss in ``out[key]``."""

    def step():
        loss = loss_fn()
        loss.backward()
        for p in allreduce:
            dist.all_reduce(p.grad)
        with torch.no_grad():
            for group in groups:
                torch._foreach_add_(group, [p.grad for p in group], alpha=-LR)
        for group in groups:
            for p in group:
                p.grad = None
        if key is not None:
            out[key] = float(loss.detach())

    return step


def worker_ep(cfg: dict) -> dict:
    """fpar's expert-parallel step against DDP with every expert local, on this process's rows."""
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(cfg["threads"])
    n, rank = dist.get_world_size(), dist.get_rank()
    model = build_qwen3_moe(cfg)
    ids = torch.randint(
        0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(1)
    )
    mine = ids.chunk(n)[rank]  # this process's rows (both sides)
    mesh = fpar.make_mesh((n, 1), ("expert", "tensor"))
    out: dict = {}

    def make_fpar(backward: bool = False):
        """(a) fpar: the experts over the expert axis, the rows too."""
        apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, expert_axis="expert")
        params = {k: v.clone() for k, v in fpar.device_put(params, mesh, specs).items()}

        def per_device(p, x):
            return fpar.pmean(apply_fn(p, x, labels=x, use_cache=False).loss, "expert")

        loss_fn = fpar.shard(per_device, mesh, (specs, P("expert")), P())
        return fpar_side(loss_fn, params, fpar.device_put(ids, mesh, P("expert")), out, backward)

    def make_ddp():
        """(b) DDP: the whole model on every process, its rows, gradients all-reduced in buckets."""
        ddp = DistributedDataParallel(copy.deepcopy(model))
        step = backward_sgd_step(
            lambda: ddp(mine, labels=mine, use_cache=False).loss, [list(ddp.parameters())], out, "ddp"
        )
        step.ddp = ddp
        return step

    # Peak memory of each side, built afresh under the profiler: everything it allocates (its
    # parameters, kept buffers and DDP's gradient buckets included) at the peak of its second step
    (fpar_step, fpar_backward_step, ddp_step), peaks = built_sides(
        {"fpar": make_fpar, "fpar .backward()": lambda: make_fpar(backward=True), "ddp": make_ddp}
    )
    params, ddp = fpar_step.params, ddp_step.ddp

    # Check: one step of each from the same values: the mean loss, an expert's and q_proj's update
    fpar_step()
    ddp_step()
    mean = torch.tensor(out["ddp"])
    dist.all_reduce(mean)
    loss_diff = abs(out["fpar"] - float(mean) / n)
    e = cfg["experts"] // n  # this process's experts: rows rank*e .. (rank+1)*e of the whole weight
    down = "model.layers.0.mlp.experts.down_proj"
    w_d = dict(ddp.module.named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    with torch.no_grad():
        weight_diff = max(
            float((params[down] - w_d[down][rank * e : (rank + 1) * e]).abs().max()),
            float((params[q] - w_d[q]).abs().max()),
        )
    steps = {"fpar": fpar_step, "fpar .backward()": fpar_backward_step, "ddp": ddp_step}
    for _ in range(cfg["warmup"]):
        for step in steps.values():
            step()
    times = interleaved(steps, cfg["repeats"])
    fpar.reset_comm_stats()
    fpar_step()
    experts = getattr(model.config, "_experts_implementation", None)
    return {"times": times, "loss_diff": loss_diff, "weight_diff": weight_diff, "stats": fpar.comm_stats(),
            "experts_impl": experts, "peaks": peaks}  # fmt: skip


def built_peak(make) -> int:
    """Bytes allocated at the peak of the second step of ``make()``'s step, counted from its building.

    ``make`` builds a side (its parameters, optimizer, buffers) and returns its step; all of it
    runs under the CPU profiler's memory events (``zero.allocation_events``), so what the side
    keeps between steps is in the count as well as what a step makes and frees.
    """
    import gc

    from torch.profiler import ProfilerActivity, profile, record_function
    from zero import allocation_events

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = make()
        step()
        gc.collect()
        with record_function("measured step"):
            step()
        del step
    allocs, start = allocation_events(prof)
    running = peak = 0
    for t, size in allocs:
        running += size
        if t >= start:
            peak = max(peak, running)
    return peak


def fpar_side(loss_fn, params: dict, x, out: dict, backward: bool):
    """fpar's step of the sharded ``loss_fn(params, x)``: by ``torch.func.grad``, or (``backward``) on
    leaf parameters by ``.backward()``; the former keeps its parameters as ``step.params``."""
    if backward:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        return backward_sgd_step(lambda: loss_fn(leaves, x), [list(leaves.values())], out, None)
    step = sgd_step(torch.func.grad_and_value(loss_fn), params, (x,), out)
    step.params = params
    return step


def built_sides(makers: dict) -> tuple[list, dict]:
    """Each side's peak memory, built afresh under the profiler (``built_peak``), then each side
    built again for the timing: ``([step, ...], {name: peak bytes})`` in ``makers``' order."""
    peaks = {name: built_peak(make) for name, make in makers.items()}
    return [make() for make in makers.values()], peaks


def larger_peaks(res: list, base: str, base_name: str) -> dict:
    """The larger rank's peak of each side, printed against the baseline's."""
    pk = {k: max(r["peaks"][k] for r in res) for k in ("fpar", "fpar .backward()", base)}
    f, b, o = (pk[k] / 2**20 for k in ("fpar", "fpar .backward()", base))
    print(
        f"  peak memory a process (the larger rank's; parameters, kept buffers and the step): fpar "
        f"{f:.1f} / {b:.1f} MiB (torch.func.grad / .backward()), {base_name} {o:.1f} MiB, "
        f"ratio {f / o:.2f} / {b / o:.2f}"
    )
    return pk


def main_ep(args, cfg: dict) -> None:
    if args.experts % NPROCS:
        raise SystemExit(f"--experts {args.experts} must divide over the {NPROCS} processes")
    record = Record("hf_tp_qwen3_moe_ep", cfg, None)
    res = fpar.launch(worker_ep, NPROCS, cfg, timeout=args.timeout)
    r0 = res[0]
    print(
        f"after one step from the same values: |loss fpar - DDP| = {max(r['loss_diff'] for r in res):.2e}, "
        f"max |down_proj experts / q_proj block fpar - DDP| = {max(r['weight_diff'] for r in res):.2e}"
    )
    a2a = r0["stats"].get("expert", {})
    print(
        f"fpar traffic per step per device over the expert axis: { {k: v['calls'] for k, v in a2a.items()} } calls"
    )
    med = {k: statistics.median(v) * 1e3 for k, v in r0["times"].items()}
    what = (
        f"HF Qwen3-MoE train step (fwd+bwd+SGD), d={args.d_model} L={args.layers} {args.experts} experts top-2, "
        f"V={args.vocab}, batch {args.batch} x {args.seq}, float32, {NPROCS} gloo processes x {args.threads} thread(s)"
    )
    print(f"{what}, torch {torch.__version__}, {args.repeats} repeats, interleaved")
    for k, t in r0["times"].items():
        print(f"  {k:6s}  median {med[k]:8.2f} ms   min {min(t) * 1e3:8.2f}   max {max(t) * 1e3:8.2f}")
    print(
        f"  ratio fpar expert=2 / DDP with every expert local = {med['fpar'] / med['ddp']:.3f} "
        f"(torch.func.grad), {med['fpar .backward()'] / med['ddp']:.3f} (.backward())"
    )
    pk = larger_peaks(res, "ddp", "DDP")
    record.compare(
        "step",
        f"{what}: `fpar.ops.tensor_parallel(expert_axis=)`, `torch.func.grad` / `.backward()`, vs DDP with every "
        "expert local",
        [
            ("fpar expert parallel", r0["times"]["fpar"], "DDP", r0["times"]["ddp"]),
            ("fpar expert parallel .backward()", r0["times"]["fpar .backward()"], "DDP", r0["times"]["ddp"]),
        ],
    )
    record.memory(
        "memory",
        f"{what}: peak memory a process (the larger rank's: its parameters, kept buffers and gradient "
        "buckets included), `torch.func.grad` / `.backward()`, vs DDP",
        [
            ("fpar expert parallel", pk["fpar"], "DDP", pk["ddp"]),
            ("fpar expert parallel .backward()", pk["fpar .backward()"], "DDP", pk["ddp"]),
        ],
    )
    record.data["extra"] = {
        "loss_diff": max(r["loss_diff"] for r in res),
        "weight_diff": max(r["weight_diff"] for r in res),
        "experts_implementation": r0["experts_impl"],
    }
    record.write(args.json)


def dtensor_from_hf_plan(model, n: int):
    """``parallelize_module`` driven by the model's own transformers plan, styles translated by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fpar.ops._hf_plan import generic

    model = copy.deepcopy(model)
    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    plan, grad_allreduce = {}, []
    for name, module in model.named_modules():
        style = model.tp_plan.get(generic(name)) if name else None
        if style in styles:
            plan[name] = styles[style]()
        elif style == "replicated_with_grad_allreduce":
            grad_allreduce += list(module.parameters())
        elif style is not None:
            raise ValueError(f"no DTensor translation for {style!r} ({name})")
    return parallelize_module(model, init_device_mesh("cpu", (n,)), plan), grad_allreduce


def dtensor_model(model, n: int):
    """The DTensor baseline: Conv1D -> nn.Linear, c_attn regrouped per rank, per-rank head counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(model)
    for block in model.transformer.h:
        for owner, name in (
            (block.attn, "c_attn"),
            (block.attn, "c_proj"),
            (block.mlp, "c_fc"),
            (block.mlp, "c_proj"),
        ):
            conv = getattr(owner, name)
            linear = nn.Linear(conv.nx, conv.nf)
            with torch.no_grad():
                w = conv.weight.t()  # [out, in]
                b = conv.bias
                if name == "c_attn" and owner is block.attn:  # [q|k|v] rows -> per rank [q_r|k_r|v_r]
                    w = w.unflatten(0, (3, n, -1)).transpose(0, 1).reshape(w.shape)
                    b = b.unflatten(0, (3, n, -1)).transpose(0, 1).reshape(b.shape)
                linear.weight.copy_(w)
                linear.bias.copy_(b)
            setattr(owner, name, linear)
        block.attn.split_size //= n
        block.attn.num_heads //= n
    mesh = init_device_mesh("cpu", (n,))
    plan = {}
    for i in range(len(model.transformer.h)):
        plan.update(
            {
                f"transformer.h.{i}.attn.c_attn": ColwiseParallel(),
                f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
                f"transformer.h.{i}.mlp.c_proj": RowwiseParallel(),
            }
        )
    return parallelize_module(model, mesh, plan)


def worker(cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    n = dist.get_world_size()
    model = build(cfg)
    ids = torch.randint(
        0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(1)
    )

    mesh = fpar.make_mesh((n,), ("tensor",))
    qwen = cfg["family"] == "qwen3"
    out: dict = {}
    from torch.distributed.tensor import DTensor

    def make_fpar(backward: bool = False):
        """(a) fpar on the unmodified model; (a') the same differentiated with .backward()."""
        apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, plan="auto" if qwen else PLAN)
        params = {k: v.clone() for k, v in fpar.device_put(params, mesh, specs).items()}
        loss_fn = fpar.shard(
            lambda p, x: apply_fn(p, x, labels=x, use_cache=False).loss, mesh, (specs, P()), P()
        )
        return fpar_side(loss_fn, params, ids, out, backward)

    def make_dtensor():
        """(b) DTensor parallelize_module."""
        dmodel, grad_allreduce = dtensor_from_hf_plan(model, n) if qwen else (dtensor_model(model, n), [])
        dparams = list(dmodel.parameters())
        groups = [
            [p for p in dparams if isinstance(p, DTensor)],
            [p for p in dparams if not isinstance(p, DTensor)],
        ]
        # replicated_with_grad_allreduce: each rank saw its heads only, so those gradients are summed
        step = backward_sgd_step(
            lambda: dmodel(ids, labels=ids, use_cache=False).loss,
            groups,
            out,
            "dtensor",
            tuple(grad_allreduce),
        )
        step.dmodel = dmodel
        return step

    # Peak memory of each side, built afresh under the profiler (parameters and kept buffers counted)
    (fpar_step, fpar_backward_step, dtensor_step), peaks = built_sides(
        {"fpar": make_fpar, "fpar .backward()": lambda: make_fpar(backward=True), "dtensor": make_dtensor}
    )
    params, dmodel = fpar_step.params, dtensor_step.dmodel

    # Check: one step of each from the same values gives the same loss and c_fc update.
    fpar_step()
    dtensor_step()
    loss_diff = abs(out["fpar"] - out["dtensor"])
    if qwen:
        w_f = params["model.layers.0.mlp.up_proj.weight"]  # [out/n, in] block
        w_d = dmodel.model.layers[0].mlp.up_proj.weight.detach().to_local()
    else:
        w_f = params["transformer.h.0.mlp.c_fc.weight"]  # [in, out/n] block (Conv1D layout)
        w_d = dmodel.transformer.h[0].mlp.c_fc.weight.detach().to_local().t()
    weight_diff = float((w_f - w_d).abs().max())

    # (c) functorch's own cost, no fpar and no tensor parallelism: the whole model on this rank's
    # batch differentiated by torch.func.grad and by .backward() (both through functional_call)
    plain = copy.deepcopy(model)
    kw = {"labels": ids, "use_cache": False}
    plain_params = {k: v.detach().clone() for k, v in plain.named_parameters()}
    plain_grad = torch.func.grad(lambda p: torch.func.functional_call(plain, p, (ids,), kw).loss)
    plain_list = list(plain_params.values())

    def plain_step():
        g = plain_grad(plain_params)
        torch._foreach_add_(plain_list, [g[k] for k in plain_params], alpha=-LR)

    plain_leaves = {k: v.detach().clone().requires_grad_() for k, v in plain.named_parameters()}
    plain_backward_step = backward_sgd_step(
        lambda: torch.func.functional_call(plain, plain_leaves, (ids,), kw).loss,
        [list(plain_leaves.values())],
        out,
        None,
    )

    steps = {
        "fpar": fpar_step,
        "fpar .backward()": fpar_backward_step,
        "dtensor": dtensor_step,
        "plain func.grad": plain_step,
        "plain .backward()": plain_backward_step,
    }
    for _ in range(cfg["warmup"]):
        for step in steps.values():
            step()
    times = interleaved(steps, cfg["repeats"])
    fpar.reset_comm_stats()
    fpar_step()
    return {
        "times": times,
        "loss_diff": loss_diff,
        "weight_diff": weight_diff,
        "stats": fpar.comm_stats(),
        "peaks": peaks,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--family", choices=("gpt2", "qwen3", "qwen3_moe"), default="gpt2")
    ap.add_argument("--ep", action="store_true", help="qwen3_moe: experts over an expert axis vs DDP")
    ap.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts a layer")
    ap.add_argument("--collectives", action="store_true", help="print the collectives-per-block table")
    add_json_arg(ap)
    args = ap.parse_args(argv)
    if args.collectives:
        collectives_table()
        return
    cfg = {k.replace("-", "_"): v for k, v in vars(args).items() if k != "json"}
    if args.family == "qwen3_moe" or args.ep:
        if not (args.family == "qwen3_moe" and args.ep):
            raise SystemExit("--ep runs --family qwen3_moe (expert parallelism); give both")
        main_ep(args, cfg)
        return
    record = Record("hf_tp" if args.family == "gpt2" else f"hf_tp_{args.family}", cfg, argv)
    res = fpar.launch(worker, NPROCS, cfg, timeout=args.timeout)
    r0 = res[0]
    print(
        f"after one step from the same values: |loss fpar - DTensor| = {max(r['loss_diff'] for r in res):.2e}, "
        f"max |c_fc block fpar - DTensor| = {max(r['weight_diff'] for r in res):.2e}"
    )
    psum = r0["stats"].get("tensor", {}).get("psum", {})
    print(
        f"fpar traffic per step per device (forward + backward): {psum.get('calls', 0)} all-reduces, "
        f"{psum.get('bytes', 0) / 1e6:.2f} MB ({args.layers} blocks; per block: --collectives)"
    )
    med = {k: statistics.median(v) * 1e3 for k, v in r0["times"].items()}
    print(
        f"HF {type(build(cfg)).__name__} train step (fwd+bwd+SGD), d={args.d_model} L={args.layers} H={args.heads} "
        f"V={args.vocab}, batch {args.batch} x {args.seq}, float32, {NPROCS} gloo processes x {args.threads} "
        f"thread(s), torch {torch.__version__}, {args.repeats} repeats, interleaved"
    )
    for k, t in r0["times"].items():
        print(f"  {k:16s}  median {med[k]:8.2f} ms   min {min(t) * 1e3:8.2f}   max {max(t) * 1e3:8.2f}")
    print(f"  ratio fpar / DTensor = {med['fpar'] / med['dtensor']:.3f} (torch.func.grad), ", end="")
    print(f"{med['fpar .backward()'] / med['dtensor']:.3f} (.backward())  (target <= 1.0)")
    pk = larger_peaks(res, "dtensor", "DTensor")
    print(
        f"  torch.func.grad / .backward(): fpar {med['fpar'] / med['fpar .backward()']:.3f}, the plain "
        f"unsharded model (no fpar: functorch's own cost) {med['plain func.grad'] / med['plain .backward()']:.3f}"
    )

    t = r0["times"]
    record.compare(
        "step",
        f"an unmodified HF {'GPT-2' if args.family == 'gpt2' else 'Qwen3 (plan=auto)'} train step, d={args.d_model} L={args.layers} V={args.vocab}, batch {args.batch} x "
        f"{args.seq}, fp32, {NPROCS} gloo processes x {args.threads} thread: `fpar.ops.tensor_parallel`, "
        "`torch.func.grad` / `.backward()`, vs DTensor `parallelize_module`",
        [
            ("fpar torch.func.grad", t["fpar"], "DTensor", t["dtensor"]),
            ("fpar .backward()", t["fpar .backward()"], "DTensor", t["dtensor"]),
        ],
    )
    record.memory(
        "memory",
        "the same: peak memory a process (the larger rank's: its parameters and kept buffers included), "
        "`torch.func.grad` / `.backward()`, vs DTensor",
        [
            ("fpar torch.func.grad", pk["fpar"], "DTensor", pk["dtensor"]),
            ("fpar .backward()", pk["fpar .backward()"], "DTensor", pk["dtensor"]),
        ],
    )
    record.compare(
        "functorch",
        f"the same model unsharded, no fpar ({args.batch} x {args.seq} on each process): `torch.func.grad` vs "
        "`.backward()`, what functorch's transform costs by itself",
        [("plain torch.func.grad", t["plain func.grad"], "plain .backward()", t["plain .backward()"])],
    )
    record.data["extra"] = {
        "allreduces": psum.get("calls", 0),
        "allreduce_bytes": psum.get("bytes", 0),
        "loss_diff": max(r["loss_diff"] for r in res),
        "weight_diff": max(r["weight_diff"] for r in res),
    }
    record.write(args.json)


# Collectives per block ----------------------------------------------------------------------------

# What each style of a transformers plan communicates (transformers/distributed/tensor_parallel.py,
# training path): (forward all-reduces, forward all-gathers, backward all-reduces, backward all-gathers).
HF_STYLE_COST = {
    "colwise": (0, 0, 1, 0),  # the replicated input's gradient, per layer
    "packed_colwise": (0, 0, 1, 0),
    "rowwise": (1, 0, 0, 0),
    "colwise_gather_output": (0, 1, 1, 0),
    "rowwise_split_input": (1, 0, 0, 1),
    "replicated_with_grad_allreduce": (0, 0, 1, 0),
    "moe_tp_experts": (1, 0, 2, 0),  # output; hidden states' and routing weights' gradients
}


def _tiny(family: str, layers: int, **kw):
    import transformers as tf

    base = dict(
        num_hidden_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=64,
        head_dim=8,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    base.update(kw)
    names = {
        "Llama": ("LlamaConfig", "LlamaForCausalLM"),
        "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "Gemma 3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "Phi-3": ("Phi3Config", "Phi3ForCausalLM"),
        "GPT-NeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
        "OLMo 2": ("Olmo2Config", "Olmo2ForCausalLM"),
        "Mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    }
    if family == "GPT-NeoX":
        base.pop("num_key_value_heads")
    if family == "Mixtral":
        base.update(num_local_experts=4, num_experts_per_tok=2)
    if family == "Gemma 3":
        base.update(layer_types=["full_attention"] * layers)
    config_cls, model_cls = names[family]
    model = getattr(tf, model_cls)(getattr(tf, config_cls)(**base)).eval()
    model.set_attn_implementation("eager")
    if hasattr(model.config, "_experts_implementation"):
        model.set_experts_implementation("batched_mm")
    return model


def _fpar_counts(family: str, layers: int, **kw) -> tuple[dict, dict]:
    model = _tiny(family, layers, **kw)
    mesh = fpar.make_mesh((2,), ("tensor",))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
    loss = fpar.shard(lambda p, x: apply_fn(p, x, labels=x, use_cache=False).loss, mesh, (specs, P()), P())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    fpar.reset_comm_stats()
    loss(params, ids)
    fwd = {op: v["calls"] for op, v in fpar.comm_stats().get("tensor", {}).items()}
    fpar.reset_comm_stats()
    torch.func.grad(loss)(params, ids)
    both = {op: v["calls"] for op, v in fpar.comm_stats().get("tensor", {}).items()}
    return fwd, both


def collectives_table() -> None:
    """Per block, tensor=2: fpar's collectives (measured) next to the transformers plan's (counted)."""
    rows = [("Llama", {}), ("Llama, 1 kv head", dict(num_key_value_heads=1)), ("Qwen3", {}), ("Gemma 3", {})]
    rows += [("Phi-3", {}), ("GPT-NeoX", {}), ("OLMo 2", {}), ("Mixtral", {})]
    print(
        "| family | fpar forward | fpar backward | transformers plan forward | transformers plan backward |"
    )
    print("|---|---|---|---|---|")
    for label, kw in rows:
        family = label.split(",")[0]
        (f1, b1), (f2, b2) = _fpar_counts(family, 1, **kw), _fpar_counts(family, 2, **kw)
        fwd = {op: f2.get(op, 0) - f1.get(op, 0) for op in set(f1) | set(f2)}
        bwd = {op: (b2.get(op, 0) - b1.get(op, 0)) - fwd.get(op, 0) for op in set(b1) | set(b2)}
        model = _tiny(family, 1, **kw)
        cost = [0, 0, 0, 0]
        for key, style in model.tp_plan.items():
            if ".layers.*." in key and any(
                n.startswith(key.replace("*", "0")) for n, _ in model.named_modules()
            ):
                cost = [a + b for a, b in zip(cost, HF_STYLE_COST.get(style, (0, 0, 0, 0)))]
        hf_f = _words(cost[0], cost[1])
        hf_b = _words(cost[2], cost[3])
        if kw.get("num_key_value_heads", 2) < 2:
            hf_f = hf_b = "fails (transformers#48307)"
        print(f"| {label} | {_fmt(fwd)} | {_fmt(bwd)} | {hf_f} | {hf_b} |")


def _words(reduces: int, gathers: int) -> str:
    parts = [f"{reduces} all-reduce"] + ([f"{gathers} all-gather"] if gathers else [])
    return " + ".join(parts)


def _fmt(ops: dict) -> str:
    names = {"psum": "all-reduce", "all_gather": "all-gather", "all_gather_invariant": "all-gather"}
    out = [f"{v} {names.get(op, op)}" for op, v in sorted(ops.items()) if v]
    return " + ".join(out) or "0"


if __name__ == "__main__":
    main()
