"""Register-blocked tile products for the tiled core (no BLAS).

These loops are faster than ``np.dot`` called from inside ``prange``
(docs/notes/performance.md, "Figures moved out of the code's comments") because every
shape is a compile-time constant: :data:`ROWS` query rows times :data:`COLS` columns accumulate in a
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

from ._jit import WIDE_REGISTERS, blocks, inner, wide_vectors

ROWS = 4
COLS = 64
# Columns of a block that gemm_block accumulates in one pass over the reduction.
# With AVX-512's 32 registers of 16 floats a whole 4 x 64 block stays in
# registers.  AVX2 has 16 registers of 8 floats: a 4 x 64 block (32 of them)
# spills to the stack on every step (docs/notes/performance.md, "An AVX2 machine type:
# blocks formed 16 columns at a time"), so there the block is formed 16 columns at
# a time (8 accumulators).  Each element is summed in the same order either way: the
# result's bits do not depend on the pass width.
PASS_COLS = COLS if WIDE_REGISTERS else 16
# the column widths of the register blocks, widest first (:func:`block_width`)
BLOCK_WIDTHS = (64, 16)
u64 = np.uint64


@blocks
def gemm_block(a, a0, lda, a_step, n, b, b0, ldb, blk, c0, width, rows):
    """``blk[c0 + r * width + c] = sum_e a[a0 + r * lda + e * a_step] * b[b0 + e * ldb + c]``.

    ``r < rows``, ``c < width``; ``a``, ``b`` and ``blk`` are flat 1-D arrays;
    ``blk`` must not overlap ``a`` or ``b``.  Offsets are non-negative.
    Indices are unsigned so that Numba adds no negative-index wraparound
    (which would turn the vector loads into gathers).

    Callers pass ``width`` and ``rows`` as constants (``rows`` is
    :data:`ROWS` or ``2 * ROWS``; see :func:`block_product` and
    :func:`block_product_add`): the function is always inlined, so each call
    site's copy has constant trip counts and its ``rows x width`` block stays
    in registers (4 x 64 float32: 16 512-bit registers; narrower blocks fewer).
    Without AVX-512 the block is formed :data:`PASS_COLS` columns at a time
    (one pass over the reduction each), so that each pass's accumulators fit
    AVX2's 16 registers; every element sums in the same order either way.
    The rows are written out one by one, because a loop over them inside the
    reduction is not vectorised; rows 4 to 7 fold away when ``rows`` is 4.

    ``A`` is read one element per row and step (broadcast to a vector), so
    it may be stored either way: ``a_step = 1`` reads its rows as stored,
    ``lda = 1`` reads the columns of a stored matrix as its rows, ``A^T``
    without a transposed copy (the backward's ``W^T @ dout`` and ``dS^T @
    q``).  Callers pass the 1 as a constant, so it folds away.
    """
    wide_vectors()
    w = u64(width)
    # columns accumulated in one pass over the reduction (see PASS_COLS)
    part = u64(min(width, PASS_COLS))
    eight = rows == 2 * ROWS
    zero = blk.dtype.type(0.0)
    ul = u64(lda)
    ubl = u64(ldb)
    for p in range(w // part):
        o = u64(c0) + u64(p) * part
        for c in range(part):
            blk[o + c] = 0.0
            blk[o + w + c] = 0.0
            blk[o + u64(2) * w + c] = 0.0
            blk[o + u64(3) * w + c] = 0.0
            if eight:
                blk[o + u64(4) * w + c] = 0.0
                blk[o + u64(5) * w + c] = 0.0
                blk[o + u64(6) * w + c] = 0.0
                blk[o + u64(7) * w + c] = 0.0
        ub = u64(b0) + u64(p) * part
        for e in range(u64(n)):
            ua = u64(a0) + e * u64(a_step)
            x0 = a[ua]
            x1 = a[ua + ul]
            x2 = a[ua + u64(2) * ul]
            x3 = a[ua + u64(3) * ul]
            bo = ub + e * ubl
            x4 = x5 = x6 = x7 = zero
            if eight:
                x4 = a[ua + u64(4) * ul]
                x5 = a[ua + u64(5) * ul]
                x6 = a[ua + u64(6) * ul]
                x7 = a[ua + u64(7) * ul]
            for c in range(part):
                y = b[bo + c]
                blk[o + c] += x0 * y
                blk[o + w + c] += x1 * y
                blk[o + u64(2) * w + c] += x2 * y
                blk[o + u64(3) * w + c] += x3 * y
                if eight:
                    blk[o + u64(4) * w + c] += x4 * y
                    blk[o + u64(5) * w + c] += x5 * y
                    blk[o + u64(6) * w + c] += x6 * y
                    blk[o + u64(7) * w + c] += x7 * y


@blocks
def add_block(dst, d0, ldd, blk, width, rows, r_from, c_from):
    """``dst[d0 + r * ldd + c] += blk[r * width + c]`` for ``r_from <= r < rows`` and
    ``c_from <= c < width``.

    The loops run over the whole constant ``rows x width`` block, and the
    rows and columns before ``r_from`` and ``c_from`` add zero: masked lanes
    rather than loops with variable bounds, which LLVM left scalar.  Adding
    ``+0.0`` leaves every value as it was.
    """
    wide_vectors()
    w = u64(width)
    ud = u64(d0)
    udl = u64(ldd)
    zero = blk.dtype.type(0.0)
    for r in range(u64(rows)):
        for c in range(w):
            x = blk[r * w + c]
            if r < u64(r_from) or c < u64(c_from):
                x = zero
            dst[ud + r * udl + c] += x


@inner
def block_width(cols):
    """The widest of :data:`BLOCK_WIDTHS` that fits in ``cols`` columns, or 0 below 16."""
    if cols >= 64:
        return 64
    if cols >= 16:
        return 16
    return 0


@inner
def padded_width(cols):
    """The narrowest of :data:`BLOCK_WIDTHS` that holds ``cols <= 64`` columns."""
    if cols <= 16:
        return 16
    return 64


@inner
def block_product(a, a0, lda, n, b, b0, ldb, blk, c0, width):
    """:func:`gemm_block` for ``width`` in :data:`BLOCK_WIDTHS`, each width through
    its own constant-width copy (``blk[c0 + r * width + c]``).

    Head sizes and value widths that are not multiples of 64 (16, 32, 40,
    80, 96, 160) are covered by 16-wide blocks instead of single rows: 4
    rows share every loaded vector of ``b``, and the accumulators stay in
    registers.  A 32-wide block is no faster than two 16-wide ones, and each
    width is one more inlined copy to compile.  Narrower than 16 the vectoriser
    gives up (docs/notes/performance.md, "Head sizes, ViT batches and decoding"), so
    there is no 8-wide block: callers reach back over columns they already have
    instead.
    """
    if width == 64:
        gemm_block(a, a0, lda, 1, n, b, b0, ldb, blk, c0, 64, ROWS)
    else:
        gemm_block(a, a0, lda, 1, n, b, b0, ldb, blk, c0, 16, ROWS)


@inner
def block_rows(width, n_rows):
    """Rows of a block of ``width`` columns in :func:`block_product_add`: 8 for a
    16-wide block where ``n_rows >= 8`` rows are there, else :data:`ROWS`; always
    :data:`ROWS` without AVX-512 (8 x 16 accumulators would fill AVX2's 16 registers)."""
    if WIDE_REGISTERS and width == 16 and n_rows >= 2 * ROWS:
        return 2 * ROWS
    return ROWS


@inner
def block_product_add(a, a0, lda, a_step, n, b, b0, ldb, blk, dst, d0, ldd, width, rows,
                      r_from, c_from):
    """``dst[d0 + r * ldd + c] += (A @ B)[r, c]`` for one ``rows x width`` block, less
    the rows before ``r_from`` and the columns before ``c_from`` (:func:`add_block`);
    ``A`` and ``B`` as in :func:`gemm_block`, ``blk`` scratch of ``rows * width``.

    The block is added while it is still in registers: formed by one call and
    added by another with variable bounds, the block goes through memory.  A
    16-wide block takes 8 rows (``width``, ``rows`` from :func:`block_rows`): 4
    rows of one 512-bit register each leave the FMAs waiting on each other's
    latency (docs/notes/performance.md, "Value products that add in registers").
    """
    if width == 64:
        gemm_block(a, a0, lda, a_step, n, b, b0, ldb, blk, 0, 64, ROWS)
        add_block(dst, d0, ldd, blk, 64, ROWS, r_from, c_from)
    elif rows == ROWS:
        gemm_block(a, a0, lda, a_step, n, b, b0, ldb, blk, 0, 16, ROWS)
        add_block(dst, d0, ldd, blk, 16, ROWS, r_from, c_from)
    else:
        gemm_block(a, a0, lda, a_step, n, b, b0, ldb, blk, 0, 16, 2 * ROWS)
        add_block(dst, d0, ldd, blk, 16, 2 * ROWS, r_from, c_from)


@blocks
def gemm_row(a, a0, a_step, n, b, b0, ldb, blk, c0, width):
    """One row: ``blk[c0 + c] = sum_e a[a0 + e * a_step] * b[b0 + e * ldb + c]`` for
    ``c < width`` (``a_step`` as in :func:`gemm_block`)."""
    wide_vectors()
    o = u64(c0)
    uw = u64(width)
    for c in range(uw):
        blk[o + c] = 0.0
    ua = u64(a0)
    ub = u64(b0)
    ubl = u64(ldb)
    for e in range(u64(n)):
        x0 = a[ua + e * u64(a_step)]
        bo = ub + e * ubl
        for c in range(uw):
            blk[o + c] += x0 * b[bo + c]
