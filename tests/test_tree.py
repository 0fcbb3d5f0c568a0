"""The house: fpar's modules import each other without circles, and none imports the facade.

The graph is read from the source (``ast``), every ``import`` and ``from ... import`` of an fpar
module, at the top of a module or inside a function (a deferred import is still a dependency;
it only hides a circle from the interpreter). An edge to a package is an edge to its
``__init__``; a module does not depend on its parent package by being inside it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FPAR = ROOT / "fpar"
FACADE = "fpar"

MAX_LINES = 650  # "no file over ~600 lines"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(FPAR.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The fpar modules ``name`` imports (a ``from pkg import sub`` of a submodule names the submodule)."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == FACADE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != FACADE:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {m: _imports(m) for m in MODULES}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    assert "fpar._collectives" in GRAPH["fpar._shard"]
    assert "fpar.ops._check" in GRAPH["fpar.ops._gpt"]  # `from . import _check as check`
    assert "fpar._dist" in GRAPH[FACADE]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    # The facade imports everything, so edges into it are test_nothing_imports_the_facade's business.
    graph = {m: deps - {FACADE} for m, deps in GRAPH.items()}
    assert _circles(graph) == [], "import circles among fpar's modules"


def test_nothing_imports_the_facade():
    # Neither the core (``fpar._x``, the backends) nor a subpackage (``fpar.ops``, ``fpar.plan``,
    # ...) calls the public API through ``fpar``: each imports the module that defines the name.
    bad = sorted(m for m, deps in GRAPH.items() if m != FACADE and FACADE in deps)
    assert bad == [], f"import the core modules (fpar._shard, fpar._collectives, ...), not `fpar`: {bad}"


def test_no_module_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}, f"split by responsibility (at most ~600 lines a module): {long}"


def test_importing_fpar_loads_neither_dynamo_nor_the_optional_packages():
    """``import fpar`` costs what torch's own import does plus fpar's modules, in every fresh
    process (torchrun's workers, a spawned launch): ``torch._dynamo`` (with sympy, FSDP and DTensor: ~2 s of CPU a
    process) loads only when something compiles, and the optional packages only when used."""
    import subprocess
    import sys

    heavy = ("torch._dynamo", "torch._inductor", "sympy", "transformers", "safetensors", "hypothesis")
    code = f"import sys, fpar; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import fpar loaded {out.stdout.strip()}"
