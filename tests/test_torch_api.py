"""Every private torch API fpar touches is listed in fpar/_torch_api.py, and this torch has them.

A torch upgrade is then a review of one file: run this test (``scripts/torch_versions.sh`` runs it
on the oldest and the newest torch we support).
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import torch

from fpar import _torch_api

FPAR = Path(__file__).resolve().parent.parent / "fpar"


def _private_methods() -> set[str]:
    """Private (single-underscore) attributes of torch's tensors, storages and autograd nodes."""
    node = torch.ones(1, requires_grad=True).view_as(torch.ones(1)).grad_fn
    names = set(dir(torch.Tensor)) | set(dir(torch.UntypedStorage)) | set(dir(node))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:])


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _uses(path: Path) -> set[str]:
    """Private torch names in a module's code (imports and attribute chains; not comments or strings)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = {"torch": "torch"}  # local name -> torch path
    found: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "torch"
        ):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = full
                if _private(full):
                    found.add(full)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and _private(alias.name):
                    found.add(alias.name)
    methods = _private_methods()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = _chain(node)
        if chain is not None and chain[0] in aliases:
            full = ".".join([aliases[chain[0]], *chain[1:]])
            if _private(full):
                found.add(full)
        elif node.attr in methods and (chain is None or chain[0] not in ("self", "cls")):
            found.add(f"<method>.{node.attr}")  # a private attribute of a tensor, storage or node
    return found


def _covered(name: str, listed: list[str]) -> bool:
    if name.startswith("<method>."):
        method = name.split(".", 1)[1]
        return any(entry.split(".")[-1] == method for entry in listed)
    return any(
        name == e or e.startswith(name + ".") or name.startswith(e + ".") or fnmatch.fnmatchcase(name, e)
        for e in listed
    )


def test_every_listed_private_api_exists_in_this_torch():
    assert _torch_api.missing() == [], f"torch {torch.__version__} lacks {_torch_api.missing()}"


def test_every_private_torch_api_in_fpar_is_listed():
    listed = [api.name for api in _torch_api.PRIVATE_APIS]
    unlisted = {}
    for path in sorted(FPAR.rglob("*.py")):
        if path.name == "_torch_api.py":
            continue
        rest = sorted(n for n in _uses(path) if not _covered(n, listed))
        if rest:
            unlisted[str(path.relative_to(FPAR))] = rest
    assert not unlisted, f"private torch APIs not listed in fpar/_torch_api.py: {unlisted}"


def test_each_entry_names_its_users_and_why():
    for api in _torch_api.PRIVATE_APIS:
        assert api.why and api.users, api
        for user in api.users:
            assert (FPAR / user).exists() or user.startswith("plan/"), (api.name, user)
