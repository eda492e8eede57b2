"""Differential attention on the CPU: two score streams over the same K/V tiles.

One task per (batch, head pair, query tile).  ``mode="difference"`` sweeps
the key tiles once: for each tile both components' logits go through the
shared :func:`~attnnb.cpu._tiles.online_update` with the same value tile (so
it is read from memory once), and the finished rows are combined as
``o1 - lam * o2``.  ``mode="rectified"`` must know both maps' normalisers
before it can clip ``A1 - lam * A2``, so its task sweeps twice: pass 1 runs
the same online update with zero-width values (only the running max and
sum, i.e. the LSEs), pass 2 recomputes the logits and accumulates
``max(0, A1 - lam * A2) @ v`` tile by tile.  ``mode="heaviside"`` takes the
same two passes with ``A1 - lam H(A1 - lam * A2)``.  No ``Lq x Lk`` array
exists.

Dropout drops the combined weight of ``(b, pair h, i, j)``: in the difference
mode both streams zero the same entries (one row key per pair row), in the
rectified mode pass 2 zeroes them after the clip; the host scales the
output by ``1 / (1 - p)`` (docs/contract.md §1.14).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .._core.codes import DIFF_MODE_CODES, DIFFERENCE, HEAVISIDE, SOFTMAX, SOFTMAX1
from ._dropout import drop_tile, kernel_dropout, row_keys, scale_kept
from ._host import kernel_sinks, run_sweep
from ._jit import inner, kernel, wide_vectors
from ._mod_hooks import mask_tile, score_tile
from ._mods import mod_kernel, mods_argument
from ._normalised_maps import add_sink, finish_weighted_rows, rectified_weights
from ._task import sweep_geometry
from ._tiles import (
    SWEEP_TILE_Q,
    TILE_K,
    add_weighted_values,
    finish_rows,
    key_tiles_seen,
    modify_logits,
    online_state,
    online_update,
    scaled_rows,
    task_rows,
    task_scratch,
    tile_logits_t,
    view2d,
)


@inner
def masked_logits(qs, kh, b, h, i0, j0, nk, diag, bias_bh, has_bias, mask_bh, has_mask,
                  logks_b, has_ks, mods, S_flat):
    """One component's modified logits for one key tile (``-inf`` outside the allowed set).

    ``kh`` is the component's keys transposed per key tile (:func:`prepare_key_tile`);
    ``mods`` the mask and score functions' arguments (:mod:`attnnb.cpu._mod_hooks`),
    which see pair ``h``.
    """
    S = tile_logits_t(qs, kh, j0, nk, S_flat)
    score_tile(S, b, h, i0, j0, mods)
    modify_logits(S, S, i0, j0, diag, bias_bh, has_bias, mask_bh, has_mask, logks_b, has_ks,
                  SOFTMAX)
    mask_tile(S, b, h, i0, j0, True, mods)
    return S


@inner
def sweep_pair(qs, kh, vh, v_ok, b, h, i0, last, diag, bias_bh, has_bias, mask_bh, has_mask,
               logks_b, has_ks, mods, m, l, acc, S_flat, P_flat, T_flat, dropout, keys, words):
    """Online softmax of both streams over key tiles ``0..last-1``, sharing each value tile.

    ``qs``, ``kh``, ``m``, ``l``, ``acc`` are pairs (stream 1, stream 2).  The
    two streams take turns on each key tile (one score buffer, the value tile
    still in cache for the second).  With zero-width ``vh``/``acc`` (and
    ``v_ok`` False) only the running max and sum are kept: the LSE pass of
    the rectified mode.  Each shared loop has one call site, indexed by the
    stream, so that the kernel holds one inlined copy of it, not four.  Both
    streams drop the same weights (rows keyed by ``keys``, one per pair row).
    """
    Lk = vh.shape[0]
    for t in range(last):
        j0 = t * TILE_K
        nk = min(TILE_K, Lk - j0)
        for c in range(2):
            S = masked_logits(qs[c], kh[c], b, h, i0, j0, nk, diag, bias_bh, has_bias, mask_bh,
                              has_mask, logks_b, has_ks, mods, S_flat)
            online_update(S, S, m[c], l[c], acc[c], P_flat, T_flat, vh, j0, v_ok[t], SOFTMAX,
                          dropout, keys, words)


@kernel
def diff_kernel(q, k, v, kt, v_ok, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                causal, lam, mode, dropout, has_sinks, sinks, mods, out, lse):
    """One task per (batch, head pair, query tile); see the module docstring.

    Leading arguments as every tiled kernel's (:mod:`attnnb.cpu._host`);
    ``lse`` is not written (differential attention has no single LSE);
    ``dropout`` as :func:`~attnnb.cpu._dropout.kernel_dropout`'s; ``mods`` as the dense
    kernel's, for both maps of pair ``h``.  With ``has_sinks``, map ``c`` of pair ``h``
    has the sink ``sinks[b, 2h + c]`` in its denominator (``(B, 2H)``).
    """
    # pairs of query heads share pairs of key heads: the group size is the same
    B, H2, Lq, Lk, Dv, group, n_qt, n_kt, diag = sweep_geometry(q, k, v, SWEEP_TILE_Q, causal)
    H, D = H2 // 2, q.shape[3]
    no_values = np.zeros((Lk, 0), q.dtype)
    no_values_ok = np.zeros(n_kt, np.bool_)
    no_dropout = np.zeros(5, np.int64)  # the LSE pass: dropping comes after the sums
    for task in prange(B * H * n_qt):
        wide_vectors()
        b, h, _, i0, nq = task_rows(task, H, n_qt, SWEEP_TILE_Q, Lq)
        g = h // group
        k1h, k2h, vh = kt[b, 2 * g], kt[b, 2 * g + 1], v[b, g]
        q1_flat, S1_flat, P_flat, _, T_flat = task_scratch(q, SWEEP_TILE_Q, Dv)
        q2_flat = np.empty(SWEEP_TILE_Q * D, q.dtype)
        keys = np.empty(nq, np.int64)
        words = np.empty(TILE_K, np.int64)
        row_keys(dropout, b, h, i0, nq, keys)
        # the rectified mode's first pass keeps only the running max and sum: no values
        width = Dv if mode == DIFFERENCE else 0
        m1, l1, acc1 = online_state(q, nq, width)
        m2, l2, acc2 = online_state(q, nq, width)
        lse1 = np.empty(nq, q.dtype)
        lse2 = np.empty(nq, q.dtype)
        qs1 = scaled_rows(q[b, 2 * h], i0, nq, scale, q1_flat)
        qs2 = scaled_rows(q[b, 2 * h + 1], i0, nq, scale, q2_flat)
        last = key_tiles_seen(i0, nq, diag, n_kt)
        rows = out[b, h, i0 : i0 + nq]
        lam_rows = lam[b, h, i0 : i0 + nq]
        bias_bh, mask_bh, logks_b = bias[b, h], mask[b, h], logks[b]
        difference = mode == DIFFERENCE
        # one call of each shared loop for both modes (see sweep_pair)
        sweep_pair((qs1, qs2), (k1h, k2h), vh if difference else no_values,
                   v_ok[b, g] if difference else no_values_ok, b, h, i0, last, diag, bias_bh,
                   has_bias, mask_bh, has_mask, logks_b, has_ks, mods, (m1, m2), (l1, l2),
                   (acc1, acc2), S1_flat, P_flat, T_flat,
                   dropout if difference else no_dropout, keys, words)
        # difference: o1 into the output rows, o2 aside; rectified: the LSEs only
        # (-inf on an empty row, NaN), the accumulators are zero-width
        o2 = np.empty((nq, Dv if difference else 0), q.dtype)
        finished = (rows if difference else acc1, o2 if difference else acc2)
        pairs = ((acc1, m1, l1, lse1), (acc2, m2, l2, lse2))
        for c in range(2):
            acc_c, m_c, l_c, lse_c = pairs[c]
            finish_rows(acc_c, m_c, l_c, SOFTMAX1 if has_sinks else SOFTMAX,
                        sinks[b, 2 * h + c], finished[c], lse_c)
            if has_sinks and not difference:  # pass 2's maps: e^s / (e^sink + sum e^s)
                add_sink(lse_c, sinks[b, 2 * h + c])
        if difference:
            for r in range(nq):  # empty rows of map 2 are zeros, and lam is finite
                for c in range(Dv):
                    rows[r, c] -= lam_rows[r] * o2[r, c]
        else:
            acc = np.zeros((nq, Dv), q.dtype)
            S2_flat = np.empty(SWEEP_TILE_Q * TILE_K, q.dtype)
            P2_flat = np.empty(SWEEP_TILE_Q * TILE_K, q.dtype)
            qs, kh, S_flats = (qs1, qs2), (k1h, k2h), (S1_flat, S2_flat)
            for t in range(last):
                j0 = t * TILE_K
                nk = min(TILE_K, Lk - j0)
                for c in range(2):
                    masked_logits(qs[c], kh[c], b, h, i0, j0, nk, diag, bias_bh, has_bias,
                                  mask_bh, has_mask, logks_b, has_ks, mods, S_flats[c])
                S1 = view2d(S1_flat, nq, nk)
                S2 = view2d(S2_flat, nq, nk)
                P = rectified_weights(S1, S2, lse1, lse2, lam_rows, mode == HEAVISIDE,
                                      P_flat, P2_flat)
                drop_tile(P, dropout, keys, j0, words)
                add_weighted_values(P, vh, j0, v_ok[b, g, t], acc, T_flat)
            finish_weighted_rows(acc, lse1, lse2, rows)


def diff_attention(problem, lam, mode="difference"):
    """Differential attention of a canonical problem (built with ``head_pairs=True``).

    Parameters
    ----------
    problem : :class:`~attnnb._front.validate.Problem`
        ``q (B, 2H, Lq, d)``, ``k (B, 2Hk, Lk, d)``, ``v (B, Hk, Lk, Dv)``;
        mask and bias views ``(B, H, Lq, Lk)``.
    lam : ``(B, H, Lq)`` C-contiguous, in the compute dtype, finite.
    mode : ``"difference"``, ``"rectified"`` or ``"heaviside"``

    Returns
    -------
    out : ``(B, H, Lq, Dv)`` in the compute dtype.
    """
    out, _ = run_sweep(mod_kernel(diff_kernel, problem), problem, lam, DIFF_MODE_CODES[mode],
                       kernel_dropout(problem), problem.sinks is not None,
                       kernel_sinks(problem), mods_argument(problem),
                       out_heads=problem.shape[1] // 2)
    return scale_kept(out, problem)
