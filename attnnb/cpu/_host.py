"""The host side shared by the tiled CPU kernels: outputs, placeholders, key tiles, launch.

Every tiled kernel (dense, sparse, top-k, differential) takes the same
leading arguments, in this order, followed by its own and then the outputs::

    kernel(q, k, v, kt, v_ok, scale, bias, has_bias, mask, has_mask, logks, has_ks,
           causal, *own, out, lse)

``kt`` and ``v_ok`` are the per-call key-tile buffers
(:func:`attnnb.cpu._scratch.key_tile_buffers`, filled just before by
:func:`attnnb.cpu._prologue.key_tiles_kernel`); ``bias``, ``mask`` and
``logks`` are always arrays (placeholders when absent, so that calls with
and without them share one compiled kernel), with ``has_*`` saying whether
they are real.  :func:`run_sweep` is the one place that builds them,
allocates the outputs and launches.
"""

from __future__ import annotations

import math

import numpy as np

from .._core.codes import SOFTPICK_EPS
from ._jit import launch
from ._prologue import filled_key_tiles

_PLACEHOLDERS: dict = {}


def _dummy_pairwise(dtype):
    # Shaped so that Numba types it like a real broadcast mask or bias (readonly, layout
    # 'A'): calls with and without a mask then share one compiled kernel.  Read-only, so
    # one per dtype serves every call, not a new broadcast each (docs/notes/performance.md,
    # "Compile time and the first call").
    dtype = np.dtype(dtype)
    placeholder = _PLACEHOLDERS.get(dtype)
    if placeholder is None:
        placeholder = np.broadcast_to(np.zeros((), dtype), (1, 1, 2, 2))
        _PLACEHOLDERS[dtype] = placeholder
    return placeholder


def _placeholder_typed(x):
    """``x (B, H, Lq, Lk)`` as a view that Numba types like the placeholders (read-only,
    layout ``'A'``), where that needs no copy.

    Numba compiles a kernel per layout of each argument.  A broadcast mask or
    bias is a read-only view in layout ``'A'``; one without broadcast axes
    (a one-head 2-D call's, or a C-contiguous ``(1, H, Lq, Lk)`` bias) is
    ``'C'`` and would compile every kernel a second time.  Where the batch
    or head axis has length 1, it is given length 2 with stride 0 (the
    kernels index only the real rows), which makes the view ``'A'``.  A
    full ``(B, H, Lq, Lk)`` array with ``B, H > 1`` keeps its own kernels.
    """
    if not (x.flags.c_contiguous or x.flags.f_contiguous or x.flags.writeable):
        return x
    axis = 0 if x.shape[0] == 1 else 1 if x.shape[1] == 1 else None
    if axis is None:
        return x
    shape, strides = list(x.shape), list(x.strides)
    shape[axis], strides[axis] = 2, 0
    return np.lib.stride_tricks.as_strided(x, shape, strides, writeable=False)


def score_arguments(problem):
    """``(bias, mask, logks)`` for the kernel: real arrays or typed placeholders."""
    dt = problem.q.dtype
    bias = _dummy_pairwise(dt) if problem.bias is None else _placeholder_typed(problem.bias)
    mask = (_dummy_pairwise(np.bool_) if problem.mask is None
            else _placeholder_typed(problem.mask))
    if problem.log_key_size is not None:
        logks = problem.log_key_size
    else:
        logks = np.zeros((1, 1), dt)
    return bias, mask, logks


def kernel_sinks(problem):
    """``(B, Hq)`` sink logits for a kernel, C-contiguous: the problem's, ``log eps`` for
    ``softpick`` (its ``eps`` is a sink), or zeros (``B * Hq`` of them: typed as real
    ones, so that one compiled kernel serves every case)."""
    if problem.sinks is not None:
        return problem.sinks
    B, Hq = problem.shape[:2]
    sink = math.log(SOFTPICK_EPS) if problem.normalizer == "softpick" else 0.0
    return np.full((B, Hq), sink, problem.q.dtype)


def run_sweep(kernel_fn, problem, *own, out_heads=None, key_tiles=True):
    """Launch a tiled kernel on a canonical problem; returns ``(out, lse)``.

    Parameters
    ----------
    kernel_fn : a kernel with the leading arguments of this module's docstring.
    problem : :class:`~attnnb._front.validate.Problem` (``q (B, Hq, Lq, D)``,
        ``k (B, Hk, Lk, D)``, ``v (B, Hk, Lk, Dv)``).
    *own : the kernel's own arguments, passed between ``causal`` and ``out``.
    out_heads : int, optional
        Heads of the output when not ``Hq`` (differential attention: ``Hq / 2``).
    key_tiles : bool
        False for a kernel that transposes its key tiles itself (decoding:
        :mod:`attnnb.cpu._decoding`): ``kt`` and ``v_ok`` then have no tiles.

    Returns
    -------
    out : ``(B, out_heads, Lq, Dv)`` and lse : ``(B, out_heads, Lq)``, in the
        compute dtype (a kernel that has no LSE leaves ``lse`` unwritten).
    """
    q, k, v = problem.q, problem.k, problem.v
    B, Hq, _, Lq, _, _, Dv = problem.shape
    heads = Hq if out_heads is None else out_heads
    out = np.empty((B, heads, Lq, Dv), q.dtype)
    lse = np.empty((B, heads, Lq), q.dtype)
    if out.size == 0 and lse.size == 0:
        return out, lse
    bias, mask, logks = score_arguments(problem)
    with filled_key_tiles(k, v, key_tiles) as (kt, v_ok):
        launch(kernel_fn, q, k, v, kt, v_ok, q.dtype.type(problem.scale), bias,
               problem.bias is not None, mask, problem.mask is not None, logks,
               problem.log_key_size is not None, problem.causal, *own, out, lse)
    return out, lse
