"""Top-k selection rules that compile for every target: plain Python on flat arrays.

Each backend compiles these functions with its own decorator (the ``cpu``
backend with ``numba.njit``, the ``cuda`` backend as device functions), so
that one algorithm, and one tie rule, serves both: a key is kept when its
logit is above the row's threshold, or equal to it and at or before the
row's *cut* index (ties go to the lower key index).  Nothing here imports
Numba or a backend.
"""

from __future__ import annotations


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


def tie_cut(row, n, top_k, thr):
    """The last key index kept at the threshold: ``top_k`` keys of ``row[:n]`` in all.

    ``thr`` is the ``top_k``-th largest value of the row (so at least one key
    equals it).  Every key above ``thr`` is kept; of the keys equal to it,
    the lowest indices are kept until ``top_k`` keys are, and the index of
    the last one is returned (``n`` is not reached for a valid ``thr``).
    """
    need = top_k
    for j in range(n):
        need -= row[j] > thr
    for j in range(n):
        if row[j] == thr:
            need -= 1
            if need == 0:
                return j
    return n


def kept(s, j, thr, cut):
    """Whether key ``j`` with ranking logit ``s`` is kept by a row's ``(thr, cut)``: above
    the threshold, or at it up to the cut, or NaN (so that a NaN row's NaN reaches it)."""
    return s > thr or s != s or (s == thr and j <= cut)
