"""Mask and score functions evaluated by the reference itself: the user's Python.

The kernels compile a mod's functions, with what they read taken at the
call (:mod:`attnnb._mods.reads`), into one composition.  The oracle must not
share a mistake of that machinery, so here each function runs as the Python
the user wrote, in float64, reading its globals and closures as Python does
(helpers wrapped in ``numba.njit`` run as their Python functions), composed
by NumPy (``&``, ``|``, ``~``, chains, a block's shifted indices).

A function is first called on whole rows (``i`` a column, ``j`` a row of
int64 indices, ``s`` an array), as FlexAttention's functions are written;
one that cannot take arrays (a branch, ``min``, ``math.exp``) or returns the
wrong shape is called entry by entry, with int64 and float64 scalars as the
kernels pass.
"""

from __future__ import annotations

import numpy as np

from .._mods.core import OFFSET, as_numpy, resolved

COMPLEX_STEP = 1e-30


def _leaf_arrays(leaf, Lq: int, Lk: int) -> tuple:
    return tuple(np.array([Lk - Lq], np.int64) if a is OFFSET else np.asarray(a)
                 for a in leaf.arrays)


def _on_rows(fn, fixed: tuple, grid: tuple, tail: tuple):
    """``fn(*fixed, *grid, *tail)`` over the broadcast ``grid`` arrays: whole, or entry by
    entry when ``fn`` does not take arrays."""
    shape = np.broadcast_shapes(*(np.shape(x) for x in grid))
    try:
        with np.errstate(all="ignore"):
            out = np.asarray(fn(*fixed, *grid, *tail))
        return np.broadcast_to(out, shape)
    except Exception:  # noqa: BLE001 - a scalar function: called entry by entry below
        pass
    parts = np.broadcast_arrays(*grid)
    out = np.empty(shape, object)
    for index in np.ndindex(shape):
        out[index] = fn(*fixed, *(p[index] for p in parts), *tail)
    return out


def _mask(mod, Lq: int, Lk: int):
    """``allowed(b, h, i, j)`` of a mask mod, over int64 arrays ``i``, ``j``."""
    if mod.kind == "fn":
        fn, arrays = mod.reads[0].python(), _leaf_arrays(mod, Lq, Lk)
        return lambda b, h, i, j: _on_rows(fn, (b, h), (i, j), arrays).astype(bool)
    if mod.kind == "at":
        o = mod.arrays[0]
        inner = _mask(mod.parts[0], *(int(n) for n in mod.arrays[1]))
        return lambda b, h, i, j: inner(b + o[0], h + o[1], i + o[2], j + o[3])
    inner = [_mask(p, Lq, Lk) for p in mod.parts]
    if mod.kind == "not":
        return lambda b, h, i, j: ~inner[0](b, h, i, j)
    combine = np.logical_and if mod.kind == "and" else np.logical_or
    return lambda b, h, i, j: combine(inner[0](b, h, i, j), inner[1](b, h, i, j))


def _score(mod, Lq: int, Lk: int, slope: bool):
    """``value(s, b, h, i, j)`` of a score mod (``d value / d s`` with ``slope``)."""
    if mod.kind == "fn":
        arrays = _leaf_arrays(mod, Lq, Lk)
        fn = mod.reads[0].python()
        if not slope:
            return lambda s, b, h, i, j: _on_rows(
                lambda b_, h_, s_, i_, j_, *a: fn(s_, b_, h_, i_, j_, *a), (b, h), (s, i, j),
                arrays).astype(np.float64)
        if mod.grad_s is not None:
            given = mod.reads[1].python()
            return lambda s, b, h, i, j: _on_rows(
                lambda b_, h_, s_, i_, j_, *a: given(s_, b_, h_, i_, j_, *a), (b, h),
                (s, i, j), arrays).astype(np.float64)

        def complex_step(s, b, h, i, j):
            at = np.asarray(s, np.float64) + 1j * COMPLEX_STEP
            out = _on_rows(lambda b_, h_, s_, i_, j_, *a: fn(s_, b_, h_, i_, j_, *a), (b, h),
                           (at, i, j), arrays)
            return np.imag(out.astype(np.complex128)) / COMPLEX_STEP
        return complex_step
    if mod.kind == "at":
        o = mod.arrays[0]
        inner = _score(mod.parts[0], *(int(n) for n in mod.arrays[1]), slope)
        return lambda s, b, h, i, j: inner(s, b + o[0], h + o[1], i + o[2], j + o[3])
    first, then = (_score(p, Lq, Lk, False) for p in mod.parts)
    if not slope:
        return lambda s, b, h, i, j: then(first(s, b, h, i, j), b, h, i, j)
    d_first, d_then = (_score(p, Lq, Lk, True) for p in mod.parts)
    return lambda s, b, h, i, j: (d_then(first(s, b, h, i, j), b, h, i, j)
                                  * d_first(s, b, h, i, j))


def _indices(Lq: int, Lk: int, rows):
    i = np.arange(Lq, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    return i[:, None], np.arange(Lk, dtype=np.int64)[None, :]


def mask_values(mod, shape: tuple, origin=(0, 0), rows=None) -> np.ndarray:
    """bool ``(B, H, n, Lk)``: the mask mod at query rows ``rows`` (all ``Lq`` by default)
    of a problem of ``shape`` ``(B, H, Lq, Lk)``, whose first batch element and head are
    ``origin`` in the call."""
    mod = resolved(mod)
    B, H, Lq, Lk = shape
    allowed = _mask(mod, Lq, Lk)
    i, j = _indices(Lq, Lk, rows)
    out = np.empty((B, H, i.shape[0], Lk), bool)
    for b in range(B):
        for h in range(H):
            out[b, h] = allowed(np.int64(b + origin[0]), np.int64(h + origin[1]), i, j)
    return out


def score_values(mod, s: np.ndarray, Lq: int, origin=(0, 0), rows=None, with_slope=False):
    """``(value, slope)`` float64 of the score mod at every logit of ``s (B, H, n, Lk)``,
    the rows ``rows`` (all ``Lq`` by default) of a problem with ``Lq`` queries; ``slope``
    (``d value / d s``) is None unless asked."""
    mod = resolved(mod)
    s = np.asarray(s, np.float64)
    B, H, _, Lk = s.shape
    i, j = _indices(Lq, Lk, rows)
    value = _score(mod, Lq, Lk, False)
    derivative = _score(mod, Lq, Lk, True) if with_slope else None
    out = np.empty_like(s)
    slope = np.empty_like(s) if with_slope else None
    for b in range(B):
        for h in range(H):
            at = (np.int64(b + origin[0]), np.int64(h + origin[1]), i, j)
            out[b, h] = value(s[b, h], *at)
            if with_slope:
                slope[b, h] = derivative(s[b, h], *at)
    return out, slope


def array_gradients(mod, g: np.ndarray, s: np.ndarray, origin=(0, 0)) -> tuple:
    """The gradients of the score mod's parameters, flat in leaf order (None for integer
    and boolean arrays and constant leaves), from ``g = dL / d value`` and the logits
    ``s``, both float64 ``(B, H, Lq, Lk)``: each leaf's ``grad_arrays`` called at every
    pair that ``g`` reads, with the leaf's logit there (a chain's later functions see
    its earlier functions' values, and ``g`` scaled by their slopes)."""
    mod = resolved(mod)
    return _leaf_gradients(mod, np.asarray(g, np.float64), np.asarray(s, np.float64),
                           (origin[0], origin[1], 0, 0), s.shape[2], s.shape[3])


def _leaf_gradients(mod, g, s, shift, Lq, Lk) -> tuple:
    if mod.kind == "at":
        o = mod.arrays[0]
        inner = tuple(int(a) + int(b) for a, b in zip(shift, o))
        return _leaf_gradients(mod.parts[0], g, s, inner, *(int(n) for n in mod.arrays[1]))
    if mod.kind == "chain":
        first, then = mod.parts
        t = _pairs(_score(first, Lq, Lk, False), s, shift)
        d_then = _pairs(_score(then, Lq, Lk, True), t, shift)
        return (_leaf_gradients(first, g * d_then, s, shift, Lq, Lk)
                + _leaf_gradients(then, g, t, shift, Lq, Lk))
    arrays = _leaf_arrays(mod, Lq, Lk)
    grads = tuple(np.zeros(a.shape, np.float64) for a in arrays)
    if not mod.constant and mod.grad_arrays is not None:
        fn = mod.reads[2].python()
        for b, h, i, j in zip(*np.nonzero(g)):
            fn(g[b, h, i, j], s[b, h, i, j], np.int64(b + shift[0]), np.int64(h + shift[1]),
               np.int64(i + shift[2]), np.int64(j + shift[3]), grads, *arrays)
    own = tuple(None if mod.constant or a.dtype.kind != "f" else d
                for a, d, given in zip(arrays, grads, mod.arrays) if given is not OFFSET)
    if mod.to_params is not None:
        own = mod.to_params(own)
    dtypes = [as_numpy("a parameter", p).dtype for p in mod.params]
    return tuple(None if d is None or dt.kind != "f" else d.astype(dt, copy=False)
                 for d, dt in zip(own, dtypes))


def _pairs(fn, s, shift):
    """``fn(s, b, h, i, j)`` at every entry of ``s (B, H, Lq, Lk)`` shifted by ``shift``."""
    B, H, Lq, Lk = s.shape
    i, j = _indices(Lq, Lk, None)
    out = np.empty_like(s)
    for b in range(B):
        for h in range(H):
            out[b, h] = fn(s[b, h], np.int64(b + shift[0]), np.int64(h + shift[1]),
                           i + shift[2], j + shift[3])
    return out
