"""Shared pieces of the float64 reference: scores, allowed sets, normalizers.

Non-finite numbers follow these rules, on every backend (the contract's §1
leaves the details to the implementation; these are the choices):

* **Logits.** A NaN or Inf in ``q`` or ``k`` (or a non-finite ``bias``) reaches
  a row through its logits ``s[i, j]``, over the row's allowed set only.  A
  NaN or ``+inf`` logit makes the row NaN: output and LSE (PyTorch's softmax
  gives NaN for a ``+inf`` logit too: ``inf - inf``).  A ``-inf`` logit is a
  weight of exactly zero, as a ``-inf`` bias is; a row whose allowed logits
  are all ``-inf`` is an empty row (zeros, ``lse = -inf``).
* **Values.** A value enters a row only through a nonzero weight.  A key
  outside the row's allowed set (mask, causal limit, pattern, top-k
  selection) and an allowed key whose weight is zero never affect the row,
  even if its value is NaN or Inf.  A weight is zero for a ``-inf`` logit,
  for ``relu_expm1``'s logits ``<= 0``, and when it underflows: when
  ``w[i, j]`` is below the smallest normal number of the compute dtype
  (about ``e^-87.3`` in float32, ``e^-708.4`` in float64; a ``-1e4`` bias,
  say).  The output is then the limit for a vanishing weight.  PyTorch's
  ``softmax(s) @ v`` gives NaN instead (``0 * inf``).  A nonzero weight,
  however small, carries a NaN or Inf value into the output columns where
  it sits: ``w * inf = inf``, and ``inf - inf`` or ``0 * inf`` is NaN.  The
  weights and the LSE never depend on ``v``.  Close to the underflow
  threshold (within a factor of about ``Lk * e^8`` either way, more when the
  row's largest logit lies in a later key tile than the key) the backends'
  exponentials and running maxima may round a weight to zero or not
  differently.
* **Differential attention** (``mode="difference"``) forms each map's output
  under these rules and then ``o1 - lam * o2``, as the reference
  implementation's two attention calls do: an Inf value that both maps
  attend gives NaN (``inf - lam * inf``).
"""

from __future__ import annotations

import numpy as np

from .._core.codes import SOFTPICK_EPS


def expand_kv_heads(x: np.ndarray, hq: int) -> np.ndarray:
    """Repeat key/value heads for grouped-query attention.

    ``x`` is ``(B, Hk, L, D)``; query head ``h`` uses key head ``h // (hq // Hk)``,
    as ``torch.repeat_interleave`` along the head axis.
    """
    return np.repeat(x, hq // x.shape[1], axis=1)


def logits(q, k, scale, bias=None):
    """``scale * q @ k^T (+ bias)`` in float64; q ``(B, H, Lq, D)``, k ``(B, H, Lk, D)``."""
    s = scale * np.matmul(q.astype(np.float64), np.swapaxes(k.astype(np.float64), -1, -2))
    if bias is not None:
        s = s + bias.astype(np.float64)
    return s


def problem_logits(problem, k, with_slope=False, rows=None):
    """The logits of a problem's rows in float64, as the kernels form them: ``scale q k^T``,
    then ``score_mod`` (:mod:`attnnb.mods`), then ``bias``.

    Returns ``(s, raw, slope)``: the logits, those before ``score_mod`` and its
    derivative ``d s / d raw`` (None without a score mod or unless asked).  ``rows``:
    only these query rows (all by default).
    """
    Lq = problem.q.shape[2]
    q = problem.q if rows is None else problem.q[:, :, rows]
    raw = logits(q, k, problem.scale)
    s, slope = raw, None
    if problem.score_mod is not None:
        from ._mods import score_values

        s, slope = score_values(problem.score_mod, raw, Lq, problem.dropout_origin, rows,
                                with_slope)
    if problem.bias is not None:
        bias = problem.bias if rows is None else problem.bias[:, :, rows]
        s = s + bias.astype(np.float64)
    return s, raw, slope


def mask_mod_values(problem, shape, rows=None):
    """bool ``(B, H, n, Lk)``: the problem's ``mask_mod`` on ``rows`` (all by default) of
    a problem of ``shape`` ``(B, H, Lq, Lk)``; None without one."""
    if problem.mask_mod is None:
        return None
    from ._mods import mask_values

    return mask_values(problem.mask_mod, shape, problem.dropout_origin, rows)


def problem_allowed(problem, shape):
    """:func:`allowed_set` of a problem, with its ``mask_mod`` evaluated everywhere."""
    allowed = allowed_set(shape, problem.mask, problem.causal)
    by_mod = mask_mod_values(problem, shape)
    return allowed if by_mod is None else allowed & by_mod


def allowed_set(shape, mask=None, causal=False):
    """Boolean ``(B, H, Lq, Lk)``: True where query i may attend key j."""
    B, H, Lq, Lk = shape
    allowed = np.ones(shape, dtype=bool)
    if mask is not None:
        allowed &= mask
    if causal:
        i = np.arange(Lq)[:, None]
        j = np.arange(Lk)[None, :]
        allowed &= j <= i + (Lk - Lq)
    return allowed


def normalize(s, allowed, log_key_size=None, normalizer="softmax", sink=0.0):
    """Attention weights and LSE from logits over the allowed set.

    Parameters
    ----------
    s : float64 ``(B, H, Lq, Lk)`` logits (scale and bias applied).
    allowed : bool ``(B, H, Lq, Lk)``.
    log_key_size : ``(B, Lk)`` or None, added to the logits (proportional attention).
    normalizer : ``"softmax"``, ``"softmax1"``, ``"relu_expm1"``, ``"sigmoid"`` or
        ``"softpick"``.
    sink : float or float64 ``(B, H, 1, 1)``
        ``softmax1``'s sink logit: the denominator is ``e^sink + S`` (1 + S by
        default; learned sinks otherwise).

    Returns
    -------
    w : float64 ``(B, H, Lq, Lk)``, zero outside the allowed set and on empty rows.
    lse : float64 ``(B, H, Lq)``, ``log sum_j key_size[j] * phi(s[i, j])``; ``-inf`` on
        empty rows.

    Notes
    -----
    A NaN or ``+inf`` among a row's counted logits makes the whole row NaN
    (``w`` and ``lse``); a ``-inf`` logit is a zero weight (see the module
    docstring).  The normaliser may be tiny (``relu_expm1`` with tiny positive
    logits: ``phi(s) ~ s``) and the weights are still ``e / z``.  For
    ``softmax1`` the weights are ``(e / z) * sigmoid(lse - sink)``, which equals
    ``e / (z + e^(sink - m))`` without overflowing for very negative logits.
    ``sigmoid`` weighs each key on its own, ``w = key_size * sigmoid(s)`` (its
    bias is in ``s``), with no normalisation; ``lse = log sum_j w``.
    """
    if normalizer == "sigmoid":
        return _sigmoid_weights(s, allowed, log_key_size)
    if normalizer == "softpick":
        return softpick_terms(s, allowed, log_key_size)[:2]
    t = s if log_key_size is None else s + log_key_size.astype(np.float64)[:, None, None, :]
    if normalizer == "relu_expm1":
        # key_size * max(0, e^s - 1) = e^(s + log size) * (1 - e^-s) for s > 0: no overflow
        counted = allowed & ~(s <= 0)  # NaN logits stay counted so that they propagate
    else:
        counted = allowed
    t = np.where(counted, t, -np.inf)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = np.max(t, axis=-1, keepdims=True) if t.shape[-1] else np.full(
            t.shape[:-1] + (1,), -np.inf)
        # a NaN logit, or a +inf one (its weight is inf / inf), spoils its row only
        nan_row = np.isnan(m) | np.isposinf(m)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        e = np.where(counted, np.exp(t - m_safe), 0.0)
        if normalizer == "relu_expm1":
            e = e * np.where(counted, -np.expm1(-s), 0.0)
        z = e.sum(axis=-1, keepdims=True)
        lse = m_safe + np.log(z)
        w = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
        if normalizer == "softmax1":
            x = lse - sink  # sigmoid(lse - sink) = S / (e^sink + S), stably
            a = np.exp(-np.abs(x))
            w = w * np.where(x >= 0, 1.0 / (1.0 + a), a / (1.0 + a))
    lse = np.where(z > 0, lse, -np.inf)[..., 0]
    w = np.where(nan_row, np.nan, w)
    lse = np.where(nan_row[..., 0], np.nan, lse)
    return w, lse


def logistic(x):
    """``1 / (1 + e^-x)`` without overflow (0 at ``-inf``, 1 at ``+inf``, NaN at NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        a = np.exp(-np.abs(x))
        return np.where(x >= 0, 1.0 / (1.0 + a), a / (1.0 + a))


def _sigmoid_weights(s, allowed, log_key_size):
    """:func:`normalize` for ``"sigmoid"``: ``w = c sigmoid(s)`` on the allowed set, and
    ``lse = log sum_j w`` (``-inf`` on a row with no weight, NaN on a NaN row)."""
    w = logistic(s)
    if log_key_size is not None:
        w = w * np.exp(log_key_size.astype(np.float64))[:, None, None, :]
    w = np.where(allowed, w, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.sum(w, axis=-1))
    nan_row = np.isnan(lse)
    return np.where(nan_row[..., None], np.nan, w), lse


def softpick_terms(s, allowed, log_key_size):
    """Softpick's weights ``w = c relu(e^s - 1) / (D + eps)``, ``D = sum_j c |e^s - 1|``.

    Returns ``(w, lse, a, u, r)``: the weights, ``lse = log D`` (``-inf`` where
    ``D`` is 0: no allowed key, or every allowed logit exactly 0), ``a = c e^s /
    (D + eps)`` (the factor of both terms' derivatives), ``u = c |e^s - 1| / (D +
    eps)`` (the denominator's terms) and ``r = D / (D + eps)`` per row.  Computed shifted by
    ``M = max(0, max_j s_j)`` (so that ``e^(s - M) <= 1``), each term from
    ``expm1`` (no cancellation near ``s = 0``); a NaN or ``+inf`` logit makes the
    row NaN, as in softmax.
    """
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        x = np.where(allowed, s, -np.inf)
        top = np.max(x, axis=-1, keepdims=True) if x.shape[-1] else np.full(
            x.shape[:-1] + (1,), -np.inf)
        nan_row = (allowed & (np.isnan(s) | np.isposinf(s))).any(axis=-1, keepdims=True)
        shift = np.where(np.isfinite(top), np.maximum(top, 0.0), 0.0)
        c = 1.0 if log_key_size is None else np.exp(
            log_key_size.astype(np.float64))[:, None, None, :]
        e = np.where(allowed, c * np.exp(x - shift), 0.0)  # c e^(s - M)
        num = np.where(allowed & (x > 0), e * -np.expm1(-x), 0.0)
        den = np.where(allowed & (x <= 0), c * np.exp(-shift) * -np.expm1(x), num)
        z = den.sum(axis=-1, keepdims=True)
        zeps = z + SOFTPICK_EPS * np.exp(-shift)
        w, a, u = num / zeps, e / zeps, den / zeps
        lse = np.where(z > 0, shift + np.log(z), -np.inf)[..., 0]
        r = (z / zeps)[..., 0]
    w, a, u = (np.where(nan_row, np.nan, x) for x in (w, a, u))
    lse = np.where(nan_row[..., 0], np.nan, lse)
    return w, lse, a, u, r


def apply_weights(w, v, allowed, dtype=None):
    """``w @ v`` where a value enters a row only through a nonzero weight.

    With finite values this is a plain matmul.  When ``v`` holds NaN or Inf,
    each row sums only the keys it counts: allowed, and, given the compute
    dtype ``dtype``, with a weight that does not underflow in it
    (``|w| >= finfo(dtype).tiny``; NaN weights, on NaN rows, count).  So a
    non-finite value reaches only the rows that weight it, and there only its
    own columns (module docstring).  Without ``dtype`` every allowed key
    counts, whatever its weight.
    """
    v = v.astype(np.float64)
    if np.isfinite(v).all():
        return np.matmul(w, v)
    counts = allowed if dtype is None else allowed & ~(np.abs(w) < np.finfo(dtype).tiny)
    B, H, Lq, _ = w.shape
    out = np.zeros((B, H, Lq, v.shape[-1]))
    with np.errstate(invalid="ignore"):  # inf - inf = NaN is the propagation we want
        for b in range(B):
            for h in range(H):
                for i in range(Lq):
                    sel = counts[b, h, i]
                    out[b, h, i] = w[b, h, i, sel] @ v[b, h, sel]
    return out
