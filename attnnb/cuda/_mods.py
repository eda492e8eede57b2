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

from .._mod_compile import Target, arity, bind, compile_mask, compile_score, fingerprint
from ..mods import parameters

CUDA = Target("cuda", lambda fn: cuda.jit(device=True)(fn))


class DeviceMods(NamedTuple):
    """The device functions of a problem's mods (``None`` where it has none).

    ``value(s, b, h, i, j, mods)`` and ``slope`` (``d value / d s``) of the score
    function, ``allowed(b, h, i, j, mods)`` of the mask function; ``tag`` names the
    kernels built with them.
    """

    tag: str
    value: Any = None
    slope: Any = None
    allowed: Any = None


def has_mods(problem) -> bool:
    return problem.mask_mod is not None or problem.score_mod is not None


def device_mods(problem) -> DeviceMods | None:
    """The problem's :class:`DeviceMods`, or None without mods."""
    if not has_mods(problem):
        return None
    parts, fns = [], {}
    offset = 1  # after the origin
    if problem.score_mod is not None:
        score = compile_score(problem.score_mod, offset, CUDA)
        fns.update(value=score.value, slope=score.slope)
        parts.append("s" + fingerprint(problem.score_mod))
        offset += arity(problem.score_mod)
    if problem.mask_mod is not None:
        fns["allowed"] = compile_mask(problem.mask_mod, offset, CUDA).allowed
        parts.append("m" + fingerprint(problem.mask_mod))
    return DeviceMods("mod_" + "_".join(parts), **fns)


def _host_arrays(score_mod, mask_mod, origin, Lq: int, Lk: int, dtype) -> tuple:
    arrays = (np.asarray(origin, np.int64),)
    for mod in (score_mod, mask_mod):
        if mod is not None:
            arrays += bind(mod, Lq, Lk)
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

    problem = SimpleNamespace(score_mod=score_mod, mask_mod=mask_mod)
    arrays = _host_arrays(score_mod, mask_mod, (0, 0), 8, 8, dtype)
    return device_mods(problem), numba.typeof(arrays)


def refuse(problem) -> None:
    """Refuse mods where the cuda backend does not run them yet."""
    if has_mods(problem):
        raise NotImplementedError("mask_mod and score_mod on the cuda backend: attention only "
                                  "for now (the reference and cpu backends run them with "
                                  "every function)")


def refuse_array_gradients(problem) -> None:
    """The cuda backward gives no gradients into a score function's arrays yet: refused
    unless the function is constant (:func:`attnnb.mods.constant`)."""
    from .._mod_compile import needs_array_gradients

    names = [] if problem.score_mod is None else needs_array_gradients(problem.score_mod)
    if names:
        raise NotImplementedError(
            f"gradients into score_mod arrays on the cuda backend: not yet ({', '.join(names)} "
            "reads float arrays that take gradients); mark the mod constant with "
            "attnnb.mods.constant(mod), or run the backward on the cpu backend")


def constant_gradients(score_mod) -> tuple:
    """The sixth result of a backward with a constant score function: None for each of
    its parameters."""
    return (None,) * len(parameters(score_mod))
