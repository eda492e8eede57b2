"""Tile lists and small tile helpers shared by the CPU backward kernels.

The backward sweeps (:mod:`attnnb.cpu.backward`,
:mod:`attnnb.cpu.rectified_backward`) walk the forward's tile lists, read by
query tile for ``dq`` and by key tile for ``dk``/``dv``.
"""

from __future__ import annotations

import numpy as np

from ._blocks import COLS, ROWS
from ._jit import inner
from ._tiles import KEY_BLOCK_ROWS, TILE_K, TILE_Q, tile_is_finite, transpose_tile


def written_whole(shape, dtype) -> np.ndarray:
    """A gradient buffer that a kernel writes element by element before anything reads
    it: not zeroed, since zeroing is a visible part of a small call (docs/notes/performance.md,
    "Gradient buffers left unzeroed").  The tests replace it with NaN-filled buffers, in
    each module that calls it, to see every element written."""
    return np.empty(shape, dtype)


@inner
def prepare_kv_tiles(k, v, kt, vt, k_ok, v_ok, task):
    """Task ``task`` of ``kt.shape[0] * kt.shape[1] * kt.shape[2]`` of the backward's
    prologue (:func:`attnnb.cpu._prologue.kv_tiles_kernel`): transpose key tile
    ``(b, g, t)`` into ``kt`` and check it (``k_ok``), and, once per value head
    (``k`` may hold ``r`` key heads per value head, as the differential layout
    does), transpose and check the value tile (``vt``, ``v_ok``).  ``kt``: ``(B,
    Hk, n_tiles, D, TILE_K)``; ``vt``: ``(B, Hv, n_tiles, Dv, TILE_K)``; ``k_ok
    (B, Hk, n_tiles)``, ``v_ok (B, Hv, n_tiles)``.
    """
    Hk, n_kt = kt.shape[1], kt.shape[2]
    b, g, t = task // (Hk * n_kt), (task // n_kt) % Hk, task % n_kt
    j0 = t * TILE_K
    transpose_tile(k, kt, b, g, j0)
    k_ok[b, g, t] = tile_is_finite(k[b, g], j0)
    r = Hk // vt.shape[1]
    if g % r == 0:
        transpose_tile(v, vt, b, g // r, j0)
        v_ok[b, g // r, t] = tile_is_finite(v[b, g // r], j0)


@inner
def pair_scratch(dt, d, dv):
    """Flat scratch of one backward task: ``(q_flat, do_flat)`` rows of queries and
    cotangents, six ``TILE_Q x TILE_K`` tile buffers, a product block, and the dropout
    generator's ``TILE_K`` column words (int64)."""
    tile = TILE_Q * TILE_K
    return (np.empty(TILE_Q * d, dt), np.empty(TILE_Q * dv, dt), np.empty(tile, dt),
            np.empty(tile, dt), np.empty(tile, dt), np.empty(tile, dt), np.empty(tile, dt),
            np.empty(tile, dt), np.empty(ROWS * COLS, dt), np.empty(TILE_K, np.int64))


@inner
def stored_keys_scratch(dt, d, dv, used):
    """Flat scratch of a backward task whose pair products read full key tiles as stored
    (:func:`attnnb.cpu._tiles.tile_logits_keys`): ``(qt_flat, dot_flat, St_flat)``, the
    pair's query and cotangent rows transposed and the products' ``S^T``; empty unless
    ``used``."""
    rows = KEY_BLOCK_ROWS if used else 0
    return (np.empty(d * rows, dt), np.empty(dv * rows, dt), np.empty(TILE_K * rows, dt))


def read_only(a):
    """``a`` marked read-only (in place; callers pass arrays they just made)."""
    a.flags.writeable = False
    return a


def dense_tiles(Lq, Lk, causal, visible=None):
    """The dense (or causal) problem's tile lists: ``(row_ptr, row_kt, row_full)``.

    Query tile ``qt`` sees key tiles ``0 .. last - 1`` (all of them, or up to its
    last row's causal limit), and of those only the ``visible`` ones when given
    (bool ``(n_qt, n_kt)``: a mask's tiles that some row may attend,
    :func:`attnnb.cpu._mask_tiles.visible_tiles`); ``full`` is True throughout
    (the causal diagonal and a mask are applied per element by
    ``modify_logits``, not from a pattern).  Typed as a pattern's tile lists
    (:class:`attnnb.patterns.BlockLayout`: int64, int32 and bool, read-only):
    Numba compiles a kernel once per argument types, so dense and sparse
    gradients then share one compiled ``dq`` kernel.
    """
    n_qt, n_kt = -(-Lq // TILE_Q), -(-Lk // TILE_K)
    diag = Lk - Lq if causal else Lk
    i_last = np.minimum(np.arange(1, n_qt + 1) * TILE_Q, Lq) - 1
    last = np.clip((i_last + diag) // TILE_K + 1, 0, n_kt)
    seen = np.arange(n_kt)[None, :] < last[:, None]
    if visible is not None:
        seen &= visible
    qt, kt = np.nonzero(seen)  # row-major: by query tile, key tiles increasing
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(qt, minlength=n_qt))])
    return (read_only(row_ptr.astype(np.int64)), read_only(kt.astype(np.int32)),
            read_only(np.ones(kt.size, np.bool_)))


def by_key_tile(row_ptr, row_kt, row_full, n_qt, n_kt):
    """The same tile lists read by key tile: ``(col_ptr, col_qt, col_full)``.

    Rows of the input are ``p_heads * n_qt`` (pattern head, query tile); the
    output's columns are ``p_heads * n_kt`` (pattern head, key tile), each
    listing its query tiles in increasing order.  O(tiles), once per call.
    """
    counts = np.diff(row_ptr)
    rows = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    col = (rows // n_qt) * n_kt + row_kt
    order = np.argsort(col, kind="stable")
    n_cols = (counts.size // max(n_qt, 1)) * n_kt
    col_ptr = np.concatenate([[0], np.cumsum(np.bincount(col, minlength=n_cols))])
    return (col_ptr.astype(np.int64), (rows % max(n_qt, 1))[order].astype(np.int64),
            np.ascontiguousarray(row_full[order]))
