"""Score products whose every entry is rounded the same way wherever its key sits.

The top-k selection across key blocks (:mod:`attnnb._dask.select`) ranks
keys by ``q @ k^T`` computed block by block, and two equal keys in blocks of
other widths, or at other columns, must get bit-equal logits so that the
lower index wins their tie as in one call.  A BLAS product does not promise
that: OpenBLAS's AVX2 sgemm kernel rounds the first and last eight columns
of a panel differently from the others, even at one matrix shape
(docs/notes/performance.md, "Figures moved out of the code's comments").

So each entry here is summed over the depth in increasing order, one IEEE
multiply and one IEEE add per step (no FMA, no reassociation), starting from
zero: the result depends only on the query row and the key row.  NumPy
arrays go through a small serial Numba loop (serial because it runs inside
Dask's worker threads, which already fill the cores); other array types
(CuPy) through the same sum as elementwise array operations, which give the
same bits.
"""

from __future__ import annotations

import numpy as np


def _row_products_kernel():
    """The compiled loop (compiled on first use: importing this module compiles nothing)."""
    global _KERNEL
    if _KERNEL is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def row_products(q, kt, out):
            # q (n, m, d), kt (n, d, nk), out (n, m, nk); default floating point
            # semantics: each step is a rounded multiply then a rounded add
            n, m, d = q.shape
            nk = kt.shape[2]
            for b in range(n):
                for i in range(m):
                    row = out[b, i]
                    row[:] = 0
                    for c in range(d):
                        a = q[b, i, c]
                        for j in range(nk):
                            row[j] += a * kt[b, c, j]

        _KERNEL = row_products
    return _KERNEL


_KERNEL = None


def ordered_products(xp, q, kt):
    """``q @ kt`` with every entry summed over the depth in order (see the module docstring).

    Parameters
    ----------
    xp : module
        The array namespace of ``q`` and ``kt`` (``numpy`` or ``cupy``).
    q : array, shape ``S + (m, d)``
    kt : array, shape ``S + (d, nk)``
        Same floating dtype as ``q``; ``S`` equal (no broadcasting).

    Returns
    -------
    array, shape ``S + (m, nk)``, ``q``'s dtype.
    """
    *batch, m, d = q.shape
    nk = kt.shape[-1]
    if xp is np:
        n = int(np.prod(batch, dtype=np.int64))
        flat_q = np.ascontiguousarray(q).reshape(n, m, d)
        flat_kt = np.ascontiguousarray(kt).reshape(n, d, nk)
        out = np.empty((n, m, nk), q.dtype)
        if out.size:
            _row_products_kernel()(flat_q, flat_kt, out)
        return out.reshape(*batch, m, nk)
    return elementwise_products(xp, q, kt)


def elementwise_products(xp, q, kt):
    """:func:`ordered_products` as ``d`` rank-one updates of whole arrays (any namespace).

    Each update is a multiply and then an add (two array operations, each
    rounded), so the bits equal the compiled loop's.
    """
    out = xp.zeros((*q.shape[:-1], kt.shape[-1]), q.dtype)
    for c in range(q.shape[-1]):
        out += q[..., :, c:c + 1] * kt[..., c:c + 1, :]
    return out
