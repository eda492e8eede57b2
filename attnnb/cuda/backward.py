"""Gradients on the GPU: FlashAttention-2's backward on the register-tiled core.

Nothing ``(Lq, Lk)`` is stored (but a bias gradient, as large as the bias
it belongs to).  The forward's ``out`` and ``lse`` recompute every weight
tile (the math: :mod:`attnnb.cuda._backward_pair`).  By default neither
mode runs the two-stream kernels: each gradient is two one-stream
backwards (:func:`pair_stream`), stream 1's with row ratio ``r = -lam``
(its ``p = -lam A2``), each query-tile kernel first
sweeping for its stream's ``delta`` (``d1``, ``e``), stream 1's key-tile
kernel adding to stream 0's ``dV`` and bias gradient.  The rectified
mode's streams ("clipped") gate every weight by its clip bit, which the
differential forward's clip build writes (one bit a (query, key) pair).
These builds meet the register-tiling gate at ``d = 64, Dv = 128``; the two-stream ones, kept as the
alternative (``DIFFERENCE_TWO_STREAMS``, ``RECTIFIED_TWO_STREAMS``, and
the rectified route past ``2**32`` clip words), do not
(``KNOWN_GATE_FAILURES``).

Two kernels, as FlashAttention-2, for one or two score streams
(``Tiling.streams``):

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
  key_size`` per key head.  No two blocks of a launch write one element: no
  atomics, and the results are the same bit for bit from run to run.

Dropout (dense, sparse and top-k attention) has builds of its own,
``dropout=True``, so that the other kernels carry none of it.

Each kernel has its own :class:`~attnnb.cuda._micro.Tiling`
(:func:`~attnnb.cuda._backward_tiling.backward_tiling`, which also says which
thread owns what; the tile lists are built for each): ``S`` and ``dP``
micro-tiles in registers, the products ``dO V^T``, ``W^T dO``, ``dS^T Q`` and
``dS K`` through the core's :func:`micro_product` on tiles staged in shared
memory (transposed for the score-like products, row-major for the others).

Dense, causal and sparse problems all walk tile lists (a dense problem's
are every key tile up to the causal limit); a sparse partial tile's mask
comes from the CSR runs, as in the forward.  Top-k keeps the forward's
selection: the top-k forward kernel is run again for its thresholds
(:func:`attnnb.cuda.topk.topk_selection`).  Differential attention takes
both streams' LSEs from its forward kernel.
"""

from __future__ import annotations

import numpy as np
from numba import cuda
from numba.np.numpy_support import from_dtype as numba_type

from .._bias_chunks import bias_chunks, chunked_vjp
from .._checks import is_device_array
from .._codes import NORMALIZER_CODES, SOFTMAX1
from .._device import device_view
from .._mod_compile import sum_param_grads
from ..patterns import BlockLayout
from ._arrays import device_problem
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
from ._dropout import kernel_dropout
from ._micro import (
    ALIGN,
    U32,
    Tiling,
    kernel_label,
    micro_functions,
    tiled_kernel,
)
from ._mods import device_mods, gradient_buffers, has_mods, parameter_gradients
from ._tiles import cached_kernel, device_functions, key_tiles_seen

ROW_THREADS = 128  # threads per block of the one-thread-per-element helper kernels


# the difference mode through the two-stream kernels instead of two pair streams: the
# other design, kept (and tested) so that a GPU run can time the two against each other
# (gpu/run.py); the pair streams pass the register gate, the two-stream kernels do not
DIFFERENCE_TWO_STREAMS = False
# the rectified mode through the two-stream kernels (which form the clip themselves) instead
# of two clipped pair streams: kept, tested and timed the same way
RECTIFIED_TWO_STREAMS = False



def build_dq(dtype, tiling: Tiling, variant: str = "dense", dropout: bool = False,
             mods=None):
    """The query-tile kernel (``dQ``; with two streams also ``d1``, ``e``).

    Arguments: ``q, k, v, dout`` (4-D, the forward's head layout), ``scale``,
    ``bias`` / ``mask`` / ``logks`` with their flags, ``causal``, the
    normalizer code, ``rowv (B, H, NR, Lq)`` (per-row values, see
    :func:`pair_functions`), ``thr`` / ``cut`` and ``selected`` (top-k),
    ``rectified``, ``clip`` (the clip bits of the ``"clipped"`` variants), the
    pattern's ``p_heads``, CSR ``indptr`` / ``indices`` and ``csr`` flag, the
    tile lists ``tile_ptr, tile_idx, tile_full``, ``dq`` and ``mods`` (the mods' arrays;
    ``()`` without, and ``mods=None``).  Grid ``(B * H, query tiles)``.

    ``variant`` (``"dense"``, ``"sparse"``, ``"topk"``; two streams: any)
    fixes the ``csr`` and ``selected`` flags at compile time, so that a
    dense kernel carries neither the CSR mask nor the selection (registers).
    ``"stream0"`` / ``"stream1"``: one stream of a differential pair
    (:func:`pair_stream`); the kernel sweeps the key tiles twice, first for
    the rows' ``delta`` (written to ``rowv``), then for ``dQ``; ``"clipped0"`` /
    ``"clipped1"`` the same with the weights gated by ``clip``.
    """
    f = micro_functions(np.dtype(dtype), tiling, mods)
    g_ = geometry(tiling)
    nt, TM, TN, BQ, BK = f.nt, f.TM, f.TN, f.BQ, f.BK
    slope_tile, N_S = f.slope_tile, f.N_S
    S_, D = tiling.streams, tiling.d
    TD, DQP, DV4 = g_["TD"], g_["DQP"], g_["DV4"]
    row_zeros, dq_zeros = f.zeros(TM), f.zeros(TM * TD)
    N_QS, N_KS = tiling.dp * BQ, round_up4(max(tiling.dp * BK, BK * DQP))
    N_DS = round_up4(BK * BQ)
    (O_Q, O_O, O_KV, O_V, O_DS, O_RED, O_ROWS, O_FLAG), N_ALL = part_offsets(dq_parts(tiling))
    t_ = device_functions(np.dtype(dtype))
    CAST, ONE = t_.CAST, t_.CAST(1)
    block_tile, thread_place = f.block_tile, f.thread_place
    stage_transposed = f.stage_transposed
    stage_dT = f.transposed_stager(DV4)
    stage_keys = f.row_stager(BK, DQP)
    dq_product = f.micro_product(TM, TD, BK, BQ, DQP)
    store_tile, row_reduce = f.store_tile, f.row_reduce
    stage_tile_mask = f.stage_tile_mask
    pair_registers, load_rows, tile_gradients = pair_functions(dtype, tiling, dropout, mods)
    CSR, SELECTED = variant == "sparse", variant == "topk"
    HS, HOFF, PAIR = pair_stream(S_, variant)
    CLIPPED = variant.startswith("clipped")
    PHASES = 2 if S_ == 2 or PAIR else 1  # a first sweep for the rows' sums

    def dq_kernel(q, k, v, dout, scale, bias, has_bias, mask, has_mask, logks, has_ks, causal,
                  normalizer, rowv, thr_a, cut_a, selected, rectified, clip, p_heads, indptr,
                  indices, csr, seed_lo, seed_hi, batch0, head0, threshold, keep, tile_ptr,
                  tile_idx, tile_full, dq, mods):
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
        S1, S2, F, dP, rv, thr, cutr = pair_registers()
        keys = cuda.local.array(TM, np.int64)  # the dropout's row keys
        R = cuda.local.array(N_S, nt)  # a score function's raw logits
        part1, part2 = row_zeros()  # with two streams: the rows' d1 and e
        Q1, Q2 = dq_zeros()  # each stream's dQ micro-tile
        if t == 0:
            flag[0] = CAST(-1)
        nq = min(BQ, Lq - i0)
        load_rows(rowv, b, h, i0, row0, Lq, rv, thr_a, cut_a, selected, thr, cutr)
        if PAIR:  # the first sweep weighs by the map alone: e is needed where lam = 0 too
            for r in range(TM):
                rv[TM + r] = ONE
        for c in range(S_):
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
                for c in range(S_):
                    stage_transposed(k[b, HS * g + HOFF + c], j0, nk, ONE, KV[c * N_KS:], BK)
                stage_dT(vh, j0, nk, ONE, Vt, BK)
                cuda.syncthreads()
                tile_gradients(Qt, Qt[N_QS:], KV, KV[N_KS:], dOt, Vt, dSt, partial, S1, S2, F,
                               dP, rv, thr, cutr, selected, rectified, clip, CLIPPED,
                               clip_row, words, part1, part2, i0, row0, j0, key0, nq, Lq,
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
                    if S_ == 2:
                        store_tile(S2, dSt[N_DS:], row0, key0)
                    bad = False
                    for c in range(S_):
                        bad = stage_keys(k[b, HS * g + HOFF + c], j0, nk, KV[c * N_KS:]) or bad
                    if bad:
                        flag[0] = CAST(s)
                    cuda.syncthreads()
                    guarded = flag[0] == CAST(s)
                    dq_product(dSt, row0, KV, colq, guarded, Q1)
                    if S_ == 2:
                        dq_product(dSt[N_DS:], row0, KV[N_KS:], colq, guarded, Q2)
                    cuda.syncthreads()
            if not last:  # the rows' d1 and e (or delta): sums over the row's threads
                row_reduce(red, rows, t, row0, key0, part1, part1, False)
                if S_ == 2:
                    row_reduce(red, rows, t, row0, key0, part2, part2, False)
                for r in range(TM):
                    if PAIR:  # the row's own ratio again
                        rv[TM + r] = rowv[b, h, 1, min(i0 + row0 + r, Lq - 1)]
                    rv[2 * TM + r] = part1[r]
                    if S_ == 2:
                        rv[3 * TM + r] = part2[r]
                    if key0 == 0 and row0 + r < nq:
                        rowv[b, h, 2, i0 + row0 + r] = part1[r]
                        if S_ == 2:
                            rowv[b, h, 3, i0 + row0 + r] = part2[r]
        for r in range(TM):
            i = i0 + row0 + r
            if i < Lq:
                for e in range(TD):
                    col = colq + e
                    if col < D:
                        dq[b, HS * h + HOFF, i, col] = scale * Q1[r * TD + e]
                        if S_ == 2:
                            dq[b, 2 * h + 1, i, col] = scale * Q2[r * TD + e]

    return dq_kernel


def build_dkdv(dtype, tiling: Tiling, variant: str = "dense", dropout: bool = False,
               mods=None):
    """The key-tile kernel (``dK``, ``dV``, the full bias gradient, ``d log key_size``).

    Arguments as :func:`build_dq` up to the pattern (``col_ptr, col_qt,
    col_full``: the tile lists read by key tile), then ``need_dbias``,
    ``dk``, ``dv``, ``dbias (B, H, Lq, Lk)`` (or a placeholder) and
    ``dlogks (B, Hk, Lk)`` (per key head; added to: zeros on entry but for a
    pair's second stream), ``mods`` and ``mod_grads`` (a score function's gradient
    buffers, a slot per block: :func:`attnnb.cuda._mods.gradient_buffers`; ``()``
    without).  Grid ``(B * Hk, key tiles)``.  ``variant`` as
    :func:`build_dq`; ``"stream1"`` adds its ``dV``, bias and key-size
    gradients to those ``"stream0"`` wrote.  Laid out as
    :func:`key_tile_layout` says.
    """
    D = tiling.d  # the columns of dK written
    tiling = key_tile_layout(tiling)
    f = micro_functions(np.dtype(dtype), tiling, mods)
    slope_tile, N_S = f.slope_tile, f.N_S
    g_ = geometry(tiling)
    nt, TM, TN, BQ, BK, NT = f.nt, f.TM, f.TN, f.BQ, f.BK, f.NT
    S_, DV = tiling.streams, tiling.dv
    NX, TDK, DKP, TVK, DVKP, DV4 = (g_[x] for x in ("NX", "TDK", "DKP", "TVK", "DVKP", "DV4"))
    row_zeros, dk_zeros, dv_zeros = f.zeros(TM), f.zeros(TN * TDK), f.zeros(TN * TVK)
    N_KS, N_TILE = tiling.dp * BK, round_up4(BQ * BK)
    N_QQ = round_up4(max(tiling.dp * BQ, BQ * DKP))
    (O_K, O_V, O_Q, O_O, O_W, O_DS, O_X), N_ALL = part_offsets(dkdv_parts(tiling))
    t_ = device_functions(np.dtype(dtype))
    ZERO, ONE = t_.ZERO, t_.CAST(1)
    thread_place = f.thread_place
    stage_transposed = f.stage_transposed
    stage_dT = f.transposed_stager(DV4)
    stage_q = f.row_stager(BQ, DKP)
    stage_o = f.row_stager(BQ, DVKP)
    dv_product = f.micro_product(TN, TVK, BQ, BK, DVKP)
    dk_product = f.micro_product(TN, TDK, BQ, BK, DKP)
    stage_tile_mask = f.stage_tile_mask
    pair_registers, load_rows, tile_gradients = pair_functions(dtype, tiling, dropout, mods)
    CSR, SELECTED = variant == "sparse", variant == "topk"
    HS, HOFF, _ = pair_stream(S_, variant)
    CLIPPED = variant.startswith("clipped")
    ADD = HOFF == 1  # the pair's second stream adds to dV and the bias gradient
    MOD_GRADS = mods is not None and mods.agrad is not None
    mod_agrad = mods.agrad if MOD_GRADS else None
    mod_views = mods.views if MOD_GRADS else None

    @cuda.jit(device=True)
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

    @cuda.jit(device=True)
    def store_rows(X, A, row0, key0):
        """``A[row0 + r, key0 + c] = X[r, c]`` (row-major ``BQ x BK``)."""
        for r in range(TM):
            for c in range(TN):
                A[(U32(row0) + U32(r)) * U32(BK) + U32(key0) + U32(c)] = X[r * TN + c]

    def dkdv_kernel(q, k, v, dout, scale, bias, has_bias, mask, has_mask, logks, has_ks, causal,
                    normalizer, rowv, thr_a, cut_a, selected, rectified, clip, p_heads, indptr,
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
        S1, S2, F, dP, rv, thr, cutr = pair_registers()
        keys = cuda.local.array(TM, np.int64)  # the dropout's row keys
        R = cuda.local.array(N_S, nt)  # a score function's raw logits
        if MOD_GRADS:  # this block's slot of the gradient buffers
            block_grads = mod_views(mod_grads, cuda.blockIdx.x * cuda.gridDim.y + kt)
        part, _ = row_zeros()  # the first sweep's sums: not needed here
        K1, K2 = dk_zeros()  # dK of each stream
        V1, _ = dv_zeros()
        for c in range(S_):
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
                load_rows(rowv, b, h, i0, row0, Lq, rv, thr_a, cut_a, selected, thr, cutr)
                if partial:  # Wt is free: the last tile ended with a barrier
                    i_csr = ph * Lq + min(i0 + t, Lq - 1)
                    stage_tile_mask(Wt, t, i_csr, indptr[i_csr], j0, indptr, indices)
                for c in range(S_):
                    stage_transposed(q[b, HS * h + HOFF + c], i0, nq, scale, QQ[c * N_QQ:],
                                     BQ)
                stage_dT(dout[b, h], i0, nq, ONE, OO, BQ)
                cuda.syncthreads()
                tile_gradients(QQ, QQ[N_QQ:], Kt, Kt[N_KS:], OO, Vt, Wt, partial, S1, S2, F, dP,
                               rv, thr, cutr, selected, rectified, clip, CLIPPED,
                               U32((b * H + h) * Lq + i0), words, part, part, i0, row0,
                               j0, key0, nq, Lq, Lk, diag, b, h, bias, has_bias, mask,
                               has_mask, logks, has_ks, normalizer, keys,
                               (seed_lo, seed_hi, batch0, head0, threshold, keep), mods, R)
                for r in range(TM):  # the contributions to d log key_size (and dbias)
                    for c in range(TN):
                        x = r * TN + c
                        # a key size's gradient sums ds: for a softmax stream that is
                        # w g, but not where the clip set w to 0 (ds is still -p delta)
                        dP[x] = (S1[x] + S2[x] if S_ == 2 else S1[x] if CLIPPED
                                 else dP[x])  # single() left w g there
                        if need_dbias and row0 + r < nq and key0 + c < nk:
                            y = S1[x] + S2[x] if S_ == 2 else S1[x]
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
                for c in range(S_):
                    stage_q(q[b, HS * h + HOFF + c], i0, nq, QQ[c * N_QQ:])
                stage_o(dout[b, h], i0, nq, OO)
                store_rows(F, Wt, row0, key0)
                store_rows(S1, dSb, row0, key0)
                if S_ == 2:
                    store_rows(S2, dSb[N_TILE:], row0, key0)
                if has_ks:
                    store_rows(dP, X, row0, key0)
                cuda.syncthreads()
                dv_product(Wt, key0, OO, colv, False, V1)
                dk_product(dSb, key0, QQ, colk, False, K1)
                if S_ == 2:
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
                        if S_ == 2:
                            dk[b, 2 * g + 1, j, colk + e] = scale * K2[x * TDK + e]
                for e in range(TVK):
                    if colv + e < DV:
                        y = V1[x * TVK + e]
                        if ADD:
                            y += dv[b, g, j, colv + e]
                        dv[b, g, j, colv + e] = y

    return dkdv_kernel


@cuda.jit(device=True)
def row_of(e, heads, lq):
    """``(b, h, i)`` of row ``e`` (row-major) of ``(B, heads, ., lq)`` row vectors."""
    return e // (heads * lq), (e // lq) % heads, e % lq


def build_row_terms(dtype):
    """Kernel, one thread per row: ``rowv[b, h] = (lse, r, delta)`` of a single stream.

    ``r = 1`` (``sigmoid(lse - sink)`` for ``softmax1``, ``sinks (B or 1, H or 1)``),
    ``delta = dout . out - dlse / r``; empty rows (``lse = -inf``) get 0 for both.
    """
    t_ = device_functions(np.dtype(dtype))
    CAST, ZERO, ONE, NINF, sigmoid = t_.CAST, t_.ZERO, t_.CAST(1), t_.NINF, t_.sigmoid
    index = t_.index

    def row_terms_kernel(out, dout, lse, dlse, has_dlse, normalizer, sinks, rowv):
        B, H, Lq = lse.shape
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if e >= B * H * Lq:
            return
        b, h, i = row_of(e, H, Lq)
        x = CAST(lse[b, h, i])
        ratio = ZERO
        delta = ZERO
        if x != NINF:
            ratio = ONE
            if normalizer == SOFTMAX1:  # the head's sink logit: 0, or learned
                ratio = sigmoid(x - CAST(sinks[index(b, sinks.shape[0]),
                                               index(h, sinks.shape[1])]), ONE)
            for c in range(out.shape[3]):
                delta += CAST(dout[b, h, i, c]) * CAST(out[b, h, i, c])
            if has_dlse:
                delta -= CAST(dlse[b, h, i]) / ratio
        rowv[b, h, 0, i] = x
        rowv[b, h, 1, i] = ratio
        rowv[b, h, 2, i] = delta

    return row_terms_kernel


def build_pair_rows(dtype):
    """Kernel, one thread per row: ``rows[b, h] = (lse_c, ratio, 0)`` for stream ``c`` of
    a differential pair, from ``rowv[b, h] = (lse_0, lse_1, ., ., lam)``: the row ratio
    is 1 for stream 0 and ``-lam`` for stream 1 (``dout`` weighs it by ``-lam``); row 2
    is zeroed for the query-tile kernel's sums."""
    t_ = device_functions(np.dtype(dtype))
    ZERO, ONE = t_.ZERO, t_.CAST(1)

    def pair_rows_kernel(rowv, c, rows):
        B, H, _, Lq = rows.shape
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if e >= B * H * Lq:
            return
        b, h, i = row_of(e, H, Lq)
        rows[b, h, 0, i] = rowv[b, h, c, i]
        rows[b, h, 1, i] = ONE if c == 0 else -rowv[b, h, 4, i]
        rows[b, h, 2, i] = ZERO

    return pair_rows_kernel


def build_negated_row(dtype):
    """Kernel, one thread per element: ``y[b, h, i] = -x[b, h, r, i]`` (``dlam = -e``)."""

    def negated_row_kernel(x, r, y):
        B, H, Lq = y.shape
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if e >= B * H * Lq:
            return
        b, h, i = row_of(e, H, Lq)
        y[b, h, i] = -x[b, h, r, i]

    return negated_row_kernel


def build_sum_to(dtype):
    """Kernel, one thread per output element: ``y = x`` summed over the axes where ``y``
    has length 1 (4-D both), in index order (deterministic)."""
    ZERO = device_functions(np.dtype(dtype)).ZERO

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

    return sum_to_kernel


def _helper(name, build, dtype):
    key = ("backward", name, np.dtype(dtype).str)
    return cached_kernel(key, lambda: cuda.jit(build(np.dtype(dtype))))


def _blocks(n):
    return (max(1, -(-n // ROW_THREADS)),), ROW_THREADS


def sum_to(x, shape, dtype):
    """``x`` (4-D device array) summed to ``shape`` (axes of length 1) on the device."""
    if tuple(x.shape) == tuple(shape):
        return x
    y = cuda.device_array(tuple(shape), dtype)
    if y.size:
        grid, threads = _blocks(y.size)
        _helper("sum_to", build_sum_to, dtype)[grid, threads](x, y)
    return y


def _variant_kernel(name, build, dtype, tiling, variant, dropout, mods):
    label = (kernel_label(f"{name}-{variant}", dropout, mods)
             + ("-grads" if mods is not None and mods.agrad is not None else ""))
    return tiled_kernel(label, lambda dt, t: build(dt, t, variant, dropout, mods), dtype,
                        tiling)


def dq_kernel(dtype, tiling, variant, dropout=False, mods=None):
    return _variant_kernel("dq", build_dq, dtype, tiling, variant, dropout, mods)


def dkdv_kernel(dtype, tiling, variant, dropout=False, mods=None):
    return _variant_kernel("dkdv", build_dkdv, dtype, tiling, variant, dropout, mods)


def _tile_lists(problem, tiling, pattern):
    """``(p_heads, indptr, indices, csr, rows, cols)`` on the device: the tile lists by
    query tile (``tile_ptr, tile_idx, tile_full``) and by key tile, and the pattern's CSR
    (placeholders for dense problems, whose lists are every key tile up to the causal
    limit)."""
    _, _, _, Lq, Lk, _, _ = problem.shape
    bq, bk = tiling.bq, tiling.bk
    if pattern is None:
        n_qt, n_kt = -(-Lq // bq), -(-Lk // bk)
        last = np.array([key_tiles_seen(t * bq, bq, Lq, Lk, bk, problem.causal)[1]
                         for t in range(n_qt)], np.int64)
        ptr = np.zeros(n_qt + 1, np.int64)
        np.cumsum(last, out=ptr[1:])
        idx = np.concatenate([np.arange(n, dtype=np.int32) for n in last] or
                             [np.zeros(0, np.int32)])
        layout = BlockLayout(bq, bk, n_qt, n_kt, ptr, idx, np.ones(idx.size, np.bool_))
        p_heads, indptr, indices = 1, np.zeros(1, np.int64), np.zeros(1, np.int32)
    else:
        layout = pattern.blocks(bq, bk)
        p_heads, indptr, indices = pattern.n_heads, pattern.indptr, pattern.indices
    rows = (layout.tile_ptr, layout.tile_idx, layout.tile_full)
    dev = [cuda.to_device(np.ascontiguousarray(x)) for x in
           (indptr, indices, *rows, *layout.by_key_tile())]
    return p_heads, dev[0], dev[1], pattern is not None, tuple(dev[2:5]), tuple(dev[5:])


def _on_device(x, dtype=None):
    if x is None:
        return None
    if is_device_array(x):
        return device_view(x, need_reshape=False)
    return cuda.to_device(np.ascontiguousarray(x, dtype))


def _finish(a, *results):
    """Gradients as device arrays (device problems) or host arrays; None stays None."""
    if a.on_device:
        return results
    return tuple(None if r is None else r.copy_to_host() for r in results)


def _sweep(problem, a, streams, rowv, dout, pattern=None, selection=None, rectified=False,
           need_dbias=False, stream=None, grads=None, clip=None, mod_grads=()):
    """Launch both kernels; returns device ``(dq, dk, dv, dbias_full, dlogks_per_head)``.

    ``mod_grads``: the score function's gradient buffers, a slot per key-tile block
    (:func:`key_tile_blocks`), added to.

    ``stream`` (0 or 1): one stream of a differential pair, through the one-stream
    kernels (``streams = 1``), into ``grads`` (what stream 0's call returned) for
    stream 1; with ``clip`` (the forward's clip bits) a rectified pair's stream.
    """
    B, Hx, Hkx, Lq, Lk, D, Dv = problem.shape
    S = streams
    paired = S == 2 or stream is not None
    H, Hk = (Hx // 2, Hkx // 2) if paired else (Hx, Hkx)
    dt = a.dtype
    if grads is None:
        dq = cuda.device_array(problem.q.shape, dt)
        dk = cuda.device_array(problem.k.shape, dt)
        dv = cuda.device_array(problem.v.shape, dt)
        # zeros: the tiles a causal limit or a pattern skips are never visited
        dbias = cuda.to_device(np.zeros((B, H, Lq, Lk) if need_dbias else (1, 1, 1, 1), dt))
        dlogks = cuda.to_device(np.zeros((B, Hk, Lk) if a.has_ks else (1, 1, 1), dt))
    else:
        dq, dk, dv, dbias, dlogks = grads
    t_dq = backward_tiling(a.dtype, D, Dv, S, "dq")
    t_kv = backward_tiling(a.dtype, D, Dv, S, "dkdv")
    p_heads, indptr, indices, csr, rows, _ = _tile_lists(problem, t_dq, pattern)
    cols = _tile_lists(problem, t_kv, pattern)[5]
    if selection is None:
        thr, cut = cuda.to_device(np.zeros((1, 1, 1), dt)), cuda.to_device(
            np.zeros((1, 1, 1), np.int64))
    else:
        thr, cut = selection
    clip_d = cuda.device_array(1, np.uint32) if clip is None else clip.reshape(clip.size)
    common = (a.q, a.k, a.v, dout, dt.type(problem.scale), a.bias, a.has_bias, a.mask,
              a.has_mask, a.logks, a.has_ks, problem.causal,
              NORMALIZER_CODES[problem.normalizer], rowv, thr, cut, selection is not None,
              rectified, clip_d, p_heads, indptr, indices, csr, *kernel_dropout(problem, dt))
    n_qt, n_kt = -(-Lq // t_dq.bq), -(-Lk // t_kv.bk)
    # the query-tile kernel first: with two streams it forms d1 and e for the other
    variant = ("sparse" if pattern is not None else "topk" if selection is not None else
               "dense" if stream is None else
               f"stream{stream}" if clip is None else f"clipped{stream}")
    dropping = bool(problem.dropout_p)
    mods = device_mods(problem)
    dq_kernel(dt, t_dq, variant, dropping, mods)[(B * H, n_qt), t_dq.threads](
        *common, *rows, dq, a.mods)
    dkdv_kernel(dt, t_kv, variant, dropping, mods)[(B * Hk, n_kt), t_kv.threads](
        *common, *cols, need_dbias, dk, dv, dbias, dlogks, a.mods, mod_grads)
    return dq, dk, dv, dbias, dlogks


def _zeros(problem, dtype, dbias_shape, extra=()):
    """The gradients of a problem without work (an empty axis)."""
    B, _, _, _, Lk, _, _ = problem.shape
    z = [np.zeros(x.shape, dtype) for x in (problem.q, problem.k, problem.v)]
    z.append(None if dbias_shape is None else np.zeros(dbias_shape, dtype))
    z.append(None if problem.log_key_size is None else np.zeros((B, Lk), dtype))
    z += [np.zeros(s, dtype) for s in extra]
    if problem.on_device:
        return tuple(None if x is None else cuda.to_device(x) for x in z)
    return tuple(z)


def _chunk_bias_shape(part, dbias_shape, streams):
    """A chunk's bias gradient shape: ``dbias_shape``'s broadcast axes, the chunk's
    batch elements and heads where the bias has them."""
    B, Hx, _, Lq, Lk = part.shape[:5]
    return (1 if dbias_shape[0] == 1 else B, 1 if dbias_shape[1] == 1 else Hx // streams,
            Lq, Lk)


def _host(x):
    return x.copy_to_host() if is_device_array(x) else np.asarray(x)


def _in_chunks(problem, per_row, dbias_shape, run, streams=1):
    """The backward of a broadcast bias whose full-size gradient buffer would pass
    :data:`~attnnb._bias_chunks.CHUNK_BYTES`, chunk by chunk (:mod:`attnnb._bias_chunks`),
    or None when it fits.  ``run(part, *rows, part_dbias_shape)`` is the one-piece
    backward of a chunk.  The chunks' gradients are gathered on the host (they are
    the gradients' own size), then copied to the device for a device problem."""
    B, Hx, Hkx, Lq, Lk = problem.shape[:5]
    itemsize = np.dtype(problem.compute_dtype).itemsize
    chunks = bias_chunks((B, Hx // streams, problem.v.shape[1], Lq, Lk), itemsize,
                         dbias_shape)
    if chunks is None:
        return None
    per_row = [None if x is None else _host(x) for x in per_row]

    def one_chunk(part, *rows):
        return run(part, *rows, _chunk_bias_shape(part, dbias_shape, streams))

    grads = chunked_vjp(one_chunk, problem, per_row, chunks, dbias_shape, streams=streams,
                        host=_host)
    if problem.on_device:
        return tuple(None if g is None else cuda.to_device(g) for g in grads)
    return grads


def _single(problem, out, lse, dout, dlse, dbias_shape, pattern=None, top_k=None):
    """Gradients of one stream (dense, sparse or top-k); the interface's 5-tuple, and
    the score function's parameters' gradients sixth when there is one."""
    if dbias_shape is not None:  # (sparse and top-k take no bias)
        mod_parts = []

        def piece(*args):
            grads = _single_piece(*args)
            mod_parts.extend(grads[5:])
            return grads[:5]

        chunked = _in_chunks(problem, (out, lse, dout, dlse), dbias_shape, piece)
        if chunked is not None:
            return chunked + ((sum_param_grads(mod_parts),) if mod_parts else ())
    return _single_piece(problem, out, lse, dout, dlse, dbias_shape, pattern, top_k)


def key_tile_blocks(problem, dtype) -> int:
    """The blocks of the key-tile kernel of a one-stream problem (``B * Hk`` times its
    key tiles)."""
    B, _, Hk, _, Lk, D, Dv = problem.shape
    return B * Hk * -(-Lk // backward_tiling(dtype, D, Dv, 1, "dkdv").bk)


def _single_piece(problem, out, lse, dout, dlse, dbias_shape, pattern=None, top_k=None):
    """:func:`_single` with the bias gradient formed full size, in one piece."""
    B, Hq, _, Lq, Lk, D, Dv = problem.shape
    a = device_problem(problem)
    dt = a.dtype
    mod_grads = () if problem.score_mod is None else gradient_buffers(
        problem, key_tile_blocks(problem, dt))
    tail = () if problem.score_mod is None else (parameter_gradients(problem, ()),)
    if not (B * Hq and Lq and Lk):
        return _zeros(problem, dt, dbias_shape) + tail
    selection = None
    if top_k is not None:  # the forward's own kernel makes the selection again
        from .topk import topk_selection

        selection = topk_selection(problem, top_k, a)[2:]
    dout = _on_device(dout)
    rowv = cuda.device_array((B, Hq, 3, Lq), dt)
    grid, threads = _blocks(B * Hq * Lq)
    dlse_d = _on_device(dlse)
    _helper("row_terms", build_row_terms, dt)[grid, threads](
        _on_device(out), dout, _on_device(lse), dlse_d if dlse is not None else rowv,
        dlse is not None, NORMALIZER_CODES[problem.normalizer], a.sinks, rowv)
    dq, dk, dv, dbias, dlogks = _sweep(problem, a, 1, rowv, dout, pattern=pattern,
                                       selection=selection, need_dbias=dbias_shape is not None,
                                       mod_grads=mod_grads)
    if mod_grads:
        tail = (parameter_gradients(problem, mod_grads),)
    dbias = None if dbias_shape is None else sum_to(dbias, dbias_shape, dt)
    dlks = None
    if a.has_ks:
        dlks = sum_to(dlogks.reshape((B, dlogks.shape[1], 1, Lk)), (B, 1, 1, Lk),
                      dt).reshape((B, Lk))
    return _finish(a, dq, dk, dv, dbias, dlks) + tail


def attention_vjp(problem, out, lse, dout, dlse=None, dbias_shape=None):
    """Gradients of dense attention (see :mod:`attnnb.vjp` for the interface).

    Host problems give NumPy gradients in the compute dtype; device problems
    (and device ``out``, ``lse``, ``dout``) device gradients.  The bias
    gradient is formed full size, ``(B, Hq, Lq, Lk)``, each element by the
    one block that owns its key tile, then summed to ``dbias_shape`` on the
    device in index order.  For a broadcast bias whose full-size buffer would
    pass :data:`~attnnb._bias_chunks.CHUNK_BYTES`, chunk by chunk of batch
    elements or key heads instead (:mod:`attnnb._bias_chunks`), the chunks'
    gradients gathered on the host and, for a device problem, copied back.  A
    score function's arrays' gradients come sixth (host arrays): each key-tile
    block adds its pairs' into a slot of its own, one thread in order, and the
    slots are summed in order (:func:`attnnb.cuda._mods.gradient_buffers`).
    """
    return _single(problem, out, lse, dout, dlse, dbias_shape)


def sparse_attention_vjp(problem, pattern, out, lse, dout, dlse=None):
    """Gradients of sparse attention: the pattern's tiles only, both sweeps."""
    return _single(problem, out, lse, dout, dlse, None, pattern=pattern)


def topk_attention_vjp(problem, top_k, out, lse, dout, dlse=None):
    """Gradients of top-k attention, the forward's selection held fixed (recomputed by the
    top-k forward kernel itself, so it is the forward's exactly, ties included)."""
    return _single(problem, out, lse, dout, dlse, None, top_k=top_k)


def diff_attention_vjp(problem, lam, mode, out, dout, dbias_shape=None):
    """Gradients of differential attention, both modes (module notes).

    Both streams' LSEs come from the differential forward kernel (run again;
    its output is dropped).  ``"difference"``: each stream's one-stream
    backward in turn (row ratio 1 and ``-lam``; the query-tile kernel sweeps
    for the stream's ``delta``, ``d1`` and ``e``), stream 1 adding to stream
    0's ``dV`` and bias gradient.  ``dlam = -e``.  ``"rectified"``: the same
    two one-stream backwards, each weight gated by its clip, which the
    differential forward's clip build writes as one bit a (query, key) pair
    (``B * H * Lq * ceil(Lk / 32) * 4`` bytes, the one ``(Lq, Lk)`` buffer
    of the backward: the clip needs both streams' weights, which a
    one-stream kernel does not form).  A broadcast bias's gradient is formed
    as in :func:`attention_vjp`.
    """
    if dbias_shape is not None:
        B, H2, _, Lq = problem.shape[:4]
        lam_rows = np.broadcast_to(_host(lam), (B, H2 // 2, Lq))
        mod_parts = []

        def piece(part, lam_c, *rest):
            grads = _diff_piece(part, lam_c, mode, *rest)
            mod_parts.extend(grads[6:])
            return grads[:6]

        chunked = _in_chunks(problem, (lam_rows, out, dout), dbias_shape, piece, streams=2)
        if chunked is not None:
            return chunked + ((sum_param_grads(mod_parts),) if mod_parts else ())
    return _diff_piece(problem, lam, mode, out, dout, dbias_shape)


def _diff_piece(problem, lam, mode, out, dout, dbias_shape):
    """:func:`diff_attention_vjp` with the bias gradient formed full size, in one piece."""
    from .._codes import DIFF_MODE_CODES, RECTIFIED
    from .diff import clip_words, diff_forward

    B, H2, _, Lq, Lk, D, Dv = problem.shape
    H = H2 // 2
    lam_h = _host(lam)
    a = device_problem(problem)
    dt = a.dtype
    mod_grads = () if problem.score_mod is None else gradient_buffers(
        problem, key_tile_blocks(problem, dt))
    tail = () if problem.score_mod is None else (parameter_gradients(problem, ()),)
    if not (B * H and Lq and Lk):
        return _zeros(problem, dt, dbias_shape, extra=[(B, H, Lq)]) + tail
    host_rows = np.zeros((B, H, 5, Lq), dt)
    host_rows[:, :, 4] = np.broadcast_to(lam_h, (B, H, Lq))
    rowv = cuda.to_device(host_rows)
    need_dbias = dbias_shape is not None
    rectified = DIFF_MODE_CODES[mode] == RECTIFIED
    # (the kernels index the clip's words with 32 bits: past 2**32 words, 16 GiB, the
    # two-stream kernels, which form the clip themselves, take the problem)
    huge = B * H * Lq * -(-Lk // 32) >= 2**32
    two_streams = (RECTIFIED_TWO_STREAMS or huge if rectified else DIFFERENCE_TWO_STREAMS)
    if two_streams and (has_mods(problem) or problem.dropout_p):  # the pair streams' own
        if rectified and huge:
            raise NotImplementedError("mask and score functions or dropout in a rectified "
                                      "backward past 2**32 clip words on the cuda backend: "
                                      "not yet")
        two_streams = False
    # the rectified pair streams read the clip the forward's clip build writes
    clip = clip_words(B, H, Lq, Lk) if rectified and not two_streams else None
    diff_forward(problem, cuda.to_device(np.ascontiguousarray(host_rows[:, :, 4])), mode, a,
                 lses=rowv, clip=clip)
    dout = _on_device(dout)
    # the row vectors stay on the device throughout
    grid, threads = _blocks(B * H * Lq)
    if two_streams:
        dq, dk, dv, dbias, dlogks = _sweep(problem, a, 2, rowv, dout, rectified=rectified,
                                           need_dbias=need_dbias)
        e_rows, e_row = rowv, 3
    else:  # two one-stream backwards: dout weighs stream 0 by 1, stream 1 by -lam
        rows, grads = cuda.device_array((B, H, 3, Lq), dt), None
        for c in range(2):
            _helper("pair_rows", build_pair_rows, dt)[grid, threads](rowv, c, rows)
            grads = _sweep(problem, a, 1, rows, dout, need_dbias=need_dbias, stream=c,
                           grads=grads, clip=clip, mod_grads=mod_grads)
        dq, dk, dv, dbias, dlogks = grads
        e_rows, e_row = rows, 2
    dlam = cuda.device_array((B, H, Lq), dt)
    _helper("negated_row", build_negated_row, dt)[grid, threads](e_rows, e_row, dlam)
    dbias = None if dbias_shape is None else sum_to(dbias, dbias_shape, dt)
    dlks = None
    if a.has_ks:
        dlks = sum_to(dlogks.reshape((B, dlogks.shape[1], 1, Lk)), (B, 1, 1, Lk),
                      dt).reshape((B, Lk))
    if mod_grads:
        tail = (parameter_gradients(problem, mod_grads),)
    return _finish(a, dq, dk, dv, dbias, dlks, dlam) + tail


def ptx_signatures():
    """``[(name, python function, argument types, options)]`` for the PTX check: both
    kernels, one stream (dense, sparse, top-k) at D = 64 and 128, one stream of a
    differential pair (the difference mode) and two streams (the rectified mode) at
    d = 64, Dv = 128; the helper kernels."""
    from numba import types

    from ._micro import ptx_cases

    b_ = types.boolean
    i64, i32, flags = types.int64[::1], types.int32[::1], types.boolean[::1]

    def common(ty):
        arr4 = ty[:, :, :, ::1]
        return (arr4, arr4, arr4, arr4, ty, arr4, b_, types.boolean[:, :, :, ::1], b_,
                ty[:, ::1], b_, b_, types.int64, arr4, ty[:, :, ::1], types.int64[:, :, ::1],
                b_, b_, types.uint32[::1], types.int64, i64, i32, b_, types.int64, types.int64,
                types.int64, types.int64, types.int64, ty, i64, i32, flags)

    def dq_types(ty):
        return common(ty) + (ty[:, :, :, ::1], types.Tuple(()))

    def dkdv_types(ty):
        arr4 = ty[:, :, :, ::1]
        return common(ty) + (b_, arr4, arr4, arr4, ty[:, :, ::1], types.Tuple(()),
                             types.Tuple(()))

    cases = []
    for label, build, argtypes in (("dq", build_dq, dq_types), ("dkdv", build_dkdv, dkdv_types)):
        def tiles(dtype, d, dv, streams, label=label):
            return backward_tiling(dtype, d, dv, streams, label)

        for d in (64, 128):
            cases += ptx_cases(f"backward {label}", build, argtypes, d, d, tiles=tiles)
        cases += ptx_cases(f"backward dropout {label}",
                           lambda dt, t, b=build: b(dt, t, "dense", True), argtypes, 64, 64,
                           tiles=tiles)
        # the difference mode: one stream of the pair (the second, which adds to dV)
        cases += ptx_cases(f"backward diff {label}", lambda dt, t, b=build: b(dt, t, "stream1"),
                           argtypes, 64, 128, tiles=tiles)
        # the rectified mode: one clipped stream of the pair (the second)
        cases += ptx_cases(f"backward rectified {label}",
                           lambda dt, t, b=build: b(dt, t, "clipped1"), argtypes, 64, 128,
                           tiles=tiles)
        # the two-stream kernels, the other design of both modes (off by default)
        cases += ptx_cases(f"backward two-stream {label}", build, argtypes, 64, 128,
                           streams=2, tiles=tiles)
    for name, _, _, options in cases:
        if name in KNOWN_GATE_FAILURES:
            options["known"] = KNOWN_GATE_FAILURES[name]
    for dtype in (np.float32, np.float64):
        ty = numba_type(dtype)
        arr3, arr4 = ty[:, :, ::1], ty[:, :, :, ::1]
        name = np.dtype(dtype).name
        cases += [(f"backward row_terms {name}", build_row_terms(np.dtype(dtype)),
                   (arr4, arr4, arr3, arr3, b_, types.int64, ty[:, ::1], arr4)),
                  (f"backward pair_rows {name}", build_pair_rows(np.dtype(dtype)),
                   (arr4, types.int64, arr4)),
                  (f"backward negated_row {name}", build_negated_row(np.dtype(dtype)),
                   (arr4, types.int64, arr3)),
                  (f"backward sum_to {name}", build_sum_to(np.dtype(dtype)), (arr4, arr4))]
    return cases
