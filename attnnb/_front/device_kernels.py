"""The one kernel of validation's device path: a device bias plus ``sigmoid``'s offset.

Validation's own, so that it reaches into no backend; it imports ``numba.cuda`` and is
imported only when there is a device array to shift (:func:`attnnb._front.device.shifted_bias`).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

SHIFT_THREADS = 128  # threads per block


def build_shift(dtype):
    """Kernel, one thread an element: ``out = x + offset`` over flat arrays, ``x`` of any
    real dtype converted to ``dtype`` (``offset``'s and ``out``'s)."""
    CAST = np.dtype(dtype).type

    def shift_kernel(x, offset, out):
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if e < out.shape[0]:
            out[e] = CAST(x[e]) + offset

    return shift_kernel


@functools.cache
def shift_kernel(dtype: str):
    """The compiled kernel of :func:`build_shift` for ``dtype`` (its ``str``)."""
    return cuda.jit(build_shift(np.dtype(dtype)))
