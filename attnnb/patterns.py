"""Sparse attention patterns: which keys each query may attend, as data.

A :class:`Pattern` is a boolean ``(Lq, Lk)`` grid stored row-compressed
(CSR), either shared by every head or one grid per head.  Builders give the
standard families (sliding window, Sparse Transformer strided and fixed,
dilated, Longformer, BigBird, block-sparse) and conversions from dense
masks and SciPy sparse matrices.  :func:`attnnb.sparse_attention` computes
attention over a pattern at a cost proportional to its allowed pairs.

Storage (read by the CPU and CUDA kernels)
------------------------------------------
``H = pattern.n_heads`` (1 for a shared pattern) grids of ``Lq`` rows are
stacked into one CSR matrix of ``H * Lq`` rows; row ``h * Lq + i`` holds the
keys query ``i`` of head ``h`` may attend:

* ``indptr``: int64 ``(H * Lq + 1,)``, ``indptr[0] == 0``, non-decreasing.
* ``indices``: int32 ``(nnz,)``; ``indices[indptr[r]:indptr[r + 1]]`` are the
  allowed key positions of row ``r``, strictly increasing (sorted, unique),
  all in ``[0, Lk)``.

Block layout (``pattern.blocks(tile_q, tile_k)``, cached): for query tile
``t`` (rows ``t * tile_q ...``) of head ``h``, with ``n_qt = ceil(Lq / tile_q)``
and ``r = h * n_qt + t``:

* ``tile_ptr``: int64 ``(H * n_qt + 1,)``;
* ``tile_idx``: int32, ``tile_idx[tile_ptr[r]:tile_ptr[r + 1]]`` are the key
  tiles (keys ``kt * tile_k ...``) holding at least one allowed pair of the
  query tile, increasing;
* ``tile_full``: bool, same length: True when *every* pair of that
  ``(query tile, key tile)`` block (clipped to ``Lq`` and ``Lk``) is allowed,
  so a kernel needs no element mask there.  Partial tiles take their element
  mask from the CSR rows.

Rectangles: builders taking ``n`` also accept ``(Lq, Lk)`` where noted;
positions then align bottom-right as for causal attention: read query ``i``
as position ``i' = i + Lk - Lq`` in the rules.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._core.layout import BlockLayout  # noqa: F401 - public here too
from ._front.checks import as_named_array

__all__ = [
    "BlockLayout",
    "Pattern",
    "bigbird",
    "block_sparse",
    "dilated",
    "fixed",
    "from_mask",
    "from_scipy",
    "local",
    "longformer",
    "strided",
]


class Pattern:
    """An allowed set of (query, key) pairs over an ``(Lq, Lk)`` grid.

    Parameters
    ----------
    indptr : int array ``(n_heads * Lq + 1,)``
    indices : int array ``(nnz,)``
        CSR storage as described in :mod:`attnnb.patterns`: rows sorted and
        without duplicates, keys in ``[0, Lk)``.
    shape : ``(Lq, Lk)``
    n_heads : int
        1 for a pattern shared by all heads, else the number of query heads.

    Normally built by the functions of :mod:`attnnb.patterns`; the
    constructor checks the invariants (``ValueError`` when broken).

    Notes
    -----
    ``a | b`` and ``a & b`` are the union and intersection of allowed sets;
    a shared pattern combines with a per-head one by applying to every head.
    """

    __slots__ = ("indptr", "indices", "shape", "n_heads", "_blocks")

    def __init__(self, indptr, indices, shape, n_heads: int = 1):
        Lq, Lk = (int(s) for s in shape)
        n_heads = int(n_heads)
        if Lq < 0 or Lk < 0 or n_heads < 1:
            raise ValueError(f"shape must be non-negative and n_heads >= 1; got shape {shape}, "
                             f"n_heads {n_heads}")
        given = (indptr, indices)
        indptr = np.ascontiguousarray(indptr, dtype=np.int64)
        indices = np.ascontiguousarray(indices)
        if indices.size == 0:
            indices = indices.astype(np.int32)
        if indices.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers; got dtype {indices.dtype}")
        # the range before the cast to int32, which would wrap keys of 2**31 and more
        if indices.size and (indices.min() < 0 or indices.max() >= Lk):
            raise ValueError(f"indices must lie in [0, Lk) = [0, {Lk})")
        indices = indices.astype(np.int32, copy=False)
        rows = n_heads * Lq
        if indptr.shape != (rows + 1,):
            raise ValueError(f"indptr must have shape ({rows + 1},) = n_heads * Lq + 1; "
                             f"got {indptr.shape}")
        if indptr[0] != 0 or indptr[-1] != indices.size or np.any(np.diff(indptr) < 0):
            raise ValueError("indptr must start at 0, be non-decreasing and end at "
                             f"len(indices) = {indices.size}")
        if indices.size:
            step = np.diff(indices.astype(np.int64))
            starts = indptr[1:-1]
            starts = starts[(starts > 0) & (starts < indices.size)]
            ok = step > 0
            ok[starts - 1] = True  # a new row may start anywhere
            if not ok.all():
                raise ValueError("indices must be strictly increasing within each row")
        # read-only from here on, but never the caller's own arrays (inputs are not
        # written to, their flags included): those are copied first
        indptr, indices = (a.copy() if a.flags.writeable and np.may_share_memory(a, g) else a
                           for a, g in zip((indptr, indices), given))
        indptr.flags.writeable = False
        indices.flags.writeable = False
        self.indptr = indptr
        self.indices = indices
        self.shape = (Lq, Lk)
        self.n_heads = n_heads
        self._blocks = {}

    # -- basic facts -----------------------------------------------------------------
    @property
    def nnz(self) -> int:
        """Number of allowed pairs (summed over heads for a per-head pattern)."""
        return int(self.indices.size)

    @property
    def density(self) -> float:
        """``nnz / (n_heads * Lq * Lk)``: the allowed fraction of the grid."""
        total = self.n_heads * self.shape[0] * self.shape[1]
        return self.nnz / total if total else 0.0

    def __repr__(self) -> str:
        heads = "shared" if self.n_heads == 1 else f"{self.n_heads} heads"
        return (f"Pattern(shape={self.shape}, {heads}, nnz={self.nnz}, "
                f"density={self.density:.4g})")

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Pattern):
            return NotImplemented
        return (self.shape == other.shape and self.n_heads == other.n_heads
                and np.array_equal(self.indptr, other.indptr)
                and np.array_equal(self.indices, other.indices))

    __hash__ = None

    def head(self, h: int) -> Pattern:
        """The ``(Lq, Lk)`` pattern of head ``h`` (the pattern itself when shared)."""
        if self.n_heads == 1:
            return self
        if not -self.n_heads <= h < self.n_heads:
            raise IndexError(f"head {h} out of range for a pattern of {self.n_heads} heads")
        h %= self.n_heads
        Lq = self.shape[0]
        ptr = self.indptr[h * Lq: (h + 1) * Lq + 1]
        return Pattern(ptr - ptr[0], self.indices[ptr[0]: ptr[-1]], self.shape)

    def row_lengths(self) -> np.ndarray:
        """Allowed keys per query: int64 ``(n_heads, Lq)``."""
        return np.diff(self.indptr).reshape(self.n_heads, self.shape[0])

    # -- conversions -----------------------------------------------------------------
    def to_mask(self) -> np.ndarray:
        """Dense boolean mask, True = may attend: ``(Lq, Lk)``, or ``(H, Lq, Lk)`` per head."""
        Lq, Lk = self.shape
        mask = np.zeros(self.n_heads * Lq * Lk, dtype=bool)
        mask[self._codes()] = True
        mask = mask.reshape(self.n_heads, Lq, Lk)
        return mask[0] if self.n_heads == 1 else mask

    def to_scipy(self):
        """A ``scipy.sparse.csr_array`` of ones, or a list of them (one per head)."""
        from scipy import sparse

        def one(p):
            data = np.ones(p.nnz, dtype=bool)
            return sparse.csr_array((data, p.indices.copy(), p.indptr.copy()), shape=p.shape)

        if self.n_heads == 1:
            return one(self)
        return [one(self.head(h)) for h in range(self.n_heads)]

    def _rows(self) -> np.ndarray:
        """Row number (``h * Lq + i``) of every stored entry."""
        return np.repeat(np.arange(self.n_heads * self.shape[0], dtype=np.int64),
                         np.diff(self.indptr))

    def _codes(self) -> np.ndarray:
        """Sorted unique int64 ``row * Lk + j`` of every allowed pair."""
        return self._rows() * self.shape[1] + self.indices

    def _expanded(self, n_heads: int) -> Pattern:
        if self.n_heads == n_heads:
            return self
        lengths = np.tile(np.diff(self.indptr), n_heads)
        indptr = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=indptr[1:])
        return Pattern(indptr, np.tile(self.indices, n_heads), self.shape, n_heads)

    # -- algebra ---------------------------------------------------------------------
    def _combine(self, other: Any, op: str) -> Pattern:
        if not isinstance(other, Pattern):
            return NotImplemented
        if self.shape != other.shape:
            raise ValueError(f"patterns must have the same shape for {op}; "
                             f"got {self.shape} and {other.shape}")
        if 1 not in (self.n_heads, other.n_heads) and self.n_heads != other.n_heads:
            raise ValueError(f"patterns must have equal head counts (or one shared) for {op}; "
                             f"got {self.n_heads} and {other.n_heads}")
        H = max(self.n_heads, other.n_heads)
        a = self._expanded(H)._codes()
        b = other._expanded(H)._codes()
        if op == "|":
            codes = _merge_sorted(a, b)
        elif b.size:
            pos = np.minimum(np.searchsorted(b, a), b.size - 1)
            codes = a[b[pos] == a]
        else:
            codes = b
        return _from_codes(codes, self.shape, H)

    def __or__(self, other: Any) -> Pattern:
        return self._combine(other, "|")

    def __and__(self, other: Any) -> Pattern:
        return self._combine(other, "&")

    # -- what the kernels read -------------------------------------------------------
    def blocks(self, tile_q: int = 64, tile_k: int = 64) -> BlockLayout:
        """The block layout for tiles of ``tile_q`` queries by ``tile_k`` keys (cached)."""
        key = (int(tile_q), int(tile_k))
        if key not in self._blocks:
            self._blocks[key] = _block_layout(self, *key)
        return self._blocks[key]

    # -- picture ---------------------------------------------------------------------
    def plot(self, head: int = 0, *, ax=None, max_pixels: int = 512, title: str | None = None):
        """Draw the allowed set of one head; returns the matplotlib ``Figure``.

        Grids larger than ``max_pixels`` are shown as the allowed fraction of
        each cell of a coarser grid, on a power-law colour scale (gamma 0.4)
        so that sparse cells stay visible.  Needs matplotlib (``pip install
        'attnnb[plot]'``), imported only here.  Save with
        ``pattern.plot().savefig("pattern.png")``.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - optional dependency
            raise ImportError("Pattern.plot needs matplotlib: pip install 'attnnb[plot]'") \
                from exc
        p = self.head(head)
        image = p.coarse(max_pixels)
        if ax is None:
            fig, ax = plt.subplots(figsize=(4, 4 * max(p.shape[0], 1) / max(p.shape[1], 1)))
        else:
            fig = ax.figure
        Lq, Lk = p.shape
        from matplotlib.colors import PowerNorm

        ax.imshow(image, cmap="Blues", norm=PowerNorm(0.4, vmin=0.0, vmax=1.0),
                  interpolation="nearest",
                  extent=(-0.5, Lk - 0.5, Lq - 0.5, -0.5), aspect="auto")
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
        ax.set_title(title if title is not None else f"density {p.density:.3g}")
        return fig

    def coarse(self, max_pixels: int = 512) -> np.ndarray:
        """Allowed fraction per cell of an at most ``max_pixels``-square grid, averaged
        over heads: ``(ceil(Lq / fy), ceil(Lk / fx))`` float64."""
        Lq, Lk = self.shape
        fy = max(1, math.ceil(Lq / max_pixels))
        fx = max(1, math.ceil(Lk / max_pixels))
        ny, nx = -(-Lq // fy), -(-Lk // fx)
        rows = self._rows() % max(Lq, 1)
        cell = (rows // fy) * nx + self.indices // fx
        counts = np.bincount(cell, minlength=ny * nx).reshape(ny, nx).astype(np.float64)
        hy = np.minimum(fy, Lq - np.arange(ny) * fy)
        hx = np.minimum(fx, Lk - np.arange(nx) * fx)
        return counts / (self.n_heads * hy[:, None] * hx[None, :])


# ---------------------------------------------------------------------------------------
# construction helpers (vectorised: no Python loop over rows)


def _from_codes(codes: np.ndarray, shape, n_heads: int) -> Pattern:
    """A pattern from sorted unique codes ``row * Lk + j``."""
    Lq, Lk = shape
    rows = n_heads * Lq
    if Lk == 0 or codes.size == 0:
        return Pattern(np.zeros(rows + 1, np.int64), np.zeros(0, np.int32), shape, n_heads)
    counts = np.bincount(codes // Lk, minlength=rows)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    return Pattern(indptr, codes % Lk, shape, n_heads)


def _merge_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Union of two sorted unique int arrays (a stable sort merges two runs in linear time)."""
    c = np.concatenate([a, b])
    c.sort(kind="stable")
    keep = np.ones(c.size, dtype=bool)
    np.not_equal(c[1:], c[:-1], out=keep[1:])
    return c[keep]


def _runs(start, count, step=1, table=None):
    """CSR ``(indptr, indices)`` where row ``r`` holds ``start[r] + step[r] * t`` for
    ``t < count[r]`` (or ``table`` at those positions)."""
    count = np.maximum(np.asarray(count, np.int64), 0)
    indptr = np.zeros(count.size + 1, np.int64)
    np.cumsum(count, out=indptr[1:])
    t = np.arange(indptr[-1], dtype=np.int64) - np.repeat(indptr[:-1], count)
    step = np.asarray(step, np.int64)
    if step.ndim:
        step = np.repeat(step, count)
    idx = np.repeat(np.asarray(start, np.int64), count) + step * t
    if table is not None:
        idx = np.asarray(table)[idx]
    return indptr, idx


def _pattern_from_runs(shape, start, count, step=1, table=None) -> Pattern:
    indptr, idx = _runs(start, count, step, table)
    return Pattern(indptr, idx, shape)


def _stack_rows(shape, parts) -> Pattern:
    """Concatenate CSR parts ``(indptr, idx)`` row by row; every key of part ``p``
    must be smaller than every key of part ``p + 1`` in the same row."""
    counts = [np.diff(ptr) for ptr, _ in parts]
    total = np.sum(counts, axis=0)
    indptr = np.zeros(total.size + 1, np.int64)
    np.cumsum(total, out=indptr[1:])
    indices = np.empty(indptr[-1], np.int64)
    before = indptr[:-1].copy()
    for (ptr, idx), c in zip(parts, counts, strict=True):
        t = np.arange(idx.size, dtype=np.int64) - np.repeat(ptr[:-1], c)
        indices[np.repeat(before, c) + t] = idx
        before += c
    return Pattern(indptr, indices, shape)


def _grid(n, name="n", rectangles=True):
    """``(Lq, Lk)`` from ``n`` or ``(Lq, Lk)``, and the aligned query positions ``i'``."""
    if isinstance(n, (tuple, list)):
        if not rectangles:
            raise TypeError(f"{name} must be an int (square grids only); got {n!r}")
        if len(n) != 2:
            raise ValueError(f"{name} must be an int or a pair (Lq, Lk); got {n!r}")
        Lq, Lk = (_count(name, x) for x in n)
    else:
        Lq = Lk = _count(name, n)
    return (Lq, Lk), np.arange(Lq, dtype=np.int64) + (Lk - Lq)


def _count(name, x, minimum=0):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an integer; got {type(x).__name__} {x!r}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {x}")
    return int(x)


def _flag(name, x):
    """``x`` as a bool: True or False only (``None`` or ``1`` are errors, as in
    :func:`attnnb.attention`)."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {x!r}")
    return bool(x)


def _positions(name, x):
    """Sorted unique integer positions from a sequence of integers: not booleans (a
    mask is not a list of positions), not floats (no silent truncation)."""
    arr = as_named_array(name, x)
    if arr.size and (arr.dtype == np.bool_ or arr.dtype.kind not in "iu"):
        raise TypeError(f"{name} must be a sequence of integer positions; got dtype "
                        f"{arr.dtype}" + (" (for a boolean mask pass np.flatnonzero(mask))"
                                          if arr.dtype == np.bool_ else ""))
    return np.unique(arr.astype(np.int64).ravel())


def _ranges(shape, lo, hi) -> Pattern:
    """Row ``i`` allows the keys ``lo[i] <= j <= hi[i]`` (clipped to ``[0, Lk)``)."""
    Lk = shape[1]
    lo = np.maximum(lo, 0)
    hi = np.minimum(hi, Lk - 1)
    return _pattern_from_runs(shape, lo, hi - lo + 1)


def _progression(shape, first, last, step) -> Pattern:
    """Row ``i`` allows ``j = first[i] + step * t <= last[i]``, with ``first`` raised
    to the smallest such value >= 0 and ``last`` clipped to ``Lk - 1``."""
    Lk = shape[1]
    first = np.where(first < 0, first + (-first + step - 1) // step * step, first)
    last = np.minimum(last, Lk - 1)
    count = np.where(last >= first, (last - first) // step + 1, 0)
    return _pattern_from_runs(shape, first, count, step)


def _columns(shape, cols, limit=None) -> Pattern:
    """Every row allows the sorted key set ``cols`` (only ``j <= limit[i]`` if given)."""
    Lq = shape[0]
    cols = np.asarray(cols, np.int64)
    if limit is None:
        count = np.full(Lq, cols.size, np.int64)
    else:
        count = np.searchsorted(cols, limit, side="right")
    return _pattern_from_runs(shape, np.zeros(Lq, np.int64), count, 1, table=cols)


# ---------------------------------------------------------------------------------------
# builders


def local(n, window: int, *, causal: bool = False) -> Pattern:
    """Sliding-window (local) attention.

    Query ``i`` may attend key ``j`` when ``i - window <= j <= i + window``
    (``i - window <= j <= i`` when ``causal``).  FlashAttention's
    ``window_size=(window, window)`` / ``(window, 0)``; DeepSpeed's
    ``LocalSlidingWindowSparsityConfig`` at element rather than block level;
    the sliding window of Longformer (Beltagy et al. 2020).

    ``local(6, 1)`` and ``local(6, 1, causal=True)``::

        x x . . . .      x . . . . .
        x x x . . .      x x . . . .
        . x x x . .      . x x . . .
        . . x x x .      . . x x . .
        . . . x x x      . . . x x .
        . . . . x x      . . . . x x

    Parameters
    ----------
    n : int or ``(Lq, Lk)``
        Grid size; rectangles align bottom-right (``i`` read as ``i + Lk - Lq``).
    window : int >= 0
    causal : bool
    """
    shape, pos = _grid(n)
    causal = _flag("causal", causal)
    window = _count("window", window)
    return _ranges(shape, pos - window, pos if causal else pos + window)


def strided(n, stride: int, *, causal: bool = True) -> Pattern:
    """The strided head of the Sparse Transformer (Child et al. 2019).

    Query ``i`` may attend key ``j`` when ``(i - j) % stride == 0`` (and
    ``j <= i`` when ``causal``): every ``stride``-th earlier position, the
    pattern ``A(2)`` of the paper's strided attention (its other head is
    :func:`local` with ``window = stride - 1``), as in OpenAI's
    ``sparse_attention`` ``attn_mode="strided"``.

    ``strided(6, 2)`` (causal) and ``strided(6, 2, causal=False)``::

        x . . . . .      x . x . x .
        . x . . . .      . x . x . x
        x . x . . .      x . x . x .
        . x . x . .      . x . x . x
        x . x . x .      x . x . x .
        . x . x . x      . x . x . x

    Parameters
    ----------
    n : int or ``(Lq, Lk)`` (rectangles align bottom-right)
    stride : int >= 1
    causal : bool, default True
    """
    shape, pos = _grid(n)
    causal = _flag("causal", causal)
    stride = _count("stride", stride, 1)
    last = pos if causal else np.full_like(pos, shape[1] - 1)
    return _progression(shape, pos % stride, last, stride)


def fixed(n, block: int, summary: int, *, causal: bool = True) -> Pattern:
    """The fixed pattern of the Sparse Transformer (Child et al. 2019).

    Query ``i`` may attend key ``j`` when ``j // block == i // block`` (same
    block) or ``j % block >= block - summary`` (the last ``summary`` keys of
    every block, which summarise it), and ``j <= i`` when ``causal``.  The
    paper's ``A(1)`` and ``A(2)`` with ``l = block``, ``c = summary``; at block
    level this is DeepSpeed's ``FixedSparsityConfig(num_local_blocks,
    num_global_blocks)``.

    ``fixed(6, 3, 1)`` (causal) and ``fixed(6, 3, 1, causal=False)``::

        x . . . . .      x x x . . x
        x x . . . .      x x x . . x
        x x x . . .      x x x . . x
        . . x x . .      . . x x x x
        . . x x x .      . . x x x x
        . . x x x x      . . x x x x

    Parameters
    ----------
    n : int or ``(Lq, Lk)`` (rectangles align bottom-right)
    block : int >= 1
    summary : int, ``0 <= summary <= block``
    causal : bool, default True
    """
    shape, pos = _grid(n)
    causal = _flag("causal", causal)
    block = _count("block", block, 1)
    summary = _count("summary", summary)
    if summary > block:
        raise ValueError(f"summary must be <= block ({block}); got {summary}")
    Lk = shape[1]
    j = np.arange(Lk, dtype=np.int64)
    cols = j[j % block >= block - summary]
    # each row is: summary keys before its own block, the block, summary keys after it
    start = pos // block * block
    own_hi = np.minimum(start + block - 1, pos) if causal else start + block - 1
    own = np.maximum(np.minimum(own_hi, Lk - 1) - start + 1, 0)
    n_before = np.searchsorted(cols, start)
    after = np.searchsorted(cols, start + block)
    n_after = np.zeros_like(pos) if causal else cols.size - after
    early = pos < 0  # rectangles: a query before the first key has no block of its own
    n_before = np.where(early, 0 if causal else cols.size, n_before)
    own = np.where(early, 0, own)
    n_after = np.where(early, 0, n_after)
    return _stack_rows(shape, [_runs(np.zeros_like(pos), n_before, 1, cols),
                               _runs(start, own),
                               _runs(after, n_after, 1, cols)])


def dilated(n, window: int, dilation: int, *, causal: bool = False) -> Pattern:
    """Dilated sliding window (Longformer, Beltagy et al. 2020).

    Query ``i`` may attend key ``j`` when ``|i - j| <= window * dilation``
    and ``(i - j) % dilation == 0`` (and ``j <= i`` when ``causal``):
    ``window`` keys on each side, ``dilation`` apart.  ``dilation=1`` is
    :func:`local`.

    ``dilated(7, 1, 2)`` and ``dilated(7, 1, 2, causal=True)``::

        x . x . . . .      x . . . . . .
        . x . x . . .      . x . . . . .
        x . x . x . .      x . x . . . .
        . x . x . x .      . x . x . . .
        . . x . x . x      . . x . x . .
        . . . x . x .      . . . x . x .
        . . . . x . x      . . . . x . x

    Parameters
    ----------
    n : int or ``(Lq, Lk)`` (rectangles align bottom-right)
    window : int >= 0
    dilation : int >= 1
    causal : bool
    """
    shape, pos = _grid(n)
    causal = _flag("causal", causal)
    window = _count("window", window)
    dilation = _count("dilation", dilation, 1)
    reach = window * dilation
    return _progression(shape, pos - reach, pos if causal else pos + reach, dilation)


def longformer(n, window: int, global_tokens) -> Pattern:
    """Longformer attention: a sliding window plus global tokens (Beltagy et al. 2020).

    Query ``i`` may attend key ``j`` when ``|i - j| <= window``, or ``i`` is a
    global token (it attends every key), or ``j`` is a global token (every
    query attends it).  DeepSpeed's ``BSLongformerSparsityConfig`` at element
    level.  Bidirectional, as in the paper's encoder.

    ``longformer(6, 1, [0])``::

        x x x x x x
        x x x . . .
        x x x x . .
        x . x x x .
        x . . x x x
        x . . . x x

    Parameters
    ----------
    n : int or ``(Lq, Lk)``
        For rectangles positions align bottom-right: query ``i`` is global
        when ``i + Lk - Lq`` is in ``global_tokens``; ``global_tokens`` are key
        positions.
    window : int >= 0
    global_tokens : sequence of int
        Positions in ``[0, Lk)``; duplicates are ignored.
    """
    shape, pos = _grid(n)
    window = _count("window", window)
    Lk = shape[1]
    g = _positions("global_tokens", global_tokens)
    if g.size and (g[0] < 0 or g[-1] >= Lk):
        raise ValueError(f"global_tokens must lie in [0, {Lk}); got {g[0]}..{g[-1]}")
    is_global = np.isin(pos, g)
    lo = np.where(is_global, 0, pos - window)
    hi = np.where(is_global, Lk - 1, pos + window)
    return _ranges(shape, lo, hi) | _columns(shape, g)


def bigbird(n: int, block: int, num_global: int, num_window: int, num_random: int, *,
            seed=None) -> Pattern:
    """BigBird attention on blocks (Zaheer et al. 2020; DeepSpeed's ``BigBirdSparsityConfig``).

    With ``bi = i // block``, ``bj = j // block`` and ``nb = ceil(n / block)``
    blocks (a last partial block counts as a block), query ``i`` may attend
    key ``j`` when

    * ``bi < num_global`` or ``bj < num_global`` (global blocks, ITC form), or
    * ``|bi - bj| <= num_window // 2`` (sliding window of blocks), or
    * ``bj`` is one of ``num_random`` blocks drawn for block-row ``bi``
      (without replacement, uniformly) from the blocks that are neither
      global nor in its window -- all of them when fewer remain.

    Random blocks are drawn with ``np.random.default_rng(seed)``, one
    ``rng.choice`` per non-global block-row in increasing order: the same
    ``seed`` gives the same pattern.  ``seed=None`` draws fresh entropy.

    ``bigbird(12, 2, 1, 3, 1, seed=0)``: block 0 global, a window of three
    blocks, one random block per block-row (block-rows 1, 2 and 3 drew
    block 5, block-rows 4 and 5 drew block 1)::

        x x x x x x x x x x x x
        x x x x x x x x x x x x
        x x x x x x . . . . x x
        x x x x x x . . . . x x
        x x x x x x x x . . x x
        x x x x x x x x . . x x
        x x . . x x x x x x x x
        x x . . x x x x x x x x
        x x x x . . x x x x x x
        x x x x . . x x x x x x
        x x x x . . . . x x x x
        x x x x . . . . x x x x

    Parameters
    ----------
    n : int
        Square grids only.
    block : int >= 1
    num_global, num_window, num_random : int >= 0
        Global blocks (the first ones), window width in blocks (odd values
        are symmetric: 3 means the block and one on each side), random blocks
        per block-row.
    seed : None, int or numpy Generator seed
    """
    (shape, _) = _grid(n, rectangles=False)
    block = _count("block", block, 1)
    num_global = _count("num_global", num_global)
    num_window = _count("num_window", num_window)
    num_random = _count("num_random", num_random)
    nb = -(-shape[0] // block)
    try:
        rng = np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"seed must be None, an integer, a SeedSequence or a Generator; "
                        f"got {seed!r} ({exc})") from exc
    bi = np.arange(nb)[:, None]
    bj = np.arange(nb)[None, :]
    layout = (bi < num_global) | (bj < num_global) | (np.abs(bi - bj) <= num_window // 2)
    if num_random:
        for r in range(num_global, nb):
            free = np.flatnonzero(~layout[r])
            if free.size:
                pick = rng.choice(free, size=min(num_random, free.size), replace=False)
                layout[r, pick] = True
    return block_sparse(layout, block, shape=shape)


def block_sparse(layout, block: int, *, shape=None) -> Pattern:
    """Block-sparse attention from a block layout (DeepSpeed ``SparsityConfig.make_layout``,
    Triton / OpenAI blocksparse).

    Query ``i`` may attend key ``j`` when ``layout[i // block, j // block]``
    (``layout[h, i // block, j // block]`` for head ``h`` of a per-head layout).

    ``block_sparse([[1, 0], [1, 1]], 2)``::

        x x . .
        x x . .
        x x x x
        x x x x

    Parameters
    ----------
    layout : bool or 0/1 array ``(nqb, nkb)`` or ``(H, nqb, nkb)``
    block : int >= 1
    shape : ``(Lq, Lk)``, optional
        Default ``(nqb * block, nkb * block)``; a smaller shape cuts the last
        block-row / block-column (``ceil(Lq / block)`` must equal ``nqb``).
    """
    block = _count("block", block, 1)
    lay = np.asarray(layout)
    if lay.dtype != np.bool_:
        if lay.dtype.kind not in "iuf":
            raise TypeError(f"layout must be a boolean or 0/1 array; got dtype {lay.dtype}")
        lay = lay != 0
    if lay.ndim not in (2, 3):
        raise ValueError(f"layout must have shape (nqb, nkb) or (H, nqb, nkb); got {lay.shape}")
    per_head = lay.ndim == 3
    lay3 = lay if per_head else lay[None]
    H, nqb, nkb = lay3.shape
    if H == 0:
        raise ValueError("a per-head layout needs at least one head")
    if shape is None:
        shape = (nqb * block, nkb * block)
    Lq, Lk = (_count("shape", int(s)) for s in shape)
    if -(-Lq // block) != nqb or -(-Lk // block) != nkb:
        raise ValueError(f"shape {(Lq, Lk)} with block {block} needs a layout of "
                         f"({-(-Lq // block)}, {-(-Lk // block)}) blocks; got ({nqb}, {nkb})")
    # the sorted key list of every block-row (h, qb), stored back to back in `table`
    h_, qb_, kb_ = np.nonzero(lay3)
    width = np.minimum(block, Lk - kb_ * block)
    _, table = _runs(kb_ * block, width)
    br_count = np.bincount(h_ * nqb + qb_, weights=width, minlength=H * nqb).astype(np.int64)
    br_start = np.concatenate([[0], np.cumsum(br_count)[:-1]])
    rows_br = (np.arange(H, dtype=np.int64)[:, None] * nqb
               + np.arange(Lq, dtype=np.int64)[None, :] // block).ravel()
    indptr, indices = _runs(br_start[rows_br], br_count[rows_br], 1, table=table)
    return Pattern(indptr, indices, (Lq, Lk), H)


def from_mask(mask) -> Pattern:
    """The pattern allowing ``mask[i, j]`` (``mask[h, i, j]`` per head).

    Parameters
    ----------
    mask : bool array ``(Lq, Lk)`` or ``(H, Lq, Lk)``
    """
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(f"mask must be a boolean array (True = may attend); got dtype {m.dtype}")
    if m.ndim not in (2, 3):
        raise ValueError(f"mask must have shape (Lq, Lk) or (H, Lq, Lk); got {m.shape}")
    H = m.shape[0] if m.ndim == 3 else 1
    if H == 0:
        raise ValueError("a per-head mask needs at least one head")
    Lq, Lk = m.shape[-2:]
    flat = m.reshape(H * Lq, Lk)
    counts = np.count_nonzero(flat, axis=1)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Pattern(indptr, np.nonzero(flat)[1], (Lq, Lk), H)


def from_scipy(m) -> Pattern:
    """The pattern allowing the nonzero entries (``m != 0``) of a ``scipy.sparse`` matrix/array.

    Explicitly stored zeros are not allowed; duplicate entries are summed
    first (as SciPy does).  NaN entries count as nonzero.  ``m`` is not modified.
    """
    from scipy import sparse

    if not sparse.issparse(m):
        raise TypeError(f"m must be a scipy.sparse matrix or array; got {type(m).__name__}")
    if m.ndim != 2:
        raise ValueError(f"m must be 2-D (Lq, Lk); got shape {m.shape}")
    c = sparse.csr_array(m, copy=True)
    c.sum_duplicates()
    c.eliminate_zeros()
    c.sort_indices()
    return Pattern(c.indptr, c.indices, c.shape)


# Entries of the CSR per pass of :func:`_block_layout`: its temporaries are a few
# arrays of this length (about 2 MiB in all), whatever the pattern's size.
_BLOCK_CHUNK = 1 << 16


def _block_layout(p: Pattern, tile_q: int, tile_k: int, chunk: int = _BLOCK_CHUNK) -> BlockLayout:
    """The :class:`BlockLayout` of ``p`` for ``tile_q x tile_k`` tiles.

    Every allowed pair ``(r, j)`` (CSR row ``r = h * Lq + i``) lies in block
    ``code = (h * n_qt + i // tile_q) * n_kt + j // tile_k``; the layout lists
    the blocks with at least one pair, in increasing ``code``, and a block is
    full when it holds ``rows_in * cols_in`` pairs (a row never repeats a key).

    The CSR is read in passes of ``chunk`` entries, so the temporary memory
    is ``O(chunk + rows + tiles)``, not ``O(nnz)``: long sequences with wide windows
    have too many pairs to count at once (docs/notes/performance.md, "Figures moved out of
    the code's comments").
    Entries come in CSR order, so block codes never decrease from one query
    tile row to the next: only the last tile row of a pass can continue in
    the next one, and its partial counts are carried over and merged.

    Parameters
    ----------
    p : Pattern
    tile_q, tile_k : int >= 1
    chunk : int >= 1
        Entries per pass (tests make it small to cross many pass boundaries).
    """
    Lq, Lk = p.shape
    H = p.n_heads
    n_qt, n_kt = -(-Lq // tile_q), -(-Lk // tile_k)
    indptr, indices = p.indptr, p.indices
    nnz = indices.size
    closed_codes, closed_counts = [], []  # blocks of finished tile rows, in code order
    open_codes = open_counts = np.zeros(0, np.int64)  # the tile row a pass may continue
    for e0 in range(0, nnz, chunk):
        e1 = min(e0 + chunk, nnz)
        # CSR rows r0 .. r1 - 1 hold entries e0 .. e1 - 1 (empty rows between included)
        r0 = int(np.searchsorted(indptr, e0, side="right")) - 1
        r1 = int(np.searchsorted(indptr, e1, side="left"))
        lengths = np.diff(np.clip(indptr[r0:r1 + 1], e0, e1))
        rows = np.arange(r0, r1, dtype=np.int64)
        qt_row = rows // Lq * n_qt + rows % Lq // tile_q  # tile row (h * n_qt + t) of each
        first = int(qt_row[0])
        span = (int(qt_row[-1]) - first + 1) * n_kt
        local = (np.repeat(qt_row - first, lengths) * n_kt
                 + indices[e0:e1] // tile_k)
        if span <= 4 * chunk:  # few blocks in reach: count them all
            counts = np.bincount(local, minlength=span)
            codes = np.flatnonzero(counts)
            counts = counts[codes]
        else:  # a sparse stretch spread over many tile rows: sort instead
            codes, counts = np.unique(local, return_counts=True)
        codes += first * n_kt
        if open_codes.size and codes[0] // n_kt == open_codes[0] // n_kt:
            k = int(np.searchsorted(codes, (codes[0] // n_kt + 1) * n_kt))
            merged, merged_counts = _sum_counts(open_codes, open_counts, codes[:k], counts[:k])
            codes = np.concatenate([merged, codes[k:]])
            counts = np.concatenate([merged_counts, counts[k:]])
        elif open_codes.size:
            closed_codes.append(open_codes)
            closed_counts.append(open_counts)
        k = int(np.searchsorted(codes, codes[-1] // n_kt * n_kt))
        closed_codes.append(codes[:k])
        closed_counts.append(counts[:k])
        open_codes, open_counts = codes[k:], counts[k:]
    present = np.concatenate(closed_codes + [open_codes])
    counts = np.concatenate(closed_counts + [open_counts])
    qt, kt = present // max(n_kt, 1), present % max(n_kt, 1)
    t = qt % max(n_qt, 1)
    rows_in = np.minimum(tile_q, Lq - t * tile_q)
    cols_in = np.minimum(tile_k, Lk - kt * tile_k)
    full = counts == rows_in * cols_in
    tile_ptr = np.zeros(H * n_qt + 1, np.int64)
    np.cumsum(np.bincount(qt, minlength=H * n_qt), out=tile_ptr[1:])
    kt = kt.astype(np.int32)
    for a in (tile_ptr, kt, full):
        a.flags.writeable = False
    return BlockLayout(tile_q, tile_k, n_qt, n_kt, tile_ptr, kt, full)


def _sum_counts(a_codes, a_counts, b_codes, b_counts):
    """Union of two sorted unique code arrays, adding the counts of codes in both."""
    codes = np.concatenate([a_codes, b_codes])
    order = np.argsort(codes, kind="stable")
    codes = codes[order]
    counts = np.concatenate([a_counts, b_counts])[order]
    starts = np.flatnonzero(np.concatenate([[True], codes[1:] != codes[:-1]]))
    return codes[starts], np.add.reduceat(counts, starts)
