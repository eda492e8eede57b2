"""Mask and score functions: any variant a researcher writes down, in the kernels.

A **mask function** ``mask(b, h, i, j, *arrays) -> bool`` says whether query
``i`` of batch element ``b`` and query head ``h`` may attend key ``j``; a
**score function** ``score(s, b, h, i, j, *arrays) -> float`` rewrites the
scaled logit ``s = scale q_i . k_j`` before the bias, the key sizes and the
normalizer see it (docs/contract.md §2.10).  Both are plain Python functions
that Numba can compile; ``arrays`` are the NumPy arrays they read (slopes,
tables, document ids, gates).  Bind a function to its arrays with
:func:`mask_mod` and :func:`score_mod`, or use this module's built-ins, and
pass the result to :func:`attnnb.attention` (``mask_mod=``, ``score_mod=``)::

    def alibi_like(s, b, h, i, j, slopes):
        return s + slopes[h] * (j - i)

    out = attnnb.attention(q, k, v, causal=True,
                           score_mod=mods.score_mod(alibi_like, slopes))

What a function reads by name (globals, closure cells, defaults, helpers to any
depth) is taken at every call (:mod:`attnnb._mods.reads`, contract §2.10): arrays
are passed to the kernels as they are then, numbers and strings are constants
keyed by value, helpers are compiled with the function; anything else is refused
by name.

Masks compose with ``&``, ``|`` and ``~``; score functions chain with ``+``
(``a + b`` applies ``a``, then ``b`` to its result: for additive biases the
sum of both).  The functions are compiled into the tiled kernels (never an
``(Lq, Lk)`` array on the cpu backend), forward and backward.

Gradients (:func:`attnnb.vjp`): ``ds`` flows through ``d score / d s``, taken
from ``grad_s=`` or, without it, derived by the complex step
(``Im f(s + i h) / h`` with ``h = 1e-30``: exact to rounding for a function
built from arithmetic and analytic functions of ``s``; a function that
compares, clips or takes ``abs`` of ``s`` needs ``grad_s=``).  A score
function's float arrays get gradients from ``grad_arrays=``, a function
``grad_arrays(g, s, b, h, i, j, grads, *arrays)`` that adds ``g`` times the
derivative of the score with respect to each entry it read into
``grads`` (a tuple of float64 arrays shaped like ``arrays``); without it
``vjp`` raises, unless the mod was made with ``constant=True`` (its arrays
then get no gradient, ``None``).  :func:`check` compares both derivatives
with central differences.  Integer and boolean arrays never get one.

Speed: a mask function written without branches (``&``, ``|`` and ``~`` on
comparisons rather than ``and``, ``or``, ``if``) lets the tile classifier's
loops vectorise, where a branch per pair leaves them scalar (docs/notes/performance.md,
"Mask and score functions"); the built-ins are written so.

Positions: a user's function gets the row and column indices ``i``, ``j``
as they are.  The built-ins that compare positions read query ``i`` as
sitting at key position ``i + Lk - Lq``, as the kernels' ``causal`` does
(bottom-right aligned: decoding with a KV cache needs no other offset).

Nothing here imports Numba: functions compile on first use
(:mod:`attnnb._mods.compile`).
"""

from __future__ import annotations

from ._mods.core import (  # noqa: F401 - re-exported
    OFFSET,
    MaskMod,
    ScoreMod,
    as_mask_mod,
    as_score_mod,
    capped_tanh,
    constant,
    detached,
    implicit_arrays,
    like,
    mask_mod,
    parameters,
    resolved,
    score_mod,
)
from ._mods.library import (
    alibi,
    causal,
    document,
    forgetting,
    from_cu_seqlens,
    prefix_lm,
    relative_bias,
    sinks,
    sliding_window,
    softcap,
)

__all__ = [
    "MaskMod",
    "ScoreMod",
    "alibi",
    "causal",
    "check",
    "constant",
    "document",
    "forgetting",
    "from_cu_seqlens",
    "like",
    "mask_mod",
    "prefix_lm",
    "relative_bias",
    "score_mod",
    "sinks",
    "sliding_window",
    "softcap",
]


def check(mod: ScoreMod, *, points: int = 64, seed: int = 0, shape=(2, 2, 8, 8),
          rtol: float = 1e-5) -> None:
    """Compare a score mod's derivatives with central differences at random points.

    Draws ``points`` logits ``s`` in ``[-3, 3]`` and indices ``(b, h, i, j)``
    within ``shape`` ``(B, H, Lq, Lk)`` (which the mod's arrays must cover),
    and checks ``d score / d s`` and, unless the mod is constant, the
    gradients into its float arrays (by perturbing each entry) in float64.

    Raises
    ------
    AssertionError
        Naming the function, the derivative and the first point that
        disagrees.
    """
    from ._mods.compile import check_derivatives

    check_derivatives(mod, points=points, seed=seed, shape=shape, rtol=rtol)
