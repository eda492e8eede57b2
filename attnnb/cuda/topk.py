"""Top-k attention on the GPU: two passes per query tile over the register-tiled core.

Blocks as the dense kernel's (:mod:`attnnb.cuda._micro`).  Pass 1 sweeps
the key tiles and each thread stores its micro-tile of modified logits
(``s + log key_size``, ``-inf`` outside the mask / causal limit) in the
global scratch rows of its query rows (length ``Lk``); then one thread per
row finds the row's threshold by selection (ties to the lower key index)
and leaves it in shared memory.  Pass 2 sweeps the value tiles with the
core's online softmax over the selected keys only, reading back the logits
pass 1 stored, so it keeps exactly the keys pass 1 counted.  Mirrors
:mod:`attnnb.cpu.topk`.

The other normalizers (``relu_expm1``, ``sigmoid``, ``softpick``) rank the
keys as softmax does (pass 1 is the same), then weigh the kept ones their
own way: pass 2 stages each key tile again and forms its logits with the
normalizer's modification (``sigmoid``'s bias, the factors, the key sizes),
masked by pass 1's selection on the stored ranking logits.  They compile
into builds of their own (:func:`topk_build`, the normalizer a constant),
so that the softmax family's build carries none of that code.

Scratch is two ``Lk`` rows per query row in flight, never ``Lq x Lk`` per
head: the query tiles are launched in chunks so that the scratch stays
under ``SCRATCH_ELEMENTS``.  For the backward the kernel also writes each
row's selection, one bit a key (``Lq x ceil(Lk / 32)`` words per head, as
the rectified mode's clip bits), so that the backward forms no ranking
logit again and holds no threshold in registers.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .._core import selection as _selection
from .._core.codes import NORMALIZER_CODES, RELU_EXPM1, SIGMOID, SOFTMAX, SOFTPICK
from ._arrays import device_problem, finish, outputs
from ._dropout import kernel_dropout
from ._micro import (
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

SCRATCH_ELEMENTS = 1 << 24  # per launch: 64 MiB in float32


def topk_build(normalizer: str):
    """The normalizer code compiled into a top-k problem's kernels: ``relu_expm1``,
    ``sigmoid`` and ``softpick`` form the kept keys' logits again (forward and backward),
    in builds of their own; None for the softmax family, whose build weighs the ranking
    logits themselves."""
    code = NORMALIZER_CODES[normalizer]
    return code if code in (RELU_EXPM1, SIGMOID, SOFTPICK) else None


# the globals the templates read, bound per build
(NINF, PINF, TM, TN, ZERO, block_tile, begin_tile, DROPOUT, dropout_keys, BQ, nt,
 tiles_seen, BK, stage_transposed, ONE, tile_scores, modify_tile, ANEW,
 key_tile_logits, online_tile, scale_values, CAST, index, finish_tile) = unbound(24)


# the selection rules the cpu backend compiles too (attnnb/_core/selection.py)
kth_smallest = cuda.jit(device=True)(_selection.kth_smallest)
tie_cut = cuda.jit(device=True)(_selection.tie_cut)
kept = cuda.jit(device=True)(_selection.kept)


def build_topk(dtype, tiling, dropout=False, mods=None, own=None):
    """The top-k kernel for one compute dtype and :class:`~attnnb.cuda._micro.Tiling`
    (not compiled yet; launch with ``tiling.threads`` threads per block); ``own``: the
    build of a normalizer that weighs the kept keys its own way (:func:`topk_build`).

    Kernel arguments: ``q, k, v``, ``scale``, ``bias`` with its flag (``sigmoid``'s
    offset, read by the ``own`` builds only: the ranking takes none), ``mask`` with its flag,
    ``logks`` with its flag, ``causal``, ``top_k``, ``qt0`` (first query tile
    of this launch), the scratch ``R`` and ``buf`` (``(B * Hq, rows, Lk)``), the
    dropout's ``seed_lo, seed_hi, batch0, head0, threshold, keep`` (read by the ``dropout``
    build: the kept keys' weights are dropped after the selection),
    ``out``, ``lse``, ``want_bits`` and ``bits`` (``(B, Hq, Lq, ceil(Lk / 32))``
    uint32: with ``want_bits`` each row's selection, bit ``j % 32`` of word ``j // 32``
    set where key ``j`` is kept, which the backward reads), the normalizer code
    (``softmax``, or ``softmax1`` with learned sinks, which only the finish reads),
    ``sinks`` (sink logits, as the dense kernel's) and ``mods``
    (mask and score functions, as the dense kernel's: rows rank the modified logits).
    """
    micro = micro_functions(np.dtype(dtype), tiling, mods, own)
    ranking = micro_functions(np.dtype(dtype), tiling, mods, None)  # pass 1's: softmax's
    return core_kernel(topk_attention_kernel, micro, "topk", DROPOUT=dropout,
                       ANEW=own is not None,  # pass 2 forms the logits again
                       PINF=np.dtype(dtype).type(np.inf), modify_tile=ranking.modify_tile)


@device
def row_threshold(row, n, top_k, buf):
    """``(thr, cut)``: key ``j`` is kept when ``row[j] > thr``, or ``row[j] == thr``
    and ``j <= cut``, or ``row[j]`` is NaN.

    Exactly ``top_k`` keys when more are allowed (ties to the lower
    index); all allowed keys when at most ``top_k`` are (``-inf, -1``);
    nothing for ``top_k = 0``; everything when the row holds a NaN (so
    that it propagates).
    """
    cnt = 0
    for j in range(n):
        x = row[j]
        if x != x:
            return NINF, n
        if x > NINF:
            buf[cnt] = x
            cnt += 1
    if cnt <= top_k:
        return NINF, -1
    if top_k == 0:
        return PINF, -1
    thr = kth_smallest(buf, cnt, cnt - top_k)
    return thr, tie_cut(row, n, top_k, thr)


@device
def kept_scores(Rows, row0, j, Lk, thr, cut, S):
    """``S`` = the stored logits of the thread's micro-tile (keys from ``j``), ``-inf``
    where not selected."""
    for r in range(TM):
        for c in range(TN):
            s = NINF
            if j + c < Lk:
                s = Rows[row0 + r, j + c]
                if not kept(s, j + c, thr[r], cut[r]):
                    s = NINF
            S[r * TN + c] = s


@device
def kept_logits(Rows, row0, j, Lk, thr, cut, S, F):
    """``S = -inf``, ``F = 0`` where the stored ranking logits of the thread's
    micro-tile (keys from ``j``) are not selected: ``S``, ``F`` another normalizer's
    logits and factors, formed anew (softpick counts a ``-inf`` logit with a
    factor)."""
    for r in range(TM):
        for c in range(TN):
            if not (j + c < Lk and kept(Rows[row0 + r, j + c], j + c, thr[r], cut[r])):
                S[r * TN + c] = NINF
                F[r * TN + c] = ZERO


@device
def store_selection(row, n, thr, cut, words, dst):
    """``dst[w]``, ``w < words``: the kept keys of a row of ``n`` stored ranking logits,
    one bit a key (keys from ``n`` on: not kept)."""
    for w in range(words):
        word = U32(0)
        for e in range(32):
            j = w * 32 + e
            if j < n and kept(row[j], j, thr, cut):
                word |= U32(1) << U32(e)
        dst[w] = word


@kernel
def topk_attention_kernel(q, k, v, scale, bias, has_bias, mask, has_mask, logks, has_ks, causal,
                          top_k, qt0, R, buf, seed_lo, seed_hi, batch0, head0, threshold,
                          keep, out, lse, want_bits, bits, normalizer, sinks, mods):
    Lq, Lk = q.shape[2], k.shape[2]
    b, h, g, i0 = block_tile(q.shape[1], k.shape[1], qt0)
    # F, the factors: unused by softmax (pass 1), pass 2's in an own build
    (Qt, KV, Pt, red, rows, flag, t, row0, key0, col0, S, F, m, l, part, alpha, O,
     T) = begin_tile(q[b, h], i0, scale)
    keys = cuda.local.array(TM, np.int64)  # the dropout's row keys
    if DROPOUT:
        dropout_keys(keys, seed_lo, seed_hi, batch0 + b, head0 + h, i0, row0)
    cuts = cuda.shared.array(BQ, numba.int64)
    thr = cuda.local.array(TM, nt)
    cut = cuda.local.array(TM, numba.int64)
    diag, last = tiles_seen(i0, BQ, Lq, Lk, BK, causal)
    Rows = R[cuda.blockIdx.x, cuda.blockIdx.y * BQ:]  # this query tile's scratch rows
    kh = k[b, g]
    vh = v[b, g]
    # pass 1: every allowed key's logit, stored
    for tile in range(last):
        j0 = tile * BK
        stage_transposed(kh, j0, min(BK, Lk - j0), ONE, KV, BK)
        cuda.syncthreads()
        tile_scores(Qt, KV, row0, key0, S)
        modify_tile(S, F, i0, row0, j0, key0, Lq, Lk, diag, b, h, bias, False, mask,
                    has_mask, logks, has_ks, SOFTMAX, mods)
        for r in range(TM):
            for c in range(TN):
                if j0 + key0 + c < Lk:
                    Rows[row0 + r, j0 + key0 + c] = S[r * TN + c]
        cuda.syncthreads()  # the key tile is read and the logits stored
    # each row's threshold: one thread a row (rows past Lq: a copy of the last, unused)
    if t < BQ:
        x, y = row_threshold(Rows[t], min(Lk, last * BK), top_k,
                             buf[cuda.blockIdx.x, cuda.blockIdx.y * BQ + t])
        rows[U32(t)] = x
        cuts[t] = y
        if want_bits and i0 + t < Lq:
            store_selection(Rows[t], min(Lk, last * BK), x, y, bits.shape[3],
                            bits[b, h, i0 + t])
    cuda.syncthreads()
    for r in range(TM):  # rows is rewritten only after the next barrier
        thr[r] = rows[U32(row0) + U32(r)]
        cut[r] = cuts[row0 + r]
    # pass 2: the online softmax over the selected keys
    for tile in range(last):
        j0 = tile * BK
        if ANEW:  # the normalizer's logits, masked by the selection
            key_tile_logits(kh, j0, min(BK, Lk - j0), Qt, KV, S, F, i0, row0, key0, Lq,
                            Lk, diag, b, h, bias, has_bias, mask, has_mask, logks, has_ks,
                            normalizer, mods)
            kept_logits(Rows, row0, j0 + key0, Lk, thr, cut, S, F)
            online_tile(S, F, part, m, l, alpha, normalizer, vh, j0, min(BK, Lk - j0),
                        tile, KV, Pt, red, rows, flag, t, row0, key0, col0, O, T, keys,
                        threshold if DROPOUT else 0)
        else:
            kept_scores(Rows, row0, j0 + key0, Lk, thr, cut, S)
            online_tile(S, S, part, m, l, alpha, SOFTMAX, vh, j0, min(BK, Lk - j0), tile,
                        KV, Pt, red, rows, flag, t, row0, key0, col0, O, T, keys,
                        threshold if DROPOUT else 0)
    if DROPOUT:
        scale_values(O, keep)
    sink = CAST(sinks[index(b, sinks.shape[0]), index(h, sinks.shape[1])])
    finish_tile(red, rows, t, row0, key0, col0, i0, Lq, m, l, O, part, normalizer,
                out[b, h], lse[b, h], sink)


def topk_selection(problem, top_k, a=None, want_bits=False):
    """Run the top-k kernel; returns device arrays ``(out, lse, bits)``.

    ``bits`` (``(B, Hq, Lq, ceil(Lk / 32))`` uint32, with ``want_bits``; else
    None) is each row's selection, bit ``j % 32`` of word ``j // 32`` for key
    ``j``: set where its ranking logit ``s`` (``s + log key_size``, after a score
    function, before any bias) is above the row's threshold, or equal to it
    at a key up to the row's tie cut, or NaN.  ``a``: the problem's device
    arrays when already made (:func:`~attnnb.cuda._arrays.device_problem`).
    """
    B, Hq, _, Lq, Lk, D, Dv = problem.shape
    a = device_problem(problem) if a is None else a
    out, lse = outputs((B, Hq, Lq, Dv), (B, Hq, Lq), a)
    bits = cuda.device_array((B, Hq, Lq, (Lk + 31) // 32) if want_bits else (1, 1, 1, 1),
                             np.uint32)
    if Lq and B * Hq:
        tiling = tiling_for(a.dtype, D, Dv)
        tq = tiling.bq
        dropping = bool(problem.dropout_p)
        mods = device_mods(problem)
        own = topk_build(problem.normalizer)
        kernel = tiled_kernel(kernel_label("topk", dropping, mods, own),
                              lambda dt, t: build_topk(dt, t, dropping, mods, own), a.dtype,
                              tiling)
        n_qt = (Lq + tq - 1) // tq
        chunk = max(1, min(n_qt, SCRATCH_ELEMENTS // (2 * B * Hq * tq * max(Lk, 1))))
        R = cuda.device_array((B * Hq, chunk * tq, max(Lk, 1)), a.dtype)
        buf = cuda.device_array((B * Hq, chunk * tq, max(Lk, 1)), a.dtype)
        for qt0 in range(0, n_qt, chunk):
            kernel[(B * Hq, min(chunk, n_qt - qt0)), tiling.threads](
                a.q, a.k, a.v, a.dtype.type(problem.scale), a.bias, a.has_bias, a.mask,
                a.has_mask, a.logks, a.has_ks, problem.causal, int(top_k), qt0, R, buf,
                *kernel_dropout(problem, a.dtype), out, lse, want_bits, bits,
                NORMALIZER_CODES[problem.normalizer], a.sinks, a.mods)
    return out, lse, bits if want_bits else None


def topk_attention(problem, top_k):
    """Top-k attention of a canonical problem; returns ``(out, lse)``."""
    a = device_problem(problem)
    out, lse, _ = topk_selection(problem, top_k, a)
    return finish(a, out, lse)


def ptx_signatures():
    """``[(name, python function, argument types, options)]`` for the PTX check."""
    from numba import types

    def argtypes(ty):
        arr4, arr3 = ty[:, :, :, ::1], ty[:, :, ::1]
        return (arr4, arr4, arr4, ty, arr4, types.boolean, types.boolean[:, :, :, ::1],
                types.boolean,
                ty[:, ::1], types.boolean, types.boolean, types.int64, types.int64, arr3, arr3,
                types.int64, types.int64, types.int64, types.int64, types.int64, ty, arr4, arr3,
                types.boolean, types.uint32[:, :, :, ::1], types.int64, ty[:, ::1],
                types.Tuple(()))

    cases = (ptx_cases("topk", build_topk, argtypes, 64, 64)
             + ptx_cases("topk dropout", lambda dt, t: build_topk(dt, t, True), argtypes,
                         64, 64, variant=True))
    for own in (RELU_EXPM1, SIGMOID, SOFTPICK):
        cases += ptx_cases(kernel_label("topk", own=own),
                           lambda dt, t, o=own: build_topk(dt, t, own=o), argtypes, 64, 64,
                           variant=True)
    return cases
