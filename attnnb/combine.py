"""Merging partial attention results over disjoint key sets: :func:`combine`.

Attention over a union of disjoint key sets is a weighted mean of the
attention over each set, weighted by each part's share of the normaliser:
with parts ``p``, ``lse = log sum_p e^(lse_p)`` and
``out = sum_p e^(lse_p - lse) * out_p`` (docs/contract.md §1.5, §7.1).  The
merge is associative and commutative, so parts may be merged in any order
or in a tree: this is what split KV caches, ring attention and the Dask
graphs of :mod:`attnnb` do.

Everything here is elementwise arithmetic through NumPy's functions, which
dispatch on their arguments (``__array_ufunc__``, ``__array_function__``):
NumPy, CuPy and Dask arrays work alike, and stay what they are.
"""

from __future__ import annotations

import math

import numpy as np

from ._core.codes import SOFTPICK_EPS
from ._front.validate import NORMALIZERS

__all__ = ["combine"]


def combine(outs, lses, *, normalizer="softmax", sinks=None):
    """Merge attention results computed over disjoint key sets into the result over their union.

    Parameters
    ----------
    outs : sequence of arrays ``(*batch, H, Lq, Dv)``
        The outputs of the parts, as the attention functions return them
        (any leading shape ``S + (Dv,)``, the same for every part).
    lses : sequence of arrays ``(*batch, H, Lq)``
        Their log-sum-exps (``return_lse=True``), of shape ``S``; one per part.
    normalizer : {"softmax", "relu_expm1", "softmax1", "sigmoid", "softpick"}
        The normalizer the parts were computed with.  ``softmax`` and
        ``relu_expm1`` merge alike (their normalisers are both sums over the
        keys); ``sigmoid`` parts are sums that simply add (``lse`` the log of
        the total weight: the LSEs add as ``logaddexp``).  ``softmax1`` parts
        are first divided by their own factor ``e^lse / (1 + e^lse)``, merged
        as softmax parts and multiplied by the factor of the merged LSE;
        where a part's factor underflows (``lse`` below about -87 in float32,
        -708 in float64) its output has already lost digits, so for such rows
        compute the parts with ``"softmax"`` and finish once after merging.
        ``softpick`` parts merge the same way: their ``eps`` is a sink of
        logit ``log eps``.
    sinks : real array broadcastable to ``(*batch, H)``, optional
        The parts were computed with these learned sinks (``normalizer``
        ``"softmax"``, docs/contract.md §1.15): they are merged as
        ``softmax1`` parts with the sink's logit in place of 0.

    Returns
    -------
    out : array ``(*batch, H, Lq, Dv)``
        In the result dtype of ``outs``.
    lse : array ``(*batch, H, Lq)``
        In the result dtype of ``lses``: the LSE over the union (for
        ``softmax1`` without the ``+1``, as the attention functions give it).

    Notes
    -----
    A part with ``lse = -inf`` (its keys were all outside the row's allowed
    set) contributes nothing; a row empty in every part is zeros with
    ``lse = -inf``, never NaN.  A part whose weight underflows to zero
    contributes nothing either, so a NaN or Inf value behind it does not
    reach the row (as in one call, docs/contract.md §1.9); a NaN LSE makes
    its row NaN.  The arithmetic runs in the result dtype of all the
    arguments (at least float32), and never writes to its inputs.

    NumPy, CuPy and Dask arrays are merged with their own operations (lazily
    for Dask); other array-likes are read with ``np.asarray``.

    Examples
    --------
    >>> import numpy as np, attnnb
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 16, 8)) for _ in range(3))
    >>> a = attnnb.attention(q, k[:, :10], v[:, :10], return_lse=True)
    >>> b = attnnb.attention(q, k[:, 10:], v[:, 10:], return_lse=True)
    >>> out, lse = attnnb.combine([a[0], b[0]], [a[1], b[1]])
    >>> bool(np.allclose(out, attnnb.attention(q, k, v)))
    True
    """
    if normalizer not in NORMALIZERS:
        raise ValueError(f"normalizer must be one of {NORMALIZERS}; got {normalizer!r}")
    outs, lses = _parts(outs, lses)
    sink = 0.0
    if sinks is not None:
        if normalizer != "softmax":
            raise ValueError("sinks belong to normalizer='softmax' parts (softmax1 is a sink "
                             f"of 0); got normalizer={normalizer!r}")
        sink = _sink_rows(sinks, tuple(lses[0].shape))
        normalizer = "softmax1"
    out_dtype = np.result_type(*(o.dtype for o in outs))
    lse_dtype = np.result_type(*(s.dtype for s in lses))
    comp = np.result_type(out_dtype, lse_dtype, np.float32)
    outs = [_as(o, comp) for o in outs]
    lses = [_as(s, comp) for s in lses]
    if normalizer == "sigmoid":
        out, lse = add_parts(outs, lses)
        return _as(out, out_dtype), _as(lse, lse_dtype)
    if normalizer == "softpick":  # D / (D + eps): softmax1's factor with the sink log eps
        sink, normalizer = math.log(SOFTPICK_EPS), "softmax1"
    if normalizer == "softmax1":
        outs = [_unfinish_softmax1(o, s, sink) for o, s in zip(outs, lses)]
    out, lse = merge_parts(outs, lses)
    if normalizer == "softmax1":
        out = finish_softmax1(out, lse, sink)
    return _as(out, out_dtype), _as(lse, lse_dtype)


def _sink_rows(sinks, rows):
    """``sinks`` as an array broadcasting against LSEs of shape ``rows`` (one sink per
    row's leading axes: ``sinks[..., None]``), checked: real, finite, broadcastable."""
    arr = np.asarray(sinks)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "fiu":
        raise TypeError(f"sinks must be real numbers; got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    try:
        view = np.broadcast_to(arr, rows[:-1])
    except ValueError:
        raise ValueError(f"sinks of shape {tuple(arr.shape)} cannot be broadcast to "
                         f"{rows[:-1]} (the LSEs' shape without the query axis)") from None
    if not bool(np.all(np.isfinite(view))):
        raise ValueError("sinks must be finite")
    return view[..., None]


def merge_parts(outs, lses):
    """The merge of :func:`combine` on checked parts of one floating dtype.

    Parameters
    ----------
    outs : list of arrays ``S + (Dv,)``
    lses : list of arrays ``S``
        Of softmax (or relu_expm1) parts, all in one dtype.

    Returns
    -------
    out, lse : arrays ``S + (Dv,)`` and ``S`` in that dtype.
    """
    top = lses[0]
    for s in lses[1:]:
        top = np.maximum(top, s)  # NaN wins
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        shift = np.where(np.isfinite(top), top, 0)  # rows empty (or NaN) in every part
        total = 0
        acc = 0
        for o, s in zip(outs, lses):
            w = np.exp(s - shift)
            total = total + w
            w = w[..., None]
            # a part of zero weight adds nothing, not 0 * (NaN or Inf behind it)
            acc = acc + np.where(w == 0, 0, w * o)
        ok = total > 0
        safe = np.where(ok, total, 1)
        out = np.where(ok[..., None], acc / safe[..., None], 0)
        lse = np.where(ok, shift + np.log(safe), -np.inf)
    nan_row = np.isnan(top)
    return (np.where(nan_row[..., None], np.nan, out), np.where(nan_row, np.nan, lse))


def add_parts(outs, lses):
    """Parts that add up (``sigmoid``'s unnormalised sums): ``out = sum_p out_p`` and
    ``lse = log sum_p e^lse_p``; a part of no weight (``lse = -inf``) adds nothing, a
    NaN LSE makes its row NaN."""
    top = lses[0]
    for s in lses[1:]:
        top = np.maximum(top, s)  # NaN wins
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        shift = np.where(np.isfinite(top), top, 0)
        total = 0
        out = 0
        for o, s in zip(outs, lses):
            total = total + np.exp(s - shift)
            out = out + np.where(np.isneginf(s)[..., None], 0, o)
        lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1)), -np.inf)
    nan_row = np.isnan(top)
    return (np.where(nan_row[..., None], np.nan, out), np.where(nan_row, np.nan, lse))


def finish_softmax1(out, lse, sink=0.0):
    """Softmax output and LSE to the ``softmax1`` output: ``out * e^lse / (e^sink +
    e^lse)``, with a learned ``sink`` (broadcasting against ``lse``) or 0.

    The factor is the logistic function of ``lse - sink``, computed without
    overflow for large ``|lse|`` (0 for ``lse = -inf``).
    """
    return out * _logistic(lse - sink)[..., None]


def _unfinish_softmax1(out, lse, sink=0.0):
    """A ``softmax1`` part back to its softmax output (zeros where the factor is 0)."""
    factor = _logistic(lse - sink)[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(factor == 0, 0, out / np.where(factor == 0, 1, factor))


def _logistic(x):
    a = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + a), a / (1 + a))


def _parts(outs, lses):
    """Check the parts: as many outputs as LSEs, at least one, shapes ``S + (Dv,)`` and ``S``."""
    if isinstance(outs, np.ndarray) or isinstance(lses, np.ndarray):
        raise TypeError("outs and lses must be sequences of arrays (one per part), not "
                        "single arrays; pass [out_a, out_b, ...] and [lse_a, lse_b, ...]")
    outs = [_array(f"outs[{i}]", o) for i, o in enumerate(outs)]
    lses = [_array(f"lses[{i}]", s) for i, s in enumerate(lses)]
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have one entry per part; got {len(outs)} "
                         f"outputs and {len(lses)} LSEs")
    if not outs:
        raise ValueError("outs and lses must hold at least one part; got none")
    shape = tuple(outs[0].shape)
    if len(shape) < 1:
        raise ValueError(f"outs[0] must have a value axis (..., Dv); got shape {shape}")
    for i, o in enumerate(outs):
        if tuple(o.shape) != shape:
            raise ValueError(f"every part's output must have one shape; outs[{i}] has "
                             f"{tuple(o.shape)}, outs[0] has {shape}")
    for i, s in enumerate(lses):
        if tuple(s.shape) != shape[:-1]:
            raise ValueError(f"lses[{i}] must have shape {shape[:-1]} (the outputs' shape "
                             f"without the value axis); got {tuple(s.shape)}")
    return outs, lses


def _array(name, x):
    """``x`` itself if NumPy or an array dispatching NumPy's functions, else ``np.asarray(x)``."""
    if not (isinstance(x, np.ndarray) or hasattr(x, "__array_function__")):
        try:
            x = np.asarray(x)
        except Exception as exc:
            raise TypeError(f"{name} could not be read as an array: {exc}") from exc
    dtype = np.dtype(x.dtype)
    if dtype.kind != "f":
        raise TypeError(f"{name} must have a floating dtype; got {dtype}")
    return x


def _as(x, dtype):
    return x if x.dtype == dtype else x.astype(dtype)
