"""The installed wheel's smoke test (run by ``scripts/wheel_smoke.sh`` inside a fresh virtual environment).

``scripts/wheel_smoke.sh`` copies this file into an empty temporary directory and runs it there with the
fresh environment's Python, as ``python -c "import wheel_smoke; ..."``, so nothing from the source tree is
importable: ``import fpar`` must find the installed wheel. It checks that, then runs

1. the README's tour: the Python block(s) of its first section that has one, read from README.md (never
   copied, so the two cannot drift), in one namespace, as a reader would paste them;
2. a 2-process ``fpar.launch`` program: a data-parallel loss and its gradient on a real gloo mesh, each
   rank's value and gradient against the unsharded loss computed here with plain autograd.

``python -m fpar.plan`` is run by the shell script (it is a command, as a user types it).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import sysconfig
import time
from pathlib import Path

_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")


def readme_tour(readme: Path) -> list[str]:
    """The Python blocks of the README's first ``##`` section that has any (the tour), in order."""
    lines = readme.read_text(encoding="utf-8").splitlines()
    blocks: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## ") and blocks:
            break  # the next section: the tour has ended
        fence = _FENCE.match(line)
        if fence:
            end = i + 1
            while end < len(lines) and not lines[end].startswith(fence.group(1)):
                end += 1
            if fence.group(2) == "python":
                blocks.append("\n".join(lines[i + 1 : end]) + "\n")
            i = end
        i += 1
    if not blocks:
        raise SystemExit(f"wheel smoke: no Python block found in {readme}: where did the tour go?")
    return blocks


def check_installed() -> str:
    """``fpar`` is imported from this environment's site-packages, not from a source tree."""
    import fpar

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(fpar.__file__).resolve()
    if site not in where.parents:
        raise SystemExit(f"wheel smoke: fpar was imported from {where}, not from the wheel in {site}")
    for mod in sys.modules.values():  # every fpar module the import pulled in, not only the package
        f = getattr(mod, "__file__", None)
        if getattr(mod, "__name__", "").startswith("fpar") and f and site not in Path(f).resolve().parents:
            raise SystemExit(f"wheel smoke: {mod.__name__} was imported from {f}, outside {site}")
    return str(where)


def run_tour(readme: Path) -> str:
    """Run the tour's blocks in one namespace; what they print."""
    import torch

    torch.manual_seed(0)
    namespace: dict = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for n, code in enumerate(readme_tour(readme)):
            exec(compile(code, f"{readme}:tour block {n + 1}", "exec"), namespace)
    return out.getvalue()


def data_parallel_rank(seed: int) -> tuple[int, float, object]:
    """One rank of a 2-process data-parallel step: (rank, loss, gradient of the replicated weight)."""
    import torch

    import fpar
    from fpar import P

    torch.manual_seed(seed)
    w, x, y = (torch.randn(*s, dtype=torch.float64) for s in ((8, 4), (6, 8), (6, 4)))
    mesh = fpar.make_mesh((2,), ("data",))

    def loss(w, x, y):
        return fpar.pmean(((x @ w - y) ** 2).mean(), "data")

    sharded = fpar.shard(loss, mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
    blocks = fpar.device_put((w, x, y), mesh, (P(), P("data"), P("data")))
    for _ in range(2):  # the first call is traced, the second runs its plan (the fast path)
        value = sharded(*blocks)
        grad = torch.func.grad(sharded)(*blocks)
    return torch.distributed.get_rank(), float(value), grad


def run_launch(seed: int = 0) -> None:
    """``fpar.launch`` on 2 processes equals the unsharded loss and gradient."""
    import torch

    import fpar

    results = fpar.launch(data_parallel_rank, 2, seed, timeout=300.0)
    torch.manual_seed(seed)
    w, x, y = (torch.randn(*s, dtype=torch.float64) for s in ((8, 4), (6, 8), (6, 4)))
    w.requires_grad_(True)
    want = ((x @ w - y) ** 2).mean()
    (want_grad,) = torch.autograd.grad(want, w)
    want = want.detach()
    if sorted(r for r, _, _ in results) != [0, 1]:
        raise SystemExit(f"wheel smoke: fpar.launch returned ranks {[r for r, _, _ in results]}, not [0, 1]")
    for rank, value, grad in results:
        if abs(value - float(want)) > 1e-12 or not torch.allclose(grad, want_grad, rtol=1e-12, atol=1e-12):
            raise SystemExit(
                f"wheel smoke: rank {rank} of fpar.launch gave loss {value!r} and gradient {grad}, "
                f"the unsharded loss is {float(want)!r} with gradient {want_grad}"
            )


def main(argv: list[str]) -> int:
    """``main([README.md's path])``: the checks above, each timed; 0 when all pass."""
    (readme,) = argv
    start = time.perf_counter()
    print(f"wheel smoke: fpar from {check_installed()}", flush=True)
    t = time.perf_counter()
    printed = run_tour(Path(readme))
    if not printed.strip():
        raise SystemExit("wheel smoke: the README tour printed nothing")
    print(f"wheel smoke: README tour ran ({time.perf_counter() - t:.1f} s), printing:", flush=True)
    print("  " + printed.strip().replace("\n", "\n  "), flush=True)
    t = time.perf_counter()
    run_launch()
    print(
        f"wheel smoke: fpar.launch on 2 processes equals the unsharded loss and gradient "
        f"({time.perf_counter() - t:.1f} s)",
        flush=True,
    )
    print(f"wheel smoke: python checks passed in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
