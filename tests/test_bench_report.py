"""The performance table cannot be typed by hand: it is what ``bench/report.py render`` makes.

docs/performance.md holds the table between ``<!-- perf-table:begin -->`` and
``<!-- perf-table:end -->``, README.md its summary between ``<!-- perf-summary:begin -->`` and
``<!-- perf-summary:end -->``; each must equal the rendering of the committed ``bench/results/*.json``
(rerun the benchmarks with ``python bench/report.py run``, then ``python bench/report.py render``).
No benchmark runs here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
report = importlib.util.module_from_spec(_spec)
sys.modules["bench_report"] = report  # dataclasses look their module up
_spec.loader.exec_module(report)


def test_results_exist_and_every_job_has_a_record():
    names = {p.stem for p in (ROOT / "bench" / "results").glob("*.json")}
    missing = [job.name for job in report.JOBS if job.name not in names]
    assert not missing, f"no record for {missing}: python bench/report.py run --only {' '.join(missing)}"


@pytest.mark.parametrize("page", report.PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_table_is_the_rendered_one(page):
    shown = report.between_markers(page.read_text(encoding="utf-8"))
    assert shown is not None, f"{page} has no {report.BEGIN} / {report.END} markers"
    assert shown == report.render_table(report.load_records()), (
        f"{page.relative_to(ROOT)}'s performance table is not the one bench/results/*.json renders: "
        "python bench/report.py render (never edit the table by hand)"
    )


@pytest.mark.parametrize("page", report.SUMMARY_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_summary_is_the_rendered_one(page):
    begin, end = report.SUMMARY_BEGIN, report.SUMMARY_END
    shown = report.between_markers(page.read_text(encoding="utf-8"), begin, end)
    assert shown is not None, f"{page} has no {begin} / {end} markers"
    assert shown == report.render_summary(report.load_records()), (
        f"{page.relative_to(ROOT)}'s performance summary is not the one bench/results/*.json renders: "
        "python bench/report.py render (never edit it by hand)"
    )


def test_every_summary_line_names_a_job_and_comparisons_its_record_has():
    records = {r["job"]: r for r in report.load_records()}
    for line in report.SUMMARY:
        assert report._job(line.job) is not None, line
        ids = {c["id"] for c in records[line.job].get("comparisons", ())}
        for cid in (line.time, line.memory):
            assert cid is None or cid in ids, (line, ids)


def _pair(name, med, lo, base_name, base_med, base_lo):
    return {
        "side": {"name": name, "median_ms": med, "min_ms": lo, "repeats": 5},
        "baseline": {"name": base_name, "median_ms": base_med, "min_ms": base_lo, "repeats": 5},
        "ratio": med / base_med,
        "min_ratio": lo / base_lo,
    }


def test_no_target_the_committed_records_miss_is_a_silent_not_met():
    """Every verdict of the table is met, not checkable on this machine, or carries its measured reason."""
    checked = 0
    for record in report.load_records():
        job = report._job(record["job"])
        if job is None or "comparisons" not in record:
            continue
        for comp in record["comparisons"]:
            target = job.targets.get(comp["id"])
            if target is None or target.elsewhere:
                continue
            verdict = target.verdicts([p["ratio"] for p in comp["pairs"]], record)
            checked += 1
            if "not met" in verdict:
                assert target.why and verdict.endswith(f"({target.why})"), (job.name, comp["id"], verdict)
    assert checked >= len(report.JOBS)  # (not an empty loop)


def test_render_of_a_synthetic_record(tmp_path):
    job = next(j for j in report.JOBS if j.name == "data_parallel")
    fg, bw, ddp = 31.25, 27.5, 29.0
    mem_f, mem_d = 40.0, 60.0
    record = {
        "benchmark": "data_parallel",
        "command": "python bench/data_parallel.py --repeats 5",
        "config": {"repeats": 5},
        "date": "2030-01-02T03:04:05Z",
        "machine": {"platform": "Plan9-x", "cpu_count": 7, "torch": "9.9.9", "commit": "abc1234"},
        "load_before": [1.25, 0, 0],
        "load_after": [3.5, 0, 0],
        "comparisons": [
            {
                "id": "step",
                "step": "a setup: a step | with a bar",
                "unit": "ms",
                "pairs": [
                    _pair("f", fg, fg - 1, "DDP", ddp, ddp - 1),
                    _pair("b", bw, bw - 1, "DDP", ddp, ddp - 1),
                ],
            },
            {
                "id": "floor",
                "step": "a setup: the floor",
                "unit": "ms",
                "pairs": [_pair("floor", bw, bw, "DDP", ddp, ddp)],
            },
            {
                "id": "memory",
                "step": "memory",
                "unit": "MiB",
                "pairs": [
                    {
                        "side": {"name": "f", "peak_mib": mem_f},
                        "baseline": {"name": "DDP", "peak_mib": mem_d},
                        "ratio": mem_f / mem_d,
                    }
                ],
            },
        ],
        "job": "data_parallel",
        "quick": True,
    }
    failed = {
        "job": "zero",
        "command": "python bench/zero.py",
        "error": "timed out after 9 s",
        "quick": True,
        "date": "2030-01-02T05:00:00Z",
        "load_before": [0.5, 0, 0],
        "load_after": [4.0, 0, 0],
    }
    skipped = {
        "job": "pipeline_4",
        "command": "python bench/pipeline.py --stages 4",
        "skipped": "too slow",
        "quick": True,
        "date": "2030-01-02T05:00:00Z",
        "load_before": [9.0, 0, 0],
    }
    for r in (record, failed, skipped):
        (tmp_path / f"{r['job']}.json").write_text(json.dumps(r), encoding="utf-8")

    records = report.load_records(tmp_path)
    assert [r["job"] for r in records] == ["data_parallel", "zero", "pipeline_4"]  # JOBS' order
    text = report.render_table(records)
    assert text.startswith("\n") and text.endswith("|\n\n")  # blank lines around it
    head, *lines = text.strip("\n").splitlines()
    lines = lines[1:]  # after the blank line: the table
    assert lines[0] == "| benchmark | step / config | fpar | baseline | ratio | target |"

    step_target = job.targets["step"]
    verdicts = ["met" if step_target.met(r) else "not met" for r in (fg / ddp, bw / ddp)]
    assert verdicts == ["not met", "met"]  # so the step's cell carries the target's measured reason
    why = f" ({step_target.why})"
    want_step = (
        f"| `{job.title}` | a setup: a step \\| with a bar | {fg:.1f} / {bw:.1f} ms | {ddp:.1f} ms | "
        f"{fg / ddp:.2f} / {bw / ddp:.2f}× | ≤ {step_target.value:.1f}: {' / '.join(verdicts)}{why} |"
    )
    assert lines[2] == want_step
    assert (
        lines[3]
        == f"| `{job.title}` | the same: the floor | {bw:.1f} ms | {ddp:.1f} ms | {bw / ddp:.2f}× | (a reference) |"
    )
    mem_target = job.targets["memory"]
    assert lines[4] == (
        f"| `{job.title}` | memory | {mem_f:.1f} MiB | {mem_d:.1f} MiB | {mem_f / mem_d:.2f}× | "
        f"≤ {mem_target.value:.1f}: {'met' if mem_target.met(mem_f / mem_d) else 'not met'} |"
    )
    assert "**failed**: timed out after 9 s" in lines[5] and lines[5].startswith("| `zero.py` |")
    assert "skipped under `--quick`: too slow" in lines[6]
    # the machine line: the ran records' machine, dates, the load average's range (not the skipped job's)
    assert "Plan9-x" in head and "7 CPUs" in head and "torch 9.9.9" in head and "abc1234" in head
    assert "2030-01-02" in head and "--quick" in head
    assert f"{min(1.25, 0.5):.1f}–{max(3.5, 4.0):.1f}" in head and "9.0" not in head

    # render writes between the markers of a page and leaves the rest alone; --check then passes
    page = tmp_path / "page.md"
    page.write_text(f"before\n{report.BEGIN}\nold table\n{report.END}\nafter\n", encoding="utf-8")
    assert report.render(results=tmp_path, pages=[page], summary_pages=[]) == [page]
    assert page.read_text(encoding="utf-8") == f"before\n{report.BEGIN}\n{text}{report.END}\nafter\n"
    assert report.render(check=True, results=tmp_path, pages=[page], summary_pages=[]) == []

    # the summary: the data_parallel line's time and memory ratios and verdicts, the others' status
    summary = report.render_summary(records)
    assert summary.startswith("\n") and summary.endswith("|\n\n")
    rows = {r.split(" | ")[1]: r for r in summary.strip("\n").splitlines() if r.startswith("| ")}
    dp_line = next(line for line in report.SUMMARY if line.job == "data_parallel")
    zero_line = next(line for line in report.SUMMARY if line.job == "zero")
    assert rows[dp_line.what] == (
        f"| {dp_line.against} | {dp_line.what} | {fg / ddp:.2f} / {bw / ddp:.2f}× | {mem_f / mem_d:.2f}× | "
        f"time ≤ {step_target.value:.1f}: {' / '.join(verdicts)}{why}; "
        f"memory ≤ {mem_target.value:.1f}: {'met' if mem_target.met(mem_f / mem_d) else 'not met'} |"
    )
    assert rows[zero_line.what] == f"| {zero_line.against} | {zero_line.what} | **failed** | – | – |"
    assert "| no record | – | – |" in rows[next(x for x in report.SUMMARY if x.job == "tp_dtensor").what]
    assert "2030-01-02" in summary and "7 CPUs" in summary and "torch 9.9.9" in summary

    # a summary line naming a comparison its record lacks is an error, not an empty cell
    record["comparisons"] = record["comparisons"][1:]
    (tmp_path / "data_parallel.json").write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(SystemExit, match="data_parallel's record has no comparison 'step'"):
        report.render_summary(report.load_records(tmp_path))


def _record(job, comparisons):
    return {"job": job, "command": f"python bench/{job}.py", "comparisons": comparisons}


def _comp(id, ratios):
    pairs = [_pair(f"s{i}", r, r, "b", 1.0, 1.0) for i, r in enumerate(ratios)]
    return {"id": id, "step": id, "unit": "ms", "pairs": pairs}


def test_a_relative_target_is_bounded_by_its_reference_and_a_gpu_target_says_it_is_not_checked():
    T = report.Target
    rel = T("<=", 1.05, "plain torch's own", relative="torch")
    record = _record("compile", [_comp("torch", [0.9]), _comp("whole", [0.94, 0.95])])
    # the bound is 1.05 x 0.9 = 0.945: the first pair meets it, the second does not
    assert rel.verdicts([0.94, 0.95], record) == "≤ 1.05 × 0.90 (plain torch's own): met / not met"
    assert rel.verdicts([0.5], _record("compile", [_comp("torch", [0.2])])) == (
        "≤ 1.05 × 0.20 (plain torch's own): not met"
    )
    with pytest.raises(SystemExit, match="compile's record has no comparison 'torch'"):
        rel.verdicts([0.5], _record("compile", [_comp("whole", [0.5])]))
    gpu = T("<", 0.95, elsewhere="a GPU target")
    assert gpu.verdicts([1.0], record) == "< 0.95: not checkable on this machine, a GPU target"
    # a missed target carries its measured reason; a met one does not
    why = T("<=", 1.0, why="the reason, measured")
    assert why.verdicts([1.2, 0.9], record) == "≤ 1.0: not met / met (the reason, measured)"
    assert why.verdicts([0.9], record) == "≤ 1.0: met"
    # every target of JOBS that names a reference names one its job's committed record has
    records = {r["job"]: r for r in report.load_records()}
    for job in report.JOBS:
        for target in job.targets.values():
            if target is not None and target.relative:
                ids = {c["id"] for c in records[job.name]["comparisons"]}
                assert target.relative in ids, (job.name, target.relative)


@pytest.mark.parametrize("load, marked", [(3.9, False), (4.1, True)])
def test_a_run_under_more_load_than_twice_the_cpus_is_marked_in_the_table_and_the_summary(load, marked):
    record = _record("data_parallel", [_comp("step", [1.2]), _comp("memory", [0.5])])
    record.update(machine={"cpu_count": 2}, load_before=[1.0, 0, 0], load_after=[load, 0, 0])
    mark = f"; run under load {load:.1f} (> 2 x 2 CPUs): rerun on a quiet machine"
    rows = report.table_rows(record)
    summary = report.summary_rows([record])
    dp_line = next(r for r in summary if "data-parallel MLP step, D=512" in r)
    assert [r.endswith(f"{mark} |") for r in [*rows, dp_line]] == [marked] * 3
    why = f"not met ({report.PER_CALL})"
    assert rows[0].endswith((f"{why} |", f"{why}{mark} |"))  # the verdict itself stays
