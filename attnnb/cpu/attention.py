"""Dense attention on the CPU: the tiled core swept over every key tile (split along the
keys when decoding: :mod:`attnnb.cpu._decoding`)."""

from __future__ import annotations

import numpy as np
from numba import prange

from .._core.codes import NORMALIZER_CODES, SOFTMAX, SOFTMAX1, SOFTPICK
from . import _first_tier as first_tier
from ._blocks import ROWS
from ._decoding import LOCAL_TILE_ROWS, LOGITS_FROM_KEYS, key_splits, merge_split_rows
from ._dropout import kernel_dropout, row_keys, scale_kept
from ._host import kernel_sinks, run_sweep
from ._jit import kernel, wide_vectors
from ._mask_tiles import EMPTY, FULL, tile_class
from ._mod_hooks import MASK_FN, mask_tile, score_tile
from ._mods import mod_kernel, mods_argument, tile_map
from ._numba_patches.views import keep_alive, unowned
from ._task import query_task, sweep_geometry
from ._tiles import (
    KEY_BLOCK_ROWS,
    SWEEP_TILE_Q,
    TILE_K,
    TILE_Q,
    factor_tile,
    finish_rows,
    key_tiles_seen,
    modify_logits,
    online_update,
    tile_is_finite,
    tile_logits_keys,
    tile_logits_rows,
    tile_logits_t,
    transpose_keys,
    transposed_queries,
)


@kernel
def attention_kernel(q, k, v, kt, v_ok, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                     causal, normalizer, dropout, mask_tiles, sinks, mods, n_split, part_out,
                     part_lse, out, lse):
    """One task per (batch, query head, query tile, key split); see :mod:`attnnb.cpu._tiles`.

    Leading arguments as every tiled kernel's (:mod:`attnnb.cpu._host`).  With
    ``causal`` the sweep stops at the last key tile the tile's last query may
    see, and only tiles that cross the diagonal are masked element by element.

    Decoding (:mod:`attnnb.cpu._decoding`): with at most ``LOCAL_TILE_ROWS``
    queries the host fills no key tiles (``kt`` and ``v_ok`` have none) and each
    task transposes and checks its key and value tiles itself (or, with
    ``LOGITS_FROM_KEYS`` and 4 rows or more, forms a full tile's logits from the
    keys as stored, :func:`~attnnb.cpu._tiles.tile_logits_keys`); with
    ``n_split > 1`` each task sweeps one contiguous range of the key tiles
    into ``part_out (n_split, B, Hq, Lq, Dv)`` and ``part_lse``, and a last
    pass merges the ranges into ``out`` and ``lse``.

    ``dropout`` (:func:`attnnb.cpu._dropout.kernel_dropout`): the dropped
    weights of each tile are zeroed after they have entered the row's sum, so
    the LSE is that of the weights before dropout; the host scales ``out``.
    ``mask_tiles``: the tile map of the mask and the mask function together
    (:mod:`attnnb.cpu._mask_tiles`, read only with either): key tiles they
    hide from every row of the task are not visited, and those they allow
    whole are not masked element by element.  ``sinks (B, Hq)``: ``softmax1``'s
    sink logits (zeros for plain ``softmax1``, learned sinks otherwise; read
    only by ``softmax1``).  ``mods``: the mask and score functions' arguments
    (:mod:`attnnb.cpu._mod_hooks`).
    """
    B, Hq, Lq, Lk, Dv, group, n_qt, n_kt, diag = sweep_geometry(q, k, v, SWEEP_TILE_Q, causal)
    local_tiles = Lq <= LOCAL_TILE_ROWS
    per_split = (n_kt + n_split - 1) // n_split
    # softmax1's +1 (softpick's eps) belongs to the whole row: the splits finish as softmax
    whole_row = normalizer == SOFTMAX1 or normalizer == SOFTPICK
    split_normalizer = SOFTMAX if whole_row and n_split > 1 else normalizer
    for task in prange(B * Hq * n_qt * n_split):
        wide_vectors()
        split = task % n_split
        (b, h, g, _, i0, nq, kth, vh, qs, m, l, acc, S_flat, P_flat, F_flat,
         T_flat) = query_task(task // n_split, q, kt, v, scale, SWEEP_TILE_Q, group, n_qt)
        own_tile = np.empty((1, k.shape[3], TILE_K), q.dtype)
        # decoding's full tiles by tile_logits_keys: the queries transposed once, and S^T
        by_keys = LOGITS_FROM_KEYS and local_tiles and nq >= ROWS
        qt = np.empty((k.shape[3] if by_keys else 0, KEY_BLOCK_ROWS), q.dtype)
        St_flat = np.empty(TILE_K * KEY_BLOCK_ROWS if by_keys else 0, q.dtype)
        if by_keys:
            transposed_queries(qs, qt)
        # the key loop works on ownerless aliases of the task's scratch, so no reference
        # counting on every tile (_numba_patches.views); the owners live to the task's end
        keys = np.empty(nq, np.int64)
        words = np.empty(TILE_K, np.int64)
        row_keys(dropout, b, h, i0, nq, keys)
        owners = (qs, m, l, acc, S_flat, P_flat, F_flat, T_flat, own_tile, qt, St_flat, keys,
                  words)
        (qs, m, l, acc, S_flat, P_flat, F_flat, T_flat, own_tile, qt, St_flat, keys,
         words) = unowned(owners)
        kh, bias_bh, mask_bh, logks_b = k[b, g], bias[b, h], mask[b, h], logks[b]
        last = min(key_tiles_seen(i0, nq, diag, n_kt), (split + 1) * per_split)
        for t in range(split * per_split, last):
            partial = has_mask or MASK_FN
            if has_mask or MASK_FN:
                cls = tile_class(mask_tiles, b, h, i0 // TILE_Q, (i0 + nq - 1) // TILE_Q, t)
                if cls == EMPTY:
                    continue
                partial = cls != FULL
            j0 = t * TILE_K
            nk = min(TILE_K, Lk - j0)
            # the key tile: from the filled buffer, or transposed here (decoding)
            tiles = kth
            tile_j0 = j0
            keys_as_stored = by_keys and nk == TILE_K
            if local_tiles:
                v_finite = tile_is_finite(vh, j0)
                if nq >= ROWS and not keys_as_stored:
                    transpose_keys(kh, j0, own_tile[0])
                    tiles = own_tile
                    tile_j0 = 0
            else:
                v_finite = v_ok[b, g, t]
            if local_tiles and nq < ROWS:  # a row or three: dot products beat transposing
                S = tile_logits_rows(qs, kh, j0, nk, S_flat)
            elif keys_as_stored:
                S = tile_logits_keys(qt, kh, vh, j0, nq, St_flat, S_flat, True)
            else:
                S = tile_logits_t(qs, tiles, tile_j0, nk, S_flat)
            score_tile(S, b, h, i0, j0, mods)
            # relu_expm1 keeps the logits and the kernel values apart (see modify_logits)
            F = factor_tile(F_flat, S, normalizer)
            modify_logits(S, F, i0, j0, diag, bias_bh, has_bias, mask_bh, partial and has_mask,
                          logks_b, has_ks, normalizer)
            mask_tile(S, b, h, i0, j0, partial, mods)
            online_update(S, F, m, l, acc, P_flat, T_flat, vh, j0, v_finite, normalizer, dropout,
                          keys, words)
        dest_out = out
        dest_lse = lse
        if n_split > 1:
            dest_out = part_out[split]
            dest_lse = part_lse[split]
        finish_rows(acc, m, l, split_normalizer, sinks[b, h], dest_out[b, h, i0 : i0 + nq],
                    dest_lse[b, h, i0 : i0 + nq])
        keep_alive(owners)
    if n_split > 1:  # B * Hq * Lq rows of n_split * Dv products: a serial loop is enough
        for row in range(B * Hq * Lq):
            merge_split_rows(part_out, part_lse, row, normalizer, sinks, out, lse)


def attention(problem):
    """Run dense attention of a canonical problem; returns ``(out, lse)``."""
    problem = first_tier.stand_in(problem, attention_kernel) or problem
    B, Hq, _, Lq, Lk, _, Dv = problem.shape
    n_split = key_splits(B, Hq, Lq, Lk)
    dt = problem.q.dtype
    part_out = np.empty((n_split if n_split > 1 else 0, B, Hq, Lq, Dv), dt)
    part_lse = np.empty(part_out.shape[:4], dt)
    out, lse = run_sweep(mod_kernel(attention_kernel, problem), problem,
                         NORMALIZER_CODES[problem.normalizer], kernel_dropout(problem),
                         tile_map(problem), kernel_sinks(problem), mods_argument(problem),
                         n_split, part_out, part_lse, key_tiles=Lq > LOCAL_TILE_ROWS)
    return scale_kept(out, problem), lse
