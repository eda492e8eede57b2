#!/usr/bin/env bash
# One end of the range pyproject.toml admits, in a virtualenv of its own (run from .ci/run):
#
#   oldest  Python 3.10 with the oldest NumPy and SciPy admitted (1.26, 1.11), Numba 0.68
#   newest  Python 3.13 with the newest releases pip finds
#
# Each runs `warmup` and the whole test suite.  The framework bridges' extras (torch, jax,
# dask, transformers) are installed in the main run only; their tests skip here.  The
# oldest end also runs two `check` cases and the fence's own tests with the Numba patches
# off (ATTNNB_NUMBA_PATCHES=0): CI's run of their fallbacks.
set -euo pipefail
cd "$(dirname "$0")/.."
end="${1:?usage: range.sh oldest|newest}"
case "$end" in
    oldest) version=3.10; pins=("numba==0.68.1" "numpy==1.26.4" "scipy==1.11.4") ;;
    newest) version=3.13; pins=() ;;
    *) echo "range.sh: oldest or newest, not $end" >&2; exit 2 ;;
esac
python_end=""
# (a pyenv shim named python3.X may exist and fail: each candidate must run)
for candidate in "python$version" \
        "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/"python$version"; do
    if "$candidate" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$version'" \
            2>/dev/null; then
        python_end="$candidate"; break
    fi
done
if [ -z "$python_end" ]; then
    echo "CI: no Python $version on this machine for the $end end of the range" >&2
    exit 1
fi
scratch="$(mktemp -d)"  # the virtualenv and the kernel caches, removed when this ends
trap 'rm -rf "$scratch"' EXIT
"$python_end" -m venv "$scratch/venv"
# shellcheck disable=SC1091
. "$scratch/venv/bin/activate"
python -m pip install -q -e . "${pins[@]}" "pytest>=8" "pytest-xdist>=3" "hypothesis>=6"
python -m attnnb info
export NUMBA_CACHE_DIR="$scratch/numba-cache"
python -m attnnb warmup
status=0
python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 2 || status=$?
if [ "$status" -eq 5 ]; then
    echo "CI: the $end run collected no tests" >&2
fi
[ "$status" -eq 0 ] || exit "$status"
if [ "$end" = oldest ]; then
    # the patches' fallbacks, in a cache of their own (the entries above carry the stamp)
    export ATTNNB_NUMBA_PATCHES=0 NUMBA_CACHE_DIR="$scratch/numba-cache-off"
    python -m attnnb check --backend reference --backend cpu \
        --only "attention plain GQA float64" --only "tome bipartite N=77 r=20 float64"
    python -m pytest -q -p no:cacheprovider tests/cpu/test_numba_patches.py \
        tests/cpu/test_views.py
fi
