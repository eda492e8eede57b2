"""Look inside attention: :func:`weights` and :func:`attention_stats` of any call.

A fused kernel never holds its attention weights, so users of fused
attention cannot see them (pytorch issues 119811 and 143993, mlx 2590,
xformers 1190).  attnnb recomputes them exactly for the query rows asked
(:mod:`attnnb._front.row_weights`: a row needs its own logits only), and reduces
them to per-row and per-key statistics block by block of rows, so that no
``(Lq, Lk)`` array exists unless it is asked for (docs/contract.md §2.9).
"""

from __future__ import annotations

import numpy as np

from ._front import dispatch as _dispatch
from ._front.checks import as_named_array
from ._front.dispatch import choose_backend
from ._front.row_weights import Call, bind_call, row_indices, row_weights
from ._front.validate import check_bool

__all__ = ["weights", "attention_stats", "STATS"]

#: the statistics :func:`attention_stats` computes
STATS = ("entropy", "max", "argmax", "mass", "zeros", "negative_mass", "received")

# elements of a block of weights (float64): bounds the temporaries at a few times 32 MB
_BLOCK_ELEMENTS = 2**22
# the largest weights array ``weights`` forms for all rows of a call (bytes)
_ALL_ROWS_BYTES = 2**30


def _blocks(call: Call, rows: np.ndarray):
    """``rows`` in consecutive blocks whose weights hold about :data:`_BLOCK_ELEMENTS`."""
    B, Lk = call.problem.shape[0], call.problem.shape[4]
    per_row = max(1, B * call.heads * Lk)
    step = max(1, _BLOCK_ELEMENTS // per_row)
    for start in range(0, rows.size, step):
        yield start, rows[start:start + step]


def _user_shape(call: Call, arr: np.ndarray) -> np.ndarray:
    """A ``(B, H, ...)`` result in the user's layout: ``(*batch, H, ...)``, or without
    the head axis for 2-D input."""
    return arr.reshape(call.out_shape + arr.shape[2:])


def weights(fn, *args, rows=None, maps=False, **kwargs):
    """The exact attention weights of a call, for the query rows asked.

    Parameters
    ----------
    fn : :func:`attnnb.attention`, :func:`attnnb.sparse_attention`,
        :func:`attnnb.topk_attention` or :func:`attnnb.diff_attention`
    *args, **kwargs
        The call's arguments, exactly as ``fn`` takes them (``backend`` and
        ``return_lse`` are accepted and do not matter).
    rows : None, slice, int or 1-D integer array
        Query positions (negative ones count from the end); None means all,
        allowed while the result stays below 1 GiB.
    maps : bool
        For :func:`attnnb.diff_attention`: also return its two softmax maps.

    Returns
    -------
    w : array ``(*batch, H, n_rows, Lk)`` (``(n_rows, Lk)`` for 2-D input)
        The weights that multiply ``v`` in the call: ``out[..., i, :] == w[...,
        r, :] @ v`` for row ``i = rows[r]`` (to rounding), dropout included
        when ``dropout_p > 0`` (pass ``dropout_p=0.0`` for the weights before
        it).  Zero outside the allowed set (mask, causal limit, pattern, top-k
        selection); a row with no allowed key is zeros.  ``H`` is the number
        of query heads, or of head pairs for differential attention, whose
        weights are the combined ``A1 - lam A2`` (rectified: clipped at 0).
        In the output dtype of the call, computed in float64.
    a1, a2 : arrays of the same shape, only with ``maps=True``
        The differential pair's softmax maps, before dropout.

    Notes
    -----
    The weights are the reference backend's arithmetic on the rows asked
    (docs/contract.md §2.9): memory ``O(n_rows * Lk)`` and work ``O(n_rows *
    Lk * D)`` per head, whatever ``Lq``.

    Examples
    --------
    >>> import numpy as np, attnnb
    >>> q = k = v = np.random.default_rng(0).standard_normal((2, 64, 16))
    >>> w = attnnb.weights(attnnb.attention, q, k, v, causal=True, rows=[0, 63])
    >>> w.shape, w[:, 0, 1:].max()
    ((2, 2, 64), 0.0)
    """
    call = bind_call("weights", fn, args, kwargs)
    if check_bool("maps", maps) and call.name != "diff_attention":
        raise ValueError(f"maps=True is for attnnb.diff_attention (its two softmax maps); "
                         f"got attnnb.{call.name}")
    B, _, _, Lq, Lk = call.problem.shape[:5]
    idx = row_indices(rows, Lq)
    nbytes = B * call.heads * idx.size * Lk * 8
    if rows is None and nbytes > _ALL_ROWS_BYTES:
        raise ValueError(f"the weights of all {Lq} rows would take {nbytes / 2**30:.1f} GiB; "
                         "pass rows= (a slice or indices), or use attnnb.attention_stats")
    parts = [np.empty((B, call.heads, idx.size, Lk)) for _ in range(3 if maps else 1)]
    for start, block in _blocks(call, idx):
        w, _, two = row_weights(call, block)
        for dest, src in zip(parts, (w, *(two if maps else ()))):
            dest[:, :, start:start + block.size] = src
    out = tuple(_user_shape(call, x).astype(call.problem.out_dtype, copy=False)
                for x in parts)
    return out if maps else out[0]


def _check_stats(stats, keys, Lk: int):
    """``(names, key_mask)``: the statistics asked, checked, and the keys of ``"mass"``
    as a boolean ``(Lk,)`` (None when not asked)."""
    names = (stats,) if isinstance(stats, str) else tuple(stats)
    unknown = [s for s in names if s not in STATS]
    if unknown or not names:
        raise ValueError(f"stats must name some of {STATS}; got {stats!r}")
    if "mass" not in names:
        if keys is not None:
            raise ValueError('keys= is read by the "mass" statistic; add it to stats')
        return names, None
    if keys is None:
        raise TypeError('the "mass" statistic needs keys=: the key positions (an integer '
                        "array, e.g. [0] for a sink token) or a boolean (Lk,) mask")
    arr = as_named_array("keys", keys)
    key_mask = np.zeros(Lk, bool)
    if arr.dtype == np.bool_:
        if arr.shape != (Lk,):
            raise ValueError(f"a boolean keys must have shape ({Lk},); got {arr.shape}")
        key_mask[:] = arr
    elif arr.dtype.kind in "iu" and arr.ndim <= 1:
        if arr.size and (arr.min() < -Lk or arr.max() >= Lk):
            raise IndexError(f"keys must lie in [-{Lk}, {Lk}); got {arr.min()}..{arr.max()}")
        key_mask[arr] = True
    else:
        raise TypeError("keys must be an integer array of key positions or a boolean (Lk,) "
                        f"mask; got dtype {arr.dtype} and shape {arr.shape}")
    return names, key_mask


def attention_stats(fn, *args, stats=("entropy", "max", "argmax", "received"), keys=None,
                    **kwargs) -> dict:
    """Statistics of a call's attention weights, with no ``(Lq, Lk)`` array.

    The weights (those of :func:`weights`: what multiplies ``v``, dropout
    included) are reduced as they are formed: for dense attention on the
    ``cpu`` backend in one compiled pass over the tiles after the forward's
    LSE (:mod:`attnnb.cpu.stats`, in the compute dtype, as the kernels weigh
    the values), otherwise block by block of query rows in float64.

    Parameters
    ----------
    fn, *args, **kwargs
        The call, as for :func:`weights`.
    stats : str or sequence of str, from :data:`STATS`
        Per query row, ``(*batch, H, Lq)``:

        * ``"entropy"``: ``-sum_j w log w`` over the positive weights (float64);
        * ``"max"`` and ``"argmax"``: the largest positive weight and its key
          (the lowest such key); 0 and ``-1`` on a row with no positive weight
          (an empty row), NaN and ``-1`` on a NaN row;
        * ``"mass"``: ``sum_j w`` over the keys given in ``keys``;
        * ``"zeros"``: how many allowed keys get a weight of exactly 0
          (``relu_expm1``'s non-positive logits, the rectified differential
          mode's clipped weights, dropped weights, underflow), int64;
        * ``"negative_mass"``: ``sum_j min(w, 0)``, at most 0 (differential
          attention).

        Per key, ``(*batch, H, Lk)``: ``"received"``, ``sum_i w[i, j]``, the
        attention each key receives (ToMe's and H2O's importance).
    keys : integer array or boolean ``(Lk,)`` array
        The keys of ``"mass"`` (e.g. ``[0]``: an attention sink).
    backend : in ``kwargs``, as the call's
        ``"cpu"`` (the default for host arrays) and ``"cuda"`` run dense
        attention's compiled pass; ``"reference"`` the float64 rows; other
        functions always take the float64 rows.

    Returns
    -------
    dict
        One array per statistic asked, named as asked.  Top-k attention's
        allowed keys are its selected ones.

    Examples
    --------
    >>> import numpy as np, attnnb
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 4, 32, 8))
    >>> s = attnnb.attention_stats(attnnb.attention, q, k, v, causal=True,
    ...                            stats=("mass", "received"), keys=[0])
    >>> s["mass"].shape, s["received"].shape
    ((1, 4, 32), (1, 4, 32))
    >>> float(s["mass"][0, 0, 0])  # the first query sees key 0 alone
    1.0
    """
    call = bind_call("attention_stats", fn, args, kwargs)
    B, _, _, Lq, Lk = call.problem.shape[:5]
    names, key_mask = _check_stats(stats, keys, Lk)
    compiled = (call.name == "attention"
                and call.problem.normalizer in ("softmax", "softmax1", "relu_expm1")
                and call.problem.mask_mod is None and call.problem.score_mod is None)
    backend = choose_backend(call.backend, False)
    if compiled and backend in ("cpu", "cuda"):
        per_row, received = _dispatch.implementation("attention_stats", backend)(
            call.problem, np.zeros(Lk, bool) if key_mask is None else key_mask)
        nan_rows = np.isnan(per_row[..., 0])
        columns = {"entropy": per_row[..., 0], "max": per_row[..., 1],
                   "argmax": per_row[..., 2].astype(np.int64), "mass": per_row[..., 3],
                   "zeros": per_row[..., 4].astype(np.int64),
                   "negative_mass": np.where(nan_rows, np.nan, 0.0), "received": received}
    else:
        columns = _host_stats(call, names, key_mask)
    return {n: _user_shape(call, columns[n]) for n in names}


def _host_stats(call: Call, names, key_mask) -> dict:
    """The statistics of :func:`attention_stats` from blocks of rows' weights, ``(B, H,
    ...)``."""
    B, _, _, Lq, Lk = call.problem.shape[:5]
    H = call.heads
    per_row = {n: np.zeros((B, H, Lq), np.int64 if n in ("argmax", "zeros") else np.float64)
               for n in names if n != "received"}
    received = np.zeros((B, H, Lk))
    for start, block in _blocks(call, np.arange(Lq)):
        w, allowed, _ = row_weights(call, block)
        rows = slice(start, start + block.size)
        nan_rows = np.isnan(w).any(axis=-1)
        if "entropy" in per_row:
            with np.errstate(divide="ignore", invalid="ignore"):
                entropy = -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0),
                                  axis=-1)
            per_row["entropy"][:, :, rows] = np.where(nan_rows, np.nan, entropy)
        if "max" in per_row or "argmax" in per_row:
            best = np.argmax(w, axis=-1) if Lk else np.zeros(w.shape[:3], np.int64)
            top = (np.take_along_axis(w, best[..., None], axis=-1)[..., 0] if Lk
                   else np.zeros(w.shape[:3]))
            positive = top > 0
            if "max" in per_row:
                per_row["max"][:, :, rows] = np.where(nan_rows, np.nan,
                                                      np.where(positive, top, 0.0))
            if "argmax" in per_row:
                per_row["argmax"][:, :, rows] = np.where(positive, best, -1)
        if "mass" in per_row:
            per_row["mass"][:, :, rows] = np.sum(w[..., key_mask], axis=-1)
        if "zeros" in per_row:
            per_row["zeros"][:, :, rows] = np.sum(allowed & (w == 0), axis=-1)
        if "negative_mass" in per_row:
            per_row["negative_mass"][:, :, rows] = np.sum(np.minimum(w, 0.0), axis=-1)
        if "received" in names:
            received += w.sum(axis=2)
    return {**per_row, "received": received}
