"""The order in which Token Merging takes its candidate edges, for the backends.

Every A token's best similarity is one candidate edge; the ``r`` best edges
merge.  The order is fixed by :mod:`attnnb.tome` (Ties and randomness):
largest similarity first, ties to the lower A index, NaN above every number
(as ``torch.sort(descending=True)``) and a protected token's ``-inf`` below
every number.

This module belongs to no backend, so that a backend can sort its edges
without importing the ``reference`` backend (the oracle it is tested
against, which keeps its own implementation) or another backend.
"""

from __future__ import annotations

import numpy as np

__all__ = ["descending_order"]


def descending_order(scores):
    """Indices sorting each row of ``scores`` from largest to smallest, stably.

    Parameters
    ----------
    scores : float array ``(B, T)``
        The best similarity of every A token (any float dtype; not modified).

    Returns
    -------
    int64 ``(B, T)``
        ``order[b]`` lists the A tokens of row ``b`` best edge first: NaN
        first, then decreasing values, ``-inf`` last; equal values (NaNs
        among themselves included) keep increasing index order.
    """
    scores = np.asarray(scores)
    # A stable ascending sort of the negated scores, NaN mapped to the smallest
    # key (a +inf score, which a cosine similarity never is, would tie with NaN).
    key = np.where(np.isnan(scores), -np.inf, np.negative(scores))
    return np.argsort(key, axis=-1, kind="stable").astype(np.int64, copy=False)
