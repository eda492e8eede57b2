"""The kernels that fill the transposed key (and value) tiles before a sweep.

Every tiled sweep reads the keys transposed tile by tile (``kt``, from
:func:`attnnb.cpu._scratch.key_tile_buffers`) and a finiteness flag per
value tile.  Filling them is its own parallel kernel, launched by the host
before the sweep (:func:`attnnb.cpu._host.run_sweep`, the backward
passes), rather than a first ``prange`` copied into every kernel: a
``prange`` in an inlined function is not parallelised by Numba, and the
backward's two sweeps then share one fill instead of each redoing it.
The second launch costs a few microseconds, which only the smallest calls
notice (docs/notes/performance.md, "The Zen 5 machine type").
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from numba import prange

from ._grad_tiles import prepare_kv_tiles
from ._jit import kernel, launch
from ._scratch import key_tile_buffers
from ._tiles import prepare_key_tile


@kernel
def key_tiles_kernel(k, v, kt, v_ok):
    """Transpose every key tile of ``k`` into ``kt`` and check every value tile of ``v``
    (``v_ok``): the forward sweeps' tiles (:func:`~attnnb.cpu._tiles.prepare_key_tile`).

    ``k (B, Hk, Lk, D)``, ``v (B, Hv, Lk, Dv)``, ``kt (B, Hk, n_tiles, D, TILE_K)``,
    ``v_ok (B, Hv, n_tiles)``.
    """
    for task in prange(kt.shape[0] * kt.shape[1] * kt.shape[2]):
        prepare_key_tile(k, v, kt, v_ok, task)


@kernel
def kv_tiles_kernel(k, v, kt, vt, k_ok, v_ok):
    """Transpose and check every key and value tile: the backward sweeps' tiles
    (:func:`~attnnb.cpu._grad_tiles.prepare_kv_tiles`; ``vt (B, Hv, n_tiles, Dv,
    TILE_K)``, ``k_ok (B, Hk, n_tiles)``)."""
    for task in prange(kt.shape[0] * kt.shape[1] * kt.shape[2]):
        prepare_kv_tiles(k, v, kt, vt, k_ok, v_ok, task)


@contextmanager
def filled_key_tiles(k, v, tiles=True):
    """``(kt, v_ok)`` of a forward sweep, filled (:func:`key_tiles_kernel`); with
    ``tiles=False`` (decoding: each task transposes its own tiles) ``kt`` and ``v_ok``
    have no tiles and nothing is launched."""
    with key_tile_buffers(k, v, tiles) as (kt, v_ok):
        if tiles:
            launch(key_tiles_kernel, k, v, kt, v_ok)
        yield kt, v_ok


@contextmanager
def filled_kv_tiles(k, v, tiles=True):
    """``(kt, vt, k_ok, v_ok)`` of a backward pass, filled (:func:`kv_tiles_kernel`);
    with ``tiles=False`` (few query rows: each task transposes its own tiles) all four
    have no tiles and nothing is launched."""
    with key_tile_buffers(k, v, tiles) as (kt, _), key_tile_buffers(v, v, tiles) as (vt, v_ok):
        k_ok = np.empty(kt.shape[:3], np.bool_)
        if tiles:
            launch(kv_tiles_kernel, k, v, kt, vt, k_ok, v_ok)
        yield kt, vt, k_ok, v_ok
