"""The docs page "Prove your layout" (docs/testing.md) runs as written, beyond what test_docs.py does.

tests/test_docs.py runs every Python block of the page (the property test and the ``distributed``
test are only defined there). Here its blocks are taken from the page (not copied), written into a
module and run: the property test with hypothesis, the ``distributed`` example on two gloo
processes; and the failure the page shows for a forgotten ``psum`` is the one the kit gives.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def _section() -> str:
    return PAGE.read_text(encoding="utf-8")


def _blocks(lang: str) -> list[str]:
    """The section's fenced blocks of language ``lang`` ('' for a bare fence)."""
    blocks, current, inside = [], [], None
    for line in _section().splitlines():
        if line.startswith("```"):
            if inside is None:
                inside, current = line[3:].strip(), []
            else:
                if inside == lang:
                    blocks.append("\n".join(current) + "\n")
                inside = None
        elif inside is not None:
            current.append(line)
    return blocks


def _load(tmp_path: Path, name: str, code: str):
    path = tmp_path / f"{name}.py"
    path.write_text(code, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@pytest.fixture
def module_name(request):
    name = f"docs_prove_your_layout_{request.node.name}"
    yield name
    sys.modules.pop(name, None)


def test_page_has_the_blocks_this_test_runs():
    python = _blocks("python")
    assert len(python) == 4, python
    assert "assert_equivalent(torch.matmul, row_parallel" in python[0]
    assert "def test_my_layout(data):" in python[1]
    assert "@fpar.testing.distributed(2, timeout=120)" in python[2]
    assert "assert_programs_on_real_mesh(programs)" in python[3]  # whole programs (test_docs.py runs it)
    assert len(_blocks("")) == 1  # the failure message


def test_page_example_and_property_test_run(tmp_path, module_name):
    first, prop = _blocks("python")[:2]
    module = _load(tmp_path, module_name, first + "\n" + prop)  # the first block runs on import
    module.test_my_layout()


def test_page_failure_message_is_what_the_kit_says(tmp_path, module_name):
    first = _blocks("python")[0]
    forgot = first.replace('fpar.psum(x @ w, "tensor")', "x @ w")
    assert forgot != first
    (shown,) = _blocks("")
    shown = re.sub(r"(error )[0-9.]+", r"\1NUMBER", " ".join(shown.split()))  # the data is random
    pattern = re.escape(shown).replace("NUMBER", "[0-9.e+]+")
    with pytest.raises(AssertionError) as info:
        _load(tmp_path, module_name, forgot)
    assert re.fullmatch(pattern, str(info.value)), (pattern, str(info.value))


@pytest.mark.multiprocess
def test_page_distributed_example_runs(tmp_path, module_name):
    first, _, dist_block = _blocks("python")[:3]
    definitions = first[: first.index("\nmesh = ")]  # its imports and row_parallel, not the run
    module = _load(tmp_path, module_name, definitions + "\n\n" + dist_block)
    module.test_row_parallel_on_a_real_mesh()
