"""Scalar formulas that compile for every target: plain Python, no Numba.

Like :mod:`attnnb._selection`, each backend compiles these with its own
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
