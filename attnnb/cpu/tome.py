"""Token Merging on the ``cpu`` backend (Numba).

* :func:`match`: cosine similarity of every A token with every B token,
  swept in ``TILE_A x 64`` tiles with the attention kernels' register-blocked
  product (:func:`~attnnb.cpu._tiles.tile_logits_t`) and a running row
  maximum, so no ``Ta x Tb`` matrix exists (Stable Diffusion's 2048 x 2048
  per image included); then a stable descending sort of the row maxima
  on the host (:func:`attnnb._core.tome_order.descending_order`, as the cuda
  backend: a sort inside the kernel was much of its compile time, and
  sorting ``B x Ta`` keys is no work; docs/notes/performance.md, "ToMe's sort out of
  its kernel, and `warmup` again").
* :func:`merge`: a segmented reduction; each output token gathers its
  members from a per-batch counting sort of ``slot``, so threads never
  write to the same row and the result does not depend on scheduling.
* :func:`unmerge`: a row gather.

Semantics (ties, NaN, protected tokens) are those of
:mod:`attnnb.reference.tome`; see :mod:`attnnb.tome`.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .._core.codes import MERGE_AMAX, MERGE_MEAN, MERGE_MODE_CODES
from .._core.tome_order import descending_order
from ._jit import inner, kernel, launch, wide_vectors
from ._tiles import TILE_K, tile_logits_t

TILE_A = 256  # A rows per task
TILE_OUT = 32  # output tokens per merge task


# Not ``inner``: under the project's fastmath flags LLVM may reorder the sum of
# squares (reassoc), fuse it into FMAs (contract) and turn ``x / norm`` into
# ``x * (1 / norm)`` (arcp), which rounds a one-channel row ``x / |x|`` to
# 1 - 1 ulp where the reference gets exactly 1, and so breaks ties that the
# reference keeps.  ``fastmath=False`` must be explicit: a jitted callee that
# leaves it unset inherits its caller's flags.  Fast-math flags belong to
# instructions, so these stay strict when LLVM inlines this into the kernel.
@numba.njit(cache=True, nogil=True, forceinline=True, fastmath=False)
def _unit_row(src, dst):
    """``dst = src / sqrt(sum(src ** 2))``; True when ``dst`` holds a NaN.

    The formula and operation order of :func:`attnnb.reference.tome.cosine_rows`
    (squares summed channel by channel in float64, one square root, one true
    division per entry, no fused or reordered operations), so a float64 row
    is normalised bit for bit as the reference does.

    A zero norm gives a NaN row (``0 / 0`` in the reference; a nonzero row
    whose squares all underflow, ``|x| < 1e-154``, gives ``x / 0 = inf``
    there instead).  An Inf or NaN entry gives a NaN entry (``inf / inf``,
    ``x / nan``).  Any other entry lies in ``[-1, 1]`` (``0`` when the sum of
    squares overflows to ``inf``, as in the reference), so a similarity is
    NaN exactly when one of its two rows holds a NaN.
    """
    acc = 0.0
    for c in range(src.shape[0]):
        v = np.float64(src[c])
        acc += v * v
    norm = np.sqrt(acc)
    if norm == 0.0:
        for c in range(src.shape[0]):
            dst[c] = np.nan
        return True
    nan = False
    for c in range(src.shape[0]):
        y = np.float64(src[c]) / norm
        dst[c] = y
        nan = nan or y != y
    return nan


@inner
def _larger(s, t):
    """``s`` when ``s > t``, else ``t``: a NaN ``s`` loses, a NaN ``t`` stays."""
    return s if s > t else t


@inner
def _row_max(row, start, stop, init):
    """``max(init, row[start:stop])`` ignoring NaN, in 8 independent lanes.

    ``s > t ? s : t`` without ``nnan`` does not vectorise as one chain;
    eight chains do (docs/notes/performance.md, "Figures moved out of the code's comments").
    """
    t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = init
    j = start
    while j + 8 <= stop:
        t0, t1 = _larger(row[j], t0), _larger(row[j + 1], t1)
        t2, t3 = _larger(row[j + 2], t2), _larger(row[j + 3], t3)
        t4, t5 = _larger(row[j + 4], t4), _larger(row[j + 5], t5)
        t6, t7 = _larger(row[j + 6], t6), _larger(row[j + 7], t7)
        j += 8
    while j < stop:
        t0 = _larger(row[j], t0)
        j += 1
    # the lanes folded pairwise
    low = _larger(_larger(t3, t2), _larger(t1, t0))
    high = _larger(_larger(t7, t6), _larger(t5, t4))
    return _larger(high, low)


@inner
def _fold_tile(S, na, nb, i0, j0, skip_row0, skip_col0, node_max, node_idx):
    """Fold a tile of similarities ``S[:na, :nb]`` into the running row max/argmax.

    The first maximum wins (strict ``>`` across tiles, first equal entry
    within one).  NaN is ignored here and settled by :func:`_settle_nan`.
    """
    start = 1 if (skip_col0 and j0 == 0) else 0
    for ii in range(na):
        if skip_row0 and i0 + ii == 0:
            continue
        row = S[ii]
        best = node_max[i0 + ii]
        tmax = _row_max(row, start, nb, best)
        if tmax > best:
            for jj in range(start, nb):
                if row[jj] == tmax:
                    node_max[i0 + ii] = tmax
                    node_idx[i0 + ii] = j0 + jj
                    break


@inner
def _settle_nan(a_nan, b_nan, class_token, distill_token, node_max, node_idx):
    """Rows whose similarities include a NaN: NaN wins, at its first column (as ``torch.max``).

    Protected entries are ``-inf``, never NaN: the class token's row and,
    with a distillation token, column 0.
    """
    first = -1
    for j in range(1 if distill_token else 0, b_nan.shape[0]):
        if b_nan[j]:
            first = j
            break
    for i in range(a_nan.shape[0]):
        if class_token and i == 0:
            continue
        if a_nan[i]:
            node_max[i] = np.nan
            node_idx[i] = 1 if distill_token else 0
        elif first >= 0:
            node_max[i] = np.nan
            node_idx[i] = first


@kernel
def match_kernel(metric, a_idx, b_idx, class_token, distill_token, node_max, node_idx):
    B, _, C = metric.shape
    Ta, Tb = a_idx.shape[1], b_idx.shape[1]
    a_shared, b_shared = a_idx.shape[0] == 1, b_idx.shape[0] == 1
    # B is stored transposed in (C, TILE_K) tiles, the layout of the attention
    # kernels' keys, for the register-blocked product tile_logits_t
    tb = TILE_K
    n_bt = (Tb + tb - 1) // tb
    ua = np.empty((B, Ta, C), metric.dtype)
    ubt = np.zeros((B, n_bt, C, tb), metric.dtype)
    a_nan = np.zeros((B, Ta), np.bool_)
    b_nan = np.zeros((B, Tb), np.bool_)
    # 1. gather both sets and normalise every row
    for task in prange(B * (Ta + Tb)):
        b = task // (Ta + Tb)
        i = task % (Ta + Tb)
        if i < Ta:
            a_nan[b, i] = _unit_row(metric[b, a_idx[0 if a_shared else b, i]], ua[b, i])
        else:
            i -= Ta
            b_nan[b, i] = _unit_row(metric[b, b_idx[0 if b_shared else b, i]],
                                    ubt[b, i // tb, :, i % tb])
    # 2. running row max over B tiles; one task per (batch, A tile)
    n_at = (Ta + TILE_A - 1) // TILE_A
    for task in prange(B * n_at):
        wide_vectors()
        b = task // n_at
        i0 = (task % n_at) * TILE_A
        na = min(TILE_A, Ta - i0)
        S_flat = np.empty(TILE_A * tb, metric.dtype)
        at = ua[b][i0:i0 + na]
        mx = node_max[b]
        ix = node_idx[b]
        for ii in range(na):
            mx[i0 + ii] = -np.inf
            ix[i0 + ii] = 0
        if class_token and i0 == 0 and na == 1:
            continue
        for t in range(n_bt):
            # a whole tile even at the end: the padding columns are zeros (the fast
            # 4 x 64 blocks instead of row by row), and the fold stops at nb
            S = tile_logits_t(at, ubt[b], t * tb, tb, S_flat)
            nb = min(tb, Tb - t * tb)
            _fold_tile(S, na, nb, i0, t * tb, class_token, distill_token, mx, ix)
    # 3. NaN rows (the order of the edges is sorted on the host)
    for b in prange(B):
        _settle_nan(a_nan[b], b_nan[b], class_token, distill_token, node_max[b], node_idx[b])


def match(metric, a_idx, b_idx, class_token, distill_token):
    """See :func:`attnnb.reference.tome.match`; computed in ``metric``'s dtype."""
    B = metric.shape[0]
    Ta = a_idx.shape[1]
    node_max = np.empty((B, Ta), metric.dtype)
    node_idx = np.empty((B, Ta), np.int64)
    launch(match_kernel, metric, np.ascontiguousarray(a_idx, np.int64),
           np.ascontiguousarray(b_idx, np.int64), bool(class_token), bool(distill_token),
           node_max, node_idx)
    return node_max, node_idx, descending_order(node_max)


@kernel
def merge_kernel(x, slot, n_out, mode, out):
    B, N, C = x.shape
    Bs = slot.shape[0]
    # members of every output token, in token order (a counting sort of slot)
    indptr = np.zeros((Bs, n_out + 1), np.int64)
    members = np.empty((Bs, N), np.int64)
    for s in prange(Bs):
        ptr = indptr[s]
        for p in range(N):
            if slot[s, p] >= 0:
                ptr[slot[s, p] + 1] += 1
        for o in range(n_out):
            ptr[o + 1] += ptr[o]
        fill = ptr[:n_out].copy()
        for p in range(N):
            o = slot[s, p]
            if o >= 0:
                members[s, fill[o]] = p
                fill[o] += 1
    n_t = (n_out + TILE_OUT - 1) // TILE_OUT
    for task in prange(B * n_t):
        b = task // n_t
        s = 0 if Bs == 1 else b
        acc = np.empty(C, np.float64)
        xb = x[b]
        for o in range((task % n_t) * TILE_OUT, min(n_out, (task % n_t + 1) * TILE_OUT)):
            start, stop = indptr[s, o], indptr[s, o + 1]
            row = xb[members[s, start]]
            for c in range(C):
                acc[c] = row[c]
            for m in range(start + 1, stop):
                row = xb[members[s, m]]
                if mode == MERGE_AMAX:
                    for c in range(C):
                        v = np.float64(row[c])
                        if v > acc[c] or v != v:
                            acc[c] = v
                else:
                    for c in range(C):
                        acc[c] += row[c]
            dst = out[b, o]
            if mode == MERGE_MEAN:
                count = np.float64(stop - start)
                for c in range(C):
                    dst[c] = acc[c] / count
            else:
                for c in range(C):
                    dst[c] = acc[c]


def merge(x, slot, n_out, mode):
    """See :func:`attnnb.reference.tome.merge`; accumulates in float64, returns ``x``'s dtype."""
    out = np.empty((x.shape[0], n_out, x.shape[2]), x.dtype)
    launch(merge_kernel, x, np.ascontiguousarray(slot, np.int64), n_out, MERGE_MODE_CODES[mode],
           out)
    return out


@kernel
def unmerge_kernel(x, slot, out):
    B, N, C = out.shape
    Bs = slot.shape[0]
    for task in prange(B * N):
        b = task // N
        p = task % N
        src = x[b, slot[0 if Bs == 1 else b, p]]
        dst = out[b, p]
        for c in range(C):
            dst[c] = src[c]


def unmerge(x, slot):
    """See :func:`attnnb.reference.tome.unmerge`."""
    out = np.empty((x.shape[0], slot.shape[1], x.shape[2]), x.dtype)
    launch(unmerge_kernel, x, np.ascontiguousarray(slot, np.int64), out)
    return out
