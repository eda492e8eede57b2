"""Sparse-pattern attention on the GPU: the tiled core over the pattern's tiles only.

Grid ``(B * Hq, query tiles)`` as the dense kernel, but a block visits only
the key tiles of its query tile in the pattern's block layout
(:meth:`attnnb.patterns.Pattern.blocks` with this backend's tile sizes), so
the work is proportional to the touched tiles.  Each thread masks the keys
of a tile its CSR row does not hold (a cursor that walks the row once);
full tiles skip the element mask.  Mirrors :mod:`attnnb.cpu.sparse`.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .._codes import NORMALIZER_CODES
from ._arrays import device_problem, finish, outputs
from ._tiles import cached_kernel, device_functions, tiles_for


def build_sparse(dtype, d, dv, tq, tk):
    """The sparse kernel for one compute dtype, head sizes and tile sizes.

    Kernel arguments: ``q, k, v`` as the dense kernel, ``scale``, ``logks``
    with its flag, the normalizer code, ``p_heads`` (the pattern's head
    count, 1 = shared), its CSR ``indptr`` / ``indices``, the block layout's
    ``tile_ptr`` / ``tile_idx`` / ``tile_full``, ``out`` and ``lse``.
    """
    f = device_functions(dtype)
    nt = numba.from_dtype(np.dtype(dtype))
    NINF, rows = f.NINF, f.rows
    load_rows, start_row, row_logits = f.load_rows, f.start_row, f.row_logits
    modify_row, online_row, finish_row = f.modify_row, f.online_row, f.finish_row

    @cuda.jit(device=True)
    def csr_row_mask(S, nk, j0, indices, p, end):
        """``S[c] = -inf`` unless key ``j0 + c`` is in the CSR row ``indices[p:end]``.

        ``p`` is a position in the row no later than its first key ``>= j0``;
        returns the position past the tile, so visiting a row's tiles in
        increasing order reads each stored key once.
        """
        while p < end and indices[p] < j0:
            p += 1
        for c in range(nk):
            if p < end and indices[p] == j0 + c:
                p += 1
            else:
                S[c] = NINF
        return p

    def sparse_attention_kernel(q, k, v, scale, logks, has_ks, normalizer, p_heads, indptr,
                                indices, tile_ptr, tile_idx, tile_full, out, lse):
        Lq, Lk = q.shape[2], k.shape[2]
        b, h, g, i0, i, valid, ii = rows(q.shape[1], k.shape[1], Lq, tq, 0)
        Ks = cuda.shared.array((tk, d), nt)
        Vs = cuda.shared.array((tk, dv), nt)
        qr = cuda.local.array(d, nt)
        acc = cuda.local.array(dv, nt)
        S = cuda.local.array(tk, nt)
        F = cuda.local.array(tk, nt)
        m, l = start_row(q[b, h], ii, scale, qr, acc)
        ph = h if p_heads > 1 else 0
        p = indptr[ph * Lq + ii]
        end = indptr[ph * Lq + ii + 1]
        tr = ph * ((Lq + tq - 1) // tq) + i0 // tq  # block-layout row of this query tile
        logks_row = logks[b if logks.shape[0] > 1 else 0]
        kh = k[b, g]
        vh = v[b, g]
        for s in range(tile_ptr[tr], tile_ptr[tr + 1]):
            j0 = tile_idx[s] * tk
            nk = min(tk, Lk - j0)
            load_rows(kh, j0, nk, Ks)
            load_rows(vh, j0, nk, Vs)
            cuda.syncthreads()
            if valid:
                row_logits(qr, Ks, nk, S)
                if not tile_full[s]:
                    p = csr_row_mask(S, nk, j0, indices, p, end)
                # no bias or mask here: the logks row stands in for both (never read)
                modify_row(S, F, nk, i, j0, Lk, logks_row, False, logks_row, False, logks_row,
                           has_ks, normalizer)
                m, l = online_row(S, F, nk, Vs, m, l, acc, normalizer)
            cuda.syncthreads()
        if valid:
            lse[b, h, i] = finish_row(acc, m, l, normalizer, out[b, h, i])

    return sparse_attention_kernel


def sparse_kernel(dtype, d, dv, tq, tk):
    key = ("sparse", np.dtype(dtype).str, d, dv, tq, tk)
    return cached_kernel(key, lambda: cuda.jit(build_sparse(np.dtype(dtype), d, dv, tq, tk)))


def sparse_attention(problem, pattern):
    """Attention of a canonical problem over ``pattern``; returns ``(out, lse)``.

    The pattern's CSR arrays and block layout are copied to the device on
    each call (they are host objects).  Device problems return device arrays.
    """
    B, Hq, _, Lq, _, D, Dv = problem.shape
    a = device_problem(problem)
    out, lse = outputs((B, Hq, Lq, Dv), (B, Hq, Lq), a)
    if Lq and B * Hq:
        tq, tk = tiles_for(a.dtype, D, Dv)
        layout = pattern.blocks(tq, tk)
        kernel = sparse_kernel(a.dtype, D, Dv, tq, tk)
        dev = [cuda.to_device(np.ascontiguousarray(x)) for x in (
            pattern.indptr, pattern.indices, layout.tile_ptr, layout.tile_idx,
            layout.tile_full)]
        kernel[(B * Hq, (Lq + tq - 1) // tq), tq](
            a.q, a.k, a.v, a.dtype.type(problem.scale), a.logks, a.has_ks,
            NORMALIZER_CODES[problem.normalizer], pattern.n_heads, *dev, out, lse)
    return finish(a, out, lse)


def ptx_signatures():
    """``[(name, python function, argument types)]`` for the PTX check, float32 and float64."""
    from numba import types

    cases = []
    for dtype in (np.float32, np.float64):
        ty = numba.from_dtype(np.dtype(dtype))
        arr4 = ty[:, :, :, ::1]
        args = (arr4, arr4, arr4, ty, ty[:, ::1], types.boolean, types.int64, types.int64,
                types.int64[::1], types.int32[::1], types.int64[::1], types.int32[::1],
                types.boolean[::1], arr4, ty[:, :, ::1])
        tq, tk = tiles_for(np.dtype(dtype), 64, 64)
        cases.append((f"sparse {np.dtype(dtype).name} D=64",
                      build_sparse(np.dtype(dtype), 64, 64, tq, tk), args))
    return cases
