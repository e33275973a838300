#!/usr/bin/env bash
# One command sets up a virtual environment and runs a job in it:
#   ./dev.sh demo [demo options]   the demo (a Llama-style model compiled with the passes, fake process group)
#   ./dev.sh test [pytest options] the test suite
#   ./dev.sh gpu-check [options]   the CUDA path on one GPU (benchmarks/gpu_check.py; without CUDA: says so, exit 0)
set -euo pipefail
cd "$(dirname "$0")"
job=${1:-}
[ $# -gt 0 ] && shift
case "$job" in demo|test|gpu-check) ;; *) echo "usage: ./dev.sh demo|test|gpu-check [options]" >&2; exit 2;; esac

python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python=$candidate; break; fi
  done
fi
[ -n "$python" ] || { echo "dev.sh: no python3 found (Python 3.11 expected)" >&2; exit 1; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.fsdp_passes-installed
want=$(cat setup.py | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "dev.sh: installing torch 2.13.0 (CPU) and the package into .venv ..." >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 numpy
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
  # third-party model tier: torchtitan without its data-loading dependencies (its model imports need only
  # what setup.py's test extras list)
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps torchtitan==0.3.0
  echo "$want" > "$stamp"
fi

case "$job" in
  demo) exec .venv/bin/python -m fsdp_passes demo "$@" ;;
  test) exec .venv/bin/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile tests "$@" ;;
  gpu-check) exec .venv/bin/python benchmarks/gpu_check.py "$@" ;;
esac
