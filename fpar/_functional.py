"""From an ``nn.Module`` to a pure function over a parameter tree, and specs by name.

``functionalize(module)`` returns ``(apply_fn, params)``: ``params`` is the module's parameters
as a flat dict keyed by their dotted names (``"blocks.0.attn.q.weight"``, as in
``state_dict``), and ``apply_fn(params, *args, **kwargs)`` runs the module's forward with those
tensors through ``torch.func.functional_call``.  ``spec_rules(params, rules)`` gives each
parameter a ``fpar.P`` by matching its name against patterns, the way OSLO and Megatron
describe tensor-parallel layouts, so that a module's parameters can be sharded with
``fpar.shard``, ``fpar.init`` and ``fpar.checkpoint``.

Buffers are kept out of ``params`` (an integer or boolean buffer cannot be differentiated):
by default they are constants inside ``apply_fn``; with ``buffers=True`` they are a separate
tree that ``apply_fn`` takes and returns updated (BatchNorm running statistics).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ._mesh import Mesh
from ._spec import PartitionSpec, check_spec
from ._tree import tree_flatten_with_path, tree_unflatten

__all__ = ["functionalize", "spec_rules"]

Tensor = torch.Tensor
_NO_DEFAULT = object()


# API ----------------------------------------------------------------------------------------


def functionalize(module: nn.Module, *, buffers: bool = False) -> tuple:
    r"""Turn ``module`` into a pure function of its parameters.

    The returned ``params`` are the module's parameters, detached (sharing memory with the
    module, not copies); tied parameters appear once, under their first name, and stay tied.
    ``apply_fn`` never reads the module's own parameter values, only its structure and flags
    (so call ``module.eval()`` first if dropout should be off).

    Args:
      module: the module.
      buffers: where the module's buffers go.  ``False``: they are constants captured by
        ``apply_fn`` (masks, position ids), passed to each call as copies; a forward seen to
        update one in place (BatchNorm in training mode) raises.
        ``True``: they are returned as a separate dict and ``apply_fn`` threads them.

    Returns:
      ``(apply_fn, params)`` with ``apply_fn(params, *args, **kwargs) -> out``; or, with
      ``buffers=True``, ``(apply_fn, params, buffers)`` with
      ``apply_fn(params, buffers, *args, **kwargs) -> (out, new_buffers)`` (the buffers passed in
      are never modified).

    Raises:
      TypeError: ``module`` is not an ``nn.Module``.

    Example:
      >>> model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
      >>> apply_fn, params = fpar.functionalize(model.eval())
      >>> list(params)
      ['0.weight', '0.bias', '2.weight', '2.bias']
      >>> specs = fpar.spec_rules(params, {r"\d+\.(weight|bias)": P()})  # replicated: data parallel
      >>> mesh = fpar.make_mesh((4,), ("data",))
      >>> y = fpar.shard(apply_fn, mesh, (specs, P("data")), P("data"))(params, torch.randn(16, 8))

      Splitting a layer's weight by name alone does not make the forward tensor parallel (a
      row-split layer needs an all-reduce before its bias): ``fpar.ops.tensor_parallel`` does that
      for an unmodified module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fpar.functionalize: expected a torch.nn.Module, got {type(module).__name__}.")
    params = {n: p.detach() for n, p in module.named_parameters()}
    bufs = {n: b.detach() for n, b in module.named_buffers()}
    if buffers:
        return _stateful(module, frozenset(params), frozenset(bufs)), params, bufs
    return _stateless(module, frozenset(params), bufs), params


def spec_rules(
    params: Any,
    rules: Mapping[str, PartitionSpec] | Iterable[tuple[str, PartitionSpec]],
    *,
    default: PartitionSpec | None = _NO_DEFAULT,  # type: ignore[assignment]
    syntax: str = "regex",
    mesh: Mesh | None = None,
) -> Any:
    r"""Assign a ``fpar.P`` to every parameter by matching its dotted name against patterns.

    A parameter's name is its pytree path joined with dots: a key of the flat dict from
    ``functionalize`` as it is (``"h.0.attn.c_attn.weight"``), ``"params.w1"`` for
    ``{"params": {"w1": ...}}``.  Rules are tried in order and the first whose pattern matches
    the *whole* name wins, so put specific rules before general ones.  Nothing is replicated
    silently: a rule that matches no name is an error, and so are names no rule matches unless
    ``default`` is given.

    Args:
      params: a pytree of tensors (typically ``params`` from ``functionalize``).
      rules: ``{pattern: spec}`` (in insertion order) or a sequence of ``(pattern, spec)``.
        Megatron rules for Hugging Face's GPT-2, whose ``Conv1D`` weights are ``[in, out]``::

            {r".*\.attn\.c_attn\.weight": P(None, "tensor"),  # column-parallel: split 'out'
             r".*\.attn\.c_attn\.bias": P("tensor"),
             r".*\.attn\.c_proj\.weight": P("tensor", None),  # row-parallel: split 'in'
             r"wte\.weight": P("tensor", None)}                 # vocab-parallel embedding

      default: the spec of a parameter no rule matches (e.g. ``P()``: replicated).  Without
        one, such parameters are an error that lists them.
      syntax: ``"regex"`` (``re.fullmatch``) or ``"glob"`` (``fnmatch``; ``*`` also crosses dots).
      mesh: if given, check each spec against the mesh and the parameter's shape now.

    Returns:
      A pytree of ``fpar.P`` with the structure of ``params``.

    Raises:
      TypeError: a rule's spec is not a ``fpar.P``, or a pattern is not a string.
      ValueError: an unknown ``syntax``, an invalid regex, a rule that matches no parameter name,
        parameters no rule matches and no ``default`` (both list the names), or a spec longer than
        its parameter's rank.
      fpar.SpecError: with ``mesh``: an unknown axis or a dim the mesh does not divide.
    """
    matchers = _compile(rules, syntax)
    if default is not _NO_DEFAULT and not isinstance(default, PartitionSpec):
        raise TypeError(f"fpar.spec_rules: default must be a fpar.P (e.g. P()), got {default!r}.")
    paths, leaves, treedef = tree_flatten_with_path(params)
    names = [".".join(str(k) for k in path) for path in paths]
    unused = [pattern for pattern, match, _ in matchers if not any(match(name) for name in names)]
    if unused:
        raise ValueError(_unused_message(unused, names))
    specs, unmatched = [], []
    for name, leaf in zip(names, leaves):
        spec, pattern = _first_match(matchers, name)
        if spec is None:
            if default is _NO_DEFAULT:
                unmatched.append(name)
                continue
            spec, pattern = default, "default"
        _check_fits(spec, name, leaf, pattern, mesh)
        specs.append(spec)
    if unmatched:
        raise ValueError(_unmatched_message(unmatched, matchers))
    return tree_unflatten(treedef, specs)


# Apply functions -----------------------------------------------------------------------------


def _stateless(module: nn.Module, names: frozenset, bufs: dict[str, Tensor]) -> Callable:
    def apply_fn(params, *args, **kwargs):
        _check_names("params", params, names)
        # Copies: a forward that writes a buffer must not change the constants of later calls.
        copies = {n: b.clone() for n, b in bufs.items()}
        versions = {n: b._version for n, b in copies.items()}
        out = torch.func.functional_call(module, ({**params, **copies}), args, kwargs, tie_weights=True)
        _check_unchanged(copies, versions)
        return out

    apply_fn.__name__ = f"{type(module).__name__}_apply"
    return apply_fn


def _stateful(module: nn.Module, names: frozenset, buf_names: frozenset) -> Callable:
    def apply_fn(params, buffers, *args, **kwargs):
        _check_names("params", params, names)
        _check_names("buffers", buffers, buf_names)
        new = {n: b.clone() for n, b in buffers.items()}  # the caller's buffers stay untouched
        out = torch.func.functional_call(module, ({**params, **new}), args, kwargs, tie_weights=True)
        return out, new

    apply_fn.__name__ = f"{type(module).__name__}_apply"
    return apply_fn


def _check_names(what: str, given: Any, expected: frozenset) -> None:
    if not isinstance(given, Mapping):
        raise TypeError(
            f"fpar.functionalize: apply_fn's {what} must be the dict of dotted names from "
            f"functionalize (or a dict like it), got {type(given).__name__}."
        )
    if set(given) == expected:
        return
    missing, extra = sorted(expected - set(given)), sorted(set(given) - expected)
    raise ValueError(
        f"fpar.functionalize: apply_fn's {what} do not match the module's: missing {missing}, "
        f"unexpected {extra}. Pass exactly the keys functionalize returned."
    )


def _check_unchanged(bufs: dict[str, Tensor], versions: dict[str, int]) -> None:
    changed = sorted(n for n, b in bufs.items() if b._version != versions[n])
    if changed:
        raise RuntimeError(
            f"fpar.functionalize: the module updated its buffers {changed} in place during forward "
            f"(e.g. BatchNorm running statistics in training mode), so apply_fn is not pure. Use "
            f"functionalize(module, buffers=True), whose apply_fn returns the updated buffers, or "
            f"call module.eval() first."
        )


# Rules ---------------------------------------------------------------------------------------

_SYNTAXES = ("regex", "glob")


def _compile(rules, syntax: str) -> list[tuple[str, Callable[[str], bool], PartitionSpec]]:
    if syntax not in _SYNTAXES:
        raise ValueError(f"fpar.spec_rules: unknown syntax {syntax!r}; choose one of {_SYNTAXES}.")
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    out = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"fpar.spec_rules: rules must be (pattern, spec) pairs, got {item!r}.")
        pattern, spec = item
        if not isinstance(pattern, str):
            raise TypeError(f"fpar.spec_rules: pattern {pattern!r} must be a string.")
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"fpar.spec_rules: rule {pattern!r} maps to {spec!r}; it must be a fpar.P, e.g. "
                f"P(None, 'tensor') (P() for replicated)."
            )
        out.append((pattern, _matcher(pattern, syntax), spec))
    return out


def _matcher(pattern: str, syntax: str) -> Callable[[str], bool]:
    if syntax == "glob":
        return lambda name: fnmatch.fnmatchcase(name, pattern)
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise ValueError(
            f"fpar.spec_rules: {pattern!r} is not a valid regex ({e}); escape dots as '\\.', or pass "
            f"syntax='glob' for shell-style patterns like 'h.*.attn.c_attn.weight'."
        ) from None
    return lambda name: regex.fullmatch(name) is not None


def _first_match(matchers, name: str) -> tuple[PartitionSpec | None, str | None]:
    for pattern, match, spec in matchers:
        if match(name):
            return spec, pattern
    return None, None


def _check_fits(spec: PartitionSpec, name: str, leaf: Any, pattern: str, mesh: Mesh | None) -> None:
    shape = tuple(leaf.shape) if isinstance(leaf, Tensor) else None
    if shape is not None and len(spec) > len(shape):
        raise ValueError(
            f"fpar.spec_rules: rule {pattern!r} gives {name!r} (shape {shape}) the spec {spec}, which is "
            f"longer than its rank {len(shape)}; the rule probably matches more than intended."
        )
    if mesh is not None:
        check_spec(spec, shape, mesh.shape, where=f"fpar.spec_rules: {name!r} (rule {pattern!r})")


def _unused_message(unused: list[str], names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:20])
    more = f" and {len(names) - 20} more" if len(names) > 20 else ""
    return (
        f"fpar.spec_rules: rule(s) {unused} match no parameter (a typo would otherwise leave the "
        f"parameters it meant replicated). A pattern must match a whole dotted name; the names are: "
        f"{shown}{more}. Fix the pattern or remove the rule."
    )


def _unmatched_message(unmatched: list[str], matchers) -> str:
    shown = ", ".join(repr(n) for n in unmatched[:20])
    more = f" and {len(unmatched) - 20} more" if len(unmatched) > 20 else ""
    return (
        f"fpar.spec_rules: no rule matches {len(unmatched)} parameter(s): {shown}{more}. Patterns must "
        f"match the whole dotted name (tried {[p for p, _, _ in matchers]}). Add rules for them, or "
        f"pass default=P() to replicate whatever no rule names."
    )
