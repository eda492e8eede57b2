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
    order reads each stored key once (cost O(tile + allowed keys)).
    """
    nq, nk = S.shape
    j1 = j0 + nk
    ninf = -np.inf
    for r in range(nq):
        p = cursor[r]
        end = indptr[row0 + r + 1]
        while p < end and indices[p] < j0:
            p += 1
        c_next = 0  # first column not yet decided
        while p < end and indices[p] < j1:
            c = indices[p] - j0
            for x in range(c_next, c):
                S[r, x] = ninf
            c_next = c + 1
            p += 1
        for x in range(c_next, nk):
            S[r, x] = ninf
        cursor[r] = p


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
def row_threshold(row, n, top_k, buf):
    """Top-k threshold of one row of ``n`` modified logits (``-inf`` = not allowed).

    Returns ``(thr, cut)``: key ``j`` is selected when ``row[j] > thr``, or
    ``row[j] == thr and j <= cut``, or ``row[j]`` is NaN -- exactly ``top_k``
    keys when more than ``top_k`` are allowed, ties to the lower index.
    With at most ``top_k`` allowed keys every one is kept (``thr = -inf``,
    ``cut = -1``); ``top_k = 0`` keeps nothing; a row holding a NaN keeps
    everything (``cut = n``) so that the NaN propagates.  ``buf`` is ``O(n)`` scratch.
    """
    ninf = -np.inf
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
    if top_k == 0:
        return np.inf, -1
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
        c = cut[r]
        for x in range(nk):
            s = R[r, j0 + x]
            if s > t or s != s or (s == t and j0 + x <= c):
                S[r, x] = s
            else:
                S[r, x] = ninf
