#!/usr/bin/env bash
# The torch-version tier: a fast subset of the suite on the oldest and the newest torch we support.
#   bash scripts/torch_versions.sh                 # torch 2.11.0 (pyproject's floor) and 2.14.1 (the newest
#                                                  # this environment's pip allows: a constraint caps torch)
#   bash scripts/torch_versions.sh 2.12.1 2.14.1   # the versions given
#   TORCH_TIER_TESTS="tests/test_torch_api.py" bash scripts/torch_versions.sh   # another subset
# Each version gets its own environment, .venv-torch/<version>, made once and reused. torch is
# installed as dev.sh installs it, a plain `pip install torch==X`: where the registry has no CPU
# build of X (only 2.13.0 has one today) that brings torch's CUDA packages too (~4 GB a version);
# the tests run on the CPU either way. fpar runs from this checkout (PYTHONPATH), not installed.
# Not part of .ci/run; see docs/torch-versions.md for what it runs and how long it takes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "$#" -gt 0 ]; then VERSIONS=("$@"); else VERSIONS=(2.11.0 2.14.1); fi
# The subset: every private torch API resolves and is listed; the README's tour and the docs'
# pages (JAX semantics, every layout incl. MoE and pipelines, randomness, ZeRO, troubleshooting);
# the testing kit (and its real-mesh example on 2 gloo processes); the spec and shard_map rules;
# torch.compile's graph breaks in-process.
DEFAULT_TESTS="tests/test_torch_api.py tests/test_docs_testing.py tests/test_spec.py tests/test_shard_map.py \
tests/test_testing_kit.py tests/test_docs.py::test_page_runs \
tests/test_compile.py::test_every_form_in_process_equals_the_unsharded_gradient \
tests/test_compile.py::test_in_process_collectives_under_compile_and_grad tests/test_compile_local.py"
read -r -a TESTS <<< "${TORCH_TIER_TESTS:-$DEFAULT_TESTS}"

status=0
for v in "${VERSIONS[@]}"; do
  env=.venv-torch/$v
  start=$(date +%s)
  if [ ! -x "$env/bin/python" ]; then
    "$PY" -m venv "$env"
  fi
  if ! "$env/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$v')" 2>/dev/null; then
    "$env/bin/python" -m pip install -q "torch==$v"
  fi
  "$env/bin/python" -m pip install -q "optree>=0.13" "safetensors>=0.4" "pytest>=8" "hypothesis>=6.100" numpy
  ready=$(date +%s)
  echo "== torch $v ($("$env/bin/python" -c 'import torch; print(torch.__version__)')): environment ready in $((ready - start)) s"
  if ! PYTHONPATH="$PWD" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CI=true \
      "$env/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"; then
    status=1
  fi
  echo "== torch $v: tests took $(( $(date +%s) - ready )) s"
done
exit $status
