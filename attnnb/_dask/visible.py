"""Which key blocks a query block sees, from block boundaries alone.

Blocks a query block cannot see get no task.  A visible block is either
whole (every pair allowed: the call needs no restriction) or partial:

* causal (``j <= i + Lk - Lq`` in global positions): a :class:`Diagonal`
  with the limit in the block's own positions;
* a pattern: the sub-pattern of the block (:func:`sub_pattern`), cut out
  in the task that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..patterns import Pattern
from .grid import spans

SKIP = "skip"  # a block no pair of which is allowed


@dataclass(frozen=True)
class Diagonal:
    """A block cut by the causal limit: its key ``j`` is allowed for its query ``i``
    when ``j <= i + offset`` (positions counted from the block's corner).

    ``native`` means the call's own ``causal=True`` (``j <= i + nk - nq``) is
    that limit, so no mask is needed.
    """

    offset: int
    native: bool

    def mask(self, nq: int, nk: int) -> np.ndarray:
        """The limit as a boolean ``(nq, nk)`` mask."""
        return np.arange(nk)[None, :] <= np.arange(nq)[:, None] + self.offset


def causal_block(q0, q1, k0, k1, shift):
    """:data:`SKIP`, None (whole) or a :class:`Diagonal` for queries ``[q0, q1)``, keys
    ``[k0, k1)``; ``shift = Lk - Lq`` aligns the diagonal bottom-right."""
    if k1 <= k0 or q1 <= q0:
        return SKIP
    if k0 > q1 - 1 + shift:
        return SKIP
    if k1 - 1 <= q0 + shift:
        return None
    offset = q0 + shift - k0
    return Diagonal(offset, offset == (k1 - k0) - (q1 - q0))


def dense_blocks(q_edges, k_edges, causal: bool):
    """``{query block: [(key block, None or Diagonal), ...]}`` of dense attention."""
    shift = k_edges[-1] - q_edges[-1]
    out = {}
    for i, (q0, q1) in enumerate(spans(q_edges)):
        row = []
        for j, (k0, k1) in enumerate(spans(k_edges)):
            spec = causal_block(q0, q1, k0, k1, shift) if causal else (
                SKIP if k1 <= k0 else None)
            if spec is not SKIP:
                row.append((j, spec))
        out[i] = row
    return out


# CSR entries read per pass when counting a pattern's pairs per block
_PASS = 1 << 20


def pattern_counts(pattern: Pattern, q_edges, k_edges) -> np.ndarray:
    """Allowed pairs per (pattern head, query block, key block): int64 ``(n_heads, nqb, nkb)``.

    Reads the CSR in passes of ``_PASS`` entries, so the temporary memory
    does not grow with the pattern.
    """
    Lq = pattern.shape[0]
    nqb, nkb = len(q_edges) - 1, len(k_edges) - 1
    n = pattern.n_heads * nqb * nkb
    row_block = np.searchsorted(np.asarray(q_edges), np.arange(Lq), side="right") - 1
    k_edges = np.asarray(k_edges)
    counts = np.zeros(n, np.int64)
    indptr, indices = pattern.indptr, pattern.indices
    for e0 in range(0, indices.size, _PASS):
        e = np.arange(e0, min(e0 + _PASS, indices.size))
        rows = np.searchsorted(indptr, e, side="right") - 1
        head, i = np.divmod(rows, Lq)
        kb = np.searchsorted(k_edges, indices[e], side="right") - 1
        counts += np.bincount((head * nqb + row_block[i]) * nkb + kb, minlength=n)
    return counts.reshape(pattern.n_heads, nqb, nkb)


def pattern_blocks(pattern: Pattern, head_edges, q_edges, k_edges):
    """``{(head block, query block): [(key block, whole: bool), ...]}`` touched by ``pattern``."""
    counts = pattern_counts(pattern, q_edges, k_edges)
    out = {}
    for hb, (h0, h1) in enumerate(spans(head_edges)):
        heads = counts[h0:h1] if pattern.n_heads > 1 else counts
        total = heads.sum(axis=0)
        for i, (q0, q1) in enumerate(spans(q_edges)):
            row = []
            for j, (k0, k1) in enumerate(spans(k_edges)):
                if total[i, j]:
                    row.append((j, bool(total[i, j] == len(heads) * (q1 - q0) * (k1 - k0))))
            out[hb, i] = row
    return out


def sub_pattern(pattern: Pattern, heads, rows, cols) -> Pattern:
    """The pattern on query heads ``heads = (h0, h1)`` (all heads of a shared one),
    queries ``rows = (q0, q1)`` and keys ``cols = (k0, k1)``, in the block's positions."""
    Lq = pattern.shape[0]
    (q0, q1), (k0, k1) = rows, cols
    per_head = pattern.n_heads > 1
    lengths, keys = [], []
    for h in range(*heads) if per_head else (0,):
        r0, r1 = h * Lq + q0, h * Lq + q1
        ptr = pattern.indptr[r0:r1 + 1]
        ind = pattern.indices[ptr[0]:ptr[-1]]
        row = np.repeat(np.arange(r1 - r0), np.diff(ptr))
        inside = (ind >= k0) & (ind < k1)
        lengths.append(np.bincount(row[inside], minlength=r1 - r0))
        keys.append(ind[inside] - k0)
    indptr = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
    return Pattern(indptr, np.concatenate(keys), (q1 - q0, k1 - k0), len(lengths))
