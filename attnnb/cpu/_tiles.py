"""The shared inner loops of the CPU tiled core.

Every CPU attention kernel (dense, sparse, top-k, differential) is a sweep
over key tiles for one (batch, head, query tile) task with an online
(running-maximum) normaliser, as in FlashAttention.  The kernels differ only
in *which* key tiles they visit and how they combine results; the loops
that touch every score live here, once:

* :func:`tile_logits`      -- ``S = q_tile @ k_tile.T`` (q pre-scaled)
* :func:`modify_logits`    -- bias, element masks, causal diagonal,
  ``relu_expm1``'s factor, ``log(key_size)``
* :func:`online_update`    -- running max / sum, ``acc = acc * alpha + P @ v_tile``
* :func:`finish_rows`      -- normaliser-specific division, LSE, empty and NaN rows

Scratch buffers are flat 1-D arrays allocated once per task and viewed as
``(rows, cols)`` tiles with ``reshape`` (a view: no allocation in the key
loop).  Tile sizes are module constants, so Numba compiles them in.

Normalizer codes: ``SOFTMAX = 0``, ``SOFTMAX1 = 1``, ``RELU_EXPM1 = 2``.
"""

from __future__ import annotations

import math

import numpy as np

from ._exp import exp_shifted
from ._jit import inner

TILE_Q = 64
TILE_K = 64

SOFTMAX = 0
SOFTMAX1 = 1
RELU_EXPM1 = 2
NORMALIZER_CODES = {"softmax": SOFTMAX, "softmax1": SOFTMAX1, "relu_expm1": RELU_EXPM1}


@inner
def view2d(flat, rows, cols):
    """A ``(rows, cols)`` C-contiguous view of the start of a flat scratch buffer."""
    return flat[: rows * cols].reshape((rows, cols))


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
def tile_logits(qs, kh, j0, nk, S_flat):
    """``S = qs @ kh[j0:j0+nk].T`` as an ``(nq, nk)`` view of ``S_flat`` (BLAS)."""
    S = view2d(S_flat, qs.shape[0], nk)
    np.dot(qs, kh[j0 : j0 + nk].T, S)
    return S


@inner
def modify_logits(S, F, i0, j0, diag, bias_bh, has_bias, mask_bh, has_mask, logks_b, has_ks,
                  normalizer):
    """Turn raw logits into the values the online softmax sweeps over.

    In order: add ``bias``; set keys outside the allowed set (``mask`` false,
    or beyond the causal limit ``j > i + diag``) to ``-inf``; for
    ``relu_expm1`` store the factor ``1 - exp(-s)`` in ``F`` and drop
    ``s <= 0``; add ``log(key_size)``.

    Parameters
    ----------
    S : ``(nq, nk)`` logits for queries ``i0..`` and keys ``j0..``, modified in place.
    F : ``(nq, nk)`` scratch, written only for ``relu_expm1``.
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
        for r in range(nq):
            for c in range(nk):
                S[r, c] += bias_bh[i0 + r, j0 + c]
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
            for c in range(nk):
                s = S[r, c]
                if s > 0:
                    F[r, c] = -math.expm1(-s)
                else:
                    F[r, c] = 0.0
                    if s == s:  # a NaN logit stays, to propagate
                        S[r, c] = ninf
    if has_ks:
        for r in range(nq):
            for c in range(nk):
                S[r, c] += logks_b[j0 + c]


@inner
def online_update(S, F, m, l, acc, P_flat, T_flat, vh, j0, v_finite, normalizer):
    """Fold one tile of modified logits into the running max, sum and accumulator.

    ``m`` (running max, ``-inf`` before any allowed key, NaN once a NaN logit
    was seen), ``l`` (running sum of ``exp(s - m)``) and ``acc`` (running
    ``sum exp(s - m) v``) are rows of the task's state.  The tile's ``P @ v``
    is summed on its own and then added (``acc = acc * alpha + T``): one long
    FMA chain over all keys loses accuracy.

    When the value tile holds NaN or Inf (``v_finite`` False) the product
    skips zero weights, so a masked key never reaches a row, even as NaN.
    """
    nq, nk = S.shape
    dv = acc.shape[1]
    P = view2d(P_flat, nq, nk)
    for r in range(nq):
        row = S[r]
        prow = P[r]
        mx = m[r]
        seen_nan = mx != mx
        for c in range(nk):
            x = row[c]
            seen_nan |= x != x
            mx = max(mx, x)
        if seen_nan or mx == -np.inf:
            if seen_nan:
                m[r] = np.nan
            prow[:] = 0.0
            continue
        alpha = math.exp(m[r] - mx)
        exp_shifted(row, prow, mx, nk)
        if normalizer == RELU_EXPM1:
            for c in range(nk):
                prow[c] *= F[r, c]
        total = 0.0
        for c in range(nk):
            total += prow[c]
        l[r] = l[r] * alpha + total
        for c in range(dv):
            acc[r, c] *= alpha
        m[r] = mx
    vt = vh[j0 : j0 + nk]
    if v_finite:
        T = view2d(T_flat, nq, dv)
        np.dot(P, vt, T)
        for r in range(nq):
            for c in range(dv):
                acc[r, c] += T[r, c]
    else:
        for r in range(nq):
            for c in range(nk):
                p = P[r, c]
                if p != 0.0:
                    for d in range(dv):
                        acc[r, d] += p * vt[c, d]


@inner
def finish_rows(acc, m, l, normalizer, out_rows, lse_rows):
    """Write ``out = acc / Z`` and ``lse = m + log(l)`` for a task's rows.

    Rows whose allowed set is empty, or whose weights sum to zero, get zeros
    and ``lse = -inf``; rows that met a NaN logit get NaN.  For ``softmax1``
    ``Z = l + exp(-m)`` (the ``+1`` in units of ``exp(m)``); the LSE excludes it.
    """
    nq, dv = acc.shape
    for r in range(nq):
        if m[r] != m[r]:
            out_rows[r, :] = np.nan
            lse_rows[r] = np.nan
        elif l[r] == 0.0 or m[r] == -np.inf:
            out_rows[r, :] = 0.0
            lse_rows[r] = -np.inf
        else:
            z = l[r]
            if normalizer == SOFTMAX1:
                z += math.exp(-m[r])
            inv = 1.0 / z
            for c in range(dv):
                out_rows[r, c] = acc[r, c] * inv
            lse_rows[r] = m[r] + math.log(l[r])


def value_tiles_finite(v: np.ndarray, tile: int = TILE_K) -> np.ndarray:
    """Host helper: ``(B, Hk, n_tiles)`` bool, True where a value tile is all finite."""
    B, H, L, _ = v.shape
    n_tiles = -(-L // tile)
    row_ok = np.isfinite(v).all(axis=-1)
    pad = n_tiles * tile - L
    if pad:
        row_ok = np.concatenate([row_ok, np.ones((B, H, pad), bool)], axis=-1)
    return row_ok.reshape(B, H, n_tiles, tile).all(axis=-1)
