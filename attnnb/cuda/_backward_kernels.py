"""The backward's kernels: their builders, their caches and their PTX catalogue.

Two kernels, as FlashAttention-2, for one or two score streams
(``Tiling.streams``; tilings from :mod:`attnnb.cuda._backward_tiling`, the
pair's weights and logit gradients from :mod:`attnnb.cuda._backward_pair`):

* :func:`build_dq`: a block per (batch, query head or pair, query tile)
  owns ``dQ``, sweeping the key tiles of its row of the tile lists; with two
  streams it first sweeps them once for ``d1`` and ``e`` (written for the
  other kernel).
* :func:`build_dkdv`: a block per (batch, key / value head, key tile) owns
  ``dK`` and ``dV`` of its keys, sweeping every query head of its GQA group
  and the query tiles that see the key tile (the tile lists read by key
  tile, :meth:`attnnb.patterns.BlockLayout.by_key_tile`); it also writes
  the full bias gradient (each element once a launch; a differential
  pair's second stream adds to what the first wrote) and adds ``d log
  key_size`` per key head.

``S`` and ``dP`` micro-tiles live in registers, the products ``dO V^T``,
``W^T dO``, ``dS^T Q`` and ``dS K`` go through the core's
:func:`~attnnb.cuda._micro.micro_functions` ``micro_product`` on tiles staged
in shared memory (transposed for the score-like products, row-major for the
others).  Dense, causal and sparse problems all walk tile lists; a sparse
partial tile's mask comes from the CSR runs, as in the forward.  The
variants (``dense``, ``sparse``, ``topk``, the pair streams ``stream0``,
``stream1``, ``clipped0``, ``clipped1``, ``gated0``) are compile-time constants of each
build, cached per (variant, dropout, mods, dtype, tiling) by
:func:`dq_kernel` and :func:`dkdv_kernel`.

The helper kernels, one thread per row or element (:data:`ROW_THREADS` a
block, :func:`element_grid`): the rows' terms of one stream
(:func:`build_row_terms`) or of one stream of a pair
(:func:`build_pair_rows`), ``dlam`` (:func:`build_negated_row`, or
:func:`build_negated_dot` in the Heaviside mode) and the sum of a gradient
to a broadcast shape (:func:`build_sum_to`).

Invariants: no two blocks of a launch write one element (no atomics), and
every sum runs in a fixed order, so the results are the same bit for bit
from run to run.  :func:`ptx_signatures` lists every build the PTX gate
(``gpu/ptx_check.py``) compiles.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.np.numpy_support import from_dtype as numba_type

from .._core.codes import RELU_EXPM1, SIGMOID, SOFTMAX1, SOFTPICK
from .._core.specialise import specialise
from ._backward_pair import pair_functions, pair_stream
from ._backward_tiling import (
    KNOWN_GATE_FAILURES,
    backward_tiling,
    dkdv_parts,
    dq_parts,
    geometry,
    key_tile_layout,
    part_offsets,
    round_up4,
)
from ._micro import ALIGN, U32, Tiling, kernel_label, micro_functions, tiled_kernel
from ._tiles import cached_kernel, device, dtype_kernel, kernel, unbound

ROW_THREADS = 128  # threads per block of the one-thread-per-element helper kernels


# the globals the kernels' templates read, bound per build (dq_constants, dkdv_constants)
(nt, TM, TN, BQ, BK, NT, N_S, STREAMS, D, DV, TD, DQP, NX, TDK, DKP, TVK, DVKP, N_QS, N_KS,
 N_DS, N_TILE, N_QQ, N_ALL, O_Q, O_O, O_KV, O_V, O_DS, O_RED, O_ROWS, O_FLAG, O_K, O_W, O_X,
 CAST, ZERO, ONE, CSR, SELECTED, HS, HOFF, PAIR, CLIPPED, GATED, PHASES, ADD, MOD_GRADS,
 mod_agrad, mod_views, block_tile, thread_place, stage_transposed, stage_dT, stage_keys,
 stage_q, stage_o, dq_product, dk_product, dv_product, store_tile, row_reduce,
 stage_tile_mask, slope_tile, pair_registers, load_rows, tile_gradients, row_zeros,
 dq_zeros, dk_zeros, dv_zeros, NINF, sigmoid, index) = unbound(73)


def _variant_constants(streams: int, variant: str) -> dict:
    hs, hoff, pair = pair_stream(streams, variant)
    return dict(CSR=variant == "sparse", SELECTED=variant == "topk", HS=hs, HOFF=hoff,
                PAIR=pair, CLIPPED=variant.startswith("clipped"), GATED=variant == "gated0")


def build_dq(dtype, tiling: Tiling, variant: str = "dense", dropout: bool = False,
             mods=None, own=None):
    """The query-tile kernel (``dQ``; with two streams also ``d1``, ``e``).

    Arguments: ``q, k, v, dout`` (4-D, the forward's head layout), ``scale``,
    ``bias`` / ``mask`` / ``logks`` with their flags, ``causal``, the
    normalizer code, ``row_terms (B, H, NR, Lq)`` (per-row values, see
    :func:`pair_functions`), ``selected`` (top-k), ``diff_mode`` (the two-stream
    kernels' differential mode code), ``clip`` (the clip bits of the ``"clipped"`` and
    ``"gated"`` variants; top-k's selection, in the same layout), the
    pattern's ``p_heads``, CSR ``indptr`` / ``indices`` and ``csr`` flag, the
    tile lists ``tile_ptr, tile_idx, tile_full``, ``dq`` and ``mods`` (the mods' arrays;
    ``()`` without, and ``mods=None``).  Grid ``(B * H, query tiles)``.

    ``variant`` (``"dense"``, ``"sparse"``, ``"topk"``; two streams: any)
    fixes the ``csr`` and ``selected`` flags at compile time, so that a
    dense kernel carries neither the CSR mask nor the selection (registers).
    ``"stream0"`` / ``"stream1"``: one stream of a differential pair
    (:func:`pair_stream`); the kernel sweeps the key tiles twice, first for
    the rows' ``delta`` (written to ``row_terms``), then for ``dQ``; ``"clipped0"`` /
    ``"clipped1"`` the same with the weights gated by ``clip``; ``"gated0"`` (the
    Heaviside mode's stream, whose gate weighs only ``dV`` and ``dlam``) as
    ``"stream0"``, and zeros for the second stream's ``dQ``.  ``own``: ``sigmoid``'s or
    ``softpick``'s build (:func:`attnnb.cuda._micro.own_build`).
    """
    micro = micro_functions(np.dtype(dtype), tiling, mods, own)
    *_, bindings = pair_functions(dtype, tiling, dropout, mods, own)
    sizes = geometry(tiling)
    TM, BQ, BK, DQP = tiling.tm, tiling.bq, tiling.bk, sizes["DQP"]
    (o_q, o_o, o_kv, o_v, o_ds, o_red, o_rows, o_flag), n_all = part_offsets(dq_parts(tiling))
    constants = dict(
        D=tiling.d, TD=sizes["TD"], DQP=DQP, N_QS=tiling.dp * BQ,
        N_KS=round_up4(max(tiling.dp * BK, BK * DQP)), N_DS=round_up4(BK * BQ), N_ALL=n_all,
        O_Q=o_q, O_O=o_o, O_KV=o_kv, O_V=o_v, O_DS=o_ds, O_RED=o_red, O_ROWS=o_rows,
        O_FLAG=o_flag, row_zeros=micro.zeros(TM), dq_zeros=micro.zeros(TM * sizes["TD"]),
        stage_dT=micro.transposed_stager(sizes["DV4"]), stage_keys=micro.row_stager(BK, DQP),
        dq_product=micro.micro_product(TM, sizes["TD"], BK, BQ, DQP),
        **_variant_constants(tiling.streams, variant))
    # a first sweep for the rows' sums
    constants["PHASES"] = 2 if tiling.streams == 2 or constants["PAIR"] else 1
    return specialise(query_tile_kernel, {**bindings, **constants},
                      f"{bindings['_tag']}_dq_{variant}")


def build_dkdv(dtype, tiling: Tiling, variant: str = "dense", dropout: bool = False,
               mods=None, own=None):
    """The key-tile kernel (``dK``, ``dV``, the full bias gradient, ``d log key_size``).

    Arguments as :func:`build_dq` up to the pattern (``col_ptr, col_qt,
    col_full``: the tile lists read by key tile), then ``need_dbias``,
    ``dk``, ``dv``, ``dbias (B, H, Lq, Lk)`` (or a placeholder) and
    ``dlogks (B, Hk, Lk)`` (per key head; added to: zeros on entry but for a
    pair's second stream), ``mods`` and ``mod_grads`` (a score function's gradient
    buffers, a slot per block: :func:`attnnb.cuda._mods.gradient_buffers`; ``()``
    without).  Grid ``(B * Hk, key tiles)``.  ``variant`` as
    :func:`build_dq`; ``"stream1"`` adds its ``dV``, bias and key-size
    gradients to those ``"stream0"`` wrote; ``"gated0"`` reads the gate's weight
    ``-lam`` from ``row_terms`` row 3 (four rows) and writes zeros for the second
    stream's ``dK``.  Laid out as
    :func:`key_tile_layout` says.  ``own`` as :func:`build_dq`.
    """
    columns = tiling.d  # the columns of dK written
    tiling = key_tile_layout(tiling)
    micro = micro_functions(np.dtype(dtype), tiling, mods, own)
    *_, bindings = pair_functions(dtype, tiling, dropout, mods, own)
    sizes = geometry(tiling)
    TM, TN, BQ, BK = tiling.tm, tiling.tn, tiling.bq, tiling.bk
    TDK, DKP, TVK, DVKP = (sizes[x] for x in ("TDK", "DKP", "TVK", "DVKP"))
    (o_k, o_v, o_q, o_o, o_w, o_ds, o_x), n_all = part_offsets(dkdv_parts(tiling))
    mod_grads = mods is not None and mods.agrad is not None
    constants = dict(
        D=columns, DV=tiling.dv, NX=sizes["NX"], TDK=TDK, DKP=DKP, TVK=TVK, DVKP=DVKP,
        N_KS=tiling.dp * BK, N_TILE=round_up4(BQ * BK),
        N_QQ=round_up4(max(tiling.dp * BQ, BQ * DKP)), N_ALL=n_all,
        O_K=o_k, O_V=o_v, O_Q=o_q, O_O=o_o, O_W=o_w, O_DS=o_ds, O_X=o_x,
        row_zeros=micro.zeros(TM), dk_zeros=micro.zeros(TN * TDK),
        dv_zeros=micro.zeros(TN * TVK), stage_dT=micro.transposed_stager(sizes["DV4"]),
        stage_q=micro.row_stager(BQ, DKP), stage_o=micro.row_stager(BQ, DVKP),
        dv_product=micro.micro_product(TN, TVK, BQ, BK, DVKP),
        dk_product=micro.micro_product(TN, TDK, BQ, BK, DKP),
        MOD_GRADS=mod_grads, mod_agrad=mods.agrad if mod_grads else None,
        mod_views=mods.views if mod_grads else None,
        **_variant_constants(tiling.streams, variant))
    # the pair's second stream adds to dV and the bias gradient
    constants["ADD"] = constants["HOFF"] == 1
    return specialise(key_tile_kernel, {**bindings, **constants},
                      f"{bindings['_tag']}_dkdv_{variant}_d{columns}")


@kernel
def query_tile_kernel(q, k, v, dout, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                      causal, normalizer, row_terms, selected, diff_mode, clip, p_heads,
                      indptr, indices, csr, seed_lo, seed_hi, batch0, head0, threshold, keep,
                      tile_ptr, tile_idx, tile_full, dq, mods):
    Lq, Lk = q.shape[2], k.shape[2]
    diag = Lk - Lq if causal else Lk
    csr = CSR  # the variant's constants (the arguments only say the same)
    selected = SELECTED
    b, h, g, i0 = block_tile(q.shape[1] // HS, k.shape[1] // HS, 0)
    words = U32((Lk + 31) // 32)  # the clip's words a row, and this tile's first row
    clip_row = U32((b * (q.shape[1] // HS) + h) * Lq + i0)
    smem = cuda.shared.array(N_ALL, nt, alignment=ALIGN)
    Qt, dOt, KV = smem[O_Q:O_O], smem[O_O:O_KV], smem[O_KV:O_V]
    Vt, dSt, red = smem[O_V:O_DS], smem[O_DS:O_RED], smem[O_RED:O_ROWS]
    rows, flag = smem[O_ROWS:O_FLAG], smem[O_FLAG:]
    t, row0, key0, _ = thread_place()
    colq = (key0 // TN) * TD
    S1, S2, F, dP, terms = pair_registers()
    keys = cuda.local.array(TM, np.int64)  # the dropout's row keys
    R = cuda.local.array(N_S, nt)  # a score function's raw logits
    part1, part2 = row_zeros()  # with two streams: the rows' d1 and e
    Q1, Q2 = dq_zeros()  # each stream's dQ micro-tile (gated: the second's stays 0)
    if t == 0:
        flag[0] = CAST(-1)
    nq = min(BQ, Lq - i0)
    load_rows(row_terms, b, h, i0, row0, Lq, terms)
    if PAIR:  # the first sweep weighs by the map alone: e is needed where lam = 0 too
        for r in range(TM):
            terms[TM + r] = ONE
    for c in range(STREAMS):
        stage_transposed(q[b, HS * h + HOFF + c], i0, nq, scale, Qt[c * N_QS:], BQ)
    stage_dT(dout[b, h], i0, nq, ONE, dOt, BQ)
    ph = h if p_heads > 1 else 0
    i_csr = ph * Lq + min(i0 + t, Lq - 1)  # thread t < BQ: its row of the pattern
    tr = ph * ((Lq + BQ - 1) // BQ) + i0 // BQ
    vh = v[b, g]
    for phase in range(PHASES):  # pass 0 forms d1 and e (or a pair stream's delta)
        last = phase == PHASES - 1
        for s in range(tile_ptr[tr], tile_ptr[tr + 1]):
            j0 = tile_idx[s] * BK
            nk = min(BK, Lk - j0)
            partial = csr and not tile_full[s]
            if partial:  # dSt is free: the last tile ended with a barrier
                stage_tile_mask(dSt, t, i_csr, indptr[i_csr], j0, indptr, indices)
            for c in range(STREAMS):
                stage_transposed(k[b, HS * g + HOFF + c], j0, nk, ONE, KV[c * N_KS:], BK)
            stage_dT(vh, j0, nk, ONE, Vt, BK)
            cuda.syncthreads()
            tile_gradients(Qt, Qt[N_QS:], KV, KV[N_KS:], dOt, Vt, dSt, partial, S1, S2, F,
                           dP, terms, selected, diff_mode, clip, CLIPPED,
                           False, clip_row, words, part1, part2, i0, row0, j0, key0, nq, Lq,
                           Lk, diag, b, h, bias, has_bias, mask, has_mask, logks, has_ks,
                           normalizer, keys, (seed_lo, seed_hi, batch0, head0, threshold, keep),
                           mods, R)
            if PAIR and not last:  # delta 0 and ratio 1: S holds A dP
                for r in range(TM):
                    for c in range(TN):
                        part1[r] += S1[r * TN + c]
            cuda.syncthreads()  # the key tiles and the tile mask are read
            if last:
                slope_tile(S1, R, i0, row0, j0, key0, Lq, Lk, b, h, mods)
                store_tile(S1, dSt, row0, key0)
                if STREAMS == 2:
                    store_tile(S2, dSt[N_DS:], row0, key0)
                bad = False
                for c in range(STREAMS):
                    bad = stage_keys(k[b, HS * g + HOFF + c], j0, nk, KV[c * N_KS:]) or bad
                if bad:
                    flag[0] = CAST(s)
                cuda.syncthreads()
                guarded = flag[0] == CAST(s)
                dq_product(dSt, row0, KV, colq, guarded, Q1)
                if STREAMS == 2:
                    dq_product(dSt[N_DS:], row0, KV[N_KS:], colq, guarded, Q2)
                cuda.syncthreads()
        if not last:  # the rows' d1 and e (or delta): sums over the row's threads
            row_reduce(red, rows, t, row0, key0, part1, part1, False)
            if STREAMS == 2:
                row_reduce(red, rows, t, row0, key0, part2, part2, False)
            for r in range(TM):
                if PAIR:  # the row's own ratio again
                    terms[TM + r] = row_terms[b, h, 1, min(i0 + row0 + r, Lq - 1)]
                terms[2 * TM + r] = part1[r]
                if STREAMS == 2:
                    terms[3 * TM + r] = part2[r]
                if key0 == 0 and row0 + r < nq:
                    row_terms[b, h, 2, i0 + row0 + r] = part1[r]
                    if STREAMS == 2:
                        row_terms[b, h, 3, i0 + row0 + r] = part2[r]
    for r in range(TM):
        i = i0 + row0 + r
        if i < Lq:
            for e in range(TD):
                col = colq + e
                if col < D:
                    dq[b, HS * h + HOFF, i, col] = scale * Q1[r * TD + e]
                    if STREAMS == 2 or GATED:
                        dq[b, 2 * h + 1, i, col] = scale * Q2[r * TD + e]


@device
def add_array_gradients(G, R, b, h, i0, j0, nq, nk, grads, mods):
    """The score function's array gradients of a tile, ``G``: its logit gradients,
    ``R``: its raw logits (row-major ``BQ x BK``), one thread in order into this
    block's ``grads``."""
    bb = b + mods[0][0]
    hh = h + mods[0][1]
    for r in range(nq):
        for c in range(nk):
            x = U32(r) * U32(BK) + U32(c)
            if G[x] != ZERO:
                mod_agrad(G[x], R[x], bb, hh, i0 + r, j0 + c, grads, mods)


@device
def store_rows(X, A, row0, key0):
    """``A[row0 + r, key0 + c] = X[r, c]`` (row-major ``BQ x BK``)."""
    for r in range(TM):
        for c in range(TN):
            A[(U32(row0) + U32(r)) * U32(BK) + U32(key0) + U32(c)] = X[r * TN + c]


@kernel
def key_tile_kernel(q, k, v, dout, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                    causal, normalizer, row_terms, selected, diff_mode, clip, p_heads, indptr,
                    indices, csr, seed_lo, seed_hi, batch0, head0, threshold, keep, col_ptr,
                    col_qt, col_full, need_dbias, dk, dv, dbias, dlogks, mods, mod_grads):
    Lq, Lk = q.shape[2], k.shape[2]
    diag = Lk - Lq if causal else Lk
    csr = CSR  # the variant's constants (the arguments only say the same)
    selected = SELECTED
    H, Hk = q.shape[1] // HS, k.shape[1] // HS
    words = U32((Lk + 31) // 32)  # the clip's words a row
    group = H // Hk
    b = cuda.blockIdx.x // Hk
    g = cuda.blockIdx.x - b * Hk
    kt = cuda.blockIdx.y
    j0 = kt * BK
    nk = min(BK, Lk - j0)
    n_kt = (Lk + BK - 1) // BK
    smem = cuda.shared.array(N_ALL, nt, alignment=ALIGN)
    Kt, Vt, QQ, OO = smem[O_K:O_V], smem[O_V:O_Q], smem[O_Q:O_O], smem[O_O:O_W]
    Wt, dSb, X = smem[O_W:O_DS], smem[O_DS:O_X], smem[O_X:]
    t, row0, key0, _ = thread_place()
    ty = t // NX
    colk = ty * TDK
    colv = ty * TVK
    S1, S2, F, dP, terms = pair_registers()
    keys = cuda.local.array(TM, np.int64)  # the dropout's row keys
    R = cuda.local.array(N_S, nt)  # a score function's raw logits
    if MOD_GRADS:  # this block's slot of the gradient buffers
        block_grads = mod_views(mod_grads, cuda.blockIdx.x * cuda.gridDim.y + kt)
    part, _ = row_zeros()  # the first sweep's sums: not needed here
    K1, K2 = dk_zeros()  # dK of each stream (gated: the second's stays 0)
    V1, _ = dv_zeros()
    for c in range(STREAMS):
        stage_transposed(k[b, HS * g + HOFF + c], j0, nk, ONE, Kt[c * N_KS:], BK)
    stage_dT(v[b, g], j0, nk, ONE, Vt, BK)
    for hh in range(group):
        h = g * group + hh
        ph = h if p_heads > 1 else 0
        col = ph * n_kt + kt
        for p in range(col_ptr[col], col_ptr[col + 1]):
            i0 = col_qt[p] * BQ
            nq = min(BQ, Lq - i0)
            partial = csr and not col_full[p]
            load_rows(row_terms, b, h, i0, row0, Lq, terms)
            if GATED:  # in the ratio's place (the map's is 1): the gate's weight, -lam
                for r in range(TM):
                    terms[TM + r] = row_terms[b, h, 3, min(i0 + row0 + r, Lq - 1)]
            if partial:  # Wt is free: the last tile ended with a barrier
                i_csr = ph * Lq + min(i0 + t, Lq - 1)
                stage_tile_mask(Wt, t, i_csr, indptr[i_csr], j0, indptr, indices)
            for c in range(STREAMS):
                stage_transposed(q[b, HS * h + HOFF + c], i0, nq, scale, QQ[c * N_QQ:],
                                 BQ)
            stage_dT(dout[b, h], i0, nq, ONE, OO, BQ)
            cuda.syncthreads()
            tile_gradients(QQ, QQ[N_QQ:], Kt, Kt[N_KS:], OO, Vt, Wt, partial, S1, S2, F, dP,
                           terms, selected, diff_mode, clip, CLIPPED, GATED,
                           U32((b * H + h) * Lq + i0), words, part, part, i0, row0,
                           j0, key0, nq, Lq, Lk, diag, b, h, bias, has_bias, mask,
                           has_mask, logks, has_ks, normalizer, keys,
                           (seed_lo, seed_hi, batch0, head0, threshold, keep), mods, R)
            for r in range(TM):  # the contributions to d log key_size (and dbias)
                for c in range(TN):
                    x = r * TN + c
                    # a key size's gradient sums ds: for a softmax stream that is
                    # w g, but not where the clip set w to 0 (ds is still -p delta)
                    # nor where a gate added -lam to w
                    dP[x] = (S1[x] + S2[x] if STREAMS == 2 else S1[x] if CLIPPED or GATED
                             else dP[x])  # single() left w g there
                    if need_dbias and row0 + r < nq and key0 + c < nk:
                        y = S1[x] + S2[x] if STREAMS == 2 else S1[x]
                        if ADD:
                            y += dbias[b, h, i0 + row0 + r, j0 + key0 + c]
                        dbias[b, h, i0 + row0 + r, j0 + key0 + c] = y
            if MOD_GRADS:  # dSb and X are free until the products' staging
                store_rows(S1, dSb, row0, key0)
                store_rows(R, X, row0, key0)
                cuda.syncthreads()
                if t == 0:
                    add_array_gradients(dSb, X, b, h, i0, j0, nq, nk, block_grads, mods)
                cuda.syncthreads()
            # (the bias and key sizes come after the score function: theirs is ds)
            slope_tile(S1, R, i0, row0, j0, key0, Lq, Lk, b, h, mods)
            cuda.syncthreads()  # the transposed tiles and the tile mask are read
            for c in range(STREAMS):
                stage_q(q[b, HS * h + HOFF + c], i0, nq, QQ[c * N_QQ:])
            stage_o(dout[b, h], i0, nq, OO)
            store_rows(F, Wt, row0, key0)
            store_rows(S1, dSb, row0, key0)
            if STREAMS == 2:
                store_rows(S2, dSb[N_TILE:], row0, key0)
            if has_ks:
                store_rows(dP, X, row0, key0)
            cuda.syncthreads()
            dv_product(Wt, key0, OO, colv, False, V1)
            dk_product(dSb, key0, QQ, colk, False, K1)
            if STREAMS == 2:
                dk_product(dSb[N_TILE:], key0, QQ[N_QQ:], colk, False, K2)
            if has_ks:  # one thread a key, rows in order: deterministic
                for c in range(t, nk, NT):
                    acc = ZERO
                    for r in range(nq):  # rows past nq hold zeros
                        acc += X[U32(r) * U32(BK) + U32(c)]
                    dlogks[b, g, j0 + c] += acc
            cuda.syncthreads()
    for x in range(TN):
        j = j0 + key0 + x
        if j < Lk:
            for e in range(TDK):
                if colk + e < D:
                    dk[b, HS * g + HOFF, j, colk + e] = scale * K1[x * TDK + e]
                    if STREAMS == 2 or GATED:
                        dk[b, 2 * g + 1, j, colk + e] = scale * K2[x * TDK + e]
            for e in range(TVK):
                if colv + e < DV:
                    y = V1[x * TVK + e]
                    if ADD:
                        y += dv[b, g, j, colv + e]
                    dv[b, g, j, colv + e] = y


@cuda.jit(device=True)
def row_of(e, heads, lq):
    """``(b, h, i)`` of row ``e`` (row-major) of ``(B, heads, ., lq)`` row vectors."""
    return e // (heads * lq), (e // lq) % heads, e % lq


def build_row_terms(dtype):
    """Kernel, one thread per row: ``row_terms[b, h] = (lse, r, delta)`` of a single stream.

    ``r = 1`` (``sigmoid(lse - sink)`` for ``softmax1``, ``sinks (B or 1, H or 1)``, and
    for ``softpick``, its sink ``log eps``), ``delta = dout . out - dlse / r``;
    ``sigmoid`` (unnormalised: :mod:`attnnb.cuda._backward_pair`) ``r = e^lse``,
    ``delta = -dlse``.  Empty rows (``lse = -inf``) get 0 for both.
    """
    return dtype_kernel(row_terms_kernel, dtype, "row_terms")


@kernel
def row_terms_kernel(out, dout, lse, dlse, has_dlse, normalizer, sinks, row_terms):
    B, H, Lq = lse.shape
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e >= B * H * Lq:
        return
    b, h, i = row_of(e, H, Lq)
    x = CAST(lse[b, h, i])
    ratio = ZERO
    delta = ZERO
    if x != NINF and normalizer == SIGMOID:
        ratio = math.exp(x)
        if has_dlse:
            delta = -CAST(dlse[b, h, i])
    elif x != NINF:
        ratio = ONE
        if normalizer == SOFTMAX1 or normalizer == SOFTPICK:  # the head's sink logit
            ratio = sigmoid(x - CAST(sinks[index(b, sinks.shape[0]),
                                           index(h, sinks.shape[1])]), ONE)
        for c in range(out.shape[3]):
            delta += CAST(dout[b, h, i, c]) * CAST(out[b, h, i, c])
        if has_dlse:
            delta -= CAST(dlse[b, h, i]) / ratio
    row_terms[b, h, 0, i] = x
    row_terms[b, h, 1, i] = ratio
    row_terms[b, h, 2, i] = delta


def build_pair_rows(dtype):
    """Kernel, one thread per row: ``stream_terms[b, h] = (lse_c, ratio, 0)`` for stream
    ``c`` of a differential pair, from ``pair_terms[b, h] = (lse_0, lse_1, ., ., lam)``:
    the row ratio is 1 for stream 0 and ``-lam`` for stream 1 (``dout`` weighs it by
    ``-lam``); row 2 is zeroed for the query-tile kernel's sums.  ``gated`` (the
    Heaviside mode's stream 0): row 3 is ``-lam``, the weight of its gate."""
    return dtype_kernel(pair_rows_kernel, dtype, "pair_rows")


@kernel
def pair_rows_kernel(pair_terms, c, gated, stream_terms):
    B, H, _, Lq = stream_terms.shape
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e >= B * H * Lq:
        return
    b, h, i = row_of(e, H, Lq)
    stream_terms[b, h, 0, i] = pair_terms[b, h, c, i]
    stream_terms[b, h, 1, i] = ONE if c == 0 else -pair_terms[b, h, 4, i]
    stream_terms[b, h, 2, i] = ZERO
    if gated:
        stream_terms[b, h, 3, i] = -pair_terms[b, h, 4, i]


def build_negated_row(dtype):
    """Kernel, one thread per element: ``y[b, h, i] = -x[b, h, r, i]`` (``dlam = -e``)."""
    return dtype_kernel(negated_row_kernel, dtype, "negated_row")


@kernel
def negated_row_kernel(x, r, y):
    B, H, Lq = y.shape
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e >= B * H * Lq:
        return
    b, h, i = row_of(e, H, Lq)
    y[b, h, i] = -x[b, h, r, i]


def build_negated_dot(dtype):
    """Kernel, one thread per row: ``y[b, h, i] = -(x[b, h, i] . dout[b, h, i])`` (the
    Heaviside mode's ``dlam = -dout . (H V)``, ``x`` the clip build's output)."""
    return dtype_kernel(negated_dot_kernel, dtype, "negated_dot")


@kernel
def negated_dot_kernel(x, dout, y):
    B, H, Lq = y.shape
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e >= B * H * Lq:
        return
    b, h, i = row_of(e, H, Lq)
    acc = ZERO
    for c in range(x.shape[3]):
        acc += x[b, h, i, c] * dout[b, h, i, c]
    y[b, h, i] = -acc


def build_sum_to(dtype):
    """Kernel, one thread per output element: ``y = x`` summed over the axes where ``y``
    has length 1 (4-D both), in index order (deterministic)."""
    return dtype_kernel(sum_to_kernel, dtype, "sum_to")


@kernel
def sum_to_kernel(x, y):
    n0, n1, n2, n3 = y.shape
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e >= n0 * n1 * n2 * n3:
        return
    a3 = e % n3
    a2 = (e // n3) % n2
    a1 = (e // (n2 * n3)) % n1
    a0 = e // (n1 * n2 * n3)
    r0 = x.shape[0] if n0 == 1 else 1
    r1 = x.shape[1] if n1 == 1 else 1
    r2 = x.shape[2] if n2 == 1 else 1
    r3 = x.shape[3] if n3 == 1 else 1
    acc = ZERO
    for i0 in range(r0):
        for i1 in range(r1):
            for i2 in range(r2):
                for i3 in range(r3):
                    acc += x[a0 + i0, a1 + i1, a2 + i2, a3 + i3]
    y[a0, a1, a2, a3] = acc


def helper_kernel(name, build, dtype):
    key = ("backward", name, np.dtype(dtype).str)
    return cached_kernel(key, lambda: cuda.jit(build(np.dtype(dtype))))


def element_grid(n):
    return (max(1, -(-n // ROW_THREADS)),), ROW_THREADS



def _variant_kernel(name, build, dtype, tiling, variant, dropout, mods, own):
    label = (kernel_label(f"{name}-{variant}", dropout, mods, own)
             + ("-grads" if mods is not None and mods.agrad is not None else ""))
    return tiled_kernel(label, lambda dt, t: build(dt, t, variant, dropout, mods, own), dtype,
                        tiling)


def dq_kernel(dtype, tiling, variant, dropout=False, mods=None, own=None):
    return _variant_kernel("dq", build_dq, dtype, tiling, variant, dropout, mods, own)


def dkdv_kernel(dtype, tiling, variant, dropout=False, mods=None, own=None):
    return _variant_kernel("dkdv", build_dkdv, dtype, tiling, variant, dropout, mods, own)


def ptx_signatures():
    """``[(name, python function, argument types, options)]`` for the PTX check: both
    kernels, one stream (dense, sparse, top-k) at D = 64 and 128, one stream of a
    differential pair (each mode's) and two streams at d = 64, Dv = 128, the builds of
    ``sigmoid`` and ``softpick`` at D = 64 and 128, top-k's builds of ``relu_expm1``,
    ``sigmoid`` and ``softpick`` at D = 64; the helper kernels."""
    from numba import types

    from ._micro import ptx_cases

    boolean = types.boolean
    i64, i32, flags = types.int64[::1], types.int32[::1], types.boolean[::1]

    def common(ty):
        arr4 = ty[:, :, :, ::1]
        return (arr4, arr4, arr4, arr4, ty, arr4, boolean, types.boolean[:, :, :, ::1],
                boolean, ty[:, ::1], boolean, boolean, types.int64, arr4,
                boolean, types.int64, types.uint32[::1], types.int64, i64,
                i32, boolean, types.int64, types.int64, types.int64, types.int64, types.int64,
                ty, i64, i32, flags)

    def dq_types(ty):
        return common(ty) + (ty[:, :, :, ::1], types.Tuple(()))

    def dkdv_types(ty):
        arr4 = ty[:, :, :, ::1]
        return common(ty) + (boolean, arr4, arr4, arr4, ty[:, :, ::1], types.Tuple(()),
                             types.Tuple(()))

    cases = []
    for label, build, argtypes in (("dq", build_dq, dq_types), ("dkdv", build_dkdv, dkdv_types)):
        def tiles(dtype, d, dv, streams, label=label, own=None, selected=False):
            return backward_tiling(dtype, d, dv, streams, label, own, selected)

        for d in (64, 128):
            cases += ptx_cases(f"backward {label}", build, argtypes, d, d, tiles=tiles,
                               variant=d != 64)
        cases += ptx_cases(f"backward dropout {label}",
                           lambda dt, t, b=build: b(dt, t, "dense", True), argtypes, 64, 64,
                           tiles=tiles, variant=True)
        # the difference mode: one stream of the pair (the second, which adds to dV)
        cases += ptx_cases(f"backward diff {label}", lambda dt, t, b=build: b(dt, t, "stream1"),
                           argtypes, 64, 128, tiles=tiles)
        # the rectified mode: one clipped stream of the pair (the second)
        cases += ptx_cases(f"backward rectified {label}",
                           lambda dt, t, b=build: b(dt, t, "clipped1"), argtypes, 64, 128,
                           tiles=tiles, variant=True)
        # the Heaviside mode: its one gated stream
        cases += ptx_cases(f"backward heaviside {label}",
                           lambda dt, t, b=build: b(dt, t, "gated0"), argtypes, 64, 128,
                           tiles=tiles, variant=True)
        # the two-stream kernels, the other design of both modes (off by default)
        cases += ptx_cases(f"backward two-stream {label}", build, argtypes, 64, 128,
                           streams=2, tiles=tiles, variant=True)
        for own in (SIGMOID, SOFTPICK):  # the normalizers with builds of their own
            for d in (64, 128):
                cases += ptx_cases(f"backward {kernel_label(label, own=own)}",
                                   lambda dt, t, b=build, o=own: b(dt, t, "dense", own=o),
                                   argtypes, d, d,
                                   tiles=lambda *a, o=own, f=tiles: f(*a, own=o), variant=True)
        # top-k's builds: softmax's, and those of the normalizers that weigh the kept keys
        # their own way (the key-tile tiles as own_build's: relu_expm1's are the
        # production tiles)
        for own in (None, RELU_EXPM1, SIGMOID, SOFTPICK):
            cases += ptx_cases(f"backward topk {kernel_label(label, own=own)}",
                               lambda dt, t, b=build, o=own: b(dt, t, "topk", own=o),
                               argtypes, 64, 64,
                               tiles=lambda *a, o=own, f=tiles: f(
                                   *a, own=None if o in (None, RELU_EXPM1) else o,
                                   selected=True), variant=True)
    for name, _, _, options in cases:
        if name in KNOWN_GATE_FAILURES:
            options["known"] = KNOWN_GATE_FAILURES[name]
    for dtype in (np.float32, np.float64):
        ty = numba_type(dtype)
        arr3, arr4 = ty[:, :, ::1], ty[:, :, :, ::1]
        name = np.dtype(dtype).name
        cases += [(f"backward row_terms {name}", build_row_terms(np.dtype(dtype)),
                   (arr4, arr4, arr3, arr3, boolean, types.int64, ty[:, ::1], arr4)),
                  (f"backward pair_rows {name}", build_pair_rows(np.dtype(dtype)),
                   (arr4, types.int64, boolean, arr4)),
                  (f"backward negated_row {name}", build_negated_row(np.dtype(dtype)),
                   (arr4, types.int64, arr3)),
                  (f"backward negated_dot {name}", build_negated_dot(np.dtype(dtype)),
                   (arr4, arr4, arr3)),
                  (f"backward sum_to {name}", build_sum_to(np.dtype(dtype)), (arr4, arr4))]
    return cases
