"""Real mesh == in-process mesh for pipelines: one launch of 4 gloo processes runs a sample of jobs.

The jobs (``dist_workers.py``) run the executor for every schedule with tensor and data
parallelism inside the stages (pipe x data x tensor = 2 x 1 x 2 and 2 x 2 x 1; the V-shaped
ZB-V and DualPipeV too; a compiled stage function under ZB-H1), a pure
4-stage pipeline, ``gpipe_scan`` on pipe x tensor, and ZeRO-2/3 inside pipelines
(``fpar.optim.zero_pipeline``); each is also run in this process on the in-process mesh, and
every rank's loss, gathered gradients and measured stats must equal those.
"""

from __future__ import annotations

import dist_workers as W
import pipe_models as M
import pytest
import torch

import fpar
from fpar._tree import tree_flatten

pytestmark = pytest.mark.multiprocess

PDT = (("pipe", 2), ("data", 1), ("tensor", 2))
PDT2 = (("pipe", 2), ("data", 2), ("tensor", 1))
PIPE4 = (("pipe", 4),)
PT = (("pipe", 2), ("tensor", 2))
DT = (("pipe", 1), ("data", 2), ("tensor", 2))

JOBS = [
    ("exec_job", (PDT, "1f1b", 2, 4, 1)),
    ("exec_job", (PDT, "interleaved", 2, 4, 2)),
    ("exec_job", (PDT, "zb_h1", 2, 3, 1)),
    ("exec_job", (PDT2, "gpipe", 2, 3, 1)),
    ("exec_job", (PDT2, "zb_h1", 2, 2, 1)),
    ("exec_job", (PDT, "zb_v", 2, 4, 2)),
    ("exec_job", (PDT2, "dualpipe_v", 2, 4, 2)),
    # DualPipeV with a recomputed stage over data=2: its microbatches' data sums are deferred and
    # the recomputation calls the sharded stage again inside the backward, which an earlier check
    # for unclaimed deferred sums took for an unmatched call (issue 53); against the eager stage
    ("exec_job", (PDT2, "dualpipe_v", 2, 4, 2, "cpu", 4, False, True)),
    ("exec_job", (PIPE4, "1f1b", 4, 4, 1)),
    ("exec_job", (PIPE4, "interleaved", 4, 4, 2)),
    ("exec_job", (PDT, "zb_h1", 2, 3, 1, "cpu", 4, True)),  # a torch.compile'd stage function
    ("scan_job", (PT, 2, 3, 1)),
    ("scan_job", (PT, 2, 2, 2)),
    # fpar.optim.zero_pipeline: ZeRO-2 and ZeRO-3 inside the pipeline (a data axis of 2); with p=1
    # and a tensor axis, the embedding's and head's gradients are summed over tensor after the
    # reduce-scatter (they are replicated over it)
    ("zero_pipeline_job", (PDT2, "1f1b", 2, 4, 1, 2)),
    ("zero_pipeline_job", (PDT2, "interleaved", 2, 4, 2, 3)),
    ("zero_pipeline_job", (DT, "gpipe", 1, 2, 1, 3)),
    # the embedding's and head's sums are over tensor on the stage that uses them, and absent on
    # the other: the ranks agree on the axes before the reduce-scatter
    ("zero_pipeline_job", (PDT, "1f1b", 2, 4, 1, 3)),
    # reduce_once=False: each chunk's gradient summed onto its owners as its backward ends
    ("zero_pipeline_job", (PDT2, "1f1b", 2, 4, 1, 2, False)),
    ("zero_pipeline_job", (PDT2, "interleaved", 2, 4, 2, 3, False)),
    ("zero_pipeline_job", (PDT2, "zb_h1", 2, 2, 1, 3, False)),
    ("zero_pipeline_job", (DT, "gpipe", 1, 2, 1, 3, False)),
    # a data axis of one rank: a sum only over tensor (a sequence-parallel norm) has no data sum to
    # take (it was refused, mid-step, as a stage function not replicated over data)
    ("zero_pipeline_job", (PDT, "1f1b", 2, 4, 1, 3, False)),
    # reshard_after_forward=True: each chunk gathered for its own forward and backward, freed after
    ("zero_pipeline_job", (PDT2, "interleaved", 2, 4, 2, 3, True, True)),
    ("zero_pipeline_job", (PDT2, "interleaved", 2, 4, 2, 3, False, True)),
    ("zero_pipeline_job", (PDT2, "zb_h1", 2, 2, 1, 3, True, True)),
    # DualPipeV puts the first and the last chunk on stage 0: ZeRO-3 gathers the embedding and the
    # head there, neither on stage 1 (each is gathered only where it is read)
    ("zero_pipeline_job", (PDT2, "dualpipe_v", 2, 4, 2, 3)),
    # chunks of stacked layers: each layer's gradient goes into the deferred sum as its backward
    # ends (fpar/pipeline/_unstack.py), whether the layers are taken by unbind, w[i] or select
    ("rows_job", (PDT2, "1f1b", 2, 4, 1, "unbind")),
    ("rows_job", (PDT2, "interleaved", 2, 4, 2, "index")),
    ("rows_job", (PDT2, "gpipe", 2, 3, 1, "select")),
]


@pytest.fixture(scope="module")
def launched():
    return fpar.launch(W.run_jobs, 4, JOBS, timeout=60.0)


def _ids():
    return [
        f"{kind}-{'x'.join(str(s) for _, s in args[0])}-{'-'.join(map(str, args[1:]))}" for kind, args in JOBS
    ]


@pytest.mark.parametrize("index", range(len(JOBS)), ids=_ids())
def test_real_mesh_equals_in_process(launched, index):
    kind, args = JOBS[index]
    expected = getattr(W, kind)(*args[:7])  # a compiled stage: against the eager in-process step
    for rank, results in enumerate(launched):
        status, got = results[index]
        assert status == "ok", f"rank {rank}:\n{got}"
        _compare(got, expected, f"{kind}{args} rank {rank}")


def _compare(got, expected, where):
    assert set(got) == set(expected), where
    for key, e in expected.items():
        g = got[key]
        if key in ("first", "last") and g is None:
            continue  # this rank's stage does not hold that part of the model
        if key in ("data_ops", "scatters", "gathers"):
            continue  # what a real mesh sends (the in-process mesh sends nothing)
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(g, e, msg=lambda msg, k=key: f"{where} {k}: {msg}")
        elif isinstance(e, dict):
            for k in e:
                torch.testing.assert_close(g[k], e[k], msg=lambda msg, k=f"{key}.{k}": f"{where} {k}: {msg}")
        else:
            assert g == e, f"{where} {key}: {g} != {e}"


# torch.compile(stage) traces the sharded call whole (in-process, once an eager call checked its
# signature); Dynamo reads tensors' .grad while tracing, which torch warns about (not fpar)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_a_compiled_stage_function_in_process_equals_the_eager_one():
    eager = W.exec_job(PDT, "zb_h1", 2, 3, 1)
    compiled = W.exec_job(PDT, "zb_h1", 2, 3, 1, "cpu", 4, True)
    _compare(compiled, eager, "compiled stage, in-process")


def test_in_process_jobs_match_the_unpipelined_model():
    """The in-process side of the comparison is itself right (so the comparison means something)."""
    for kind, args in JOBS[:2]:
        res = getattr(W, kind)(*args)
        p, m, v = args[2:] if kind == "exec_job" else args[1:]
        loss, g_stages, _, _ = M.reference_grads(M.problem(p, m, v))
        torch.testing.assert_close(res["loss"], loss)
        import fpar.pipeline as pp

        torch.testing.assert_close(res["stages"], pp.stage_major(g_stages, p, v))


@pytest.mark.multiprocess
def test_ranks_running_different_steps_raise_on_every_rank():
    """A rank with another schedule, or another number of microbatches, would post sends and
    receives the others do not pair: before the check, a hang until the timeout (schedule) or a
    gloo abort (microbatches); a rank whose own argument check fails tells the others, which name
    it. Every rank raises naming what differs, then a correct step works."""
    got = fpar.launch(W.run_jobs, 2, [("mismatch_job", ())], timeout=60.0)
    expected = W.exec_job((("pipe", 2),), "1f1b", 2, 4, 1)  # in-process
    for rank, [(status, res)] in enumerate(got):
        assert status == "ok", f"rank {rank}:\n{res}"
        assert res["schedule"] is not None and res["microbatches"] is not None, res
        for case in ("schedule", "microbatches"):
            assert "fpar.pipeline.pipeline: step: the ranks run different steps" in res[case], res[case]
        assert "schedule (rank 0: 1F1B (p=2, m=4, v=1, actions #" in res["schedule"], res["schedule"]
        assert "rank 1: GPipe (p=2, m=4, v=1" in res["schedule"], res["schedule"]
        assert "xs (rank 0: (4, 4) int64; rank 1: (2, 4) int64)" in res["microbatches"], res["microbatches"]
        kind, message = res["one_rank_raises"]  # rank 1's own check, then rank 0 names it
        if rank == 1:
            assert (
                kind == "ValueError"
                and "xs must be the 4 microbatches stacked on dim 0, got (3, 4)" in message
            )
        else:
            assert kind == "RuntimeError", message
            assert "1 of the 2 ranks raised before the step's first message (global rank 1)" in message
        _compare(res["after"], expected, f"after the errors, rank {rank}")


@pytest.mark.multiprocess
def test_input_gradients_leave_before_the_weight_gradients_are_computed():
    """A BW's input gradient is posted as soon as B has it (the upstream stage waits on it, not
    on this stage's W): every BW with a stage upstream sends early; the first stage has none."""
    jobs = [("early_sends", ("1f1b", 2, 4, 1)), ("early_sends", ("interleaved", 2, 4, 2))]
    got = fpar.launch(W.run_jobs, 2, jobs, timeout=60.0)
    (r0_1f1b, r0_inter), (r1_1f1b, r1_inter) = [[res for _, res in ranks] for ranks in got]
    assert (r0_1f1b, r1_1f1b) == (0, 4)  # stage 1's 4 BWs; stage 0 is virtual stage 0
    assert (r0_inter, r1_inter) == (4, 8)  # stage 0's chunk 1 has stage 1 upstream


@pytest.mark.multiprocess
@pytest.mark.parametrize("args", [("interleaved", 2, 4, 2), ("zb_h1", 2, 4, 1)], ids=["interleaved", "zb_h1"])
def test_kept_gradient_rows_never_overwrite_held_gradients(args):
    """W writes into stacked gradient rows kept between steps (two chunks per rank, or one).
    A step's gradients the caller still holds stay intact through the next step; once dropped,
    their buffers are reused; every step's gradients equal the in-process pipeline's."""
    expected = W.held_rows(*args)  # in-process: fresh tensors every step
    got = fpar.launch(W.run_jobs, 2, [("held_rows", args)], timeout=60.0)
    # the two steps' gradients differ, so an overwrite would show
    pairs = zip(tree_flatten(expected["first"])[0], tree_flatten(expected["second"])[0])
    assert all(not torch.equal(a, b) for a, b in pairs)
    for rank, [(status, res)] in enumerate(got):
        assert status == "ok", f"rank {rank}:\n{res}"
        assert res["intact"] and res["reused"], (rank, res["intact"], res["reused"])
        for k in ("first", "second", "third"):
            _compare({k: res[k]}, {k: expected[k]}, f"held_rows rank {rank}")


@pytest.mark.multiprocess
def test_batched_p2p_of_coalescing_backends_equals_in_process():
    """On NCCL each tick's sends and receives go as one ``batch_isend_irecv`` (one group call:
    posted one by one, neighbours that both send first can deadlock on large messages).  Here
    on gloo, with the backend made to look coalescing and the batch to return one handle as
    NCCL's does: every schedule's step equals the in-process one, and batches that carry both
    directions were posted."""
    jobs = [("batched_job", ((("pipe", 2),), name, 2, 4, v)) for name, v in (("1f1b", 1), ("zb_v", 2))]
    got = fpar.launch(W.run_jobs, 2, jobs, timeout=60.0)
    for (kind, args), *ranks in zip(jobs, *got):
        expected = W.exec_job(*args)
        for rank, (status, res) in enumerate(ranks):
            assert status == "ok", f"rank {rank}:\n{res}"
            assert res.pop("crossing") > 0, (args, rank)
            _compare(res, expected, f"{kind}{args} rank {rank}")


PIPE2, PD = (("pipe", 2),), (("pipe", 2), ("data", 1))


def _equal(got: dict, expected: dict, where: str) -> None:
    """Loss and every gradient bit for bit (``first``/``last`` where this rank holds them)."""
    for key in ("loss", "stages", "first", "last"):
        g, e = got[key], expected[key]
        if g is None or e is None:
            continue
        for a, b in zip(tree_flatten(g)[0], tree_flatten(e)[0]):
            assert torch.equal(a, b), f"{where}: {key} differs"


def test_a_stage_casts_its_weights_to_bfloat16_once_a_step_in_process():
    """A stage function that casts float32 masters (``w.to(torch.bfloat16)``) gets the step's one
    cast, shared by every microbatch in flight: GPipe's 4 microbatches on each of 2 stages held 4
    copies of their chunk's bfloat16 weights, now 1 (less the embedding table's cast, which indexing
    does not save: shared, it is held for the step); values and gradients bit for bit those of a
    cast per microbatch."""
    shared = W.cast_job(PIPE2, "gpipe", 2, 4, 1, True)
    own = W.cast_job(PIPE2, "gpipe", 2, 4, 1, False)
    _equal(shared, own, "shared casts, in-process")
    saved = own["forward_peak"] - shared["forward_peak"]
    assert saved == 2 * 3 * shared["cast_bytes"] - shared["table_bytes"]
    assert own["peak"] > shared["peak"]
    inter = (W.cast_job(PIPE2, "interleaved", 2, 4, 2, s) for s in (True, False))
    _equal(*inter, "shared casts, interleaved, in-process")


@pytest.mark.multiprocess
def test_a_stage_casts_its_weights_to_bfloat16_once_a_step_on_the_real_mesh():
    """The same on 2 gloo processes, the stage functions shards over a data axis: each stage holds 3
    copies of its chunk's bfloat16 weights fewer under GPipe with 4 microbatches; values bit for bit
    a cast per microbatch's, and the in-process mesh's.

    And a stage holds a chunk's output only until its send is done: a forward's output is sent
    at the next tick and waited for at the one after, so at GPipe's fourth forward stage 0 holds
    that output, the third (to send) and the second (being sent), not the first too (the last
    stage sends none)."""
    jobs = [
        ("cast_job", (PD, name, 2, 4, v, s))
        for name, v in (("gpipe", 1), ("interleaved", 2))
        for s in (True, False)
    ] + [("cast_job", (PD, "gpipe", 2, 4, 1, True, False))]
    got = fpar.launch(W.run_jobs, 2, jobs, timeout=120.0)
    for rank, results in enumerate(got):
        assert all(status == "ok" for status, _ in results), f"rank {rank}:\n{results}"
        (_, shared), (_, own), (_, inter_shared), (_, inter_own), (_, kept) = results
        _equal(shared, kept, f"rank {rank}, outputs kept")
        released = kept["forward_peak"] - shared["forward_peak"]
        assert released == (shared["out_bytes"] if rank == 0 else 0), (rank, released)
        _equal(shared, own, f"rank {rank}, gpipe")
        _equal(inter_shared, inter_own, f"rank {rank}, interleaved")
        saved = own["forward_peak"] - shared["forward_peak"]
        assert saved == 3 * shared["cast_bytes"] - shared["table_bytes"], (rank, saved)
        assert own["peak"] > shared["peak"], rank
        _compare(
            {k: shared[k] for k in ("loss", "stages", "first", "last")},
            {
                k: v
                for k, v in W.cast_job(PIPE2, "gpipe", 2, 4, 1, True).items()
                if k in ("loss", "stages", "first", "last")
            },
            f"real mesh rank {rank} against in-process",
        )


def test_zero_inside_a_pipeline_reduce_scatters_what_the_pipeline_all_reduces(launched):
    """ZeRO-2/3 in a pipeline: every rank's gradient chunks are bit for bit the chunks of the plain
    pipeline's all-reduced gradients (2 data ranks: one addition either way), on the real mesh and
    in-process, and the loss is the plain step's; on the real mesh the data axis carries
    reduce-scatters (and ZeRO-3's gathers), no all-reduce.  With ``reduce_once=False`` each
    microbatch's sums are added in another order (equal to rounding), each chunk's backward of
    each microbatch reducing its leaves: more reductions than one a bucket a step.  With
    ``reshard_after_forward=True`` each chunk is gathered for its own forward and backward: the
    same values, bit for bit where the sums' order is the same, and with several chunks a stage
    at least one gather a chunk and microbatch where the stage is gathered once a step (with one,
    every action is the chunk's: it stays gathered)."""
    once, gathers = {}, {}
    for index, (kind, args) in enumerate(JOBS):
        if kind != "zero_pipeline_job":
            continue
        results = [ranks[index] for ranks in launched] + [("ok", W.zero_pipeline_job(*args))]
        each = len(args) > 6 and args[6] is False
        single = dict(args[0])["data"] == 1  # reduced as chunks end over one rank: nothing sent
        reshard = len(args) > 7 and args[7]
        for where, (status, got) in enumerate(results):
            assert status == "ok", f"{args} rank {where}:\n{got}"
            assert torch.equal(got["loss"], got["plain_loss"]), (args, where)
            pairs = list(zip(tree_flatten(got["chunks"])[0], tree_flatten(got["plain_chunks"])[0]))
            if each:
                for a, b in pairs:
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
                if where < len(launched) and args[0] != DT and not single:
                    m, v = args[3], args[4]
                    assert got["scatters"] >= m * v, (args, where, got["scatters"])
                    assert got["scatters"] > once.get(args[:6], 0), (args, where, got["scatters"])
            else:
                assert all(torch.equal(a, b) for a, b in pairs), (args, where)
                if where == 0:
                    once[args] = got["scatters"]
            if where < len(launched) and args[0] != DT and args[5] == 3:
                if reshard and args[4] > 1:
                    m, v = args[3], args[4]
                    assert got["gathers"] >= m * v > gathers[args[:6]], (args, where, got["gathers"])
                elif reshard:  # one chunk a stage: every action is the chunk's; gathered once
                    assert got["gathers"] == gathers[args[:6]], (args, where, got["gathers"])
                else:
                    gathers.setdefault(args[:6], got["gathers"])
            if where < len(launched) and args[0] != DT and not (each and single):
                # the real mesh: gradients reduce-scattered, none all-reduced (and the loss's pmean;
                # ZeRO-3 gathers its parameters).  Not on DT: there the block's residual uses its
                # input both beside the tensor-split weights and plainly, so its sharded call stays
                # traced and sums the weights' gradients where they are used, each microbatch
                # (tracker.py); zero_pipeline then takes its chunk of those sums, as checked above
                ops = got["data_ops"]
                assert "psum" not in ops, (args, where, ops)
                # over one data rank a stage may send none: what its sums did not reduce already
                # is a leaf it never read, whose zero sum it does not send
                assert "psum_scatter" in ops or single, (args, where, ops)
                assert ("all_gather_invariant" in ops) == (args[5] == 3), (args, where, ops)


def test_stacked_layers_give_the_unpipelined_gradients(launched):
    """A chunk of stacked layers on the real mesh (each layer's gradient added into the deferred
    sum as its backward ends): the unpipelined model's loss and gradients, unused layers' zero; and
    ZeRO-2 in the pipeline gives bit for bit the chunks of the plain pipeline's gradients."""
    for index, (kind, args) in enumerate(JOBS):
        if kind != "rows_job":
            continue
        for rank, ranks in enumerate(launched):
            status, got = ranks[index]
            assert status == "ok", f"{args} rank {rank}:\n{got}"
            torch.testing.assert_close(got["loss"], got["ref_loss"])
            for k in ("a", "b"):
                torch.testing.assert_close(
                    got["stages"][k], got["ref_stages"][k], msg=lambda m, k=k, a=args: f"{a} {k}: {m}"
                )
            if args[-1] == "index":
                assert not got["stages"]["a"][:, 1].any() and got["ref_stages"]["a"][:, 1].abs().sum() == 0
            pairs = list(zip(tree_flatten(got["chunks"])[0], tree_flatten(got["plain_chunks"])[0]))
            if args[-1] == "select":
                # w["b"] used whole too: the last microbatch of the plain step adds the whole use's
                # gradient to the rows' before its sum, ZeRO's each into the sum: another rounding
                for a, b in pairs:
                    torch.testing.assert_close(a, b)
            else:
                assert all(torch.equal(a, b) for a, b in pairs), (args, rank)


def test_zero_pipeline_refuses_what_it_cannot_run():
    import fpar.optim as fo

    mesh = W.mesh_for(PDT2)
    fns = M.stage_fns(mesh)
    prob = M.problem(2, 2, 1)
    params = {"stages": prob["stages"], "first": prob["first"], "last": prob["last"]}
    specs = {"stages": M.stage_spec(mesh), "first": {"emb": fpar.P()}, "last": {"head": fpar.P()}}
    step = fpar.pipeline.pipeline(
        fns["stage"], M.schedule("1f1b", 2, 2), mesh, loss=fns["loss"], first=fns["first"]
    )
    with pytest.raises(ValueError, match="layout has stage 1; a pipeline takes ZeRO stage 2 or 3 here"):
        fo.zero_pipeline(step, fo.zero_layout(params, mesh, specs, stage=1))
    with pytest.raises(TypeError, match="step must come from fpar.pipeline.pipeline, got function"):
        fo.zero_pipeline(lambda *a: None, fo.zero_layout(params, mesh, specs, stage=2))
    with pytest.raises(TypeError, match="reduce_once must be True or False, got None"):
        fo.zero_pipeline(step, fo.zero_layout(params, mesh, specs, stage=2), reduce_once=None)
    with pytest.raises(TypeError, match="reshard_after_forward must be True or False, got 1"):
        fo.zero_pipeline(step, fo.zero_layout(params, mesh, specs, stage=3), reshard_after_forward=1)
    with pytest.raises(ValueError, match="reshard_after_forward=True is for ZeRO-3; stage 2 keeps whole"):
        fo.zero_pipeline(step, fo.zero_layout(params, mesh, specs, stage=2), reshard_after_forward=True)
    with pytest.raises(ValueError, match="layout has units; inside a pipeline ZeRO-3 gathers each stage's"):
        fo.zero_pipeline(
            step, fo.zero_layout(params, mesh, specs, stage=3, units={"stages": 0, "first": 1, "last": 2})
        )
    other = fpar.make_mesh((2, 2, 1), ("pipe", "data", "tensor"))
    with pytest.raises(ValueError, match="layout is on another mesh than the pipeline"):
        fo.zero_pipeline(step, fo.zero_layout(params, other, specs, stage=3))
    run = fo.zero_pipeline(step, fo.zero_layout(params, mesh, specs, stage=3))
    with pytest.raises(ValueError, match="params do not have the layout's structure"):
        run({"stages": prob["stages"], "first": prob["first"]}, prob["xs"], prob["ts"])


@pytest.mark.multiprocess
def test_the_planners_pipelined_step_trains_alike_at_every_zero_stage():
    """``fpar.plan.model_step``'s pipeline (GPT with its head tied to the embedding, Llama) at ZeRO 0,
    1 and 3 (``zero_pipeline``: reduce-scattered chunks, the tied pair summed as chunks) on 4 gloo
    processes: three steps' losses equal ZeRO-0's on every rank, and the in-process mesh's; in
    bfloat16 compute, ZeRO-3 gathering bfloat16 parameters equals ZeRO-0's float32 masters.
    Interleaved over 2 chunks a stage, ZeRO-2 and 3 reducing each chunk's gradient as its
    backward ends (``reduce_once=False``; GPT's tied pair summed as chunks) equal ZeRO-0's there
    (other additions' order: to rounding, which AdamW grows to ~1e-11 in three steps)."""
    bf16 = [("llama", z, "bfloat16") for z in (0, 3)]
    each = [
        ("gpt", 0, "float64", None, 2),
        ("gpt", 3, "float64", False, 2),
        ("llama", 2, "float64", False, 2),
    ]
    cases = [("gpt", 0), ("gpt", 1), ("gpt", 3), ("llama", 3), *bf16, *each]
    jobs = [("model_step_job", args) for args in cases]
    got = fpar.launch(W.run_jobs, 4, jobs, timeout=240.0)
    expected = {args: W.model_step_job(*args) for _, args in jobs}
    llama = W.model_step_job("llama", 0, "float64", None, 2)  # ZeRO-0 over 2 chunks, in-process
    for rank, results in enumerate(got):
        assert all(status == "ok" for status, _ in results), f"rank {rank}:\n{results}"
        losses = {args: res for (_, args), (_, res) in zip(jobs, results)}
        for args, res in losses.items():
            assert res == pytest.approx(expected[args], rel=2e-2 if "bfloat16" in args else 1e-6), (
                rank,
                args,
            )
        assert losses[("gpt", 1)] == losses[("gpt", 0)] and losses[("gpt", 3)] == losses[("gpt", 0)], rank
        # ZeRO-3 gathers the bfloat16 parameters the stage casts to at ZeRO-0 and sums their
        # gradients in float32 as ZeRO-0 does: bit for bit
        assert losses[bf16[1]] == losses[bf16[0]], rank
        assert losses[each[1]] == pytest.approx(losses[each[0]], rel=1e-9), rank
        assert losses[each[2]] == pytest.approx(llama, rel=1e-9), rank
    assert expected[("gpt", 1)] == expected[("gpt", 0)] and expected[("gpt", 3)] == expected[("gpt", 0)]


def test_a_shared_cast_modified_in_place_raises_not_a_wrong_answer():
    """Every microbatch in flight sees the same cast: writing into it would change the others'
    weights.  Autograd refuses (the cast is a custom Function's view), naming the action."""
    mesh = W.mesh_for(PIPE2)
    prob = M.problem(2, 2, 1, dtype=torch.float32)

    def block(w, h):
        a = w["a"].to(torch.bfloat16)
        a.mul_(2.0)
        return h + torch.tanh(h.bfloat16() @ a).float() @ w["b"]

    fns = M.make_fns(())
    step = fpar.pipeline.pipeline(
        block, M.schedule("gpipe", 2, 2), mesh, loss=fns["loss"], first=fns["first"]
    )
    params = {"stages": prob["stages"], "first": prob["first"], "last": prob["last"]}
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace") as info:
        step(params, prob["xs"], prob["ts"])
    assert "raised on pipeline stage 0 running F of microbatch 0" in "\n".join(info.value.__notes__)
