"""Differential attention on the GPU: two score streams over the same K/V tiles.

Grid ``(B * H, query tiles)`` of register-tiled blocks (:mod:`attnnb.cuda._micro`)
over head pair ``h``: both components' query tiles (``q[2h]``, ``q[2h+1]``)
sit side by side in shared memory, and so do their key tiles (``k[2g]``,
``k[2g+1]``), staged once per key tile; each thread owns the same micro-tile
of both score streams.  Two passes, for every mode:

* pass 1 runs the online maximum / sum of both streams (no values): each
  row's two LSEs;
* pass 2 recomputes the logits, turns them into the normalised maps
  ``A1 = exp(s1 - lse1)``, ``A2 = exp(s2 - lse2)`` and accumulates
  ``W V`` into one ``O`` micro-tile, ``W = A1 - lam * A2`` (``"difference"``),
  ``max(0, A1 - lam * A2)`` (``"rectified"``) or ``A1 - lam * H(A1 - lam * A2)``
  (``"heaviside"``, ``H(x) = 1`` for ``x > 0``, else 0: ``A1 - lam`` or ``A1``).

With values twice the key width (the paper's ``Dv = 2d``) the two passes
do the multiply-adds of one pass that keeps two value accumulators (four
``Q K^T`` products of width ``d`` against two ``P V`` products of width
``Dv``), with half the registers.  A value tile holding a non-finite value
takes, in ``"difference"`` mode, the two maps' products on their own,
``O += A1 V - lam * (A2 V)`` (as two attention calls subtracted: an Inf that
both maps weight gives NaN); in the other two a zero weight (clipped, or of a key
neither map weighs) never carries a value.  A row where either map meets a NaN
logit is NaN.
Mirrors :mod:`attnnb.cpu.diff`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .._core import scalars as _scalars
from .._core.codes import DIFF_MODE_CODES, DIFFERENCE, HEAVISIDE, RECTIFIED, SOFTMAX
from ._arrays import device_problem, finish
from ._dropout import kernel_dropout
from ._micro import (
    ALIGN,
    U32,
    core_kernel,
    kernel_label,
    micro_functions,
    ptx_cases,
    tiled_kernel,
    tiling_for,
)
from ._mods import device_mods
from ._tiles import device, kernel, unbound

# the globals the templates read, bound per build
(stage_transposed, ONE, BK, N_KS, tile_scores, modify_tile, N_QS, thread_max,
 row_reduce, tile_sums, TM, map_lse, TN, ZERO, NINF, CLIP, ONE_WORD, BQ, block_tile,
 N_ALL, nt, shared_arrays, thread_place, N_S, N_O, start, start_rows, DROPOUT,
 dropout_keys, tiles_seen, CAST, drop_stored, stage_values, store_tile, tile_product,
 add_tile, scale_values, TO, DV, NAN) = unbound(40)


log_add_exp = cuda.jit(device=True)(_scalars.log_add_exp)  # shared with the cpu backend


def build_diff(dtype, tiling, clip_bits=False, mods=None, dropout=False):
    """The differential kernel for one compute dtype and :class:`~attnnb.cuda._micro.Tiling`
    (``streams=2``; not compiled yet; launch with ``tiling.threads`` threads per block).

    Kernel arguments: ``q (B, 2H, Lq, d)``, ``k (B, 2Hk, Lk, d)``,
    ``v (B, Hk, Lk, Dv)``, ``lam (B, H, Lq)``, ``scale``, ``bias`` / ``mask``
    (4-D over pairs, each axis full or 1) with flags, ``logks`` with its flag,
    ``causal``, the mode code, ``out (B, H, Lq, Dv)``, ``lses (B, H, 2, Lq)``
    (both streams' LSEs, which the backward reuses), ``clip``, the dropout's
    ``seed_lo, seed_hi, batch0, head0, threshold, keep`` (read by the ``dropout``
    build: a combined weight ``(b, pair h, i, j)`` is dropped after it is formed, its
    clip bit and the LSEs are those before dropout) and ``mods`` (mask and score
    functions on both streams, ``h`` the pair's index; as the dense kernel's).
    With ``has_sinks``, ``sinks (B, 2H)`` (query head ``2h + c``'s sink in the
    denominator of map ``c`` of pair ``h``): between the passes each LSE becomes
    ``log(e^lse + e^sink)``, the map's normaliser, which ``lses`` then holds.

    ``clip_bits``: the rectified and Heaviside backwards' build.  Pass 2 also sets the
    clip of every weight it forms (the Heaviside mode's gate ``H``),
    ``clip[b, h, i, j // 32]`` bit ``j % 32`` where ``A1 - lam A2 > 0``
    (``clip (B, H, Lq, ceil(Lk / 32))`` uint32, zeros on entry; the threads
    sharing a word OR their bits in, so the word is the same whatever their
    order).  The other build ignores ``clip``.  In the Heaviside mode this build
    weighs the values by the gate alone: its ``out`` is ``H V`` (dropout
    included), from which the backward forms ``dlam = -dout . (H V)``.
    """
    micro = micro_functions(np.dtype(dtype), tiling, mods)
    return core_kernel(diff_attention_kernel, micro, "diff", CLIP=clip_bits, DROPOUT=dropout,
                       ONE_WORD=32 % tiling.tn == 0)  # a thread's keys share a clip word


@device
def pair_scores(Qt, KV, k1h, k2h, j0, nk, row0, key0, S1, S2, F, i0, Lq, Lk, diag, b, h,
                bias, has_bias, mask, has_mask, logks, has_ks, mods):
    """Stage both components' key tiles at ``j0``; both modified logit micro-tiles
    (``-inf`` outside the allowed set; ``F``: scratch for the unused factors).  Every
    thread must call it; a barrier must follow before ``KV`` is staged again."""
    stage_transposed(k1h, j0, nk, ONE, KV, BK)
    stage_transposed(k2h, j0, nk, ONE, KV[N_KS:], BK)
    cuda.syncthreads()
    tile_scores(Qt, KV, row0, key0, S1)
    modify_tile(S1, F, i0, row0, j0, key0, Lq, Lk, diag, b, h, bias, has_bias, mask,
                has_mask, logks, has_ks, SOFTMAX, mods)
    tile_scores(Qt[N_QS:], KV[N_KS:], row0, key0, S2)
    modify_tile(S2, F, i0, row0, j0, key0, Lq, Lk, diag, b, h, bias, has_bias, mask,
                has_mask, logks, has_ks, SOFTMAX, mods)


@device
def sweep_max(S, part, m, l, alpha, Pt, red, rows, t, row0, key0):
    """Fold one stream's tile into its running ``(m, l)`` (every thread calls it)."""
    thread_max(S, part)
    row_reduce(red, rows, t, row0, key0, part, part, True)
    tile_sums(S, S, m, l, alpha, part, SOFTMAX, Pt, row0, key0)


@device
def stream_lse(m, l, part, red, rows, t, row0, key0):
    """``m[r]`` becomes the row's LSE of a finished pass-1 sweep (``l``: partial sums)."""
    row_reduce(red, rows, t, row0, key0, l, part, False)
    for r in range(TM):
        m[r] = map_lse(m[r], part[r])


@device
def add_sink(lse, sink):
    """``lse = log(e^lse + e^sink)`` in place: ``exp(s - lse)`` then weighs as
    ``e^s / (e^sink + sum e^s)``; an empty row's becomes the sink, NaN stays NaN."""
    for r in range(TM):
        lse[r] = log_add_exp(lse[r], sink)


@device
def normalise(S, lse):
    """``S = exp(S - lse)``: one map's weights (an empty map, ``lse = -inf``, is 0)."""
    for r in range(TM):
        for c in range(TN):
            S[r * TN + c] = ZERO if lse[r] == NINF else math.exp(S[r * TN + c] - lse[r])


@device
def combine(A1, A2, lamr, mode, Pt, row0, key0, clip, row_word, words, i0, j0, Lq):
    """``Pt = (A1 - lam * A2)^T``, clipped at 0 in the rectified ``mode``, ``A1 - lam``
    where it is above 0 and ``A1`` elsewhere in the Heaviside one (the clip build:
    1 and 0, the gate ``H``); the clip build
    also sets the bits of the weights above 0 (rows ``i0 + row0 + r``, keys ``j0 +
    key0 + c``), which the threads sharing a word OR in: with ``TN`` dividing 32 a
    thread's keys lie in one word (``key0`` is a multiple of ``TN``), else each bit is
    set on its own."""
    for r in range(TM):
        bits = U32(0)
        word = row_word + U32(r) * words
        live = CLIP and i0 + row0 + r < Lq
        for c in range(TN):
            a1 = A1[r * TN + c]
            w = a1 - lamr[r] * A2[r * TN + c]
            if w > ZERO:
                bits |= U32(1) << U32(c)
                if live and not ONE_WORD:
                    j = U32(j0 + key0 + c)
                    cuda.atomic.or_(clip, word + (j >> U32(5)), U32(1) << (j & U32(31)))
            if mode == HEAVISIDE and CLIP:  # the backward's build: the gate alone
                w = ONE if w > ZERO else ZERO
            elif mode == HEAVISIDE:  # H(0) = 0: keys neither map weighs keep 0
                w = a1 - lamr[r] if w > ZERO else a1
            elif mode == RECTIFIED and not w > ZERO:
                w = ZERO
            Pt[(U32(key0) + U32(c)) * U32(BQ) + U32(row0) + U32(r)] = w
        j = U32(j0 + key0)
        if live and ONE_WORD and bits != U32(0):
            cuda.atomic.or_(clip, word + (j >> U32(5)), bits << (j & U32(31)))


@kernel
def diff_attention_kernel(q, k, v, lam, scale, bias, has_bias, mask, has_mask, logks,
                          has_ks, causal, mode, out, lses, clip, seed_lo, seed_hi, batch0,
                          head0, threshold, keep, has_sinks, sinks, mods):
    Lq, Lk = q.shape[2], k.shape[2]
    b, h, g, i0 = block_tile(q.shape[1] // 2, k.shape[1] // 2, 0)
    smem = cuda.shared.array(N_ALL, nt, alignment=ALIGN)
    Qt, KV, Pt, red, rows, flag = shared_arrays(smem)
    t, row0, key0, col0 = thread_place()
    S1 = cuda.local.array(N_S, nt)
    S2 = cuda.local.array(N_S, nt)
    F = cuda.local.array(N_S, nt)  # the factors: unused (softmax)
    m1 = cuda.local.array(TM, nt)  # pass 2: the LSEs
    l1 = cuda.local.array(TM, nt)  # pass 2: 1 (the first map's coefficient)
    m2 = cuda.local.array(TM, nt)
    l2 = cuda.local.array(TM, nt)  # pass 2: -lam (the second map's)
    part = cuda.local.array(TM, nt)  # pass 2: lam
    alpha = cuda.local.array(TM, nt)
    O = cuda.local.array(N_O, nt)
    T = cuda.local.array(N_O, nt)
    start(m1, l1, O, flag)
    start_rows(m2, l2)
    keys = cuda.local.array(TM, np.int64)  # the dropout's row keys
    if DROPOUT:
        dropout_keys(keys, seed_lo, seed_hi, batch0 + b, head0 + h, i0, row0)
    nq = min(BQ, Lq - i0)
    stage_transposed(q[b, 2 * h], i0, nq, scale, Qt, BQ)
    stage_transposed(q[b, 2 * h + 1], i0, nq, scale, Qt[N_QS:], BQ)
    diag, last = tiles_seen(i0, BQ, Lq, Lk, BK, causal)
    k1h = k[b, 2 * g]
    k2h = k[b, 2 * g + 1]
    vh = v[b, g]
    # pass 1: both streams' running maxima and sums (no values): their LSEs
    for tile in range(last):
        pair_scores(Qt, KV, k1h, k2h, tile * BK, min(BK, Lk - tile * BK), row0, key0,
                    S1, S2, F, i0, Lq, Lk, diag, b, h, bias, has_bias, mask, has_mask, logks,
                    has_ks, mods)
        sweep_max(S1, part, m1, l1, alpha, Pt, red, rows, t, row0, key0)
        sweep_max(S2, part, m2, l2, alpha, Pt, red, rows, t, row0, key0)  # ends: barrier
    stream_lse(m1, l1, part, red, rows, t, row0, key0)
    stream_lse(m2, l2, part, red, rows, t, row0, key0)
    if has_sinks:  # pass 2's maps: e^s / (e^sink + sum e^s)
        add_sink(m1, CAST(sinks[b, 2 * h]))
        add_sink(m2, CAST(sinks[b, 2 * h + 1]))
    if key0 == 0:
        for r in range(TM):
            if i0 + row0 + r < Lq:
                lses[b, h, 0, i0 + row0 + r] = m1[r]
                lses[b, h, 1, i0 + row0 + r] = m2[r]
    # the clip build: the flat index of the word of row i0 + row0 and key 0 (32-bit:
    # the backward sends problems of 2**32 words or more to the two-stream kernels)
    words = U32((Lk + 31) // 32)
    row_word = U32((b * (q.shape[1] // 2) + h) * Lq + i0 + row0) * words
    for r in range(TM):
        part[r] = CAST(lam[b, h, min(i0 + row0 + r, Lq - 1)])
        l1[r] = ONE
        l2[r] = -part[r]
    # pass 2: the combined weights of the two normalised maps, times the values
    for tile in range(last):
        j0 = tile * BK
        nk = min(BK, Lk - j0)
        pair_scores(Qt, KV, k1h, k2h, j0, nk, row0, key0, S1, S2, F, i0, Lq, Lk, diag, b,
                    h, bias, has_bias, mask, has_mask, logks, has_ks, mods)
        normalise(S1, m1)
        normalise(S2, m2)
        # Pt is free: a barrier ended
        combine(S1, S2, part, mode, Pt, row0, key0, clip, row_word, words, i0, j0, Lq)
        if DROPOUT:
            drop_stored(Pt, row0, key0, j0, keys, threshold)
        cuda.syncthreads()  # the key tiles are read: stage the values over them
        if stage_values(vh, j0, nk, KV):
            flag[0] = CAST(tile)
        cuda.syncthreads()
        guarded = flag[0] == CAST(tile)
        if guarded and mode == DIFFERENCE:  # as two attention calls: A1 V - lam * (A2 V)
            store_tile(S1, Pt, row0, key0)
            if DROPOUT:
                drop_stored(Pt, row0, key0, j0, keys, threshold)
            cuda.syncthreads()
            tile_product(Pt, KV, row0, col0, True, T)
            add_tile(O, T, l1)
            cuda.syncthreads()
            store_tile(S2, Pt, row0, key0)
            if DROPOUT:
                drop_stored(Pt, row0, key0, j0, keys, threshold)
            cuda.syncthreads()
            tile_product(Pt, KV, row0, col0, True, T)
            add_tile(O, T, l2)
        else:
            tile_product(Pt, KV, row0, col0, guarded, T)
            add_tile(O, T, l1)
        cuda.syncthreads()
    if DROPOUT:
        scale_values(O, keep)
    for r in range(TM):
        i = i0 + row0 + r
        spoiled = m1[r] != m1[r] or m2[r] != m2[r]
        if i < Lq:
            for e in range(TO):
                if col0 + e < DV:
                    out[b, h, i, col0 + e] = NAN if spoiled else O[r * TO + e]


def diff_forward(problem, lam, mode, a=None, lses=None, clip=None):
    """Run the differential kernel; returns device arrays ``(out, lses)``.

    ``lses (B, H, NR >= 2, Lq)``: both streams' LSEs (compute dtype; with sinks the
    maps' normalisers, ``log(e^lse + e^sink)``) in rows 0 and 1 (given: written there,
    the other rows kept).  ``lam``: a host or
    device ``(B, H, Lq)`` array; ``a``: the problem's device arrays when
    already made.  ``clip`` (rectified and Heaviside modes; :func:`clip_words` zeros):
    the build that also writes the weights' clip bits there (:func:`build_diff`; its
    ``out``, in the compute dtype, is ``H V`` in the Heaviside mode).
    """
    B, H2, _, Lq, _, D, Dv = problem.shape
    H = H2 // 2
    a = device_problem(problem) if a is None else a
    out = cuda.device_array((B, H, Lq, Dv), a.out_dtype if clip is None else a.dtype)
    if lses is None:
        lses = cuda.device_array((B, H, 2, Lq), a.dtype)
    if Lq and B * H:
        tiling = tiling_for(a.dtype, D, Dv, streams=2)
        mods = device_mods(problem)
        bits = clip is not None
        dropping = bool(problem.dropout_p)
        kernel = tiled_kernel(kernel_label("diff-clip" if bits else "diff", dropping, mods),
                              lambda dt, t: build_diff(dt, t, bits, mods, dropping), a.dtype,
                              tiling)
        clip = clip.reshape(clip.size) if bits else cuda.device_array(1, np.uint32)
        lam_d = lam if hasattr(lam, "copy_to_host") else cuda.to_device(
            np.ascontiguousarray(lam))
        kernel[(B * H, (Lq + tiling.bq - 1) // tiling.bq), tiling.threads](
            a.q, a.k, a.v, lam_d, a.dtype.type(problem.scale), a.bias, a.has_bias, a.mask,
            a.has_mask, a.logks, a.has_ks, problem.causal, DIFF_MODE_CODES[mode], out, lses,
            clip, *kernel_dropout(problem, a.dtype), problem.sinks is not None, a.sinks,
            a.mods)
    return out, lses


def build_clip(dtype, tiling):
    """:func:`build_diff`'s build that writes the clip bits (the Heaviside mode's gate)."""
    return build_diff(dtype, tiling, clip_bits=True)


def clip_words(B: int, H: int, Lq: int, Lk: int):
    """Zeroed device ``(B, H, Lq, ceil(Lk / 32))`` uint32: one bit a (query, key) pair."""
    return cuda.to_device(np.zeros((B, H, Lq, -(-Lk // 32)), np.uint32))


def diff_attention(problem, lam, mode="difference"):
    """Differential attention of a canonical problem (built with ``head_pairs=True``).

    Parameters
    ----------
    problem : :class:`~attnnb._front.validate.Problem`
        ``q (B, 2H, Lq, d)``, ``k (B, 2Hk, Lk, d)``, ``v (B, Hk, Lk, Dv)``.
    lam : ``(B, H, Lq)`` host array (copied to the device), finite.
    mode : ``"difference"``, ``"rectified"`` or ``"heaviside"``

    Returns
    -------
    out : ``(B, H, Lq, Dv)``: a device array in the result dtype for device
    problems, else a NumPy array in the compute dtype.
    """
    a = device_problem(problem)
    return finish(a, diff_forward(problem, lam, mode, a)[0])[0]


def ptx_signatures():
    """``[(name, python function, argument types, options)]`` for the PTX check."""
    from numba import types

    def argtypes(ty):
        arr4 = ty[:, :, :, ::1]
        return (arr4, arr4, arr4, ty[:, :, ::1], ty, arr4, types.boolean,
                types.boolean[:, :, :, ::1], types.boolean, ty[:, ::1], types.boolean,
                types.boolean, types.int64, arr4, arr4, types.uint32[::1], types.int64,
                types.int64, types.int64, types.int64, types.int64, ty, types.boolean,
                ty[:, ::1], types.Tuple(()))

    return (ptx_cases("diff", build_diff, argtypes, 64, 128, streams=2)
            + ptx_cases("diff clip", build_clip, argtypes, 64, 128, streams=2)
            + ptx_cases("diff dropout", lambda dt, t: build_diff(dt, t, dropout=True), argtypes,
                        64, 128, streams=2, variant=True))
