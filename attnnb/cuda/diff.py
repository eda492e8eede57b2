"""Differential attention on the GPU: two score streams over the same K/V tiles.

Grid ``(B * H, query tiles)``, one thread per query row of head pair ``h``.
The block stages both components' key tiles (``k[2g]``, ``k[2g+1]``) and the
pair's value tile in shared memory once per tile.  ``mode="difference"``
runs the shared online update of :mod:`attnnb.cuda._tiles` on both streams
and writes ``o1 - lam * o2``.  ``mode="rectified"`` must know both maps'
normalisers before it can clip ``A1 - lam * A2``: pass 1 runs the same
online update with no values (only the LSEs), pass 2 recomputes the logits
and accumulates ``max(0, A1 - lam * A2) @ v``.  Mirrors
:mod:`attnnb.cpu.diff`.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .._codes import DIFF_MODE_CODES, RECTIFIED, SOFTMAX
from ._arrays import device_problem, finish
from ._tiles import cached_kernel, device_functions, tiles_for


def build_diff(dtype, d, dv, tq, tk):
    """The differential kernel for one compute dtype, head sizes and tile sizes.

    Kernel arguments: ``q (B, 2H, Lq, d)``, ``k (B, 2Hk, Lk, d)``,
    ``v (B, Hk, Lk, Dv)``, ``lam (B, H, Lq)``, ``scale``, ``bias`` / ``mask``
    (4-D over pairs, each axis full or 1) with flags, ``logks`` with its flag,
    ``causal``, the mode code and ``out (B, H, Lq, Dv)``.
    """
    f = device_functions(dtype)
    nt = numba.from_dtype(np.dtype(dtype))
    CAST, NAN = f.CAST, f.NAN
    rows, tiles_seen, views = f.rows, f.tiles_seen, f.views
    load_rows, start_row = f.load_rows, f.start_row
    row_logits, modify_row, online_row = f.row_logits, f.modify_row, f.online_row
    map_lse, rectified_row, add_weighted_row = f.map_lse, f.rectified_row, f.add_weighted_row
    finish_row = f.finish_row

    @cuda.jit(device=True)
    def pair_logits(q1, q2, K1s, K2s, nk, S1, S2, i, j0, diag, bias_row, has_bias, mask_row,
                    has_mask, logks_row, has_ks):
        """Both components' modified logits for one key tile (``-inf`` outside the set)."""
        row_logits(q1, K1s, nk, S1)
        modify_row(S1, S1, nk, i, j0, diag, bias_row, has_bias, mask_row, has_mask,
                   logks_row, has_ks, SOFTMAX)
        row_logits(q2, K2s, nk, S2)
        modify_row(S2, S2, nk, i, j0, diag, bias_row, has_bias, mask_row, has_mask,
                   logks_row, has_ks, SOFTMAX)

    def diff_attention_kernel(q, k, v, lam, scale, bias, has_bias, mask, has_mask, logks,
                              has_ks, causal, mode, out):
        Lq, Lk = q.shape[2], k.shape[2]
        b, h, g, i0, i, valid, ii = rows(q.shape[1] // 2, k.shape[1] // 2, Lq, tq, 0)
        K1s = cuda.shared.array((tk, d), nt)
        K2s = cuda.shared.array((tk, d), nt)
        Vs = cuda.shared.array((tk, dv), nt)
        q1 = cuda.local.array(d, nt)
        q2 = cuda.local.array(d, nt)
        acc1 = cuda.local.array(dv, nt)
        acc2 = cuda.local.array(dv, nt)
        S1 = cuda.local.array(tk, nt)
        S2 = cuda.local.array(tk, nt)
        m1, l1 = start_row(q[b, 2 * h], ii, scale, q1, acc1)
        m2, l2 = start_row(q[b, 2 * h + 1], ii, scale, q2, acc2)
        lam_i = CAST(lam[b, h, ii])
        diag, last = tiles_seen(i0, tq, Lq, Lk, tk, causal)
        bias_row, mask_row, logks_row = views(bias, mask, logks, b, h, ii)
        k1h = k[b, 2 * g]
        k2h = k[b, 2 * g + 1]
        vh = v[b, g]
        rectified = mode == RECTIFIED
        # pass 1: both online sweeps (rectified: LSEs only, the values wait for pass 2)
        for t in range(last):
            j0 = t * tk
            nk = min(tk, Lk - j0)
            load_rows(k1h, j0, nk, K1s)
            load_rows(k2h, j0, nk, K2s)
            if not rectified:
                load_rows(vh, j0, nk, Vs)
            cuda.syncthreads()
            if valid:
                pair_logits(q1, q2, K1s, K2s, nk, S1, S2, i, j0, diag, bias_row, has_bias,
                            mask_row, has_mask, logks_row, has_ks)
                width = 0 if rectified else dv
                m1, l1 = online_row(S1, S1, nk, Vs, m1, l1, acc1[:width], SOFTMAX)
                m2, l2 = online_row(S2, S2, nk, Vs, m2, l2, acc2[:width], SOFTMAX)
            cuda.syncthreads()
        if not rectified:
            if valid:
                finish_row(acc1, m1, l1, SOFTMAX, acc1)
                finish_row(acc2, m2, l2, SOFTMAX, acc2)
                for e in range(dv):  # empty rows of map 2 are zeros, and lam is finite
                    out[b, h, i, e] = acc1[e] - lam_i * acc2[e]
            return
        lse1 = map_lse(m1, l1)
        lse2 = map_lse(m2, l2)
        spoiled = lse1 != lse1 or lse2 != lse2
        # pass 2: the clipped difference of the two normalised maps, times the values
        for t in range(last):
            j0 = t * tk
            nk = min(tk, Lk - j0)
            load_rows(k1h, j0, nk, K1s)
            load_rows(k2h, j0, nk, K2s)
            load_rows(vh, j0, nk, Vs)
            cuda.syncthreads()
            if valid and not spoiled:
                pair_logits(q1, q2, K1s, K2s, nk, S1, S2, i, j0, diag, bias_row, has_bias,
                            mask_row, has_mask, logks_row, has_ks)
                rectified_row(S1, S2, nk, lse1, lse2, lam_i)
                add_weighted_row(S1, nk, Vs, acc1)
            cuda.syncthreads()
        if valid:
            for e in range(dv):
                out[b, h, i, e] = NAN if spoiled else acc1[e]

    return diff_attention_kernel


def diff_kernel(dtype, d, dv, tq, tk):
    key = ("diff", np.dtype(dtype).str, d, dv, tq, tk)
    return cached_kernel(key, lambda: cuda.jit(build_diff(np.dtype(dtype), d, dv, tq, tk)))


def diff_attention(problem, lam, mode="difference"):
    """Differential attention of a canonical problem (built with ``head_pairs=True``).

    Parameters
    ----------
    problem : :class:`~attnnb._validate.Problem`
        ``q (B, 2H, Lq, d)``, ``k (B, 2Hk, Lk, d)``, ``v (B, Hk, Lk, Dv)``.
    lam : ``(B, H, Lq)`` host array (copied to the device), finite.
    mode : ``"difference"`` or ``"rectified"``

    Returns
    -------
    out : ``(B, H, Lq, Dv)``: a device array in the result dtype for device
    problems, else a NumPy array in the compute dtype.
    """
    B, H2, _, Lq, _, D, Dv = problem.shape
    H = H2 // 2
    a = device_problem(problem)
    out = cuda.device_array((B, H, Lq, Dv), a.out_dtype)
    if Lq and B * H:
        tq, tk = tiles_for(a.dtype, D, D, Dv)
        kernel = diff_kernel(a.dtype, D, Dv, tq, tk)
        lam_d = lam if hasattr(lam, "copy_to_host") else cuda.to_device(
            np.ascontiguousarray(lam))
        kernel[(B * H, (Lq + tq - 1) // tq), tq](
            a.q, a.k, a.v, lam_d, a.dtype.type(problem.scale), a.bias, a.has_bias, a.mask,
            a.has_mask, a.logks, a.has_ks, problem.causal, DIFF_MODE_CODES[mode], out)
    return finish(a, out)[0]


def ptx_signatures():
    """``[(name, python function, argument types)]`` for the PTX check, float32 and float64."""
    from numba import types

    cases = []
    for dtype in (np.float32, np.float64):
        ty = numba.from_dtype(np.dtype(dtype))
        arr4 = ty[:, :, :, ::1]
        args = (arr4, arr4, arr4, ty[:, :, ::1], ty, arr4, types.boolean,
                types.boolean[:, :, :, ::1], types.boolean, ty[:, ::1], types.boolean,
                types.boolean, types.int64, arr4)
        d, dv = 64, 128
        tq, tk = tiles_for(np.dtype(dtype), d, d, dv)
        cases.append((f"diff {np.dtype(dtype).name} d={d}",
                      build_diff(np.dtype(dtype), d, dv, tq, tk), args))
    return cases
