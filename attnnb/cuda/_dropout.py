"""Dropout in the cuda kernels: :mod:`attnnb._core.dropout`'s generator as device functions.

The same integer text as the reference and cpu backends compile
(:func:`attnnb._core.dropout.rebound`), so the keep decisions are the same bits
on every backend.  A kernel built with dropout takes ``seed_lo, seed_hi,
batch0, head0, threshold`` (int64; ``batch0, head0`` the problem's
``dropout_origin``, added to its batch and head indices) and ``keep`` (``1 /
(1 - p)``, compute dtype) and forms its rows' keys once per tile.
"""

from __future__ import annotations

from numba import cuda

from .._core import dropout as _dropout


def _device(fn):
    return cuda.jit(device=True)(fn)


row_key = _dropout.rebound(_dropout.row_key, _device)
column_word = _dropout.rebound(_dropout.column_word, _device)
kept = _dropout.rebound(_dropout.kept, _device)


def kernel_dropout(problem, dtype) -> tuple:
    """``(seed_lo, seed_hi, batch0, head0, threshold, keep)`` of a problem for a kernel
    launch (``threshold = 0``: nothing dropped)."""
    if not problem.dropout_p:
        return (0, 0, 0, 0, 0, dtype.type(1.0))
    lo, hi = _dropout.seed_words(problem.seed)
    return (lo, hi, *problem.dropout_origin, _dropout.threshold(problem.dropout_p),
            dtype.type(_dropout.keep_scale(problem.dropout_p)))
