"""Gradients of rectified differential attention on the CPU.

``out = P @ v`` with ``P = max(0, A1 - lam * A2)`` and ``A_c`` the softmax
map of stream ``c`` (query heads ``2h + c``, key heads ``2g + c``).  With
``G = [P > 0] * (dout @ v^T)`` (the clip at 0 has derivative 0)::

    dv   = P^T @ dout
    ds1  = A1 * (G - d1),        d1 = rowsum(G * A1)
    ds2  = -lam * A2 * (G - e),  e  = rowsum(G * A2),   dlam = -e

With dropout (factors ``z``: ``1 / (1 - p)`` kept, 0 dropped), ``out = (z P) @
v``: ``G`` and ``P`` are both multiplied by ``z``, and the lines above hold.

The Heaviside mode, ``P = A1 - lam g`` with the gate ``g = H(A1 - lam A2)``
held fixed, runs the same kernels: ``G = dout @ v^T`` unclipped, the tile of
``A2`` replaced by ``g`` (so that ``e = rowsum(G g)``, ``dlam = -e``) and
``ds2 = 0`` (the second map enters only through the gate).
    dq_c = scale ds_c @ k_c,  dk_c = scale ds_c^T @ q_c,  dbias = ds1 + ds2

The row sums ``d1`` and ``e`` need every key of a row before any ``ds``
can be formed (unlike softmax's ``D = dout . out``, they cannot be read off
the output, which the clip changed).  The query-tile sweep forms them in a
first pass over its key tiles and ``dq`` in a second; the key-tile sweep
(``dk``, ``dv``) runs after it, as in :mod:`attnnb.cpu.backward`.  Each
stream's LSE comes from the dense forward.  Nothing ``(Lq, Lk)`` is stored.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import prange

from .._core.bias_chunks import bias_chunks, chunked_vjp, sum_to_shape
from .._core.codes import DIFF_MODE_CODES, HEAVISIDE, SOFTMAX
from .._core.dropout import keep_scale
from .._mods.compile import sum_param_grads
from ._dropout import kernel_dropout, scale_by_kept
from ._exp import exp_shifted
from ._grad_tiles import (
    by_key_tile,
    dense_tiles,
    pair_scratch,
    written_whole,
)
from ._host import score_arguments
from ._jit import inner, kernel, launch, wide_vectors
from ._mod_hooks import (
    add_array_gradients,
    mask_tile,
    mod_grad_views,
    mod_scratch,
    raw_gradients,
    score_tile_kept,
    task_groups,
)
from ._mods import group_gradients, mod_kernel, mods_argument, parameter_gradients
from ._prologue import filled_kv_tiles
from ._task import sweep_geometry
from ._tiles import (
    TILE_K,
    TILE_Q,
    add_weighted_values,
    key_tiles_seen,
    modify_logits,
    scaled_rows,
    task_rows,
    tile_logits_t,
    transposed_values_product,
    view2d,
)
from .attention import attention as attention_forward


@inner
def stream_map(q_bh, kth, b, h, i0, nq, j0, nk, scale, diag, bias_bh, has_bias, mask_bh,
               has_mask, logks_b, has_ks, mods, R_flat, M_flat, lse_bh, q_flat, S_flat):
    """``A = exp(s' - lse)`` of one stream's tile (``s'`` the modified logit), ``(nq, nk)``;
    rows without an allowed key (``lse = -inf``) are zero.  A score function's logits
    before it and slopes go to ``R_flat`` and ``M_flat`` (:mod:`attnnb.cpu._mod_hooks`)."""
    qs = scaled_rows(q_bh, i0, nq, scale, q_flat)
    S = tile_logits_t(qs, kth, j0, nk, S_flat)
    score_tile_kept(S, R_flat, M_flat, b, h, i0, j0, mods)
    modify_logits(S, S, i0, j0, diag, bias_bh, has_bias, mask_bh, has_mask, logks_b, has_ks,
                  SOFTMAX)
    mask_tile(S, b, h, i0, j0, True, mods)
    for r in range(nq):
        lse = lse_bh[i0 + r]
        if lse == -np.inf:
            S[r, :] = 0.0
        else:
            exp_shifted(S[r], S[r], lse, nk)
    return S


@inner
def rectified_pair(q, kt, vt, dout, b, h, g, i0, nq, j0, nk, scale, diag, bias, has_bias, mask,
                   has_mask, logks, has_ks, lse1, lse2, lam, mode, dropout, keep_scale, q_flat,
                   do_flat, A1_flat, A2_flat, G_flat, W_flat, words, mods, modded):
    """``(A1, A2, G, W)`` of one (query tile, key tile) pair: both maps, the clipped
    cotangent of ``P`` and the weights ``W = max(0, A1 - lam A2)``, ``(nq, nk)`` each,
    the last two times the dropout factors (``words``: the generator's scratch).  In the
    Heaviside ``mode``: ``A2`` is the gate, ``G`` unclipped, ``W = A1 - lam A2``.
    ``modded``: each stream's ``(R_flat, M_flat)`` for a score function."""
    (R1, M1), (R2, M2) = modded
    A1 = stream_map(q[b, 2 * h], kt[b, 2 * g], b, h, i0, nq, j0, nk, scale, diag, bias[b, h],
                    has_bias, mask[b, h], has_mask, logks[b], has_ks, mods, R1, M1,
                    lse1[b, h], q_flat, A1_flat)
    A2 = stream_map(q[b, 2 * h + 1], kt[b, 2 * g + 1], b, h, i0, nq, j0, nk, scale, diag,
                    bias[b, h], has_bias, mask[b, h], has_mask, logks[b], has_ks, mods, R2, M2,
                    lse2[b, h], q_flat, A2_flat)
    do = scaled_rows(dout[b, h], i0, nq, 1.0, do_flat)
    G = tile_logits_t(do, vt[b, g], j0, nk, G_flat)
    W = view2d(W_flat, nq, nk)
    for r in range(nq):
        lr = lam[b, h, i0 + r]
        if mode == HEAVISIDE:
            for c in range(nk):
                gate = 1.0 if A1[r, c] - lr * A2[r, c] > 0.0 else 0.0
                A2[r, c] = gate
                W[r, c] = A1[r, c] - lr * gate
            continue
        for c in range(nk):
            w = A1[r, c] - lr * A2[r, c]
            if w > 0.0:
                W[r, c] = w
            else:
                W[r, c] = 0.0
                G[r, c] = 0.0
    scale_by_kept(W, G, dropout, b, h, i0, j0, words, keep_scale)
    return A1, A2, G, W


@inner
def logit_gradients(A1, A2, G, lam_bh, d1_bh, e_bh, i0, second, dS1_flat, dS2_flat):
    """``ds1 = A1 (G - d1)`` and ``ds2 = -lam A2 (G - e)`` of one pair, ``(nq, nk)``;
    ``ds2 = 0`` unless ``second`` (the second map has a gradient)."""
    nq, nk = A1.shape
    dS1 = view2d(dS1_flat, nq, nk)
    dS2 = view2d(dS2_flat, nq, nk)
    for r in range(nq):
        x1, x2, lr = d1_bh[i0 + r], e_bh[i0 + r], lam_bh[i0 + r]
        for c in range(nk):
            dS1[r, c] = A1[r, c] * (G[r, c] - x1)
            dS2[r, c] = -lr * A2[r, c] * (G[r, c] - x2) if second else 0.0
    return dS1, dS2


@kernel
def rect_dkdv_kernel(q, k, v, kt, vt, k_ok, v_ok, scale, bias, has_bias, mask, has_mask, logks,
                     has_ks, causal, dout, lse1, lse2, lam, mode, dropout, keep_scale, d1, e,
                     mods, mod_grads, col_ptr, col_qt, need_dbias,
                     dk, dv, dbias, dlogks):
    """One task per (batch, value head, key tile): ``dv``, both streams' ``dk``, and that
    tile's ``dbias`` columns and ``dlogks`` (per value head; summed on the host); a score
    function's array gradients by groups of tasks (:mod:`attnnb.cpu._mod_hooks`)."""
    B, H2, Lq, Lk, Dv, group, n_qt, n_kt, diag = sweep_geometry(q, k, v, TILE_Q, causal)
    Hv = v.shape[1]
    n_tasks = B * Hv * n_kt
    n_groups = task_groups(n_tasks)
    for grp in prange(n_groups):
        wide_vectors()
        group_grads = mod_grad_views(mod_grads, grp)
        for task in range(grp, n_tasks, n_groups):
            b, g, t = task // (Hv * n_kt), (task // n_kt) % Hv, task % n_kt
            key_tile_pairs(q, kt, vt, dout, b, g, t, group, Lq, Lk, Dv, diag, scale, bias,
                           has_bias, mask, has_mask, logks, has_ks, lse1, lse2, lam, mode,
                           dropout, keep_scale, d1, e, mods, group_grads, col_ptr, col_qt,
                           need_dbias, dk, dv, dbias, dlogks)


@inner
def key_tile_pairs(q, kt, vt, dout, b, g, t, group, Lq, Lk, Dv, diag, scale, bias, has_bias,
                   mask, has_mask, logks, has_ks, lse1, lse2, lam, mode, dropout, keep_scale,
                   d1, e, mods, mod_grads, col_ptr, col_qt, need_dbias, dk, dv, dbias, dlogks):
    """The gradients of key tile ``t`` of value head ``g``: one task of
    :func:`rect_dkdv_kernel`."""
    D = q.shape[3]
    j0 = t * TILE_K
    nk = min(TILE_K, Lk - j0)
    (q_flat, do_flat, A1_flat, A2_flat, G_flat, W_flat, dS1_flat, dS2_flat,
     T_flat, words) = pair_scratch(q.dtype, D, Dv)
    modded = (mod_scratch(q.dtype), mod_scratch(q.dtype))
    dk1 = np.zeros((nk, D), q.dtype)
    dk2 = np.zeros((nk, D), q.dtype)
    dv_acc = np.zeros((nk, Dv), q.dtype)
    for h in range(g * group, (g + 1) * group):
        for p in range(col_ptr[t], col_ptr[t + 1]):
            i0 = col_qt[p] * TILE_Q
            nq = min(TILE_Q, Lq - i0)
            A1, A2, G, W = rectified_pair(
                q, kt, vt, dout, b, h, g, i0, nq, j0, nk, scale, diag, bias, has_bias,
                mask, has_mask, logks, has_ks, lse1, lse2, lam, mode, dropout, keep_scale,
                q_flat, do_flat, A1_flat, A2_flat, G_flat, W_flat, words, mods, modded)
            dS1, dS2 = logit_gradients(A1, A2, G, lam[b, h], d1[b, h], e[b, h], i0,
                                       mode != HEAVISIDE, dS1_flat, dS2_flat)
            if need_dbias:
                for r in range(nq):
                    for c in range(nk):
                        dbias[b, h, i0 + r, j0 + c] = dS1[r, c] + dS2[r, c]
            if has_ks:
                for r in range(nq):
                    for c in range(nk):
                        dlogks[b, g, j0 + c] += dS1[r, c] + dS2[r, c]
            # the score function's values' gradients: into its arrays, then through it
            add_array_gradients(dS1, modded[0][0], b, h, i0, j0, mods, mod_grads)
            add_array_gradients(dS2, modded[1][0], b, h, i0, j0, mods, mod_grads)
            raw_gradients(dS1, modded[0][1])
            raw_gradients(dS2, modded[1][1])
            transposed_values_product(W, dout[b, h], i0, dv_acc, T_flat)
            transposed_values_product(dS1, q[b, 2 * h], i0, dk1, T_flat)
            transposed_values_product(dS2, q[b, 2 * h + 1], i0, dk2, T_flat)
    for c in range(nk):
        for x in range(D):
            dk[b, 2 * g, j0 + c, x] = scale * dk1[c, x]
            dk[b, 2 * g + 1, j0 + c, x] = scale * dk2[c, x]
        for x in range(Dv):
            dv[b, g, j0 + c, x] = dv_acc[c, x]


@kernel
def rect_dq_kernel(q, k, v, kt, vt, k_ok, v_ok, scale, bias, has_bias, mask, has_mask, logks,
                   has_ks, causal, dout, lse1, lse2, lam, mode, dropout, keep_scale, d1, e,
                   mods, dq):
    """One task per (batch, head pair, query tile): its rows' sums ``d1 = rowsum(G A1)``
    and ``e = rowsum(G A2)`` (pass 0, ``(B, H, Lq)``, which the dK/dV sweep reads
    too), then both streams' ``dq`` (pass 1).  One call site of the pair's
    recomputation serves both passes (it is inlined: once, not twice)."""
    B, H2, Lq, Lk, Dv, group, n_qt, n_kt, diag = sweep_geometry(q, k, v, TILE_Q, causal)
    D = q.shape[3]
    for task in prange(B * (H2 // 2) * n_qt):
        wide_vectors()
        b, h, _, i0, nq = task_rows(task, H2 // 2, n_qt, TILE_Q, Lq)
        g = h // group
        (q_flat, do_flat, A1_flat, A2_flat, G_flat, W_flat, dS1_flat, dS2_flat,
         T_flat, words) = pair_scratch(q.dtype, D, Dv)
        modded = (mod_scratch(q.dtype), mod_scratch(q.dtype))
        dq1 = np.zeros((nq, D), q.dtype)
        dq2 = np.zeros((nq, D), q.dtype)
        d1[b, h, i0 : i0 + nq] = 0.0
        e[b, h, i0 : i0 + nq] = 0.0
        for phase in range(2):
            for t in range(key_tiles_seen(i0, nq, diag, n_kt)):
                j0 = t * TILE_K
                nk = min(TILE_K, Lk - j0)
                A1, A2, G, _ = rectified_pair(
                    q, kt, vt, dout, b, h, g, i0, nq, j0, nk, scale, diag, bias, has_bias,
                    mask, has_mask, logks, has_ks, lse1, lse2, lam, mode, dropout, keep_scale,
                    q_flat, do_flat, A1_flat, A2_flat, G_flat, W_flat, words, mods, modded)
                if phase == 0:
                    for r in range(nq):
                        s1 = 0.0
                        s2 = 0.0
                        for c in range(nk):
                            s1 += G[r, c] * A1[r, c]
                            s2 += G[r, c] * A2[r, c]
                        d1[b, h, i0 + r] += s1
                        e[b, h, i0 + r] += s2
                    continue
                dS1, dS2 = logit_gradients(A1, A2, G, lam[b, h], d1[b, h], e[b, h], i0,
                                           mode != HEAVISIDE, dS1_flat, dS2_flat)
                raw_gradients(dS1, modded[0][1])
                raw_gradients(dS2, modded[1][1])
                # key tiles holding Inf or NaN: skip the zero weights, as the forward does
                add_weighted_values(dS1, k[b, 2 * g], j0, k_ok[b, 2 * g, t], dq1, T_flat)
                add_weighted_values(dS2, k[b, 2 * g + 1], j0, k_ok[b, 2 * g + 1, t], dq2,
                                    T_flat)
        for r in range(nq):
            for x in range(D):
                dq[b, 2 * h, i0 + r, x] = scale * dq1[r, x]
                dq[b, 2 * h + 1, i0 + r, x] = scale * dq2[r, x]


def stream_lses(problem):
    """Each stream's LSE ``(B, H, Lq)`` from the dense forward, with its map's sink when
    the pairs have sinks (``log(e^sink + e^lse)``: what normalises the map).

    The forward runs on values of width zero: the same kernel (the same types),
    the same logits and so the same LSE bit for bit, without the value
    product, which at ``Dv = 2d`` is two thirds of the forward's work
    (docs/notes/performance.md, "The rectified backward, chunked bias gradients and first
    calls").
    """
    lses = []
    no_values = np.ascontiguousarray(problem.v[..., :0])
    for c in range(2):  # dropout leaves the LSEs as they are
        stream = dataclasses.replace(problem, q=np.ascontiguousarray(problem.q[:, c::2]),
                                     k=np.ascontiguousarray(problem.k[:, c::2]), v=no_values,
                                     dropout_p=0.0, sinks=None, normalizer="softmax")
        lse = attention_forward(stream)[1]
        if problem.sinks is not None:  # the maps' normalisers: e^sink + sum e^s
            with np.errstate(invalid="ignore"):
                lse = np.logaddexp(lse, problem.sinks[:, c::2, None]).astype(lse.dtype)
        lses.append(np.ascontiguousarray(lse))
    return lses


def rectified_vjp(problem, lam, dout, dbias_shape=None, mode="rectified"):
    """Gradients of ``diff_attention(mode="rectified")`` (or ``"heaviside"``) of a
    canonical problem.

    The interface of :func:`attnnb.cpu.backward.diff_attention_vjp`: returns
    ``(dq, dk, dv, dbias, dlog_key_size, dlam)``.  The bias gradient is
    formed full size, ``(B, H, Lq, Lk)``, and summed to ``dbias_shape``; for a
    broadcast bias whose buffer would pass
    :data:`~attnnb._core.bias_chunks.CHUNK_BYTES`, chunk by chunk of batch
    elements or value heads (:mod:`attnnb._core.bias_chunks`; every chunk size
    keeps all the kernels' tasks, one per key tile).
    """
    B, H2, _, Lq, Lk = problem.shape[:5]
    Hv = problem.v.shape[1]
    chunks = bias_chunks((B, H2 // 2, Hv, Lq, Lk), problem.q.dtype.itemsize, dbias_shape)
    if chunks is None:
        dq, dk, dv, dbias, dlks, dlam, *dmod = tiled_rectified_vjp(
            problem, lam, dout, dbias_shape is not None, mode)
        if dbias_shape is not None:
            dbias = sum_to_shape(dbias, dbias_shape)
        return (dq, dk, dv, dbias, dlks, dlam, *dmod)
    lam = np.broadcast_to(lam, (B, H2 // 2, Lq))
    mod_parts = []

    def run(part, lam_c, dout_c):
        grads = tiled_rectified_vjp(part, lam_c, dout_c, True, mode)
        mod_parts.extend(grads[6:])  # a score function's parameter gradients
        return grads[:6]

    whole = chunked_vjp(run, problem, (lam, dout), chunks, dbias_shape, streams=2)
    return whole + (sum_param_grads(mod_parts),) if problem.score_mod is not None else whole


def tiled_rectified_vjp(problem, lam, dout, need_bias, mode="rectified"):
    """:func:`rectified_vjp` in one piece: ``(dq, dk, dv, dbias, dlog_key_size, dlam)``
    with ``dbias`` full size, ``(B, H, Lq, Lk)``, when ``need_bias`` (else None)."""
    q, k, v = problem.q, problem.k, problem.v
    B, H2, Hk2, Lq, Lk, D, Dv = problem.shape
    H, dt = H2 // 2, q.dtype
    run = bool(q.size and k.size and v.size)
    # the two kernels write dq, d1, e and dk, dv whole; an empty problem's are zeros
    fresh = written_whole if run else np.zeros
    dq, dk, dv = fresh(q.shape, dt), fresh(k.shape, dt), fresh(v.shape, dt)
    has_ks = problem.log_key_size is not None
    dbias = np.zeros((B, H, Lq, Lk) if need_bias else (1, 1, 1, 1), dt)
    dlogks = np.zeros((B, Hk2 // 2, Lk) if has_ks else (1, 1, 1), dt)
    d1, e = fresh((B, H, Lq), dt), fresh((B, H, Lq), dt)
    if run:
        lse1, lse2 = stream_lses(problem)
        lam = np.ascontiguousarray(np.broadcast_to(lam, (B, H, Lq)), dt)
        dout = np.ascontiguousarray(dout, dt)
        bias, mask, logks = score_arguments(problem)
        common = (dt.type(problem.scale), bias, problem.bias is not None, mask,
                  problem.mask is not None, logks, has_ks, problem.causal, dout, lse1, lse2,
                  lam, DIFF_MODE_CODES[mode], kernel_dropout(problem),
                  dt.type(keep_scale(problem.dropout_p)))
        col_ptr, col_qt, _ = by_key_tile(*dense_tiles(Lq, Lk, problem.causal),
                                         -(-Lq // TILE_Q), -(-Lk // TILE_K))
        mods = mods_argument(problem)
        mod_grads = group_gradients(problem, mods, B * v.shape[1] * -(-Lk // TILE_K))
        with filled_kv_tiles(k, v) as (kt, vt, k_ok, v_ok):
            bufs = (q, k, v, kt, vt, k_ok, v_ok)
            # first: it forms d1 and e
            launch(mod_kernel(rect_dq_kernel, problem), *bufs, *common, d1, e, mods, dq)
            launch(mod_kernel(rect_dkdv_kernel, problem), *bufs, *common, d1, e, mods,
                   mod_grads, col_ptr, col_qt, need_bias, dk, dv, dbias, dlogks)
    grads = (dq, dk, dv, dbias if need_bias else None, dlogks.sum(axis=1) if has_ks else None,
             -e)
    if problem.score_mod is None:
        return grads
    return grads + (parameter_gradients(problem, mod_grads) if run else None,)
