"""Dense attention on the GPU: the tiled core swept over every key tile.

Grid ``(B * Hq, query tiles)``, one thread per query row; see
:mod:`attnnb.cuda._tiles` for the shared per-row device functions.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .._codes import NORMALIZER_CODES
from ._arrays import device_problem, finish, outputs
from ._tiles import cached_kernel, device_functions, tiles_for


def build_dense(dtype, d, dv, tq, tk):
    """The dense kernel for one compute dtype, head sizes and tile sizes (not compiled yet).

    Kernel arguments: ``q (B, Hq, Lq, D)``, ``k (B, Hk, Lk, D)``,
    ``v (B, Hk, Lk, Dv)`` of any floating dtype, ``scale`` (compute dtype),
    ``bias`` / ``mask`` (4-D, each axis full or 1) with their flags,
    ``logks (B or 1, Lk or 1)`` with its flag, ``causal``, the normalizer
    code, ``out (B, Hq, Lq, Dv)`` and ``lse (B, Hq, Lq)``.

    With ``causal`` the sweep stops at the last key tile the block's last
    query may see (causal tile skipping); the diagonal is applied per element.
    """
    f = device_functions(dtype)
    nt = numba.from_dtype(np.dtype(dtype))
    rows, tiles_seen, views = f.rows, f.tiles_seen, f.views
    load_rows, start_row, row_logits = f.load_rows, f.start_row, f.row_logits
    modify_row, online_row, finish_row = f.modify_row, f.online_row, f.finish_row

    def dense_attention_kernel(q, k, v, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                               causal, normalizer, out, lse):
        Lq, Lk = q.shape[2], k.shape[2]
        b, h, g, i0, i, valid, ii = rows(q.shape[1], k.shape[1], Lq, tq, 0)
        Ks = cuda.shared.array((tk, d), nt)
        Vs = cuda.shared.array((tk, dv), nt)
        qr = cuda.local.array(d, nt)
        acc = cuda.local.array(dv, nt)
        S = cuda.local.array(tk, nt)
        F = cuda.local.array(tk, nt)
        m, l = start_row(q[b, h], ii, scale, qr, acc)
        diag, last = tiles_seen(i0, tq, Lq, Lk, tk, causal)
        bias_row, mask_row, logks_row = views(bias, mask, logks, b, h, ii)
        kh = k[b, g]
        vh = v[b, g]
        for t in range(last):
            j0 = t * tk
            nk = min(tk, Lk - j0)
            load_rows(kh, j0, nk, Ks)
            load_rows(vh, j0, nk, Vs)
            cuda.syncthreads()
            if valid:
                row_logits(qr, Ks, nk, S)
                modify_row(S, F, nk, i, j0, diag, bias_row, has_bias, mask_row, has_mask,
                           logks_row, has_ks, normalizer)
                m, l = online_row(S, F, nk, Vs, m, l, acc, normalizer)
            cuda.syncthreads()
        if valid:
            lse[b, h, i] = finish_row(acc, m, l, normalizer, out[b, h, i])

    return dense_attention_kernel


def dense_kernel(dtype, d, dv, tq, tk):
    """The compiled-on-first-launch dense kernel (cached per configuration)."""
    key = ("dense", np.dtype(dtype).str, d, dv, tq, tk)
    return cached_kernel(key, lambda: cuda.jit(build_dense(np.dtype(dtype), d, dv, tq, tk)))


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
        tq, tk = tiles_for(a.dtype, D, Dv)
        kernel = dense_kernel(a.dtype, D, Dv, tq, tk)
        grid = (B * Hq, (Lq + tq - 1) // tq)
        kernel[grid, tq](a.q, a.k, a.v, a.dtype.type(problem.scale), a.bias, a.has_bias,
                         a.mask, a.has_mask, a.logks, a.has_ks, problem.causal,
                         NORMALIZER_CODES[problem.normalizer], out, lse)
    return finish(a, out, lse)


def ptx_signatures():
    """``[(name, python function, argument types)]`` for the PTX check, float32 and float64."""
    from numba import types

    cases = []
    for dtype in (np.float32, np.float64):
        ty = numba.from_dtype(np.dtype(dtype))
        arr4, arr2 = ty[:, :, :, ::1], ty[:, ::1]
        args = (arr4, arr4, arr4, ty, arr4, types.boolean, types.boolean[:, :, :, ::1],
                types.boolean, arr2, types.boolean, types.boolean, types.int64, arr4,
                ty[:, :, ::1])
        for d, dv in ((64, 64), (128, 128)):
            tq, tk = tiles_for(np.dtype(dtype), d, dv)
            cases.append((f"dense {np.dtype(dtype).name} D={d}",
                          build_dense(np.dtype(dtype), d, dv, tq, tk), args))
    return cases
