"""Top-k attention on the CPU: two passes per query tile over the tiled core.

Pass 1 computes the tile's rows of modified logits (``s + log key_size``,
``-inf`` outside the mask / causal limit) into an ``(TILE_Q, Lk)`` scratch
(O(Lk) per task, never ``Lq x Lk``) and finds each row's threshold with a
selection (:func:`~attnnb.cpu._sparse_tiles.row_threshold`).  Pass 2 reads
the logits pass 1 stored, so the keys it keeps are exactly the ``top_k``
that pass 1 counted.  When a row keeps few of the keys it sees (at most
1 / ``GATHER_BELOW``), pass 2 reads only the selected keys' values
(:func:`~attnnb.cpu._sparse_tiles.gather_selected`); otherwise it sweeps the
same key tiles, masked down to the selected keys, through the shared online
softmax.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ._jit import kernel, launch, wide_vectors
from ._scratch import key_tile_buffers
from ._sparse_tiles import gather_selected, row_threshold, select_tile
from ._tiles import (
    SOFTMAX,
    TILE_K,
    TILE_Q,
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
    view2d,
)
from .attention import empty_outputs, kernel_arguments

# Pass 2 gathers the selected keys' values (gather_selected) when a row keeps at most
# 1 / GATHER_BELOW of the keys it sees; otherwise it sweeps the tiles.
GATHER_BELOW = 8


@kernel
def topk_kernel(q, k, v, scale, bias, mask, has_mask, logks, has_ks, causal, top_k, kt, v_ok,
                out, lse):
    """One task per (batch, query head, query tile); ``bias`` is a placeholder."""
    B, Hq, Lq, D = q.shape
    Hk, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hk
    n_qt = (Lq + TILE_Q - 1) // TILE_Q
    n_kt = (Lk + TILE_K - 1) // TILE_K
    diag = Lk - Lq if causal else Lk
    for task in prange(kt.shape[0] * kt.shape[1] * kt.shape[2]):
        prepare_key_tile(k, v, kt, v_ok, task)
    for task in prange(B * Hq * n_qt):
        wide_vectors()
        b, h, _, i0, nq = task_rows(task, Hq, n_qt, TILE_Q, Lq)
        g = h // group
        kth, vh = kt[b, g], v[b, g]
        q_flat, S_flat, P_flat, _, T_flat = task_scratch(q, TILE_Q, Dv)
        R = view2d(np.empty(TILE_Q * Lk, q.dtype), nq, Lk)
        buf = np.empty(Lk, q.dtype)
        thr = np.empty(nq, q.dtype)
        cut = np.empty(nq, np.int64)
        m, l, acc = online_state(q, nq, Dv)
        qs = scaled_rows(q[b, h], i0, nq, scale, q_flat)
        last = key_tiles_seen(i0, nq, diag, n_kt)
        n_seen = min(Lk, last * TILE_K)  # keys beyond the causal limit of the whole tile
        # pass 1: logits of every allowed key, then each row's threshold
        for t in range(last):
            j0 = t * TILE_K
            nk = min(TILE_K, Lk - j0)
            S = tile_logits_t(qs, kth, j0, nk, S_flat)
            modify_logits(S, S, i0, j0, diag, bias[0, 0], False, mask[b, h], has_mask,
                          logks[b], has_ks, SOFTMAX)
            R[:, j0 : j0 + nk] = S
        for r in range(nq):
            thr[r], cut[r] = row_threshold(R[r], n_seen, top_k, buf)
        # pass 2: few keys kept per row: read just their values; many: the masked sweep
        # over the same tiles, through the shared online softmax
        if GATHER_BELOW * top_k <= n_seen:
            gather_selected(R, n_seen, thr, cut, vh, np.empty(n_seen, np.int64), m, l, acc)
        else:
            for t in range(last):
                j0 = t * TILE_K
                nk = min(TILE_K, Lk - j0)
                S = view2d(S_flat, nq, nk)
                select_tile(R, j0, nk, thr, cut, S)
                online_update(S, S, m, l, acc, P_flat, T_flat, vh, j0, v_ok[b, g, t], SOFTMAX)
        finish_rows(acc, m, l, SOFTMAX, out[b, h, i0 : i0 + nq], lse[b, h, i0 : i0 + nq])


def topk_attention(problem, top_k):
    """Top-k softmax attention of a canonical problem; returns ``(out, lse)``."""
    q, k, v = problem.q, problem.k, problem.v
    out, lse = empty_outputs(problem)
    if out.size == 0 and lse.size == 0:
        return out, lse
    bias, mask, logks = kernel_arguments(problem)
    with key_tile_buffers(k, v) as (kt, v_ok):
        launch(topk_kernel, q, k, v, q.dtype.type(problem.scale), bias, mask,
               problem.mask is not None, logks, problem.log_key_size is not None,
               problem.causal, int(top_k), kt, v_ok, out, lse)
    return out, lse
