"""Sparse-pattern attention on the GPU: the register-tiled core over the pattern's tiles.

Grid ``(B * Hq, query tiles)`` of register-tiled blocks as the dense kernel
(:mod:`attnnb.cuda._micro`), but a block visits only the key tiles of its
query tile in the pattern's block layout (:meth:`attnnb.patterns.Pattern.blocks`
with the kernel's tile sizes), so the work is proportional to the touched
tiles.  A partial tile's mask is staged in the weights' shared tile ``Pt``
from the CSR runs (one thread a row, with a cursor that walks the row's run
once over the sweep) and applied by each thread to its micro-tile of ``S``;
full tiles skip the element mask.  Mirrors :mod:`attnnb.cpu.sparse`.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .._core.codes import NORMALIZER_CODES
from ._arrays import device_problem, finish, outputs
from ._dropout import kernel_dropout
from ._micro import (
    core_kernel,
    kernel_label,
    micro_functions,
    own_build,
    ptx_cases,
    tiled_kernel,
    tiling_for,
)
from ._mods import device_mods
from ._tiles import kernel, unbound

# the globals the templates read, bound per build
(block_tile, begin_tile, TM, DROPOUT, dropout_keys, BQ, BK, stage_tile_mask, stage_transposed,
 ONE, tile_scores, modify_tile, apply_tile_mask, online_tile, scale_values, finish_tile, CAST,
 index) = unbound(18)


def build_sparse(dtype, tiling, dropout=False, mods=None, own=None):
    """The sparse kernel for one compute dtype and :class:`~attnnb.cuda._micro.Tiling`
    (not compiled yet; launch with ``tiling.threads`` threads per block); ``own``:
    ``sigmoid``'s or ``softpick``'s build (:func:`~attnnb.cuda._micro.own_build`).

    Kernel arguments: ``q, k, v`` as the dense kernel, ``scale``, ``bias`` with its
    flag (``sigmoid``'s offset alone: the function takes no bias of its own), ``mask``
    (a placeholder: a pattern takes none), ``logks`` with its flag,
    the normalizer code, ``p_heads`` (the pattern's head count, 1 = shared),
    its CSR ``indptr`` / ``indices``, the block layout's ``tile_ptr`` /
    ``tile_idx`` / ``tile_full``, the dropout's ``seed_lo, seed_hi, threshold,
    keep`` (read by the ``dropout`` build, as the dense kernel's), ``out``,
    ``lse``, ``sinks`` and ``mods`` (as the dense kernel's: the mask function is
    intersected with the pattern).
    """
    micro = micro_functions(np.dtype(dtype), tiling, mods, own)
    return core_kernel(sparse_attention_kernel, micro, "sparse", DROPOUT=dropout)


@kernel
def sparse_attention_kernel(q, k, v, scale, bias, has_bias, mask, logks, has_ks,
                            normalizer, p_heads, indptr, indices, tile_ptr, tile_idx,
                            tile_full, seed_lo, seed_hi, batch0, head0, threshold, keep,
                            out, lse, sinks, mods):
    Lq, Lk = q.shape[2], k.shape[2]
    b, h, g, i0 = block_tile(q.shape[1], k.shape[1], 0)
    (Qt, KV, Pt, red, rows, flag, t, row0, key0, col0, S, F, m, l, part, alpha, O,
     T) = begin_tile(q[b, h], i0, scale)
    keys = cuda.local.array(TM, np.int64)  # the dropout's row keys
    if DROPOUT:
        dropout_keys(keys, seed_lo, seed_hi, batch0 + b, head0 + h, i0, row0)
    ph = h if p_heads > 1 else 0
    i = ph * Lq + min(i0 + t, Lq - 1)  # thread t < BQ: row t's CSR cursor (past Lq: clipped)
    p = indptr[i]
    tr = ph * ((Lq + BQ - 1) // BQ) + i0 // BQ  # block-layout row of this query tile
    kh = k[b, g]
    vh = v[b, g]
    for s in range(tile_ptr[tr], tile_ptr[tr + 1]):
        j0 = tile_idx[s] * BK
        nk = min(BK, Lk - j0)
        partial = not tile_full[s]
        if partial:  # Pt is free: the last tile ended with a barrier
            p = stage_tile_mask(Pt, t, i, p, j0, indptr, indices)
        stage_transposed(kh, j0, nk, ONE, KV, BK)
        cuda.syncthreads()
        tile_scores(Qt, KV, row0, key0, S)
        modify_tile(S, F, i0, row0, j0, key0, Lq, Lk, Lk, b, h, bias, has_bias, mask,
                    False, logks, has_ks, normalizer, mods)
        if partial:  # after the score function, which may map -inf to a number
            # (Pt is rewritten after online_tile's barrier)
            apply_tile_mask(S, F, Pt, row0, key0)
        online_tile(S, F, part, m, l, alpha, normalizer, vh, j0, nk, s, KV, Pt, red,
                    rows, flag, t, row0, key0, col0, O, T, keys,
                    threshold if DROPOUT else 0)
    if DROPOUT:
        scale_values(O, keep)
    finish_tile(red, rows, t, row0, key0, col0, i0, Lq, m, l, O, part, normalizer,
                out[b, h], lse[b, h], CAST(sinks[index(b, sinks.shape[0]),
                                                 index(h, sinks.shape[1])]))


def sparse_attention(problem, pattern):
    """Attention of a canonical problem over ``pattern``; returns ``(out, lse)``.

    The pattern's CSR arrays and block layout are copied to the device on
    each call (they are host objects).  Device problems return device arrays.
    """
    B, Hq, _, Lq, _, D, Dv = problem.shape
    a = device_problem(problem)
    out, lse = outputs((B, Hq, Lq, Dv), (B, Hq, Lq), a)
    if Lq and B * Hq:
        tiling = tiling_for(a.dtype, D, Dv)
        layout = pattern.blocks(tiling.bq, tiling.bk)
        dropping = bool(problem.dropout_p)
        mods = device_mods(problem)
        own = own_build(problem.normalizer)
        kernel = tiled_kernel(kernel_label("sparse", dropping, mods, own),
                              lambda dt, t: build_sparse(dt, t, dropping, mods, own), a.dtype,
                              tiling)
        dev = [cuda.to_device(np.ascontiguousarray(x)) for x in (
            pattern.indptr, pattern.indices, layout.tile_ptr, layout.tile_idx,
            layout.tile_full)]
        kernel[(B * Hq, (Lq + tiling.bq - 1) // tiling.bq), tiling.threads](
            a.q, a.k, a.v, a.dtype.type(problem.scale), a.bias, a.has_bias, a.mask, a.logks,
            a.has_ks,
            NORMALIZER_CODES[problem.normalizer], pattern.n_heads, *dev,
            *kernel_dropout(problem, a.dtype), out, lse, a.sinks, a.mods)
    return finish(a, out, lse)


def ptx_signatures():
    """``[(name, python function, argument types, options)]`` for the PTX check."""
    from numba import types

    def argtypes(ty):
        arr4 = ty[:, :, :, ::1]
        return (arr4, arr4, arr4, ty, arr4, types.boolean, types.boolean[:, :, :, ::1],
                ty[:, ::1],
                types.boolean, types.int64, types.int64, types.int64[::1], types.int32[::1],
                types.int64[::1], types.int32[::1], types.boolean[::1], types.int64,
                types.int64, types.int64, types.int64, types.int64, ty, arr4, ty[:, :, ::1],
                ty[:, ::1], types.Tuple(()))

    return (ptx_cases("sparse", build_sparse, argtypes, 64, 64)
            + ptx_cases("sparse dropout", lambda dt, t: build_sparse(dt, t, True), argtypes,
                        64, 64, variant=True))
