"""The model's own forward run as a pipeline stage: its decoder layers replaced by slots.

``fpar.hf.pipeline_stages`` runs each stage as the causal LM whose decoder layers are slots
(``_Shell``): a stage's first slot gives the hidden state it received, its steps run its layers'
weights, and a slot after its last layer stops the forward with the hidden state it reached.  So
everything the model's forward does between the plan's pieces runs as the model's own code.
"""

from __future__ import annotations

import dis
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

Tensor = torch.Tensor
_API = "fpar.hf.pipeline_stages"


class _Shell:
    """The causal LM ``outer`` whose decoder layers are ``slots`` (``_Shell.run`` runs its forward)."""

    def __init__(self, outer: torch.nn.Module, slots: list, explain: Callable):
        self.outer, self.explain = outer, explain
        self.start = next((s for s in slots if isinstance(s, _Start)), None)
        self.steps = [s for s in slots if isinstance(s, _Step)]
        self.last = not any(isinstance(s, _Stop) for s in slots)  # runs the forward to its end

    def run(
        self, params: Mapping, kwargs: dict, hidden: Tensor | None = None, weights: list | None = None
    ) -> Any:
        """The forward with ``hidden`` fed to the ``_Start`` slot, ``weights[i]`` to step ``i``.

        Returns what the forward returns, or the hidden state that a ``_Stop`` slot reached.
        """
        if self.start is not None:
            self.start.__dict__["_hidden"] = hidden
        for s, w in zip(self.steps, weights or [], strict=True):
            s.__dict__["weights"] = w
        _RUNNING.append(self)
        try:
            return torch.func.functional_call(self.outer, dict(params), (), kwargs)
        except _Reached as stop:
            return stop.hidden
        except _TakenApart as e:
            raise ValueError(
                f"{_API}: {type(self.outer).__name__}'s decoder layers ({e.layer}) return more than the "
                f"hidden state (state for the next layer, such as HY-V4's and GLM-DSA's top-k indices), "
                f"which its forward takes apart; a pipeline stage passes on the hidden state only, so "
                f"this model cannot be cut into stages."
            ) from None
        except RuntimeError as e:  # a module's shape error on this device's blocks, by name
            better = self.explain(e)
            if better is None:
                raise
            raise better from e
        except ValueError as e:  # the model's loop unpacked a stage's hidden state as a tuple
            if "values to unpack" not in str(e):
                raise
            raise ValueError(
                f"{_API}: {type(self.outer).__name__}'s decoder layers return more than the hidden state "
                f"(state for the next layer, such as GLM-DSA's top-k indices), which its forward unpacks; "
                f"a pipeline stage passes on the hidden state only, so this model cannot be cut into "
                f"stages ({e})."
            ) from e
        finally:  # the slots hold no tensor between calls
            _RUNNING.pop()
            if self.start is not None:
                self.start.__dict__["_hidden"] = None
            for s in self.steps:
                s.__dict__["weights"] = None


_RUNNING: list[_Shell] = []  # the shells running now (innermost last)


def _parameters(fn: Callable) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or a C function: no Python signature
        return ()


def _after_layers(
    module: torch.nn.Module, base: torch.nn.Module, layers_attr: str, pieces: list
) -> dict[str, torch.nn.Module]:
    """``{name: module}``: modules with parameters outside the plan's pieces, after the layers.

    Registered after the decoder layers, in ``base`` or in the causal LM beside ``base``.
    """
    dotted = {id(m): n for n, m in module.named_modules()}
    taken = {id(m) for m in pieces}
    order = list(base._modules)
    later = [base._modules[k] for k in order[order.index(layers_attr) + 1 :]]
    if module is not base:
        later += [m for m in module._modules.values() if m is not base]
    return {
        dotted[id(m)]: m
        for m in later
        if m is not None and id(m) not in taken and any(True for _ in m.parameters())
    }


def _last_only(where: str, module: torch.nn.Module, args: tuple) -> None:
    """A forward pre-hook: a module the last stage holds runs only in the last stage's forward."""
    if _RUNNING and not _RUNNING[-1].last:
        raise ValueError(
            f"{_API}: {where} is in none of the pp plan's pieces and is registered after the decoder "
            f"layers, so the last stage holds it, but the model's forward runs it before them; this "
            f"model cannot be cut by its pp plan."
        )


def _reached(hidden: Any, where: str) -> Tensor:
    if not isinstance(hidden, Tensor):
        raise RuntimeError(f"{_API}: the model's forward returned before it reached {where}.")
    return hidden


class _Reached(Exception):  # noqa: N818 (control flow, never seen by a user)
    """Raised by a ``_Stop`` slot: the model's forward reached the end of a stage's layers."""

    def __init__(self, hidden: Tensor):
        super().__init__("pipeline stage boundary")
        self.hidden = hidden


class _TakenApart(Exception):  # noqa: N818 (turned into a ValueError naming the model by _Shell.run)
    def __init__(self, layer: str):
        super().__init__(layer)
        self.layer = layer


class _Slot(torch.nn.Module):
    """Stands where a decoder layer stands in the model's own forward.

    It reads through to the real layer's attributes (``attention_type``, ``layer_idx``, ...), which
    the forward may look up.
    """

    def __init__(self, like: torch.nn.Module):
        super().__init__()
        self.__dict__["_like"] = like

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_like"], name)


class _Start(_Slot):
    """The first slot: the hidden state this stage received, in place of the placeholder embeddings'."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not torch.compiler.is_compiling() and _taken_apart(sys._getframe(1)):
            raise _TakenApart(type(self.__dict__["_like"]).__name__)
        return self.__dict__["_hidden"]


class _Stop(_Slot):
    """The slot after a stage's last layer: ends the forward with the hidden state it is given."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        raise _Reached(hidden_states)


class _Step(_Slot):
    """Decoder layer ``index`` of the model, run with the chunk's row of its stacked weights."""

    def __init__(self, like: torch.nn.Module):
        super().__init__(like)
        self.__dict__["weights"] = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        layer = type(self.__dict__["_like"]).__name__
        shell = _RUNNING[-1] if _RUNNING else None
        if shell is not None and shell.start is not None and shell.steps and shell.steps[0] is self:
            # the stage's first layer gets what its first slot gave, unless the forward took it apart
            h, given = args[0] if args else kwargs.get("hidden_states"), shell.start.__dict__["_hidden"]
            if isinstance(h, Tensor) and isinstance(given, Tensor) and h.shape != given.shape:
                raise _TakenApart(layer)
        out = torch.func.functional_call(self.__dict__["_like"], self.__dict__["weights"], args, kwargs)
        if isinstance(out, (tuple, list)):  # more than the hidden state, which a stage's first slot
            raise _TakenApart(layer)  # cannot give, whatever the forward does with it
        return out


_TAKES_APART = ("UNPACK_SEQUENCE", "UNPACK_EX", "BINARY_SUBSCR")
_taken: dict[tuple, bool] = {}


def _taken_apart(frame: Any) -> bool:
    """Whether the model's code calling a decoder layer unpacks or indexes what it returns.

    The first frame outside torch's ``Module.__call__`` is the model's forward; the instruction after
    its call tells (``a, b = layer(...)``, ``layer(...)[0]``).  A stage's first slot returns a tensor,
    which such code would take apart along the batch: refused instead.  Cached a call site.
    """
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_NN):
        frame = frame.f_back
    if frame is None:
        return False
    key = (frame.f_code, frame.f_lasti)
    if key not in _taken:
        after = [i for i in dis.get_instructions(frame.f_code) if i.offset > frame.f_lasti][:2]
        if after and after[0].opname in ("LOAD_CONST", "LOAD_SMALL_INT") and len(after) > 1:
            after = after[1:]  # layer(...)[0]: the index is loaded first
        _taken[key] = bool(after) and (
            after[0].opname in _TAKES_APART or (after[0].opname == "BINARY_OP" and after[0].argrepr == "[]")
        )
    return _taken[key]


_TORCH_NN = os.path.dirname(torch.nn.modules.module.__file__)
