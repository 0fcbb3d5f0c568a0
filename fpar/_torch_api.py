"""Every private torch API fpar touches, why, and the torch versions it was checked on.

torch's private names (a leading underscore, ``torch._C``, functorch's level machinery) change
without deprecation, so a torch upgrade is a review of this one file: ``PRIVATE_APIS`` names each,
with the modules that use it and why no public API does; ``missing()`` lists those the running
torch lacks. ``tests/test_torch_api.py`` checks that every one resolves and that every private
torch name in ``fpar/``'s source is listed here; ``scripts/torch_versions.sh`` runs that test and
a fast subset of the suite on the oldest and the newest torch we support.

Modules import these names from here (``from ._torch_api import maybe_current_level``), or
directly from torch while the tree is being reorganised; either way the name is listed below.

Checked on (``scripts/torch_versions.sh``): see ``CHECKED_ON``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch
from torch._C import _functorch as functorch  # noqa: F401  (the module, for attribute access)
from torch._C._functorch import (  # noqa: F401
    _unwrap_for_grad,
    _wrap_for_grad,
    get_interpreter_stack,
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    is_gradtrackingtensor,
    maybe_current_level,
    maybe_get_level,
)

__all__ = ["CHECKED_ON", "PRIVATE_APIS", "PrivateApi", "missing"]

# The torch versions on which every name below resolved (tests/test_torch_api.py, CPU, 2026-11-26).
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1")

DisableFuncTorch = torch._C._DisableFuncTorch
DisableTorchFunction = torch._C.DisableTorchFunction
disabled_torch_function_impl = torch._C._disabled_torch_function_impl
is_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled


@dataclasses.dataclass(frozen=True)
class PrivateApi:
    """One private torch name: where fpar uses it and why."""

    name: str  # dotted path from ``torch``; ``Class.method`` for a method
    users: tuple[str, ...]  # fpar modules (paths under fpar/)
    why: str
    optional: bool = False  # fpar checks for it and falls back when it is missing
    probe: Callable[[], object] | None = None  # how to reach it, where a dotted path cannot


_FT = "torch._C._functorch"

PRIVATE_APIS: tuple[PrivateApi, ...] = (
    # functorch's level machinery: which torch.func transforms are active, and moving a tensor
    # in and out of a grad level without recording it (no public API exposes levels).
    PrivateApi(
        f"{_FT}.maybe_current_level",
        (
            "_local/shard.py",
            "_local/collective.py",
            "_local/mode.py",
            "_dist/compiled.py",
            "_dist/shard.py",
            "_dist/tracker.py",
            "optim/_remat.py",
            "optim/_zero_comm.py",
            "pipeline/_split.py",
        ),
        "whether a torch.func transform is active, and its level: fpar's vmap nest and the real mesh's "
        "plans differ under grad/vmap",
    ),
    PrivateApi(
        f"{_FT}.maybe_get_level",
        (
            "_local/mode.py",
            "_local/collective.py",
            "_stats.py",
            "optim/_remat.py",
            "_dist/buckets.py",
            "_dist/exchange.py",
            "_dist/lowered.py",
        ),
        "the functorch level a tensor is wrapped at",
    ),
    PrivateApi(
        f"{_FT}.get_unwrapped",
        (
            "_local/mode.py",
            "_local/collective.py",
            "_stats.py",
            "_defer.py",
            "optim/_zero_comm.py",
            "_dist/buckets.py",
            "_dist/exchange.py",
        ),
        "the plain tensor inside a functorch wrapper (sizes, storage), without recording an op",
    ),
    PrivateApi(
        f"{_FT}.is_batchedtensor",
        ("_local/mode.py", "_local/collective.py", "optim/_remat.py", "optim/_zero_comm.py"),
        "whether a tensor is batched by vmap (the in-process mesh's levels)",
    ),
    PrivateApi(
        f"{_FT}.is_gradtrackingtensor",
        ("_stats.py", "_defer.py", "_dist/lowered.py"),
        "whether a tensor is wrapped by torch.func.grad",
    ),
    PrivateApi(
        f"{_FT}.is_functorch_wrapped_tensor",
        (
            "_defer.py",
            "optim/_internal.py",
            "optim/_accumulate.py",
            "random/_philox.py",
            "_dist/shard.py",
            "_dist/buckets.py",
            "_dist/exchange.py",
            "_dist/tracker.py",
        ),
        "whether any functorch transform wraps a tensor",
    ),
    PrivateApi(
        f"{_FT}._unwrap_for_grad",
        (
            "_local/mode.py",
            "_local/collective.py",
            "_dist/buckets.py",
            "_dist/exchange.py",
            "_dist/lowered.py",
        ),
        "hand a cotangent's plain tensor to a gradient bucket without a custom Function (~0.4 ms each)",
    ),
    PrivateApi(
        f"{_FT}._wrap_for_grad",
        ("_dist/buckets.py", "_dist/exchange.py", "_dist/lowered.py"),
        "wrap the reduced gradient back at its grad level (a lowered call's outputs and gradients too)",
    ),
    PrivateApi(
        f"{_FT}.get_interpreter_stack",
        (
            "_dist/agreement.py",
            "_dist/buckets.py",
            "_dist/exchange.py",
            "_dist/lowered.py",
            "ops/_moe_dispatch.py",
        ),
        "which transforms are active (grad only, or a vmap on top)",
    ),
    PrivateApi(
        f"{_FT}.TransformType",
        (
            "_dist/agreement.py",
            "_dist/buckets.py",
            "_dist/exchange.py",
            "_dist/lowered.py",
            "ops/_moe_dispatch.py",
        ),
        "the kind of each active transform",
    ),
    # lowering a call under torch.func.grad to plain autograd inside it (_dist/lowered.py): what
    # functorch does for every custom autograd.Function under a transform, less its per-call class
    # and tree work (~0.4 ms a call)
    PrivateApi(
        f"{_FT}.pop_dynamic_layer_stack",
        ("_dist/lowered.py",),
        "run the call's function below the grad transform's level (functorch's interpreter.lower())",
    ),
    PrivateApi(
        f"{_FT}.push_dynamic_layer_stack",
        ("_dist/lowered.py",),
        "restore the transform's level after the lowered forward and backward",
    ),
    PrivateApi(
        f"{_FT}.CGradInterpreterPtr",
        ("_dist/lowered.py",),
        "the grad mode outside the transform (prevGradMode): whether its results must stay differentiable there",
    ),
    PrivateApi(
        "torch._functorch.eager_transforms.grad_and_value_impl",
        ("_dist/lowered.py",),
        "tell torch.func.grad/grad_and_value (one backward, then done) from torch.func.vjp (whose vjp_fn may "
        "run again, or under vmap) by the frame that entered the level",
    ),
    PrivateApi(
        "torch._functorch.utils.enable_single_level_autograd_function",
        ("_dist/lowered.py",),
        "apply a single-level Function to the transform's wrapped tensors, as functorch does",
    ),
    PrivateApi(
        "torch.autograd.function._SingleLevelFunction",
        ("_dist/lowered.py",),
        "the one op the transform records for a lowered call (functorch's Generated Function's base)",
    ),
    PrivateApi(
        "torch._C._DisableFuncTorch",
        (
            "_defer.py",
            "_dist/agreement.py",
            "_dist/buckets.py",
            "_dist/exchange.py",
            "_dist/pending.py",
            "_dist/shard.py",
        ),
        "plain tensor ops on communication buffers from hooks that run under torch.func (~3x cheaper, and "
        "no wrapper leaks into a buffer kept across steps)",
    ),
    PrivateApi(
        "torch._C._set_grad_enabled",
        ("_dist/tracker.py",),
        "the grad mode a sharded function asks for (torch.no_grad and its kin call it through the "
        "torch-function mode): autograd off while it is on is a custom autograd.Function's forward, "
        "where an implicit pvary's sum would be lost (refused)",
    ),
    PrivateApi(
        "torch._functorch.autograd_function.custom_function_call",
        ("_local/mode.py", "_dist/tracker.py"),
        "recognise fpar's own autograd.Functions when torch.func dispatches them through the mode",
    ),
    PrivateApi(
        "torch.autograd.forward_ad._current_level",
        ("_dist/agreement.py", "_dist/exchange.py", "ops/_moe_dispatch.py"),
        "whether forward-mode AD (jvp) is active: its tangents take another path than grad's cotangents",
    ),
    # torch-function and dispatch machinery
    PrivateApi(
        "torch.overrides._get_current_function_mode_stack",
        ("optim/_internal.py", "_dist/tracker.py"),
        "whether fpar's own TorchFunctionMode is active (an optimizer called inside fpar.shard; a remat "
        "body typed by the real mesh's tracker)",
    ),
    PrivateApi(
        "torch._C._DisableTorchDispatch",
        ("_dist/shard.py",),
        "read the generator state unseen by dispatch modes (fpar.plan's memory count would take it for a buffer)",
    ),
    PrivateApi(
        "torch._C.DisableTorchFunction",
        ("_dist/agreement.py", "_dist/tracker.py"),
        "run fpar's bookkeeping ops without re-entering its own TorchFunctionMode",
    ),
    PrivateApi(
        "torch._C._disabled_torch_function_impl",
        ("_dist/pending.py",),
        "the Pending loss subclass opts out of __torch_function__ (as torch's own subclasses do)",
    ),
    PrivateApi(
        "torch._C._is_torch_function_mode_enabled",
        ("random/_philox.py",),
        "the compiled Philox path only where no mode intercepts",
    ),
    PrivateApi(
        "torch.Tensor._make_wrapper_subclass",
        ("_dist/pending.py",),
        "the Pending loss: a tensor subclass without storage (as AsyncCollectiveTensor)",
    ),
    PrivateApi(
        "torch.utils._pytree.tree_map", ("_dist/pending.py",), "map over __torch_dispatch__ arguments"
    ),
    PrivateApi(
        "torch.utils._python_dispatch.TorchDispatchMode",
        ("plan/_record.py",),
        "record the aten ops of a model for the planner's cost model",
    ),
    PrivateApi(
        "torch._subclasses.fake_tensor.is_fake",
        ("ops/_moe_dispatch.py",),
        "skip value checks on fake tensors",
    ),
    # tensors, storages and autograd nodes
    PrivateApi(
        "torch.Tensor._version",
        ("_defer.py", "_dist/buckets.py", "_functional.py"),
        "the version counter: an input modified in place between deferred calls is an error, not a wrong sum",
    ),
    PrivateApi("torch.Tensor._base", ("pipeline/_split.py", "random/_philox.py"), "the base of a view"),
    PrivateApi(
        "torch.UntypedStorage._cdata",
        ("_buffers.py", "optim/_zero_comm.py", "plan/_estimate.py", "plan/_record.py"),
        "a storage's identity (meta tensors have no data_ptr) and its use count",
    ),
    # autograd engine
    PrivateApi(
        "<autograd node>._set_sequence_nr",
        ("_dist/buckets.py", "pipeline/_unstack.py"),
        "give a gradient bucket's hook node AccumulateGrad's priority, so its all-reduce starts as soon as "
        "its gradients are final (DDP's overlap)",
        probe=lambda: torch.ones(1, requires_grad=True).view_as(torch.ones(1)).grad_fn._set_sequence_nr,  # type: ignore[union-attr]  # grad_fn is a Node: x requires grad
    ),
    PrivateApi(
        "torch.autograd.Variable._execution_engine.queue_callback",
        ("_defer.py",),
        "run a check once the current backward ends (as DDP does): deferred gradient sums that the final "
        "call outside fpar.defer_reduction() left unclaimed are an error then",
    ),
    PrivateApi(
        "torch.autograd.graph._engine_run_backward",
        ("pipeline/_stage.py",),
        "run a pipeline chunk's backward from an output whose values were released after its send "
        "(torch.autograd.backward compares the cotangent's shape with the emptied output's; the engine "
        "checks it against the graph's own record, as Megatron-LM's custom_backward does)",
    ),
    PrivateApi("torch._C._current_graph_task_id", ("plan/_record.py",), "whether a backward is running"),
    PrivateApi(
        "torch._C._storage_Use_Count",
        ("_buffers.py",),
        "whether anything but fpar still holds a kept buffer (reuse it only then, as DDP's buckets)",
    ),
    # torch.compile
    PrivateApi(
        "torch._C._dynamo.eval_frame.set_code_exec_strategy",
        ("_compile.py",),
        "run fpar's hooks eagerly per code object under torch.compile (what torch._dynamo.skip_code uses)",
        optional=True,
    ),
    PrivateApi("torch._C._dynamo.eval_frame._FrameAction", ("_compile.py",), "the same", optional=True),
    PrivateApi("torch._C._dynamo.eval_frame._FrameExecStrategy", ("_compile.py",), "the same", optional=True),
    PrivateApi(
        "torch._dynamo.config.trace_autograd_ops",
        ("_compile.py", "testing/_program_run.py"),
        "whether Dynamo traces .backward() (then an fpar call at a graph break is refused: torch makes no "
        "gradient for a graph input's backward)",
    ),
    PrivateApi(
        "torch._dynamo.utils.orig_code_map",
        ("_compile.py",),
        "whether a frame on the stack is code Dynamo compiled (an fpar call runs at its graph break)",
    ),
    PrivateApi(
        "torch.distributed._functional_collectives.*",
        ("_dist/compiled.py",),
        "collectives Dynamo traces into a compiled graph (all_reduce, all_gather_tensor, "
        "reduce_scatter_tensor, all_to_all_single), their _c10d_functional ops seen by Inductor's passes",
        probe=lambda: (
            torch.distributed._functional_collectives.all_reduce,
            torch.distributed._functional_collectives.all_gather_tensor,
            torch.distributed._functional_collectives.reduce_scatter_tensor,
            torch.distributed._functional_collectives.all_to_all_single,
        ),
    ),
    # kernels
    PrivateApi(
        "torch._foreach_*",
        ("optim/_ops.py",),
        "multi-tensor kernels for the optimizers' updates (what torch.optim's foreach path runs)",
        probe=lambda: (torch._foreach_add, torch._foreach_mul_, torch._foreach_lerp_, torch._foreach_norm),
    ),
    PrivateApi(
        "torch.ops.aten._scaled_dot_product_flash_attention",
        ("plan/_models.py",),
        "the planner's model on meta tensors calls the flash kernel directly, so the memory it records "
        "keeps no s x s attention matrix",
    ),
    PrivateApi(
        "torch.ops.inductor.resize_storage_bytes_",
        ("optim/_zero_fsdp.py", "plan/_record.py"),
        "free and re-allocate a ZeRO-3 parameter's gathered storage while its tensor and views live (as "
        "FSDP2 does); an op, so the planner's recorder sees the bytes",
    ),
    PrivateApi(
        "torch.autograd._unsafe_preserve_version_counter",
        ("optim/_zero_fsdp.py",),
        "a ZeRO-3 parameter gathered into its own storage is not a change autograd must check (FSDP2's use)",
    ),
    # testing
    PrivateApi(
        "torch.testing._internal.distributed.fake_pg.FakeStore",
        ("plan/_paper.py",),
        "a fake process group, to build a real mesh's groups without processes",
    ),
    # public names newer than pyproject's floor (torch 2.11 has them under their older names)
    PrivateApi(
        "torch.distributed.all_gather_single",
        ("_dist/exchange.py", "optim/_zero_comm.py"),
        "one-buffer all-gather; falls back to all_gather_into_tensor (same arguments) where missing",
        optional=True,
    ),
    PrivateApi(
        "torch.distributed.reduce_scatter_single",
        ("_dist/exchange.py", "optim/_zero_fsdp.py"),
        "one-buffer reduce-scatter; falls back to reduce_scatter_tensor (same arguments) where missing",
        optional=True,
    ),
    PrivateApi(
        "torch._grouped_mm",
        ("ops/_moe_dispatch.py", "plan/_cost.py"),
        "one grouped matmul for all experts where the build has it",
        optional=True,
    ),
)


def _resolve(name: str) -> object:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def missing(*, optional: bool = False) -> list[str]:
    """The listed names the running torch lacks (with ``optional``, also those fpar can do without)."""
    out = []
    for api in PRIVATE_APIS:
        if api.optional and not optional:
            continue
        try:
            api.probe() if api.probe is not None else _resolve(api.name)
        except (ImportError, AttributeError):
            out.append(api.name)
    return out
