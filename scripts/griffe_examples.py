"""A griffe extension for the docs build (mkdocs.yml): read ``Example:`` as ``Examples:``.

fpar's docstrings write Google style's ``Example:`` section in the singular; griffe parses only
the plural as a section of ``>>>`` examples and renders the singular as an admonition, where
``>>>`` lines become nested block quotes and ``x["a"]["b"]`` a broken link.  This one line teaches
griffe's Google parser the singular (a private table of griffe's: if it moves, the docs build
fails with a clear import error here, not wrong pages).
"""

import griffe
from griffe._internal.docstrings import google as _google

_google._section_kind.setdefault("example", griffe.DocstringSectionKind.examples)


class ExampleSections(griffe.Extension):
    """Nothing to do per object: importing this module registers the section name."""
