"""A training program to compare meshes with: its description (``TrainingProgram``).

``program.run(mesh)`` trains it on any mesh (``_program_run.py``) and returns every step's loss,
gradients, parameters, optimizer state and evaluation loss as *global* values (see
``_random_mesh.py`` for the tier).
"""

from __future__ import annotations

import dataclasses
import math

from .._mesh import Mesh
from ._program_run import _Run

__all__ = ["TrainingProgram"]

AXES = ("data", "tensor", "pipe")
MODELS = ("mlp", "gpt", "sp_gpt", "moe")
DRIVERS = ("manual", "zero", "pipeline")
GRAD_APIS = ("func_grad", "backward")
ACCUMULATIONS = ("none", "loop", "defer", "accumulate")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v")
OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("fp64", "bf16", "fp16")

# model chunks per pipeline stage each schedule takes (gpipe: 1 or 2; the V schedules: 2 in a V)
CHUNKS = {
    "gpipe": (1, 2),
    "1f1b": (1,),
    "interleaved_1f1b": (2,),
    "zb_h1": (1,),
    "zb_v": (2,),
    "dualpipe_v": (2,),
}


# The description --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainingProgram:
    """One training program and its layout: what :meth:`run` trains, on whatever mesh it is given.

    The model is a first layer, ``layers`` blocks and a linear head with a squared-error loss,
    float64.  ``"mlp"`` blocks are Megatron MLPs (column- then row-parallel over ``"tensor"``,
    residual); ``"gpt"`` blocks are ``fpar.ops.gpt_block`` (heads split over ``"tensor"``),
    ``"sp_gpt"`` its sequence-parallel form ``fpar.ops.sp_gpt_block`` (the activations split over
    ``"tensor"`` along the sequence between blocks), ``"moe"`` ``fpar.ops.moe_block`` (a dropless
    top-2-of-4 MoE MLP, each expert's hidden dim split over ``"tensor"``); the head is column-parallel (its
    outputs and the targets split over ``"tensor"``, the squared errors summed over it, as a
    vocab-parallel head's loss; replicated for ``"sp_gpt"``, whose rows of the sequence are
    split instead).  The batch is split over ``"data"``; parameters are replicated over it
    (ZeRO shards them there), and the blocks are stacked on a leading dim (split over
    ``"pipe"`` for the pipeline).  A ``"pipe"`` axis without the pipeline driver is an axis
    the program never reduces over: everything is replicated along it.

    Attributes:
      shape: the mesh's axis sizes, e.g. ``(1, 2, 1)``.
      names: its axis names, distinct, from ``("data", "tensor", "pipe")``; ``"data"`` is
        always one of them (ZeRO and the optimizer update shard over it).
      model: ``"mlp"`` or ``"gpt"`` (the latter needs a ``"tensor"`` axis).
      driver: how a step is written: ``"manual"`` (an ``fpar.shard``-ed loss differentiated by
        hand, then ``fpar.optim.zero_update`` at stage 0), ``"zero"`` (``fpar.optim.zero_step``,
        or ``zero_grads`` then ``zero_update``, at ``zero_stage``) or ``"pipeline"``
        (``fpar.pipeline.pipeline`` over ``"pipe"``, then ``zero_update`` at stage 0; at stage
        2 or 3 through ``fpar.optim.zero_pipeline``).
      grad_api: ``"manual"`` only: ``"func_grad"`` (``torch.func.grad_and_value``) or
        ``"backward"`` (``loss.backward()`` into ``.grad``).
      accumulation: ``"manual"`` only, how ``n_micro`` microbatches are summed: ``"none"``
        (``n_micro == 1``), ``"loop"`` (a Python loop), ``"defer"`` (the same loop with all but
        the last microbatch under ``fpar.defer_reduction()``) or ``"accumulate"``
        (``fpar.optim.accumulate``).
      n_micro: microbatches per step (the pipeline's ``m``; ``zero_step``'s ``n_micro``).
      zero_stage: the ZeRO stage: 0 to 3 for ``"zero"``, 0, 2 or 3 for ``"pipeline"``.
      fused: ``"zero"`` only: ``zero_step`` (True) or ``zero_grads`` + ``zero_update``, whose
        gradients are then compared too (False).
      reduce_once: stage 2 or 3 with ``n_micro > 1``: the microbatches' gradients summed
        unreduced and reduce-scattered once (True), or each microbatch's reduced as its backward
        ends (False); ``None``: the driver's default (``"zero"``: False, ``zero_step``'s;
        ``"pipeline"``: True, ``zero_pipeline``'s).
      reshard_after_forward: ``"pipeline"`` at ``zero_stage`` 3 only: each model chunk's
        parameters gathered for its own forward and backward and freed after
        (``zero_pipeline``'s option), not the stage's once a step.
      schedule: ``"pipeline"`` only: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``,
        ``"zb_h1"``, ``"zb_v"`` or ``"dualpipe_v"`` (``fpar.pipeline``'s builders).
      chunks: ``"pipeline"`` only: model chunks per stage (``v``): 1 or 2 for ``"gpipe"``, 2 for
        ``"interleaved_1f1b"`` (in the V layout for ``"zb_v"`` and ``"dualpipe_v"``), any for
        ``"gpipe"``, else 1.
      layers: blocks in the model (the pipeline has ``pipe size x chunks``).
      dropout: dropout rate (``fpar.ops.dropout`` / ``gpt_block``'s, keys from ``fpar.random``).
      optimizer: ``"sgd"`` or ``"adamw"``.
      clip: ``fpar.optim.clip_by_global_norm``'s ``max_norm`` in front of the optimizer, or None.
      donate: the update gets ``donate=True`` (``zero_update`` / ``zero_step``): on a real mesh
        the parameters and optimizer state are updated in place.
      steps: training steps; every step after the first calls the same sharded functions again.
      evaluate: after each step, the loss of another batch under ``torch.no_grad()``, by the same
        sharded loss (the pipeline step itself for ``"pipeline"``).
      remat: every block is wrapped in ``fpar.optim.remat`` (recomputed in the backward).
      precision: ``"fp64"``, or ``"zero"`` and ``fused`` only: ``fpar.optim.mixed_precision``
        with ``"bf16"`` compute, or ``"fp16"`` with dynamic loss scaling (float64 masters).
      checkpoint: after the first step (``steps >= 2``), the parameters and optimizer state are
        saved with ``fpar.checkpoint.save``, loaded onto another layout (replicated) and placed
        back, and training goes on from what was loaded.
      compile: ``"zero"`` and ``fused`` only, ``steps >= 2``: the whole step (the sharded loss,
        its backward, the update) under ``torch.compile(fullgraph=True)`` (``aot_eager``) after
        a first eager step.
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
    reduce_once: bool | None = None
    reshard_after_forward: bool = False
    schedule: str = "gpipe"
    chunks: int = 1
    layers: int = 1
    dropout: float = 0.0
    optimizer: str = "sgd"
    clip: float | None = None
    donate: bool = False
    steps: int = 2
    evaluate: bool = False
    remat: bool = False
    precision: str = "fp64"
    checkpoint: bool = False
    compile: bool = False
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
            ("precision", PRECISIONS),
        ):
            if getattr(self, field) not in allowed:
                bad(f"{field}={getattr(self, field)!r} must be one of {allowed}.")
        size = dict(zip(names, shape))
        if self.model != "mlp" and "tensor" not in names:
            bad(f"model={self.model!r} needs a 'tensor' axis (fpar.ops.gpt_block splits its heads over it).")
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
            if self.chunks not in CHUNKS[self.schedule] and self.schedule != "gpipe":
                bad(
                    f"schedule={self.schedule!r} runs chunks in {CHUNKS[self.schedule]} per stage, not {self.chunks}."
                )
            if self.schedule == "interleaved_1f1b" and self.n_micro < size["pipe"]:
                bad("schedule='interleaved_1f1b' needs n_micro >= the pipe size.")
            if self.schedule == "dualpipe_v" and self.n_micro < 2 * size["pipe"]:
                bad("schedule='dualpipe_v' needs n_micro >= 2 x the pipe size.")
        elif self.chunks != 1 or self.schedule != "gpipe":
            bad("schedule and chunks are for driver='pipeline'.")
        if self.driver == "manual" and (self.accumulation == "none") != (self.n_micro == 1):
            bad("accumulation='none' goes with n_micro=1, and n_micro > 1 needs an accumulation.")
        if self.zero_stage not in (0, 1, 2, 3) or (
            self.zero_stage != 0
            and self.driver != "zero"
            and not (self.driver == "pipeline" and self.zero_stage in (2, 3))
        ):
            bad(
                "zero_stage is 0 to 3 with driver='zero', 0, 2 or 3 with driver='pipeline' "
                "(fpar.optim.zero_pipeline; ZeRO-1 in a pipeline is stage 2), and 0 otherwise."
            )
        if self.driver != "manual" and (self.grad_api, self.accumulation) != ("func_grad", "none"):
            bad("grad_api and accumulation are for driver='manual'.")
        if self.driver != "zero" and not self.fused:
            bad("fused=False is for driver='zero'.")
        if self.reduce_once not in (None, True, False):
            bad("reduce_once is None, True or False.")
        pipelined = self.driver == "pipeline" and self.reduce_once is not None
        if (self.reduce_once or pipelined) and not (
            self.driver in ("zero", "pipeline") and self.zero_stage in (2, 3) and self.n_micro > 1
        ):
            bad("reduce_once is for driver='zero' or 'pipeline' at zero_stage 2 or 3 with n_micro > 1.")
        if self.reshard_after_forward not in (True, False) or (
            self.reshard_after_forward and (self.driver, self.zero_stage) != ("pipeline", 3)
        ):
            bad(
                "reshard_after_forward is True or False, and True only for driver='pipeline' at zero_stage 3."
            )
        for field, on in (("precision", self.precision != "fp64"), ("compile", self.compile)):
            if on and not (self.driver == "zero" and self.fused):
                bad(f"{field} is for driver='zero' with fused=True (fpar.optim.zero_step).")
        if (self.checkpoint or self.compile) and self.steps < 2:
            bad("checkpoint and compile need steps >= 2 (they act between the first step and the next).")

    @property
    def devices(self) -> int:
        """The mesh's device count (processes on a real mesh)."""
        return math.prod(self.shape)

    @property
    def tolerance(self) -> tuple[float | None, float | None]:
        """``(rtol, atol)`` to compare a real mesh with the in-process mesh (None: float64's default).

        bf16/fp16 compute rounds each mesh's partial sums apart: 2e-2 and 2e-3; with AdamW an
        absolute 2 x its learning rate per step: a gradient that is zero up to rounding (the key
        bias of attention, whose exact gradient is zero) has either sign, and AdamW moves the weight
        by about the learning rate either way, every step.  In float64 that rounding (~1e-17) is
        below AdamW's ``eps`` (1e-8), which divides it: the weight moves by up to ``lr * 1e-9`` a
        step either way, over float64's default ``atol`` of 1e-11 (seen: 6.5e-11 on an MoE's key
        bias after 2 steps); ``atol`` 1e-9 a step there.
        """
        if self.precision == "fp64":
            return (None, 1e-9 * max(self.steps, 1)) if self.optimizer == "adamw" else (None, None)
        return (2e-2, 2 * 0.02 * max(self.steps, 1) if self.optimizer == "adamw" else 2e-3)

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
            how += " reduced once" if self.reduce_once else ""
        else:
            how = f"pipeline {self.schedule} m={self.n_micro} v={self.chunks}"
            how += f", ZeRO-{self.zero_stage}" if self.zero_stage else ""
            how += " reduced each microbatch" if self.reduce_once is False else ""
            how += " resharded after forward" if self.reshard_after_forward else ""
        extra = [f"{self.model} x{self.layers}", how, self.optimizer]
        if self.precision != "fp64":
            extra.append(self.precision)
        if self.clip is not None:
            extra.append(f"clip {self.clip:g}")
        if self.donate:
            extra.append("donate")
        if self.dropout:
            extra.append(f"dropout {self.dropout:g}")
        extra += [name for name in ("remat", "checkpoint", "compile") if getattr(self, name)]
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
