"""Gradients of dense and sparse attention on the CPU: FlashAttention-2's backward.

Nothing ``(Lq, Lk)`` is stored.  The forward's ``out`` and ``lse`` are
enough to recompute every weight tile: ``p = exp(s' - lse)`` with ``s'``
the modified logit of the forward (bias, mask, causal limit, ``log
key_size``; :func:`~attnnb.cpu._tiles.modify_logits`).  With a row factor
``r`` (1, or ``1 / (1 + e^-lse)`` for ``softmax1``, whose weights are
``r p``) and ``F`` (1, or ``1 - e^-s`` for ``relu_expm1``, whose weights
are ``p F``), every normalizer has the same backward::

    w    = r p F                           the forward's weights
    dp   = dout @ v^T                      per tile
    ds   = r p (dp - delta)                delta = dout . out - dlse / r, per row
    dv  += w^T @ dout,  dk += scale ds^T @ q,  dq += scale ds @ k
    dbias = ds,  d log key_size += w (dp - delta)  (summed over queries and heads)

Two kernels, as FlashAttention-2: :func:`dkdv_kernel` owns the gradients
of one key tile (it sweeps the query tiles that can see it, for every
query head of the GQA group: no write races) and :func:`dq_kernel` owns
one query tile's ``dq``.  That recomputes each pair's weights twice.  With
at least :data:`ONE_SWEEP_TASKS` key heads (times the batch)
:func:`dkdv_kernel` runs alone, one task per key head owning all three
gradients: each pair once, and the same bits as the two kernels (the same
per-tile code, ``dq``'s terms in the same order).  All walk tile lists: the
dense (or causal) problem's or a sparse pattern's block layout, read by query tile for
``dq`` and by key tile for ``dk``/``dv`` (:mod:`attnnb.cpu._grad_tiles`),
so sparse attention's backward also costs in proportion to the allowed
pairs.  All five matrix
products are the forward's register-blocked ones: ``q k^T`` and
``dout v^T`` read keys and values transposed tile by tile
(:func:`~attnnb.cpu._tiles.prepare_key_tile`; with fewer than ``ROWS``
query rows, as stored, one dot product per key: :func:`pair_tiles`), the
three others are
:func:`~attnnb.cpu._tiles.values_product` and
:func:`~attnnb.cpu._tiles.transposed_values_product`, which reads a weight
tile's columns as its rows (no transposed copy).
Working memory: O(tile) per task, plus the transposed keys and values
and the gradients themselves (the bias gradient is materialised only
when a bias was given and needs one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np
from numba import prange

from .._core.bias_chunks import bias_chunks, chunked_vjp, sum_to_shape
from .._core.codes import NORMALIZER_CODES, RELU_EXPM1, SIGMOID, SOFTPICK
from .._core.dropout import keep_scale
from .._mods.compile import sum_param_grads
from . import _first_tier as first_tier
from ._blocks import ROWS
from ._decoding import LOCAL_TILE_ROWS, LOGITS_FROM_KEYS
from ._dropout import keep_factors, kernel_dropout
from ._exp import exp_overflows, exp_shifted, quotient
from ._grad_tiles import (
    by_key_tile,
    dense_tiles,
    pair_scratch,
    read_only,
    stored_keys_scratch,
    written_whole,
)
from ._host import kernel_sinks, score_arguments
from ._jit import inner, kernel, launch, wide_vectors
from ._mask_tiles import visible_tiles
from ._mod_hooks import (
    add_array_gradients,
    mask_tile,
    mod_grad_views,
    mod_scratch,
    raw_gradients,
    score_tile_kept,
    task_groups,
)
from ._mods import (
    group_gradients,
    mod_kernel,
    mods_argument,
    parameter_gradients,
    tile_map,
)
from ._prologue import filled_kv_tiles
from ._sparse_tiles import csr_tile_mask
from ._task import sweep_geometry
from ._tiles import (
    KEY_BLOCK_ROWS,
    TILE_K,
    TILE_Q,
    add_weighted_values,
    factor_tile,
    modify_logits,
    scaled_rows,
    task_rows,
    tile_is_finite,
    tile_logits_keys,
    tile_logits_rows,
    tile_logits_t,
    transpose_keys,
    transposed_queries,
    transposed_values_product,
    view2d,
)
from .attention import attention as attention_forward
from .rectified_backward import rectified_vjp
from .topk import topk_selection

# Key heads (times the batch) from which one sweep forms all three gradients
# (:func:`dkdv_kernel` with ``own_dq``); below, two sweeps with a task per tile
# keep every core busy.  A function of the shape alone, so that which kernels run, and so
# the results, do not depend on the number of threads.
ONE_SWEEP_TASKS = 8


class PairArguments(NamedTuple):
    """The arguments :func:`pair_gradients` reads besides the tiles, one value for both
    kernels (Numba compiles a named tuple of arrays into the kernel like separate
    arguments; the names keep the kernels readable).

    Score modification as the forward's (:mod:`attnnb.cpu._host`): ``scale``,
    ``bias``/``has_bias``, ``mask``/``has_mask``, ``logks``/``has_ks``,
    ``causal``, ``normalizer``.  Per row ``(B, Hq, Lq)``: ``dout`` (with ``Dv``),
    ``lse``, ``ratio``, ``delta`` (:func:`row_terms`).  A sparse pattern:
    ``p_heads``, its CSR ``indptr``/``indices``, ``csr`` (False for dense
    placeholders).  A top-k selection held fixed: ``selected``, ``thr``, ``cut``.
    Dropout: ``dropout`` (:func:`~attnnb.cpu._dropout.kernel_dropout`) and
    ``keep_scale`` (``1 / (1 - p)``).
    """

    scale: float
    bias: np.ndarray
    has_bias: bool
    mask: np.ndarray
    has_mask: bool
    logks: np.ndarray
    has_ks: bool
    causal: bool
    normalizer: int
    dout: np.ndarray
    lse: np.ndarray
    ratio: np.ndarray
    delta: np.ndarray
    p_heads: int
    indptr: np.ndarray
    indices: np.ndarray
    csr: bool
    selected: bool
    thr: np.ndarray
    cut: np.ndarray
    dropout: np.ndarray
    keep_scale: float


@inner
def few_rows(local, Lq, selected):
    """Whether the pair products read keys and values as stored (:func:`pair_tiles`):
    with the local tiles and fewer than ``ROWS`` query rows, but not for a top-k
    selection, whose forward formed its logits from transposed tiles: the selection
    held fixed compares recomputed logits with the forward's threshold, so they must
    be the forward's bit for bit."""
    return local and Lq < ROWS and not selected


@inner
def from_stored_keys(local, Lq):
    """Whether the pair products of a full key tile read keys and values as stored
    against the pair's rows transposed (:func:`~attnnb.cpu._tiles.tile_logits_keys`):
    with the local tiles and ``ROWS`` or more query rows, where
    :data:`~attnnb.cpu._decoding.LOGITS_FROM_KEYS`.  The same bits as the transposed
    tiles, so a top-k selection held fixed may take it too."""
    return LOGITS_FROM_KEYS and local and Lq >= ROWS


@inner
def pair_tiles(k, v, kt, vt, k_ok, local, by_rows, by_keys, own, b, g, t):
    """``(kth, vth, tile_j0, k_finite)``: key head ``g``'s key and value tile ``t`` for
    the pair products (:func:`tile_logits_t` of ``kth``, ``vth`` at ``tile_j0``) and
    whether the key tile is all finite.

    From the filled buffers ``kt``, ``vt``, ``k_ok``; or, ``local`` (few query
    rows, :data:`~attnnb.cpu._decoding.LOCAL_TILE_ROWS`: the host filled none),
    transposed and checked here, into ``own = (k tile, v tile)`` of shapes ``(1,
    D, TILE_K)`` and ``(1, Dv, TILE_K)``, which stay in cache for the pair.  The
    same tiles either way, so the same bits.  With ``by_rows`` (:func:`few_rows`)
    nothing is transposed: the pair products then read the keys and values as
    stored (:func:`pair_gradients`), as the forward's do, since two transposed
    copies a tile cost more than the dot products of one to three rows; nor with
    ``by_keys`` (:func:`from_stored_keys`) for a full tile.
    """
    j0 = t * TILE_K
    if local:
        own_k, own_v = own
        if not by_rows and not (by_keys and j0 + TILE_K <= k.shape[2]):
            transpose_keys(k[b, g], j0, own_k[0])
            transpose_keys(v[b, g], j0, own_v[0])
        return own_k, own_v, 0, tile_is_finite(k[b, g], j0)
    return kt[b, g], vt[b, g], j0, k_ok[b, g, t]


@inner
def pair_gradients(pair, q, kth, vth, tile_j0, kh, vh, by_rows, by_keys, b, h, ph, i0, nq, j0,
                   nk, diag, csr_masked, cursor, scratch, keys_scratch, mods, modded):
    """Weights ``W`` and logit gradients ``dS`` of one (query tile, key tile) pair.

    Recomputes the forward's modified logits of query head ``h``'s rows
    ``i0 : i0 + nq`` and keys ``j0 : j0 + nk`` (see the module docstring),
    with the element mask of a sparse pattern's partial tile when
    ``csr_masked`` (the CSR rows of pattern head ``ph``; ``cursor`` is
    scratch of ``nq``) and, when ``pair.selected``, only the keys of the
    forward's top-k selection (:func:`attnnb.cpu.topk.topk_selection`);
    ``kth``, ``vth``, ``tile_j0``: the key tile's transposed keys and values
    (:func:`pair_tiles`), or with ``by_rows`` the key head's keys and values
    ``kh``, ``vh`` as stored, one dot product per (row, key) (the dense
    forward's logits of so few rows, the same bits), or with ``by_keys`` and a
    full tile from ``kh``, ``vh`` against the rows transposed (the same bits as
    from ``kth``, ``vth``); ``scratch`` is
    :func:`~attnnb.cpu._grad_tiles.pair_scratch`'s, ``keys_scratch``
    :func:`~attnnb.cpu._grad_tiles.stored_keys_scratch`'s.  Returns
    ``(W, dS, dP, Wd)``, ``(nq, nk)`` views of the scratch, with ``dP``
    overwritten by ``z dP - delta`` (what ``d log key_size`` needs, with ``W``)
    and ``Wd = z W`` the weights that reach the values (``W`` itself without
    dropout), ``z`` the dropout factor (``1 / (1 - p)`` kept, 0 dropped).  Rows
    with ``lse = -inf`` (nothing allowed) have zero weights and gradients.

    With a score function (:mod:`attnnb.cpu._mod_hooks`) ``dS`` is the gradient
    of its values, and ``modded = (R_flat, M_flat)`` receives the logits
    before it and its slopes (:func:`~attnnb.cpu._mod_hooks.raw_gradients`);
    a mask function masks every pair.
    """
    q_flat, do_flat, S_flat, F_flat, W_flat, dS_flat, dP_flat, Wd_flat, _, words = scratch
    qt_flat, dot_flat, St_flat = keys_scratch
    keys_as_stored = by_keys and nk == TILE_K
    normalizer, indptr, indices = pair.normalizer, pair.indptr, pair.indices
    lse_bh, ratio_bh, delta_bh = pair.lse[b, h], pair.ratio[b, h], pair.delta[b, h]
    row0 = ph * q.shape[2] + i0  # CSR row of the tile's first query
    qs = scaled_rows(q[b, h], i0, nq, pair.scale, q_flat)
    if by_rows:
        S = tile_logits_rows(qs, kh, j0, nk, S_flat)
    elif keys_as_stored:
        qt = view2d(qt_flat, qs.shape[1], KEY_BLOCK_ROWS)
        transposed_queries(qs, qt)
        S = tile_logits_keys(qt, kh, vh, j0, nq, St_flat, S_flat, True)
    else:
        S = tile_logits_t(qs, kth, tile_j0, nk, S_flat)
    score_tile_kept(S, modded[0], modded[1], b, h, i0, j0, mods)  # before any -inf
    if csr_masked:
        # the pairs are visited in any order: find each row's first key >= j0
        for r in range(nq):
            start, stop = indptr[row0 + r], indptr[row0 + r + 1]
            cursor[r] = start + np.searchsorted(indices[start:stop], j0)
        csr_tile_mask(S, indptr, indices, row0, j0, cursor)
    if pair.selected:  # the forward's rule, on its ranking logits: s + log key_size
        logks_b = pair.logks[b]
        for r in range(nq):
            thr, cut = pair.thr[b, h, i0 + r], pair.cut[b, h, i0 + r]
            for c in range(nk):
                x = S[r, c] + logks_b[j0 + c] if pair.has_ks else S[r, c]
                if not (x > thr or (x == thr and j0 + c <= cut) or x != x):
                    S[r, c] = -np.inf  # (a key outside the mask: -inf below anyway)
    F = factor_tile(F_flat, S, normalizer)
    modify_logits(S, F, i0, j0, diag, pair.bias[b, h], pair.has_bias, pair.mask[b, h],
                  pair.has_mask, pair.logks[b], pair.has_ks, normalizer)
    mask_tile(S, b, h, i0, j0, True, mods)
    do = scaled_rows(pair.dout[b, h], i0, nq, 1.0, do_flat)
    if by_rows:
        dP = tile_logits_rows(do, vh, j0, nk, dP_flat)
    elif keys_as_stored:
        dot = view2d(dot_flat, do.shape[1], KEY_BLOCK_ROWS)
        transposed_queries(do, dot)
        dP = tile_logits_keys(dot, vh, vh, j0, nq, St_flat, dP_flat, False)
    else:
        dP = tile_logits_t(do, vth, tile_j0, nk, dP_flat)
    W = view2d(W_flat, nq, nk)
    dS = view2d(dS_flat, nq, nk)
    dropping = pair.dropout[2] != 0
    Wd = view2d(Wd_flat, nq, nk) if dropping else W
    if dropping:  # dP = z (dout . v) before the loop, which stays the plain one
        keep_factors(Wd, pair.dropout, b, h, i0, j0, words, pair.keep_scale)
        for r in range(nq):
            for c in range(nk):
                dP[r, c] *= Wd[r, c]
    for r in range(nq):
        lse = lse_bh[i0 + r]
        if lse == -np.inf:  # an empty row: no weight, no gradient
            W[r, :] = 0.0
            dS[r, :] = 0.0
            dP[r, :] = 0.0
            continue
        if normalizer == SIGMOID:
            sigmoid_row_gradients(S[r], F[r], W[r], dS[r], dP[r], delta_bh[i0 + r])
            continue
        if normalizer == SOFTPICK:
            softpick_row_gradients(S[r], F[r], W[r], dS[r], dP[r], lse, ratio_bh[i0 + r],
                                   delta_bh[i0 + r])
            continue
        exp_shifted(S[r], W[r], lse, nk)  # p = exp(s' - lse)
        ratio, delta = ratio_bh[i0 + r], delta_bh[i0 + r]
        for c in range(nk):
            p = ratio * W[r, c]
            if p == 0.0:  # a key the row does not weigh: its value never reaches it
                dS[r, c] = 0.0
                dP[r, c] = 0.0
                W[r, c] = 0.0
                continue
            grad = dP[r, c] - delta
            dS[r, c] = p * grad
            dP[r, c] = grad
            W[r, c] = p * F[r, c] if normalizer == RELU_EXPM1 else p
    if dropping:  # the weights that reach the values: z w
        for r in range(nq):
            for c in range(nk):
                Wd[r, c] *= W[r, c]
    return W, dS, dP, Wd


@inner
def sigmoid_row_gradients(s, f, w, ds, dp, delta):
    """One row of :func:`pair_gradients` for ``sigmoid``: ``w = f sigmoid(s)`` (``f`` the
    key sizes), ``ds = w (1 - sigmoid(s)) (dp - delta)``, ``dp`` becomes ``dp - delta``
    (``delta = -dlse / e^lse``: each weight depends on its own logit only); ``s`` is
    overwritten."""
    n = s.shape[0]
    one, zero = s.dtype.type(1.0), s.dtype.type(0.0)
    for c in range(n):
        w[c] = -s[c]
    exp_shifted(w, s, 0.0, n)  # e^-s over the logits: separate arrays vectorise
    for c in range(n):
        # exactly 0 where e^-s is out of range (a masked key among them), as the forward
        sig = zero if exp_overflows(w[c]) else quotient(one, one + s[c])
        p = f[c] * sig
        grad = dp[c] - delta
        live = p != 0.0  # a key the row does not weigh: its value never reaches it
        w[c] = p
        ds[c] = p * (1.0 - sig) * grad if live else 0.0
        dp[c] = grad if live else 0.0


@inner
def softpick_row_gradients(s, f, w, ds, dp, lse, ratio, delta):
    """One row of :func:`pair_gradients` for ``softpick``: with ``a = ratio f e^(s - lse)``
    (``f`` the key size, ``ratio = D / (D + eps)``) and ``u = ratio f (e^(s - lse) -
    e^-lse) = a (1 - e^-s)``: ``w = u`` for ``s > 0`` (else 0), ``ds = a ([s > 0] dp -
    sign(s) delta)``; ``dp`` becomes the term of ``d log key_size``, ``(1 - e^-s) ds``
    (``u (dp - delta)`` above 0, ``u delta`` below).  The exponentials come from the
    vectorised exp, the rest by selects."""
    n = s.shape[0]
    floor = math.exp(-lse)
    exp_shifted(s, w, lse, n)
    for c in range(n):
        x = s[c]
        a = ratio * f[c] * w[c]
        u = ratio * f[c] * (w[c] - floor)
        grad = dp[c] - delta
        above = x > 0.0
        # (-inf: a key the row may not attend; NaN: below, so that its row's dq is NaN)
        below = not x >= 0.0 and x != -np.inf
        w[c] = u if above else 0.0
        ds[c] = a * grad if above else (a * delta if below else 0.0)
        dp[c] = u * grad if above else (u * delta if below else 0.0)


@inner
def key_tile_gradients(pair, q, k, v, kt, vt, k_ok, local, by_rows, by_keys, own, b, g, t,
                       col_ptr, col_qt, col_full, need_dbias, own_dq, dq, dk, dv, dbias,
                       dlogks, scratch, keys_scratch, cursor, mods, modded, mod_grads):
    """Every gradient term of key tile ``t`` of key head ``g``: its ``dk``, ``dv``,
    ``dbias`` columns and ``dlogks``, and with ``own_dq`` its terms of ``dq``.

    Sweeps the query tiles that see the tile (``col_qt[col_ptr[...]]``, the
    forward's tile lists read by key tile) for every query head of the GQA
    group.  ``dq`` gets ``dS @ k_tile`` added unscaled (its owner scales it
    once at the end); ``dk`` and ``dv`` of the tile are written, scaled.
    ``kt``, ``vt``, ``k_ok``, ``local``, ``by_rows``, ``by_keys``, ``own``: as
    :func:`pair_tiles` takes them.  A score function's array gradients go to
    ``mod_grads`` (this task's group's, :mod:`attnnb.cpu._mod_hooks`).
    """
    _, _, Lq, Lk, Dv, group, _, n_kt, diag = sweep_geometry(q, k, dv, TILE_Q, pair.causal)
    D = k.shape[3]
    j0 = t * TILE_K
    nk = min(TILE_K, Lk - j0)
    T_flat = scratch[8]
    kth, vth, tile_j0, k_finite = pair_tiles(k, v, kt, vt, k_ok, local, by_rows, by_keys,
                                             own, b, g, t)
    dk_acc = np.zeros((nk, D), q.dtype)
    dv_acc = np.zeros((nk, Dv), q.dtype)
    for h in range(g * group, (g + 1) * group):
        ph = h if pair.p_heads > 1 else 0
        col = ph * n_kt + t
        for p in range(col_ptr[col], col_ptr[col + 1]):
            i0 = col_qt[p] * TILE_Q
            nq = min(TILE_Q, Lq - i0)
            partial = pair.csr and not col_full[p]  # (no control flow inside a call)
            W, dS, G, Wd = pair_gradients(pair, q, kth, vth, tile_j0, k[b, g], v[b, g],
                                          by_rows, by_keys, b, h, ph, i0, nq, j0, nk, diag,
                                          partial, cursor, scratch, keys_scratch, mods, modded)
            if need_dbias:
                for r in range(nq):
                    for c in range(nk):
                        dbias[b, h, i0 + r, j0 + c] = dS[r, c]
            add_array_gradients(dS, modded[0], b, h, i0, j0, mods, mod_grads)
            raw_gradients(dS, modded[1])
            if own_dq:
                # a key tile holding Inf or NaN: skip the zero weights, as the forward does
                add_weighted_values(dS, k[b, g], j0, k_finite, dq[b, h, i0 : i0 + nq], T_flat)
            transposed_values_product(Wd, pair.dout[b, h], i0, dv_acc, T_flat)
            transposed_values_product(dS, q[b, h], i0, dk_acc, T_flat)
            if pair.has_ks:
                # softpick's pair loop leaves the whole term in G (its weight may be 0)
                whole = pair.normalizer == SOFTPICK
                for r in range(nq):
                    for c in range(nk):
                        dlogks[b, g, j0 + c] += G[r, c] if whole else W[r, c] * G[r, c]
    for c in range(nk):
        for e in range(D):
            dk[b, g, j0 + c, e] = pair.scale * dk_acc[c, e]
        for e in range(Dv):
            dv[b, g, j0 + c, e] = dv_acc[c, e]


@kernel
def dkdv_kernel(q, k, v, kt, vt, k_ok, v_ok, local, pair, mods, mod_grads, col_ptr, col_qt,
                col_full, need_dbias, own_dq, dq, dk, dv, dbias, dlogks):
    """``dk``, ``dv``, ``dbias`` columns and ``dlogks`` (per key head; summed on the
    host), and with ``own_dq`` also ``dq``.

    Without ``own_dq``, one task per (batch, key head, key tile), and
    :func:`dq_kernel` forms ``dq`` afterwards.  With it, one task per (batch,
    key head) sweeps all its key tiles and owns ``dq`` of its GQA group's query
    heads as well (``dq`` must come in as zeros): each pair's weights are
    recomputed once instead of twice, five tile products instead of seven.
    One kernel for both, so that the one-sweep form costs no compile of its
    own; :func:`tiled_vjp` picks it from :data:`ONE_SWEEP_TASKS` key heads.

    ``kt``, ``vt``, ``k_ok``, ``v_ok``: the transposed tiles and their checks,
    filled before by :func:`attnnb.cpu._prologue.kv_tiles_kernel`, or, with
    ``local`` (few query rows), empty: each task transposes its tiles itself
    (:func:`pair_tiles`).  The
    query tiles that see key tile ``t`` of pattern head ``ph`` are
    ``col_qt[col_ptr[ph * n_kt + t] : col_ptr[ph * n_kt + t + 1]]`` (the
    forward's tile lists read by key tile, :func:`by_key_tile`); ``col_full``
    says which need no element mask from the CSR rows (``pair.csr``).

    ``mods``: the mask and score functions' arguments, ``mod_grads`` the score
    function's array gradients, one set per group of tasks
    (:mod:`attnnb.cpu._mod_hooks`).
    """
    B, Hq, Lq, D = q.shape
    Hk, Dv, n_kt = k.shape[1], v.shape[3], -(-k.shape[2] // TILE_K)
    group = Hq // Hk
    per_task = n_kt if own_dq else 1
    n_ranges = n_kt // per_task
    by_rows = few_rows(local, Lq, pair.selected)
    by_keys = from_stored_keys(local, Lq)
    n_tasks = B * Hk * n_ranges
    n_groups = task_groups(n_tasks)
    for grp in prange(n_groups):
        wide_vectors()
        group_grads = mod_grad_views(mod_grads, grp)
        for task in range(grp, n_tasks, n_groups):
            b, g, span = task // (Hk * n_ranges), (task // n_ranges) % Hk, task % n_ranges
            scratch = pair_scratch(q.dtype, D, Dv)
            keys_scratch = stored_keys_scratch(q.dtype, D, Dv, by_keys)
            cursor = np.empty(TILE_Q, np.int64)
            own = (np.empty((1, D, TILE_K), q.dtype), np.empty((1, Dv, TILE_K), q.dtype))
            modded = mod_scratch(q.dtype)
            for t in range(span * per_task, (span + 1) * per_task):
                key_tile_gradients(pair, q, k, v, kt, vt, k_ok, local, by_rows, by_keys, own,
                                   b, g, t, col_ptr, col_qt, col_full, need_dbias, own_dq, dq,
                                   dk, dv, dbias, dlogks, scratch, keys_scratch, cursor, mods,
                                   modded, group_grads)
            if own_dq:  # dq's terms arrived in key-tile order, as in dq_kernel; now scaled
                for h in range(g * group, (g + 1) * group):
                    for r in range(Lq):
                        for e in range(D):
                            dq[b, h, r, e] = pair.scale * dq[b, h, r, e]


@kernel
def dq_kernel(q, k, v, kt, vt, k_ok, local, pair, mods, row_ptr, row_kt, row_full, dq):
    """One task per (batch, query head, query tile): ``dq`` of its rows, over the key
    tiles ``row_kt[row_ptr[ph * n_qt + qt] : ...]`` of the forward's tile lists.

    ``kt``, ``vt``, ``k_ok``, ``local``: as :func:`dkdv_kernel`'s, the same buffers.
    """
    B, Hq, Lq, Lk, Dv, group, n_qt, n_kt, diag = sweep_geometry(q, k, v, TILE_Q, pair.causal)
    D = k.shape[3]
    by_rows = few_rows(local, Lq, pair.selected)
    by_keys = from_stored_keys(local, Lq)
    for task in prange(B * Hq * n_qt):
        wide_vectors()
        b, h, qt, i0, nq = task_rows(task, Hq, n_qt, TILE_Q, Lq)
        g = h // group
        ph = h if pair.p_heads > 1 else 0
        row = ph * n_qt + qt
        scratch = pair_scratch(q.dtype, D, Dv)
        keys_scratch = stored_keys_scratch(q.dtype, D, Dv, by_keys)
        cursor = np.empty(TILE_Q, np.int64)
        own = (np.empty((1, D, TILE_K), q.dtype), np.empty((1, Dv, TILE_K), q.dtype))
        modded = mod_scratch(q.dtype)
        dq_acc = np.zeros((nq, D), q.dtype)
        for p in range(row_ptr[row], row_ptr[row + 1]):
            j0 = row_kt[p] * TILE_K
            nk = min(TILE_K, Lk - j0)
            partial = pair.csr and not row_full[p]  # (no control flow inside a call)
            kth, vth, tile_j0, k_finite = pair_tiles(k, v, kt, vt, k_ok, local, by_rows,
                                                     by_keys, own, b, g, row_kt[p])
            _, dS, _, _ = pair_gradients(pair, q, kth, vth, tile_j0, k[b, g], v[b, g], by_rows,
                                         by_keys, b, h, ph, i0, nq, j0, nk, diag, partial,
                                         cursor, scratch, keys_scratch, mods, modded)
            raw_gradients(dS, modded[1])
            # a key tile holding Inf or NaN: skip the zero weights, as the forward does
            add_weighted_values(dS, k[b, g], j0, k_finite, dq_acc, scratch[8])
        for r in range(nq):
            for e in range(D):
                dq[b, h, i0 + r, e] = pair.scale * dq_acc[r, e]


def row_terms(problem, out, lse, dout, dlse):
    """``(ratio, delta)`` per row, ``(B, Hq, Lq)`` in the compute dtype.

    ``ratio`` is ``r`` of the module docstring; ``delta = dout . out - dlse / r``
    (summed in float64); for ``sigmoid``, whose weights are not normalised,
    ``delta = -dlse / e^lse``.  Empty rows (``lse = -inf``) get 0 for both.
    """
    dt = problem.q.dtype
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if problem.normalizer in ("softmax1", "softpick"):  # sigmoid(lse - sink)
            # the sink 0, a learned one, or softpick's eps: D / (D + eps)
            sink = kernel_sinks(problem)[:, :, None].astype(np.float64)
            ratio = 1.0 / (1.0 + np.exp(sink - lse.astype(np.float64)))
        else:
            ratio = np.ones(lse.shape)
        if problem.normalizer == "sigmoid":
            delta = np.zeros(lse.shape)
            if dlse is not None:
                delta = -dlse * np.exp(-lse.astype(np.float64))
        else:
            delta = np.einsum("bhid,bhid->bhi", dout, out, dtype=np.float64)
            if dlse is not None:
                delta = delta - dlse / ratio
        empty = np.isneginf(lse)
        delta = np.where(empty, 0.0, delta)
        ratio = np.where(empty, 0.0, ratio)
    return np.ascontiguousarray(ratio, dt), np.ascontiguousarray(delta, dt)


def tiled_vjp(problem, out, lse, dout, dlse, need_bias, pattern=None, selection=None):
    """Gradients of dense (``pattern=None``) or sparse attention of a canonical problem.

    Parameters
    ----------
    problem : :class:`~attnnb._front.validate.Problem`
        ``q (B, Hq, Lq, D)``, ``k, v (B, Hk, Lk, D / Dv)``, compute dtype.
    out, lse : the forward's ``(B, Hq, Lq, Dv)`` output and ``(B, Hq, Lq)`` LSE.
    dout : ``(B, Hq, Lq, Dv)``; dlse : ``(B, Hq, Lq)`` or None.
    need_bias : bool
        Materialise the bias gradient (only when a bias was given).
    pattern : :class:`~attnnb.patterns.Pattern`, optional
    selection : ``(thr, cut)``, optional
        A top-k selection held fixed (:func:`attnnb.cpu.topk.topk_selection`).

    Returns
    -------
    dict with ``"q"``, ``"k"``, ``"v"`` (canonical shapes), ``"bias"`` (full
    ``(B, Hq, Lq, Lk)``, or None) and ``"log_key_size"`` (``(B, Lk)``, or None).
    """
    q, k, v = problem.q, problem.k, problem.v
    B, Hq, Hk, Lq, Lk, D, Dv = problem.shape
    dt = q.dtype
    empty = q.size == 0 or k.size == 0 or v.size == 0
    one_sweep = B * Hk >= ONE_SWEEP_TASKS
    # dk and dv are written whole by dkdv_kernel, dq by dq_kernel; the one sweep adds
    # into dq, which must then start at zero (as everything of an empty problem)
    fresh = np.zeros if empty else written_whole
    dq = np.zeros(q.shape, dt) if one_sweep else fresh(q.shape, dt)
    dk, dv = fresh(k.shape, dt), fresh(v.shape, dt)
    has_ks = problem.log_key_size is not None
    need_bias = bool(need_bias and problem.bias is not None)
    dbias = np.zeros((B, Hq, Lq, Lk) if need_bias else (1, 1, 1, 1), dt)
    dlogks = np.zeros((B, Hk, Lk) if has_ks else (1, 1, 1), dt)
    grads = {"q": dq, "k": dk, "v": dv, "bias": dbias if need_bias else None,
             "log_key_size": np.zeros((B, Lk), dt) if has_ks else None}
    if empty:
        return grads
    n_qt, n_kt = -(-Lq // TILE_Q), -(-Lk // TILE_K)
    if pattern is None:
        # placeholders typed as a Pattern's arrays: one compiled kernel for both paths
        indptr, indices = read_only(np.zeros(1, np.int64)), read_only(np.zeros(1, np.int32))
        p_heads = 1
        visible = (None if problem.mask is None and problem.mask_mod is None else
                   visible_tiles(tile_map(problem), n_qt, n_kt))
        rows = dense_tiles(Lq, Lk, problem.causal, visible)
    else:
        layout = pattern.blocks(TILE_Q, TILE_K)
        p_heads, indptr, indices = pattern.n_heads, pattern.indptr, pattern.indices
        rows = (layout.tile_ptr, layout.tile_idx, layout.tile_full)
    cols = by_key_tile(*rows, n_qt, n_kt)
    if selection is None:
        thr, cut = np.zeros((1, 1, 1), dt), np.zeros((1, 1, 1), np.int64)
    else:
        thr, cut = selection
    dout = np.ascontiguousarray(dout, dt)
    lse = np.ascontiguousarray(lse, dt)
    ratio, delta = row_terms(problem, out, lse, dout, dlse)
    bias, mask, logks = score_arguments(problem)
    pair = PairArguments(
        scale=dt.type(problem.scale), bias=bias, has_bias=problem.bias is not None, mask=mask,
        has_mask=problem.mask is not None, logks=logks, has_ks=has_ks, causal=problem.causal,
        normalizer=NORMALIZER_CODES[problem.normalizer], dout=dout, lse=lse, ratio=ratio,
        delta=delta, p_heads=p_heads, indptr=indptr, indices=indices, csr=pattern is not None,
        selected=selection is not None, thr=thr, cut=cut, dropout=kernel_dropout(problem),
        keep_scale=dt.type(keep_scale(problem.dropout_p)))
    # few query rows: each key tile serves one query tile, so a task transposes it itself
    # instead of a prologue pass over all of k and v (the forward's rule, _decoding)
    local = Lq <= LOCAL_TILE_ROWS
    mods = mods_argument(problem)
    mod_grads = group_gradients(problem, mods, B * Hk * (1 if one_sweep else n_kt))
    with filled_kv_tiles(k, v, tiles=not local) as (kt, vt, k_ok, v_ok):
        launch(mod_kernel(dkdv_kernel, problem), q, k, v, kt, vt, k_ok, v_ok, local, pair,
               mods, mod_grads, *cols, need_bias, one_sweep, dq, dk, dv, dbias, dlogks)
        if not one_sweep:
            launch(mod_kernel(dq_kernel, problem), q, k, v, kt, vt, k_ok, local, pair, mods,
                   *rows, dq)
    if has_ks:
        grads["log_key_size"] = dlogks.sum(axis=1)
    if problem.score_mod is not None:
        grads["score_mod"] = parameter_gradients(problem, mod_grads)
    return grads


def attention_vjp(problem, out, lse, dout, dlse, dbias_shape=None):
    """Gradients of :func:`attnnb.attention` (the interface of :mod:`attnnb.vjp`).

    The bias gradient is formed full size, ``(B, Hq, Lq, Lk)``, then summed
    to ``dbias_shape``: each key-tile task owns its columns, so there are
    no write races.  For a broadcast bias whose full-size buffer would pass
    :data:`~attnnb._core.bias_chunks.CHUNK_BYTES` the backward runs in chunks
    of batch elements or key heads instead (:mod:`attnnb._core.bias_chunks`).
    """
    problem = first_tier.stand_in(problem, dkdv_kernel) or problem
    chunks = bias_chunks(problem.shape, problem.q.dtype.itemsize, dbias_shape,
                         min_heads=ONE_SWEEP_TASKS)
    if chunks is not None:
        mod_parts = []

        def run(part, out_c, lse_c, dout_c, dlse_c):
            g = tiled_vjp(part, out_c, lse_c, dout_c, dlse_c, True)
            if "score_mod" in g:
                mod_parts.append(g["score_mod"])
            return g["q"], g["k"], g["v"], g["bias"], g["log_key_size"]

        whole = chunked_vjp(run, problem, (out, lse, dout, dlse), chunks, dbias_shape)
        return whole + (sum_param_grads(mod_parts),) if mod_parts else whole
    g = tiled_vjp(problem, out, lse, dout, dlse, dbias_shape is not None)
    dbias = None if dbias_shape is None else sum_to_shape(g["bias"], dbias_shape)
    grads = (g["q"], g["k"], g["v"], dbias, g["log_key_size"])
    return grads + (g["score_mod"],) if "score_mod" in g else grads


def sparse_attention_vjp(problem, pattern, out, lse, dout, dlse):
    """Gradients of :func:`attnnb.sparse_attention`: the pattern's tiles only."""
    g = tiled_vjp(problem, out, lse, dout, dlse, False, pattern=pattern)
    grads = (g["q"], g["k"], g["v"], None, g["log_key_size"])
    return grads + (g["score_mod"],) if "score_mod" in g else grads


def map_problem(problem, c):
    """Map ``c`` of every pair of a differential problem as attention: query heads and
    key heads ``c::2``, the shared values, with its sinks (query head ``2h + c``'s) as
    ``softmax1``'s when the pairs have sinks."""
    sinks = problem.sinks
    return dataclasses.replace(problem, q=np.ascontiguousarray(problem.q[:, c::2]),
                               k=np.ascontiguousarray(problem.k[:, c::2]),
                               sinks=None if sinks is None else np.ascontiguousarray(
                                   sinks[:, c::2]),
                               normalizer="softmax" if sinks is None else "softmax1")


def diff_attention_vjp(problem, lam, mode, out, dout, dbias_shape=None):
    """Gradients of :func:`attnnb.diff_attention` (``mode="difference"``).

    ``out = o1 - lam * o2`` with ``o_c`` plain attention of stream ``c``
    (query heads ``c::2``, key heads ``c::2``, the shared values): each
    stream's forward is recomputed (for its LSE and ``o2``), then each
    stream's backward runs with ``dout`` and ``-lam * dout``, and
    ``dlam = -sum(dout * o2)``.  Bias and key-size gradients add both maps'.
    The rectified and Heaviside modes have kernels of their own
    (:mod:`attnnb.cpu.rectified_backward`).
    """
    if mode != "difference":
        return rectified_vjp(problem, lam, dout, dbias_shape, mode)
    dt = problem.q.dtype
    lam = np.asarray(lam, dt)
    dout = np.ascontiguousarray(dout, dt)
    grads, o2 = [], None
    for c in range(2):
        stream = map_problem(problem, c)
        o_c, lse_c = attention_forward(stream)
        if c == 1:
            o2 = o_c
        d_c = dout if c == 0 else np.ascontiguousarray(-lam[..., None] * dout)
        grads.append(attention_vjp(stream, o_c, lse_c, d_c, None, dbias_shape))
    (dq1, dk1, dv1, db1, dl1, *dm1), (dq2, dk2, dv2, db2, dl2, *dm2) = grads
    dq = np.empty(problem.q.shape, dt)
    dq[:, 0::2], dq[:, 1::2] = dq1, dq2
    dk = np.empty(problem.k.shape, dt)
    dk[:, 0::2], dk[:, 1::2] = dk1, dk2
    dlam = -np.einsum("bhid,bhid->bhi", dout, o2, dtype=np.float64).astype(dt)
    dbias = None if db1 is None else db1 + db2
    dlogks = None if dl1 is None else dl1 + dl2
    result = (dq, dk, dv1 + dv2, dbias, dlogks, dlam)
    return result + (sum_param_grads(dm1 + dm2),) if dm1 else result


def topk_attention_vjp(problem, top_k, out, lse, dout, dlse):
    """Gradients of :func:`attnnb.topk_attention`, its selection held fixed.

    The selection is recomputed by the forward kernel itself (one more
    forward pass), so it is the forward's exactly, ties included.
    """
    _, _, thr, cut = topk_selection(problem, top_k)
    g = tiled_vjp(problem, out, lse, dout, dlse, False, selection=(thr, cut))
    grads = (g["q"], g["k"], g["v"], None, g["log_key_size"])
    return grads + (g["score_mod"],) if "score_mod" in g else grads
