"""Canonical ``mask`` / ``bias`` / ``key_size`` when q, k, v are CUDA device arrays.

Imported only when q, k, v are device arrays (so numba-cuda is importable).

Choices (the contract is silent):

* ``mask``, ``bias`` and ``key_size`` may each be a host array (NumPy or
  anything ``np.asarray`` reads) or a device array.  Host arrays are checked
  and copied to the device in their compact (unbroadcast) form: a ``(Lk,)``
  key-padding mask travels as ``Lk`` booleans, never as ``Lq * Lk``.
* A C-contiguous device ``mask`` / ``bias`` whose batch axes are either all
  full or all 1 is used in place (reshaped to 4-D, no copy); any real dtype
  of ``bias`` is converted to the compute dtype as the kernel reads it.
  Other layouts take one round trip through the host.
* ``key_size`` must be checked for positivity before any work and is small
  (``(*batch, Lk)``), so a device ``key_size`` is copied to the host, checked,
  turned into its logarithm and copied back.
* ``sigmoid``'s offset ``b`` is added to the bias as on the host (the kernels
  see biased logits only): by a small kernel into a new array, so that a
  bias used in place is never written, or as a ``(1, 1, 1, 1)`` bias alone.

The problem then holds 4-D device arrays ``mask`` / ``bias`` whose axes are
each of full length or 1 (broadcast), and ``log_key_size`` as ``(B, Lk)``.
"""

from __future__ import annotations

import functools

import numpy as np

from .checks import _user_full_shape, broadcast_pairwise, is_device_array, log_key_sizes


def compact(x: np.ndarray) -> np.ndarray:
    """The smallest C-contiguous array that broadcasts back to ``x``.

    Axes of stride 0 (broadcast) keep length 1, so a ``(Lk,)`` key-padding
    mask broadcast to ``(B, H, Lq, Lk)`` becomes ``(1, 1, 1, Lk)``.
    """
    index = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None)
                  for st, n in zip(x.strides, x.shape, strict=True))
    return np.ascontiguousarray(x[index])


@functools.cache
def _simulator_array_class():
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    class SimulatorArray(FakeCUDAArray):
        """A simulator array whose ``shape`` is a plain tuple, as a real device array's
        (the simulator's own shape rejects negative indices)."""

        @property
        def shape(self):
            return tuple(self._ary.shape)

    return SimulatorArray


def device_view(x, *, name="array", need_reshape=True):
    """``x`` as a Numba device array, without a copy.

    Numba device arrays are used as they are; other objects exposing
    ``__cuda_array_interface__`` (CuPy, PyTorch) are wrapped.  With
    ``need_reshape`` (q, k, v), an array that is not 4-D must be C-contiguous
    so that it can be viewed as 4-D (a ``ValueError`` naming the argument
    ``name`` says so).
    """
    from numba import cuda

    if not hasattr(x, "copy_to_host"):
        x = cuda.as_cuda_array(x)
    elif type(x).__name__ == "FakeCUDAArray":
        x = _simulator_array_class()(x._ary, stream=x.stream)
    if need_reshape and len(x.shape) != 4 and x.size and not x.is_c_contiguous():
        # (B, H, L, D) views of any strides are read in place; other ranks must be
        # reshaped to 4-D, which Numba refuses to do without a copy
        raise ValueError(
            f"{name} is a non-contiguous CUDA device array of shape {tuple(x.shape)}, which "
            "cannot be used in place; pass a contiguous one (tensor.contiguous(), "
            "cupy.ascontiguousarray) or a 4-D (batch, heads, length, dim) view"
        )
    return x


def _compact_shape(name, shape, batch_shape, squeeze, B, Hq, Lq, Lk):
    """The 4-D shape a broadcastable ``shape`` takes without a copy, or None.

    None means the batch axes are partly broadcast, which a single
    canonical batch axis cannot express without materialising them.
    """
    full = _user_full_shape(batch_shape, squeeze, Hq, Lq, Lk)
    shape = tuple(shape)
    padded = (1,) * (len(full) - len(shape)) + shape
    if len(shape) > len(full) or any(n not in (1, f) for n, f in zip(padded, full, strict=True)):
        raise ValueError(f"{name} of shape {shape} cannot be broadcast to {full} "
                         "(batch..., heads, queries, keys)")
    if squeeze:
        return (1, 1) + padded
    nb = len(batch_shape)
    head = padded[:nb]
    if all(n == 1 for n in head):
        mb = 1
    elif head == tuple(batch_shape):
        mb = B
    else:
        return None
    return (mb,) + padded[nb:]


def device_pairwise(name, x, batch_shape, squeeze, B, Hq, Lq, Lk, dtype):
    """A mask (``dtype`` bool) or bias as a compact 4-D device array (see module notes)."""
    from numba import cuda

    if x is None:
        return None
    if is_device_array(x):
        arr = device_view(x, need_reshape=False)
        kind = np.dtype(arr.dtype)
        if dtype == np.bool_ and kind != np.bool_:
            raise TypeError(f"{name} must be a boolean array (True = may attend); "
                            f"got dtype {kind}")
        if dtype != np.bool_ and (kind.kind not in "fiu" or kind == np.bool_):
            raise TypeError(f"{name} must be a real numeric array; got dtype {kind}")
        shape4 = _compact_shape(name, arr.shape, batch_shape, squeeze, B, Hq, Lq, Lk)
        if shape4 is not None and arr.size:
            try:
                return arr.reshape(shape4)
            except NotImplementedError:  # not contiguous: through the host below
                pass
        x = arr.copy_to_host()
    view = broadcast_pairwise(name, x, batch_shape, squeeze, B, Hq, Lq, Lk, dtype)
    return cuda.to_device(compact(view))


def device_log_key_sizes(key_size, batch_shape, squeeze, B, Lk, dtype):
    """``log(key_size)`` as a ``(B, Lk)`` device array, checked on the host."""
    from numba import cuda

    if key_size is None:
        return None
    if is_device_array(key_size):
        key_size = device_view(key_size, need_reshape=False).copy_to_host()
    return cuda.to_device(log_key_sizes(key_size, batch_shape, squeeze, B, Lk, dtype))


def device_extras(mask, bias, key_size, batch_shape, squeeze, B, Hq, Lq, Lk, dtype,
                  offset=0.0):
    """``(mask, bias, log_key_size)`` on the device for a problem with device q, k, v.

    ``offset`` (``sigmoid``'s ``b``, a number) is added to the bias, on the device
    (:func:`shifted_bias`): the caller's array, used in place
    otherwise, is not written."""
    dev_mask = device_pairwise("mask", mask, batch_shape, squeeze, B, Hq, Lq, Lk, np.bool_)
    dev_bias = device_pairwise("bias", bias, batch_shape, squeeze, B, Hq, Lq, Lk, dtype)
    if offset:
        dev_bias = shifted_bias(dev_bias, offset, dtype)
    return dev_mask, dev_bias, device_log_key_sizes(key_size, batch_shape, squeeze, B, Lk,
                                                    dtype)


def shifted_bias(bias, offset, dtype):
    """``bias + offset`` as a new device array in ``dtype``: ``bias`` a C-contiguous device
    array of any real dtype, left as it is, or None (the offset alone, ``(1, 1, 1, 1)``).
    ``sigmoid``'s ``b`` for device inputs (:func:`attnnb._front.device.device_extras`)."""
    from numba import cuda

    from .device_kernels import SHIFT_THREADS, shift_kernel

    dtype = np.dtype(dtype)
    if bias is None:
        return cuda.to_device(np.full((1, 1, 1, 1), offset, dtype))
    out = cuda.device_array(bias.shape, dtype)
    if bias.size:
        kernel = shift_kernel(dtype.str)
        kernel[-(-bias.size // SHIFT_THREADS), SHIFT_THREADS](
            bias.reshape(bias.size), dtype.type(offset), out.reshape(out.size))
    return out
