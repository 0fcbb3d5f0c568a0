"""The docs cannot rot: every Python block of README.md and docs/ runs, and the site builds.

The rules a page follows (docs/writing-docs.md says the same for writers):

* every fenced ```` ```python ```` block runs; the blocks of one page run in order in one namespace
  (a page is one program: a later block uses an earlier block's names), in a fresh temporary
  directory, after ``torch.manual_seed(0)`` and ``fpar.reset_comm_stats()``;
* a block that must not run says so on the line right before its fence:
  ``<!-- no-run: why -->`` (the reason is required: "needs torchrun", "a fragment", ...);
* a ```` ```text ```` block right after a Python block (blank lines between allowed) is what that
  block prints. Lines are compared with trailing spaces stripped; ``...`` inside a line matches
  any text, and a line that is only ``...`` matches any number of lines.

Each page is one test (its id is the page's path), so a failure names the page, and the traceback
names the Markdown file and line of the failing statement. The site test runs
``mkdocs build --strict`` into a temporary directory; it is skipped only where mkdocs is not
installed (``pip install -e .[docs]``; ``scripts/dev.sh setup`` installs it, so CI runs it).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

OPTIONAL = {"transformers": "hf", "sklearn": "examples", "matplotlib": "examples", "tqdm": "examples"}
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")
_NO_RUN = re.compile(r"^<!--\s*no-run\b(.*?)-->\s*$")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the first code line
    no_run: str | None = None  # the reason, when marked
    expected: str | None = None  # the text block that follows, if any


def parse(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with no-run markers and expected output attached."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i, marker, last_end = 0, None, -10
    while i < len(lines):
        line = lines[i]
        no_run = _NO_RUN.match(line.strip())
        fence = _FENCE.match(line)
        if no_run:
            reason = no_run.group(1).strip().lstrip(":").strip()
            if not reason:
                raise ValueError(f"{path}:{i + 1}: '<!-- no-run -->' needs a reason: '<!-- no-run: why -->'")
            marker = (reason, i)
        elif fence:
            ticks, lang = fence.group(1), fence.group(2)
            end = i + 1
            while end < len(lines) and not lines[end].startswith(ticks):
                end += 1
            block = Block(lang, "\n".join(lines[i + 1 : end]) + "\n", i + 2)
            if marker is not None:
                if marker[1] != i - 1 or lang != "python":
                    raise ValueError(
                        f"{path}:{marker[1] + 1}: a no-run marker goes on the line right before a python fence"
                    )
                block.no_run, marker = marker[0], None
            between = lines[last_end + 1 : i]
            if (
                lang == "text"
                and blocks
                and blocks[-1].lang == "python"
                and not any(s.strip() for s in between)
            ):
                blocks[-1].expected = block.code
            blocks.append(block)
            i, last_end = end, end
        elif marker is not None and line.strip():
            raise ValueError(
                f"{path}:{marker[1] + 1}: a no-run marker goes on the line right before a python fence"
            )
        i += 1
    return blocks


def _matches(expected: str, actual: str) -> bool:
    exp = [s.rstrip() for s in expected.rstrip("\n").splitlines()]
    act = [s.rstrip() for s in actual.rstrip("\n").splitlines()]

    def line_ok(e: str, a: str) -> bool:
        return re.fullmatch(".*".join(re.escape(part) for part in e.split("...")), a) is not None

    def match(i: int, j: int) -> bool:
        if i == len(exp):
            return j == len(act)
        if exp[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(act) + 1))
        return j < len(act) and line_ok(exp[i], act[j]) and match(i + 1, j + 1)

    return match(0, 0)


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _runnable(path: Path) -> bool:
    return any(b.lang == "python" and b.no_run is None for b in parse(path))


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=_page_id)
def test_page_runs(page: Path, tmp_path, monkeypatch):
    import torch

    import fpar

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    fpar.reset_comm_stats()
    namespace = {"__name__": "docs_" + re.sub(r"\W", "_", _page_id(page))}
    for block in parse(page):
        if block.lang != "python" or block.no_run is not None:
            continue
        # Pad with newlines so a traceback names the Markdown file's own line numbers.
        code = compile("\n" * (block.line - 1) + block.code, str(page), "exec")
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(code, namespace)
        except ModuleNotFoundError as e:
            if e.name in OPTIONAL:  # CI installs every extra (scripts/dev.sh setup), so it runs there
                pytest.skip(f"{_page_id(page)} needs {e.name}: pip install -e '.[{OPTIONAL[e.name]}]'")
            raise
        if block.expected is not None:
            assert _matches(block.expected, out.getvalue()), (
                f"{_page_id(page)}:{block.line}: the block printed\n{out.getvalue()}\nbut the page shows\n{block.expected}"
            )


def test_every_page_is_in_the_nav_and_no_marker_is_misplaced():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in PAGES:
        parse(page)  # raises on a misplaced or reasonless marker
        if page.is_relative_to(DOCS):
            assert str(page.relative_to(DOCS)) in nav, f"{page} is not in mkdocs.yml's nav"


def test_collector_rules():
    text = (
        "```python\nprint('a')\nprint('b c')\n```\n\n```text\na\nb ...\n```\n"
        "<!-- no-run: a fragment -->\n```python\n...\n```\n"
    )
    page = ROOT / "tests" / "_collector_probe.md"
    try:
        page.write_text(text, encoding="utf-8")
        first, shown, fragment = parse(page)
    finally:
        page.unlink()
    assert first.expected == "a\nb ...\n" and shown.lang == "text"
    assert fragment.no_run == "a fragment" and fragment.line == 12
    assert _matches("a\nb ...\n", "a\nb c\n") and not _matches("a\nb ...\n", "a\nc\n")
    assert _matches("a\n...\nz\n", "a\nb\nc\nz\n") and not _matches("a\n", "a\nb\n")


def test_readme_is_short_and_its_links_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def _public_packages() -> list[str]:
    """fpar and every subpackage whose ``__init__`` has an ``__all__``."""
    names = ["fpar"]
    for init in sorted((ROOT / "fpar").glob("*/__init__.py")):
        if not init.parent.name.startswith("_") and "__all__" in init.read_text(encoding="utf-8"):
            names.append(f"fpar.{init.parent.name}")
    return names


def test_api_page_lists_every_public_package():
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^::: (\S+)\s*$", api, flags=re.M))
    missing = [name for name in _public_packages() if name not in listed]
    assert not missing, f"add '::: NAME' lines to docs/api.md for {missing}"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    mkdocs = shutil.which("mkdocs", path=os.path.dirname(sys.executable)) or shutil.which("mkdocs")
    if importlib.util.find_spec("mkdocs") is None or mkdocs is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (bash scripts/dev.sh setup does)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_site_builds_strict_and_offline(site):
    pages = list(site.rglob("*.html"))
    assert (site / "index.html").exists() and (site / "search" / "search_index.json").exists()
    for page in pages:
        html = page.read_text(encoding="utf-8")
        # Nothing fetched from the network when a page is read: no web fonts, no CDN scripts.
        assert not re.search(r'<(?:link|script)[^>]+(?:href|src)="https?://', html), page
        assert "fonts.googleapis" not in html and "fonts.gstatic" not in html, page


def test_api_reference_has_every_public_name(site):
    html = (site / "api" / "index.html").read_text(encoding="utf-8")
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^::: (\S+)\s*$", api, flags=re.M))  # the other test checks the list
    missing = []
    for package in sorted(listed & set(_public_packages())):
        module = importlib.import_module(package)
        for name in module.__all__:
            if isinstance(getattr(module, name), type(module)):
                continue  # a subpackage: it has its own section
            # Rendered from its docstring, or (an alias, a name its module shadows) named in the page's prose.
            if f'id="{package}.{name}"' not in html and f"`{package}.{name}`" not in api:
                missing.append(f"{package}.{name}")
    assert not missing, f"not in the API reference (no docstring?): {missing}"
