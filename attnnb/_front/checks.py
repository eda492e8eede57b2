"""Checks shared by the host (``_validate``) and device (``_device``) argument paths.

A leaf module: it imports NumPy and, only when handed a device array,
``numba.cuda``; never another module of the package.  Both ``_validate`` and
``_device`` import from here, so neither needs the other at import time.

Every error names the argument, what was received and what was expected.
Nothing here writes to its inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_device_array(x: Any) -> bool:
    """True when ``x`` is a CUDA device array (CuPy, PyTorch CUDA, Numba, simulator).

    Imports ``numba.cuda`` only when ``x`` looks like a device array, so that
    host-only use never pays for (or fails on) the CUDA import.
    """
    if isinstance(x, np.ndarray) or x is None:
        return False
    if not (hasattr(x, "__cuda_array_interface__") or hasattr(x, "__cuda_ndarray__")):
        return False
    try:
        from numba import cuda
    except Exception:  # pragma: no cover - numba-cuda missing
        return False
    check = getattr(cuda, "is_cuda_array", None)  # the simulator has none
    if check is not None and check(x):
        return True
    # Numba device arrays, also the simulator's (which lack the interface)
    return bool(getattr(x, "__cuda_ndarray__", False))


def where_first(bad: np.ndarray, offset: tuple = (), shape: tuple | None = None) -> str:
    """Where the first True entry of ``bad`` sits, for an error message.

    Parameters
    ----------
    bad : bool array
        Must hold at least one True entry.
    offset : tuple of int, optional
        Where ``bad``'s first entry sits in a larger array (one chunk of a
        Dask array); added to the index.
    shape : tuple of int, optional
        That larger array's shape (default ``bad.shape``).

    Returns
    -------
    str
        ``"at index (i, j) of shape (m, n)"``, the index in the array's own
        shape (C order), or ``"(scalar)"`` for a 0-d array.
    """
    if bad.ndim == 0:
        return "(scalar)"
    flat = int(np.flatnonzero(bad.reshape(-1))[0])
    local = np.unravel_index(flat, bad.shape)
    index = tuple(int(i) + int(o) for i, o in zip(local, offset or (0,) * bad.ndim))
    return f"at index {index} of shape {tuple(bad.shape if shape is None else shape)}"


def _user_full_shape(batch_shape, squeeze, Hq, Lq, Lk):
    return batch_shape + ((Lq, Lk) if squeeze else (Hq, Lq, Lk))


_RESHAPE_HAS_COPY = np.lib.NumpyVersion(np.__version__) >= "2.1.0"


def _reshaped_view(x: np.ndarray, shape: tuple) -> np.ndarray:
    """``x`` reshaped to ``shape`` as a view; ``ValueError`` where that needs a copy.

    ``np.reshape(..., copy=False)`` says so from NumPy 2.1; before, a view with
    the new shape set in place does (an ``AttributeError``).
    """
    if _RESHAPE_HAS_COPY:
        return np.reshape(x, shape, copy=False)
    view = x.view()
    try:
        view.shape = shape
    except AttributeError as err:
        raise ValueError(str(err)) from None
    return view


def broadcast_pairwise(name, x, batch_shape, squeeze, B, Hq, Lq, Lk, dtype):
    """Broadcast a mask or bias to the canonical ``(B, Hq, Lq, Lk)`` as a view.

    The cast to ``dtype`` happens on the user's (unbroadcast) shape, so a
    ``(Lk,)`` key-padding mask never grows to ``Lq * Lk``.  With several batch
    axes that the array broadcasts along only in part (a ``(B1, 1, 1, Lq,
    Lk)`` bias for ``(B1, B2, ...)`` queries), merging them into one axis is
    not a view: then only the batch axes are copied out (``B1 * B2`` times the
    user's trailing three axes), never the heads or rows it broadcasts along.
    """
    if x is None:
        return None
    arr = as_named_array(name, x)
    if dtype == np.bool_:
        if arr.dtype != np.bool_:
            raise TypeError(f"{name} must be a boolean array (True = may attend); "
                            f"got dtype {arr.dtype}")
    else:
        if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
            raise TypeError(f"{name} must be a real numeric array; got dtype {arr.dtype}")
        arr = arr.astype(dtype, copy=False)
    full = _user_full_shape(batch_shape, squeeze, Hq, Lq, Lk)
    try:
        view = np.broadcast_to(arr, full)
    except ValueError:
        raise ValueError(
            f"{name} of shape {arr.shape} cannot be broadcast to {full} "
            "(batch..., heads, queries, keys)"
        ) from None
    if not view.size:
        return np.zeros((B, Hq, Lq, Lk), arr.dtype)
    try:
        return _reshaped_view(view, (B, Hq, Lq, Lk))
    except ValueError:  # the batch axes do not merge as a view: copy them alone
        padded = arr.reshape((1,) * (len(full) - arr.ndim) + arr.shape)
        tail = padded.shape[-3:]  # the user's heads, rows, keys (1 where broadcast)
        merged = np.ascontiguousarray(np.broadcast_to(padded, batch_shape + tail))
        merged = merged.reshape((B,) + tail)
        return np.broadcast_to(merged, (B, Hq, Lq, Lk))


def _is_torch_tensor(x: Any) -> bool:
    """True for a ``torch.Tensor`` or subclass, without importing torch."""
    return any(c.__name__ == "Tensor" and c.__module__ == "torch"
               for c in type(x).__mro__)


def refuse_unreadable_tensor(name: str, x: Any) -> None:
    """Refuse a PyTorch tensor that the NumPy functions could only read by detaching it.

    A tensor that requires grad would lose its gradient without a word, and a
    subclass (``CausalBias``, a masked or nested tensor) may mean something
    other than its storage: both are a ``TypeError`` naming the argument and
    the fix.  A ``torch.nn.Parameter`` that requires no grad is a plain tensor.
    """
    if x is None or isinstance(x, np.ndarray) or not _is_torch_tensor(x):
        return
    cls = type(x)
    if getattr(x, "requires_grad", False):
        raise TypeError(f"{name} is a torch.Tensor that requires grad: attnnb's NumPy "
                        "functions would drop its gradient; call attnnb.torch's function of "
                        f"the same name for gradients, or pass {name}.detach()")
    if cls.__name__ not in ("Tensor", "Parameter") or cls.__module__ not in (
            "torch", "torch.nn.parameter"):
        raise TypeError(f"{name} is a {cls.__module__}.{cls.__name__}, a torch.Tensor "
                        "subclass whose storage need not hold its values; pass a plain "
                        "tensor or NumPy array (attnnb.torch.scaled_dot_product_attention "
                        "understands torch.nn.attention.bias.CausalBias)")


def as_named_array(name, x):
    """``np.asarray(x)``, with an error that names the argument (ragged lists).

    A ``numpy.ma`` masked array with masked entries is refused: ``np.asarray``
    would drop its mask and the masked data would be used as they are (pass
    ``x.filled(...)``, or for keys a ``mask=``).  One with no masked entry is
    taken as its data.  PyTorch tensors that need a detach are refused
    (:func:`refuse_unreadable_tensor`).
    """
    refuse_unreadable_tensor(name, x)
    if isinstance(x, np.ma.MaskedArray) and np.ma.getmaskarray(x).any():
        raise TypeError(f"{name} is a masked array with masked entries, which attnnb would "
                        "read as they are; pass x.filled(value), or say which keys to leave "
                        "out with mask=")
    try:
        return np.asarray(x)
    except (ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: e.g. a meta tensor
        raise TypeError(f"{name} could not be read as a NumPy array: {exc}") from exc


def check_key_size_values(arr: np.ndarray, offset: tuple = (), shape: tuple | None = None):
    """Reject a ``key_size`` holding NaN, an infinity, zero or a negative entry.

    A size of ``+inf`` would give ``log(key_size) = inf`` logits, on which
    the backends' running maxima disagree, so it is refused with the rest.
    The message reports the first offending entry, in the user's shape;
    ``offset`` and ``shape`` (:func:`where_first`) place a chunk of a larger
    array in it.
    """
    with np.errstate(invalid="ignore"):
        bad = ~((arr > 0) & (arr < np.inf))  # NaN fails both comparisons
    if not np.any(bad):
        return
    where = where_first(bad, offset, shape)
    value = arr[bad][0] if arr.ndim else arr[()]
    if np.isnan(value):
        raise ValueError("key_size must be finite and positive everywhere; it holds NaN "
                         f"{where}")
    if value > 0:
        raise ValueError("key_size must be finite and positive everywhere; it holds inf "
                         f"{where}")
    raise ValueError("key_size must be positive (and finite) everywhere; got "
                     f"{float(value)} {where}")


def log_key_sizes(key_size, batch_shape, squeeze, B, Lk, dtype):
    """Check ``key_size`` (positive, finite, broadcastable to ``(*batch, Lk)``); return its log.

    The result is a ``(B, Lk)`` array in the compute dtype.
    """
    if key_size is None:
        return None
    user = as_named_array("key_size", key_size)
    if user.dtype.kind not in "fiu" or user.dtype == np.bool_:
        raise TypeError(f"key_size must be a real numeric array; got dtype {user.dtype}")
    arr = user
    if arr.ndim >= 1 and arr.shape[-1] == 1 and arr.ndim == len(batch_shape) + 2:
        arr = arr[..., 0]  # accept ToMe's (B, N, 1) size layout
    full = batch_shape + (Lk,)
    try:
        view = np.broadcast_to(arr, full)
    except ValueError:
        raise ValueError(
            f"key_size of shape {arr.shape} cannot be broadcast to {full} (batch..., keys)"
        ) from None
    check_key_size_values(user)  # on the user's array, so the index is in its shape
    logs = np.log(view.astype(np.float64)).astype(dtype)
    return np.ascontiguousarray(logs.reshape(B, Lk))
