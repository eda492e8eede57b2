"""Gradients: :func:`vjp`, the vector-Jacobian product of an attention call.

``result, pullback = attnnb.vjp(fn, *args, **kwargs)`` runs ``fn(*args,
**kwargs)`` for ``fn`` one of :func:`attnnb.attention`,
:func:`attnnb.sparse_attention`, :func:`attnnb.topk_attention` and
:func:`attnnb.diff_attention`, and returns its result with a function that
maps an output cotangent to the gradients of every differentiable argument
(docs/contract.md §5).

The public layer (this module) validates the arguments exactly as ``fn``
does, runs the forward operation of the dispatcher (``"attention"``, ...)
keeping its canonical ``out`` and ``lse``, and on each ``pullback`` call runs
the backward operation ``"<function>_vjp"`` on the same backend.  It then
turns the canonical gradients back into the user's shapes and dtypes (GQA
and broadcast axes summed, ``d log key_size`` turned into ``d key_size``).
:func:`run` is that body, for the framework bridges (:mod:`attnnb._bridges.common`):
it can take the saved result of an earlier forward in place of running the
forward again.

Backend interface
-----------------
A backend implements gradients by defining the four functions below and
registering them in :mod:`attnnb._front.dispatch` (``GRADIENT_OPERATIONS`` names
the module ``attnnb.<backend>.backward`` and the function; add the backend
to ``GRADIENT_BACKENDS``).  Until then :func:`vjp` on that backend raises
:class:`NotImplementedError` before any work.  ``attnnb.reference.backward``
is the float64 oracle they are tested against.

All arrays are canonical: 4-D, C-contiguous, in the compute dtype
(``problem.compute_dtype``: float32, or float64 for float64 inputs), as the
forward received and returned them.  ``problem`` is the
:class:`~attnnb._front.validate.Problem` the forward ran on (``q (B, Hq, Lq, D)``,
``k (B, Hk, Lk, D)``, ``v (B, Hk, Lk, Dv)``, ``mask`` and ``bias`` broadcast
views of ``(B, Hq, Lq, Lk)``, ``log_key_size (B, Lk)``, ``causal``,
``scale``, ``normalizer``).  ``out`` and ``lse`` are exactly what the same
backend's forward operation returned for it.  Nothing may be written to.
A backward function may be called several times and from several threads
at once for the same saved forward.

``attention_vjp(problem, out, lse, dout, dlse, dbias_shape)``
    ``out, dout: (B, Hq, Lq, Dv)``, ``lse: (B, Hq, Lq)``, ``dlse: (B, Hq,
    Lq)`` or None (no gradient flows into the LSE: treat as zeros).
    ``dbias_shape``: None when ``problem.bias`` is None, else a 4-tuple
    ``(B or 1, Hq or 1, Lq or 1, Lk or 1)``; the returned ``dbias`` has that
    shape, summed over the axes given as 1 (the axes the user's bias was
    broadcast along), so that no backend needs a full ``(B, Hq, Lq, Lk)``
    buffer for a ``(Lq, Lk)`` bias.
    Returns ``(dq, dk, dv, dbias, dlog_key_size)``: ``dq (B, Hq, Lq, D)``,
    ``dk (B, Hk, Lk, D)`` and ``dv (B, Hk, Lk, Dv)`` (summed over the query
    heads of each GQA group), ``dbias`` of shape ``dbias_shape`` or None,
    ``dlog_key_size (B, Lk)`` (summed over heads and queries) or None when
    ``problem.log_key_size`` is None.  Float32 or float64; the public layer
    casts.  With ``problem.score_mod`` a sixth result: the gradients of its
    parameter arrays, flat in leaf order
    (:func:`attnnb._mods.compile.param_grads`).
``sparse_attention_vjp(problem, pattern, out, lse, dout, dlse)``
    ``pattern``: the forward's :class:`~attnnb.patterns.Pattern` (shared, or
    one per query head), a constant mask.  Returns as ``attention_vjp``
    (``dbias`` is None: sparse attention takes no bias).
``topk_attention_vjp(problem, top_k, out, lse, dout, dlse)``
    ``top_k``: the forward's ``int``.  The selection (the keys each row
    kept in the forward) is a constant; a backend recomputes it with the
    forward's own deterministic rule (ranking by ``s + log key_size``,
    ties to the lower key index), so it is the forward's selection exactly.
    Returns as ``attention_vjp`` (``dbias`` is None).
``diff_attention_vjp(problem, lam, mode, out, dout, dbias_shape)`` (a seventh
    result with a score mod, as ``attention_vjp``'s sixth)
    ``problem`` built with ``head_pairs=True``: ``q (B, 2H, Lq, d)``, ``k
    (B, 2Hk, Lk, d)``, ``v (B, Hk, Lk, Dv)``, mask and bias broadcast to
    ``(B, H, Lq, Lk)``.  ``lam (B, H, Lq)`` and ``mode`` as the forward got
    them; ``out, dout: (B, H, Lq, Dv)``.  The forward keeps no LSE, so the
    backward recomputes whatever it needs of the two streams (their LSEs,
    and ``o2`` for ``dlam``).  ``dbias_shape`` as above against ``(B, H,
    Lq, Lk)``.  Returns ``(dq, dk, dv, dbias, dlog_key_size, dlam)`` with
    ``dq (B, 2H, Lq, d)``, ``dk (B, 2Hk, Lk, d)``, ``dv (B, Hk, Lk, Dv)``,
    ``dlam (B, H, Lq)``, the others as above (bias and key sizes get the sum
    over both maps).

The math the backends implement is written out in
:mod:`attnnb.reference.backward`.
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ._front import dispatch as _dispatch
from ._front.function_args import check_mode, check_pattern, check_top_k, lambda_rows
from ._front.validate import (
    attention_problem,
    check_bool,
    compute_dtypes,
    float_dtype_of,
    host_float_array,
    is_device_array,
)
from .attention import attention
from .diff import diff_attention
from .sparse import sparse_attention, topk_attention

__all__ = ["vjp"]


def vjp(fn, *args, **kwargs):
    """Run an attention function and return its result with its pullback.

    Parameters
    ----------
    fn : callable
        One of :func:`attnnb.attention`, :func:`attnnb.sparse_attention`,
        :func:`attnnb.topk_attention`, :func:`attnnb.diff_attention`.
    *args, **kwargs
        Its arguments, exactly as ``fn`` takes them (``backend=`` included).

    Returns
    -------
    result
        Exactly what ``fn(*args, **kwargs)`` returns: ``out``, or ``(out,
        lse)`` with ``return_lse=True``.
    pullback : callable
        ``pullback(dout)``, or ``pullback(dout, dlse=None)`` with
        ``return_lse=True``: ``dout`` of ``out``'s shape, ``dlse`` of
        ``lse``'s shape or None (no gradient into the LSE).  Returns a
        ``dict`` of gradients keyed by argument name: ``"q"``, ``"k"``,
        ``"v"``, and ``"bias"``, ``"key_size"``, ``"sinks"`` when those were
        given, ``"lam"`` for :func:`attnnb.diff_attention`, ``"score_mod"``
        with a score mod: a tuple with one gradient per parameter array of its
        functions, in order (``None`` for integer arrays and constant mods).

    Raises
    ------
    TypeError
        ``fn`` is not one of the four functions, or the arguments do not
        fit its signature (and every error ``fn`` itself raises on them).
    NotImplementedError
        The chosen backend has no backward pass yet (checked before the
        forward runs).

    Notes
    -----
    Each gradient has the shape its argument was given in (broadcast axes
    summed: a ``(Lq, Lk)`` bias gets a ``(Lq, Lk)`` gradient, ToMe's ``(B,
    N, 1)`` sizes a ``(B, N, 1)`` one, a Python float ``lam`` a 0-d array)
    and the argument's floating dtype; float16 is computed in float32.
    Arguments given as Python numbers, integers or lists of numbers get the
    output's dtype (a list of floats: float64, as NumPy reads it).

    The gradients are exact with the discrete parts held fixed: the mask,
    the causal limit, the pattern and the top-k selection of the forward
    are constants; the kink of ``relu_expm1`` at 0 and the rectified clip at
    0 have derivative 0; an empty row contributes nothing, never NaN.

    The pullback keeps the canonical inputs and the forward's ``out`` and
    ``lse`` (no copy where the forward needed none): writing into ``q``,
    ``k``, ``v`` or the returned ``out`` before calling it changes the
    gradients.  It runs on the backend the forward ran on, whatever
    :func:`attnnb.use_backend` says at call time, and may be called several
    times and from several threads.

    Examples
    --------
    >>> import numpy as np, attnnb
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    >>> out, pullback = attnnb.vjp(attnnb.attention, q, k, v, causal=True,
    ...                            backend="reference")
    >>> grads = pullback(np.ones_like(out))
    >>> sorted(grads), grads["q"].shape
    (['k', 'q', 'v'], (2, 5, 4))
    """
    result, saved, return_lse = run(fn, args, kwargs)
    return result, _pullback(saved, return_lse)


def run(fn, args, kwargs, forward=None):
    """The body of :func:`vjp`, for the framework bridges (:mod:`attnnb._bridges.common`).

    Parameters
    ----------
    fn, args, kwargs
        As :func:`vjp` takes them (``args`` a tuple, ``kwargs`` a dict).
    forward : callable or None
        None runs the dispatcher's forward operation.  Otherwise it stands in
        for it: ``forward(problem, *extras)`` must return what that operation
        returns for the validated problem (``(out, lse)`` canonical, or
        ``out`` for :func:`attnnb.diff_attention`), e.g. the saved result of
        an earlier identical call, so that a pullback can be built without
        running the forward again.

    Returns
    -------
    result
        As :func:`vjp`.
    saved : _Saved
        ``saved.out`` and ``saved.lse`` are the canonical forward results
        (``lse`` None for :func:`attnnb.diff_attention`);
        ``saved.gradients(dout, dlse)`` is the pullback.
    return_lse : bool
    """
    spec = _SPECS.get(_key(fn))
    if spec is None:
        names = ", ".join(f"attnnb.{f.__name__}" for f in _FUNCTIONS)
        raise TypeError(f"vjp supports {names}; got {fn!r}")
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return spec(bound.arguments, forward)


def _key(fn):
    try:
        return fn if fn in _SPECS else None
    except TypeError:  # an unhashable object is no supported function either
        return None


# ---------------------------------------------------------------------------
# gradient dtypes and shapes


def _grad_dtype(x, fallback: np.dtype) -> np.dtype:
    """The dtype of ``x``'s gradient: ``x``'s floating dtype, else ``fallback``.

    Python numbers and integer arrays (accepted for bias, key sizes and lam)
    have no floating dtype of their own and get ``fallback``, the output's
    dtype; longdouble is computed and returned as float64, as the forward.
    """
    if isinstance(x, numbers.Number) and not isinstance(x, np.generic):
        return np.dtype(fallback)
    if is_device_array(x):
        from ._front.device import device_view

        x = device_view(x, need_reshape=False)
    try:
        dt = np.dtype(x.dtype)
    except (AttributeError, TypeError):  # lists, or a dtype NumPy cannot read (torch)
        dt = np.asarray(x).dtype
    if dt.kind != "f":
        return np.dtype(fallback)
    return np.dtype(np.float64) if dt.itemsize > 8 else dt


def _sum_to_shape(g: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``g`` over the axes that broadcasting ``shape`` to ``g.shape`` created."""
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and g.shape[a] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return np.asarray(g).reshape(shape)


def _restore(g, shape, dtype, host_restore, exact=True):
    """``host_restore(g)``, keeping a device gradient on the device.

    A device gradient (the ``cuda`` backend's, for device inputs) that needs
    no sum and no cast (``exact`` restores) is reshaped in place; otherwise
    it goes once through the host (a cast to float16, a partly broadcast
    batch, key sizes, ``lam``: small or rare) and back.
    """
    if g is None or not is_device_array(g):
        return host_restore(g)
    if exact and np.dtype(g.dtype) == dtype and g.size == int(np.prod(shape)):
        return g.reshape(shape)
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(host_restore(g.copy_to_host())))


@dataclass(frozen=True)
class _Arg:
    """How to hand a canonical gradient back: the user's shape and dtype."""

    shape: tuple
    dtype: np.dtype

    def restore(self, g) -> np.ndarray:
        return _restore(g, self.shape, self.dtype, lambda x: np.asarray(x).reshape(
            self.shape).astype(self.dtype, copy=False))


def _qkv_args(problem, q, k, v) -> dict[str, _Arg]:
    """The user's shapes (from the canonical ones) and gradient dtypes of q, k, v."""
    lead = 2 if problem.squeeze_head else 1
    batch = problem.batch_shape
    return {name: _Arg(batch + tuple(a.shape[lead:]), _grad_dtype(x, problem.out_dtype))
            for name, x, a in (("q", q, problem.q), ("k", k, problem.k), ("v", v, problem.v))}


@dataclass(frozen=True)
class _Pairwise:
    """A bias as the user gave it, against the canonical ``(B, H, Lq, Lk)``."""

    shape: tuple
    dtype: np.dtype
    canonical: tuple  # (B or 1, H or 1, Lq or 1, Lk or 1): what the backend returns
    batch: tuple
    squeeze: bool  # 2-D inputs: the canonical (1, 1, Lq, Lk) has no user batch or head

    @classmethod
    def of(cls, bias, problem, H: int):
        B, _, _, Lq, Lk, _, _ = problem.shape
        shape = tuple(np.shape(bias))
        batch = problem.batch_shape
        full = batch + ((Lq, Lk) if problem.squeeze_head else (H, Lq, Lk))
        user = (1,) * (len(full) - len(shape)) + shape  # validated: broadcasts to full
        if problem.squeeze_head:
            canonical = (1, 1)
        else:
            nb = len(batch)
            canonical = (1 if all(n == 1 for n in user[:nb]) else B,
                         1 if user[nb] == 1 else H)
        canonical += tuple(1 if n == 1 else m for n, m in zip(user[-2:], full[-2:]))
        return cls(shape, _grad_dtype(bias, problem.out_dtype), canonical, batch,
                   problem.squeeze_head)

    def restore(self, g) -> np.ndarray:
        return _restore(g, self.shape, self.dtype, self._host)

    def _host(self, g) -> np.ndarray:
        g = np.asarray(g)
        if self.squeeze:
            g = g[0, 0]
        else:
            lead = self.batch if g.shape[0] != 1 else (1,) * len(self.batch)
            g = g.reshape(lead + g.shape[1:])
        return _sum_to_shape(g, self.shape).astype(self.dtype, copy=False)


@dataclass(frozen=True)
class _SigmoidBias:
    """A learned ``sigmoid`` bias (one per query head) as the user gave it.

    The forward adds it to the bias (:func:`attnnb._front.validate.attention_problem`), so its
    gradient is the bias gradient summed over each head's logits: the backward returns
    the bias gradient in a shape that holds both (:func:`_dbias_tail`), and this sums
    it as it would a bias of the user's shape with two trailing axes of 1.
    """

    pairwise: _Pairwise
    shape: tuple

    @classmethod
    def of(cls, sigmoid_bias, problem):
        shape = tuple(np.shape(sigmoid_bias))
        stand_in = np.broadcast_to(np.zeros((), np.asarray(sigmoid_bias).dtype), shape + (1, 1))
        return cls(_Pairwise.of(stand_in, problem, problem.shape[1]), shape)

    @property
    def canonical(self) -> tuple:
        return self.pairwise.canonical

    def restore(self, g):
        return self.pairwise.restore(g).reshape(self.shape)


@dataclass(frozen=True)
class _KeySizes:
    """Key sizes as the user gave them: ``d key_size = d log key_size / key_size``."""

    shape: tuple
    dtype: np.dtype
    values: np.ndarray  # float64, ToMe's trailing axis dropped; broadcasts to (*batch, Lk)
    tome: bool
    batch: tuple

    @classmethod
    def of(cls, key_size, problem):
        if is_device_array(key_size):
            from ._front.device import device_view

            key_size = device_view(key_size, need_reshape=False).copy_to_host()
        arr = np.asarray(key_size)
        batch = problem.batch_shape
        # the layout rule of attnnb._front.checks.log_key_sizes: ToMe's (B, N, 1)
        tome = arr.ndim >= 1 and arr.shape[-1] == 1 and arr.ndim == len(batch) + 2
        values = (arr[..., 0] if tome else arr).astype(np.float64)
        return cls(arr.shape, _grad_dtype(key_size, problem.out_dtype), values, tome, batch)

    def restore(self, dlog) -> np.ndarray:
        return _restore(dlog, self.shape, self.dtype, self._host, exact=False)

    def _host(self, dlog) -> np.ndarray:
        dlog = np.asarray(dlog, np.float64)
        g = dlog.reshape(self.batch + dlog.shape[-1:]) / self.values
        g = _sum_to_shape(g, self.values.shape)
        if self.tome:
            g = g[..., None]
        return g.astype(self.dtype, copy=False)


@dataclass(frozen=True)
class _Sinks:
    """Learned sinks as the user gave them (docs/contract.md §1.15).

    A sink enters only the denominator: with ``r_i = sigmoid(lse_i - sink)``
    (the row's weight mass, the LSE excluding the sink), ``d out_i / d sink =
    -(1 - r_i) out_i``, so ``d sink = -sum_i (1 - r_i) (dout_i . out_i)``,
    from the forward's ``out`` and ``lse`` alone, whichever backend ran
    (the LSE's cotangent does not reach it).
    """

    shape: tuple
    dtype: np.dtype
    batch: tuple
    squeeze: bool

    @classmethod
    def of(cls, sinks, problem):
        return cls(tuple(np.shape(sinks)), _grad_dtype(sinks, problem.out_dtype),
                   problem.batch_shape, problem.squeeze_head)

    @staticmethod
    def gradient(problem, out, lse, dout) -> np.ndarray:
        """``d sink (B, Hq)`` in float64 from canonical ``out``, ``lse`` and ``dout``."""
        lse = np.asarray(lse, np.float64)
        sink = np.asarray(problem.sinks, np.float64)[:, :, None]
        with np.errstate(over="ignore", invalid="ignore"):
            rest = np.where(np.isneginf(lse), 0.0, 1.0 / (1.0 + np.exp(lse - sink)))
        # (einsum's dtype: float64 sums without float64 copies of both arrays)
        delta = np.einsum("bhid,bhid->bhi", dout, out, dtype=np.float64)
        return -np.sum(rest * delta, axis=-1)

    def restore(self, g) -> np.ndarray:
        g = np.asarray(g)
        g = g.reshape(self.batch + (() if self.squeeze else g.shape[1:]))
        return _sum_to_shape(g, self.shape).astype(self.dtype, copy=False)


def _stream_lses(problem, backend) -> tuple:
    """Each component map's LSE ``(B, H, Lq)`` of a differential problem, without its
    sink: the backend's attention over the stream's queries and keys, with values of
    width zero (only the sums), no dropout and no sinks.  A device problem's streams are
    gathered on the host (``q`` and ``k``) and copied back; its LSEs come to the host."""
    forward = _operations("attention", backend, problem)[0]
    q, k, v = problem.q, problem.k, problem.v
    if problem.on_device:
        from numba import cuda

        q, k = q.copy_to_host(), k.copy_to_host()
        no_values = cuda.device_array(tuple(v.shape[:-1]) + (0,), v.dtype)
    else:
        no_values = np.ascontiguousarray(v[..., :0])
    lses = []
    for c in range(2):
        qc, kc = (np.ascontiguousarray(x[:, c::2]) for x in (q, k))
        if problem.on_device:
            qc, kc = cuda.to_device(qc), cuda.to_device(kc)
        stream = replace(problem, q=qc, k=kc, v=no_values, dropout_p=0.0, sinks=None,
                         normalizer="softmax")
        lse = forward(stream)[1]
        lses.append(np.asarray(lse.copy_to_host() if is_device_array(lse) else lse,
                               np.float64))
    return tuple(lses)


def _diff_sink_gradient(problem, lses, lam, mode, out, dout, dlam) -> np.ndarray:
    """``d sink (B, 2H)`` of differential attention with sinks (docs/contract.md §2.4).

    A sink scales its map by ``r = sigmoid(lse - sink)``, so ``d sink = -sum_i (1 -
    r_i) t_i`` with ``t_i = sum_j A_ij dA_ij`` the map's share of the row.  The output
    is linear in ``A1`` and in ``lam`` times what ``lam`` multiplies (every gate held),
    so ``t1 = dout . out - lam dlam`` and ``t2 = lam dlam`` (0 in the Heaviside mode,
    whose second map gets no gradient), from any backend's results.
    """
    lam = np.asarray(lam, np.float64)
    dlam = np.asarray(dlam, np.float64)
    share1 = np.einsum("bhid,bhid->bhi", dout, out, dtype=np.float64) - lam * dlam
    shares = (share1, np.zeros_like(share1) if mode == "heaviside" else lam * dlam)
    sinks = np.asarray(problem.sinks, np.float64)
    grad = np.empty(sinks.shape)
    for c in range(2):
        with np.errstate(over="ignore"):
            rest = 1.0 / (1.0 + np.exp(lses[c] - sinks[:, c::2, None]))  # 1 - r
        grad[:, c::2] = -np.sum(rest * shares[c], axis=-1)
    return grad


def _cotangent(name, x, shape, canonical, dtype, of, on_device=False):
    """Check a cotangent against its primal's shape; return it canonical.

    For a device problem the cotangent is a device array (a host one is
    copied over): used in place when C-contiguous, in its own floating dtype
    (the kernels convert on load).
    """
    if on_device:
        return _device_cotangent(name, x, shape, canonical, dtype, of)
    arr = host_float_array(name, x)
    if arr.shape != tuple(shape):
        raise ValueError(f"{name} must have the shape of {of}, {tuple(shape)}; got shape "
                         f"{arr.shape}")
    out = np.ascontiguousarray(arr.reshape(canonical), dtype=dtype)
    return out if out.flags.writeable else out.copy()


def _device_cotangent(name, x, shape, canonical, dtype, of):
    from numba import cuda

    from ._front.device import device_view

    if not is_device_array(x):
        host = _cotangent(name, x, shape, canonical, dtype, of)
        return cuda.to_device(host)
    arr = device_view(x, need_reshape=False)
    float_dtype_of(name, arr.dtype)
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of {of}, {tuple(shape)}; got shape "
                         f"{tuple(arr.shape)}")
    if arr.is_c_contiguous():
        return arr.reshape(canonical)
    return cuda.to_device(np.ascontiguousarray(arr.copy_to_host()).reshape(canonical))


# ---------------------------------------------------------------------------
# the forward and its pullback


@dataclass(frozen=True)
class _Saved:
    """One forward pass: what each pullback call reads (never writes)."""

    operation: str  # the backward operation, "<function>_vjp"
    backward: Any
    problem: Any
    extras: tuple  # what follows ``problem`` in the forward call: pattern, top_k, (lam, mode)
    out: Any
    lse: Any  # None for diff_attention, whose forward keeps none
    out_shape: tuple
    args: dict  # name -> _Arg / _Pairwise / _KeySizes / _Lam
    tail: tuple  # (dbias_shape,) for the functions that take a bias, else ()
    stream_lses: tuple = ()  # diff_attention with sinks: each map's LSE (_stream_lses)

    def gradients(self, dout, dlse):
        p = self.problem
        dtype = p.compute_dtype
        dev = p.on_device
        dout = _cotangent("dout", dout, self.out_shape, self.out.shape, dtype, "out", dev)
        dmod = ()
        if self.lse is None:
            dq, dk, dv, dbias, dlks, dlam, *dmod = self.backward(p, *self.extras, self.out,
                                                                 dout, *self.tail)
        else:
            if dlse is not None:
                dlse = _cotangent("dlse", dlse, self.out_shape[:-1], self.lse.shape, dtype,
                                  "lse", dev)
            dq, dk, dv, dbias, dlks, *dmod = self.backward(p, *self.extras, self.out, self.lse,
                                                           dout, dlse, *self.tail)
            dlam = None
        raw = {"q": dq, "k": dk, "v": dv, "bias": dbias, "key_size": dlks, "lam": dlam,
               "sigmoid_bias": dbias, "score_mod": dmod[0] if dmod else None}
        if "sinks" in self.args and self.lse is None:
            raw["sinks"] = _diff_sink_gradient(p, self.stream_lses, *self.extras, self.out,
                                               dout, dlam)
        elif "sinks" in self.args:
            raw["sinks"] = _Sinks.gradient(p, self.out, self.lse, dout)
        return {name: arg.restore(raw[name]) for name, arg in self.args.items()}


def _pullback(saved: _Saved, return_lse: bool):
    if return_lse:
        def pullback(dout, dlse=None):
            """Gradients for the cotangents ``dout`` (``out``'s shape) and ``dlse``.

            ``dlse`` (``lse``'s shape) may be None: no gradient into the LSE.
            Returns a ``dict`` keyed by argument name (see :func:`attnnb.vjp`).
            """
            return saved.gradients(dout, dlse)
    else:
        def pullback(dout):
            """Gradients for the cotangent ``dout`` (``out``'s shape).

            Returns a ``dict`` keyed by argument name (see :func:`attnnb.vjp`).
            """
            return saved.gradients(dout, None)
    return pullback


def _operations(name: str, backend, problem, forward=None):
    """Resolve the backend once; the backward is looked up before the forward runs.

    ``forward``, when given, stands in for the dispatcher's forward (see :func:`run`).
    """
    chosen = _dispatch.choose_backend(backend, problem.on_device)
    backward = _dispatch.implementation(name + "_vjp", chosen)
    if forward is None:
        forward = _dispatch.implementation(name, chosen)
    return forward, backward


def _extra_args(a, problem, H, **given) -> dict:
    args = _qkv_args(problem, a["q"], a["k"], a["v"])
    if given.get("bias") is not None:
        args["bias"] = _Pairwise.of(given["bias"], problem, H)
    if given.get("key_size") is not None:
        args["key_size"] = _KeySizes.of(given["key_size"], problem)
    if given.get("sinks") is not None:
        args["sinks"] = _Sinks.of(given["sinks"], problem)
    if getattr(problem, "sigmoid_bias", None) is not None:
        args["sigmoid_bias"] = _SigmoidBias.of(a["sigmoid_bias"], problem)
    if getattr(problem, "score_mod", None) is not None:
        args["score_mod"] = _ModArrays()
    return args


class _ModArrays:
    """A score mod's parameters: the backend's gradients, flat in leaf order
    (:func:`attnnb._mods.compile.param_grads`), as they are."""

    @staticmethod
    def restore(grads) -> tuple:
        return tuple(grads)


def _check_mod_gradients(problem) -> None:
    """Before the forward: a score mod's derivatives must exist (docs/contract.md §2.10)."""
    mod = problem.score_mod
    if mod is None:
        return
    from ._mods.compile import check_slope, missing_array_gradients

    missing = missing_array_gradients(mod)
    if missing:
        raise NotImplementedError(
            f"vjp: score_mod {', '.join(missing)} reads float arrays but has no grad_arrays= "
            "(their gradients); pass grad_arrays=, or constant=True for arrays that take none")
    Lq, Lk = problem.shape[3], problem.shape[4]
    check_slope(mod, Lq, Lk, problem.compute_dtype)


def _dbias_tail(name, args) -> tuple:
    """The trailing ``dbias_shape`` argument of the backward operations that take one: the
    bias's canonical shape, or the smallest that holds both it and a learned sigmoid
    bias's ``(B or 1, Hq or 1, 1, 1)`` (each axis 1 or full, so the larger of the two)."""
    if name not in ("attention", "diff_attention"):
        return ()
    shapes = [args[n].canonical for n in ("bias", "sigmoid_bias") if n in args]
    if not shapes:
        return (None,)
    return (tuple(max(axis) for axis in zip(*shapes)),)


def _refuse_learned_sigmoid_bias(name, problem):
    """Functions whose backward returns no bias gradient have none for an array
    ``sigmoid_bias`` either: refused by name, never left out."""
    if problem.sigmoid_bias is not None:
        raise NotImplementedError(f"vjp: {name} with a learned sigmoid_bias (an array) has no "
                                  "gradient for it yet; pass a number, or use attention with "
                                  "a mask")


def _lse_function(name, a, forward, problem, extras, return_lse, bias=None, sinks=None):
    """Shared tail of attention, sparse_attention and topk_attention."""
    forward, backward = _operations(name, a["backend"], problem, forward)
    out_c, lse_c = forward(problem, *extras)
    out, lse = problem.restore(out_c, lse_c)
    Hq = problem.shape[1]
    args = _extra_args(a, problem, Hq, bias=bias, key_size=a["key_size"], sinks=sinks)
    saved = _Saved(name + "_vjp", backward, problem, extras, out_c, lse_c, out.shape, args,
                   _dbias_tail(name, args))
    return ((out, lse) if return_lse else out), saved, return_lse


def _attention(a, forward):
    return_lse = check_bool("return_lse", a["return_lse"])
    problem = attention_problem(a["q"], a["k"], a["v"], mask=a["mask"], bias=a["bias"],
                                key_size=a["key_size"], causal=a["causal"], scale=a["scale"],
                                normalizer=a["normalizer"], dropout_p=a["dropout_p"],
                                seed=a["seed"], sinks=a["sinks"],
                                sigmoid_bias=a["sigmoid_bias"], mask_mod=a["mask_mod"],
                                score_mod=a["score_mod"])
    _check_mod_gradients(problem)
    return _lse_function("attention", a, forward, problem, (), return_lse, bias=a["bias"],
                         sinks=a["sinks"])


def _sparse_attention(a, forward):
    return_lse = check_bool("return_lse", a["return_lse"])
    problem = attention_problem(a["q"], a["k"], a["v"], key_size=a["key_size"],
                                scale=a["scale"], normalizer=a["normalizer"],
                                dropout_p=a["dropout_p"], seed=a["seed"], sinks=a["sinks"],
                                sigmoid_bias=a["sigmoid_bias"], mask_mod=a["mask_mod"],
                                score_mod=a["score_mod"])
    _check_mod_gradients(problem)
    _refuse_learned_sigmoid_bias("sparse_attention", problem)
    _, Hq, _, Lq, Lk, _, _ = problem.shape
    pattern = check_pattern(a["pattern"], Lq, Lk, Hq)
    return _lse_function("sparse_attention", a, forward, problem, (pattern,), return_lse,
                         sinks=a["sinks"])


def _topk_attention(a, forward):
    return_lse = check_bool("return_lse", a["return_lse"])
    top_k = check_top_k(a["top_k"])
    problem = attention_problem(a["q"], a["k"], a["v"], mask=a["mask"],
                                key_size=a["key_size"], causal=a["causal"], scale=a["scale"],
                                normalizer=a["normalizer"], dropout_p=a["dropout_p"],
                                seed=a["seed"], sinks=a["sinks"],
                                sigmoid_bias=a["sigmoid_bias"], mask_mod=a["mask_mod"],
                                score_mod=a["score_mod"])
    _check_mod_gradients(problem)
    _refuse_learned_sigmoid_bias("topk_attention", problem)
    return _lse_function("topk_attention", a, forward, problem, (top_k,), return_lse,
                         sinks=a["sinks"])


def _diff_attention(a, forward):
    mode = a["mode"]
    check_mode(mode)
    problem = attention_problem(a["q"], a["k"], a["v"], mask=a["mask"], bias=a["bias"],
                                key_size=a["key_size"], causal=a["causal"], scale=a["scale"],
                                head_pairs=True, dropout_p=a["dropout_p"], seed=a["seed"],
                                sinks=a["sinks"], mask_mod=a["mask_mod"],
                                score_mod=a["score_mod"])
    _check_mod_gradients(problem)
    if problem.squeeze_head:  # the refusal of diff_attention, word for word
        raise ValueError(
            "q, k and v must have a head axis: (*batch, 2H, L, d), (*batch, 2Hk, L, d) and "
            f"(*batch, Hk, L, Dv); got 2-D q of shape {np.shape(problem.q)[2:]}"
        )
    B, H2, _, Lq, _, _, Dv = problem.shape
    H = H2 // 2
    comp = compute_dtypes(problem.q.dtype, problem.k.dtype, problem.v.dtype)[0]
    lam_b = lambda_rows(a["lam"], problem.batch_shape, B, H, Lq, comp)
    forward, backward = _operations("diff_attention", a["backend"], problem, forward)
    out_c = forward(problem, lam_b, mode)
    out = out_c.reshape(problem.batch_shape + (H, Lq, Dv))
    if not problem.on_device:
        out = out.astype(problem.out_dtype, copy=False)
    args = _extra_args(a, problem, H, bias=a["bias"], key_size=a["key_size"],
                       sinks=a["sinks"])
    args["lam"] = _Lam(tuple(np.shape(a["lam"])), _grad_dtype(a["lam"], problem.out_dtype),
                       problem.batch_shape)
    lses = () if problem.sinks is None else _stream_lses(problem, a["backend"])
    saved = _Saved("diff_attention_vjp", backward, problem, (lam_b, mode), out_c, None,
                   out.shape, args, _dbias_tail("diff_attention", args), lses)
    return out, saved, False


@dataclass(frozen=True)
class _Lam:
    """``lam`` as the user gave it, against the canonical ``(B, H, Lq)``."""

    shape: tuple
    dtype: np.dtype
    batch: tuple

    def restore(self, g) -> np.ndarray:
        return _restore(g, self.shape, self.dtype, self._host, exact=False)

    def _host(self, g) -> np.ndarray:
        g = np.asarray(g)
        g = _sum_to_shape(g.reshape(self.batch + g.shape[1:]), self.shape)
        return g.astype(self.dtype, copy=False)


_FUNCTIONS = (attention, sparse_attention, topk_attention, diff_attention)
_SPECS = dict(zip(_FUNCTIONS, (_attention, _sparse_attention, _topk_attention,
                               _diff_attention)))
