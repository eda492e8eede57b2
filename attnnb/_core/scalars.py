"""Scalar formulas that compile for every target: plain Python, no Numba.

Like :mod:`attnnb._core.selection`, each backend compiles these with its own
decorator (``cpu`` as inlined ``numba.njit`` functions, ``cuda`` as device
functions), so that one formula serves both and neither backend imports
the other.  ``one`` is passed in so that each backend keeps its own
arithmetic type: the ``cuda`` kernels pass ``1`` in the compute dtype, the
``cpu`` kernels the float ``1.0``.
"""

from __future__ import annotations

import math


def sigmoid(x, one):
    """``1 / (1 + exp(-x))`` without overflow for any ``x`` (``exp`` of ``-|x|`` only):
    ``softmax1``'s row factor ``sigmoid(lse)``."""
    a = math.exp(-abs(x))
    return one / (one + a) if x >= 0 else a / (one + a)


def log_add_exp(x, y):
    """``log(e^x + e^y)`` without overflow: a normaliser with a learned sink added,
    ``log(e^lse + e^sink)``.  NaN stays NaN; ``-inf`` and ``-inf`` give ``-inf``."""
    if x != x or y != y:
        return x + y
    top = max(x, y)
    if top - top != top - top:  # +-inf (NaN is handled above); no literal: x's type stays
        return top
    return top + math.log1p(math.exp(min(x, y) - top))
