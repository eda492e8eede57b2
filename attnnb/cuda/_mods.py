"""Mask and score functions (:mod:`attnnb.mods`) on the cuda backend.

A problem's mods become device functions (:func:`device_mods`), compiled into
the register-tiled core by :func:`attnnb.cuda._micro.micro_functions`, and a
``mods`` kernel argument (:func:`mods_argument`): ``(origin, *score_arrays,
*mask_arrays)`` as device arrays, ``origin = [b0, h0]`` the problem's first batch
element and head in the call (a chunked call's part sees the call's indices).
Float arrays are converted to the compute dtype, so that a float32 kernel does
float32 arithmetic.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
from numba import cuda

from .._mods import compile as compiled

CUDA = compiled.Target("cuda", lambda fn: cuda.jit(device=True)(fn))


class DeviceMods(NamedTuple):
    """The device functions of a problem's mods (``None`` where it has none).

    ``value(s, b, h, i, j, mods)`` and ``slope`` (``d value / d s``) of the score
    function, ``allowed(b, h, i, j, mods)`` of the mask function; ``agrad(g, s, b, h,
    i, j, grads, mods)`` and ``views(mod_grads, slot)``
    (:func:`attnnb._mods.compile.grad_views`) when the score function's arrays take
    gradients; ``tag`` names the kernels built with them.
    """

    tag: str
    value: Any = None
    slope: Any = None
    allowed: Any = None
    agrad: Any = None
    views: Any = None


def has_mods(problem) -> bool:
    return problem.mask_mod is not None or problem.score_mod is not None


def device_mods(problem) -> DeviceMods | None:
    """The problem's :class:`DeviceMods`, or None without mods."""
    if not has_mods(problem):
        return None
    parts, fns = [], {}
    offset = 1  # after the origin
    if problem.score_mod is not None:
        score = compiled.compile_score(problem.score_mod, offset, CUDA)
        fns.update(value=score.value, slope=score.slope)
        parts.append("s" + compiled.fingerprint(problem.score_mod))
        offset += compiled.arity(problem.score_mod)
        if compiled.needs_array_gradients(problem.score_mod):
            masks = 0 if problem.mask_mod is None else compiled.arity(problem.mask_mod)
            n_arrays = offset + masks
            fns.update(agrad=score.agrad, views=compiled.grad_views(n_arrays, CUDA))
    if problem.mask_mod is not None:
        fns["allowed"] = compiled.compile_mask(problem.mask_mod, offset, CUDA).allowed
        parts.append("m" + compiled.fingerprint(problem.mask_mod))
    return DeviceMods("mod_" + "_".join(parts), **fns)


def _host_arrays(score_mod, mask_mod, origin, Lq: int, Lk: int, dtype) -> tuple:
    arrays = (np.asarray(origin, np.int64),)
    for mod in (score_mod, mask_mod):
        if mod is not None:
            arrays += compiled.bind(mod, Lq, Lk)
    return tuple(a.astype(dtype) if a.dtype.kind == "f" else a for a in arrays)


def mods_argument(problem, dtype) -> tuple:
    """The ``mods`` kernel argument: ``(origin, *score_arrays, *mask_arrays)`` on the
    device (module notes); ``()`` without mods."""
    if not has_mods(problem):
        return ()
    arrays = _host_arrays(problem.score_mod, problem.mask_mod, problem.dropout_origin,
                          problem.q.shape[2], problem.k.shape[2], dtype)
    return tuple(cuda.to_device(a) for a in arrays)


def ptx_mods(dtype, score_mod=None, mask_mod=None) -> tuple:
    """``(DeviceMods, argument type)`` of a kernel built with these mods, for the PTX
    check."""
    import numba

    from .._mods.core import resolved

    score_mod, mask_mod = resolved(score_mod), resolved(mask_mod)
    problem = SimpleNamespace(score_mod=score_mod, mask_mod=mask_mod)
    arrays = _host_arrays(score_mod, mask_mod, (0, 0), 8, 8, dtype)
    return device_mods(problem), numba.typeof(arrays)


# the largest gradient buffers of a score function's arrays (a copy per key-tile block)
MAX_GRADIENT_BYTES = 1 << 30


def gradient_buffers(problem, n_blocks: int) -> tuple:
    """Zeroed float64 device buffers ``(n_blocks, *shape)`` for every array of the
    ``mods`` argument (the backward's key-tile blocks each add into their own slot,
    one thread in a fixed order: no atomics, the same bits from run to run); ``()``
    when the score function's arrays take no gradient."""
    if problem.score_mod is None or not compiled.needs_array_gradients(problem.score_mod):
        return ()
    shapes = [a.shape for a in _host_arrays(problem.score_mod, problem.mask_mod, (0, 0),
                                            problem.q.shape[2], problem.k.shape[2],
                                            np.float64)]
    total = n_blocks * sum(int(np.prod(s, dtype=np.int64)) for s in shapes) * 8
    if total > MAX_GRADIENT_BYTES:
        raise NotImplementedError(
            f"gradients into score_mod {problem.score_mod.name!r}'s arrays on the cuda "
            f"backend would take {total} bytes of buffers (a copy for each of {n_blocks} "
            "blocks); mark the mod constant with attnnb.mods.constant(mod), or run the "
            "backward on the cpu backend")
    return tuple(cuda.to_device(np.zeros((n_blocks,) + tuple(s), np.float64)) for s in shapes)


def parameter_gradients(problem, buffers: tuple) -> tuple:
    """The score function's parameters' gradients (the sixth result of a backward): its
    blocks' buffers summed in block order, or None for each parameter of a constant
    function (or one of no work: zeros)."""
    n = compiled.arity(problem.score_mod)
    if not buffers:
        Lq, Lk = problem.q.shape[2], problem.k.shape[2]
        grads = compiled.zero_grads(compiled.bind(problem.score_mod, Lq, Lk))
    else:
        grads = tuple(b.copy_to_host().sum(axis=0) for b in buffers[1:1 + n])
    return compiled.param_grads(problem.score_mod, grads)
