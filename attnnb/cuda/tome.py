"""Token Merging on the GPU (the ``cuda`` backend of :mod:`attnnb.tome`).

* :func:`match`: one thread per token normalises the rows of sets A and B;
  then one thread per A token sweeps the B tokens in shared-memory tiles
  (the dot products of :mod:`attnnb.cuda._tiles`' ``row_logits``) with a
  running first maximum, so no ``Ta x Tb`` matrix exists.  The edges'
  stable descending order (``O(Ta log Ta)``, small next to the
  ``O(Ta Tb C)`` similarities) is sorted on the host by
  :func:`attnnb._tome_order.descending_order` (not the oracle's own copy,
  so that comparing with ``reference`` also tests the ordering).
* :func:`merge`: a segmented reduction, one block per output token and a
  thread per channel; the members of every output token come from a
  counting sort of ``slot`` done on the host, so no two threads write the
  same element and the result does not depend on scheduling.
* :func:`unmerge`: a row gather.

The public functions of :mod:`attnnb.tome` take host arrays, so inputs are
copied in and results copied back.  Arithmetic is in the compute dtype
(float32 for float16/float32 data): the norms and merge sums too, where the
``cpu`` backend accumulates in float64.  Semantics (ties, NaN, protected
tokens) are those of :mod:`attnnb.reference.tome`.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda

from .._codes import MERGE_AMAX, MERGE_MEAN, MERGE_MODE_CODES
from .._tome_order import descending_order
from ._tiles import TILE_Q, cached_kernel, device_functions, tiles_for

ROW_THREADS = 128  # threads over the channels of one token (merge, unmerge)


def build_unit_rows(dtype):
    """Kernel: ``out[b, i] = metric[b, idx[i]] / ||.||`` and a NaN flag per row."""
    f = device_functions(dtype)
    CAST, ZERO = f.CAST, f.ZERO

    def unit_rows_kernel(metric, idx, out, nan_flags):
        b = cuda.blockIdx.y
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= idx.shape[1]:
            return
        src = metric[b, idx[0 if idx.shape[0] == 1 else b, i]]
        acc = ZERO
        for c in range(src.shape[0]):
            x = CAST(src[c])
            acc += x * x
        norm = math.sqrt(acc)
        nan = False
        for c in range(src.shape[0]):
            y = CAST(src[c]) / norm  # a zero row gives 0 / 0 = NaN, as the reference
            out[b, i, c] = y
            nan = nan or y != y
        nan_flags[b, i] = nan

    return unit_rows_kernel


def build_match(dtype, c, ta, tb):
    """Kernel: best B partner of every A token (first maximum; NaN wins; protected -inf)."""
    f = device_functions(dtype)
    nt = numba.from_dtype(np.dtype(dtype))
    NINF, NAN = f.NINF, f.NAN
    load_rows, row_logits = f.load_rows, f.row_logits

    def match_kernel(ua, ub, a_nan, b_nan, class_token, distill_token, node_max, node_idx):
        b = cuda.blockIdx.y
        Ta, Tb = ua.shape[1], ub.shape[1]
        i = cuda.blockIdx.x * ta + cuda.threadIdx.x
        valid = i < Ta
        ii = min(i, Ta - 1)
        Bs = cuda.shared.array((tb, c), nt)
        ar = cuda.local.array(c, nt)
        S = cuda.local.array(tb, nt)
        for e in range(c):
            ar[e] = ua[b, ii, e]
        skip_row = class_token and ii == 0  # the class token is never merged
        start = 1 if distill_token else 0  # nor merged into the distillation token
        best = NINF
        best_j = 0
        for j0 in range(0, Tb, tb):
            nb = min(tb, Tb - j0)
            load_rows(ub[b], j0, nb, Bs)
            cuda.syncthreads()
            if valid and not skip_row:
                row_logits(ar, Bs, nb, S)
                for jj in range(nb):
                    if j0 + jj >= start and S[jj] > best:
                        best = S[jj]
                        best_j = j0 + jj
            cuda.syncthreads()
        if not valid:
            return
        if not skip_row:  # a NaN similarity wins its row, at its first column
            if a_nan[b, i]:
                best = NAN
                best_j = start
            else:
                for j in range(start, Tb):
                    if b_nan[b, j]:
                        best = NAN
                        best_j = j
                        break
        node_max[b, i] = best
        node_idx[b, i] = best_j

    return match_kernel


def build_merge(dtype):
    """Kernel: ``out[b, o] = mean / sum / max`` of the members of output token ``o``."""
    CAST = device_functions(dtype).CAST

    def merge_kernel(x, indptr, members, mode, out):
        o = cuda.blockIdx.x
        b = cuda.blockIdx.y
        s = 0 if indptr.shape[0] == 1 else b
        start = indptr[s, o]
        stop = indptr[s, o + 1]
        for c in range(cuda.threadIdx.x, x.shape[2], cuda.blockDim.x):
            acc = CAST(x[b, members[s, start], c])
            for p in range(start + 1, stop):
                v = CAST(x[b, members[s, p], c])
                if mode == MERGE_AMAX:
                    if v > acc or v != v:
                        acc = v
                else:
                    acc += v
            if mode == MERGE_MEAN:
                acc = acc / CAST(stop - start)
            out[b, o, c] = acc

    return merge_kernel


def build_unmerge(dtype):
    """Kernel: ``out[b, p] = x[b, slot[p]]``."""

    def unmerge_kernel(x, slot, out):
        p = cuda.blockIdx.x
        b = cuda.blockIdx.y
        src = slot[0 if slot.shape[0] == 1 else b, p]
        for c in range(cuda.threadIdx.x, x.shape[2], cuda.blockDim.x):
            out[b, p, c] = x[b, src, c]

    return unmerge_kernel


def _kernel(name, build, dtype, *config):
    key = ("tome", name, np.dtype(dtype).str) + config
    return cached_kernel(key, lambda: cuda.jit(build(np.dtype(dtype), *config)))


def _unit_rows(metric_d, idx, dtype):
    B, T, C = metric_d.shape[0], idx.shape[1], metric_d.shape[2]
    out = cuda.device_array((B, T, C), dtype)
    flags = cuda.device_array((B, T), np.bool_)
    if T and B:
        kernel = _kernel("unit_rows", build_unit_rows, dtype)
        kernel[((T + ROW_THREADS - 1) // ROW_THREADS, B), ROW_THREADS](
            metric_d, cuda.to_device(np.ascontiguousarray(idx, np.int64)), out, flags)
    return out, flags


def match(metric, a_idx, b_idx, class_token, distill_token):
    """See :func:`attnnb.reference.tome.match`; computed in ``metric``'s dtype.

    Returns host arrays ``(node_max, node_idx, order)``.
    """
    dtype = np.dtype(metric.dtype)
    B, _, C = metric.shape
    Ta = a_idx.shape[1]
    metric_d = cuda.to_device(np.ascontiguousarray(metric))
    ua, a_nan = _unit_rows(metric_d, a_idx, dtype)
    ub, b_nan = _unit_rows(metric_d, b_idx, dtype)
    node_max = cuda.device_array((B, Ta), dtype)
    node_idx = cuda.device_array((B, Ta), np.int64)
    if B and Ta:
        ta, tb = tiles_for(dtype, C)
        kernel = _kernel("match", build_match, dtype, C, ta, tb)
        kernel[((Ta + ta - 1) // ta, B), ta](ua, ub, a_nan, b_nan, bool(class_token),
                                            bool(distill_token), node_max, node_idx)
    node_max = node_max.copy_to_host()
    return node_max, node_idx.copy_to_host(), descending_order(node_max)


def members_of(slot, n_out):
    """Host counting sort of ``slot`` (``(Bs, N)``, -1 = dropped): ``(indptr, members)``.

    ``members[s, indptr[s, o]:indptr[s, o + 1]]`` are the tokens of output
    ``o``, in token order.
    """
    slot = np.asarray(slot, np.int64)
    keyed = np.where(slot < 0, n_out, slot)  # dropped tokens sort last
    members = np.argsort(keyed, axis=1, kind="stable")
    counts = np.stack([np.bincount(row, minlength=n_out + 1)[:n_out] for row in keyed])
    indptr = np.zeros((slot.shape[0], n_out + 1), np.int64)
    np.cumsum(counts, axis=1, out=indptr[:, 1:])
    return indptr, members


def merge(x, slot, n_out, mode):
    """See :func:`attnnb.reference.tome.merge`; returns ``x``'s dtype (host array)."""
    dtype = np.dtype(x.dtype)
    B, _, C = x.shape
    out = cuda.device_array((B, n_out, C), dtype)
    if B and n_out and C:
        indptr, members = members_of(slot, n_out)
        kernel = _kernel("merge", build_merge, dtype)
        kernel[(n_out, B), min(ROW_THREADS, C)](
            cuda.to_device(np.ascontiguousarray(x)), cuda.to_device(indptr),
            cuda.to_device(members), MERGE_MODE_CODES[mode], out)
    return out.copy_to_host()


def unmerge(x, slot):
    """See :func:`attnnb.reference.tome.unmerge` (host arrays in and out)."""
    dtype = np.dtype(x.dtype)
    B, _, C = x.shape
    N = slot.shape[1]
    out = cuda.device_array((B, N, C), dtype)
    if B and N and C:
        kernel = _kernel("unmerge", build_unmerge, dtype)
        kernel[(N, B), min(ROW_THREADS, C)](
            cuda.to_device(np.ascontiguousarray(x)),
            cuda.to_device(np.ascontiguousarray(slot, np.int64)), out)
    return out.copy_to_host()


def ptx_signatures():
    """``[(name, python function, argument types)]`` for the PTX check, float32 and float64."""
    from numba import types

    cases = []
    for dtype in (np.float32, np.float64):
        ty = numba.from_dtype(np.dtype(dtype))
        name = np.dtype(dtype).name
        arr3, i64 = ty[:, :, ::1], types.int64[:, ::1]
        flags = types.boolean[:, ::1]
        ta, tb = TILE_Q, tiles_for(np.dtype(dtype), 64)[1]
        cases += [
            (f"tome unit_rows {name}", build_unit_rows(np.dtype(dtype)),
             (arr3, i64, arr3, flags)),
            (f"tome match {name} C=64", build_match(np.dtype(dtype), 64, ta, tb),
             (arr3, arr3, flags, flags, types.boolean, types.boolean, ty[:, ::1], i64)),
            (f"tome merge {name}", build_merge(np.dtype(dtype)),
             (arr3, i64, i64, types.int64, arr3)),
            (f"tome unmerge {name}", build_unmerge(np.dtype(dtype)), (arr3, i64, arr3)),
        ]
    return cases
