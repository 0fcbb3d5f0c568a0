"""A Hugging Face model's RMSNorms and SwiGLU MLPs keeping what fused kernels keep.

``lean(apply_fn)`` finds, in ``apply_fn``'s local model, each module whose forward computes what
``fpar.ops.rms_norm`` computes (Llama's ``RMSNorm`` and its copies: Qwen, Mistral, ...) and each
MLP whose middle is ``silu(gate) * up`` (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``),
and changes its class to a subclass that runs the ``fpar.ops`` form.  Which modules qualify is
decided by running them: a module's own forward and the ``fpar.ops`` form, on random weights of
its shapes, must give the same values bit for bit, in float32 and in bfloat16; one that does not
(Gemma's ``1 + weight``, a GeLU MLP) keeps its own forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops._lean import rms_norm, swiglu

__all__ = ["lean"]

_API = "fpar.hf.lean"


def lean(apply_fn: Any) -> dict[str, int]:
    """Let a Hugging Face model's norms and gated MLPs keep only their inputs for the backward.

    Plain torch RMSNorm keeps float32 copies of the hidden state beside its result, and a SwiGLU
    MLP keeps ``silu(gate)`` beside ``gate`` and ``up``; ``fpar.ops.rms_norm`` and
    ``fpar.ops.swiglu`` keep what fused kernels keep and recompute the rest in the backward.  The
    values are the module's own bit for bit (each module is checked before it is changed);
    gradients agree to rounding (the norm's backward is written out).  A norm whose input and
    weight differ in dtype (float32 weights on bfloat16 activations: Hugging Face's result is
    then float32) runs its own forward.

    Args:
      apply_fn: what ``fpar.hf.from_pretrained`` or ``fpar.ops.tensor_parallel`` returned; its
        local model is changed in place (``pipeline_stages`` cut before or after runs it so).

    Returns:
      ``{"rms_norm": n, "swiglu": m}``: how many modules were changed.

    Raises:
      TypeError: ``apply_fn`` is not a model's per-device function.
    """
    module = getattr(apply_fn, "module", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"{_API}: apply_fn must be what fpar.hf.from_pretrained or fpar.ops.tensor_parallel returned "
            f"(it has the model as .module), got {type(apply_fn).__name__}."
        )
    counts = {"rms_norm": 0, "swiglu": 0}
    verdicts: dict[tuple, bool] = {}  # (class, kind, shapes) -> whether the fpar.ops form equals it
    for m in module.modules():
        if "forward" in m.__dict__:  # a forward tensor_parallel installed (a split norm): its own
            continue
        plain = type(m).__dict__.get("_fpar_plain", type(m))
        for kind, probe, cls in (("rms_norm", _norm_probe, _LeanNorm), ("swiglu", _mlp_probe, _LeanMLP)):
            shapes = probe(m, plain, None)
            if shapes is None:
                continue
            key = (plain, kind, shapes)
            if key not in verdicts:
                verdicts[key] = bool(probe(m, plain, True))
            if verdicts[key]:
                m.__class__ = _subclass(plain, cls)
                counts[kind] += 1
    return counts


def _norm_probe(m: torch.nn.Module, plain: type, run: bool | None) -> Any:
    """Whether ``m`` computes ``fpar.ops.rms_norm``.

    ``run=None``: the shapes that key the check, or None when ``m`` is no RMSNorm candidate;
    ``run=True``: whether ``m``'s forward equals ``fpar.ops.rms_norm`` on random values.
    """
    w = m._parameters.get("weight")
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if (
        w is None
        or w.dim() != 1
        or not isinstance(eps, float)
        or len(m._parameters) != 1
        or list(m.children())
    ):
        return None
    if run is None:
        return (tuple(w.shape),)
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, w.shape[0], generator=g).to(dt)
        weight = (1 + 0.1 * torch.randn(w.shape[0], generator=g)).to(dt)
        with torch.no_grad():
            want = _plain_call(m, plain, {"weight": weight}, x)
            got = rms_norm(x, weight, eps, compute_dtype=torch.float32)
        if not (isinstance(want, torch.Tensor) and want.dtype == got.dtype and torch.equal(want, got)):
            return False
    return True


def _mlp_probe(m: torch.nn.Module, plain: type, run: bool | None) -> Any:
    """As ``_norm_probe`` for a gated MLP: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, ``act_fn`` SiLU."""
    parts = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, torch.nn.Linear) for p in parts) or not isinstance(
        getattr(m, "act_fn", None), torch.nn.Module
    ):
        return None
    named = dict(m.named_parameters())
    if run is None:
        return tuple((n, tuple(p.shape)) for n, p in named.items())
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, named["gate_proj.weight"].shape[-1], generator=g).to(dt)
        params = {n: (0.1 * torch.randn(p.shape, generator=g)).to(dt) for n, p in named.items()}
        with torch.no_grad():
            want = _plain_call(m, plain, params, x)
            got = torch.func.functional_call(_as(m, _LeanMLP, plain), params, (x,))
        if not (isinstance(want, torch.Tensor) and torch.equal(want, got)):
            return False
    return True


def _plain_call(m: torch.nn.Module, plain: type, params: dict, x: torch.Tensor) -> Any:
    """``m``'s own forward on ``params`` (a module on meta or with other weights is not touched)."""
    return torch.func.functional_call(_as(m, plain, plain), params, (x,))


def _as(m: torch.nn.Module, cls: type, plain: type) -> torch.nn.Module:
    """A shallow copy of ``m`` of class ``cls`` (``plain``'s lean subclass, or ``plain``).

    Its children are shallow copies with their class's forward (not one ``tensor_parallel``
    installed, whose collectives run only inside ``fpar.shard``), and none has the hooks
    sequence parallelism puts on a module (all-gathers too): the probe checks ``m``'s own
    arithmetic.
    """
    other = _copy(m, _subclass(plain, cls) if cls is not plain else plain)
    other._modules = {n: None if c is None else _copy(c, type(c)) for n, c in m._modules.items()}
    return other


def _copy(m: torch.nn.Module, cls: type) -> torch.nn.Module:
    other: Any = object.__new__(cls)
    other.__dict__.update({k: v for k, v in m.__dict__.items() if k != "forward"})
    other._parameters = dict(m._parameters)
    for hooks in _HOOKS:
        setattr(other, hooks, type(getattr(m, hooks))())
    return other


_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _subclass(plain: type, lean: type) -> type:
    """``plain`` with ``lean``'s forward (``lean`` falls back to ``plain``'s where it must)."""
    key = (plain, lean)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(
            plain.__name__, (lean, plain), {"_fpar_plain": plain, "__module__": plain.__module__}
        )
    return _SUBCLASSES[key]


class _LeanNorm(torch.nn.Module):
    """An RMSNorm's forward as ``fpar.ops.rms_norm`` (computed in float32, as Hugging Face's)."""

    _fpar_plain: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: Any = self.weight
        if x.dtype != w.dtype:  # Hugging Face's result is then in the promoted dtype
            return self._fpar_plain.forward(self, x)
        eps: Any = getattr(self, "variance_epsilon", getattr(self, "eps", None))
        return rms_norm(x, w, eps, compute_dtype=torch.float32)


class _LeanMLP(torch.nn.Module):
    """A gated MLP's forward with ``fpar.ops.swiglu`` in the middle."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        me: Any = self
        return me.down_proj(swiglu(me.gate_proj(x), me.up_proj(x)))
