"""How a ``TrainingProgram`` runs: its model, data and training loop on any mesh (``_Run``).

Every value comes back *global* (``fpar.gather`` on a real mesh), so the runs on a real mesh and
on the in-process mesh of the same shape can be compared leaf by leaf.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import optree
import torch

from .. import checkpoint as ckpt
from .. import ops
from .. import optim as fo
from .. import pipeline as pp
from .._collectives import pmean, psum
from .._defer import defer_reduction
from .._global import Init, device_put
from .._global import gather as gather_global
from .._mesh import Mesh
from .._shard import shard
from .._spec import PartitionSpec as P
from .._tree import tree_flatten, tree_map
from ..pipeline._builders import smallest_group
from ..random import fold_in
from ..random import key as random_key

Tensor = torch.Tensor

F64 = torch.float64

# The model's sizes: inputs, width, MLP hidden, outputs, GPT sequence and heads, MoE experts; rows
# per microbatch (the same on every layout, so programs of different layouts can be compared: split
# over data sizes up to 4, more rows beyond).  Widths divide by every tensor size drawn (1, 2, 4).
_D_IN, _D, _HIDDEN, _OUT, _SEQ, _HEADS, _EXPERTS, _ROWS = 3, 8, 8, 4, 4, 4, 4, 8

_COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16}


# Building and running one program ---------------------------------------------------------------


class _Run:
    """One program on one mesh: the model's pieces, its data, and the training loop."""

    def __init__(self, program, mesh: Mesh):
        self.pr, self.mesh = program, mesh
        self.size = dict(mesh.shape)
        self.tp = "tensor" in self.size
        self.rate = program.dropout
        self.base_key = random_key(program.seed)
        self.gen = torch.Generator().manual_seed(program.seed)
        t = "tensor" if self.tp else None
        self.sp = program.model == "sp_gpt"
        if program.model == "mlp":
            self.block_specs = {"w_in": P(None, t), "b_in": P(t), "w_out": P(t, None), "b_out": P()}
        elif program.model == "moe":  # every expert on every device, its hidden dim split over "tensor"
            specs = ops.gpt_block_specs("tensor")
            del specs["mlp"]
            self.block_specs = {**specs, "moe": ops.moe_specs(None, tensor_axis="tensor")}
        else:
            self.block_specs = ops.gpt_block_specs("tensor")
        self.first_specs = {"w": P()}
        # the head: column-parallel, outputs split (sequence parallel: replicated, the sequence split)
        self.last_specs = {"w": P(), "b": P()} if self.sp else {"w": P(None, t), "b": P(t)}
        self.hidden_spec = P("data", t)  # the MLP's hidden activations inside a shard
        self.h_spec = P("data", "tensor") if self.sp else P("data")  # activations between blocks
        seq = (None,) if program.model != "mlp" else ()
        # targets: rows over data, outputs over tensor (sequence parallel: the sequence over tensor)
        self.y_spec = P("data", "tensor") if self.sp else P("data", *seq, t)
        self.ys_spec = P(None, *self.y_spec)  # stacked microbatches of them
        self.block_fn = fo.remat(self._block) if program.remat else self._block

    # The model (per-device code) ------------------------------------------------------------

    def first(self, w: dict, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = torch.tanh(x @ w["w"])
        return ops.dropout(key, h, self.rate, spec=self.h_spec) if self.rate else h

    def block(self, w: dict, h: Tensor, *key: Tensor) -> Tensor:
        return self.block_fn(w, h, *key)

    def _block(self, w: dict, h: Tensor, key: Tensor | None = None) -> Tensor:
        model = self.pr.model
        if model != "mlp":
            drop = dict(dropout=self.rate, key=key) if self.rate else {}
            if model == "moe":  # the aux loss is left out: the same model on every layout
                return ops.moe_block(w, h, axis="tensor", n_heads=_HEADS, moe=dict(top_k=2), **drop)[0]
            block = ops.sp_gpt_block if model == "sp_gpt" else ops.gpt_block
            return block(w, h, axis="tensor", n_heads=_HEADS, **drop)
        a = torch.tanh(h @ w["w_in"] + w["b_in"])
        if self.rate:
            a = ops.dropout(fold_in(key, 7), a, self.rate, spec=self.hidden_spec)
        out = a @ w["w_out"]
        return h + (psum(out, "tensor") if self.tp else out) + w["b_out"]

    def head_loss(self, w: dict, h: Tensor, y: Tensor) -> Tensor:
        """This device's mean squared error over its rows (not yet averaged over ``"data"``).

        The head is column-parallel: each device has its slice of the outputs (and targets),
        and the squared errors are summed over ``"tensor"``, like a vocab-parallel head's loss.
        """
        sq = ((h @ w["w"] + w["b"] - y) ** 2).sum()
        if self.tp:
            sq = psum(sq, "tensor")
        return sq / (y.numel() * (self.size["tensor"] if self.tp else 1))

    def local_loss(self, params: dict, x: Tensor, y: Tensor, *key: Tensor) -> Tensor:
        """The unpipelined model, per device: first, every block of the stack, the head."""
        h = self.first(params["first"], x, *[fold_in(k, 0) for k in key])
        for i in range(self.pr.layers):
            layer = tree_map(lambda t, i=i: t[i], params["stages"])
            h = self.block(layer, h, *[fold_in(k, i + 1) for k in key])
        return self.head_loss(params["last"], h, y)

    def loss(self, params: dict, x: Tensor, y: Tensor, *key: Tensor) -> Tensor:
        return pmean(self.local_loss(params, x, y, *key), "data")

    # Parameters and data (global tensors, drawn the same on every process) -----------------------

    def randn(self, *shape: int, scale: float = 1.0) -> Tensor:
        return torch.randn(shape, generator=self.gen, dtype=F64) * scale

    def init_params(self) -> dict:
        layers = self.pr.layers
        if self.pr.model == "mlp":
            stages = {
                "w_in": self.randn(layers, _D, _HIDDEN, scale=_D**-0.5),
                "b_in": self.randn(layers, _HIDDEN, scale=0.2),
                "w_out": self.randn(layers, _HIDDEN, _D, scale=_HIDDEN**-0.5),
                "b_out": self.randn(layers, _D, scale=0.2),
            }
        else:
            shapes = ops.init_gpt_block(_D, dtype=F64)
            if self.pr.model == "moe":
                shapes["moe"] = ops.init_moe(_D, _HIDDEN, _EXPERTS, dtype=F64)
                del shapes["mlp"]
            leaves, treedef = optree.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, Init))
            drawn = []
            for init in leaves:
                shape = tuple(init.shape)
                if len(shape) == 1:  # LayerNorm scales near 1, biases near 0
                    base = 1.0 if init.kind == "ones" else 0.0
                    drawn.append(base + self.randn(layers, *shape, scale=0.1))
                else:
                    drawn.append(self.randn(layers, *shape, scale=shape[0] ** -0.5))
            stages = treedef.unflatten(drawn)
        return {
            "stages": stages,
            "first": {"w": self.randn(_D_IN, _D, scale=_D_IN**-0.5)},
            "last": {"w": self.randn(_D, _OUT, scale=_D**-0.5), "b": self.randn(_OUT, scale=0.2)},
        }

    def batch(self, micro: int) -> tuple[Tensor, Tensor]:
        """``micro`` microbatches stacked on dim 0, each of ``_ROWS`` rows (more past data=4): ``(x, y)``."""
        rows = _ROWS * max(1, self.size["data"] // 4)
        seq = (_SEQ,) if self.pr.model != "mlp" else ()
        return self.randn(micro, rows, *seq, _D_IN), self.randn(micro, rows, *seq, _OUT)

    def step_key(self, step: int, salt: int = 0) -> tuple[Tensor, ...]:
        """``()`` without dropout, else the step's key."""
        return (fold_in(self.base_key, 1000 * salt + step),) if self.rate else ()

    def specs(self, stacked_over: str | None) -> dict:
        """The parameters' specs: the blocks stacked on dim 0, split over ``stacked_over`` there."""
        stages = optree.tree_map(lambda s: P(stacked_over, *s), self.block_specs, is_leaf=_is_spec)
        return {"stages": stages, "first": self.first_specs, "last": self.last_specs}

    def optimizer(self):
        pr = self.pr
        opt = fo.sgd(0.1) if pr.optimizer == "sgd" else fo.adamw(0.02, weight_decay=0.01)
        opt = fo.chain(fo.clip_by_global_norm(pr.clip), opt) if pr.clip is not None else opt
        if pr.precision == "fp64":
            return opt
        if pr.precision == "bf16":
            return fo.mixed_precision(opt, compute_dtype=torch.bfloat16)
        # a small first scale: the loss scaled by it stays finite in fp16, so the steps update
        return fo.mixed_precision(opt, compute_dtype=torch.float16, loss_scale="dynamic", init_scale=2.0**8)

    # A checkpoint mid-run ----------------------------------------------------------------------

    def reload(self, params: Any, state: Any, layout, opt) -> tuple[Any, Any]:
        """Save the parameters and optimizer state; load them onto another layout; place them back.

        The other layout holds every leaf whole on every device (``P()``); what is returned is
        what was loaded, in the layout the step takes.
        """
        specs = {"params": layout.param_specs, "opt": layout.state_specs(opt)}
        whole = optree.tree_map(lambda s: P(), specs, is_leaf=lambda x: isinstance(x, P))
        directory = self._shared_dir()
        try:
            ckpt.save(directory, {"params": params, "opt": state}, self.mesh, specs, step=1)
            loaded = ckpt.load(directory, self.mesh, whole, like={"params": params, "opt": state})
        finally:
            self._release(directory)
        back = device_put(loaded, self.mesh, specs)
        return back["params"], back["opt"]

    def _shared_dir(self) -> str:
        """A fresh directory, the same on every process of a real mesh (rank 0 makes it)."""
        if self.mesh.backend != "dist":
            return tempfile.mkdtemp(prefix="fpar-program-")
        import torch.distributed as dist

        from ._real_mesh import _agreement_group

        box = [tempfile.mkdtemp(prefix="fpar-program-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, group=_agreement_group())
        return box[0]

    def _release(self, directory: str) -> None:
        """Remove the directory once every process has read from it."""
        if self.mesh.backend == "dist":
            import torch.distributed as dist

            from ._real_mesh import _agreement_group

            dist.barrier(group=_agreement_group())
            if dist.get_rank() != 0:
                return
        if os.path.isdir(directory):
            shutil.rmtree(directory, ignore_errors=True)

    # Training -------------------------------------------------------------------------------

    def train(self) -> dict:
        return {"manual": self.train_manual, "zero": self.train_zero, "pipeline": self.train_pipeline}[
            self.pr.driver
        ]()

    def _optimizer_setup(self, params: dict, specs: dict, stage: int):
        opt = self.optimizer()
        layout = fo.zero_layout(params, self.mesh, specs, stage=stage, data_axis="data")
        stored, state = fo.zero_init(opt, params, layout)
        return opt, layout, stored, state

    def _record(
        self, trace, step, loss, params, specs, state, layout, opt, grads=None, gspecs=None, order=None
    ):
        """Step ``step``'s global values; ``order`` puts stacked stages back in model order."""

        def gather(tree, specs):
            # copies: a replicated leaf may come back as the process's own tensor, which the next
            # step's donated (in-place) update overwrites
            return tree_map(lambda t: t.detach().clone(), gather_global(tree, self.mesh, specs))

        order = order or (lambda tree: tree)
        rec = {"loss": loss.detach().clone()}
        if grads is not None:
            rec["grads"] = gather(grads, gspecs)
            if gspecs is specs:
                rec["grads"] = order(rec["grads"])
        rec["params"] = order(gather(fo.zero_params(params, layout), specs))
        rec["opt_state"] = gather(state, layout.state_specs(opt))
        trace[f"step {step}"] = rec

    def train_manual(self) -> dict:
        pr, mesh = self.pr, self.mesh
        specs = self.specs(None)
        params = device_put(self.init_params(), mesh, specs)
        opt, layout, params, state = self._optimizer_setup(params, specs, 0)
        update = fo.zero_update(opt, layout, donate=pr.donate)
        keyspec = (P(),) if self.rate else ()
        loss_fn = shard(self.loss, mesh, (specs, self.h_spec, self.y_spec, *keyspec), P())
        m = pr.n_micro
        bspecs = {"x": self.h_spec, "y": self.y_spec}
        if pr.accumulation == "accumulate":
            acc = fo.accumulate(self._grad_fn(loss_fn), m, mesh, bspecs, key_arg=2 if self.rate else None)
        trace: dict = {}
        for t in range(pr.steps):
            xs, ys = self.batch(m)
            key = self.step_key(t)
            if pr.accumulation == "accumulate":
                batch = device_put({"x": xs.flatten(0, 1), "y": ys.flatten(0, 1)}, mesh, bspecs)
                grads, loss = acc(params, batch, *key)
            else:
                xs, ys = device_put((xs, ys), mesh, (P(None, *self.h_spec), self.ys_spec))
                grads, loss = self._loop(loss_fn, params, xs, ys, key)
            rec_grads = tree_map(lambda g: g.detach().clone(), grads)
            params, state = update(grads, state, params)
            self._record(trace, t, loss, params, specs, state, layout, opt, rec_grads, specs)
            if pr.checkpoint and t == 0:
                params, state = self.reload(params, state, layout, opt)
            if pr.evaluate:
                ex, ey = self.batch(1)
                ex, ey = device_put((ex[0], ey[0]), mesh, (self.h_spec, self.y_spec))
                with torch.no_grad():
                    trace[f"eval {t}"] = loss_fn(params, ex, ey, *self.step_key(t, salt=1)).clone()
        return trace

    def _grad_fn(self, loss_fn: Callable) -> Callable:
        """``grad_fn(params, batch, *key) -> (grads, loss)`` by the program's gradient API."""
        if self.pr.grad_api == "func_grad":

            def grad_fn(params, batch, *key):
                return torch.func.grad_and_value(loss_fn)(params, batch["x"], batch["y"], *key)

            return grad_fn
        leaves: dict = {}

        def backward_fn(params, batch, *key):
            # the same leaf tensors for every microbatch (defer_reduction pairs calls by their inputs)
            if leaves.get("of") is not params:
                leaves.update(of=params, req=tree_map(lambda t: t.detach().requires_grad_(), params))
            req = leaves["req"]
            for leaf in tree_flatten(req)[0]:
                leaf.grad = None
            loss = loss_fn(req, batch["x"], batch["y"], *key)
            loss.backward()
            return _grads_of(req), loss.detach()

        return backward_fn

    def _loop(self, loss_fn, params, xs, ys, key) -> tuple[Any, Tensor]:
        """The microbatches in a Python loop (all but the last deferred, for ``"defer"``)."""
        pr = self.pr
        m = pr.n_micro
        scope = defer_reduction() if pr.accumulation == "defer" else None
        req = tree_map(lambda t: t.detach().requires_grad_(), params) if pr.grad_api == "backward" else None
        total, losses = None, []
        for i in range(m):
            k = tuple(fold_in(kk, i) for kk in key)
            ctx = scope if scope is not None and i < m - 1 else contextlib.nullcontext()
            with ctx:
                if req is not None:
                    loss = loss_fn(req, xs[i], ys[i], *k)
                    loss.backward()
                else:
                    g, loss = torch.func.grad_and_value(loss_fn)(params, xs[i], ys[i], *k)
                    total = g if total is None else tree_map(torch.add, total, g)
            losses.append(loss.detach())
        if req is not None:
            total = _grads_of(req)
        grads = tree_map(lambda t: t / m, total)
        return grads, sum(losses) / m

    def train_zero(self) -> dict:
        if not self.pr.compile:
            return self._train_zero()
        # .backward() inside the compiled step is traced (fpar's step takes torch.func's grad: the
        # flag must be on from the first, eager, step, which plans the sharded calls' forms)
        import torch._dynamo

        before = torch._dynamo.config.trace_autograd_ops
        torch._dynamo.config.trace_autograd_ops = True
        torch.compiler.reset()  # no recompile limit carried over from the programs before
        try:
            return self._train_zero()
        finally:
            torch.compiler.reset()
            torch._dynamo.config.trace_autograd_ops = before

    def _train_zero(self) -> dict:
        pr, mesh = self.pr, self.mesh
        specs = self.specs(None)
        params = device_put(self.init_params(), mesh, specs)
        opt, layout, params, state = self._optimizer_setup(params, specs, pr.zero_stage)
        rate = self.rate

        def loss_fn(p, batch):
            return self.local_loss(p, batch["x"], batch["y"], *([batch["key"]] if rate else []))

        bspecs = {"x": self.h_spec, "y": self.y_spec, **({"key": P()} if rate else {})}
        if pr.fused:
            step = fo.zero_step(
                loss_fn,
                opt,
                layout,
                batch_specs=bspecs,
                n_micro=pr.n_micro,
                donate=pr.donate,
                reduce_once=bool(pr.reduce_once),
            )
        else:
            grads_fn = fo.zero_grads(
                loss_fn, layout, batch_specs=bspecs, n_micro=pr.n_micro, reduce_once=bool(pr.reduce_once)
            )
            update = fo.zero_update(opt, layout, donate=pr.donate)
        keyspec = (P(),) if rate else ()
        eval_fn = shard(self.loss, mesh, (specs, self.h_spec, self.y_spec, *keyspec), P())
        trace: dict = {}
        for t in range(pr.steps):
            xs, ys = self.batch(pr.n_micro)
            batch = {"x": xs.flatten(0, 1), "y": ys.flatten(0, 1)}
            batch = device_put(batch, mesh, {"x": self.h_spec, "y": self.y_spec})
            if rate:
                batch["key"] = self.step_key(t)[0]
            if pr.compile and t == 1:  # the first step ran eagerly: it planned the sharded calls
                step = torch.compile(step, backend="aot_eager", fullgraph=True)
            if pr.fused:
                params, state, metrics = step(params, state, batch)
                self._record(trace, t, metrics["loss"], params, specs, state, layout, opt)
            else:
                grads, loss = grads_fn(params, batch)
                rec_grads = tree_map(lambda g: g.detach().clone(), grads)
                params, state = update(grads, state, params)
                self._record(trace, t, loss, params, specs, state, layout, opt, rec_grads, layout.grad_specs)
            if pr.checkpoint and t == 0:
                params, state = self.reload(params, state, layout, opt)
            if pr.evaluate:
                ex, ey = self.batch(1)
                ex, ey = device_put((ex[0], ey[0]), mesh, (self.h_spec, self.y_spec))
                with torch.no_grad():
                    full = fo.zero_params(params, layout)
                    trace[f"eval {t}"] = eval_fn(full, ex, ey, *self.step_key(t, salt=1)).clone()
        return trace

    def train_pipeline(self) -> dict:
        pr, mesh = self.pr, self.mesh
        p, v, m = self.size["pipe"], pr.chunks, pr.n_micro
        sub = mesh.submesh(tuple(a for a in mesh.axis_names if a != "pipe"))
        rows, keyspec = self.h_spec, ((P(),) if self.rate else ())
        stage = shard(self.block, sub, (self.block_specs, rows, *keyspec), rows)
        first = shard(self.first, sub, (self.first_specs, rows, *keyspec), rows)

        def head(w, h, y):
            return pmean(self.head_loss(w, h, y), "data")

        loss = shard(head, sub, (self.last_specs, rows, self.y_spec), P())
        build = {
            "gpipe": lambda: pp.gpipe(p, m, v),
            "1f1b": lambda: pp.one_f_one_b(p, m),
            "interleaved_1f1b": lambda: pp.interleaved_1f1b(p, m, v, smallest_group(p, m)),
            "zb_h1": lambda: pp.zb_h1(p, m),
            "zb_v": lambda: pp.zb_v(p, m),
            "dualpipe_v": lambda: pp.dualpipe_v(p, m),
        }
        schedule = build[pr.schedule]()
        run = pp.pipeline(stage, schedule, mesh, loss=loss, first=first, axis="pipe")
        specs = self.specs("pipe")
        chunks = dict(layout=schedule.layout)

        def in_model_order(tree):
            return {**tree, "stages": pp.model_major(tree["stages"], p, v, **chunks)}

        params = self.init_params()
        params["stages"] = pp.stage_major(params["stages"], p, v, **chunks)
        params = device_put(params, mesh, specs)
        opt, layout, params, state = self._optimizer_setup(params, specs, pr.zero_stage)
        update = fo.zero_update(opt, layout, donate=pr.donate)
        if pr.zero_stage:  # each stage's gradients reduce-scattered over data (ZeRO-3: chunks kept)
            run = fo.zero_pipeline(
                run,
                layout,
                reduce_once=pr.reduce_once is not False,
                reshard_after_forward=pr.reshard_after_forward,
            )
        gspecs = specs if not pr.zero_stage else layout.grad_specs
        trace: dict = {}
        for t in range(pr.steps):
            xs, ys = device_put(self.batch(m), mesh, (P(None, *self.h_spec), self.ys_spec))
            key = self.step_key(t)
            res = run(params, xs, ys, key=key[0] if key else None)
            grads = tree_map(lambda g: g.detach().clone(), res.grads)
            params, state = update(res.grads, state, params)
            self._record(
                trace, t, res.loss, params, specs, state, layout, opt, grads, gspecs, order=in_model_order
            )
            if pr.checkpoint and t == 0:
                params, state = self.reload(params, state, layout, opt)
            if pr.evaluate:
                exs, eys = device_put(self.batch(m), mesh, (P(None, *self.h_spec), self.ys_spec))
                ekey = self.step_key(t, salt=1)
                with torch.no_grad():
                    trace[f"eval {t}"] = run(params, exs, eys, key=ekey[0] if ekey else None).loss.clone()
        return trace


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


def _grads_of(leaves: Any) -> Any:
    """The ``.grad`` of each leaf (zeros where there is none)."""
    return tree_map(lambda t: t.grad if t.grad is not None else torch.zeros_like(t), leaves)
