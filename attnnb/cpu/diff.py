"""Differential attention on the CPU: two score streams over the same K/V tiles.

One task per (batch, head pair, query tile).  ``mode="difference"`` sweeps
the key tiles once: for each tile both components' logits go through the
shared :func:`~attnnb.cpu._tiles.online_update` with the same value tile (so
it is read from memory once), and the finished rows are combined as
``o1 - lam * o2``.  ``mode="rectified"`` must know both maps' normalisers
before it can clip ``A1 - lam * A2``, so its task sweeps twice: pass 1 runs
the same online update with zero-width values (only the running max and
sum, i.e. the LSEs), pass 2 recomputes the logits and accumulates
``max(0, A1 - lam * A2) @ v`` tile by tile.  No ``Lq x Lk`` array exists.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ._jit import inner, kernel, launch, wide_vectors
from ._scratch import key_tile_buffers
from ._streams import add_weighted_values, finish_weighted_rows, rectified_weights
from ._tiles import (
    SOFTMAX,
    SWEEP_TILE_Q,
    TILE_K,
    finish_rows,
    key_tiles_seen,
    modify_logits,
    online_state,
    online_update,
    prepare_key_tile,
    scaled_rows,
    task_rows,
    task_scratch,
    tile_logits_t,
)
from .attention import kernel_arguments

DIFFERENCE = 0
RECTIFIED = 1
MODE_CODES = {"difference": DIFFERENCE, "rectified": RECTIFIED}


@inner
def masked_logits(qs, kh, i0, j0, nk, diag, bias_bh, has_bias, mask_bh, has_mask, logks_b,
                  has_ks, S_flat):
    """One component's modified logits for one key tile (``-inf`` outside the allowed set).

    ``kh`` is the component's keys transposed per key tile (:func:`prepare_key_tile`).
    """
    S = tile_logits_t(qs, kh, j0, nk, S_flat)
    modify_logits(S, S, i0, j0, diag, bias_bh, has_bias, mask_bh, has_mask, logks_b, has_ks,
                  SOFTMAX)
    return S


@inner
def sweep_pair(qs1, qs2, k1h, k2h, vh, v_ok, i0, last, diag, bias_bh, has_bias, mask_bh,
               has_mask, logks_b, has_ks, m1, l1, acc1, m2, l2, acc2, S_flat, P_flat, T_flat):
    """Online softmax of both streams over key tiles ``0..last-1``, sharing each value tile.

    The two streams take turns on each key tile (one score buffer, the value
    tile still in cache for the second).  With zero-width ``vh``/``acc`` (and
    ``v_ok`` False) only the running max and sum are kept: the LSE pass of
    the rectified mode.
    """
    Lk = vh.shape[0]
    for t in range(last):
        j0 = t * TILE_K
        nk = min(TILE_K, Lk - j0)
        S = masked_logits(qs1, k1h, i0, j0, nk, diag, bias_bh, has_bias, mask_bh, has_mask,
                          logks_b, has_ks, S_flat)
        online_update(S, S, m1, l1, acc1, P_flat, T_flat, vh, j0, v_ok[t], SOFTMAX)
        S = masked_logits(qs2, k2h, i0, j0, nk, diag, bias_bh, has_bias, mask_bh, has_mask,
                          logks_b, has_ks, S_flat)
        online_update(S, S, m2, l2, acc2, P_flat, T_flat, vh, j0, v_ok[t], SOFTMAX)


@kernel
def diff_kernel(q, k, v, lam, scale, bias, has_bias, mask, has_mask, logks, has_ks, causal,
                mode, kt, v_ok, out):
    """One task per (batch, head pair, query tile); see the module docstring."""
    B, H2, Lq, D = q.shape
    Hk2, Lk, Dv = k.shape[1], v.shape[2], v.shape[3]
    H = H2 // 2
    group = H // (Hk2 // 2)
    n_qt = (Lq + SWEEP_TILE_Q - 1) // SWEEP_TILE_Q
    n_kt = (Lk + TILE_K - 1) // TILE_K
    diag = Lk - Lq if causal else Lk  # j > i + diag is masked; Lk disables it
    no_values = np.zeros((Lk, 0), q.dtype)
    no_values_ok = np.zeros(n_kt, np.bool_)
    for task in prange(kt.shape[0] * kt.shape[1] * kt.shape[2]):
        prepare_key_tile(k, v, kt, v_ok, task)
    for task in prange(B * H * n_qt):
        wide_vectors()
        b, h, _, i0, nq = task_rows(task, H, n_qt, SWEEP_TILE_Q, Lq)
        g = h // group
        k1h, k2h, vh = kt[b, 2 * g], kt[b, 2 * g + 1], v[b, g]
        q1_flat, S1_flat, P_flat, _, T_flat = task_scratch(q, SWEEP_TILE_Q, Dv)
        q2_flat = np.empty(SWEEP_TILE_Q * D, q.dtype)
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
        if mode == DIFFERENCE:
            sweep_pair(qs1, qs2, k1h, k2h, vh, v_ok[b, g], i0, last, diag, bias_bh, has_bias,
                       mask_bh, has_mask, logks_b, has_ks, m1, l1, acc1, m2, l2, acc2, S1_flat,
                       P_flat, T_flat)
            o2 = np.empty((nq, Dv), q.dtype)
            finish_rows(acc1, m1, l1, SOFTMAX, rows, lse1)
            finish_rows(acc2, m2, l2, SOFTMAX, o2, lse2)
            for r in range(nq):  # empty rows of map 2 are zeros, and lam is finite
                for c in range(Dv):
                    rows[r, c] -= lam_rows[r] * o2[r, c]
        else:
            sweep_pair(qs1, qs2, k1h, k2h, no_values, no_values_ok, i0, last, diag, bias_bh,
                       has_bias, mask_bh, has_mask, logks_b, has_ks, m1, l1, acc1, m2, l2,
                       acc2, S1_flat, P_flat, T_flat)
            finish_rows(acc1, m1, l1, SOFTMAX, acc1, lse1)  # LSEs only: -inf empty, NaN
            finish_rows(acc2, m2, l2, SOFTMAX, acc2, lse2)
            acc = np.zeros((nq, Dv), q.dtype)
            S2_flat = np.empty(SWEEP_TILE_Q * TILE_K, q.dtype)
            P2_flat = np.empty(SWEEP_TILE_Q * TILE_K, q.dtype)
            for t in range(last):
                j0 = t * TILE_K
                nk = min(TILE_K, Lk - j0)
                S1 = masked_logits(qs1, k1h, i0, j0, nk, diag, bias_bh, has_bias, mask_bh,
                                   has_mask, logks_b, has_ks, S1_flat)
                S2 = masked_logits(qs2, k2h, i0, j0, nk, diag, bias_bh, has_bias, mask_bh,
                                   has_mask, logks_b, has_ks, S2_flat)
                P = rectified_weights(S1, S2, lse1, lse2, lam_rows, P_flat, P2_flat)
                add_weighted_values(P, vh, j0, v_ok[b, g, t], acc, T_flat)
            finish_weighted_rows(acc, lse1, lse2, rows)


def diff_attention(problem, lam, mode="difference"):
    """Differential attention of a canonical problem (built with ``head_pairs=True``).

    Parameters
    ----------
    problem : :class:`~attnnb._validate.Problem`
        ``q (B, 2H, Lq, d)``, ``k (B, 2Hk, Lk, d)``, ``v (B, Hk, Lk, Dv)``;
        mask and bias views ``(B, H, Lq, Lk)``.
    lam : ``(B, H, Lq)`` C-contiguous, in the compute dtype, finite.
    mode : ``"difference"`` or ``"rectified"``

    Returns
    -------
    out : ``(B, H, Lq, Dv)`` in the compute dtype.
    """
    q, k, v = problem.q, problem.k, problem.v
    B, H2, _, Lq, _, _, Dv = problem.shape
    out = np.empty((B, H2 // 2, Lq, Dv), q.dtype)
    if out.size == 0:
        return out
    bias, mask, logks = kernel_arguments(problem)
    # kt holds both components of value head g: key heads 2g and 2g + 1
    with key_tile_buffers(k, v) as (kt, v_ok):
        launch(diff_kernel, q, k, v, lam, q.dtype.type(problem.scale), bias,
               problem.bias is not None, mask, problem.mask is not None, logks,
               problem.log_key_size is not None, problem.causal, MODE_CODES[mode], kt, v_ok,
               out)
    return out
