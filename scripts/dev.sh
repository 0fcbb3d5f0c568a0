#!/usr/bin/env bash
# One entry point for a fresh machine:
#   bash scripts/dev.sh example   # set up (once), then run the main example
#   bash scripts/dev.sh test      # set up (once), then run the whole test suite
#   bash scripts/dev.sh setup     # only set up
#   bash scripts/dev.sh wheel     # set up (once), then build the wheel and smoke-test it in a fresh venv
#   bash scripts/dev.sh flakes N  # set up (once), then run the multi-process tier N times under load
# Set-up makes .venv with the CPU build of torch 2.13.0 *before* installing fpar: a bare `torch`
# requirement with no torch present would pull the newest release with GBs of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

setup() {
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    .venv/bin/python -m pip install -q torch==2.13.0
  fi
  .venv/bin/python -m pip install -q -e ".[test,examples,hf,docs,lint]"
  .venv/bin/python -m pip install -q build==1.6.1  # python -m build, for scripts/wheel_smoke.sh
}

case "${1:-}" in
  setup) setup ;;
  example) setup; .venv/bin/python examples/train_gpt.py "${@:2}" ;;
  # two pytest-xdist workers by default, one per core of the CI machine (four were no faster on it);
  # FPAR_TEST_WORKERS=0: one process
  test) setup
    workers=(); [ "${FPAR_TEST_WORKERS:-2}" != 0 ] && workers=(-n "${FPAR_TEST_WORKERS:-2}" --dist worksteal)
    .venv/bin/python -m pytest ${workers[@]+"${workers[@]}"} "${@:2}" ;;
  wheel) setup; bash scripts/wheel_smoke.sh ;;
  # the flake hunt: the multi-process tier (-m multiprocess; more pytest args narrow it) N times in a
  # row while a second process burns a core, one log per run in flakes/, every failure listed
  flakes) setup
    n=${2:-10}
    mkdir -p flakes
    .venv/bin/python -c "while True: pass" & burner=$!
    trap 'kill "$burner" 2>/dev/null || true' EXIT
    failed=0
    for i in $(seq 1 "$n"); do
      if .venv/bin/python -m pytest -q -p no:cacheprovider -m multiprocess "${@:3}" > "flakes/run-$i.log" 2>&1; then
        echo "run $i/$n: passed ($(tail -n 1 "flakes/run-$i.log"))"
      else
        failed=$((failed + 1))
        echo "run $i/$n: FAILED (flakes/run-$i.log)"
        grep -E "^(FAILED|ERROR) " "flakes/run-$i.log" || tail -n 5 "flakes/run-$i.log"
      fi
    done
    echo "$n runs, $failed with a failure"
    [ "$failed" = 0 ] ;;
  *) echo "usage: bash scripts/dev.sh {setup|example|test|wheel|flakes N} [args...]" >&2; exit 2 ;;
esac
