"""Published training runs, held against ``fpar.plan``'s prediction (docs/plan.md's table).

Each run: the model, the layout the paper reports, the hardware, and the figure it published
(TFLOP/s per GPU as the paper counts it).  ``bench/plan.py published`` estimates every run and
stores the predictions in ``bench/plan_published.json``; ``render`` makes the table from them
(``tests/plan/test_plan_scale.py`` checks the page shows that table, and re-derives a row from
the code).  Nothing here is fit: the hardware presets and the time model are the same for
every row.
"""

from __future__ import annotations

import dataclasses

from ._hardware import PRESETS, Hardware
from ._models import MODELS, Layout, Model

__all__ = ["BEGIN", "END", "RUNS", "Run", "predicted_tflops", "record", "render", "retimed"]

BEGIN, END = "<!-- plan-published:begin -->", "<!-- plan-published:end -->"

_MEGATRON = "Narayanan et al. 2021 (Megatron-LM), Table 1"
_LLAMA3 = "Llama 3 paper (Dubey et al. 2024), Table 4"
_TITAN = "torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Table 3 (FSDP, no torch.compile)"


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run: what it trained, how it was laid out, what it reached."""

    name: str
    model: Model
    layout: Layout
    hardware: str | Hardware
    published_tflops: float  # per GPU, as the paper counts it (tokens per second for "tokens")
    counts: str  # "executed": recomputation's FLOPs included (Megatron); "model": not (MFU); "tokens"
    source: str
    note: str = ""


# torchtitan's H100s, as its benchmark states them: 96 GB HBM2e at 2.4 TB/s, a 500 W power limit,
# a peak "between SXM and NVL" (989 and 835 TFLOP/s BF16 dense, NVIDIA's datasheets): the midpoint.
# Its memory: 96 GiB of HBM less what the driver keeps of the 80 GB H100's 80 GiB (0.82 GiB), an
# estimate (no published total_memory); the benchmark's own peaks reach 84.9 GiB on these parts.
_TITAN_H100 = dataclasses.replace(
    PRESETS["h100-sxm"],
    name="h100 96GB HBM2e 500W",
    flops={**PRESETS["h100-sxm"].flops, "bfloat16": 912e12, "float16": 912e12},
    memory_bytes=96 * 2**30 - (80 * 2**30 - PRESETS["h100-sxm"].memory_bytes),
    memory_bandwidth=2.4e12,
)


# Megatron-LM in 2021 materialised the attention scores: "two custom kernels to enable the fusion of
# scale, mask, and softmax (reduction) operations" (Narayanan et al. 2021, section 4.2), between two
# batched matmuls; FlashAttention came a year later.  The rows run eager attention, as it did.
def _megatron_2021(name: str) -> Model:
    return dataclasses.replace(MODELS[name], attention="eager")


def _llama3_layout(data: int, microbatches: int) -> Layout:
    """Llama 3 405B at 8K tokens as the paper's section 3.3.2 lays it out.

    16 stages of 8 one-layer chunks, tensor 8, its FSDP as ZeRO-3 with sharded gradients, no
    recomputation, 2,048 sequences a step.
    """
    return Layout(
        pipeline=16,
        data=data,
        tensor=8,
        zero=3,
        microbatches=microbatches,
        batch=2048,
        remat=False,
        virtual=8,
        reduce_once=False,
    )


RUNS = (
    Run(
        "Megatron GPT 1.7B, 32 A100",
        _megatron_2021("gpt-1.7b"),
        Layout(data=32, zero=0, microbatches=4, batch=512, remat=True, sequence_parallel=False),
        "a100-80g",
        137.0,
        "executed",
        _MEGATRON,
        "microbatch size not published: 4 assumed; eager attention (section 4.2)",
    ),
    Run(
        "Megatron GPT 18B, 256 A100",
        _megatron_2021("gpt-18b"),
        Layout(data=32, tensor=8, zero=0, microbatches=4, batch=1024, remat=True, sequence_parallel=False),
        "a100-80g",
        135.0,
        "executed",
        _MEGATRON,
        "microbatch size not published: 8 assumed; eager attention (section 4.2)",
    ),
    Run(
        "Megatron GPT 39B, 512 A100",
        _megatron_2021("gpt-39b"),
        Layout(
            pipeline=2,
            data=32,
            tensor=8,
            zero=0,
            microbatches=48,
            batch=1536,
            remat=True,
        ),
        "a100-80g",
        138.0,
        "executed",
        _MEGATRON,
        "microbatch size 1 assumed; 1F1B; eager attention (section 4.2); sequence parallel on (the same bytes as Megatron's "
        "all-reduces; the run had none: without it, 0.72, see below)",
    ),
    # Section 3.3.2 of the paper: no activation checkpointing at 8K tokens; one layer fewer on the
    # first and the last stage, "the first model chunk on the first stage has only the embedding":
    # one layer a chunk, so 126 layers + 2 empty slots = 16 stages x 8 chunks
    Run(
        "Llama 3 405B, 8,192 H100",
        MODELS["llama-405b"],
        _llama3_layout(data=64, microbatches=32),
        "h100-sxm",
        430.0,
        "model",
        _LLAMA3,
        "section 3.3.2: no recomputation, the first and last stage one layer fewer (the first chunk "
        "only the embedding, the last only the head: one layer a chunk, 8 chunks a stage); "
        "microbatch size 1 assumed; its FSDP as ZeRO-3 inside the pipeline (fpar.optim.zero_pipeline: "
        "a stage gathered in bf16 once a step, not resharded after forward; gradients sharded, as the "
        "paper's FSDP shards them: each chunk's reduce-scattered in fp32 as its backward ends and "
        "accumulated in fp32 as shards, reduce_once=False)",
    ),
    Run(
        "Llama 3 405B, 16,384 H100",
        MODELS["llama-405b"],
        _llama3_layout(data=128, microbatches=16),
        "h100-sxm",
        400.0,
        "model",
        _LLAMA3,
        "as above",
    ),
    Run(
        "torchtitan Llama 3.1 8B FSDP, 128 H100",
        MODELS["llama-8b"],
        Layout(data=128, zero=3, microbatches=1, batch=256, remat="alternate_dots"),
        _TITAN_H100,
        5605.0,
        "tokens",
        _TITAN,
        'FSDP = ZeRO-3; its selective activation checkpointing ("op": attention\'s and every other '
        "matmul's outputs kept) as fpar.optim.save_alternate_dots; H100 96 GB HBM2e at 500 W as "
        "stated (peak between SXM and NVL: 912 assumed)",
    ),
)


def predicted_tflops(est, counts: str, tokens_per_step: int = 0) -> float:
    """TFLOP/s per device of an estimate, counted as the paper counts them (tokens/s for "tokens")."""
    if counts == "tokens":
        return tokens_per_step / est.step_time / est.mesh.size
    flops = est.flops if counts == "executed" else est.model_flops
    return flops / est.step_time / est.mesh.size / 1e12


def record(est, run: Run) -> dict:
    """What the table and ``bench/plan_published.json`` keep of a run's estimate."""
    tokens = run.layout.batch * run.model.seq
    return {
        "predicted_tflops": predicted_tflops(est, run.counts, tokens),
        "step_time": est.step_time,
        "mfu": est.mfu,
        "hfu": est.hfu,
        "fits": est.fits,
        "peak_gib": est.peak_bytes / 2**30,
        "time_breakdown": est.time_breakdown,
        "losses": est.losses,
    }


def retimed(run: Run, trace: dict):
    """The run's estimate from its stored trace (``fpar.plan._trace``), timed by today's time model."""
    from ._hardware import hardware
    from ._models import pipeline_schedule
    from ._trace import load

    schedule = pipeline_schedule(run.layout) if run.layout.pipeline > 1 else None
    return load(trace, hardware(run.hardware), schedule)


def slug(run: Run) -> str:
    """The run's file name stem (its stored trace)."""
    return "".join(ch if ch.isalnum() or ch == "." else "_" for ch in run.name).strip("_")


def render(records: dict) -> str:
    """The docs table from ``{run name: {"predicted_tflops", "step_time", ...}}``."""
    lines = [
        "| run | layout | published per GPU | fpar.plan | ratio | step (s) | fpar's peak GiB | source |",
        "|---|---|---|---|---|---|---|---|",
    ]
    missing = [run.name for run in RUNS if run.name not in records]
    for run in RUNS:
        got = records.get(run.name)
        if got is None:
            continue
        pred = got["predicted_tflops"]
        lines.append(
            f"| {run.name} | {run.layout.describe()} | {_figure(run)} | "
            f"{pred:.0f} | {pred / run.published_tflops:.2f} | {got['step_time']:.2f} | "
            f"{got['peak_gib']:.0f}{'' if got['fits'] else f' (over {_memory_gib(run):.1f})'} | {run.source}; "
            f"{run.note} |"
        )
    if missing:
        lines += ["", "Not estimated yet (no record): " + "; ".join(missing) + "."]
    return "\n".join(lines)


def _figure(run: Run) -> str:
    if run.counts == "tokens":
        return f"{run.published_tflops:g} tokens/s"
    return f"{run.published_tflops:g} TFLOP/s ({run.counts})"


def _memory_gib(run: Run) -> float:
    from ._hardware import hardware

    return hardware(run.hardware).memory_bytes / 2**30
