"""The family x layout table of docs/hf-tensor-parallel.md is what its cells gave, and they still give it.

``tests/hf/family_table.py run`` runs every cell (every family with a pp plan x TP, TP+SP, PP, EP,
ZeRO 1-3, remat) into ``tests/hf/family_table.json``; ``render`` writes the table into the page.
Here: the page shows the record's rendering, the record covers every family ``transformers``
ships now and holds no wrong value, and a sample of cells (each layout's first equal and first
refused family, and the cells that found bugs) run again to the recorded outcome.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the hf extra (pip install fpar[hf]) is not installed"
)

import family_table as ft  # noqa: E402  (needs transformers)

RERUN = "python tests/hf/family_table.py run && python tests/hf/family_table.py render"


@pytest.fixture(scope="module")
def record():
    return ft.load()


def test_page_shows_the_rendered_table(record):
    shown = ft.between_markers(ft.PAGE.read_text(encoding="utf-8"))
    assert shown is not None, f"{ft.PAGE} has no {ft.BEGIN} / {ft.END} markers"
    assert shown == ft.render_table(record), (
        f"docs/hf-tensor-parallel.md's family table is not what the record renders: {RERUN}"
    )


def test_record_covers_every_family_and_layout_and_holds_no_wrong_value(record):
    assert set(record["families"]) == set(ft.families()), (
        f"transformers {transformers.__version__} ships other families than the record's "
        f"({record['transformers']}): {RERUN}"
    )
    for family, row in record["families"].items():
        assert set(row["cells"]) == set(ft.LAYOUTS), family
        for layout, got in row["cells"].items():
            assert got["outcome"] in ft.OUTCOMES, (family, layout, got)
            assert got["outcome"] != "wrong", f"{family} x {layout} is wrong: {got['detail']}"


def _sample() -> list[tuple[str, str]]:
    """Each layout's first equal and first refused family, and the cells that found bugs."""
    record = ft.load()
    out = []
    for layout in ft.LAYOUTS:
        for outcome in ("equal", "refused"):
            found = [f for f, row in record["families"].items() if row["cells"][layout]["outcome"] == outcome]
            out += [(found[0], layout)] if found else []
    return out + [
        ("inkling_text", "tp"),  # its plan splits the experts' [gate | up] contiguously: was 1.6e-5 off
        ("apertus", "remat"),  # xIELU's buffers were captured by the recompute: functorch's assert
        ("doge", "pp"),  # a shape error in a stage was a raw RuntimeError, not the refusal by name
        ("qwen3_moe", "ep"),
        ("deepseek_v2", "tp"),  # latent attention (mla_kv_a_proj) with its heads split: was refused
        ("deepseek_v3", "ep"),
        ("glm_moe_dsa", "remat"),  # its layers return top-k indices beside the hidden state
        ("glm_moe_dsa", "pp"),  # ... which a stage cannot pass on: refused by name
        ("llama", "sp"),
        ("olmo_hybrid", "sp"),  # its replicated linear attention ran on sequence blocks: 2.5e-3 off
        ("glm", "sp"),  # rowwise_split_input after a gathered colwise output: reduce-scattered
        ("minimax", "pp"),  # units of 2 layers; a chunk ran chunk 0's decay buffers: 5e-3 off
        ("glm4_moe_lite", "pp"),  # a dense layer before the MoE layers: on stage 0 with the embedding
        ("granite_swa", "pp"),  # its forward reads config.layer_rope_theta[i]: a shell's own list
        ("beam", "tp"),  # 'local_params' attention, its gate's bias split by its own rule: was refused
        ("qwen3_moe", "sp"),  # experts on the gathered sequence: was refused
    ]


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize(("family", "layout"), sorted(set(_sample())))
def test_cell_gives_what_the_record_says(record, family, layout):
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        got = ft.cell(family, layout)
    finally:
        transformers.logging.set_verbosity(level)
    assert got == record["families"][family]["cells"][layout], RERUN


def test_a_wrong_split_is_recorded_wrong(monkeypatch):
    """The cells can fail: without fpar's regrouping of fused weights ([q_r | k_r | v_r] and
    [gate_r | up_r] a device) Phi-3's fused projections get contiguous splits and the value is off."""
    import fpar.ops._tensor_parallel as tp

    monkeypatch.setattr(tp, "layout_index", lambda segments, n: (None, None, 1))
    transformers.logging.set_verbosity_error()
    got = ft.cell("phi3", "tp")
    assert got["outcome"] == "wrong" and got["detail"].startswith("the loss:"), got
