"""attnnb on JAX arrays: the four attention functions as ``jax.custom_vjp`` functions.

``import attnnb.jax`` (extra ``attnnb[jax]``; ``import attnnb`` alone never
imports JAX) gives :func:`attention`, :func:`sparse_attention`,
:func:`topk_attention` and :func:`diff_attention` with the arguments and
results of their NumPy namesakes (docs/contract.md §2), taking and returning
JAX arrays.  They work under ``jax.jit``, ``jax.grad`` (and ``jax.vjp``,
``jax.jacrev``) and ``jax.vmap``, and compose with each other and with the
rest of JAX.  Forward mode (``jax.jvp``, ``jax.jacfwd``) is not offered: a
``custom_vjp`` function is reverse mode only.

How it runs
-----------
The forward and the backward pass each run attnnb's NumPy API on the host
through one ``jax.pure_callback``; JAX arrays on other devices are copied to
the host and back.

* **Arguments.** ``q``, ``k``, ``v``, ``bias``, ``key_size``, ``lam`` and
  ``sinks`` are differentiable arrays (when floating); ``mask`` is an array without a
  gradient (its cotangent is zero).  Everything else (``causal``, ``scale``,
  ``normalizer``, ``pattern``, ``top_k``, ``mode``, ``return_lse``,
  ``backend``) is static: a Python value fixed when the function is traced,
  never a traced array (a traced ``scale`` is a ``TypeError``).
* **Residuals.** The forward keeps its output and LSE (in the compute dtype)
  as JAX residuals, and the backward hands them to the backend's backward
  operation through :mod:`attnnb._bridges.common`: the forward is never run twice.
  Each callback pays for a host copy of ``q``, ``k``, ``v`` (JAX hands
  read-only buffers, which the cpu kernels take only as copies) and, in the
  backward, of the residuals and the cotangent (docs/notes/performance.md, "The JAX
  bridge's callbacks").
* **vmap.** The callbacks use ``vmap_method="expand_dims"``: each ``vmap``
  level adds one leading axis to every argument, of size 1 where that
  argument is not batched.  Before the call, the arguments are given the
  rank of the full problem (``mask`` and ``bias`` that of ``(*batch, H, Lq,
  Lk)``, ``key_size`` that of ``(*batch, Lk)``, ``lam`` that of ``(*batch, H,
  Lq)``; 2-D ``(L, D)`` inputs one head axis), so the new axes are leading
  batch axes of every argument; inside the callback they are broadcast
  against each other as zero-copy NumPy views.  ``"broadcast_all"`` would
  tile every unbatched argument (a shared ``(Lq, Lk)`` bias, a mask) in
  memory first; ``"sequential"`` would call attnnb once per batch element.
* **Mask and score functions** (``mask_mod``, ``score_mod``,
  :mod:`attnnb.mods`) are static, their arrays NumPy constants of the
  gradient: a score function gets no gradient into its arrays here (it runs
  as :func:`attnnb.mods.constant` of itself), and a mod cannot be built from
  a traced array (a ``TypeError`` at its construction).  Build mods outside
  the traced function, as ``pattern``.
* **Dropout** (``dropout_p``, static, and ``seed``): the kernels' own
  dropout (docs/contract.md §1.14), its decisions regenerated in the backward
  from the seed.  ``seed`` is a Python int (static: a new value traces the
  function anew) or a scalar integer JAX array, which may be traced (drawn
  from a ``jax.random`` key inside ``jax.jit``); under ``vmap`` the seed must
  be the same for every mapped element (the mapped axes are batch axes of
  the call, so their decisions differ all the same).
* **Backend.** ``backend=None`` is resolved (:func:`attnnb.use_backend`, then
  ``ATTNNB_BACKEND``, then ``"cpu"``) when the function is traced: under
  ``jax.jit`` at the first call, and it then stays for that compiled
  function.
* **Errors.** Shapes, dtypes and static arguments are checked at trace time
  with attnnb's own messages.  Values (positive, finite ``key_size``;
  finite ``lam``) are checked after them, before the call, when they are
  concrete arrays: the NumPy call's ``ValueError``.  Traced values (under
  ``jax.jit``, ``jax.grad`` or ``jax.vmap``) are checked when the callback
  runs, and such an error surfaces as JAX's runtime error carrying attnnb's
  message.  Both name the offending entry in the argument's own shape, but
  for an argument that ``vmap`` batched: that one is named in the shape the
  callback sees (the mapped axes first, then the argument given the full
  problem's rank).
* **Precision.** As in attnnb: float32 in, float32 out; float64 (with
  ``jax_enable_x64``) in, float64 out; float16 computed in float32, the
  output rounded from the float32 residual (bit for bit attnnb's on cpu;
  the ``reference`` backend's float64 result is thus rounded twice and may
  differ from its NumPy call by one unit in the last place).  ``bfloat16``
  is a ``TypeError``, as NumPy has no such type of its own.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> import attnnb.jax as ajax
>>> q = k = v = jnp.ones((2, 5, 4))
>>> loss = lambda q: ajax.attention(q, k, v, causal=True).sum()
>>> jax.jit(jax.grad(loss))(q).shape
(2, 5, 4)
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from . import mods
from ._bridges import common as _bridge
from ._front.checks import check_key_size_values
from ._front.function_args import check_lam_values

__all__ = ["attention", "diff_attention", "sparse_attention", "topk_attention"]

# One leading axis per vmap level on every argument, size 1 where unbatched (see above).
_VMAP_METHOD = "expand_dims"


def attention(q, k, v, *, mask=None, bias=None, key_size=None, causal=False, scale=None,
              normalizer="softmax", return_lse=False, sinks=None, sigmoid_bias=None,
              mask_mod=None, score_mod=None, dropout_p=0.0, seed=None, backend=None):
    """:func:`attnnb.attention` on JAX arrays, differentiable in q, k, v, bias, key_size,
    sinks and a learned sigmoid_bias.

    Parameters
    ----------
    q, k, v : JAX arrays ``(*batch, Hq, Lq, D)``, ``(*batch, Hk, Lk, D)``, ``(*batch, Hk, Lk, Dv)``
        Or 2-D ``(L, D)``: one head.
    mask : bool JAX array broadcastable to ``(*batch, Hq, Lq, Lk)``, optional
        No gradient.
    bias : JAX array broadcastable to ``(*batch, Hq, Lq, Lk)``, optional
    key_size : positive JAX array broadcastable to ``(*batch, Lk)``, optional
    sinks : JAX array broadcastable to ``(*batch, Hq)``, optional
        Learned sink logits (``normalizer="softmax"``), with a gradient.
    sigmoid_bias : float, or JAX array broadcastable to ``(*batch, Hq)``, optional
        ``normalizer="sigmoid"``'s bias: a number is static (no gradient); an array
        of one or more axes is one learned bias per query head, with a gradient.
    causal, scale, normalizer, return_lse, backend
        Static, as in :func:`attnnb.attention` (every normalizer).
    dropout_p : float, optional
        Static: attention dropout (:func:`attnnb.attention`'s, module notes).
    seed : int or integer JAX array, optional
        The dropout's seed (needed with ``dropout_p > 0``): a Python int
        (static) or a scalar integer array (traced, e.g. drawn from a
        ``jax.random`` key each step).
    mask_mod, score_mod : :mod:`attnnb.mods` objects or Python functions, optional
        Static; their arrays are constants of the gradient (module notes).

    Returns
    -------
    out : JAX array ``(*batch, Hq, Lq, Dv)``
    lse : JAX array ``(*batch, Hq, Lq)``, only with ``return_lse=True``
        Differentiable too: its cotangent reaches the backward pass.
    """
    learned = np.ndim(sigmoid_bias) > 0  # an array of one bias per head: traced
    arrays = dict(q=q, k=k, v=v, mask=mask, bias=bias, key_size=key_size, sinks=sinks,
                  sigmoid_bias=sigmoid_bias if learned else None)
    static = dict(causal=causal, scale=scale, normalizer=normalizer, return_lse=return_lse,
                  backend=backend, **_mods(mask_mod, score_mod))
    if not learned and sigmoid_bias is not None:  # a number: static (a 0-d array read once)
        static["sigmoid_bias"] = (sigmoid_bias.item() if hasattr(sigmoid_bias, "item")
                                  else sigmoid_bias)
    return _call("attention", arrays, static, dropout_p, seed)


def sparse_attention(q, k, v, pattern, *, key_size=None, scale=None, normalizer="softmax",
                     return_lse=False, sinks=None, mask_mod=None, score_mod=None,
                     dropout_p=0.0, seed=None, backend=None):
    """:func:`attnnb.sparse_attention` on JAX arrays, differentiable in q, k, v, key_size,
    sinks.

    Parameters
    ----------
    q, k, v : JAX arrays, as in :func:`attention`
    pattern : :class:`attnnb.patterns.Pattern`
        Static, of shape ``(Lq, Lk)``; a constant of the gradient.
    key_size : positive JAX array broadcastable to ``(*batch, Lk)``, optional
    sinks : JAX array broadcastable to ``(*batch, Hq)``, optional
    scale, normalizer, return_lse, backend
        Static, as in :func:`attnnb.sparse_attention`.
    dropout_p, seed, mask_mod, score_mod
        As in :func:`attention`.

    Returns
    -------
    out : JAX array ``(*batch, Hq, Lq, Dv)``
    lse : JAX array ``(*batch, Hq, Lq)``, only with ``return_lse=True``
    """
    return _call("sparse_attention", dict(q=q, k=k, v=v, key_size=key_size, sinks=sinks),
                 dict(pattern=pattern, scale=scale, normalizer=normalizer,
                      return_lse=return_lse, backend=backend, **_mods(mask_mod, score_mod)),
                 dropout_p, seed)


def topk_attention(q, k, v, top_k, *, mask=None, causal=False, key_size=None, scale=None,
                   normalizer="softmax", return_lse=False, sinks=None, sigmoid_bias=None,
                   mask_mod=None, score_mod=None, dropout_p=0.0, seed=None, backend=None):
    """:func:`attnnb.topk_attention` on JAX arrays, differentiable in q, k, v, key_size,
    sinks.

    Parameters
    ----------
    q, k, v : JAX arrays, as in :func:`attention`
    top_k : int
        Static.  The keys each row kept are a constant of the gradient.
    mask : bool JAX array broadcastable to ``(*batch, Hq, Lq, Lk)``, optional
    key_size : positive JAX array broadcastable to ``(*batch, Lk)``, optional
    sinks : JAX array broadcastable to ``(*batch, Hq)``, optional
    causal, scale, normalizer, return_lse, sigmoid_bias, backend
        Static, as in :func:`attnnb.topk_attention` (``sigmoid_bias`` a number).
    dropout_p, seed, mask_mod, score_mod
        As in :func:`attention`.

    Returns
    -------
    out : JAX array ``(*batch, Hq, Lq, Dv)``
    lse : JAX array ``(*batch, Hq, Lq)``, only with ``return_lse=True``
    """
    static = dict(top_k=top_k, causal=causal, scale=scale, normalizer=normalizer,
                  return_lse=return_lse, backend=backend, **_mods(mask_mod, score_mod))
    if sigmoid_bias is not None:
        static["sigmoid_bias"] = sigmoid_bias
    return _call("topk_attention", dict(q=q, k=k, v=v, mask=mask, key_size=key_size,
                                        sinks=sinks), static, dropout_p, seed)


def diff_attention(q, k, v, lam, *, mask=None, bias=None, key_size=None, causal=False,
                   scale=None, mode="difference", sinks=None, mask_mod=None, score_mod=None,
                   dropout_p=0.0, seed=None, backend=None):
    """:func:`attnnb.diff_attention` on JAX arrays, differentiable in q, k, v, lam, bias,
    key_size, sinks.

    Parameters
    ----------
    q, k, v : JAX arrays ``(*batch, 2H, Lq, d)``, ``(*batch, 2Hk, Lk, d)``, ``(*batch, Hk, Lk, Dv)``
    lam : float or JAX array broadcastable to ``(*batch, H, Lq)``
        A traced value like the other arrays: its gradient has its shape.
    mask : bool JAX array broadcastable to ``(*batch, H, Lq, Lk)``, optional
    bias : JAX array broadcastable to ``(*batch, H, Lq, Lk)``, optional
    key_size : positive JAX array broadcastable to ``(*batch, Lk)``, optional
    sinks : JAX array broadcastable to ``(*batch, 2H)``, optional
        A learned sink per component map (query head), with a gradient.
    causal, scale, mode, backend
        Static, as in :func:`attnnb.diff_attention` (``mode="rectified"``:
        the clip at 0 has derivative 0; ``"heaviside"``: the gate is held
        fixed).
    dropout_p, seed, mask_mod, score_mod
        As in :func:`attention`.

    Returns
    -------
    out : JAX array ``(*batch, H, Lq, Dv)``
    """
    return _call("diff_attention", dict(q=q, k=k, v=v, lam=lam, mask=mask, bias=bias,
                                        key_size=key_size, sinks=sinks),
                 dict(causal=causal, scale=scale, mode=mode, backend=backend,
                      **_mods(mask_mod, score_mod)), dropout_p, seed)


# ---------------------------------------------------------------------------


# each score mod's constant twin, kept while the mod lives: one custom_vjp function a mod
_CONSTANT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mods(mask_mod, score_mod) -> dict:
    """The static ``mask_mod`` / ``score_mod`` of a call (module notes); none: nothing."""
    out = {}
    if mask_mod is not None:
        out["mask_mod"] = mods.as_mask_mod(mask_mod)
    if score_mod is not None:
        given = mods.as_score_mod(score_mod)
        if given not in _CONSTANT:
            _CONSTANT[given] = mods.constant(given)
        out["score_mod"] = _CONSTANT[given]
    return out


@dataclass(frozen=True)
class _Call:
    """One traced call: what its callbacks need besides the arrays."""

    name: str
    static: dict  # backend resolved
    shapes: dict  # argument -> the shape handed to the callbacks (full rank)
    residuals: tuple  # shapes of (out,) or (out, lse) in the callbacks' layout
    residual_dtype: np.dtype
    grads: dict  # differentiable argument -> jax.ShapeDtypeStruct of its gradient
    return_lse: bool
    key: tuple  # equal for calls that can share one custom_vjp function (see _function)
    given: dict  # argument -> its shape as given (for the value checks' messages)

    @classmethod
    def of(cls, name, arrays, static, sig):
        shapes = _full_rank(arrays)
        lead = (1,) if arrays["q"].ndim == 2 else ()  # 2-D inputs get a head axis
        residuals = (lead + sig.out_shape,)
        if sig.lse_shape is not None:
            residuals += (lead + sig.lse_shape,)
        grads = {a: jax.ShapeDtypeStruct(shapes[a], x.dtype) for a, x in arrays.items()
                 if a in _bridge.DIFFERENTIABLE and jnp.issubdtype(x.dtype, jnp.floating)}
        key = (name, tuple((n, _hashable(x)) for n, x in sorted(static.items())),
               tuple((a, tuple(x.shape), np.dtype(x.dtype).str) for a, x in arrays.items()))
        return cls(name, static, shapes, residuals, np.dtype(sig.residual_dtype), grads,
                   bool(static.get("return_lse", False)), key,
                   {a: tuple(x.shape) for a, x in arrays.items()})


def _hashable(x):
    """``x`` as part of a cache key: by value when hashable, else by identity.

    An unhashable value (a :class:`~attnnb.patterns.Pattern`) is kept alive by
    the cached call's ``static``, so its ``id`` is not reused while cached.
    """
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return (type(x).__name__, x)


def _full_rank(arrays) -> dict:
    """The shapes that make a vmap axis a leading batch axis of every argument.

    Leading axes of size 1 change nothing under attnnb's broadcasting rules
    (mask, bias, key_size, lam and sinks broadcast against the full problem), so the
    shapes are as good as the given ones; they only fix every argument's rank.
    """
    q = arrays["q"].shape
    nb = max(len(q) - 3, 0)  # batch axes (2-D input: none, and a head axis is added)
    rank = {"q": 3, "k": 3, "v": 3, "mask": nb + 3, "bias": nb + 3, "key_size": nb + 1,
            "lam": nb + 2, "sinks": nb + 1, "sigmoid_bias": nb + 1, "seed": 0}
    return {a: (1,) * max(rank[a] - x.ndim, 0) + tuple(x.shape) for a, x in arrays.items()}


# arguments whose values (not only shapes) are checked, and how
_VALUE_CHECKS = {"key_size": check_key_size_values, "lam": check_lam_values}


def _check_values(arrays, call=None):
    """The value checks of ``key_size`` and ``lam``, in the shapes the user gave them.

    Outside a callback (``call`` None) only concrete arrays are checked:
    traced ones (under ``jax.jit``, ``jax.grad``, ``jax.vmap``) are left to
    the callback.  Inside one, an array in the rank :func:`_full_rank` gave it
    is checked in its given shape (``call.given``); one that ``vmap`` added
    axes to is checked in the shape the callback sees.
    """
    for name, check in _VALUE_CHECKS.items():
        x = arrays.get(name)
        if x is None or isinstance(x, jax.core.Tracer):
            continue
        x = np.asarray(x)
        if call is not None and x.ndim == len(call.shapes[name]):
            x = x.reshape(call.given[name])
        check(x)


def _seed(dropout_p, seed, static: dict):
    """``dropout_p`` into ``static``; a Python int ``seed`` too, else the seed array for
    the callbacks (None without one).  The signature's checks see a stand-in seed."""
    static["dropout_p"] = dropout_p
    if seed is None or isinstance(seed, int):
        static["seed"] = seed
        return None
    seed = jnp.asarray(seed)
    if seed.ndim != 0 or not jnp.issubdtype(seed.dtype, jnp.integer):
        raise TypeError(f"seed must be an integer or a scalar integer array; got an array of "
                        f"dtype {seed.dtype}, shape {tuple(seed.shape)}")
    return seed


def _call(name, arrays, static, dropout_p=0.0, seed=None):
    arrays = {a: jnp.asarray(x) for a, x in arrays.items() if x is not None}
    seed_array = _seed(dropout_p, seed, static)
    checked = static if seed_array is None else dict(static, seed=0)
    sig = _bridge.signature(name, {a: (x.shape, x.dtype) for a, x in arrays.items()}, checked)
    if seed_array is not None:
        arrays["seed"] = seed_array
    _check_values(arrays)  # known values: after the dtype and shape checks, as in NumPy
    call = _Call.of(name, arrays, dict(static, backend=sig.backend), sig)
    res = _function(call)({a: x.reshape(call.shapes[a]) for a, x in arrays.items()})
    out = res[0].astype(sig.out_dtype).reshape(sig.out_shape)
    if not call.return_lse:
        return out
    return out, res[1].astype(sig.lse_dtype).reshape(sig.lse_shape)


# Built custom_vjp functions by _Call.key, oldest first.  Outside jax.jit, JAX compiles
# each callback primitive for its callback object: reusing one per kind of call lets
# eager calls hit that cache instead of compiling anew every time.
_FUNCTIONS: dict = {}
_MAX_FUNCTIONS = 256


def _function(call: _Call):
    """The custom_vjp function for ``call``'s kind of call, built once and kept."""
    function = _FUNCTIONS.get(call.key)
    if function is None:
        function = _build(call)
        while len(_FUNCTIONS) >= _MAX_FUNCTIONS:
            _FUNCTIONS.pop(next(iter(_FUNCTIONS)), None)
        _FUNCTIONS[call.key] = function
    return function


def _build(call: _Call):
    """The call as a ``jax.custom_vjp`` function of its dict of arrays.

    It returns the residuals, ``(out,)`` or ``(out, lse)`` in the compute
    dtype and the callbacks' layout; :func:`_call` casts and reshapes them.
    """
    specs = tuple(jax.ShapeDtypeStruct(s, call.residual_dtype) for s in call.residuals)
    host_forward = functools.partial(_host_forward, call)
    host_backward = functools.partial(_host_backward, call)

    def forward(arrays):
        return jax.pure_callback(host_forward, specs, arrays, vmap_method=_VMAP_METHOD)

    def fwd(arrays):
        res = forward(arrays)
        return res, (arrays, res)

    def bwd(saved, cotangents):
        arrays, res = saved
        dlse = cotangents[1] if call.return_lse else None  # else: lse is not an output
        grads = jax.pure_callback(host_backward, call.grads, arrays, res, cotangents[0], dlse,
                                  vmap_method=_VMAP_METHOD)
        return ({a: grads.get(a) for a in arrays},)  # None: mask and integer arrays

    function = jax.custom_vjp(forward)
    function.defvjp(fwd, bwd)
    return function


def _host_seed(call: _Call, arrays) -> dict:
    """The call's static arguments with a traced seed's value (one for every element that
    ``vmap`` maps)."""
    seed = arrays.pop("seed", None)
    if seed is None:
        return call.static
    values = np.unique(np.asarray(seed))
    if values.size != 1 or values[0] < 0:
        raise ValueError(f"seed must be one integer >= 0 for the whole call; got {values}")
    return dict(call.static, seed=int(values[0]))


def _host_forward(call: _Call, arrays):
    _check_values(arrays, call)
    arrays, lead = _broadcast(call, arrays)
    static = _host_seed(call, arrays)
    _, residuals = _bridge.forward(call.name, arrays, static)
    return tuple(np.asarray(r).reshape(lead + s) for r, s in zip(residuals, call.residuals))


def _host_backward(call: _Call, arrays, res, dout, dlse):
    extra = {"out": (res[0], call.residuals[0]), "dout": (dout, call.residuals[0])}
    if len(res) > 1:
        extra["lse"] = (res[1], call.residuals[1])
    if dlse is not None:
        extra["dlse"] = (dlse, call.residuals[1])
    arrays, lead = _broadcast(call, arrays, extra)
    static = _host_seed(call, arrays)
    residuals = (arrays["out"], arrays.get("lse"))
    grads = _bridge.backward(call.name, {a: arrays[a] for a in call.shapes if a != "seed"},
                             static, residuals, arrays["dout"], arrays.get("dlse"))
    return {a: np.asarray(grads[a]).astype(spec.dtype, copy=False)
            for a, spec in call.grads.items()}


def _broadcast(call: _Call, arrays, extra=None):
    """Broadcast the vmap axes of every argument against each other (zero-copy views).

    Under ``vmap_method="expand_dims"`` each argument arrives with ``n``
    leading axes more than its traced shape (``n`` vmap levels), of size 1
    where it is not batched.  Returns the arrays, each of shape ``lead +``
    its traced shape, and ``lead``: so every result and every gradient gets
    the full vmap axes that JAX expects.
    """
    named = {a: (np.asarray(x), call.shapes[a]) for a, x in arrays.items()}
    named.update({a: (np.asarray(x), s) for a, (x, s) in (extra or {}).items()})
    n = named["q"][0].ndim - len(call.shapes["q"])
    lead = tuple(np.broadcast_shapes(*(x.shape[:n] for x, _ in named.values())))
    return {a: np.broadcast_to(x, lead + tuple(s)) for a, (x, s) in named.items()}, lead
