"""The family x layout table of ``docs/hf-tensor-parallel.md``: each cell run, never typed.

Every causal LM ``transformers`` ships a pipeline plan for (``pp_families.families()``), built tiny
by ``pp_families.tiny`` (float64, eager attention, random weights, every scaling its config has
moved off its default, embeddings tied as the family ties them), in each layout a user reaches
with ``plan="auto"``:

=========  ==================================================================================
``tp``     data=2 x tensor=2: the loss (HF's own ``labels=`` path) and every gradient
``sp``     tensor=2 with the family's norms given HF's ``sequence_parallel`` style in ``plan=``
``pp``     pipe=2 x tensor=2, ``fpar.hf.pipeline_stages`` under 1F1B, 2 microbatches (the fewest
           layers that cut into 2 stages: ``pp_families.pipeline_layers``)
``ep``     expert=2 x tensor=2 from ``base_model_ep_plan`` (``expert_axis=``); a dense family: n/a
``zero1``  one ``fpar.optim.zero_step`` of AdamW at data=2 x tensor=2, ZeRO stage 1 (2, 3 alike)
``remat``  data=2 x tensor=2 under ``fpar.hf.remat``: the loss and every gradient
=========  ==================================================================================

Each is compared with the unsharded model run as ``transformers`` runs it (its own forward on
its own parameters; for ZeRO, AdamW's step on them).  A cell's outcome is ``equal``, ``refused``
(fpar raised its own error, naming the model, before any step: the message is kept), ``n/a``,
``transformers`` (the tiny model does not build or run in ``transformers`` itself: a limit of
the tiny config, not of fpar) or ``wrong`` (a value off, or an error that is not fpar's refusal:
a bug, shown as such).

    python tests/hf/family_table.py run [--only FAMILY ...]   # writes tests/hf/family_table.json
    python tests/hf/family_table.py render                    # the table into the docs page

``tests/hf/test_family_table.py`` checks that the page shows what the record renders, that the
record covers every family and layout, and reruns some cells against it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RECORD = HERE / "family_table.json"
PAGE = ROOT / "docs" / "hf-tensor-parallel.md"
BEGIN, END = "<!-- hf-family-table:begin -->", "<!-- hf-family-table:end -->"
LAYOUTS = {
    "tp": "TP",
    "sp": "TP+SP",
    "pp": "PP",
    "ep": "EP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "remat": "remat",
}
OUTCOMES = ("equal", "refused", "n/a", "transformers", "wrong")
# the loss to 1e-7 relative; each gradient to 1e-6 of its largest entry: many families compute norms,
# routers or linear attention in float32 inside the float64 model, whose rounding moves with the split
LOSS_RTOL, GRAD_REL = 1e-7, 1e-6
M = 2  # microbatches (pipeline) / batch halves


class Wrong(AssertionError):
    """A value that is not the unsharded model's."""


def _paths() -> None:
    for p in (str(HERE), str(HERE.parent)):
        if p not in sys.path:
            sys.path.insert(0, p)


def _ids(rows: int = 4):
    import torch

    return torch.randint(0, 64, (rows, 8), generator=torch.Generator().manual_seed(0))


def _close_loss(got, want, what: str) -> None:
    import torch

    # HF's own loss is float32 where the head is not vocabulary-split (Inkling's): 1e-6 there
    rtol = LOSS_RTOL if got.dtype == torch.float64 else 1e-6
    got, want = float(got), float(want)
    if not abs(got - want) <= rtol * abs(want):
        raise Wrong(f"{what}: loss {got!r} against the unsharded model's {want!r}")


def _close_tree(got: dict, want: dict, what: str, scale: dict | None = None) -> None:
    """Each tensor to ``GRAD_REL`` of its largest entry (of ``scale``'s, where given)."""
    import torch

    if set(got) != set(want):
        raise Wrong(f"{what}: names differ: {sorted(set(got) ^ set(want))[:4]}")
    for k, w in want.items():
        g = got[k]
        if g.shape != w.shape:
            raise Wrong(f"{what} {k}: shape {tuple(g.shape)} against {tuple(w.shape)}")
        atol = GRAD_REL * float((w if scale is None else scale[k]).abs().max()) + 1e-12
        if not torch.allclose(g.to(w.dtype), w, rtol=1e-5, atol=atol):
            err = float((g.to(w.dtype) - w).abs().max())
            raise Wrong(f"{what} {k}: off by {err:.3g} (largest entry {float(w.abs().max()):.3g})")


def _reference(model, ids):
    """The unsharded model's mean next-token loss over the batch's two halves, and its gradient."""
    import torch
    import tp_losses

    own = {k: p.detach() for k, p in model.named_parameters()}
    ref = tp_losses.reference_loss(model)
    halves = ids.chunk(M)

    def loss(p):
        return sum(ref(p, h) for h in halves) / M

    return own, loss(own), torch.func.grad(loss)(own)


def _hf_loss(apply_fn, mesh, axis: str):
    """HF's own ``labels=`` loss through ``apply_fn``, averaged over the batch's axis."""
    import fpar
    from fpar import P

    def per_device(params, ids):
        return fpar.pmean(apply_fn(params, ids, labels=ids, use_cache=False).loss, axis)

    return lambda specs: fpar.shard(per_device, mesh, (specs, P(axis)), P())


def _loss_and_grads(model, mesh, axis: str, prepare=None, **tp_kw) -> None:
    import torch

    import fpar

    ids = _ids()
    _, want_loss, want_grads = _reference(model, ids)
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh, **tp_kw)
    if prepare is not None:
        prepare(apply_fn)
    loss = _hf_loss(apply_fn, mesh, axis)(specs)
    grads, value = torch.func.grad_and_value(loss)(params, ids)
    _close_loss(value, want_loss, "the loss")
    _close_tree(apply_fn.export(grads), want_grads, "the gradient")


def _tp(model, family: str) -> None:
    import fpar

    _loss_and_grads(model, fpar.make_mesh((2, 2), ("data", "tensor")), "data")


def _remat(model, family: str) -> None:
    import fpar

    _loss_and_grads(model, fpar.make_mesh((2, 2), ("data", "tensor")), "data", prepare=fpar.hf.remat)


def _sp(model, family: str) -> None:
    """The family's plan with its layers' norms as HF's ``sequence_parallel`` (Megatron-SP)."""
    import hf_models

    import fpar

    mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
    _loss_and_grads(model, mesh, "data", plan=hf_models.sp_plan(model))


def _ep(model, family: str) -> None:
    import fpar

    if not getattr(type(model.config), "base_model_ep_plan", None):
        raise _NotApplicable("no base_model_ep_plan (a dense family)")
    _loss_and_grads(model, fpar.make_mesh((2, 2), ("expert", "tensor")), "expert", expert_axis="expert")


def _pp(model, family: str) -> None:
    import torch

    import fpar
    import fpar.pipeline as pp

    ids = torch.randint(0, 64, (M, 2, 5), generator=torch.Generator().manual_seed(1))
    xs, ys = ids[..., :-1], ids[..., 1:]
    import pp_families

    want_loss, want_grads = pp_families.reference(model, xs, ys)
    mesh = fpar.make_mesh((2, 2), ("pipe", "tensor"))
    apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
    stages = fpar.hf.pipeline_stages(apply_fn, specs, mesh)
    step = pp.pipeline(stages.stage, pp.one_f_one_b(2, M), mesh, loss=stages.loss, first=stages.first)
    result = step(stages.split(params), xs, ys)
    _close_loss(result.loss, want_loss, "the loss")
    _close_tree(apply_fn.export(stages.merge(result.grads)), want_grads, "the gradient")


def _zero(stage: int):
    def cell(model, family: str) -> None:
        import fpar
        import fpar.optim as fo

        mesh = fpar.make_mesh((2, 2), ("data", "tensor"))
        ids = _ids()
        own, _, want_grads = _reference(model, ids)
        opt = fo.adamw(1e-3, eps=1e-3, weight_decay=0.1)  # eps: a near-zero gradient's move stays small
        updates, _ = opt.update(want_grads, opt.init(own), own)
        want = fo.apply_updates(own, updates)
        apply_fn, params, specs = fpar.ops.tensor_parallel(model, mesh)
        layout = fo.zero_layout(params, mesh, specs, stage=stage)
        zparams, state = fo.zero_init(opt, params, layout)

        def loss(p, x):
            return sum(apply_fn(p, h, labels=h, use_cache=False).loss for h in x.chunk(M)) / M

        zparams, state, _ = fo.zero_step(loss, opt, layout)(zparams, state, ids)
        got = apply_fn.export(fo.zero_params(zparams, layout))
        # AdamW's first move is lr * g / (|g| + eps): a gradient's error moves it by at most lr / eps
        # times as much, so each move to GRAD_REL of its gradient's largest entry (lr / eps = 1)
        moved = {k: got[k] - own[k] for k in own}
        _close_tree(moved, {k: want[k] - own[k] for k in own}, "the step's move", scale=want_grads)

    return cell


CELLS = {
    "tp": _tp,
    "sp": _sp,
    "pp": _pp,
    "ep": _ep,
    "zero1": _zero(1),
    "zero2": _zero(2),
    "zero3": _zero(3),
    "remat": _remat,
}


class _NotApplicable(Exception):
    pass


def _first_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cell(family: str, layout: str) -> dict:
    """One cell's outcome: ``{"outcome": ..., "detail": ...}`` (see the module's docstring)."""
    _paths()
    import pp_families

    try:
        model, _ = pp_families.tiny(
            family, layers=pp_families.pipeline_layers(family) if layout == "pp" else 2
        )
        ids = _ids()
        _reference(model, ids)  # the model runs in transformers at all
    except Exception as e:  # noqa: BLE001 (transformers' own failure on the tiny sizes)
        return {"outcome": "transformers", "detail": f"{type(e).__name__}: {_first_line(e)}"}
    try:
        CELLS[layout](model, family)
    except _NotApplicable as e:
        return {"outcome": "n/a", "detail": str(e)}
    except Wrong as e:
        return {"outcome": "wrong", "detail": _first_line(e)}
    except (ValueError, TypeError) as e:
        if str(e).startswith("fpar."):  # fpar's own refusal, by name
            return {"outcome": "refused", "detail": _first_line(e)}
        return {"outcome": "wrong", "detail": f"{type(e).__name__}: {_first_line(e)}"}
    except Exception as e:  # noqa: BLE001 (anything else is a bug, recorded as one)
        return {"outcome": "wrong", "detail": f"{type(e).__name__}: {_first_line(e)}"}
    return {"outcome": "equal", "detail": ""}


def families() -> list[str]:
    _paths()
    import pp_families

    return list(pp_families.families())


def _class_name(family: str) -> str:
    _paths()
    import pp_families

    return pp_families.families()[family][1]


def _tied(family: str) -> bool:
    _paths()
    import pp_families

    structure, _ = pp_families.tiny(family, meta=True)
    return bool(getattr(structure.config, "tie_word_embeddings", False))


# -- the record -------------------------------------------------------------------------------------


def _commit() -> str:
    """HEAD, with ``+changes`` when fpar's sources differ from it (the cells ran other code)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--", "fpar") else "")


def load() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def run(only: list[str] | None = None, layouts: list[str] | None = None) -> dict:
    """Run the cells (every family, or ``only``) and merge them into the record; returns it."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # tiny configs trip token-id range warnings
    torch.set_num_threads(1)  # linear-attention families run torch's per-example vmap fallback
    record = load() if RECORD.exists() else {"families": {}}
    names = only or families()
    for family in names:
        cls = _class_name(family)
        try:
            tied = _tied(family)
        except Exception:  # noqa: BLE001 (does not build at all: every cell says so)
            tied = False
        row = record["families"].setdefault(family, {"class": cls, "tied": tied, "cells": {}})
        row.update({"class": cls, "tied": tied})
        for layout in layouts or list(LAYOUTS):
            start = time.perf_counter()
            row["cells"][layout] = cell(family, layout)
            got = row["cells"][layout]
            print(
                f"{family:24s} {layout:6s} {got['outcome']:12s} {time.perf_counter() - start:6.1f}s "
                f"{got['detail'][:90]}",
                flush=True,
            )
        _write(record)  # after each family: a long run that stops keeps what it ran
    return record


def _write(record: dict) -> None:
    import torch
    import transformers

    record["families"] = {k: record["families"][k] for k in sorted(record["families"])}
    record.update(
        transformers=transformers.__version__,
        torch=torch.__version__,
        commit=_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    )
    RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


# -- the rendering ----------------------------------------------------------------------------------


def _general(detail: str, cls: str) -> str:
    """A refusal's reason without the model's own names and sizes, so that one reason is one note.

    Its first sentence (up to 240 characters), the model, module and class names and the sizes of a
    shape error replaced by placeholders.
    """
    text = detail.replace(cls, "<model>")
    text = re.sub(r"'[\w.]*\.(\*|\d+)(\.[\w.*]+)?'|'lm_head'", "'<module>'", text)
    text = re.sub(r"\((?:[A-Z][A-Za-z0-9_]*)\)", "(<class>)", text)
    text = re.sub(r"\(\d+\)", "(n)", re.sub(r"dimension \d+", "dimension k", text))
    first = re.split(r"(?<=\.) (?=[A-Z])", text, maxsplit=1)[0]
    return first if len(first) <= 240 else first[:237] + "..."


def render_table(record: dict) -> str:
    notes: dict[str, int] = {}

    def note(text: str) -> int:
        return notes.setdefault(text, len(notes) + 1)

    head = "| family (class) | " + " | ".join(LAYOUTS.values()) + " |"
    lines = [head, "|" + "---|" * (len(LAYOUTS) + 1)]
    count = dict.fromkeys(LAYOUTS, 0)
    for family, row in record["families"].items():
        cells = []
        for layout in LAYOUTS:
            got = row["cells"][layout]
            outcome = got["outcome"]
            if outcome == "equal":
                count[layout] += 1
                cells.append("✓ tied" if layout == "pp" and row["tied"] else "✓")
            elif outcome == "n/a":
                cells.append("—")
            elif outcome == "transformers":
                cells.append(f"· [{note('transformers cannot run the tiny model: ' + got['detail'])}]")
            elif outcome == "refused":
                cells.append(f"✗ [{note(_general(got['detail'], row['class']))}]")
            else:
                cells.append(f"**wrong** [{note('WRONG: ' + got['detail'])}]")
        lines.append(f"| {family} (`{row['class']}`) | " + " | ".join(cells) + " |")
    total = len(record["families"])
    lines.append("| **equal** | " + " | ".join(f"**{count[k]}** of {total}" for k in LAYOUTS) + " |")
    lines.append("")
    lines.append(
        f"✓ equal to the unsharded model; ✗ refused by name before any step; — not applicable; "
        f"· the tiny model does not run in `transformers` itself. Run on {record['date']} (commit "
        f"{record['commit']}, transformers {record['transformers']}, torch {record['torch']}) by "
        f"`python tests/hf/family_table.py run`."
    )
    lines.append("")
    for text, n in notes.items():
        lines.append(f"{n}. {_md(text)}")
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def between_markers(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def render(page: Path = PAGE) -> None:
    text = page.read_text(encoding="utf-8")
    if between_markers(text) is None:
        raise SystemExit(f"{page} has no {BEGIN} / {END} markers")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    page.write_text(head + BEGIN + "\n" + render_table(load()) + "\n" + END + tail, encoding="utf-8")


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the cells into tests/hf/family_table.json")
    r.add_argument("--only", nargs="*", help="these families only (merged into the record)")
    r.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), help="these layouts only")
    sub.add_parser("render", help="the table into docs/hf-tensor-parallel.md")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.only, args.layouts)
    else:
        render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
