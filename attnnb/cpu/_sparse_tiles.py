"""The sparse CPU kernels' element mask, shared by the forward and backward passes.

This extends :mod:`attnnb.cpu._tiles` (which it does not change) with the
element-level selection that dense attention does not need:
:func:`csr_tile_mask` masks one partial tile of a sparse pattern from its
CSR rows (keys outside the rows' allowed lists become ``-inf``).  Top-k's
selection is in :mod:`attnnb.cpu._topk_rows`.

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
