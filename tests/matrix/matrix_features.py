"""The feature matrix's registry: every public training feature as a factor of one training program.

A *factor* is a feature with its options (levels); a *run* picks one level of every factor and is
built into a ``fpar.testing.TrainingProgram`` by :func:`program` (``None``: the combination does
not exist, e.g. ZeRO stage 1 of a pipeline step, or ``.backward()`` inside ``zero_step``).
``matrix_covering.py`` picks runs so that every pair of levels of two factors that exists is in
some run; ``test_feature_matrix.py`` runs them on a real mesh against the in-process mesh.

``PUBLIC`` classifies every public name of ``fpar.optim``, ``fpar.pipeline`` and ``fpar.ops`` once,
as the factor level that trains with it or as not a training feature (with the reason): a new public
name that is not classified fails ``test_every_public_feature_is_classified`` by name.
"""

from __future__ import annotations

from fpar.testing import TrainingProgram
from fpar.testing._program import CHUNKS

# Factors ------------------------------------------------------------------------------------------

# The meshes per device count: an axis of size 1 in each, and an axis the program never reduces
# (a "pipe" axis of size > 1 under a step that is not a pipeline: everything replicated along it).
MESHES = {
    2: {
        "data2": ((2, 1, 1), ("data", "tensor", "pipe")),
        "tensor2": ((1, 2), ("data", "tensor")),
        "pipe2": ((2, 1, 1), ("pipe", "tensor", "data")),
    },
    4: {
        "data2.tensor2": ((2, 2, 1), ("data", "tensor", "pipe")),
        "pipe2.tensor2": ((2, 1, 2), ("pipe", "data", "tensor")),
        "pipe2.data2": ((2, 2), ("pipe", "data")),
        "data4": ((4, 1), ("data", "tensor")),
    },
}

FACTORS: dict[str, tuple] = {
    "driver": ("manual", "zero_step", "zero_grads", "pipeline"),
    "grad": ("func_grad", "backward"),
    "accumulation": ("none", "loop", "defer", "accumulate", "accumulate_once"),
    "zero_stage": (0, 1, 2, 3),
    "schedule": ("none", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v"),
    "model": ("mlp", "gpt", "sp_gpt", "moe"),
    "precision": ("fp64", "bf16", "fp16"),
    "remat": (False, True),
    "clip": (False, True),
    "dropout": (False, True),
    "checkpoint": (False, True),
    "evaluate": (False, True),
    "compile": (False, True),
    "optimizer": ("sgd", "adamw"),
    "donate": (False, True),
}


def factors(devices: int) -> dict[str, tuple]:
    """The factors of a matrix on ``devices`` processes: the mesh, then ``FACTORS``."""
    return {"mesh": tuple(MESHES[devices]), **FACTORS}


# Pairs that are refused, on both meshes alike, with the message pinned ---------------------------

REFUSED: dict[tuple, str] = {
    # torch.compile cannot trace remat's recomputation inside a whole compiled step
    (
        ("remat", True),
        ("compile", True),
    ): "inside a sharded call that torch.compile traces whole: not supported",
}


def refusal(run: dict) -> str | None:
    """The phrase the refusal of ``run`` must carry, or None when it is not refused."""
    for pair, phrase in REFUSED.items():
        if all(run[f] == level for f, level in pair):
            return phrase
    return None


# A run as a program -------------------------------------------------------------------------------


def program(run: dict, devices: int) -> TrainingProgram | None:
    """The ``TrainingProgram`` of ``run`` (a level per factor), or None where it does not exist."""
    shape, names = MESHES[devices][run["mesh"]]
    size = dict(zip(names, shape))
    driver, schedule = run["driver"], run["schedule"]
    kw: dict = dict(
        shape=shape,
        names=names,
        model=run["model"],
        optimizer=run["optimizer"],
        clip=1.0 if run["clip"] else None,
        dropout=0.25 if run["dropout"] else 0.0,
        donate=run["donate"],
        evaluate=run["evaluate"],
        remat=run["remat"],
        precision=run["precision"],
        checkpoint=run["checkpoint"],
        compile=run["compile"],
        grad_api=run["grad"],
        steps=2,
        seed=len(run["mesh"]),
    )
    if driver == "pipeline":
        if schedule == "none" or run["zero_stage"] == 1:
            # ZeRO inside a pipeline is stage 2 or 3 (fpar.optim.zero_pipeline), stage 1 being
            # stage 2 there
            return None
        # a pipeline's microbatches are its accumulation: "accumulate" draws ZeRO-2/3 reducing
        # each chunk's gradient as its backward ends (zero_pipeline's reduce_once=False), "none"
        # its default (once a step), and "accumulate_once" ZeRO-3 summing once a step with each
        # model chunk gathered for its own actions (zero_pipeline's reshard_after_forward=True)
        each = run["accumulation"] == "accumulate" and run["zero_stage"] in (2, 3)
        reshard = run["accumulation"] == "accumulate_once" and run["zero_stage"] == 3
        if run["accumulation"] != "none" and not (each or reshard):
            return None
        p = size.get("pipe", 1)
        chunks = CHUNKS[schedule][0]
        micro = {"interleaved_1f1b": 2 * p, "dualpipe_v": 2 * p}.get(schedule, 2)
        kw.update(driver="pipeline", schedule=schedule, chunks=chunks, layers=p * chunks, n_micro=micro)
        kw.update(
            zero_stage=run["zero_stage"], reduce_once=False if each else None, reshard_after_forward=reshard
        )
    else:
        if schedule != "none":
            return None
        if driver == "manual":
            if run["zero_stage"] != 0 or run["accumulation"] == "accumulate_once":
                return None
            acc = run["accumulation"]
            kw.update(driver="manual", accumulation=acc, n_micro=1 if acc == "none" else 2)
        else:  # zero_step / zero_grads accumulate microbatches themselves
            if run["accumulation"] not in ("none", "accumulate", "accumulate_once"):
                return None
            # accumulate_once: ZeRO-2/3's reduce_once (the microbatches summed unreduced)
            kw.update(
                driver="zero",
                zero_stage=run["zero_stage"],
                fused=driver == "zero_step",
                n_micro=1 if run["accumulation"] == "none" else 2,
                reduce_once=run["accumulation"] == "accumulate_once",
            )
    try:
        return TrainingProgram(**kw)
    except ValueError:
        return None


# Every public name, classified once ---------------------------------------------------------------

# name -> the factor level that trains with it, or "not a training feature: <why>"
_NOT = "not a training feature: "
PUBLIC: dict[str, str] = {
    # fpar.optim
    "optim.remat": "remat=True",
    # remat's policies: which ops it keeps; equal on both meshes in tests/test_remat_dist.py, with
    # op counts and errors in tests/train/test_optim.py, but not yet a level of the matrix
    "optim.save_dots": _NOT + "a policy of remat (not yet a matrix level): tests/test_remat_dist.py",
    "optim.save_alternate_dots": _NOT
    + "a policy of remat (not yet a matrix level): tests/test_remat_dist.py",
    "optim.accumulate": "accumulation=accumulate",
    "optim.zero_layout": "zero_stage",
    "optim.zero_init": "zero_stage",
    "optim.zero_step": "driver=zero_step",
    "optim.zero_grads": "driver=zero_grads",
    "optim.zero_update": "driver=manual",
    "optim.zero_params": "zero_stage",
    "optim.zero_pipeline": "zero_stage=3",
    "optim.ZeroLayout": "zero_stage",
    "optim.mixed_precision": "precision",
    "optim.MixedPrecision": "precision",
    "optim.MixedPrecisionState": "precision",
    "optim.cast_floating": "precision",
    "optim.all_finite": "precision=fp16",
    "optim.clip_by_global_norm": "clip=True",
    "optim.global_norm": "clip=True",
    "optim.sgd": "optimizer=sgd",
    "optim.adamw": "optimizer=adamw",
    "optim.adam": _NOT + "adamw without decay: the same update code as optimizer=adamw",
    "optim.scale_by_adam": "optimizer=adamw",
    "optim.ScaleByAdamState": "optimizer=adamw",
    "optim.add_decayed_weights": "optimizer=adamw",
    "optim.scale": "optimizer=sgd",
    "optim.scale_by_learning_rate": "optimizer=sgd",
    "optim.chain": "clip=True",
    "optim.identity": _NOT + "a no-op transformation",
    "optim.apply_updates": "driver=manual",
    "optim.GradientTransformation": _NOT + "the optimizer type",
    "optim.EmptyState": _NOT + "the state of a stateless transformation",
    "optim.trace": _NOT + "momentum: elementwise, the same code path as optimizer=sgd's scale",
    "optim.TraceState": _NOT + "momentum's state",
    "optim.scale_by_schedule": _NOT + "a learning-rate schedule: a function of the step count only",
    "optim.ScaleByScheduleState": _NOT + "a schedule's step count",
    "optim.constant": _NOT + "a schedule",
    "optim.linear_warmup": _NOT + "a schedule",
    "optim.warmup_cosine": _NOT + "a schedule",
    "optim.bytes_per_device": _NOT + "a memory measure",
    # fpar.pipeline: each schedule builder is a level of "schedule"
    "pipeline.gpipe": "schedule=gpipe",
    "pipeline.one_f_one_b": "schedule=1f1b",
    "pipeline.interleaved_1f1b": "schedule=interleaved_1f1b",
    "pipeline.zb_h1": "schedule=zb_h1",
    "pipeline.zb_v": "schedule=zb_v",
    "pipeline.dualpipe_v": "schedule=dualpipe_v",
    "pipeline.pipeline": "driver=pipeline",
    "pipeline.StepResult": "driver=pipeline",
    "pipeline.stage_major": "driver=pipeline",
    "pipeline.model_major": "driver=pipeline",
    "pipeline.place": _NOT + "the builders' own placement of a hand-written order (every builder uses it)",
    "pipeline.gpipe_scan": _NOT
    + "GPipe as a scan inside fpar.shard: tested by tests/pipeline (no step driver)",
    "pipeline.Action": _NOT + "schedule data",
    "pipeline.Schedule": _NOT + "schedule data",
    "pipeline.ScheduleError": _NOT + "an error type",
    "pipeline.validate": _NOT + "a schedule check",
    "pipeline.draw": _NOT + "a picture",
    "pipeline.timeline": _NOT + "a measure",
    "pipeline.Timeline": _NOT + "a measure",
    "pipeline.simulate": _NOT + "a measure",
    # fpar.ops: layers; the ones a program trains with are levels of "model"
    "ops.dropout": "dropout=True",
    "ops.gpt_block": "model=gpt",
    "ops.gpt_block_specs": "model=gpt",
    "ops.init_gpt_block": "model=gpt",
    "ops.sp_gpt_block": "model=sp_gpt",
    "ops.moe_block": "model=moe",
    "ops.moe": "model=moe",
    "ops.moe_specs": "model=moe",
    "ops.init_moe": "model=moe",
    # fpar itself and fpar.checkpoint
    "defer_reduction": "accumulation=defer",
    "checkpoint.save": "checkpoint=True",
    "checkpoint.load": "checkpoint=True",
    "checkpoint.latest_step": _NOT + "finds a step to resume from (tests/test_checkpoint*)",
    "checkpoint.CheckpointError": _NOT + "an error type",
    "checkpoint.merge": _NOT + "writes one file from a checkpoint (tests/test_checkpoint*)",
    "checkpoint.wait": _NOT
    + "waits for a background save (save(..., blocking=False)); its values: tests/train/test_checkpoint_async.py",
    "checkpoint.PendingSave": _NOT + "the handle of a background save (tests/train/test_checkpoint_async.py)",
}
_LAYER = _NOT + "a layer (tests/ops checks it against its unsharded form); the model factor trains with "
_LAYER += "the blocks built from it"
for _name in (
    "attention attention_specs column_linear gpt gpt_loss gpt_specs init_attention init_gpt "
    "init_layer_norm init_mlp layer_norm layer_norm_specs mlp mlp_specs row_linear vocab_cross_entropy "
    "vocab_embedding ring_attention ring_self_attention sp_attention sp_column_linear sp_gather_matmul sp_mlp "
    "sp_row_linear sp_vocab_embedding ulysses_attention rms_norm swiglu"
).split():
    PUBLIC[f"ops.{_name}"] = _LAYER
for _name in (
    "TensorParallelSpecs layer_norm_2d layer_norm_2p5d linear_2d linear_2p5d mlp_2d mlp_2p5d specs_2d "
    "specs_2p5d summa_matmul layer_norm_3d linear_3d mlp_3d specs_3d TensorLayout "
    "tensor_layout tensor_parallel TensorParallelFn"
).split():
    PUBLIC[f"ops.{_name}"] = _NOT + "a tensor layout of its own (2D/2.5D/3D, module TP): tests/ops"


def level_names() -> set[str]:
    """Every ``factor=level`` the registry knows, and every bare factor name."""
    out = set(FACTORS)
    for f, levels in FACTORS.items():
        out |= {f"{f}={v}" for v in levels}
    return out
