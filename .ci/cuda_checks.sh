#!/usr/bin/env bash
# The cuda backend's checks that need no GPU (sourced or run from .ci/run, in the CI venv):
# its tests under Numba's CUDA simulator, then the float32-PTX check (needs NVRTC:
# pip install "numba-cuda[cu13]").
set -euo pipefail
cd "$(dirname "$0")/.."
# Both in parallel over the cores (at most 4): serially they took 443 s and 233 s of a
# 2-core AMD EPYC (znver1) machine's CI, 111 s and 107 s in parallel.
NUMBA_ENABLE_CUDASIM=1 python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 tests/cuda_sim
# (the float64 builds of kernel variants are left out: --every-float64 compiles them)
python gpu/ptx_check.py
