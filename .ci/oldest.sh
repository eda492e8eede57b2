#!/usr/bin/env bash
# The oldest Python, Numba, NumPy and SciPy that pyproject.toml admits, in a virtualenv
# of their own (run from .ci/run).  Numba 0.60 is outside the releases the Numba patches
# were tested with, so the version gate turns them all off: this is also CI's run with
# the patches off.  It runs two float64 cases of `python -m attnnb check` (dense attention
# and Token Merging, on the cpu backend against the reference, to 1e-12) and the fence's
# own tests: without the patches, Numba 0.60 takes over a minute for each kernel family
# on this 2-core machine (all 96 cases: over 40 minutes; docs/notes/performance.md, "Numba's
# internals behind one gate").
set -euo pipefail
cd "$(dirname "$0")/.."
python_oldest=""
# (a pyenv shim named python3.10 may exist and fail: each candidate must run)
for candidate in python3.10 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then
        python_oldest="$candidate"; break
    fi
done
if [ -z "$python_oldest" ]; then
    echo "CI: no Python 3.10 on this machine for the oldest-versions run" >&2
    exit 1
fi
scratch="$(mktemp -d)"  # the virtualenv and the kernel cache, removed when this ends
trap 'rm -rf "$scratch"' EXIT
venv="$scratch/venv-oldest"
"$python_oldest" -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install -q -e . "numba==0.60.0" "numpy==1.26.4" "scipy==1.11.4" \
    "pytest>=8" "pytest-xdist>=3" "hypothesis>=6"
python -m attnnb info
# a cache of its own: the main run's entries were written with the patches on
export NUMBA_CACHE_DIR="$scratch/numba-cache"
python -W "ignore::RuntimeWarning" -m attnnb check --backend reference --backend cpu \
    --only "attention plain GQA float64" --only "tome bipartite N=77 r=20 float64"
python -m pytest -q -p no:cacheprovider tests/cpu/test_numba_patches.py tests/cpu/test_views.py
