"""Top-k attention on the GPU: two passes per query tile over the tiled core.

Pass 1 sweeps the key tiles (staged in shared memory) and stores each
thread's row of modified logits (``s + log key_size``, ``-inf`` outside the
mask / causal limit) in a global scratch row of length ``Lk``, then finds
the row's threshold by selection (ties to the lower key index).  Pass 2
sweeps the value tiles and runs the shared online softmax over the selected
keys only, reading the logits pass 1 stored, so it keeps exactly the keys
pass 1 counted.  Mirrors :mod:`attnnb.cpu.topk`.

Scratch is two ``Lk`` rows per query row in flight, never ``Lq x Lk`` per
head: the query tiles are launched in chunks so that the scratch stays
under ``SCRATCH_ELEMENTS``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .. import _selection
from .._codes import SOFTMAX
from ._arrays import device_problem, finish, outputs
from ._tiles import cached_kernel, device_functions, tiles_for

SCRATCH_ELEMENTS = 1 << 24  # per launch: 64 MiB in float32


def build_topk(dtype, d, dv, tq, tk):
    """The top-k kernel for one compute dtype, head sizes and tile sizes.

    Kernel arguments: ``q, k, v``, ``scale``, ``bias`` (a placeholder: top-k
    takes none), ``mask`` with its flag,
    ``logks`` with its flag, ``causal``, ``top_k``, ``qt0`` (first query tile
    of this launch), the scratch ``R`` and ``buf`` (``(B * Hq, rows, Lk)``),
    ``out`` and ``lse``.
    """
    f = device_functions(dtype)
    nt = numba.from_dtype(np.dtype(dtype))
    NINF = f.NINF
    PINF = np.dtype(dtype).type(np.inf)
    rows, tiles_seen, views = f.rows, f.tiles_seen, f.views
    load_rows, start_row, row_logits = f.load_rows, f.start_row, f.row_logits
    modify_row, online_row, finish_row = f.modify_row, f.online_row, f.finish_row

    # the selection rules the cpu backend compiles too (attnnb/_selection.py)
    kth_smallest = cuda.jit(device=True)(_selection.kth_smallest)
    tie_cut = cuda.jit(device=True)(_selection.tie_cut)

    @cuda.jit(device=True)
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

    def topk_attention_kernel(q, k, v, scale, bias, mask, has_mask, logks, has_ks, causal,
                              top_k, qt0, R, buf, out, lse):
        Lq, Lk = q.shape[2], k.shape[2]
        b, h, g, i0, i, valid, ii = rows(q.shape[1], k.shape[1], Lq, tq, qt0)
        Ks = cuda.shared.array((tk, d), nt)
        Vs = cuda.shared.array((tk, dv), nt)
        qr = cuda.local.array(d, nt)
        acc = cuda.local.array(dv, nt)
        S = cuda.local.array(tk, nt)
        m, l = start_row(q[b, h], ii, scale, qr, acc)
        slot = cuda.blockIdx.y * tq + cuda.threadIdx.x
        row = R[cuda.blockIdx.x, slot]
        diag, last = tiles_seen(i0, tq, Lq, Lk, tk, causal)
        bias_row, mask_row, logks_row = views(bias, mask, logks, b, h, ii)  # bias: placeholder
        kh = k[b, g]
        vh = v[b, g]
        # pass 1: every allowed key's logit, then the row's threshold
        for t in range(last):
            j0 = t * tk
            nk = min(tk, Lk - j0)
            load_rows(kh, j0, nk, Ks)
            cuda.syncthreads()
            if valid:
                row_logits(qr, Ks, nk, S)
                modify_row(S, S, nk, i, j0, diag, bias_row, False, mask_row, has_mask,
                           logks_row, has_ks, SOFTMAX)
                for c in range(nk):
                    row[j0 + c] = S[c]
            cuda.syncthreads()
        thr = NINF
        cut = -1
        if valid:
            thr, cut = row_threshold(row, min(Lk, last * tk), top_k, buf[cuda.blockIdx.x, slot])
        # pass 2: the online softmax over the selected keys
        for t in range(last):
            j0 = t * tk
            nk = min(tk, Lk - j0)
            load_rows(vh, j0, nk, Vs)
            cuda.syncthreads()
            if valid:
                for c in range(nk):
                    s = row[j0 + c]
                    keep = s > thr or s != s or (s == thr and j0 + c <= cut)
                    S[c] = s if keep else NINF
                m, l = online_row(S, S, nk, Vs, m, l, acc, SOFTMAX)
            cuda.syncthreads()
        if valid:
            lse[b, h, i] = finish_row(acc, m, l, SOFTMAX, out[b, h, i])

    return topk_attention_kernel


def topk_kernel(dtype, d, dv, tq, tk):
    key = ("topk", np.dtype(dtype).str, d, dv, tq, tk)
    return cached_kernel(key, lambda: cuda.jit(build_topk(np.dtype(dtype), d, dv, tq, tk)))


def topk_attention(problem, top_k):
    """Top-k softmax attention of a canonical problem; returns ``(out, lse)``."""
    B, Hq, _, Lq, Lk, D, Dv = problem.shape
    a = device_problem(problem)
    out, lse = outputs((B, Hq, Lq, Dv), (B, Hq, Lq), a)
    if Lq and B * Hq:
        tq, tk = tiles_for(a.dtype, D, Dv)
        kernel = topk_kernel(a.dtype, D, Dv, tq, tk)
        n_qt = (Lq + tq - 1) // tq
        chunk = max(1, min(n_qt, SCRATCH_ELEMENTS // (2 * B * Hq * tq * max(Lk, 1))))
        R = cuda.device_array((B * Hq, chunk * tq, max(Lk, 1)), a.dtype)
        buf = cuda.device_array((B * Hq, chunk * tq, max(Lk, 1)), a.dtype)
        for qt0 in range(0, n_qt, chunk):
            kernel[(B * Hq, min(chunk, n_qt - qt0)), tq](
                a.q, a.k, a.v, a.dtype.type(problem.scale), a.bias, a.mask, a.has_mask, a.logks,
                a.has_ks, problem.causal, int(top_k), qt0, R, buf, out, lse)
    return finish(a, out, lse)


def ptx_signatures():
    """``[(name, python function, argument types)]`` for the PTX check, float32 and float64."""
    from numba import types

    cases = []
    for dtype in (np.float32, np.float64):
        ty = numba.from_dtype(np.dtype(dtype))
        arr4, arr3 = ty[:, :, :, ::1], ty[:, :, ::1]
        args = (arr4, arr4, arr4, ty, arr4, types.boolean[:, :, :, ::1], types.boolean, ty[:, ::1],
                types.boolean, types.boolean, types.int64, types.int64, arr3, arr3, arr4, arr3)
        tq, tk = tiles_for(np.dtype(dtype), 64, 64)
        cases.append((f"topk {np.dtype(dtype).name} D=64",
                      build_topk(np.dtype(dtype), 64, 64, tq, tk), args))
    return cases
