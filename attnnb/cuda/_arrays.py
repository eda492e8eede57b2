"""Moving a canonical problem's arrays to the device, and back.

A problem built from NumPy inputs (``backend="cuda"``) holds host arrays:
they are copied to the device here, masks and biases in their compact
(unbroadcast) form, and the results are copied back by :func:`finish`.  A
problem built from device inputs (see :mod:`attnnb._front.device`) already holds
device arrays; they are used in place and the results stay on the device.

Optional inputs that are absent become one-element placeholders so that a
kernel has one argument list (the ``has_*`` flags say which are real).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
from numba import cuda
from numba.np.numpy_support import from_dtype as numba_type

from .._core.codes import SOFTPICK_EPS
from .._front.device import compact
from .._front.device_kernels import build_shift
from .._front.validate import lse_dtype
from ._mods import mods_argument


def _placeholder(shape, dtype):
    return cuda.to_device(np.zeros(shape, dtype))


def device_problem(problem) -> SimpleNamespace:
    """Device arrays, flags and dtypes for a kernel launch.

    Returns a namespace with ``q, k, v`` (device), ``mask, bias`` (4-D,
    each axis of full length or 1), ``logks`` (``(B or 1, Lk or 1)``), the
    ``has_mask / has_bias / has_ks`` flags, ``dtype`` (compute), ``out_dtype``,
    ``lse_dtype``, ``on_device``, ``sinks`` (``(B, Hq)`` sink logits, or one
    ``(1, 1)``: 0, or ``log eps`` for ``softpick``) and ``mods`` (the mods'
    kernel argument, :func:`attnnb.cuda._mods.mods_argument`).
    """
    q, k, v = problem.q, problem.k, problem.v
    dtype = problem.compute_dtype
    if problem.on_device:
        out_dtype = np.dtype(problem.out_dtype)
        mask, bias, logks = problem.mask, problem.bias, problem.log_key_size
    else:
        out_dtype = dtype
        q, k, v = (cuda.to_device(x) for x in (q, k, v))
        mask = None if problem.mask is None else cuda.to_device(compact(problem.mask))
        bias = None if problem.bias is None else cuda.to_device(compact(problem.bias))
        logks = (None if problem.log_key_size is None
                 else cuda.to_device(compact(problem.log_key_size)))
    return SimpleNamespace(
        q=q, k=k, v=v,
        mask=mask if mask is not None else _placeholder((1, 1, 1, 1), np.bool_),
        bias=bias if bias is not None else _placeholder((1, 1, 1, 1), dtype),
        logks=logks if logks is not None else _placeholder((1, 1), dtype),
        has_mask=mask is not None, has_bias=bias is not None, has_ks=logks is not None,
        dtype=np.dtype(dtype), out_dtype=out_dtype, lse_dtype=lse_dtype(out_dtype),
        on_device=problem.on_device, mods=mods_argument(problem, dtype),
        sinks=cuda.to_device(np.ascontiguousarray(_sinks(problem), dtype)),
    )


def _sinks(problem):
    """The kernels' sink logits: the problem's learned ones, ``log eps`` for ``softpick``
    (its ``eps`` is a sink) or 0."""
    if problem.sinks is not None:
        return problem.sinks
    return np.full((1, 1), math.log(SOFTPICK_EPS) if problem.normalizer == "softpick" else 0.0)


def outputs(shape_out, shape_lse, arrays):
    """Device arrays for ``out`` and ``lse`` in the result dtypes."""
    return (cuda.device_array(shape_out, arrays.out_dtype),
            cuda.device_array(shape_lse, arrays.lse_dtype))


def finish(arrays, *results):
    """Results as they are (device problems) or copied to the host."""
    if arrays.on_device:
        return results
    return tuple(r.copy_to_host() for r in results)


def ptx_signatures():
    """``[(name, python function, argument types)]`` for the PTX check: the bias shift."""
    return [(f"shift {np.dtype(dt).name}", build_shift(np.dtype(dt)),
             (numba_type(dt)[::1], numba_type(dt), numba_type(dt)[::1]))
            for dt in (np.float32, np.float64)]
