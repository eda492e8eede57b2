"""Shared inner loops of the sparse and top-k CPU kernels.

These extend :mod:`attnnb.cpu._tiles` (which they do not change) with the
two element-level selections that dense attention does not need:

* :func:`csr_tile_mask`  -- mask one partial tile of a sparse pattern from
  its CSR rows (keys outside the rows' allowed lists become ``-inf``);
* :func:`row_threshold` and :func:`select_tile` -- top-k: find a row's
  threshold (the ``top_k``-th largest modified logit and, among keys equal
  to it, the last index kept so that ties go to the lower key index), then
  mask a tile down to exactly the selected keys.

Masked entries are set to ``-inf`` *before* :func:`~attnnb.cpu._tiles.modify_logits`
and :func:`~attnnb.cpu._tiles.online_update` run, which treat ``-inf`` as
"not allowed" for every normalizer.
"""

from __future__ import annotations

import numpy as np

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


@inner
def kth_smallest(a, n, k):
    """The ``k``-th smallest (0-based) of ``a[:n]`` (no NaN), reordering ``a[:n]`` in place.

    Quickselect with a median-of-three pivot and Hoare partitioning (which
    also keeps runs of equal values cheap): expected O(n).
    """
    lo = 0
    hi = n - 1
    while hi > lo:
        mid = (lo + hi) // 2
        x, y, z = a[lo], a[mid], a[hi]
        pivot = max(min(x, y), min(max(x, y), z))
        i = lo
        j = hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while a[j] > pivot:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            return a[k]
    return a[k]


@inner
def _sift_down(h, n, i):
    """Restore the min-heap property of ``h[:n]`` below position ``i``."""
    x = h[i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and h[c + 1] < h[c]:
            c += 1
        if h[c] >= x:
            break
        h[i] = h[c]
        i = c
    h[i] = x


@inner
def kth_largest_heap(row, n, k, heap):
    """``(k-th largest of the finite-or-inf values > -inf in row[:n], their count)``.

    One pass with a min-heap of the ``k`` largest values seen (``heap`` holds
    ``k`` slots): most values lose a single comparison against the heap's
    root, so for ``k << n`` this costs about one read per key.  Returns
    ``count = -1`` when a NaN is met.  Equal values are kept as a multiset,
    so the root is exactly the ``k``-th largest.
    """
    ninf = -np.inf
    cnt = 0
    for j in range(n):
        x = row[j]
        if x != x:
            return ninf, -1
        if x > ninf:
            if cnt < k:
                heap[cnt] = x
                cnt += 1
                if cnt == k:
                    for i in range(k // 2 - 1, -1, -1):
                        _sift_down(heap, k, i)
            else:
                cnt += 1
                if x > heap[0]:
                    heap[0] = x
                    _sift_down(heap, k, 0)
    return heap[0], cnt


@inner
def row_threshold(row, n, top_k, buf):
    """Top-k threshold of one row of ``n`` modified logits (``-inf`` = not allowed).

    Returns ``(thr, cut)``: key ``j`` is selected when ``row[j] > thr``, or
    ``row[j] == thr and j <= cut``, or ``row[j]`` is NaN -- exactly ``top_k``
    keys when more than ``top_k`` are allowed, ties to the lower index.
    With at most ``top_k`` allowed keys every one is kept (``thr = -inf``,
    ``cut = -1``); ``top_k = 0`` keeps nothing; a row holding a NaN keeps
    everything (``cut = n``) so that the NaN propagates.  ``buf`` is ``O(n)``
    scratch.  Small ``top_k`` (up to ``n / 16``) use a heap, larger ones a
    quickselect over a copy of the allowed values.
    """
    ninf = -np.inf
    if top_k == 0:
        for j in range(n):
            if row[j] != row[j]:
                return ninf, n
        return np.inf, -1
    if 16 * top_k <= n:
        thr, cnt = kth_largest_heap(row, n, top_k, buf)
        if cnt < 0:
            return ninf, n
        if cnt <= top_k:
            return ninf, -1
    else:
        cnt = 0
        for j in range(n):
            x = row[j]
            if x != x:
                return ninf, n
            if x > ninf:
                buf[cnt] = x
                cnt += 1
        if cnt <= top_k:
            return ninf, -1
        thr = kth_smallest(buf, cnt, cnt - top_k)
    need = top_k
    for j in range(n):
        if row[j] > thr:
            need -= 1
    for j in range(n):
        if row[j] == thr:
            need -= 1
            if need == 0:
                return thr, j
    return thr, n  # not reached: `need` ties exist by construction


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
