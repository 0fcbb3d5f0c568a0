"""fpar.P (PartitionSpec): construction, sequence protocol, equality, hashing, repr."""

from __future__ import annotations

import pytest

import fpar
from fpar import P


def test_p_is_partitionspec():
    assert fpar.P is fpar.PartitionSpec


@pytest.mark.parametrize(
    ("spec", "entries"),
    [
        pytest.param(P(), (), id="empty"),
        pytest.param(P("i"), ("i",), id="one-name"),
        pytest.param(P(None, "j"), (None, "j"), id="none-then-name"),
        pytest.param(P(("i", "j"), None), (("i", "j"), None), id="tuple-entry"),
        pytest.param(P("i", None, ("k",)), ("i", None, ("k",)), id="one-tuple"),
    ],
)
def test_sequence_protocol(spec, entries):
    assert len(spec) == len(entries)
    assert tuple(spec) == entries
    assert list(iter(spec)) == list(entries)
    for k, e in enumerate(entries):
        assert spec[k] == e


def test_equality_and_hash():
    assert P("i", None) == P("i", None)
    assert P(("i", "j")) == P(("i", "j"))
    assert P("i") != P("j")
    assert P(("i", "j")) != P(("j", "i"))
    assert P("i", "j") != P(("i", "j"))
    assert P(None, "i") != P("i", None)
    assert hash(P("i", None)) == hash(P("i", None))
    assert len({P("i"), P("i"), P(None, "i"), P()}) == 3


def test_repr():
    assert repr(P("i", None)) == "P('i', None)"


def test_repr_round_trips():
    for spec in (P(), P("i"), P(None, "j"), P(("i", "j"), None)):
        assert eval(repr(spec), {"P": P}) == spec
