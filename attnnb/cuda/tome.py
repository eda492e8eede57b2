"""Token Merging on the GPU (the ``cuda`` backend of :mod:`attnnb.tome`).

* :func:`match`: one thread per token normalises the rows of sets A and B;
  then one thread per A token sweeps the B tokens in shared-memory tiles
  (the dot products of :mod:`attnnb.cuda._tiles`' ``row_logits``) with a
  running first maximum, so no ``Ta x Tb`` matrix exists.  The edges'
  stable descending order (``O(Ta log Ta)``, small next to the
  ``O(Ta Tb C)`` similarities) is sorted on the host by
  :func:`attnnb._core.tome_order.descending_order` (not the oracle's own copy,
  so that comparing with ``reference`` also tests the ordering).
* :func:`merge`: a segmented reduction, one block per output token and a
  thread per channel; the members of every output token come from a
  counting sort of ``slot`` done on the host, so no two threads write the
  same element and the result does not depend on scheduling.
* :func:`unmerge`: a row gather.

* :func:`merge_wavg`: ToMe's size-weighted average, ``sum(size x) /
  sum(size)`` per output token, and the summed sizes, in one kernel (for
  device arrays; host arrays go through two merges in :mod:`attnnb.tome`).

Host arrays are copied in and results copied back.  Device arrays (Numba,
CuPy, PyTorch: anything with ``__cuda_array_interface__``) are read in
place and results stay on the device as Numba device arrays, in the input's
dtype (float16 in, float16 out); the matching's indices (small) are host
arrays either way.  Arithmetic is in the compute dtype (float32 for
float16/float32 data): the norms and merge sums too, where the ``cpu``
backend accumulates in float64.  Semantics (ties, NaN, protected
tokens) are those of :mod:`attnnb.reference.tome`.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda

from .._core.codes import MERGE_AMAX, MERGE_MEAN, MERGE_MODE_CODES
from .._core.tome_order import descending_order
from .._front.checks import is_device_array
from .._front.device import device_view
from .._front.validate import compute_dtypes
from ._tiles import (
    TILE_Q,
    cached_kernel,
    dtype_kernel,
    kernel,
    tiles_for,
    unbound,
)

ROW_THREADS = 128  # threads over the channels of one token (merge, unmerge)


# the globals the kernels' templates read, bound per build (dtype_kernel)
CAST, ZERO, NINF, NAN, nt, C, TA, TB, load_rows, row_logits = unbound(10)


def build_unit_rows(dtype):
    """Kernel: ``out[b, i] = metric[b, idx[i]] / ||.||`` and a NaN flag per row."""
    return dtype_kernel(unit_rows_kernel, dtype, "unit_rows")


@kernel
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


def build_match(dtype, c, ta, tb):
    """Kernel: best B partner of every A token (first maximum; NaN wins; protected -inf);
    ``c`` channels, ``ta`` A tokens a block, ``tb`` B tokens a shared tile."""
    return dtype_kernel(match_kernel, dtype, "match", C=c, TA=ta, TB=tb,
                        nt=numba.from_dtype(np.dtype(dtype)))


@kernel
def match_kernel(ua, ub, a_nan, b_nan, class_token, distill_token, node_max, node_idx):
    b = cuda.blockIdx.y
    Ta, Tb = ua.shape[1], ub.shape[1]
    i = cuda.blockIdx.x * TA + cuda.threadIdx.x
    valid = i < Ta
    ii = min(i, Ta - 1)
    Bs = cuda.shared.array((TB, C), nt)
    ar = cuda.local.array(C, nt)
    S = cuda.local.array(TB, nt)
    for e in range(C):
        ar[e] = ua[b, ii, e]
    skip_row = class_token and ii == 0  # the class token is never merged
    start = 1 if distill_token else 0  # nor merged into the distillation token
    best = NINF
    best_j = 0
    for j0 in range(0, Tb, TB):
        nb = min(TB, Tb - j0)
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


def build_merge(dtype):
    """Kernel: ``out[b, o] = mean / sum / max`` of the members of output token ``o``."""
    return dtype_kernel(merge_kernel, dtype, "merge")


@kernel
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


def build_merge_wavg(dtype):
    """Kernel: ``out[b, o] = sum(size x) / sum(size)`` over the members of output token
    ``o``, and ``size_out[b, o, 0] = sum(size)`` (thread 0 of the block)."""
    return dtype_kernel(merge_wavg_kernel, dtype, "merge_wavg")


@kernel
def merge_wavg_kernel(x, size, indptr, members, out, size_out):
    o = cuda.blockIdx.x
    b = cuda.blockIdx.y
    s = 0 if indptr.shape[0] == 1 else b
    start = indptr[s, o]
    stop = indptr[s, o + 1]
    total = CAST(0)
    for p in range(start, stop):
        total += CAST(size[b, members[s, p], 0])
    if cuda.threadIdx.x == 0:
        size_out[b, o, 0] = total
    for c in range(cuda.threadIdx.x, x.shape[2], cuda.blockDim.x):
        acc = CAST(0)
        for p in range(start, stop):
            m = members[s, p]
            acc += CAST(x[b, m, c]) * CAST(size[b, m, 0])
        out[b, o, c] = acc / total


def build_unmerge(dtype):
    """Kernel: ``out[b, p] = x[b, slot[p]]`` (the same for every dtype)."""
    return unmerge_kernel


@kernel
def unmerge_kernel(x, slot, out):
    p = cuda.blockIdx.x
    b = cuda.blockIdx.y
    src = slot[0 if slot.shape[0] == 1 else b, p]
    for c in range(cuda.threadIdx.x, x.shape[2], cuda.blockDim.x):
        out[b, p, c] = x[b, src, c]


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


def _device_in(x):
    """``(device array, compute dtype, on_device)``: a device input as it is, a host one
    copied over (C-contiguous)."""
    if is_device_array(x):
        x = device_view(x, need_reshape=False)
        return x, compute_dtypes(np.dtype(x.dtype))[0], True
    x = np.ascontiguousarray(x)
    return cuda.to_device(x), np.dtype(x.dtype), False


def _out(arrays, on_device):
    return arrays if on_device else tuple(a.copy_to_host() for a in arrays)


def match(metric, a_idx, b_idx, class_token, distill_token):
    """See :func:`attnnb.reference.tome.match`; computed in ``metric``'s compute dtype.

    ``metric`` may be a device array (read in place).  Returns host arrays
    ``(node_max, node_idx, order)``.
    """
    metric_d, dtype, _ = _device_in(metric)
    B, _, C = metric_d.shape
    Ta = a_idx.shape[1]
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
    """See :func:`attnnb.reference.tome.merge`.

    Host ``x``: a host array in ``x``'s dtype; device ``x`` (read in place):
    a device array in ``x``'s dtype.
    """
    x_d, dtype, on_device = _device_in(x)
    B, _, C = x_d.shape
    out = cuda.device_array((B, n_out, C), np.dtype(x_d.dtype))
    if B and n_out and C:
        indptr, members = members_of(slot, n_out)
        kernel = _kernel("merge", build_merge, dtype)
        kernel[(n_out, B), min(ROW_THREADS, C)](
            x_d, cuda.to_device(indptr), cuda.to_device(members), MERGE_MODE_CODES[mode], out)
    return _out((out,), on_device)[0]


def merge_wavg(x, size, slot, n_out):
    """ToMe's ``merge_wavg`` on the device: ``(sum(size x) / sum(size), sum(size))`` per
    output token; ``x (B, N, C)``, ``size (B, N, 1)``; device arrays in (read in place)
    and out, in ``x``'s and ``size``'s dtypes."""
    x_d, dtype, _ = _device_in(x)
    size_d = _device_in(size)[0]
    B, _, C = x_d.shape
    out = cuda.device_array((B, n_out, C), np.dtype(x_d.dtype))
    size_out = cuda.device_array((B, n_out, 1), np.dtype(size_d.dtype))
    if B and n_out:
        indptr, members = members_of(slot, n_out)
        kernel = _kernel("merge_wavg", build_merge_wavg, dtype)
        kernel[(n_out, B), max(1, min(ROW_THREADS, C))](
            x_d, size_d, cuda.to_device(indptr), cuda.to_device(members), out, size_out)
    return out, size_out


def unmerge(x, slot):
    """See :func:`attnnb.reference.tome.unmerge`; host or device ``x``, as :func:`merge`."""
    x_d, dtype, on_device = _device_in(x)
    B, _, C = x_d.shape
    N = slot.shape[1]
    out = cuda.device_array((B, N, C), np.dtype(x_d.dtype))
    if B and N and C:
        kernel = _kernel("unmerge", build_unmerge, dtype)
        kernel[(N, B), min(ROW_THREADS, C)](
            x_d, cuda.to_device(np.ascontiguousarray(slot, np.int64)), out)
    return _out((out,), on_device)[0]


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
            (f"tome merge_wavg {name}", build_merge_wavg(np.dtype(dtype)),
             (arr3, arr3, i64, i64, arr3, arr3)),
        ]
    return cases
