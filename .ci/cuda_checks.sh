#!/usr/bin/env bash
# The cuda backend's checks that need no GPU (sourced or run from .ci/run, in the CI venv):
# its tests under Numba's CUDA simulator, then the float32-PTX check (needs NVRTC:
# pip install "numba-cuda[cu13]").
set -euo pipefail
cd "$(dirname "$0")/.."
NUMBA_ENABLE_CUDASIM=1 python -m pytest -q -p no:cacheprovider tests/cuda_sim
python gpu/ptx_check.py
