"""``fpar.optim.remat`` on the real mesh equals the in-process mesh and the unsharded program.

The regression: on a real mesh remat's outputs varied over every mesh axis (the tracker typed the
remat Function by the union of its operands, which include the mesh's axis indices), so any step
whose output spec leaves an axis out was refused; a body with a psum was typed varying, and a
replicated weight meeting only summed values would have had its gradient summed.  Now the body's
ops are typed one by one on the real mesh, as the in-process mesh's vmap levels type them.  A remat
function that reads a value (Python control flow on a tensor) is refused alike on both meshes.
"""

from __future__ import annotations

import pytest
import remat_programs as rp
import torch

import fpar

pytestmark = pytest.mark.multiprocess

CASES_2 = [
    ((1, 2), ("pipeline", "data")),  # the mesh: a size-1 axis the program never reduces
    ((2, 1), ("pipeline", "data")),  # an axis of two devices the program never reduces
    ((1, 2), ("data", "tensor")),
]
CASES_4 = [((2, 2), ("pipeline", "data")), ((2, 2), ("data", "tensor"))]
FORMS = ("grad", "backward")


def _check(cases, nprocs):
    flat = [(shape, names, form) for shape, names in cases for form in FORMS]
    real = fpar.launch(rp.run_many, nprocs, flat, timeout=240)[0]
    for (shape, names, form), (got, error, reads) in zip(flat, real):
        where = f"{names}={shape} {form}"
        want, want_error, want_reads = rp.run(shape, names, form)  # the in-process mesh
        ref = rp.unsharded(shape, names)
        assert set(got) == set(want) == set(ref), where
        for name in want:
            for a, b, c in zip(
                [want[name][0], *want[name][1]], [got[name][0], *got[name][1]], [ref[name][0], *ref[name][1]]
            ):
                torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12, msg=f"{where} {name}: in-process")
                torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=f"{where} {name}: real mesh")
        if "tensor" in names:
            _check_kept_sums(where, got, want)
        # a remat output that varies over 'data' is still refused, with the same error on both meshes
        if shape[names.index("data")] > 1:
            assert want_error is not None and want_error[0] == "ReplicationError", where
            assert error == want_error, where
            assert "varies over mesh axis 'data'" in error[1]
        # a remat function that reads a value: the same ValueError on both meshes (the in-process
        # mesh's vmap cannot read one; the real mesh could, but must not differ)
        for raised in (reads, want_reads):
            assert raised is not None and raised[0] == "ValueError", (where, raised)
            assert (
                "fpar.optim.remat(_reads_value) inside fpar.shard: _reads_value reads a tensor's value"
                in raised[1]
            )
            assert "select with torch.where" in raised[1]


def _calls(stats: dict, kind: str) -> int:
    return stats.get("tensor", {}).get(kind, {}).get("calls", 0)


def _check_kept_sums(where: str, real: dict, local: dict) -> None:
    """Under save_dots the real mesh's recompute serves a row-parallel product's sum from the
    forward: one message fewer than the same body recomputed whole.  The in-process mesh computes
    it again (fpar/_recompute.py), so its counts are the same with and without the policy."""
    for plain, dots, kind in (
        ("tensor_parallel", "tensor_parallel_dots", "psum"),
        ("tensor_parallel_scattered", "tensor_parallel_scattered_dots", "psum_scatter"),
    ):
        assert _calls(real[dots][2], kind) == _calls(real[plain][2], kind) - 1 > 0, (
            where,
            dots,
            real[dots][2],
        )
        assert _calls(local[dots][2], kind) == _calls(local[plain][2], kind) > 0, (
            where,
            dots,
            local[dots][2],
        )


def test_remat_real_mesh_two_processes():
    _check(CASES_2, 2)


def test_remat_real_mesh_four_processes():
    _check(CASES_4, 4)
