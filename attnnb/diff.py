"""Differential attention (Diff Transformer): :func:`diff_attention` and its helpers.

Differential attention (Ye et al. 2024, arXiv 2410.05258) computes two
softmax maps per head pair and subtracts them, ``(A1 - lam * A2) @ v``, so
that attention noise common to both maps cancels.  The layout is the one of
the reference implementation (``microsoft/unilm``, ``Diff-Transformer/``):

* ``q: (*batch, 2H, Lq, d)`` -- heads ``2h`` and ``2h + 1`` form query pair ``h``;
* ``k: (*batch, 2Hk, Lk, d)`` -- heads ``2g`` and ``2g + 1`` form key pair ``g``;
* ``v: (*batch, Hk, Lk, 2d)`` -- one value head per key pair.

The helpers :func:`lambda_init`, :func:`reparam_lambda` and :func:`subln`
are the other pieces of the paper's layer (``MultiheadDiffAttn``):
``lam = reparam_lambda(...)``, then ``subln(diff_attention(...), weight,
lambda_init=...)`` before the output projection.
"""

from __future__ import annotations

import math

import numpy as np

from ._core.dropout import refuse_lazy_dropout
from ._dask import any_dask
from ._front import eager as _eager
from ._front.checks import as_named_array
from ._front.function_args import MODES
from ._front.validate import compute_dtypes, float_dtype_of

__all__ = ["diff_attention", "lambda_init", "reparam_lambda", "subln", "MODES"]


def diff_attention(q, k, v, lam, *, mask=None, bias=None, key_size=None, causal=False,
                   scale=None, mode="difference", dropout_p=0.0, seed=None, sinks=None,
                   mask_mod=None, score_mod=None, backend=None):
    """Differential attention: ``(A1 - lam * A2) @ v`` for every head pair.

    Parameters
    ----------
    q : array ``(*batch, 2H, Lq, d)``
        Query heads ``2h`` and ``2h + 1`` are the two components of pair ``h``.
    k : array ``(*batch, 2Hk, Lk, d)``
        Key heads ``2g`` and ``2g + 1`` form key pair ``g``.  ``H`` must be a
        multiple of ``Hk`` (grouped-query attention): query pair ``h`` uses key
        pair and value head ``g = h // (H // Hk)``, component with component
        (``q[2h]`` with ``k[2g]``, ``q[2h+1]`` with ``k[2g+1]``), as in the
        reference's ``multihead_flashdiff_1.py``.  The reference's naive
        ``multihead_diffattn.py`` repeats the key *heads* instead
        (``repeat_kv``), so that under GQA query head ``2h + c`` meets key head
        ``(2h + c) // (H // Hk)``; both agree when ``Hk == H``.
    v : array ``(*batch, Hk, Lk, Dv)``
        One value head per key pair; ``Dv`` is ``2d`` in the paper but may be
        any width.
    lam : float or array broadcastable to ``(*batch, H, Lq)``
        One value per layer (the paper's version 1), per head (pass shape
        ``(H, 1)``) or per head and token (version 2).  Cast to the compute
        dtype; must be finite.
    mask : bool array broadcastable to ``(*batch, H, Lq, Lk)``, optional
        True where query ``i`` may attend key ``j``; one mask per head *pair*,
        applied to both maps.
    bias : array broadcastable to ``(*batch, H, Lq, Lk)``, optional
        Added to the scaled logits of both maps.
    key_size : positive array broadcastable to ``(*batch, Lk)``, optional
        Proportional attention, applied to both maps: key ``j`` counts as
        ``key_size[j]`` identical keys in ``A1`` and in ``A2``.
    causal : bool
        Key ``j`` allowed for query ``i`` only when ``j <= i + Lk - Lq``.
    scale : float, optional
        Logit scale, default ``1 / sqrt(d)``.
    mode : {"difference", "rectified", "heaviside"}
        ``"difference"``: weights ``A1 - lam * A2`` (the paper).
        ``"rectified"``: weights ``max(0, A1 - lam * A2)``, elementwise on the
        final weights (key sizes included), not renormalised.
        ``"heaviside"``: weights ``A1 - lam * H(A1 - lam * A2)``, the formula
        of the discussion attnnb grew from read literally (docs/contract.md
        §2.4): ``lam`` is subtracted from ``A1`` wherever ``A1 > lam A2``
        (``H(x) = 1`` for ``x > 0``, else 0); the gate is held fixed in the
        gradients, so ``A2`` gets none.
    dropout_p : float
        Attention dropout on the combined weights: weight ``(b, h, i, j)`` of
        pair ``h`` (``A1 - lam A2``, or its rectified value) is dropped with
        probability ``dropout_p`` and kept ones are scaled by ``1 / (1 -
        dropout_p)``; in the difference mode both maps' entries go together.
        The decisions are those of :func:`attnnb.attention` for head ``h``
        and the same seed (not with Dask arrays).
    seed : int in ``[0, 2**64)``, optional
        Required when ``dropout_p > 0``.
    sinks : real array broadcastable to ``(*batch, 2H)``, optional
        Learned attention sinks, one per *component map*: query head ``2h + c``'s
        sink enters the denominator of map ``c`` of pair ``h``, ``A_c =
        e^s / (e^sink + sum e^s)`` (:func:`attnnb.attention`'s ``sinks``), in
        every mode; :func:`attnnb.vjp` gives its gradient.  With Dask arrays a
        NumPy array.
    mask_mod, score_mod : optional
        As in :func:`attnnb.attention` (:mod:`attnnb.mods`), for both maps of
        a pair; ``h`` is the pair's index.
    backend : {None, "auto", "reference", "cpu", "cuda"}

    Returns
    -------
    out : array ``(*batch, H, Lq, Dv)``
        In the result dtype of q, k, v (float16 is computed in float32).

    Notes
    -----
    ``A1`` and ``A2`` are the softmax maps of the pair's two components over
    the same allowed set (mask, causal limit, ``-inf`` bias); other
    normalizers are not offered (use :func:`attnnb.attention` with
    ``normalizer=``).  A row with no allowed key has ``A1 = A2 = 0`` and gets
    zeros.  In the rectified mode keys outside the allowed set get weight
    zero, and merging ``n`` duplicate keys into one of size ``n`` leaves the
    output unchanged as for softmax (``max(0, n a) = n max(0, a)``).
    2-D input is rejected: the head axis carries the pairs.  Unlike softmax
    attention, the output may leave the convex hull of the values.
    """
    if any_dask(q, k, v):
        from ._dask.ops import diff_attention as lazy

        refuse_lazy_dropout(dropout_p)
        return lazy(q, k, v, lam, mask=mask, bias=bias, key_size=key_size, causal=causal,
                    scale=scale, mode=mode, sinks=sinks, mask_mod=mask_mod,
                    score_mod=score_mod, backend=backend)
    return _eager.diff_attention(q, k, v, lam, mask=mask, bias=bias, key_size=key_size,
                                 causal=causal, scale=scale, mode=mode, dropout_p=dropout_p,
                                 seed=seed, sinks=sinks, mask_mod=mask_mod,
                                 score_mod=score_mod, backend=backend)


def _real(name, x):
    """``np.asarray(x)`` for real numeric (not bool, not complex) input."""
    arr = as_named_array(name, x)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be real numbers; got dtype {arr.dtype}")
    return arr


def _scalar_or_array(x):
    return float(x) if np.ndim(x) == 0 else x


def lambda_init(depth):
    """The reference's initial ``lambda`` of a layer: ``0.8 - 0.6 * exp(-0.3 * depth)``.

    Parameters
    ----------
    depth : int, float or array
        The layer index, counted from 0 as in the reference code.

    Returns
    -------
    float or ndarray (float64), the shape of ``depth``.
    """
    d = _real("depth", depth).astype(np.float64)
    return _scalar_or_array(0.8 - 0.6 * np.exp(-0.3 * d))


def reparam_lambda(lq1, lk1, lq2, lk2, lambda_init):
    """The paper's re-parameterised lambda: ``exp(lq1·lk1) - exp(lq2·lk2) + lambda_init``.

    Parameters
    ----------
    lq1, lk1, lq2, lk2 : arrays ``(..., d)``
        The learned vectors; leading axes broadcast (e.g. ``(H, d)`` for one
        lambda per head).  Dot products run over the last axis.
    lambda_init : float or array broadcastable to the result
        Usually :func:`lambda_init` of the layer's depth.

    Returns
    -------
    float or ndarray
        Shape: the broadcast leading axes (a float for 1-D vectors), in the
        result dtype of the inputs (at least float32).  A per-head result of
        shape ``(H,)`` is passed to :func:`diff_attention` as ``lam[:, None]``.
    """
    vecs = [_real(n, x) for n, x in (("lq1", lq1), ("lk1", lk1), ("lq2", lq2), ("lk2", lk2))]
    for name, a in zip(("lq1", "lk1", "lq2", "lk2"), vecs, strict=True):
        if a.ndim == 0:
            raise ValueError(f"{name} must have at least one axis (..., d); got a scalar")
    d = {a.shape[-1] for a in vecs}
    if len(d) != 1:
        raise ValueError("lq1, lk1, lq2 and lk2 must have the same last axis (d); got "
                         f"shapes {[a.shape for a in vecs]}")
    init = _real("lambda_init", lambda_init)
    # a scalar lambda_init does not widen float32 vectors (as a Python float would not)
    dtype = np.result_type(np.float32, *vecs, *([init] if init.ndim else []))
    a1, b1, a2, b2 = (a.astype(dtype, copy=False) for a in vecs)
    try:
        lam = np.exp(np.sum(a1 * b1, axis=-1)) - np.exp(np.sum(a2 * b2, axis=-1)) + init
    except ValueError:
        raise ValueError("lq1, lk1, lq2, lk2 and lambda_init must broadcast; got shapes "
                         f"{[a.shape for a in vecs]} and {init.shape}") from None
    return _scalar_or_array(lam.astype(dtype, copy=False))


def subln(x, weight=None, *, lambda_init, eps=1e-5):
    """The layer's output norm: RMSNorm over the last axis, ``* weight * (1 - lambda_init)``.

    ``y = x / sqrt(mean(x**2, axis=-1) + eps) * weight * (1 - lambda_init)``,
    as ``RMSNorm(2d, eps=1e-5)`` followed by ``attn * (1 - lambda_init)`` in
    the reference.

    Parameters
    ----------
    x : array ``(..., C)``
        Typically the output of :func:`diff_attention`, ``(*batch, H, L, 2d)``.
    weight : array ``(C,)`` (or broadcastable to ``x`` without growing it), optional
        The RMSNorm gain; None means ones.
    lambda_init : float
    eps : float

    Returns
    -------
    ndarray, the shape and floating dtype of ``x``
        Computed in float32 (float64 for float64 input), as the reference
        normalises in float32.
    """
    x = np.asarray(x)
    out_dtype = float_dtype_of("x", x.dtype)
    if x.ndim == 0:
        raise ValueError("x must have at least one axis (..., C); got a scalar")
    comp, _ = compute_dtypes(out_dtype)
    init = _real("lambda_init", lambda_init)
    if init.ndim:
        raise TypeError(f"lambda_init must be a number; got an array of shape {init.shape}")
    init = float(init)
    eps_v = float(_real("eps", eps))
    if not (math.isfinite(eps_v) and eps_v >= 0):
        raise ValueError(f"eps must be finite and >= 0; got {eps_v}")
    xc = x.astype(comp)
    y = xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + comp.type(eps_v))
    if weight is not None:
        w = _real("weight", weight).astype(comp, copy=False)
        try:
            grows = np.broadcast_shapes(w.shape, x.shape) != x.shape
        except ValueError:
            grows = True
        if grows:  # the result keeps x's shape
            raise ValueError(f"weight of shape {w.shape} cannot be broadcast to x's {x.shape}; "
                             f"expected ({x.shape[-1]},)")
        y = y * w
    return (y * comp.type(1.0 - init)).astype(out_dtype, copy=False)
