"""The one kernel of validation's device path: a device bias plus ``sigmoid``'s offset.

Validation's own, so that it reaches into no backend; it imports ``numba.cuda`` and is
imported only when there is a device array to shift (:func:`attnnb._front.device.shifted_bias`).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .._core.specialise import specialise, template

SHIFT_THREADS = 128  # threads per block


CAST = None  # the compute dtype's scalar type, bound per dtype (build_shift)


def shift_elements(x, offset, out):
    """One thread an element: ``out = x + offset`` over flat arrays, ``x`` of any real
    dtype converted to ``CAST`` (``offset``'s and ``out``'s)."""
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if e < out.shape[0]:
        out[e] = CAST(x[e]) + offset


template(shift_elements, lambda fn: fn, py=shift_elements)  # copies: Python functions


def build_shift(dtype):
    """:func:`shift_elements` for ``dtype``, not compiled yet."""
    dtype = np.dtype(dtype)
    return specialise(shift_elements, {"CAST": dtype.type}, f"shift_{dtype.name}",
                      required=["CAST"])


@functools.cache
def shift_kernel(dtype: str):
    """The compiled kernel of :func:`build_shift` for ``dtype`` (its ``str``)."""
    return cuda.jit(build_shift(np.dtype(dtype)))
