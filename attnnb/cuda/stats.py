"""Statistics of dense attention's weights on the GPU: one pass over the tiles after the LSE.

The cuda twin of :mod:`attnnb.cpu.stats`.  The weights of row ``i`` are ``w
= r_i exp(s' - lse_i) F z`` (``s'`` the modified logit, ``r_i`` softmax1's
or the sinks' ratio, ``F`` ``relu_expm1``'s factor, ``z`` the dropout
factor), from the forward's LSE.  Blocks as the dense kernel's (register
tiles of :mod:`attnnb.cuda._micro`); each thread reduces its micro-tile's
weights into its rows' partial entropy, mass on the chosen keys, exact zeros
among the allowed keys and largest weight (with its lowest key), and the row's
threads combine them at the end.  The weight each key receives is summed per
block over its query rows, in row order, into the block's own row of
``received``; the host sums those rows in order (no atomics: the same bits on
every run).  Accumulation is in the compute dtype.

Rows whose LSE is NaN get NaN statistics (and NaN received by every key) on
the host; empty rows zeros and ``argmax = -1``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from numba import cuda

from .._core.codes import NORMALIZER_CODES, RELU_EXPM1
from ._arrays import device_problem
from ._dropout import column_word, kept, kernel_dropout
from ._micro import (
    I64,
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

SCRATCH_ELEMENTS = 1 << 24  # per launch, of the blocks' received rows


# the globals the templates read, bound per build
(TM, CAST, NINF, ZERO, DROPOUT, TN, key_allowed, ONE, block_tile, begin_tile, nt,
 dropout_keys, tiles_seen, BQ, BK, key_tile_logits, store_tile, row_reduce) = unbound(18)


def build_stats(dtype, tiling, dropout=False, mods=None):
    """The statistics kernel for one compute dtype and :class:`~attnnb.cuda._micro.Tiling`.

    Kernel arguments: ``q``, ``k`` (4-D), ``scale``, ``bias`` / ``mask`` with their
    flags, ``logks`` with its flag, ``causal``, the normalizer code, ``lse`` and
    ``ratio`` (``(B, Hq, Lq)``, compute dtype), the dropout's ``seed_lo, seed_hi,
    batch0, head0, threshold, keep``, ``key_mask (Lk,)`` (the keys of the mass),
    ``qt0`` (first query tile of the launch), ``per_row (B, Hq, Lq, 5)`` (entropy,
    max, argmax, mass, zeros), ``received (B * Hq, tiles of the launch, Lk)`` (zeros
    on entry) and ``mods``.  Grid ``(B * Hq, query tiles of the launch)``.
    """
    micro = micro_functions(np.dtype(dtype), tiling, mods)
    return core_kernel(stats_kernel, micro, "stats", DROPOUT=dropout)


@device
def reduce_tile(S, F, i0, row0, j0, key0, Lq, Lk, diag, b, h, mask, has_mask, mods, lse,
                ratio, normalizer, keys, threshold, keep, key_mask, ent, mass, zeros, top,
                arg):
    """The thread's micro-tile of logits ``S`` (factors ``F``) becomes its weights, and
    its rows' partial statistics take them in."""
    for r in range(TM):
        i = i0 + row0 + r
        ii = min(i, Lq - 1)
        shift = CAST(lse[b, h, ii])
        live = i < Lq and shift == shift and shift != NINF
        rr = CAST(ratio[b, h, ii])
        log_scale = ZERO
        if live:
            log_scale = math.log(rr) - shift
            if DROPOUT:
                log_scale += math.log(keep)
        for c in range(TN):
            x = r * TN + c
            j = j0 + key0 + c
            w = ZERO
            if live and j < Lk:
                s = S[x]
                w = rr * math.exp(s - shift)
                if normalizer == RELU_EXPM1:
                    w *= F[x]
                    if F[x] > ZERO:
                        s += math.log(F[x])
                if DROPOUT:
                    if kept(keys[r], column_word(I64(j)), threshold):
                        w *= keep
                    else:
                        w = ZERO
                if w > ZERO:
                    ent[r] -= w * (s + log_scale)
                if key_mask[j]:
                    mass[r] += w
                if w == ZERO and key_allowed(ii, j, Lk, diag, b, h, mask, has_mask, mods):
                    zeros[r] += ONE
                if w > top[r]:  # keys come in increasing order: the lowest holds it
                    top[r] = w
                    arg[r] = CAST(j)
            S[x] = w


@kernel
def stats_kernel(q, k, scale, bias, has_bias, mask, has_mask, logks, has_ks, causal,
                 normalizer, lse, ratio, seed_lo, seed_hi, batch0, head0, threshold, keep,
                 key_mask, qt0, per_row, received, mods):
    Lq, Lk = q.shape[2], k.shape[2]
    b, h, g, i0 = block_tile(q.shape[1], k.shape[1], qt0)
    (Qt, KV, Pt, red, rows, flag, t, row0, key0, col0, S, F, ent, mass, zeros, top, O,
     T) = begin_tile(q[b, h], i0, scale)
    arg = cuda.local.array(TM, nt)
    keys = cuda.local.array(TM, np.int64)  # the dropout's row keys
    for r in range(TM):  # (begin_tile's online state, taken for the statistics)
        ent[r] = ZERO
        mass[r] = ZERO
        zeros[r] = ZERO
        top[r] = ZERO
        arg[r] = CAST(-1)
    if DROPOUT:
        dropout_keys(keys, seed_lo, seed_hi, batch0 + b, head0 + h, i0, row0)
    diag, last = tiles_seen(i0, BQ, Lq, Lk, BK, causal)
    nq = min(BQ, Lq - i0)
    kh = k[b, g]
    out = received[cuda.blockIdx.x, cuda.blockIdx.y]
    for tile in range(last):
        j0 = tile * BK
        nk = min(BK, Lk - j0)
        key_tile_logits(kh, j0, nk, Qt, KV, S, F, i0, row0, key0, Lq, Lk, diag, b, h, bias,
                        has_bias, mask, has_mask, logks, has_ks, normalizer, mods)
        reduce_tile(S, F, i0, row0, j0, key0, Lq, Lk, diag, b, h, mask, has_mask, mods, lse,
                    ratio, normalizer, keys, threshold if DROPOUT else 0, keep, key_mask,
                    ent, mass, zeros, top, arg)
        store_tile(S, Pt, row0, key0)
        cuda.syncthreads()
        for c in range(t, nk, cuda.blockDim.x):  # a key a thread, rows in order
            acc = ZERO
            for r in range(nq):
                acc += Pt[U32(c) * U32(BQ) + U32(r)]
            out[j0 + c] += acc
        cuda.syncthreads()  # the key tile and Pt are read
    row_reduce(red, rows, t, row0, key0, ent, ent, False)
    row_reduce(red, rows, t, row0, key0, mass, mass, False)
    row_reduce(red, rows, t, row0, key0, zeros, zeros, False)
    best = cuda.local.array(TM, nt)
    row_reduce(red, rows, t, row0, key0, top, best, True)
    for r in range(TM):  # the lowest key holding the row's largest weight
        arg[r] = -arg[r] if top[r] == best[r] and best[r] > ZERO else CAST(-Lk - 1)
    row_reduce(red, rows, t, row0, key0, arg, arg, True)
    if key0 == 0:
        for r in range(TM):
            i = i0 + row0 + r
            if i < Lq:
                per_row[b, h, i, 0] = ent[r]
                per_row[b, h, i, 1] = best[r]
                per_row[b, h, i, 2] = -arg[r] if best[r] > ZERO else CAST(-1)
                per_row[b, h, i, 3] = mass[r]
                per_row[b, h, i, 4] = zeros[r]


def attention_stats(problem, key_mask):
    """Statistics of dense attention's weights for a canonical problem; returns
    ``(per_row, received)`` as :func:`attnnb.cpu.stats.attention_stats`: float64
    ``(B, Hq, Lq, 5)`` (entropy, max, argmax, mass on ``key_mask``, zeros) and
    ``(B, Hq, Lk)``, host arrays."""
    from .attention import attention as attention_forward

    if problem.normalizer in ("sigmoid", "softpick"):  # weights this kernel does not form
        raise NotImplementedError(f"attention_stats with normalizer={problem.normalizer!r} on "
                                  "the cuda backend: not yet (attnnb.attention_stats computes "
                                  "them on the host)")
    B, Hq, _, Lq, Lk, D, _ = problem.shape
    a = device_problem(problem)
    dt = a.dtype
    # the LSE of the weights before dropout, from the same logits as the forward's
    _, lse = attention_forward(dataclasses.replace(problem, dropout_p=0.0))
    lse = np.asarray(lse.copy_to_host() if hasattr(lse, "copy_to_host") else lse, np.float64)
    with np.errstate(over="ignore"):
        ratio = np.ones(lse.shape)
        if problem.normalizer == "softmax1":  # sigmoid(lse - sink), the sink 0
            ratio = 1.0 / (1.0 + np.exp(-lse))
    per_row = np.zeros((B, Hq, Lq, 5))
    received = np.zeros((B, Hq, Lk))
    if B * Hq and Lq and Lk:
        tiling = tiling_for(dt, D, 1)
        mods = device_mods(problem)
        dropping = bool(problem.dropout_p)
        kernel = tiled_kernel(kernel_label("stats", dropping, mods),
                              lambda d_, t: build_stats(d_, t, dropping, mods), dt, tiling)
        n_qt = -(-Lq // tiling.bq)
        chunk = max(1, min(n_qt, SCRATCH_ELEMENTS // (B * Hq * Lk)))
        lse_d, ratio_d = (cuda.to_device(x.astype(dt)) for x in (lse, ratio))
        rows_d = cuda.to_device(np.zeros((B, Hq, Lq, 5), dt))
        keys_d = cuda.to_device(np.ascontiguousarray(key_mask, np.bool_))
        for qt0 in range(0, n_qt, chunk):
            tiles = min(chunk, n_qt - qt0)
            part = cuda.to_device(np.zeros((B * Hq, tiles, Lk), dt))
            kernel[(B * Hq, tiles), tiling.threads](
                a.q, a.k, dt.type(problem.scale), a.bias, a.has_bias, a.mask, a.has_mask,
                a.logks, a.has_ks, problem.causal, NORMALIZER_CODES[problem.normalizer],
                lse_d, ratio_d, *kernel_dropout(problem, dt), keys_d, qt0, rows_d, part,
                a.mods)
            received += part.copy_to_host().astype(np.float64).sum(axis=1).reshape(B, Hq, Lk)
        per_row = rows_d.copy_to_host().astype(np.float64)
    nan_rows = np.isnan(lse)
    per_row[nan_rows] = np.nan
    per_row[..., 2][nan_rows] = -1
    per_row[..., 4][nan_rows] = 0
    received[nan_rows.any(axis=2)] = np.nan
    return per_row, received


def ptx_signatures():
    """``[(name, python function, argument types, options)]`` for the PTX check."""
    from numba import types

    def argtypes(ty):
        arr4, arr3 = ty[:, :, :, ::1], ty[:, :, ::1]
        return (arr4, arr4, ty, arr4, types.boolean, types.boolean[:, :, :, ::1],
                types.boolean, ty[:, ::1], types.boolean, types.boolean, types.int64, arr3,
                arr3, types.int64, types.int64, types.int64, types.int64, types.int64, ty,
                types.boolean[::1], types.int64, arr4, arr3, types.Tuple(()))

    return ptx_cases("stats", build_stats, argtypes, 64, 1)
