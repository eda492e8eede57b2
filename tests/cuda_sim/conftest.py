"""The cuda backend's tests: under Numba's CUDA simulator, or on a real GPU.

They run only when asked for, because the simulator must be switched on
before Numba is imported (so in a pytest run of its own):

* ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -q tests/cuda_sim``: simulator,
  tiny tiles (4 query rows x 3 keys; 4 x 6 for the register-tiled kernels)
  so that the awkward shapes below cross many tile borders; a short thread
  switch interval speeds the simulator's threads up several times.
* ``ATTNNB_CUDA_TESTS=device python -m pytest -q tests/cuda_sim`` on a
  machine with a GPU (``gpu/run.py`` does this): default tiles, shapes
  scaled up by ``ATTNNB_CUDA_TEST_SCALE`` (default 1).

Anywhere else the whole directory is skipped.
"""

import os
import sys

import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
DEVICE = os.environ.get("ATTNNB_CUDA_TESTS") == "device"

if not (SIMULATOR or DEVICE):
    pytest.skip("cuda tests run with NUMBA_ENABLE_CUDASIM=1 (simulator) or "
                "ATTNNB_CUDA_TESTS=device (a GPU), in a pytest run of their own",
                allow_module_level=True)

if SIMULATOR:
    sys.setswitchinterval(5e-4)
    from attnnb.cuda import _micro, _tiles

    _tiles.set_tiles(4, 3)
    # register-tiled kernels: 4 rows x 6 keys per tile, 2 x 2 threads (micro tiles 2 x 3)
    _micro.set_micro_tiles((4, 6, 2, 3))
