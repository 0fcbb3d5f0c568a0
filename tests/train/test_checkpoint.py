"""fpar.checkpoint: per-process blocks, atomic commits, resharding loads, merge, resume.

Resharding between block layouts is checked three ways: the read planner on its own; a property
test that plays every process of a "real" mesh in turn in this process (each saves its block, then
each process of another mesh loads its block); and a real 4-process launch (``dist_workers_ckpt``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import pickle
import tempfile
from unittest import mock

import dist_workers_ckpt as W
import optree
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from safetensors.torch import load_file

import fpar
from fpar import P
from fpar.checkpoint import CheckpointError, _core, _layout

F64 = torch.float64
_TREE = {"none_is_leaf": True, "namespace": ""}


# Helpers: blocks of global values, tree equality, playing a process of a real mesh ---------------------


def coords_of(axes: dict[str, int], rank: int) -> dict[str, int]:
    out = {}
    for name, size in reversed(list(axes.items())):
        out[name] = rank % size
        rank //= size
    return dict(reversed(list(out.items())))


def block_of(t: torch.Tensor, spec: P, axes: dict[str, int], rank: int) -> torch.Tensor:
    c = coords_of(axes, rank)
    for d, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        index, n = 0, 1
        for a in names:
            index, n = index * axes[a] + c[a], n * axes[a]
        t = t.narrow(d, index * (t.shape[d] // n), t.shape[d] // n)
    return t


def blocks_of(tree, specs, axes, rank):
    def one(spec, sub):
        return optree.tree_map(
            lambda t: block_of(t, spec, axes, rank) if isinstance(t, torch.Tensor) else t, sub, **_TREE
        )

    return optree.tree_map(one, specs, tree, is_leaf=lambda s: s is None or isinstance(s, P), **_TREE)


def assert_tree_equal(a, b):
    assert optree.tree_structure(a, **_TREE) == optree.tree_structure(b, **_TREE)
    for x, y in zip(optree.tree_leaves(a, **_TREE), optree.tree_leaves(b, **_TREE)):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (x, y)
        else:
            assert type(x) is type(y) and x == y


@contextlib.contextmanager
def as_process(axes: dict[str, int], rank: int):
    """Run save/load as process ``rank`` of a real mesh of shape ``axes`` (no process group)."""

    def agree(mesh, err, digest, api):
        if err is not None:
            raise err

    coords = coords_of(axes, rank)
    with (
        mock.patch.object(_core, "_process", lambda mesh, api: (rank, coords)),
        mock.patch.object(_core, "_agree", agree),
        mock.patch.object(_core._io, "next_generation", lambda directory: 0),
    ):
        yield fpar.Mesh(tuple(axes.values()), tuple(axes), backend="dist")


def save_as_processes(path, tree, axes, specs, **kw):
    for rank in reversed(range(math.prod(axes.values()))):  # rank 0 commits, so it goes last
        with as_process(axes, rank) as mesh:
            fpar.checkpoint.save(path, blocks_of(tree, specs, axes, rank), mesh, specs, **kw)


def load_as_process(path, axes, specs, rank, **kw):
    with as_process(axes, rank) as mesh:
        return fpar.checkpoint.load(path, mesh, specs, **kw)


def local_mesh(axes):
    return fpar.make_mesh(tuple(axes.values()), tuple(axes))


AXES22, AXES4 = {"data": 2, "tensor": 2}, {"x": 4}


# Round trips --------------------------------------------------------------------------------------------


def test_in_process_round_trip_every_kind_of_leaf(tmp_path):
    tree = W.global_tree()
    tree["scalar"] = torch.tensor(2.5, dtype=F64)
    tree["list"] = [torch.zeros(0, 3), (1.5, True)]
    specs = {**W.SPECS_22, "scalar": P(), "list": [P(), None]}
    out = fpar.checkpoint.save(tmp_path / "ck", tree, local_mesh(AXES22), specs)
    assert out == str(tmp_path / "ck")
    assert sorted(os.listdir(out)) == ["g000000-p00000.safetensors", "metadata.json"]
    loaded = fpar.checkpoint.load(
        out, local_mesh(AXES4), {**W.SPECS_4, "scalar": P(), "list": P()}, like=tree
    )
    assert_tree_equal(loaded, tree)
    plain = fpar.checkpoint.load(out, local_mesh(AXES22), specs | {"opt": P()})  # no like=: rebuilt from JSON
    moments = plain["opt"]["moments"]
    assert type(moments).__name__ == "Moments" and moments._fields == ("mu", "nu")
    assert isinstance(plain["list"], list) and isinstance(plain["list"][1], tuple)
    torch.testing.assert_close(moments.nu, tree["opt"]["moments"].nu, rtol=0, atol=0)


def test_files_carry_global_shape_spec_mesh_and_offsets(tmp_path):
    tree, specs = W.global_tree(), W.SPECS_22
    save_as_processes(tmp_path, tree, AXES22, specs, step=9)
    ck = tmp_path / "step_00000009"
    # Replicas are written once: w2 (P('tensor', None)) by the data=0 processes 0 and 1 only.
    meta = json.loads((ck / "metadata.json").read_text())
    leaf = {r["name"]: r for r in meta["leaves"]}
    assert [b["file"] for b in leaf["params.w2"]["blocks"]] == [
        "g000000-p00000.safetensors",
        "g000000-p00001.safetensors",
    ]
    assert [b["offsets"] for b in leaf["params.w1"]["blocks"]] == [[0, 0], [0, 6], [4, 0], [4, 6]]
    assert leaf["opt.count"]["blocks"] == [{"file": "g000000-p00000.safetensors", "offsets": [], "shape": []}]
    assert leaf["step"] == {"name": "step", "path": ["step"], "kind": "value", "value": 5}
    assert meta["mesh"] == {"axis_names": ["data", "tensor"], "axis_sizes": [2, 2], "processes": 4}
    assert meta["step"] == 9
    from safetensors import safe_open

    with safe_open(ck / "g000000-p00003.safetensors", framework="pt") as f:
        header = json.loads(f.metadata()["fpar"])
        assert header["process"] == 3 and header["mesh"]["axis_sizes"] == [2, 2]
        assert header["tensors"]["params.w1"] == {
            "global_shape": [8, 12],
            "spec": ["data", "tensor"],
            "offsets": [4, 6],
        }
        assert "params.w2" not in header["tensors"]  # process 3 is data=1: not its replica to write
        torch.testing.assert_close(f.get_tensor("params.w1"), tree["params"]["w1"][4:, 6:], rtol=0, atol=0)


def test_reshard_between_real_mesh_layouts(tmp_path):
    tree = W.global_tree()
    save_as_processes(tmp_path / "ck", tree, AXES22, W.SPECS_22)
    for rank in range(4):
        got = load_as_process(tmp_path / "ck", AXES4, W.SPECS_4, rank, like=tree)
        assert_tree_equal(got, blocks_of(tree, W.SPECS_4, AXES4, rank))
    assert_tree_equal(fpar.checkpoint.load(tmp_path / "ck", local_mesh({"one": 1}), P(), like=tree), tree)


@st.composite
def layouts(draw):
    """A global shape and two (mesh, spec) layouts that both divide it."""
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 12]), min_size=0, max_size=3)))

    def one(prefix):
        n_axes = draw(st.integers(1, 3))
        axes = {f"{prefix}{i}": draw(st.sampled_from([1, 2, 3])) for i in range(n_axes)}
        names = draw(st.permutations(list(axes)))
        entries, left = [], list(names)
        for d in range(len(shape)):
            k = draw(st.integers(0, min(2, len(left))))
            take, left = tuple(left[:k]), left[k:]
            ok = shape[d] % math.prod(axes[a] for a in take) == 0
            entries.append((take if len(take) > 1 else take[0]) if take and ok else None)
        return axes, P(*entries)

    return shape, one("a"), one("b")


@given(layouts())
def test_reshard_property(layout):
    shape, (axes_a, spec_a), (axes_b, spec_b) = layout
    assume(math.prod(axes_a.values()) <= 8 and math.prod(axes_b.values()) <= 8)  # keep it quick
    value = torch.arange(math.prod(shape), dtype=F64).reshape(shape)
    with tempfile.TemporaryDirectory() as d:
        save_as_processes(d, {"v": value}, axes_a, {"v": spec_a})
        for rank in range(math.prod(axes_b.values())):
            got = load_as_process(d, axes_b, {"v": spec_b}, rank)["v"]
            torch.testing.assert_close(got, block_of(value, spec_b, axes_b, rank), rtol=0, atol=0)


def test_plan_reads_only_overlapping_blocks():
    shape, spec = (8, 12), P("data", "tensor")
    stored = _layout.blocks(shape, spec, AXES22, distributed=True)
    assert [b.process for b in stored] == [0, 1, 2, 3]
    start, size = _layout.region(shape, P(None, "x"), AXES4, {"x": 1})  # columns 3:6, all rows
    assert (start, size) == ((0, 3), (8, 3))
    reads = _layout.plan(start, size, stored)
    assert [r.block for r in reads] == [0, 2]  # only the tensor=0 blocks hold columns 3:6
    assert [(r.src, r.dst) for r in reads] == [
        ((slice(0, 4), slice(3, 6)), (slice(0, 4), slice(0, 3))),
        ((slice(0, 4), slice(3, 6)), (slice(4, 8), slice(0, 3))),
    ]
    assert sum(r.numel for r in reads) == math.prod(size)
    assert _layout.blocks(shape, P("tensor"), AXES22, distributed=True)[1].process == 1
    assert len(_layout.blocks(shape, P(), AXES22, distributed=True)) == 1


# Atomicity ------------------------------------------------------------------------------------------


class Crash(RuntimeError):
    pass


def _v(k):
    return {"w": torch.full((4, 4), float(k)), "step": k}


def _crash_writing_a_file(monkeypatch):
    import safetensors.torch

    real = safetensors.torch.save_file

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00garbage, half a file")
        raise Crash("killed mid-write")

    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    return real


@pytest.mark.parametrize("where", ["block file", "commit"])
def test_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, where):
    mesh, specs = local_mesh(AXES22), {"w": P("data"), "step": None}
    fpar.checkpoint.save(tmp_path, _v(1), mesh, specs)
    if where == "block file":
        _crash_writing_a_file(monkeypatch)
    else:  # every block written, killed while writing metadata.json
        monkeypatch.setattr(
            _core._io, "write_json", lambda *a: (_ for _ in ()).throw(Crash("killed at commit"))
        )
    with pytest.raises(Crash):
        fpar.checkpoint.save(tmp_path, _v(2), mesh, specs)
    assert_tree_equal(fpar.checkpoint.load(tmp_path, mesh, specs), _v(1))
    monkeypatch.undo()
    fpar.checkpoint.save(tmp_path, _v(3), mesh, specs)  # the next save works and cleans up
    assert_tree_equal(fpar.checkpoint.load(tmp_path, mesh, specs), _v(3))
    left = sorted(os.listdir(tmp_path))  # one save's block file, no temporary files
    assert len(left) == 2 and left[1] == "metadata.json" and left[0].endswith("-p00000.safetensors"), left


def test_crash_after_commit_has_the_new_checkpoint(tmp_path, monkeypatch):
    mesh, specs = local_mesh(AXES22), {"w": P(), "step": None}
    fpar.checkpoint.save(tmp_path, _v(1), mesh, specs)
    monkeypatch.setattr(_core._io, "collect_garbage", lambda *a: (_ for _ in ()).throw(Crash("killed")))
    with pytest.raises(Crash):
        fpar.checkpoint.save(tmp_path, _v(2), mesh, specs)
    assert_tree_equal(fpar.checkpoint.load(tmp_path, mesh, specs), _v(2))


def test_crash_in_a_step_save_keeps_the_previous_step(tmp_path, monkeypatch):
    mesh, specs = local_mesh(AXES22), {"w": P("tensor"), "step": None}
    fpar.checkpoint.save(tmp_path, _v(1), mesh, specs, step=1)
    _crash_writing_a_file(monkeypatch)
    with pytest.raises(Crash):
        fpar.checkpoint.save(tmp_path, _v(2), mesh, specs, step=2)
    assert fpar.checkpoint.latest_step(tmp_path) == 1
    assert_tree_equal(fpar.checkpoint.load(tmp_path, mesh, specs), _v(1))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint for step 2"):
        fpar.checkpoint.load(tmp_path, mesh, specs, step=2)


def test_steps_and_keep(tmp_path):
    mesh, specs = local_mesh(AXES22), {"w": P(), "step": None}
    assert fpar.checkpoint.latest_step(tmp_path) is None
    for k in (1, 2, 3, 4):
        fpar.checkpoint.save(tmp_path, _v(k), mesh, specs, step=k, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004"]
    assert fpar.checkpoint.load(tmp_path, mesh, specs)["step"] == 4
    assert fpar.checkpoint.load(tmp_path, mesh, specs, step=3)["step"] == 3
    assert fpar.checkpoint.load(tmp_path, mesh, specs, device="meta")["w"].is_meta
    with pytest.raises(ValueError, match="keep=2 needs step="):
        fpar.checkpoint.save(tmp_path, _v(1), mesh, specs, keep=2)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        fpar.checkpoint.save(tmp_path, _v(1), mesh, specs, step=-1)


# Safety: JSON + safetensors only ----------------------------------------------------------------------


def test_loading_never_unpickles(tmp_path, monkeypatch):
    mesh, tree = local_mesh(AXES22), W.global_tree()
    fpar.checkpoint.save(tmp_path / "ck", tree, mesh, W.SPECS_22, step=1)
    fpar.checkpoint.merge(tmp_path / "ck", tmp_path / "merged.safetensors")

    def refuse(*a, **k):
        raise AssertionError("unpickling during load")

    for mod, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(mod, name, refuse)
    assert_tree_equal(fpar.checkpoint.load(tmp_path / "ck", mesh, W.SPECS_22, like=tree), tree)
    assert_tree_equal(
        fpar.checkpoint.load(tmp_path / "merged.safetensors", mesh, W.SPECS_22, like=tree), tree
    )


def test_refuses_pickles_and_foreign_files(tmp_path):
    mesh = local_mesh(AXES22)
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="never unpickles"):
        fpar.checkpoint.load(tmp_path / "model.pt", mesh, P())
    (tmp_path / "hf").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"not an fpar checkpoint \(found \['pytorch_model.bin'\]\)"):
        fpar.checkpoint.load(tmp_path / "hf", mesh, P())
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(CheckpointError, match="without fpar metadata"):
        fpar.checkpoint.load(tmp_path / "plain.safetensors", mesh, P())
    with pytest.raises(FileNotFoundError, match="no such file"):
        fpar.checkpoint.load(tmp_path / "nothing", mesh, P())
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        fpar.checkpoint.load(tmp_path / "empty", mesh, P())


@pytest.mark.parametrize(
    ("edit", "phrase"),
    [
        (
            lambda m: m["leaves"][0]["blocks"][0].update(file="../elsewhere.safetensors"),
            "not a plain .safetensors file name",
        ),
        (lambda m: m["leaves"][0]["blocks"][0].update(file="weights.pt"), "fpar reads only safetensors"),
        (lambda m: m.update(format="pickle"), "format is not 'fpar.checkpoint'"),
        (lambda m: m.update(version=99), "version 99"),
        (lambda m: m["leaves"][0].update(dtype="Tensor"), "'Tensor' is not a torch dtype"),
        (lambda m: m["leaves"][0]["blocks"][0].update(offsets=[3]), "a block outside the tensor"),
        (lambda m: m["tree"].update({"dict": [["w", {"leaf": 7}]]}), "leaf index out of range"),
        (lambda m: m.update(tree={"object": "os.system"}), "unknown node"),
        (lambda m: m["leaves"][0].update(blocks=[]), "cover 0 of the 4 elements"),
    ],
    ids=[
        "path-escape",
        "pickle-file",
        "format",
        "version",
        "dtype",
        "bounds",
        "leaf-index",
        "node",
        "coverage",
    ],
)
def test_rejects_malformed_metadata(tmp_path, edit, phrase):
    mesh = local_mesh(AXES22)
    fpar.checkpoint.save(tmp_path, {"w": torch.ones(4)}, mesh, P())
    meta = json.loads((tmp_path / "metadata.json").read_text())
    edit(meta)
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=phrase):
        fpar.checkpoint.load(tmp_path, mesh, P())


def test_rejects_a_block_file_of_another_save(tmp_path):
    mesh = local_mesh(AXES22)
    fpar.checkpoint.save(tmp_path / "a", {"w": torch.ones(4, 4)}, mesh, P())
    fpar.checkpoint.save(tmp_path / "b", {"w": torch.ones(4, 2)}, mesh, P())
    os.replace(tmp_path / "b" / "g000000-p00000.safetensors", tmp_path / "a" / "g000000-p00000.safetensors")
    with pytest.raises(CheckpointError, match="mixes files of different saves"):
        fpar.checkpoint.load(tmp_path / "a", mesh, P())
    (tmp_path / "a" / "metadata.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        fpar.checkpoint.load(tmp_path / "a", mesh, P())


# Specs and trees ------------------------------------------------------------------------------------


def test_spec_and_tree_errors(tmp_path):
    mesh = local_mesh(AXES22)
    tree = {"w": torch.ones(4, 6), "b": torch.ones(6)}
    fpar.checkpoint.save(tmp_path / "ck", tree, mesh, {"w": P("data"), "b": P()})
    with pytest.raises(fpar.SpecError, match=r"nothing covers the leaf at \['w'\]"):
        fpar.checkpoint.load(tmp_path / "ck", mesh, {"b": P()})
    with pytest.raises(fpar.SpecError, match=r"specs at \[\"\['c'\]\"\] match no leaf"):
        fpar.checkpoint.load(tmp_path / "ck", mesh, {"w": P(), "b": P(), "c": P()})
    with pytest.raises(fpar.SpecError, match="dim 0 of size 6 is not evenly divisible"):
        fpar.checkpoint.load(tmp_path / "ck", local_mesh(AXES4), {"w": P(), "b": P("x")})
    with pytest.raises(TypeError, match="must be a fpar.P"):
        fpar.checkpoint.save(tmp_path / "x", tree, mesh, {"w": P(), "b": None})
    with pytest.raises(CheckpointError, match="same dotted name 'a.b'"):
        fpar.checkpoint.save(tmp_path / "x", {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, mesh, P())
    with pytest.raises(TypeError, match="a checkpoint holds tensors, None and Python scalars"):
        fpar.checkpoint.save(tmp_path / "x", {"f": lambda: 0}, mesh, P())
    with pytest.raises(TypeError, match="must be a fpar.Mesh"):
        fpar.checkpoint.load(tmp_path / "ck", "mesh", P())
    with pytest.raises(CheckpointError, match=r"leaves only in the checkpoint \[\"\['b'\]\"\]"):
        fpar.checkpoint.load(tmp_path / "ck", mesh, P(), like={"w": 0, "c": 0})
    Pair = collections.namedtuple("Pair", ["b", "w"])  # like= gives the result its own node types
    fpar.checkpoint.save(tmp_path / "pair", Pair(tree["b"], tree["w"]), mesh, P())
    assert type(fpar.checkpoint.load(tmp_path / "pair", mesh, P(), like=Pair(0, 0))) is Pair
    assert type(fpar.checkpoint.load(tmp_path / "pair", mesh, P())) is not Pair  # a same-named lookalike
    assert not os.path.exists(tmp_path / "x")  # failed saves write nothing


# merge ------------------------------------------------------------------------------------------------


def test_merge_writes_one_file_of_full_tensors(tmp_path):
    tree = W.global_tree()
    save_as_processes(tmp_path, tree, AXES22, W.SPECS_22, step=2)
    out = fpar.checkpoint.merge(tmp_path, tmp_path / "full.safetensors")
    flat = load_file(out)
    assert flat.keys() == {
        "params.w1",
        "params.w2",
        "params.b",
        "opt.moments.0.w1",
        "opt.moments.0.w2",
        "opt.moments.1",
        "opt.count",
        "half",
        "mask",
    }
    for path, leaf in zip(*optree.tree_flatten_with_path(tree, **_TREE)[:2]):
        if isinstance(leaf, torch.Tensor):
            assert torch.equal(flat[".".join(map(str, path))], leaf)
    again = fpar.checkpoint.load(out, local_mesh(AXES4), W.SPECS_4, like=tree)
    assert_tree_equal(again, tree)
    for rank in (1, 3):  # a merged file reshards onto a real mesh too
        got = load_as_process(out, AXES4, W.SPECS_4, rank, like=tree)
        assert_tree_equal(got, blocks_of(tree, W.SPECS_4, AXES4, rank))


def test_merge_of_functionalized_params_is_a_state_dict(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    _, params = fpar.functionalize(model)
    mesh = local_mesh(AXES22)
    specs = fpar.spec_rules(params, {r"0\.weight": P("tensor"), r"2\.weight": P(None, "tensor")}, default=P())
    fpar.checkpoint.save(tmp_path / "ck", params, mesh, specs)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fresh.load_state_dict(load_file(fpar.checkpoint.merge(tmp_path / "ck", tmp_path / "model.safetensors")))
    for (n, p), q in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p, q), n


# Resume -----------------------------------------------------------------------------------------------

LR, MOMENTUM = 0.1, 0.9
PSPECS = {"w1": P(None, "tensor"), "w2": P("tensor", None)}


def _loss(p, x, y):
    h = torch.tanh(x @ p["w1"])
    out = fpar.psum(h @ p["w2"], "tensor")
    return fpar.pmean(((out - y) ** 2).mean(), "data")


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 6, generator=g, dtype=F64), torch.randn(8, 3, generator=g, dtype=F64)


def _train(state, mesh, n):
    """Plain SGD with momentum, inline; returns the new state and the losses."""
    step_fn = torch.func.grad_and_value(
        fpar.shard(_loss, mesh, in_specs=(PSPECS, P("data"), P("data")), out_specs=P())
    )
    losses = []
    for _ in range(n):
        grads, loss = step_fn(state["params"], *_batch(state["step"]))
        mom = {k: MOMENTUM * state["opt"]["mom"][k] + grads[k] for k in grads}
        params = {k: state["params"][k] - LR * mom[k] for k in grads}
        state = {"params": params, "opt": {"mom": mom}, "step": state["step"] + 1}
        losses.append(loss.item())
    return state, losses


def _fresh(mesh):
    params = fpar.init(
        {"w1": fpar.normal((6, 16), std=0.5, dtype=F64), "w2": fpar.normal((16, 3), std=0.5, dtype=F64)},
        mesh,
        PSPECS,
    )
    return {"params": params, "opt": {"mom": {k: torch.zeros_like(v) for k, v in params.items()}}, "step": 0}


STATE_SPECS = {"params": PSPECS, "opt": {"mom": PSPECS}, "step": None}


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    mesh = local_mesh(AXES22)
    _, uninterrupted = _train(_fresh(mesh), mesh, 6)

    state, first = _train(_fresh(mesh), mesh, 3)
    fpar.checkpoint.save(tmp_path, state, mesh, STATE_SPECS, step=state["step"])
    del state  # the run is killed

    mesh = local_mesh(AXES22)  # a fresh run
    assert fpar.checkpoint.latest_step(tmp_path) == 3
    state = fpar.checkpoint.load(tmp_path, mesh, STATE_SPECS)
    assert state["step"] == 3
    _, rest = _train(state, mesh, 3)
    assert first + rest == uninterrupted  # exactly, on CPU

    other = local_mesh({"data": 1, "tensor": 4})  # resumed on another layout: same up to rounding
    _, rest4 = _train(fpar.checkpoint.load(tmp_path, other, STATE_SPECS), other, 3)
    torch.testing.assert_close(rest4, uninterrupted[3:], rtol=1e-12, atol=0)


# Real mesh ---------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_real_mesh_save_reshard_merge(tmp_path):
    tree = W.global_tree()
    src, dst = tmp_path / "src", tmp_path / "dst"
    fpar.checkpoint.save(src, tree, local_mesh(AXES22), W.SPECS_22)
    results = fpar.launch(W.save_and_reshard, 4, str(src), str(dst), timeout=120.0)
    tensors, _ = W.tensors_only(tree, W.SPECS_4)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["written"] == str(dst / "step_00000003")
        assert_tree_equal(res["blocks"], blocks_of(tree, W.SPECS_22, AXES22, r))
        assert_tree_equal(res["resharded"], blocks_of(tree, W.SPECS_4, AXES4, r))
        assert_tree_equal(res["full"], tensors)
        if r == 2:
            assert res["bad_spec"].startswith("SpecError: fpar.checkpoint.save: tree['half']")
        else:
            assert res["bad_spec"].startswith("CheckpointError: fpar.checkpoint.save: process 2 failed")
        assert res["disagree"].startswith("CheckpointError") and "disagree" in res["disagree"]
    # Each process wrote its own file; the failed saves left nothing behind.
    assert sorted(os.listdir(dst)) == ["step_00000003"]
    written = sorted(os.listdir(dst / "step_00000003"))
    assert written == [f"g000000-p0000{p}.safetensors" for p in range(4)] + ["metadata.json"]
    # Loaded on one process with yet other specs, and merged: the global values.
    assert_tree_equal(fpar.checkpoint.load(dst, local_mesh({"one": 1}), P(), like=tree), tree)
    flat = load_file(fpar.checkpoint.merge(dst, tmp_path / "merged.safetensors"))
    assert torch.equal(flat["params.w1"], tree["params"]["w1"]) and torch.equal(
        flat["opt.moments.1"], tree["opt"]["moments"].nu
    )
    assert len(flat) == 9
