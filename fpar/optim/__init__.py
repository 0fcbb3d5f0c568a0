"""Functional training on fpar: optimizers, ZeRO, mixed precision, clipping, accumulation, remat.

Everything is a pure function over pytrees of tensors (optax's design, see ``STYLE.md``).

* Optimizers are ``GradientTransformation(init, update)`` pairs built by composition:
  ``sgd``, ``adam``, ``adamw`` from ``chain``, ``scale_by_adam``, ``trace``,
  ``add_decayed_weights``, ``scale``, ``scale_by_schedule``, ``scale_by_learning_rate``,
  ``clip_by_global_norm`` (``global_norm`` is correct across shards); ``apply_updates`` adds the
  updates.  Learning rates may be schedules: ``constant``, ``linear_warmup``, ``warmup_cosine``.
* Data parallelism from DDP (stage 0) to ZeRO-3: ``zero_layout`` plans the storage,
  ``zero_init`` shards the state (and stage-3 parameters), ``zero_step`` builds
  ``(params, opt_state, batch) -> (params, opt_state, metrics)`` from ``zero_grads`` and
  ``zero_update``; ``zero_params`` returns the full parameters; ``accumulate`` averages
  microbatches; ``bytes_per_device`` measures what a device holds.
* ``mixed_precision(optimizer, compute_dtype=..., loss_scale=...)``: bf16/fp16 compute over fp32
  master weights, dynamic loss scaling with overflow skips agreed by every device.
* ``remat(f, policy=None)``: activation checkpointing that composes with ``torch.func`` and
  ``fpar.shard``; a ``policy`` (``save_dots``, ``save_alternate_dots``) keeps chosen ops' outputs.

Example:
  >>> import fpar, fpar.optim as fo
  >>> layout = fo.zero_layout(params, mesh, specs, stage=2)
  >>> opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(fo.warmup_cosine(3e-4, 100, 10_000)))
  >>> params, state = fo.zero_init(opt, params, layout)
  >>> step = fo.zero_step(loss_fn, opt, layout, batch_specs=fpar.P("data"))
  >>> params, state, metrics = step(params, state, batch)
"""

from ._accumulate import accumulate as accumulate
from ._base import EmptyState as EmptyState
from ._base import GradientTransformation as GradientTransformation
from ._base import apply_updates as apply_updates
from ._base import chain as chain
from ._base import identity as identity
from ._precision import MixedPrecision as MixedPrecision
from ._precision import MixedPrecisionState as MixedPrecisionState
from ._precision import all_finite as all_finite
from ._precision import cast_floating as cast_floating
from ._precision import mixed_precision as mixed_precision
from ._remat import remat as remat
from ._remat import save_alternate_dots as save_alternate_dots
from ._remat import save_dots as save_dots
from ._schedules import constant as constant
from ._schedules import linear_warmup as linear_warmup
from ._schedules import warmup_cosine as warmup_cosine
from ._transforms import ScaleByAdamState as ScaleByAdamState
from ._transforms import ScaleByScheduleState as ScaleByScheduleState
from ._transforms import TraceState as TraceState
from ._transforms import adam as adam
from ._transforms import adamw as adamw
from ._transforms import add_decayed_weights as add_decayed_weights
from ._transforms import clip_by_global_norm as clip_by_global_norm
from ._transforms import global_norm as global_norm
from ._transforms import scale as scale
from ._transforms import scale_by_adam as scale_by_adam
from ._transforms import scale_by_learning_rate as scale_by_learning_rate
from ._transforms import scale_by_schedule as scale_by_schedule
from ._transforms import sgd as sgd
from ._transforms import trace as trace
from ._zero import ZeroLayout as ZeroLayout
from ._zero import bytes_per_device as bytes_per_device
from ._zero import zero_init as zero_init
from ._zero import zero_layout as zero_layout
from ._zero import zero_params as zero_params
from ._zero_grads import zero_grads as zero_grads
from ._zero_pipeline import zero_pipeline as zero_pipeline
from ._zero_update import zero_step as zero_step
from ._zero_update import zero_update as zero_update

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "MixedPrecision",
    "MixedPrecisionState",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "TraceState",
    "ZeroLayout",
    "accumulate",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_updates",
    "bytes_per_device",
    "cast_floating",
    "chain",
    "clip_by_global_norm",
    "constant",
    "global_norm",
    "identity",
    "linear_warmup",
    "mixed_precision",
    "remat",
    "save_alternate_dots",
    "save_dots",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "trace",
    "warmup_cosine",
    "zero_grads",
    "zero_init",
    "zero_layout",
    "zero_params",
    "zero_pipeline",
    "zero_step",
    "zero_update",
]
