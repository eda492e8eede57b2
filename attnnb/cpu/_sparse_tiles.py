"""Shared inner loops of the sparse and top-k CPU kernels.

These extend :mod:`attnnb.cpu._tiles` (which they do not change) with the
two element-level selections that dense attention does not need:

* :func:`csr_tile_mask`  -- mask one partial tile of a sparse pattern from
  its CSR rows (keys outside the rows' allowed lists become ``-inf``);
* :func:`row_threshold` and :func:`select_tile` -- top-k: find a row's
  threshold (the ``top_k``-th largest modified logit and, among keys equal
  to it, the last index kept so that ties go to the lower key index), then
  mask a tile down to exactly the selected keys;
* :func:`gather_selected` -- top-k's second pass when few keys are kept:
  the softmax over each row's selected keys, reading only their values.

Masked entries are set to ``-inf`` *before* :func:`~attnnb.cpu._tiles.modify_logits`
and :func:`~attnnb.cpu._tiles.online_update` run, which treat ``-inf`` as
"not allowed" for every normalizer.
"""

from __future__ import annotations

import math

import numpy as np

from .. import _selection
from ._exp import maxnum
from ._jit import inner


@inner
def csr_tile_mask(S, indptr, indices, row0, j0, cursor):
    """Set ``S[r, c] = -inf`` unless key ``j0 + c`` is in CSR row ``row0 + r``.

    ``S`` is the ``(nq, nk)`` tile of keys ``j0 .. j0 + nk - 1``.  ``cursor[r]``
    is a position in row ``row0 + r`` no later than its first key ``>= j0``;
    it is advanced past the tile, so visiting a row's tiles in increasing
    order reads each stored key at most once.

    Only the gaps between allowed keys are written.  A row whose keys in the
    tile form one run (every row of a sliding window, of BigBird's and
    Longformer's bands) is found in O(log nk) -- a binary search for the
    run's end and one comparison -- and masked with two vectorised fills;
    the general case walks its keys once.
    """
    nq, nk = S.shape
    j1 = j0 + nk
    ninf = -np.inf
    for r in range(nq):
        p = cursor[r]
        end = indptr[row0 + r + 1]
        while p < end and indices[p] < j0:
            p += 1
        # the row's keys in this tile are indices[p:stop]: at most nk of them
        stop = p + np.searchsorted(indices[p : min(end, p + nk)], j1)
        cursor[r] = stop
        row = S[r]
        n_in = stop - p
        if n_in == nk:
            continue
        if n_in == 0:
            row[:] = ninf
            continue
        first, last = indices[p] - j0, indices[stop - 1] - j0
        if last - first == n_in - 1:  # one run of consecutive keys
            row[:first] = ninf
            row[last + 1 :] = ninf
            continue
        c = 0
        for x in range(p, stop):
            a = indices[x] - j0
            for y in range(c, a):
                row[y] = ninf
            c = a + 1
        row[c:] = ninf


# the selection rules shared with the cuda backend (attnnb/_selection.py)
kth_smallest = inner(_selection.kth_smallest)
tie_cut = inner(_selection.tie_cut)


# Keys per group in the top-k threshold's first pass.
GROUP = 16


@inner
def group_bound(row, n, top_k, buf):
    """A lower bound of the ``top_k``-th largest of ``row[:n]``, or ``-inf``.

    Splits the first ``GROUP * m`` keys (``m = n // GROUP``) into ``m`` groups
    ``{c, c + m, c + 2m, ...}`` and returns the ``top_k``-th largest of the
    groups' maxima: those ``top_k`` maxima are ``top_k`` distinct keys at or
    above it, so the row's ``top_k``-th largest is too.  Strided groups make
    the maxima an element-wise max of ``GROUP`` contiguous runs (vectorised);
    the selection then touches ``m`` values.  ``-inf`` (no bound) when
    ``m < top_k``.  NaN is ignored here (LLVM's ``maxnum``); :func:`row_threshold`
    checks for it first.  ``buf`` is scratch of ``m`` values.
    """
    m = n // GROUP
    if m < top_k or top_k == 0:
        return -np.inf
    buf[:m] = row[:m]
    for i in range(1, GROUP):
        o = i * m
        for c in range(m):
            buf[c] = maxnum(buf[c], row[o + c])
    return kth_smallest(buf, m, m - top_k)


@inner
def row_threshold(row, n, top_k, buf):
    """Top-k threshold of one row of ``n`` modified logits (``-inf`` = not allowed).

    Returns ``(thr, cut)``: key ``j`` is selected when ``row[j] > thr``, or
    ``row[j] == thr and j <= cut``, or ``row[j]`` is NaN -- exactly ``top_k``
    keys when more than ``top_k`` are allowed, ties to the lower index.
    With at most ``top_k`` allowed keys every one is kept (``thr = -inf``,
    ``cut = -1``); ``top_k = 0`` keeps nothing; a row holding a NaN keeps
    everything (``cut = n``) so that the NaN propagates.  ``buf`` is scratch
    of at least ``n`` values.

    :func:`group_bound` gives a lower bound of the answer; one branch-free
    pass keeps the allowed values at or above it (usually a small multiple
    of ``top_k``) and a quickselect among those finds the threshold.
    Measured at ``n = 2048, top_k = 64``: about 10 cycles a key, most of it
    in the two quickselects' mispredicted branches (a heap of the ``top_k``
    largest, branching on every key, took 11).
    """
    ninf = -np.inf
    nans = 0
    for j in range(n):
        nans += row[j] != row[j]
    if nans:
        return ninf, n
    if top_k == 0:
        return np.inf, -1
    lower = group_bound(row, n, top_k, buf)
    cnt = 0
    for j in range(n):  # compaction without a branch: store always, advance when kept
        x = row[j]
        buf[cnt] = x
        cnt += (x >= lower) & (x > ninf)
    if lower == ninf and cnt <= top_k:  # cnt counts every allowed key: keep them all
        return ninf, -1
    thr = kth_smallest(buf, cnt, cnt - top_k)  # with a bound, cnt >= top_k by construction
    return thr, tie_cut(row, n, top_k, thr)


@inner
def select_tile(R, j0, nk, thr, cut, S):
    """Copy keys ``j0 .. j0 + nk - 1`` of the logit rows ``R`` into ``S``, ``-inf``
    where :func:`row_threshold`'s ``(thr, cut)`` does not select them."""
    nq = S.shape[0]
    ninf = -np.inf
    for r in range(nq):
        t = thr[r]
        c = cut[r] - j0
        src = R[r, j0 : j0 + nk]
        dst = S[r]
        for x in range(nk):  # branch-free, so that it vectorises
            s = src[x]
            keep = (s > t) | (s != s) | ((s == t) & (x <= c))
            dst[x] = s if keep else ninf


@inner
def gather_selected(R, n, thr, cut, vh, sel, m, l, acc):
    """Softmax of each row of ``R[:, :n]`` over the keys :func:`row_threshold` selected.

    Sets the task's state for :func:`~attnnb.cpu._tiles.finish_rows`: ``m[r]``
    (the row's largest selected logit; ``-inf`` when none, NaN for a row
    holding a NaN, i.e. ``cut[r] == n``), ``l[r] = sum exp(s - m)`` and
    ``acc[r] = sum exp(s - m) * vh[j]`` over the selected ``j``.  Reads one
    value row per selected key, so it costs ``O(n + top_k * Dv)`` per row
    against the tiled sweep's ``O(n * Dv)``.  Zero weights (underflow) skip
    their value, as the tiled sweep does for a non-finite value tile.
    ``sel`` is integer scratch of at least ``n``; ``acc`` starts at zero.
    """
    nq = R.shape[0]
    dv = acc.shape[1]
    for r in range(nq):
        t = thr[r]
        c = cut[r]
        if c >= n:  # a NaN logit: the row is NaN
            m[r] = np.nan
            continue
        row = R[r]
        cnt = 0
        mx = -np.inf
        for j in range(n):
            s = row[j]
            if s > t or (s == t and j <= c):
                sel[cnt] = j
                cnt += 1
                mx = max(mx, s)
        m[r] = mx
        if mx == -np.inf:  # nothing selected (top_k = 0, or no allowed key)
            continue
        total = 0.0
        a = acc[r]
        for x in range(cnt):
            j = sel[x]
            p = math.exp(row[j] - mx)
            total += p
            if p != 0.0:
                vj = vh[j]
                for d in range(dv):
                    a[d] += p * vj[d]
        l[r] = total
