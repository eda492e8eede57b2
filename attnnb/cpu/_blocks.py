"""Register-blocked tile products for the tiled core (no BLAS).

A 64 x 64 ``np.dot`` called from inside ``prange`` reaches ~77 GFLOP/s a
thread; these loops go faster because every shape is a compile-time
constant: :data:`ROWS` query rows times :data:`COLS` columns accumulate in a
small scratch ``blk`` at constant offsets, which LLVM keeps in vector
registers for the whole reduction (one loaded vector, ``ROWS`` broadcasts,
``ROWS`` FMAs a step).  That needs constant offsets (so the rows provably
do not overlap), indices from ``range`` (no wraparound selects) and the
``noalias`` flag (see :func:`attnnb.cpu._jit.blocks`).

Both products have the form ``C[ROWS, COLS] = A[ROWS, n] @ B[n, COLS]``
with ``B`` read row by row:

* logits:  ``S = Q @ K^T`` reads ``B = K^T``, the head's keys transposed tile
  by tile once per call (:func:`attnnb.cpu._tiles.prepare_key_tile`);
* values:  ``T = P @ V`` reads ``B = V`` as stored.
"""

from __future__ import annotations

import numpy as np

from ._jit import blocks, wide_vectors

ROWS = 4
COLS = 64
U = np.uint64


@blocks
def gemm_block(a, a0, lda, n, b, b0, ldb, blk, c0):
    """``blk[c0 + r * COLS + c] = sum_e a[a0 + r * lda + e] * b[b0 + e * ldb + c]``.

    ``r < ROWS``, ``c < COLS``; ``a``, ``b`` and ``blk`` are flat 1-D arrays;
    ``blk`` must not overlap ``a`` or ``b``.  Offsets are non-negative.
    Indices are unsigned so that Numba adds no negative-index wraparound
    (which would turn the vector loads into gathers).
    """
    wide_vectors()
    w = U(COLS)
    o = U(c0)
    for c in range(w):
        blk[o + c] = 0.0
        blk[o + w + c] = 0.0
        blk[o + U(2) * w + c] = 0.0
        blk[o + U(3) * w + c] = 0.0
    ua = U(a0)
    ul = U(lda)
    ub = U(b0)
    ubl = U(ldb)
    for e in range(U(n)):
        x0 = a[ua + e]
        x1 = a[ua + ul + e]
        x2 = a[ua + U(2) * ul + e]
        x3 = a[ua + U(3) * ul + e]
        bo = ub + e * ubl
        for c in range(w):
            y = b[bo + c]
            blk[o + c] += x0 * y
            blk[o + w + c] += x1 * y
            blk[o + U(2) * w + c] += x2 * y
            blk[o + U(3) * w + c] += x3 * y


@blocks
def gemm_row(a, a0, n, b, b0, ldb, blk, c0, width):
    """One row: ``blk[c0 + c] = sum_e a[a0 + e] * b[b0 + e * ldb + c]`` for ``c < width``."""
    wide_vectors()
    o = U(c0)
    uw = U(width)
    for c in range(uw):
        blk[o + c] = 0.0
    ua = U(a0)
    ub = U(b0)
    ubl = U(ldb)
    for e in range(U(n)):
        x0 = a[ua + e]
        bo = ub + e * ubl
        for c in range(uw):
            blk[o + c] += x0 * b[bo + c]
