"""Top-k attention on the CPU: two passes per query tile over the tiled core.

Pass 1 computes the tile's rows of modified logits (a score function's
value, ``+ log key_size``, ``-inf`` outside the mask / causal limit / mask
function) into an ``(TILE_Q, Lk)`` scratch (O(Lk) per task, never ``Lq x
Lk``); then each row's selection
(:func:`~attnnb.cpu._topk_rows.select_row`) gives its threshold, tie cut
and the list of kept keys.  When a row keeps few of the keys it sees (at
most 1 / ``GATHER_BELOW``), pass 2 is that row's softmax over its list,
reading only the kept keys' values (:func:`~attnnb.cpu._topk_rows.gather_row`);
otherwise it sweeps the same key tiles, masked down to the selected keys
(:func:`~attnnb.cpu._topk_rows.select_tile`), through the shared online
softmax.  Either way pass 2 reads the logits pass 1 stored, so the keys it
keeps are exactly the ``top_k`` that pass 1 selected.

The other normalizers rank the keys as softmax does (pass 1 is the same), then
weigh the kept ones their own way: pass 2 always sweeps, forming each tile's
logits again with the normalizer's modification (its bias, factors and key
sizes) and masking them by pass 1's selection.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .._core.codes import NORMALIZER_CODES, SOFTMAX, SOFTMAX1
from ._dropout import kernel_dropout, row_keys, scale_kept
from ._host import kernel_sinks, run_sweep
from ._jit import kernel, wide_vectors
from ._mod_hooks import mask_tile, score_tile
from ._mods import mod_kernel, mods_argument
from ._task import query_task, sweep_geometry
from ._tiles import (
    TILE_K,
    TILE_Q,
    factor_tile,
    finish_rows,
    key_tiles_seen,
    modify_logits,
    online_update,
    tile_logits_t,
    view2d,
)
from ._topk_rows import BUCKETS, gather_row, scratch_size, select_row, select_tile

# Pass 2 gathers the selected keys' values (gather_row) when a row keeps at most
# 1 / GATHER_BELOW of the keys it sees; otherwise it sweeps the tiles.
GATHER_BELOW = 2


@kernel
def topk_kernel(q, k, v, kt, v_ok, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                causal, top_k, dropout, normalizer, sinks, mods, thr_rows, cut_rows, out, lse):
    """One task per (batch, query head, query tile); leading arguments as every tiled
    kernel's (:mod:`attnnb.cpu._host`), ``bias`` read only by the normalizers other than
    softmax (``sigmoid``'s bias; the ranking takes none).

    ``thr_rows``, ``cut_rows`` ``(B, Hq, Lq)`` receive each row's selection
    (:func:`~attnnb.cpu._topk_rows.select_row`), which the backward pass
    holds fixed.  ``dropout`` as the dense kernel's: the kept keys' weights are
    dropped after the selection and the row's sum.  ``mods`` as the dense kernel's:
    rows rank the keys by their modified logits.  ``normalizer``: any code; ``SOFTMAX1``
    and ``SOFTPICK`` with the ``sinks (B, Hq)`` in the denominator.
    """
    B, Hq, Lq, Lk, Dv, group, n_qt, n_kt, diag = sweep_geometry(q, k, v, TILE_Q, causal)
    for task in prange(B * Hq * n_qt):
        wide_vectors()
        (b, h, g, _, i0, nq, kth, vh, qs, m, l, acc, S_flat, P_flat, F_flat,
         T_flat) = query_task(task, q, kt, v, scale, TILE_Q, group, n_qt)
        R = view2d(np.empty(TILE_Q * Lk, q.dtype), nq, Lk)
        # the selection's scratch (select_row); at least one element each
        w = scratch_size(Lk)
        gmax, cval, ftmp = np.empty(w, q.dtype), np.empty(w, q.dtype), np.empty(w, q.dtype)
        cidx, itmp, hist = np.empty(w, np.int64), np.empty(w, np.int64), np.empty(BUCKETS, np.int64)
        thr = np.empty(nq, q.dtype)
        cut = np.empty(nq, np.int64)
        keys = np.empty(nq, np.int64)
        words = np.empty(TILE_K, np.int64)
        row_keys(dropout, b, h, i0, nq, keys)
        last = key_tiles_seen(i0, nq, diag, n_kt)
        n_seen = min(Lk, last * TILE_K)  # keys beyond the causal limit of the whole tile
        # pass 1: logits of every allowed key
        for t in range(last):
            j0 = t * TILE_K
            nk = min(TILE_K, Lk - j0)
            S = tile_logits_t(qs, kth, j0, nk, S_flat)
            score_tile(S, b, h, i0, j0, mods)
            modify_logits(S, S, i0, j0, diag, bias[0, 0], False, mask[b, h], has_mask,
                          logks[b], has_ks, SOFTMAX)
            mask_tile(S, b, h, i0, j0, True, mods)
            R[:, j0 : j0 + nk] = S
        # each row's selection; few keys kept per row: its softmax over its list at once
        ranked = normalizer == SOFTMAX or normalizer == SOFTMAX1  # pass 1's logits weigh
        gather = ranked and GATHER_BELOW * top_k <= n_seen
        for r in range(nq):
            thr[r], cut[r], cnt = select_row(R[r], n_seen, top_k, gmax, cval, cidx, ftmp,
                                             itmp, hist)
            thr_rows[b, h, i0 + r], cut_rows[b, h, i0 + r] = thr[r], cut[r]
            if gather:
                gather_row(r, cval, cidx, cnt, vh, m, l, acc, ftmp, T_flat, dropout, keys[r])
        # many: pass 2 is the masked sweep over the same tiles, through the shared online
        # softmax (another normalizer's logits formed anew, then masked)
        if not gather:
            for t in range(last):
                j0 = t * TILE_K
                nk = min(TILE_K, Lk - j0)
                S = view2d(S_flat, nq, nk)
                F = factor_tile(F_flat, S, normalizer)  # (S itself for softmax)
                if not ranked:
                    tile_logits_t(qs, kth, j0, nk, S_flat)  # into S
                    score_tile(S, b, h, i0, j0, mods)
                    modify_logits(S, F, i0, j0, diag, bias[b, h], has_bias, mask[b, h],
                                  has_mask, logks[b], has_ks, normalizer)
                    mask_tile(S, b, h, i0, j0, True, mods)
                select_tile(R, j0, nk, thr, cut, S, ranked)
                online_update(S, F, m, l, acc, P_flat, T_flat, vh, j0, v_ok[b, g, t],
                              normalizer, dropout, keys, words)
        finish_rows(acc, m, l, normalizer, sinks[b, h], out[b, h, i0 : i0 + nq],
                    lse[b, h, i0 : i0 + nq])


def topk_selection(problem, top_k):
    """Top-k attention and its selection: ``(out, lse, thr, cut)``.

    Key ``j`` is kept by row ``i`` when its modified logit ``x`` (``s + log
    key_size``, ``-inf`` outside the mask and causal limit) has ``x >
    thr[i]``, or ``x == thr[i]`` and ``j <= cut[i]``, or is NaN; ``thr`` and
    ``cut`` are ``(B, Hq, Lq)``.
    """
    B, Hq, _, Lq, _, _, _ = problem.shape
    thr = np.zeros((B, Hq, Lq), problem.q.dtype)
    cut = np.zeros((B, Hq, Lq), np.int64)
    out, lse = run_sweep(mod_kernel(topk_kernel, problem), problem, int(top_k),
                         kernel_dropout(problem), NORMALIZER_CODES[problem.normalizer],
                         kernel_sinks(problem), mods_argument(problem), thr, cut)
    return scale_kept(out, problem), lse, thr, cut


def topk_attention(problem, top_k):
    """Top-k softmax attention of a canonical problem; returns ``(out, lse)``."""
    out, lse, _, _ = topk_selection(problem, top_k)
    return out, lse
