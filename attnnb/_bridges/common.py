"""What the framework bridges share: attnnb's calls as a forward and a backward.

A framework's autodiff keeps its own residuals between the forward and the
backward pass, and they must be arrays (JAX's ``custom_vjp``, PyTorch's
custom ops).  :func:`attnnb.vjp`'s pullback is a closure, so this module
splits it: :func:`forward` runs a function and hands back the canonical
``out`` and ``lse`` as the residuals; :func:`backward` rebuilds the
pullback from the same arguments and those residuals, without running the
forward again (:func:`attnnb.vjp.run` with the residuals standing in for
the forward).  :func:`signature` validates a call from shapes and dtypes
alone and says what it returns, for tracing and fake tensors.

Every function takes the call as ``name`` (``"attention"``,
``"sparse_attention"``, ``"topk_attention"`` or ``"diff_attention"``),
``arrays`` (a dict of the array arguments given, by name: those of
:data:`ARRAYS`; leave out the ones not given) and ``static`` (a dict of the
other keyword arguments of the function, by name).  Arrays are anything
:func:`numpy.asarray` reads; nothing is written to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._front import dispatch as _dispatch
from .._front.validate import _kernel_ready, is_device_array
from ..attention import attention
from ..diff import diff_attention
from ..sparse import sparse_attention, topk_attention
from ..vjp import run

FUNCTIONS = {f.__name__: f for f in (attention, sparse_attention, topk_attention,
                                     diff_attention)}

# The array arguments of each function, and those of them with a gradient (when floating).
ARRAYS = {
    "attention": ("q", "k", "v", "mask", "bias", "key_size", "sinks", "sigmoid_bias"),
    "sparse_attention": ("q", "k", "v", "key_size", "sinks"),
    "topk_attention": ("q", "k", "v", "mask", "key_size", "sinks"),
    "diff_attention": ("q", "k", "v", "lam", "mask", "bias", "key_size", "sinks"),
}
DIFFERENTIABLE = ("q", "k", "v", "bias", "key_size", "lam", "sinks", "sigmoid_bias")


@dataclass(frozen=True)
class Signature:
    """What a call returns, found from its arguments' shapes and dtypes.

    Attributes
    ----------
    out_shape, out_dtype : tuple, numpy dtype
        The output, as the function returns it.
    lse_shape, lse_dtype : tuple, numpy dtype, or None
        The LSE as returned with ``return_lse=True``; None for
        :func:`attnnb.diff_attention`, which has none.  The LSE residual
        exists whenever ``lse_shape`` does, whether or not it is returned.
    residual_dtype : numpy dtype
        The dtype of the residuals (the compute dtype: float32, or float64
        for float64 inputs).
    backend : str
        The backend ``static["backend"]`` resolves to now; pass it on to
        :func:`forward` and :func:`backward` so that they run there whatever
        thread calls them (:func:`attnnb.use_backend` is per thread).
    """

    out_shape: tuple
    out_dtype: np.dtype
    lse_shape: tuple | None
    lse_dtype: np.dtype | None
    residual_dtype: np.dtype
    backend: str


def signature(name: str, specs: dict, static: dict) -> Signature:
    """Validate a call from shapes and dtypes, as the function itself would.

    Parameters
    ----------
    name : str
    specs : dict
        ``{argument: (shape, dtype)}`` for each array argument given.
    static : dict
        The other arguments, by name.

    Returns
    -------
    Signature

    Raises
    ------
    TypeError, ValueError
        Every error the function raises on arguments of those shapes and
        dtypes, word for word (checks of the values, such as positive key
        sizes, wait for the real call).
    NotImplementedError
        The backend has no backward pass.

    Notes
    -----
    The arguments are stand-ins that cost no work: zeros (pages the system
    hands out lazily; only dtypes that need a cast are touched), ones for
    key sizes, a broadcast True for the mask.  Nothing runs on a backend.
    """
    backend = _dispatch.choose_backend(static.get("backend"), False)
    arrays = {arg: _stand_in(arg, shape, dtype) for arg, (shape, dtype) in specs.items()}
    result, saved, _ = _run(name, arrays, dict(static, backend=backend), _zeros(name))
    out, lse = (result if isinstance(result, tuple) else (result, None))
    if lse is None and saved.lse is not None:  # return_lse=False: its shape and dtype still
        lse = saved.problem.restore(saved.out, saved.lse)[1]
    return Signature(out.shape, out.dtype, None if lse is None else lse.shape,
                     None if lse is None else lse.dtype, saved.out.dtype, backend)


def forward(name: str, arrays: dict, static: dict):
    """Run the function; return its result and the residuals for :func:`backward`.

    Returns
    -------
    result
        Exactly what the function returns for these arguments.
    residuals : tuple
        ``(out, lse)``: the forward's canonical output ``(B, Hq, Lq, Dv)`` and
        LSE ``(B, Hq, Lq)`` (``B`` the product of the batch axes), in the
        signature's ``residual_dtype``; ``lse`` is None for
        :func:`attnnb.diff_attention`.  They may be kept in any shape with
        that many elements (e.g. reshaped to the output's layout).

    Notes
    -----
    The ``reference`` backend computes in float64 and returns float64; its
    residuals are rounded to the compute dtype here, so that they have one
    dtype on every backend.  Its backward reads neither (it recomputes
    everything in float64 from the inputs), so its gradients are unchanged.
    """
    result, saved, _ = _run(name, arrays, static)
    dtype = saved.problem.compute_dtype
    return result, tuple(None if r is None else _in_dtype(r, dtype) for r in (saved.out, saved.lse))


def backward(name: str, arrays: dict, static: dict, residuals: tuple, dout, dlse=None) -> dict:
    """The gradients of the call that :func:`forward` ran, from its residuals.

    Parameters
    ----------
    name, arrays, static
        The same as given to :func:`forward`.
    residuals : tuple
        What :func:`forward` returned, values unchanged (any shape, same size).
    dout : array
        The cotangent of the output, of its shape.
    dlse : array or None
        The cotangent of the LSE (only with ``return_lse=True``); None: zero.

    Returns
    -------
    dict
        As :func:`attnnb.vjp`'s pullback: ``"q"``, ``"k"``, ``"v"``, and
        ``"bias"``, ``"key_size"``, ``"lam"`` where the function has them and
        they were given; each of its argument's shape and dtype.
    """
    _, saved, return_lse = _run(name, arrays, static, _replay(*residuals))
    return saved.gradients(dout, dlse if return_lse else None)


def _run(name, arrays, static, stand_in=None):
    """:func:`attnnb.vjp.run` on keyword arguments; unknown names are a TypeError."""
    unknown = set(arrays) - set(ARRAYS[name])
    if unknown:
        raise TypeError(f"{name} takes no array argument {sorted(unknown)}")
    return run(FUNCTIONS[name], (), {**arrays, **static}, stand_in)


def _in_dtype(x, dtype: np.dtype):
    """``x`` in ``dtype`` (only the reference backend's float64 host results need a cast)."""
    return x if x.dtype == dtype else np.asarray(x).astype(dtype)


def _stand_in(arg: str, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if arg == "mask":  # a view: a full (B, H, Lq, Lk) mask would cost its size
        return np.broadcast_to(np.ones((), dtype), tuple(shape))
    if arg == "key_size":  # validated as positive; (*batch, Lk) is small
        return np.ones(shape, dtype)
    return np.zeros(shape, dtype)


def _canonical_shapes(problem, diff: bool):
    """The canonical ``out`` and ``lse`` shapes of ``problem``'s forward."""
    B, Hq, _, Lq, _, _, Dv = problem.shape
    H = Hq // 2 if diff else Hq  # differential attention: one output head per query pair
    return (B, H, Lq, Dv), (B, H, Lq)


def _zeros(name: str):
    """A forward that returns zeros of the right shapes: for :func:`signature`."""
    diff = name == "diff_attention"

    def forward(problem, *extras):
        out, lse = _canonical_shapes(problem, diff)
        dtype = problem.compute_dtype
        return np.zeros(out, dtype) if diff else (np.zeros(out, dtype), np.zeros(lse, dtype))

    return forward


def _replay(out, lse):
    """A forward that returns the saved residuals, as the backends' kernels take them."""

    def forward(problem, *extras):
        out_shape, lse_shape = _canonical_shapes(problem, lse is None)
        dtype = problem.compute_dtype
        o = _residual("out", out, out_shape, dtype)
        return o if lse is None else (o, _residual("lse", lse, lse_shape, dtype))

    return forward


def _residual(what: str, x, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if is_device_array(x):  # a CUDA tensor's residuals stay on the device, read in place
        from .._front.device import device_view

        dev = device_view(x, need_reshape=False)
        if dev.size != int(np.prod(shape)) or np.dtype(dev.dtype) != dtype:
            raise ValueError(f"the saved {what} must hold {int(np.prod(shape))} values of "
                             f"dtype {dtype}; got shape {tuple(dev.shape)} and dtype "
                             f"{np.dtype(dev.dtype)}")
        return dev.reshape(shape)
    arr = np.asarray(x)
    if arr.size != int(np.prod(shape)) or arr.dtype != dtype:
        raise ValueError(f"the saved {what} must hold {int(np.prod(shape))} values of dtype "
                         f"{dtype} (the forward's canonical {shape}); got shape {arr.shape} "
                         f"and dtype {arr.dtype}")
    return _kernel_ready(arr.reshape(shape), dtype)
