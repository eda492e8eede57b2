"""Checks of the arguments particular to one function: a sparse pattern, ``top_k``, the
differential mode, the head axis its pairs need and ``lam``.

Shared by the eager functions (:mod:`attnnb._front.eager`), :func:`attnnb.vjp` and
the Dask front (:mod:`attnnb._dask`), which check before anything runs.
"""

from __future__ import annotations

import numpy as np

from .._core.codes import DIFF_MODE_CODES
from ..patterns import Pattern
from .checks import as_named_array, is_device_array, where_first

MODES = tuple(DIFF_MODE_CODES)  # differential attention's public names; kernels see codes


def check_pattern(pattern, Lq: int, Lk: int, Hq: int) -> Pattern:
    if not isinstance(pattern, Pattern):
        raise TypeError("pattern must be an attnnb.patterns.Pattern (build one with "
                        "attnnb.patterns.local, ..., from_mask or from_scipy); got "
                        f"{type(pattern).__name__}")
    if pattern.shape != (Lq, Lk):
        raise ValueError(f"pattern has shape {pattern.shape} but q and k give "
                         f"(Lq, Lk) = {(Lq, Lk)}")
    if pattern.n_heads not in (1, Hq):
        raise ValueError(f"pattern has {pattern.n_heads} heads; expected 1 (shared) or the "
                         f"number of query heads, {Hq}")
    return pattern


def check_top_k(top_k) -> int:
    """``top_k`` as a Python int >= 0: an int, a NumPy integer or a 0-d integer array."""
    if isinstance(top_k, bool) or not hasattr(top_k, "__index__"):
        raise TypeError(f"top_k must be an integer; got {type(top_k).__name__} {top_k!r}")
    shape = tuple(getattr(top_k, "shape", ()))
    if shape:  # a 1-element array has __index__ but NumPy refuses to convert it
        raise TypeError(f"top_k must be an integer (an int or a 0-d integer array); got "
                        f"{type(top_k).__name__} of shape {shape} and dtype "
                        f"{getattr(top_k, 'dtype', '?')}")
    top_k = int(top_k.__index__())
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0; got {top_k}")
    return top_k


def check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")


def check_head_axis(squeeze: bool, q_shape) -> None:
    """Differential attention needs a head axis (it carries the pairs): no 2-D input."""
    if squeeze:
        raise ValueError(
            "q, k and v must have a head axis: (*batch, 2H, L, d), (*batch, 2Hk, L, d) and "
            f"(*batch, Hk, L, Dv); got 2-D q of shape {tuple(q_shape)}"
        )


def check_lam_values(arr: np.ndarray, offset: tuple = (), shape: tuple | None = None):
    """Reject a ``lam`` holding NaN or an infinity, naming the first such entry in the
    user's shape (``offset``, ``shape``: a chunk's place in it, see
    :func:`~attnnb._front.checks.where_first`)."""
    bad = ~np.isfinite(arr)
    if bad.any():
        # say where: a NaN lam usually comes from one diverged head of a reparam_lambda
        value = arr[bad][0] if arr.ndim else arr[()]
        raise ValueError(f"lam must be finite everywhere; got {value} "
                         f"{where_first(bad, offset, shape)}")


def lambda_rows(lam, batch_shape, B, H, Lq, dtype):
    """Check ``lam`` and return it as a C-contiguous ``(B, H, Lq)`` host array in ``dtype``."""
    if lam is None:
        raise TypeError("lam must be a real number or an array; got None")
    if is_device_array(lam):
        from .device import device_view  # imports numba.cuda: device arrays only

        lam = device_view(lam, need_reshape=False).copy_to_host()
    arr = as_named_array("lam", lam)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"lam must be a real number or a real array; got dtype {arr.dtype}")
    full = tuple(batch_shape) + (H, Lq)
    try:
        view = np.broadcast_to(arr, full)
    except ValueError:
        raise ValueError(
            f"lam of shape {arr.shape} cannot be broadcast to {full} (batch..., pairs, queries); "
            "pass per-head values as shape (H, 1)"
        ) from None
    check_lam_values(arr)
    return np.ascontiguousarray(view.astype(dtype).reshape(B, H, Lq))

