"""Sparse-pattern attention on the CPU: the tiled core over the pattern's tiles only.

One task per (batch, query head, query tile), as the dense kernel; the key
loop runs over the tile list of the pattern's block layout
(:meth:`attnnb.patterns.Pattern.blocks` with this backend's ``TILE_Q`` and
``TILE_K``), so the work is proportional to the touched tiles.  Full tiles
need no element mask; partial tiles are masked from the CSR rows
(:func:`~attnnb.cpu._sparse_tiles.csr_tile_mask`).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .._core.codes import NORMALIZER_CODES
from ._dropout import kernel_dropout, row_keys, scale_kept
from ._host import kernel_sinks, run_sweep
from ._jit import kernel, wide_vectors
from ._mod_hooks import mask_tile, score_tile
from ._mods import mod_kernel, mods_argument
from ._sparse_tiles import csr_tile_mask
from ._task import query_task, sweep_geometry
from ._tiles import (
    TILE_K,
    TILE_Q,
    factor_tile,
    finish_rows,
    modify_logits,
    online_update,
    tile_logits_t,
)


@kernel
def sparse_kernel(q, k, v, kt, v_ok, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                  causal, normalizer, dropout, sinks, mods, p_heads, indptr, indices, tile_ptr,
                  tile_idx, tile_full, out, lse):
    """Leading arguments as every tiled kernel's (:mod:`attnnb.cpu._host`); ``mask`` and
    ``causal`` are never read (a pattern carries the whole allowed set), ``bias`` only
    for ``sigmoid``'s bias (the function takes none of its own).

    ``p_heads`` is the pattern's head count (1: shared by all query heads);
    ``dropout``, ``sinks`` and ``mods`` as the dense kernel's
    (:func:`attnnb.cpu.attention.attention_kernel`): a mask function is tested on
    every pair the pattern allows.
    """
    B, Hq, Lq, Lk, Dv, group, n_qt, _, _ = sweep_geometry(q, k, v, TILE_Q, False)
    for task in prange(B * Hq * n_qt):
        wide_vectors()
        (b, h, g, qt, i0, nq, kth, vh, qs, m, l, acc, S_flat, P_flat, F_flat,
         T_flat) = query_task(task, q, kt, v, scale, TILE_Q, group, n_qt)
        ph = h if p_heads > 1 else 0
        row0 = ph * Lq + i0  # CSR row of the tile's first query
        tr = ph * n_qt + qt  # block-layout row of this query tile
        cursor = np.empty(nq, np.int64)
        for r in range(nq):
            cursor[r] = indptr[row0 + r]
        keys = np.empty(nq, np.int64)
        words = np.empty(TILE_K, np.int64)
        row_keys(dropout, b, h, i0, nq, keys)
        for p in range(tile_ptr[tr], tile_ptr[tr + 1]):
            t = tile_idx[p]
            j0 = t * TILE_K
            nk = min(TILE_K, Lk - j0)
            S = tile_logits_t(qs, kth, j0, nk, S_flat)
            score_tile(S, b, h, i0, j0, mods)  # before the pattern's -inf (softcap(-inf) is finite)
            if tile_full[p]:
                # every row holds exactly the tile's nk keys: step over them, so that
                # the next partial tile finds its first key without a scan
                for r in range(nq):
                    cursor[r] += nk
            else:
                csr_tile_mask(S, indptr, indices, row0, j0, cursor)
            F = factor_tile(F_flat, S, normalizer)
            modify_logits(S, F, i0, j0, Lk, bias[b, h], has_bias, mask[0, 0], False, logks[b],
                          has_ks, normalizer)
            mask_tile(S, b, h, i0, j0, True, mods)
            online_update(S, F, m, l, acc, P_flat, T_flat, vh, j0, v_ok[b, g, t], normalizer,
                          dropout, keys, words)
        finish_rows(acc, m, l, normalizer, sinks[b, h], out[b, h, i0 : i0 + nq],
                    lse[b, h, i0 : i0 + nq])


def sparse_attention(problem, pattern):
    """Attention of a canonical problem over ``pattern``; returns ``(out, lse)``."""
    layout = pattern.blocks(TILE_Q, TILE_K)
    out, lse = run_sweep(mod_kernel(sparse_kernel, problem), problem,
                         NORMALIZER_CODES[problem.normalizer], kernel_dropout(problem),
                         kernel_sinks(problem), mods_argument(problem), pattern.n_heads,
                         pattern.indptr, pattern.indices, layout.tile_ptr, layout.tile_idx,
                         layout.tile_full)
    return scale_kept(out, problem), lse
