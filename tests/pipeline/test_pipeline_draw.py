"""Pictures of schedules: the text chart (pinned) and the PNG (matplotlib, the optional extra)."""

from __future__ import annotations

import sys

import pytest

import fpar.pipeline as pp

ONE_F_ONE_B_2x3 = """\
1F1B: p=2 stages, m=3 microbatches
tick     0              5
--------------------------------
stage 0 F0 F1  . B0 F2 B1  . B2
stage 1  . F0 B0 F1 B1 F2 B2  .
--------------------------------
F forward, B backward, . idle; bubble 0.250"""


def test_text_chart_is_the_megatron_picture():
    assert pp.draw(pp.one_f_one_b(2, 3)) == ONE_F_ONE_B_2x3
    assert str(pp.one_f_one_b(2, 3)) == "1F1B: p=2 stages, m=3 microbatches, v=1, 8 ticks"


def test_text_chart_names_chunks_and_split_backwards():
    interleaved = pp.draw(pp.interleaved_1f1b(2, 2, 2)).splitlines()
    assert interleaved[3].split()[2:7] == ["F0a", "F1a", "F0b", "F1b", "."]
    assert interleaved[-1].endswith("a/b/.. model chunk; bubble 0.200")
    zb = pp.draw(pp.zb_h1(2, 2)).splitlines()
    assert zb[4].split()[2:] == [".", "F0", "B0", "F1", "B1", "W0", "W1"]  # the last stage defers its Ws
    assert "W weight grad" in zb[-1] and zb[-1].endswith("bubble 0.143")  # 2 idle of 2 x 7 ticks
    zbv = pp.draw(pp.zb_v(2, 4)).splitlines()
    assert zbv[3].split()[2:5] == ["F0a", "F1a", "F2a"] and zbv[-1].endswith("bubble 0.040")


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    for schedule, durations in [
        (pp.interleaved_1f1b(2, 4, 2), None),
        (pp.zb_h1(3, 4), {"f": 1, "b": 1, "w": 1}),
        (pp.dualpipe_v(2, 4), {"f": 1, "b": 1, "w": 1}),
    ]:
        path = tmp_path / f"{schedule.name.split()[0]}.png"
        text = pp.draw(schedule, str(path), durations=durations)
        assert text == pp.draw(schedule)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'fpar\[plot\]'"):
        pp.draw(pp.gpipe(2, 2), str(tmp_path / "x.png"))
