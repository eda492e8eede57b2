"""Where a mask or score function (:mod:`attnnb.mods`) enters the tiled kernels.

The kernels call the tile loops below on every tile.  As compiled in this
module they do nothing (``SCORE_FN`` and ``MASK_FN`` are False, constants
that Numba folds), so a call without mods runs the kernels it always ran.
For a call with mods, :func:`attnnb._core.specialise.specialise` compiles copies of the
kernels in which ``SCORE_FN``/``MASK_FN`` are True and ``mod_value``,
``mod_slope``, ``mod_agrad`` and ``mod_allowed`` are the mod's own compiled
functions (:mod:`attnnb._mods.compile`), inlined into the loops.

Every kernel takes the mods as one flat tuple argument, ``mods = (origin,
*score_arrays, *mask_arrays)``: ``origin`` int64 ``(2,)`` is the ``(b0,
h0)`` added to the batch element and head the functions see (a problem that
is part of a larger call), then the arrays of the score and of the mask
functions (:func:`attnnb._mods.compile.bind`), which the compiled functions
read at their static places (:func:`attnnb.cpu._mods.mod_kernel`).
"""

from __future__ import annotations

import numpy as np

from ._jit import inner
from ._tiles import TILE_K, TILE_Q, view2d

SCORE_FN = False
MASK_FN = False


@inner
def mod_value(s, b, h, i, j, args):
    """The score function (the identity here)."""
    return s


@inner
def mod_slope(s, b, h, i, j, args):
    """``d mod_value / d s`` (1 here)."""
    return 1.0


@inner
def mod_agrad(g, s, b, h, i, j, grads, args):
    """Add ``g`` times the score function's derivative into its arrays' ``grads``."""


@inner
def mod_allowed(b, h, i, j, args):
    """The mask function (everything allowed here)."""
    return True


@inner
def mod_grad_views(mod_grads, slot):
    """The gradient buffers of one accumulation group: ``mod_grads[n][slot]`` for each
    array (a copy binds a function of the mod's arity; here nothing is read)."""
    return mod_grads


# Groups of backward tasks that own one set of the score function's array gradients
# (summed on the host in group order: the same bits whatever the threads' schedule).
MOD_GRAD_GROUPS = 64


@inner
def task_groups(n_tasks):
    """How many groups the backward's ``n_tasks`` run in: one task each without a score
    function, else at most :data:`MOD_GRAD_GROUPS` (tasks ``g, g + n, g + 2n, ...``)."""
    if SCORE_FN:
        return min(n_tasks, MOD_GRAD_GROUPS)
    return n_tasks


@inner
def mod_scratch(dt):
    """Two tile buffers for the score function's logits before it and its slopes (none
    without one)."""
    n = TILE_Q * TILE_K if SCORE_FN else 0
    return np.empty(n, dt), np.empty(n, dt)


@inner
def raw_gradients(dS, M_flat):
    """``dS`` (the gradient of the score function's values) times its slopes (``M_flat``
    as ``(nq, nk)``): the gradient of the logits ``q k^T`` (a zero stays zero, whatever
    the slope)."""
    if SCORE_FN:
        nq, nk = dS.shape
        M = view2d(M_flat, nq, nk)
        for r in range(nq):
            for c in range(nk):
                if dS[r, c] != 0.0:
                    dS[r, c] *= M[r, c]


@inner
def score_tile(S, b, h, i0, j0, mods):
    """Apply the score function to the logits ``S (nq, nk)`` of queries ``i0..`` and keys
    ``j0..`` in place (the forward's: its slope is never compiled there, so a function
    without one runs forward)."""
    if SCORE_FN:
        nq, nk = S.shape
        origin = mods[0]
        bb, hh = b + origin[0], h + origin[1]
        for r in range(nq):
            for c in range(nk):
                S[r, c] = mod_value(S[r, c], bb, hh, i0 + r, j0 + c, mods)


@inner
def score_tile_kept(S, R_flat, G_flat, b, h, i0, j0, mods):
    """:func:`score_tile` for the backward: the logits before it go to ``R_flat`` and
    ``d value / d s`` to ``G_flat`` (both as ``(nq, nk)``)."""
    if SCORE_FN:
        nq, nk = S.shape
        R = view2d(R_flat, nq, nk)
        G = view2d(G_flat, nq, nk)
        origin = mods[0]
        bb, hh = b + origin[0], h + origin[1]
        for r in range(nq):
            for c in range(nk):
                x = S[r, c]
                R[r, c] = x
                G[r, c] = mod_slope(x, bb, hh, i0 + r, j0 + c, mods)
                S[r, c] = mod_value(x, bb, hh, i0 + r, j0 + c, mods)


@inner
def mask_tile(S, b, h, i0, j0, partial, mods):
    """Set the logits of ``S (nq, nk)`` that the mask function disallows to ``-inf``, in a
    tile the tile map calls ``partial`` (in full tiles every pair is allowed)."""
    if MASK_FN and partial:
        nq, nk = S.shape
        origin = mods[0]
        bb, hh = b + origin[0], h + origin[1]
        for r in range(nq):
            for c in range(nk):
                if not mod_allowed(bb, hh, i0 + r, j0 + c, mods):
                    S[r, c] = -np.inf


@inner
def add_array_gradients(dS, R_flat, b, h, i0, j0, mods, grads):
    """Add the score function's array gradients of one tile, ``dS (nq, nk)`` the gradient
    of its values and ``R_flat`` its logits before it, into ``grads`` (this task's
    group's)."""
    if SCORE_FN:
        nq, nk = dS.shape
        R = view2d(R_flat, nq, nk)
        origin = mods[0]
        bb, hh = b + origin[0], h + origin[1]
        for r in range(nq):
            for c in range(nk):
                g = dS[r, c]
                if g != 0.0:  # a pair the output does not read gives nothing
                    mod_agrad(g, R[r, c], bb, hh, i0 + r, j0 + c, grads, mods)


def no_mods() -> tuple:
    """The ``mods`` argument of a call without mods."""
    return (np.zeros(2, np.int64),)
