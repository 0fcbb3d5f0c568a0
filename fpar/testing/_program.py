"""A training program to compare meshes with: its description (``TrainingProgram``) and its run.

``program.run(mesh)`` trains it on any mesh and returns every step's loss, gradients, parameters,
optimizer state and evaluation loss as *global* values (see ``_random_mesh.py`` for the tier).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import optree
import torch

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
from ..random import fold_in
from ..random import key as random_key

__all__ = ["TrainingProgram"]

Tensor = torch.Tensor

F64 = torch.float64

AXES = ("data", "tensor", "pipe")
MODELS = ("mlp", "gpt")
DRIVERS = ("manual", "zero", "pipeline")
GRAD_APIS = ("func_grad", "backward")
ACCUMULATIONS = ("none", "loop", "defer", "accumulate")
SCHEDULES = ("gpipe", "1f1b")
OPTIMIZERS = ("sgd", "adamw")

# The model's sizes: inputs, width, MLP hidden, outputs, GPT sequence and heads; rows per
# microbatch (the same on every layout, so programs of different layouts can be compared: split
# over data sizes up to 4, more rows beyond).  Widths divide by every tensor size drawn (1, 2, 4).
_D_IN, _D, _HIDDEN, _OUT, _SEQ, _HEADS, _ROWS = 3, 8, 8, 4, 4, 4, 8


# The description --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainingProgram:
    """One training program and its layout: what :meth:`run` trains, on whatever mesh it is given.

    The model is a first layer, ``layers`` blocks and a linear head with a squared-error loss,
    float64.  ``"mlp"`` blocks are Megatron MLPs (column- then row-parallel over ``"tensor"``,
    residual); ``"gpt"`` blocks are ``fpar.ops.gpt_block`` (heads split over ``"tensor"``); the
    head is column-parallel (its outputs and the targets split over ``"tensor"``, the squared
    errors summed over it, as a vocab-parallel head's loss).  The batch is split over
    ``"data"``; parameters are replicated over it (ZeRO shards them there), and the blocks are
    stacked on a leading dim (split over ``"pipe"`` for the pipeline).

    Attributes:
      shape: the mesh's axis sizes, e.g. ``(1, 2, 1)``.
      names: its axis names, distinct, from ``("data", "tensor", "pipe")``; ``"data"`` is
        always one of them (ZeRO and the optimizer update shard over it).
      model: ``"mlp"`` or ``"gpt"`` (the latter needs a ``"tensor"`` axis).
      driver: how a step is written: ``"manual"`` (an ``fpar.shard``-ed loss differentiated by
        hand, then ``fpar.optim.zero_update`` at stage 0), ``"zero"`` (``fpar.optim.zero_step``,
        or ``zero_grads`` then ``zero_update``, at ``zero_stage``) or ``"pipeline"``
        (``fpar.pipeline.pipeline`` over ``"pipe"``, then ``zero_update`` at stage 0).
      grad_api: ``"manual"`` only: ``"func_grad"`` (``torch.func.grad_and_value``) or
        ``"backward"`` (``loss.backward()`` into ``.grad``).
      accumulation: ``"manual"`` only, how ``n_micro`` microbatches are summed: ``"none"``
        (``n_micro == 1``), ``"loop"`` (a Python loop), ``"defer"`` (the same loop with all but
        the last microbatch under ``fpar.defer_reduction()``) or ``"accumulate"``
        (``fpar.optim.accumulate``).
      n_micro: microbatches per step (the pipeline's ``m``; ``zero_step``'s ``n_micro``).
      zero_stage: ``"zero"`` only: the ZeRO stage, 0 to 3.
      fused: ``"zero"`` only: ``zero_step`` (True) or ``zero_grads`` + ``zero_update``, whose
        gradients are then compared too (False).
      schedule: ``"pipeline"`` only: ``"gpipe"`` or ``"1f1b"``.
      chunks: ``"pipeline"`` only: model chunks per stage (``v``; 2 needs ``"gpipe"``).
      layers: blocks in the model (the pipeline has ``pipe size x chunks``).
      dropout: dropout rate (``fpar.ops.dropout`` / ``gpt_block``'s, keys from ``fpar.random``).
      optimizer: ``"sgd"`` or ``"adamw"``.
      clip: ``fpar.optim.clip_by_global_norm``'s ``max_norm`` in front of the optimizer, or None.
      donate: the update gets ``donate=True`` (``zero_update`` / ``zero_step``): on a real mesh
        the parameters and optimizer state are updated in place.
      steps: training steps; every step after the first calls the same sharded functions again.
      evaluate: after each step, the loss of another batch under ``torch.no_grad()``, by the same
        sharded loss (the pipeline step itself for ``"pipeline"``).
      seed: seeds the parameters, the batches and the dropout keys.

    Example:
      >>> program = TrainingProgram(shape=(2, 1), names=("data", "tensor"), model="mlp",
      ...                           driver="zero", zero_stage=2, steps=2)
      >>> trace = program.run(fpar.make_mesh(program.shape, program.names, backend="local"))
      >>> sorted(trace["step 0"])
      ['grads', 'loss', 'opt_state', 'params']
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]
    model: str = "mlp"
    driver: str = "manual"
    grad_api: str = "func_grad"
    accumulation: str = "none"
    n_micro: int = 1
    zero_stage: int = 0
    fused: bool = True
    schedule: str = "gpipe"
    chunks: int = 1
    layers: int = 1
    dropout: float = 0.0
    optimizer: str = "sgd"
    clip: float | None = None
    donate: bool = False
    steps: int = 2
    evaluate: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"fpar.testing.TrainingProgram: {msg}")

        shape, names = tuple(self.shape), tuple(self.names)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)
        if len(shape) != len(names) or not names or not all(isinstance(s, int) and s >= 1 for s in shape):
            bad(f"shape {shape} and names {names} must be as long as each other, sizes positive ints.")
        if len(set(names)) != len(names) or not set(names) <= set(AXES) or "data" not in names:
            bad(f"names {names} must be distinct names from {AXES}, including 'data'.")
        for field, allowed in (
            ("model", MODELS),
            ("driver", DRIVERS),
            ("grad_api", GRAD_APIS),
            ("accumulation", ACCUMULATIONS),
            ("schedule", SCHEDULES),
            ("optimizer", OPTIMIZERS),
        ):
            if getattr(self, field) not in allowed:
                bad(f"{field}={getattr(self, field)!r} must be one of {allowed}.")
        size = dict(zip(names, shape))
        if self.model == "gpt" and "tensor" not in names:
            bad("model='gpt' needs a 'tensor' axis (fpar.ops.gpt_block splits its heads over it).")
        if size.get("tensor", 1) not in (1, 2, 4):
            bad("the tensor axis must have size 1, 2 or 4 (the model's widths divide by it).")
        if self.n_micro < 1 or self.steps < 1 or self.layers < 1 or self.chunks < 1:
            bad("n_micro, steps, layers and chunks must be at least 1.")
        if not 0.0 <= self.dropout < 1.0:
            bad(f"dropout={self.dropout} must be in [0, 1).")
        if self.driver == "pipeline":
            if "pipe" not in names:
                bad("driver='pipeline' needs a 'pipe' axis.")
            if self.layers != size["pipe"] * self.chunks:
                bad(
                    f"a pipeline has layers = pipe size x chunks = {size['pipe'] * self.chunks}, not {self.layers}."
                )
            if self.chunks > 1 and self.schedule != "gpipe":
                bad("chunks > 1 needs schedule='gpipe' (1F1B runs one chunk per stage).")
        elif size.get("pipe", 1) > 1:
            bad("a 'pipe' axis of size > 1 is for driver='pipeline'.")
        if self.driver == "manual" and (self.accumulation == "none") != (self.n_micro == 1):
            bad("accumulation='none' goes with n_micro=1, and n_micro > 1 needs an accumulation.")
        if self.zero_stage not in (0, 1, 2, 3) or (self.driver != "zero" and self.zero_stage != 0):
            bad("zero_stage is 0 to 3, and other than 0 only with driver='zero'.")

    @property
    def devices(self) -> int:
        """The mesh's device count (processes on a real mesh)."""
        return math.prod(self.shape)

    def describe(self) -> str:
        """A one-line summary: the mesh, then what differs from a plain program."""
        mesh = "x".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        if self.driver == "manual":
            how = f"manual {self.grad_api}"
            if self.accumulation != "none":
                how += f", {self.n_micro} microbatches by {self.accumulation}"
        elif self.driver == "zero":
            how = f"ZeRO-{self.zero_stage} {'zero_step' if self.fused else 'zero_grads+zero_update'}"
            how += f", n_micro={self.n_micro}" if self.n_micro > 1 else ""
        else:
            how = f"pipeline {self.schedule} m={self.n_micro} v={self.chunks}"
        extra = [f"{self.model} x{self.layers}", how, self.optimizer]
        if self.clip is not None:
            extra.append(f"clip {self.clip:g}")
        if self.donate:
            extra.append("donate")
        if self.dropout:
            extra.append(f"dropout {self.dropout:g}")
        extra.append(f"{self.steps} steps")
        if self.evaluate:
            extra.append("eval")
        return f"[{mesh}] " + ", ".join(extra)

    def run(self, mesh: Mesh) -> dict:
        """Train on ``mesh`` (a real or in-process mesh of this program's shape); return global values.

        Call it on every process of a real mesh.  Returns ``{"step i": {"loss", "params",
        "opt_state"[, "grads"]}, "eval i": loss}`` (``"grads"``: the gradients the step took, in
        the layout its API returns them: every driver but ``zero_step``), each a global tensor
        (gathered with ``fpar.gather`` on a real mesh).
        """
        if tuple(mesh.shape.values()) != self.shape or tuple(mesh.axis_names) != self.names:
            raise ValueError(
                f"fpar.testing.TrainingProgram.run: the mesh {dict(mesh.shape)} is not the program's "
                f"{dict(zip(self.names, self.shape))}."
            )
        return _Run(self, mesh).train()


# Building and running one program ---------------------------------------------------------------


class _Run:
    """One program on one mesh: the model's pieces, its data, and the training loop."""

    def __init__(self, program: TrainingProgram, mesh: Mesh):
        self.pr, self.mesh = program, mesh
        self.size = dict(mesh.shape)
        self.tp = "tensor" in self.size
        self.rate = program.dropout
        self.base_key = random_key(program.seed)
        self.gen = torch.Generator().manual_seed(program.seed)
        t = "tensor" if self.tp else None
        if program.model == "mlp":
            self.block_specs = {"w_in": P(None, t), "b_in": P(t), "w_out": P(t, None), "b_out": P()}
        else:
            self.block_specs = ops.gpt_block_specs("tensor")
        self.first_specs = {"w": P()}
        self.last_specs = {"w": P(None, t), "b": P(t)}  # the head: column-parallel, outputs split
        self.hidden_spec = P("data", t)  # the MLP's hidden activations inside a shard
        seq = (None,) if program.model == "gpt" else ()
        self.y_spec = P("data", *seq, t)  # targets: rows over data, outputs over tensor
        self.ys_spec = P(None, *self.y_spec)  # stacked microbatches of them

    # The model (per-device code) ------------------------------------------------------------

    def first(self, w: dict, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = torch.tanh(x @ w["w"])
        return ops.dropout(key, h, self.rate, spec=P("data")) if self.rate else h

    def block(self, w: dict, h: Tensor, key: Tensor | None = None) -> Tensor:
        if self.pr.model == "gpt":
            drop = dict(dropout=self.rate, key=key) if self.rate else {}
            return ops.gpt_block(w, h, axis="tensor", n_heads=_HEADS, **drop)
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
        seq = (_SEQ,) if self.pr.model == "gpt" else ()
        return self.randn(micro, rows, *seq, _D_IN), self.randn(micro, rows, *seq, _OUT)

    def step_key(self, step: int, salt: int = 0) -> tuple[Tensor, ...]:
        """``()`` without dropout, else the step's key."""
        return (fold_in(self.base_key, 1000 * salt + step),) if self.rate else ()

    def specs(self, stacked_over: str | None) -> dict:
        """The parameters' specs: the blocks stacked on dim 0, split over ``stacked_over`` there."""
        stages = optree.tree_map(lambda s: P(stacked_over, *s), self.block_specs, is_leaf=_is_spec)
        return {"stages": stages, "first": self.first_specs, "last": self.last_specs}

    def optimizer(self):
        opt = fo.sgd(0.1) if self.pr.optimizer == "sgd" else fo.adamw(0.02, weight_decay=0.01)
        return fo.chain(fo.clip_by_global_norm(self.pr.clip), opt) if self.pr.clip is not None else opt

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
        loss_fn = shard(self.loss, mesh, (specs, P("data"), self.y_spec, *keyspec), P())
        m = pr.n_micro
        bspecs = {"x": P("data"), "y": self.y_spec}
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
                xs, ys = device_put((xs, ys), mesh, (P(None, "data"), self.ys_spec))
                grads, loss = self._loop(loss_fn, params, xs, ys, key)
            rec_grads = tree_map(lambda g: g.detach().clone(), grads)
            params, state = update(grads, state, params)
            self._record(trace, t, loss, params, specs, state, layout, opt, rec_grads, specs)
            if pr.evaluate:
                ex, ey = self.batch(1)
                ex, ey = device_put((ex[0], ey[0]), mesh, (P("data"), self.y_spec))
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
        pr, mesh = self.pr, self.mesh
        specs = self.specs(None)
        params = device_put(self.init_params(), mesh, specs)
        opt, layout, params, state = self._optimizer_setup(params, specs, pr.zero_stage)
        rate = self.rate

        def loss_fn(p, batch):
            return self.local_loss(p, batch["x"], batch["y"], *([batch["key"]] if rate else []))

        bspecs = {"x": P("data"), "y": self.y_spec, **({"key": P()} if rate else {})}
        if pr.fused:
            step = fo.zero_step(
                loss_fn, opt, layout, batch_specs=bspecs, n_micro=pr.n_micro, donate=pr.donate
            )
        else:
            grads_fn = fo.zero_grads(loss_fn, layout, batch_specs=bspecs, n_micro=pr.n_micro)
            update = fo.zero_update(opt, layout, donate=pr.donate)
        keyspec = (P(),) if rate else ()
        eval_fn = shard(self.loss, mesh, (specs, P("data"), self.y_spec, *keyspec), P())
        trace: dict = {}
        for t in range(pr.steps):
            xs, ys = self.batch(pr.n_micro)
            batch = {"x": xs.flatten(0, 1), "y": ys.flatten(0, 1)}
            batch = device_put(batch, mesh, {"x": P("data"), "y": self.y_spec})
            if rate:
                batch["key"] = self.step_key(t)[0]
            if pr.fused:
                params, state, metrics = step(params, state, batch)
                self._record(trace, t, metrics["loss"], params, specs, state, layout, opt)
            else:
                grads, loss = grads_fn(params, batch)
                rec_grads = tree_map(lambda g: g.detach().clone(), grads)
                params, state = update(grads, state, params)
                self._record(trace, t, loss, params, specs, state, layout, opt, rec_grads, layout.grad_specs)
            if pr.evaluate:
                ex, ey = self.batch(1)
                ex, ey = device_put((ex[0], ey[0]), mesh, (P("data"), self.y_spec))
                with torch.no_grad():
                    full = fo.zero_params(params, layout)
                    trace[f"eval {t}"] = eval_fn(full, ex, ey, *self.step_key(t, salt=1)).clone()
        return trace

    def train_pipeline(self) -> dict:
        pr, mesh = self.pr, self.mesh
        p, v, m = self.size["pipe"], pr.chunks, pr.n_micro
        sub = mesh.submesh(tuple(a for a in mesh.axis_names if a != "pipe"))
        rows, keyspec = P("data"), ((P(),) if self.rate else ())
        stage = shard(self.block, sub, (self.block_specs, rows, *keyspec), rows)
        first = shard(self.first, sub, (self.first_specs, rows, *keyspec), rows)

        def head(w, h, y):
            return pmean(self.head_loss(w, h, y), "data")

        loss = shard(head, sub, (self.last_specs, rows, self.y_spec), P())
        schedule = pp.gpipe(p, m, v) if pr.schedule == "gpipe" else pp.one_f_one_b(p, m)
        run = pp.pipeline(stage, schedule, mesh, loss=loss, first=first, axis="pipe")
        specs = self.specs("pipe")

        def in_model_order(tree):
            return {**tree, "stages": pp.model_major(tree["stages"], p, v)}

        params = self.init_params()
        params["stages"] = pp.stage_major(params["stages"], p, v)
        params = device_put(params, mesh, specs)
        opt, layout, params, state = self._optimizer_setup(params, specs, 0)
        update = fo.zero_update(opt, layout, donate=pr.donate)
        trace: dict = {}
        for t in range(pr.steps):
            xs, ys = device_put(self.batch(m), mesh, (P(None, "data"), self.ys_spec))
            key = self.step_key(t)
            res = run(params, xs, ys, key=key[0] if key else None)
            grads = tree_map(lambda g: g.detach().clone(), res.grads)
            params, state = update(res.grads, state, params)
            self._record(
                trace, t, res.loss, params, specs, state, layout, opt, grads, specs, order=in_model_order
            )
            if pr.evaluate:
                exs, eys = device_put(self.batch(m), mesh, (P(None, "data"), self.ys_spec))
                ekey = self.step_key(t, salt=1)
                with torch.no_grad():
                    trace[f"eval {t}"] = run(params, exs, eys, key=ekey[0] if ekey else None).loss.clone()
        return trace


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


def _grads_of(leaves: Any) -> Any:
    """The ``.grad`` of each leaf (zeros where there is none)."""
    return tree_map(lambda t: t.grad if t.grad is not None else torch.zeros_like(t), leaves)
