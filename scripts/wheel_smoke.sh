#!/usr/bin/env bash
# fpar as users install it: build the sdist and the wheel, check what they hold, install the wheel into a
# fresh virtual environment, and run a smoke test there with nothing from this tree importable.
#   bash scripts/wheel_smoke.sh          # uses .venv (bash scripts/dev.sh setup makes it)
# 1. `python -m build`: the sdist, then the wheel built *from the sdist* (build's default), so a file the
#    sdist leaves out is missing from the wheel too; every file under fpar/ (tracked or new, not ignored:
#    modules and package data such as py.typed) must be in both.
# 2. a fresh venv in a temporary directory; the same torch as .venv (its exact version, e.g. 2.13.0+cpu)
#    first, so fpar's bare `torch` requirement is already met and never pulls a CUDA build; then the wheel.
# 3. from an empty directory, PYTHONPATH unset: fpar must come from the venv's site-packages; the README's
#    tour (read from README.md), a 2-process fpar.launch against the unsharded gradient
#    (scripts/wheel_smoke.py), and `python -m fpar.plan --model tiny`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fpar-wheel-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS
say() { echo "wheel smoke: $* ($((SECONDS - t0)) s)"; }

"$PY" -m build --outdir "$WORK/dist" "$ROOT" > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
say "built $(cd "$WORK/dist" && echo *)"

git -C "$ROOT" ls-files --cached --others --exclude-standard -- fpar > "$WORK/fpar_files.txt"
"$PY" - "$WORK/dist" "$WORK/fpar_files.txt" <<'EOF'
import sys, tarfile, zipfile
from pathlib import Path

dist, listing = Path(sys.argv[1]), Path(sys.argv[2])
want = {p for p in listing.read_text().split() if (Path.cwd() / p).is_file()}
(wheel,), (sdist,) = dist.glob("fpar-*.whl"), dist.glob("fpar-*.tar.gz")
in_wheel = set(zipfile.ZipFile(wheel).namelist())
with tarfile.open(sdist) as tar:
    in_sdist = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
bad = False
for name, held in (("wheel", in_wheel), ("sdist", in_sdist)):
    missing = sorted(want - held)
    if missing:
        print(f"wheel smoke: the {name} lacks {len(missing)} file(s) of fpar/: {missing[:20]}")
        bad = True
extra = sorted(p for p in in_wheel if p.startswith("fpar/") and p not in want)
if extra:
    print(f"wheel smoke: the wheel holds files fpar/ does not: {extra[:20]}")
    bad = True
if bad:
    sys.exit("wheel smoke: fix the package data (pyproject.toml [tool.setuptools]; MANIFEST.in for the sdist)")
print(f"wheel smoke: the wheel and the sdist hold all {len(want)} files of fpar/ "
      f"({sum(p.endswith('.py') for p in want)} modules; py.typed {'in' if 'fpar/py.typed' in want else 'absent'})")
EOF

TORCH=$("$PY" -c "import torch; print(torch.__version__)")
"$PY" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
"$VPY" -m pip install -q --no-compile "torch==$TORCH"  # .pyc only for what is imported
"$VPY" -m pip install -q "$WORK"/dist/fpar-*.whl
say "installed torch==$TORCH and the wheel into a fresh venv"

mkdir "$WORK/run"
cp "$ROOT/scripts/wheel_smoke.py" "$WORK/run/"
cd "$WORK/run"
env -u PYTHONPATH "$VPY" -c "import sys, wheel_smoke; sys.exit(wheel_smoke.main(sys.argv[1:]))" "$ROOT/README.md"
# the tiny model with the command's defaults for it (4 devices; the exit status says whether a layout fits)
env -u PYTHONPATH "$VPY" -m fpar.plan --model tiny > plan.txt
grep -q "layouts estimated" plan.txt || { cat plan.txt; echo "wheel smoke: fpar.plan estimated nothing" >&2; exit 1; }
say "python -m fpar.plan --model tiny: $(grep "layouts estimated" plan.txt)"
say "passed"
