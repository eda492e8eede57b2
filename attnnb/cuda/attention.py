"""Dense attention on the GPU: the register-tiled core swept over every key tile.

Grid ``(B * Hq, query tiles)``, ``tiling.threads`` threads per block, each
owning a register micro-tile of ``S`` and of ``O``; see
:mod:`attnnb.cuda._micro`.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .._core.codes import NORMALIZER_CODES, SIGMOID, SOFTPICK
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
(block_tile, begin_tile, TM, DROPOUT, dropout_keys, tiles_seen, BQ, BK, key_tile_logits,
 online_tile, scale_values, finish_tile, CAST, index) = unbound(14)


def build_dense(dtype, tiling, dropout=False, mods=None, own=None):
    """The register-tiled dense kernel for one compute dtype and :class:`Tiling`
    (not compiled yet; launch with ``tiling.threads`` threads per block), with a
    problem's mask and score functions when ``mods``
    (:class:`attnnb.cuda._mods.DeviceMods`) is given, and ``sigmoid``'s or
    ``softpick``'s code in their builds (``own``, :func:`~attnnb.cuda._micro.own_build`).

    Kernel arguments: ``q (B, Hq, Lq, D)``, ``k (B, Hk, Lk, D)``,
    ``v (B, Hk, Lk, Dv)`` of any floating dtype, ``scale`` (compute dtype),
    ``bias`` / ``mask`` (4-D, each axis full or 1) with their flags,
    ``logks (B or 1, Lk or 1)`` with its flag, ``causal``, the normalizer
    code, the dropout's ``seed_lo, seed_hi, batch0, head0, threshold, keep``
    (:func:`attnnb.cuda._dropout.kernel_dropout`; read only by the ``dropout``
    build, a kernel of its own so that the others carry none of it),
    ``out (B, Hq, Lq, Dv)``, ``lse (B, Hq, Lq)``, ``sinks`` (``(B or 1, Hq or 1)``
    sink logits of ``softmax1``: learned, or a zero) and ``mods`` (the mods' arrays,
    :func:`attnnb.cuda._mods.mods_argument`; ``()`` without).

    With ``causal`` the sweep stops at the last key tile the block's last
    query may see (causal tile skipping); the diagonal is applied per element.
    """
    micro = micro_functions(np.dtype(dtype), tiling, mods, own)
    return core_kernel(dense_attention_kernel, micro, "dense", DROPOUT=dropout)


@kernel
def dense_attention_kernel(q, k, v, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                           causal, normalizer, seed_lo, seed_hi, batch0, head0, threshold,
                           keep, out, lse, sinks, mods):
    Lq, Lk = q.shape[2], k.shape[2]
    b, h, g, i0 = block_tile(q.shape[1], k.shape[1], 0)
    (Qt, KV, Pt, red, rows, flag, t, row0, key0, col0, S, F, m, l, part, alpha, O,
     T) = begin_tile(q[b, h], i0, scale)
    keys = cuda.local.array(TM, np.int64)  # the dropout's row keys
    if DROPOUT:
        dropout_keys(keys, seed_lo, seed_hi, batch0 + b, head0 + h, i0, row0)
    diag, last = tiles_seen(i0, BQ, Lq, Lk, BK, causal)
    kh = k[b, g]
    vh = v[b, g]
    for tile in range(last):
        j0 = tile * BK
        nk = min(BK, Lk - j0)
        key_tile_logits(kh, j0, nk, Qt, KV, S, F, i0, row0, key0, Lq, Lk, diag, b, h, bias,
                        has_bias, mask, has_mask, logks, has_ks, normalizer, mods)
        online_tile(S, F, part, m, l, alpha, normalizer, vh, j0, nk, tile, KV, Pt, red,
                    rows, flag, t, row0, key0, col0, O, T, keys,
                    threshold if DROPOUT else 0)
    if DROPOUT:
        scale_values(O, keep)
    finish_tile(red, rows, t, row0, key0, col0, i0, Lq, m, l, O, part, normalizer,
                out[b, h], lse[b, h], CAST(sinks[index(b, sinks.shape[0]),
                                                 index(h, sinks.shape[1])]))


def attention(problem):
    """Run dense attention of a canonical problem on the GPU; returns ``(out, lse)``.

    Device problems return Numba device arrays in the result dtype (float16
    output for float16 inputs, LSE in float32); host problems return NumPy
    arrays in the compute dtype.
    """
    B, Hq, _, Lq, Lk, D, Dv = problem.shape
    a = device_problem(problem)
    out, lse = outputs((B, Hq, Lq, Dv), (B, Hq, Lq), a)
    if Lq and B * Hq:
        tiling = tiling_for(a.dtype, D, Dv)
        dropping = bool(problem.dropout_p)
        mods = device_mods(problem)
        own = own_build(problem.normalizer)
        kernel = tiled_kernel(kernel_label("dense", dropping, mods, own),
                              lambda dt, t: build_dense(dt, t, dropping, mods, own), a.dtype,
                              tiling)
        grid = (B * Hq, (Lq + tiling.bq - 1) // tiling.bq)
        kernel[grid, tiling.threads](a.q, a.k, a.v, a.dtype.type(problem.scale), a.bias, a.has_bias,
                         a.mask, a.has_mask, a.logks, a.has_ks, problem.causal,
                         NORMALIZER_CODES[problem.normalizer],
                         *kernel_dropout(problem, a.dtype), out, lse, a.sinks, a.mods)
    return finish(a, out, lse)


def ptx_signatures():
    """``[(name, python function, argument types, options)]`` for the PTX check: dense
    attention at D = 64 and 128, with dropout, with ALiBi and with a document mask, and
    the builds of ``sigmoid`` and ``softpick``."""
    from numba import types

    from .._mods import library as m
    from ._mods import ptx_mods

    no_mods = types.Tuple(())

    def argtypes(ty, mods_type=no_mods):
        arr4 = ty[:, :, :, ::1]
        return (arr4, arr4, arr4, ty, arr4, types.boolean, types.boolean[:, :, :, ::1],
                types.boolean, ty[:, ::1], types.boolean, types.boolean, types.int64,
                types.int64, types.int64, types.int64, types.int64, types.int64, ty, arr4,
                ty[:, :, ::1], ty[:, ::1], mods_type)

    def with_mods(**given):
        def build(dt, t):
            return build_dense(dt, t, False, ptx_mods(dt, **given)[0])

        def types_of(ty):
            return argtypes(ty, ptx_mods(np.dtype(str(ty)), **given)[1])
        return build, types_of

    ids = np.repeat(np.arange(2), 4)
    cases = [case for d in (64, 128)
             for case in ptx_cases("dense", build_dense, argtypes, d, d, variant=d != 64)]
    cases += ptx_cases("dense dropout", lambda dt, t: build_dense(dt, t, True), argtypes,
                       64, 64, variant=True)
    cases += ptx_cases("dense alibi", *with_mods(score_mod=m.alibi(np.ones(2))), 64, 64,
                       variant=True)
    cases += ptx_cases("dense document", *with_mods(mask_mod=m.document(ids)), 64, 64,
                       variant=True)
    for own in (SIGMOID, SOFTPICK):
        cases += ptx_cases(kernel_label("dense", own=own),
                           lambda dt, t, o=own: build_dense(dt, t, own=o), argtypes, 64, 64,
                           variant=True)
    return cases
