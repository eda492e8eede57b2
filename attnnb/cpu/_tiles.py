"""The shared inner loops of the CPU tiled core.

Every CPU attention kernel (dense, sparse, top-k, differential) is a sweep
over key tiles for one (batch, head, query tile) task with an online
(running-maximum) normaliser, as in FlashAttention.  The kernels differ only
in *which* key tiles they visit and how they combine results; the loops
that touch every score live here, once:

* :func:`tile_logits_t`    -- ``S = q_tile @ k_tile.T`` (q pre-scaled) from the
  head's keys transposed tile by tile (:func:`prepare_key_tile`, into
  :func:`attnnb.cpu._scratch.key_tile_buffers`, or by the task itself with
  :func:`transpose_keys` when decoding), register-blocked; below 4 query rows
  :func:`tile_logits_rows` takes dot products with the keys as stored instead,
  and from 4 to 16 rows :func:`tile_logits_keys` reads the keys as stored
  against the queries transposed (:data:`attnnb.cpu._decoding.LOGITS_FROM_KEYS`)
* :func:`modify_logits`    -- bias, element masks, causal diagonal,
  ``relu_expm1``'s factor, ``log(key_size)``
* :func:`online_update`    -- running max / sum, ``acc = acc * alpha + P @ v_tile``
* :func:`finish_rows`      -- normaliser-specific division, LSE, empty and NaN rows

Scratch buffers are flat 1-D arrays allocated once per task and viewed as
``(rows, cols)`` tiles with ``reshape`` (a view: no allocation in the key
loop).  Tile sizes are module constants, so Numba compiles them in.

Normalizer codes: ``SOFTMAX = 0``, ``SOFTMAX1 = 1``, ``RELU_EXPM1 = 2``, ``SIGMOID = 3``
(no running maximum: each weight is ``key_size * sigmoid(s)`` on its own, the
output the sum ``acc`` itself), ``SOFTPICK = 4`` (numerators ``relu(e^s - 1)``
over the sum of ``|e^s - 1|``, shifted by a running maximum of at least 0; its
``eps`` enters as a sink of logit ``log eps``).
"""

from __future__ import annotations

import math

import numpy as np

from .._core import scalars as _scalars
from .._core.codes import RELU_EXPM1, SIGMOID, SOFTMAX1, SOFTPICK
from ._blocks import (
    COLS,
    ROWS,
    block_product,
    block_product_add,
    block_rows,
    block_width,
    gemm_row,
    padded_width,
    u64,
)
from ._dropout import drop_tile
from ._exp import (
    exp_shifted,
    exp_shifted_sum_at,
    exp_tile_accumulate,
    maxnum,
    relu_expm1_factors,
    sigmoid_tile_accumulate,
    sum_at,
)
from ._jit import blocks, inner, wide_vectors
from ._numba_patches.views import flat, rows_of
from ._vector_ir import prefetch_line, row_max_64, transpose_16

TILE_Q = 64
TILE_K = COLS  # 64: the register blocks' width

# Query rows per task of the kernels that sweep a contiguous range of key
# tiles (dense, differential): twice TILE_Q halves the key and value tiles
# streamed per query (a 128-row task's scratch still fits in L2), which was faster
# at N = 2048-4096 (docs/notes/performance.md, "Figures moved out of the code's comments").
# The sparse and top-k
# kernels keep TILE_Q: a pattern's tiles are chosen per 64 query rows, and
# wider tasks would visit the union of two rows' tile lists.
SWEEP_TILE_Q = 128

# Lazy rescaling: the running max used as the exponent's shift moves only
# when a tile's max exceeds it by more than this (natural units), so most
# tiles skip ``acc *= alpha``; weights then reach at most exp(LAZY) ~ 3e3,
# far from float32 overflow.
LAZY = 8.0



@inner
def task_rows(task, n_heads, n_qt, tile_q, Lq):
    """``(b, h, qt, i0, nq)`` of one task of ``B * n_heads * n_qt`` (batch-major, then
    head, then query tile ``qt``): its query rows are ``i0 : i0 + nq``."""
    qt = task % n_qt
    i0 = qt * tile_q
    return task // (n_heads * n_qt), (task // n_qt) % n_heads, qt, i0, min(tile_q, Lq - i0)


@inner
def task_scratch(q, rows, dv):
    """One task's flat scratch for ``rows`` query rows, in ``q``'s dtype:
    ``(q_flat, S_flat, P_flat, F_flat, T_flat)`` for the scaled queries
    (``rows * D``), the logits, the weights, ``relu_expm1``'s factors (``rows *
    TILE_K`` each) and the value products (``rows * dv``)."""
    d, dt = q.shape[-1], q.dtype
    return (np.empty(rows * d, dt), np.empty(rows * TILE_K, dt), np.empty(rows * TILE_K, dt),
            np.empty(rows * TILE_K, dt), np.empty(rows * dv, dt))


@inner
def online_state(q, nq, dv):
    """``(m, l, acc)`` before the first key tile: running shift ``-inf``, sum 0,
    accumulator ``(nq, dv)`` zeros, in ``q``'s dtype (see :func:`online_update`)."""
    return np.full(nq, -np.inf, q.dtype), np.zeros(nq, q.dtype), np.zeros((nq, dv), q.dtype)


@inner
def key_tiles_seen(i0, nq, diag, n_kt):
    """Key tiles ``0 .. last - 1`` that rows ``i0 : i0 + nq`` may see: all ``n_kt``,
    or with a causal limit (``j > i + diag`` masked) those up to the last row's limit."""
    return min(n_kt, max(0, (i0 + nq - 1 + diag) // TILE_K + 1))


@inner
def view2d(buffer, rows, cols):
    """A ``(rows, cols)`` C-contiguous view of the start of a flat scratch buffer."""
    return rows_of(buffer, rows, cols)


@inner
def scaled_rows(x, i0, n, scale, dst_flat):
    """Copy rows ``i0:i0+n`` of ``x`` times ``scale`` into scratch; return the view."""
    d = x.shape[1]
    dst = view2d(dst_flat, n, d)
    for r in range(n):
        for c in range(d):
            dst[r, c] = x[i0 + r, c] * scale
    return dst


@inner
def tile_logits_t(qs, kth, j0, nk, S_flat):
    """``S = qs @ K[j0:j0+nk].T`` as an ``(nq, nk)`` view of ``S_flat``.

    ``kth`` is this head's keys transposed tile by tile, ``(n_tiles, D,
    TILE_K)`` C-contiguous (one slice of :func:`prepare_key_tile`'s ``kt``; ``j0`` a
    multiple of ``TILE_K``); ``qs`` is ``(nq, D)`` C-contiguous; ``S_flat``
    holds at least ``nq * TILE_K`` elements.  Each key tile is one contiguous
    ``D x TILE_K`` block: with the keys transposed as a whole, ``(D, Lk)``,
    the tile's rows lie ``4 Lk`` bytes apart, a power of two for the usual
    lengths, so they compete for the same few L1 sets (docs/notes/performance.md,
    "Figures moved out of the code's comments").

    Register-blocked (:mod:`attnnb.cpu._blocks`), no BLAS, in 4-row blocks
    (the last block reaches back over rows already done, which it writes
    again with the same values).  A partial last key tile is computed in the
    narrowest block width that holds it (16 or 64), over the tile's zero padding
    (:func:`transpose_tile`), and then packed to ``nk`` columns: at N = 197
    (a ViT's tokens) the 5 keys of the last tile cost a quarter of a full
    tile instead of as much as one row by row.  Fewer than 4 rows go row
    by row.
    """
    nq, d = qs.shape
    queries = flat(qs)
    keys_t = flat(kth[j0 // TILE_K])
    if nq < ROWS:
        for r in range(nq):
            gemm_row(queries, r * d, 1, d, keys_t, 0, TILE_K, S_flat, r * nk, nk)
        return view2d(S_flat, nq, nk)
    w = padded_width(nk)
    r0 = 0
    while r0 < nq:
        rs = min(r0, nq - ROWS)
        block_product(queries, rs * d, d, d, keys_t, 0, TILE_K, S_flat, rs * w, w)
        r0 = rs + ROWS
    if w != nk:  # pack rows of w columns to nk, front to back (each moves left)
        for r in range(1, nq):
            for c in range(nk):
                S_flat[r * nk + c] = S_flat[r * w + c]
    return view2d(S_flat, nq, nk)


@blocks
def _dot(a, a0, b, b0, n):
    """``sum_e a[a0 + e] * b[b0 + e]`` for ``e < n``, vectorised over ``e``."""
    wide_vectors()
    acc = a.dtype.type(0.0)  # in the arrays' dtype (a float64 literal would promote it)
    ua = u64(a0)
    ub = u64(b0)
    for e in range(u64(n)):
        acc += a[ua + e] * b[ub + e]
    return acc


@inner
def tile_logits_rows(qs, kh, j0, nk, S_flat):
    """``S = qs @ kh[j0:j0+nk].T`` as an ``(nq, nk)`` view of ``S_flat``, from the keys
    as stored: one dot product per (query, key).

    For fewer than 4 query rows (decoding), where transposing a key tile for
    :func:`tile_logits_t` costs more than the dot products (docs/notes/performance.md,
    "Figures moved out of the code's comments").
    ``kh (Lk, D)`` and ``qs (nq, D)`` C-contiguous.
    """
    nq, d = qs.shape
    queries = flat(qs)
    keys = flat(kh)
    for r in range(nq):
        for c in range(nk):
            S_flat[r * nk + c] = _dot(queries, r * d, keys, (j0 + c) * d, d)
    return view2d(S_flat, nq, nk)


# query columns of :func:`tile_logits_keys`' blocks (a register block's narrowest width)
KEY_BLOCK_ROWS = 16


@inner
def transposed_queries(qs, qt):
    """``qt[e, r] = qs[r, e]`` for the ``nq <= 16`` scaled query rows ``qs (nq, D)`` and
    zeros in the columns past ``nq``: ``qt (D, KEY_BLOCK_ROWS)``, once per task, for
    :func:`tile_logits_keys`."""
    nq, d = qs.shape
    for e in range(d):
        for r in range(KEY_BLOCK_ROWS):
            qt[e, r] = qs[r, e] if r < nq else 0.0


@inner
def tile_logits_keys(qt, kh, vh, j0, nq, St_flat, S_flat, fetch):
    """``S = qs @ kh[j0:j0+TILE_K].T`` for a full key tile and ``nq <= 16`` query rows, as
    an ``(nq, TILE_K)`` view of ``S_flat``, from the keys as stored; with ``fetch``
    prefetches the next tile of ``kh`` and ``vh``.

    Decoding's tasks would otherwise transpose each key tile for :func:`tile_logits_t`
    and use it for 16 rows at most, a transpose that costs more than it saves
    (docs/notes/performance.md, "Decoding from the keys as stored").  Here
    the keys are the broadcast operand of the register blocks (4 keys by 16 query
    columns of ``qt``, :func:`transposed_queries`), which gives ``S^T`` in
    ``St_flat`` (``TILE_K * 16``), transposed to ``S`` by four 16 x 16 copies (a
    quarter of the key tile's).  Each logit is the same chain of FMAs over the
    depth, in the same order, as in :func:`tile_logits_t`: the same bits.  The
    columns past ``nq`` are computed over zeros and dropped.

    With ``fetch`` each block of 4 keys also prefetches the same 4 rows of the
    next tile of ``kh`` and of ``vh`` (the keys and the values; the backward's
    second product, ``dout v^T``, passes the values as ``kh`` and no ``fetch``),
    when that tile is whole (:func:`~attnnb.cpu._vector_ir.prefetch_line`):
    spread over the products, the memory traffic of a call that reads every key
    and value once overlaps the FMAs (prefetching a whole tile at the tile's
    start did not).  ``kh (Lk, D)``, ``vh (Lk, Dv)``
    C-contiguous; ``qt (D, 16)``.  Used by the decoding forward and backward.
    """
    d, dv = kh.shape[1], vh.shape[1]
    keys = flat(kh)
    values = flat(vh)
    queries = flat(qt)
    ahead = fetch and j0 + 2 * TILE_K <= kh.shape[0]
    line = 64 // kh.itemsize  # elements of a 64-byte cache line
    for c0 in range(0, TILE_K, ROWS):
        block_product(keys, (j0 + c0) * d, d, d, queries, 0, KEY_BLOCK_ROWS, St_flat,
                      c0 * KEY_BLOCK_ROWS, KEY_BLOCK_ROWS)
        if ahead:
            j = j0 + TILE_K + c0
            for e in range(j * d, (j + ROWS) * d, line):
                prefetch_line(keys, e)
            for e in range(j * dv, (j + ROWS) * dv, line):
                prefetch_line(values, e)
    St = view2d(St_flat, TILE_K, KEY_BLOCK_ROWS)
    S16 = view2d(S_flat, KEY_BLOCK_ROWS, TILE_K)
    for c0 in range(0, TILE_K, 16):
        transpose_16(St, c0, 0, S16, 0, c0)
    return view2d(S_flat, nq, TILE_K)


@inner
def values_product(P, vh, j0, acc, T_flat):
    """``acc += P @ vh[j0:j0+nk]``: the online softmax's weighted values, and ``dq``'s
    ``dS @ k_tile`` (:func:`weighted_rows`; ``P`` is ``(nq, nk)`` C-contiguous)."""
    nq, nk = P.shape
    weighted_rows(flat(P), nk, 1, nq, nk, vh, j0, acc, T_flat)


@inner
def transposed_values_product(Pt, vh, j0, acc, T_flat):
    """``acc += Pt.T @ vh[j0:j0+n]`` for ``Pt (n, m)`` C-contiguous: the backward's
    ``W^T @ dout`` and ``dS^T @ q``, read from the weight tile as it is
    (:func:`weighted_rows`): a transposed copy of the tile, twice per (query tile,
    key tile) pair, cost more."""
    n, m = Pt.shape
    weighted_rows(flat(Pt), 1, m, m, n, vh, j0, acc, T_flat)


@inner
def key_run(nk, row_bytes):
    """Keys per pass of :func:`weighted_rows` over value rows ``row_bytes`` apart.

    A 64-key column block of values whose rows are a multiple of 1 KiB apart falls
    on 16 or fewer of L1's 64 sets (4 KiB a way), more lines to a set than the 8-12
    ways of the project's machines, so each row block read it again from L2
    (docs/notes/performance.md, "Value rows 1 KiB apart, and the Xeon type's table").
    Such widths take the keys in runs that fit: 32 keys at 1 KiB
    (or 3 KiB) periods, 16 at 2 KiB, 8 at 4 KiB; every other width all ``nk`` at once.
    """
    period = row_bytes % 4096
    run = nk
    if period == 0:
        run = 8
    elif period == 2048:
        run = 16
    elif period % 1024 == 0:
        run = 32
    return min(run, nk)


@inner
def weighted_rows(p, row_step, step, nq, nk, vh, j0, acc, T_flat):
    """``acc[r] += sum_e P[r, e] * vh[j0 + e]`` with ``P[r, e] = p[r * row_step + e * step]``
    (``r < nq``, ``e < nk``): one of ``row_step``, ``step`` is 1 (:func:`values_product`,
    :func:`transposed_values_product`).

    Register-blocked (:func:`~attnnb.cpu._blocks.block_product_add`) in
    column blocks of 64 or 16 value columns (a value width of 80 is 64 + 16,
    160 is 64 + 64 + 16 + 16), each swept over the rows in blocks of 4 rows
    (64 wide) or 8 (16 wide, :func:`~attnnb.cpu._blocks.block_rows`).  Where
    fewer than 16 columns or a block's rows remain, the last block reaches
    back over columns or rows an earlier block added, and adds only its new
    part (40 is 16 + 16 + the last 8 of a 16-wide block), so that only value
    widths below 16 and tiles of fewer than 4 rows go row by row.  Summing
    the tile on its own and then adding keeps one long FMA chain over every
    key out (it lost accuracy: 2.5e-6).  Value rows a multiple of 1 KiB apart
    (``Dv = 256`` float32, 128 float64) take the keys in runs (:func:`key_run`),
    each run swept over every column block before the next.  ``acc`` is
    C-contiguous ``(nq, Dv)``; ``T_flat`` holds at least ``ROWS * COLS`` elements.
    """
    dv = acc.shape[1]
    v = flat(vh)
    acc_flat = flat(acc)
    if dv >= 16 and nq >= ROWS:
        kc = key_run(nk, dv * v.itemsize)
        e0 = 0  # keys added so far
        while e0 < nk:
            ne = min(kc, nk - e0)
            c0 = 0  # columns added so far
            while c0 < dv:
                w = block_width(dv - c0)
                cs = c0
                if w == 0:
                    w = 16
                    cs = dv - 16
                rows = block_rows(w, nq)
                r0 = 0  # rows of these columns added so far
                while r0 < nq:
                    rs = min(r0, nq - rows)
                    block_product_add(p, rs * row_step + e0 * step, row_step, step, ne, v,
                                      (j0 + e0) * dv + cs, dv, T_flat, acc_flat, rs * dv + cs,
                                      dv, w, rows, r0 - rs, c0 - cs)
                    r0 = rs + rows
                c0 = cs + w
            e0 += ne
        return
    for r in range(nq):
        c0 = 0
        while c0 < dv:
            w = min(COLS, dv - c0)
            if w == COLS:
                gemm_row(p, r * row_step, step, nk, v, j0 * dv + c0, dv, T_flat, 0, COLS)
            else:
                gemm_row(p, r * row_step, step, nk, v, j0 * dv + c0, dv, T_flat, 0, w)
            for c in range(w):
                acc_flat[r * dv + c0 + c] += T_flat[c]
            c0 += w


@inner
def factor_tile(F_flat, S, normalizer):
    """The tile of :func:`modify_logits`'s factors for logits ``S``: an ``(nq, nk)`` view
    of ``F_flat`` where the normalizer has factors (``relu_expm1``, ``sigmoid``), else
    ``S`` itself (never written)."""
    nq, nk = S.shape
    if normalizer == RELU_EXPM1 or normalizer == SIGMOID or normalizer == SOFTPICK:
        return view2d(F_flat, nq, nk)
    return S


@inner
def modify_logits(S, F, i0, j0, diag, bias_bh, has_bias, mask_bh, has_mask, logks_b, has_ks,
                  normalizer):
    """Turn raw logits into the values the online softmax sweeps over.

    In order: add ``bias``; set keys outside the allowed set (``mask`` false,
    or beyond the causal limit ``j > i + diag``) to ``-inf``; for
    ``relu_expm1`` store the factor ``1 - exp(-s)`` in ``F`` and drop
    ``s <= 0``; add ``log(key_size)`` (for ``sigmoid`` and ``softpick`` store
    ``key_size`` in ``F`` instead, 1 without key sizes).

    Parameters
    ----------
    S : ``(nq, nk)`` logits for queries ``i0..`` and keys ``j0..``, modified in place.
    F : ``(nq, nk)`` scratch, written only for ``relu_expm1``, ``sigmoid`` and
        ``softpick``.
    diag : int
        Causal offset ``Lk - Lq``; pass a value ``>= Lk`` for no causal limit
        in this tile.
    bias_bh, mask_bh : ``(Lq, Lk)`` views for this batch and head (ignored when
        the matching ``has_*`` flag is False).
    logks_b : ``(Lk,)`` log key sizes for this batch.
    """
    nq, nk = S.shape
    ninf = -np.inf
    if has_bias:
        along_keys = bias_bh.strides[1] != 0
        for r in range(nq):
            brow = bias_bh[i0 + r]
            if along_keys:
                for c in range(nk):
                    S[r, c] += brow[j0 + c]
            else:  # one bias for the row's keys (sigmoid's b, a per-head bias): vectorises
                x = brow[0]
                for c in range(nk):
                    S[r, c] += x
    if normalizer == SOFTPICK and has_bias:  # a -inf bias leaves its key allowed:
        lowest = -np.finfo(S.dtype).max  # |e^s - 1| = 1 in the denominator, unlike a mask
        for r in range(nq):
            for c in range(nk):
                S[r, c] = max(S[r, c], lowest)  # (NaN stays NaN)
    if has_mask:
        for r in range(nq):
            for c in range(nk):
                if not mask_bh[i0 + r, j0 + c]:
                    S[r, c] = ninf
    if j0 + nk - 1 > i0 + diag:  # the causal limit cuts this tile
        for r in range(nq):
            for c in range(max(0, i0 + r + diag + 1 - j0), nk):
                S[r, c] = ninf
    if normalizer == RELU_EXPM1:
        for r in range(nq):
            relu_expm1_factors(S[r], F[r], nk)
            for c in range(nk):  # drop s <= 0; a NaN logit stays, to propagate
                S[r, c] = ninf if S[r, c] <= 0.0 else S[r, c]
    if normalizer == SIGMOID or normalizer == SOFTPICK:  # one exp a key, not a logit
        for c in range(nk if nq else 0):
            F[0, c] = math.exp(logks_b[j0 + c]) if has_ks else 1.0
        for r in range(1, nq):
            for c in range(nk):
                F[r, c] = F[0, c]
    elif has_ks:
        for r in range(nq):
            for c in range(nk):
                S[r, c] += logks_b[j0 + c]


@blocks
def row_max(x, x0, n):
    """``max(x[x0:x0+n])`` (``-inf`` for ``n == 0``), vectorised.

    LLVM's ``maxnum`` ignores NaN operands; NaN handling is left to the
    caller (a NaN logit makes the row's sum of weights NaN).
    """
    wide_vectors()
    o = u64(x0)
    mx = x[o]
    if n == COLS:  # a full tile: a constant trip count
        for c in range(u64(COLS)):
            mx = maxnum(mx, x[o + c])
        return mx
    for c in range(u64(n)):
        mx = maxnum(mx, x[o + c])
    return mx


@inner
def tile_row_max(x, out, nq):
    """``out[r] = max(x[r * 64 : (r + 1) * 64])`` for ``r < nq``: a full tile in one call
    (:func:`attnnb.cpu._vector_ir.row_max_64`; ``x`` flat and C-contiguous)."""
    for r in range(nq):
        out[r] = row_max_64(x, r * COLS)


@inner
def online_update(S, F, m, l, acc, P_flat, T_flat, vh, j0, v_finite, normalizer, dropout,
                  keys, words):
    """Fold one tile of modified logits into the running max, sum and accumulator:
    :func:`online_weights`, the dropped weights zeroed after they entered the sum
    (:func:`~attnnb.cpu._dropout.drop_tile`, rows keyed by ``keys``), then ``acc +=
    P @ v_tile`` (:func:`add_weighted_values`)."""
    P = online_weights(S, F, m, l, acc, P_flat, normalizer)
    drop_tile(P, dropout, keys, j0, words)
    add_weighted_values(P, vh, j0, v_finite, acc, T_flat)


@inner
def online_weights(S, F, m, l, acc, P_flat, normalizer):
    """One tile's weights ``P`` (an ``(nq, nk)`` view of ``P_flat``), folded into the
    running max and sum, with ``acc`` rescaled to the new shift; the caller adds
    ``P @ v_tile`` (:func:`online_update`, or after dropping weights).

    ``m`` (the running shift, ``-inf`` before any allowed key, NaN once a NaN
    logit was seen), ``l`` (running sum of ``exp(s - m)``) and ``acc``
    (running ``sum exp(s - m) v``) are rows of the task's state.  ``m`` moves
    only when a tile's max exceeds it by more than :data:`LAZY` (lazy
    rescaling), so ``m`` is an upper bound of the row's max up to ``LAZY``,
    and ``m + log(l)`` is still the exact LSE.

    A rescaling whose factor underflows to 0 clears the accumulator rather
    than multiply it: a value behind a weight that has underflowed leaves no
    trace (the rule in :mod:`attnnb.reference._common`).

    For ``relu_expm1`` the weight is ``exp(S) * F`` with ``F = 1 - exp(-s)``,
    about ``s`` for a tiny logit.  A factor below ``2**-40`` is folded into the
    logit (``S += log F``, ``F = 1``), so that the shift follows the largest
    weight within ``40 ln 2 + LAZY`` even when every positive logit of a row
    is tiny: otherwise the row's weights, sum and products are subnormal and
    lose their digits (and ``1 / l`` overflows).  Larger factors keep the
    cheaper product.
    """
    nq, nk = S.shape
    dv = acc.shape[1]
    s = flat(S)
    P = view2d(P_flat, nq, nk)
    if normalizer == SIGMOID:
        return sigmoid_weights(S, F, m, l, P)
    if normalizer == SOFTPICK:
        return softpick_weights(S, F, m, l, acc, P)
    if normalizer == RELU_EXPM1:
        for r in range(nq):
            frow = F[r]
            srow = S[r]
            # count first, branch-free: a factor of 0 (a key not counted) beside positive
            # ones made the test a coin toss for the branch predictor (~3 ns a logit)
            tiny = 0
            for c in range(nk):
                f = frow[c]
                tiny += 1 if (f < 9.094947017729282e-13) & (f > 0.0) else 0  # 2**-40
            if tiny == 0:
                continue
            for c in range(nk):
                f = frow[c]
                if f < 9.094947017729282e-13 and f > 0.0:  # F = 0: not counted
                    srow[c] += math.log(f)
                    frow[c] = 1.0
    # per row: the max, and the shift m[r] it moves (lazily)
    full = nk == COLS
    if full:  # the row maxima go to the start of P_flat, written over below
        tile_row_max(s, P_flat, nq)
    for r in range(nq):
        o = r * nk
        mo = m[r]
        if mo != mo:
            continue
        mx = P_flat[r] if full else row_max(s, o, nk)
        if mx == -np.inf:  # nothing allowed here, unless the maximum skipped NaN logits
            for c in range(nk):
                if s[o + c] != s[o + c]:
                    m[r] = np.nan
            continue
        if not mx <= mo + LAZY:  # also for mo == -inf and for a NaN mx
            alpha = math.exp(mo - mx)
            l[r] *= alpha
            arow = acc[r]
            if alpha == 0.0:
                # the earlier weights all underflow to 0, and so do their terms, Inf or
                # NaN values included (multiplying would make 0 * inf = NaN)
                arow[:] = 0.0
            else:
                for c in range(dv):
                    arow[c] *= alpha
            m[r] = mx
    # the weights and their sums: a whole tile per call where it is full
    if full and normalizer != RELU_EXPM1:
        exp_tile_accumulate(s, P_flat, m, l, nq)
    for r in range(nq):
        o = r * nk
        sh = m[r]
        if sh == -np.inf or sh != sh:
            P_flat[o:o + nk] = 0.0
            continue
        if not full or normalizer == RELU_EXPM1:
            total = exp_shifted_sum_at(s, o, P_flat, o, sh, nk)
            if normalizer == RELU_EXPM1:
                frow = F[r]
                for c in range(nk):
                    P_flat[o + c] *= frow[c]
                total = sum_at(P_flat, o, nk)  # not in the loop above: see sum_at
            l[r] += total
        if l[r] != l[r]:  # a NaN logit, or +inf: the row is NaN
            m[r] = np.nan
            P_flat[o:o + nk] = 0.0
    return P


@inner
def sigmoid_weights(S, F, m, l, P):
    """:func:`online_weights` for ``sigmoid``: ``P = F * sigmoid(S)`` (``F`` the key sizes),
    ``l += sum P``; ``m`` only marks rows: 0 once they have a key, NaN once a NaN
    logit was seen (no shift: every weight is below its key size).  ``S`` is
    overwritten."""
    nq, nk = S.shape
    sigmoid_tile_accumulate(flat(S), flat(F), flat(P), m, l, nq, nk)
    for r in range(nq):
        if m[r] != m[r] or l[r] != l[r]:
            m[r] = np.nan
            P[r, :] = 0.0
        elif m[r] == -np.inf:
            m[r] = 0.0
    return P


@inner
def softpick_weights(S, F, m, l, acc, P):
    """:func:`online_weights` for ``softpick``: with the shift ``m >= 0`` (moved lazily, as
    softmax's), ``P = F max(0, e^(S - m) - e^-m)`` and ``l += sum F |e^(S - m) - e^-m|``
    (``F`` the key sizes): the numerators and the denominator in units of ``e^m``,
    the exponentials from the vectorised :func:`~attnnb.cpu._exp.exp_shifted`,
    each term at most ``F``; the differences lose digits near ``s = 0`` only where
    the terms are small against the row's (``e^-m <= 1``)."""
    nq, nk = S.shape
    dv = acc.shape[1]
    s, f, p = flat(S), flat(F), flat(P)
    zero = s.dtype.type(0.0)
    for r in range(nq):
        mo = m[r]
        o = u64(r * nk)
        if mo != mo:
            p[o:o + nk] = 0.0
            continue
        # the shift stays >= 0, so e^-m <= 1 too; a NaN logit is not a maximum (the
        # row's sum finds it)
        mx = max(0.0, row_max(s, o, nk))
        if not mx <= mo + LAZY:  # also for mo == -inf
            if mo != -np.inf:
                alpha = math.exp(mo - mx)
                l[r] *= alpha
                for c in range(dv):
                    acc[r, c] = 0.0 if alpha == 0.0 else acc[r, c] * alpha
            m[r] = mx
        sh = m[r]
        floor = s.dtype.type(math.exp(-sh))
        exp_shifted(S[r], P[r], sh, nk)  # e^(s - m): then |e^(s - m) - e^-m| by selects
        total = zero
        for c in range(u64(nk)):  # every allowed key counts (a NaN one too), a masked one not
            term = f[o + c] * abs(p[o + c] - floor)
            total += term if s[o + c] != -np.inf else zero
        for c in range(u64(nk)):  # the numerators: the keys above 0 only
            p[o + c] = f[o + c] * max(p[o + c] - floor, zero)
        l[r] += total
        if l[r] != l[r] or m[r] != m[r]:  # a NaN logit, or +inf: the row is NaN
            m[r] = np.nan
            p[o:o + nk] = 0.0
    return P


@inner
def add_weighted_values(P, vh, j0, v_finite, acc, T_flat):
    """``acc += P @ vh[j0:j0+nk]``; with a non-finite value tile, zero weights are skipped.

    The tile's product is summed on its own and then added
    (:func:`values_product`).  Skipping zero weights when the value tile holds
    NaN or Inf (``v_finite`` False) keeps a masked key (or a dropped one) out of
    a row, even as NaN.

    The finite case is the online softmax's register-blocked product
    (:func:`~attnnb.cpu._tiles.values_product`); ``P`` and ``acc`` C-contiguous.
    """
    nq, nk = P.shape
    dv = acc.shape[1]
    vt = vh[j0 : j0 + nk]
    if v_finite:
        values_product(P, vh, j0, acc, T_flat)
    else:
        for r in range(nq):
            for c in range(nk):
                p = P[r, c]
                if p != 0.0:
                    for d in range(dv):
                        acc[r, d] += p * vt[c, d]


@inner
def finish_rows(acc, m, l, normalizer, sink, out_rows, lse_rows):
    """Write ``out = acc / Z`` and ``lse = m + log(l)`` for a task's rows.

    Rows whose allowed set is empty, or whose weights sum to zero, get zeros
    and ``lse = -inf``; rows that met a NaN logit get NaN.  For ``softmax1``
    ``Z = l + exp(sink - m)`` (the ``+e^sink`` in units of ``exp(m)``: 1 for
    ``sink = 0``, a learned sink otherwise); the LSE excludes it.  For
    ``softpick`` ``Z = l + eps e^-m``: its ``eps`` is the sink ``e^sink``.

    ``Z`` may be out of reach of a plain ``acc * (1 / Z)``.  ``softmax1``'s
    ``exp(sink - m)`` overflows for very negative logits, so ``acc / Z`` is taken as
    ``(acc / l) * sigmoid(lse - sink)``: in that order, and in two passes, so that
    the fast-math reassociation cannot form ``sigmoid(lse) / l`` (subnormal
    when ``m`` is).  ``relu_expm1``'s ``l`` would be tiny when all the row's
    positive logits are (``phi(s) ~ s``); :func:`online_update` keeps it
    near 1, and should a sum below ``4 / finfo.max`` (where ``1 / l``
    overflows) still arrive, the power of two of ``l`` is divided out of
    ``acc`` exactly (``frexp`` / ``ldexp``) before the reciprocal.  The test
    is on ``l``, not on ``1 / l``: under the fast-math flags LLVM may
    evaluate ``1 / l`` in ``l``'s dtype whatever its Numba type.
    """
    nq, dv = acc.shape
    l_min = 4.0 / np.finfo(l.dtype).max
    for r in range(nq):
        if m[r] != m[r]:
            out_rows[r, :] = np.nan
            lse_rows[r] = np.nan
        elif l[r] == 0.0 or m[r] == -np.inf:
            out_rows[r, :] = 0.0
            lse_rows[r] = -np.inf
        elif normalizer == SIGMOID:  # no normalisation: the sum is the output
            lse_rows[r] = math.log(l[r])
            for c in range(dv):
                out_rows[r, c] = acc[r, c]
        else:
            z = l[r]
            lse = m[r] + math.log(z)
            lse_rows[r] = lse
            if z < l_min:  # relu_expm1 and softpick only: the softmax sums are >= 1
                mant, ex = math.frexp(z)
                inv = 1.0 / mant
                for c in range(dv):
                    out_rows[r, c] = math.ldexp(acc[r, c], -ex) * inv
            else:
                inv = 1.0 / z
                for c in range(dv):
                    out_rows[r, c] = acc[r, c] * inv
            # 1 / (l + e^(sink - m)) = sigmoid(lse - sink) / l; softpick's eps is the sink e^sink
            if normalizer == SOFTMAX1 or normalizer == SOFTPICK:
                sig = sigmoid(lse - sink)
                for c in range(dv):
                    out_rows[r, c] *= sig


_sigmoid = inner(_scalars.sigmoid)


@inner
def sigmoid(x):
    """``1 / (1 + exp(-x))`` without overflow for any ``x``: ``softmax1``'s factor
    (:func:`attnnb._core.scalars.sigmoid`)."""
    return _sigmoid(x, 1.0)


@inner
def transposed_copy(src, r0, nr, c0, nc, dst):
    """``dst[c, r] = src[r0 + r, c0 + c]`` for ``r < nr``, ``c < nc`` (2-D arrays).

    In 16 x 16 blocks (:func:`attnnb.cpu._vector_ir.transpose_16`: row loads,
    shuffles, row stores), then the rows and columns that are left.  A plain
    double loop over the whole tile read or wrote with a stride in its inner
    loop (gathers or scattered stores), and 16 x 16 blocks as double loops still
    stored one element at a time; the vector-IR blocks take a tenth of the time
    (docs/notes/performance.md, "Figures moved out of the code's comments").  The copy
    is exact: results do not change.
    """
    nr_blocks = nr - nr % 16
    nc_blocks = nc - nc % 16
    for cb in range(0, nc_blocks, 16):
        for rb in range(0, nr_blocks, 16):
            transpose_16(src, r0 + rb, c0 + cb, dst, cb, rb)
    for c in range(nc_blocks, nc):
        for r in range(nr_blocks):
            dst[c, r] = src[r0 + r, c0 + c]
    for c in range(nc):
        for r in range(nr_blocks, nr):
            dst[c, r] = src[r0 + r, c0 + c]


@inner
def transpose_keys(src, j0, dst):
    """``dst[:, j - j0] = src[j, :]`` for the key tile starting at ``j0``: ``src (L, D)``,
    ``dst (D, TILE_K)`` (:func:`transposed_copy`).  The columns past the end of a last,
    partial tile are zeros (:func:`tile_logits_t` computes over them and drops them)."""
    L, D = src.shape
    n = min(TILE_K, L - j0)
    transposed_copy(src, j0, n, 0, D, dst)
    for e in range(D):
        for j in range(n, TILE_K):
            dst[e, j] = 0.0


@inner
def transpose_tile(k, kt, b, h, j0):
    """``kt[b, h, t] = k[b, h, j0 : j0 + TILE_K].T`` for the key tile ``t`` starting at
    ``j0 = t * TILE_K`` (:func:`transpose_keys`)."""
    transpose_keys(k[b, h], j0, kt[b, h, j0 // TILE_K])


@inner
def tile_is_finite(vh, j0):
    """True when rows ``j0 : j0 + TILE_K`` of one head's values ``vh (L, Dv)`` hold no
    NaN or Inf.

    ``x * 0`` is NaN for a NaN or an infinite ``x`` and 0 otherwise, so the sum
    is 0 exactly when every element is finite.  The rows are one contiguous
    run of ``vh`` (C-contiguous), read as one flat loop in its own
    dtype: one vectorised reduction per tile.  Row by row, with a float64
    zero, it was a reduction per row through float64 conversions, a large part
    of a decoding call (docs/notes/performance.md, "Figures moved out of the code's
    comments").
    """
    n_rows, width = vh.shape
    values = flat(vh)
    start = u64(j0 * width)
    zero = values.dtype.type(0.0)
    acc = zero
    for e in range(u64((min(j0 + TILE_K, n_rows) - j0) * width)):
        acc += values[start + e] * zero
    return acc == 0.0


@inner
def prepare_key_tile(k, v, kt, v_ok, task):
    """Task ``task`` of ``kt.shape[0] * kt.shape[1] * kt.shape[2]`` of the forward's
    prologue (:func:`attnnb.cpu._prologue.key_tiles_kernel`, launched before the
    sweep): transpose one key tile and check the matching value tile.

    ``kt``: ``(B, Hk, n_tiles, D, TILE_K)``, the keys ``k (B, Hk, Lk, D)``
    transposed tile by tile for :func:`tile_logits_t`; ``v_ok``: ``(B, Hv,
    n_tiles)`` bool, set True where value tile ``t`` of ``v (B, Hv, Lk, Dv)``
    is all finite (:func:`online_update` then takes the fast product).  The
    host passes both from :func:`attnnb.cpu._scratch.key_tile_buffers`.

    ``k`` may hold a whole multiple ``r`` of ``v``'s heads (the differential
    kernel's two components per value head): key head ``g`` then checks value
    head ``g // r`` when ``g % r == 0``, so every value tile is checked once.
    Done by a parallel kernel rather than by host helpers: no host pass over
    ``v``, which shows in small calls.
    """
    Hk, n_kt = kt.shape[1], kt.shape[2]
    b, g, t = task // (Hk * n_kt), (task // n_kt) % Hk, task % n_kt
    transpose_tile(k, kt, b, g, t * TILE_K)
    r = Hk // v_ok.shape[1]
    if g % r == 0:
        v_ok[b, g // r, t] = tile_is_finite(v[b, g // r], t * TILE_K)
