"""Argument checking and canonicalisation shared by every public function.

Public functions call these helpers to turn user input into a canonical
problem (4-D ``(B, H, L, D)`` arrays in the compute dtype, broadcast views
for masks and biases) before any numerical work starts.  Every error names
the argument, what was received and what was expected.

Nothing here computes attention and nothing here writes to its inputs.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The checks the device path shares live in a leaf module, so that _device
# (imported lazily below, as it needs numba-cuda) never imports this one.
from .._core.codes import NORMALIZER_CODES
from .._core.dropout import check_dropout
from .checks import (
    as_named_array,
    broadcast_pairwise,
    is_device_array,
    log_key_sizes,
    refuse_unreadable_tensor,
)

NORMALIZERS = tuple(NORMALIZER_CODES)  # the public names; the kernels see the codes


def float_dtype_of(name: str, dtype: np.dtype) -> np.dtype:
    """Check that ``dtype`` is a real floating dtype; return it."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(
            f"{name} must have a floating dtype (float16, float32 or float64); got {dtype}"
        )
    return dtype


def host_float_array(name: str, x: Any) -> np.ndarray:
    """``np.asarray(x)``, rejecting integer, bool, complex and object data."""
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    arr = as_named_array(name, x)  # e.g. ragged lists, masked arrays
    float_dtype_of(name, arr.dtype)
    return arr


def compute_dtypes(*dtypes: np.dtype) -> tuple[np.dtype, np.dtype]:
    """Return ``(compute_dtype, output_dtype)`` for the given input dtypes.

    The output dtype follows ``np.result_type``; float16 (and anything
    narrower than float32) is computed in float32.
    """
    out = np.result_type(*dtypes)
    comp = np.dtype(np.float64) if out == np.float64 else np.dtype(np.float32)
    if out.itemsize > 8:  # longdouble: computed and returned as float64
        out = comp = np.dtype(np.float64)
    return comp, out


def lse_dtype(out_dtype: np.dtype) -> np.dtype:
    """LSE is float32 for float16 inputs, else the output dtype."""
    return np.dtype(np.float32) if out_dtype == np.float16 else out_dtype


def check_normalizer(normalizer: str) -> str:
    if normalizer not in NORMALIZERS:
        raise ValueError(f"normalizer must be one of {NORMALIZERS}; got {normalizer!r}")
    return normalizer


def check_scale(scale: Any, head_dim: int) -> float:
    """Return the logit scale; ``None`` means ``1 / sqrt(head_dim)``.

    Python and NumPy real numbers (and 0-d real arrays) are accepted; bools,
    strings, complex numbers and sequences are a ``TypeError``.
    """
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, np.ndarray) and scale.ndim == 0:
        scale = scale[()]
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale must be a real number or None; got {type(scale).__name__} {scale!r}"
        )
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite; got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return bool(value)


@dataclass
class Problem:
    """A canonical attention problem handed to a backend.

    Attributes
    ----------
    q, k, v : arrays ``(B, Hq, Lq, D)``, ``(B, Hk, Lk, D)``, ``(B, Hk, Lk, Dv)``
        In the compute dtype, C-contiguous (host) or device arrays (cuda).
    mask : bool array broadcast to ``(B, Hq, Lq, Lk)`` or None
        True = may attend.  A broadcast view: it costs no memory.
    bias : array broadcast to ``(B, Hq, Lq, Lk)`` or None
    log_key_size : array broadcast to ``(B, Lk)`` or None
        ``log(key_size)``; the kernels add it to the logits.
    causal : bool
        Bottom-right aligned: key ``j`` allowed for query ``i`` when
        ``j <= i + Lk - Lq``.
    scale : float
    normalizer : str
    batch_shape : tuple
        The user's leading batch dimensions (``()`` for 3-D input).
    squeeze_head : bool
        The user passed 2-D ``(L, D)`` arrays: drop the head axis on output.
    out_dtype : numpy dtype
        The dtype the public function returns.
    dropout_p : float
        Probability of dropping each weight (inverted dropout, docs/contract.md
        §1.14); 0 means none.
    seed : int
        The dropout generator's seed, ``[0, 2**64)`` (:mod:`attnnb._core.dropout`).
    dropout_origin : tuple ``(b0, h0)``
        The batch element and head of this problem's first in the call whose
        indices key the dropout decisions: nonzero for a part of a problem run
        on its own (:func:`attnnb._core.bias_chunks.chunk_problem`), so that a part
        drops what the whole does.  Heads are query heads (head pairs for
        differential attention).
    sinks : array ``(B, Hq)`` or None
        Learned sink logits (docs/contract.md §1.15), in the compute dtype; the
        problem's ``normalizer`` is then ``"softmax1"``, whose ``+1`` is the
        case of a sink of 0.
    sigmoid_bias : array ``(B, Hq)`` or None
        A learned ``sigmoid`` bias, one per query head (docs/contract.md §1.5), when
        one was given as an array: already added to ``bias``; kept for its gradient.
    mask_mod, score_mod : :class:`attnnb.mods.MaskMod`, :class:`attnnb.mods.ScoreMod` or None
        Functions of ``(b, h, i, j)`` compiled into the kernels (docs/contract.md
        §2.10); ``dropout_origin`` is added to the ``b`` and ``h`` they get.
    """

    q: Any
    k: Any
    v: Any
    mask: Any = None
    bias: Any = None
    log_key_size: Any = None
    causal: bool = False
    scale: float = 1.0
    normalizer: str = "softmax"
    batch_shape: tuple = ()
    squeeze_head: bool = False
    out_dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float32))
    on_device: bool = False
    dropout_p: float = 0.0
    seed: int = 0
    dropout_origin: tuple = (0, 0)
    sinks: Any = None
    sigmoid_bias: Any = None
    mask_mod: Any = None
    score_mod: Any = None

    @property
    def shape(self) -> tuple[int, int, int, int, int, int, int]:
        """``(B, Hq, Hk, Lq, Lk, D, Dv)``."""
        B, Hq, Lq, D = self.q.shape
        Hk, Lk, Dv = self.k.shape[1], self.k.shape[2], self.v.shape[3]
        return B, Hq, Hk, Lq, Lk, D, Dv

    @property
    def compute_dtype(self) -> np.dtype:
        if self.on_device:  # device inputs keep their dtypes; the kernels convert on load
            return compute_dtypes(self.q.dtype, self.k.dtype, self.v.dtype)[0]
        return np.dtype(self.q.dtype)

    def restore(self, out: Any, lse: Any = None):
        """Reshape canonical results back to the user's layout and dtype."""
        B, Hq, _, Lq, _, _, Dv = self.shape
        shape = self.batch_shape + ((Lq,) if self.squeeze_head else (Hq, Lq))
        out = out.reshape(shape + (Dv,))
        if lse is not None:
            lse = lse.reshape(shape)
        if not self.on_device:
            out = out.astype(self.out_dtype, copy=False)
            if lse is not None:
                lse = lse.astype(lse_dtype(self.out_dtype), copy=False)
        return out, lse


def _split_qkv_shapes(q_shape, k_shape, v_shape, *, q_name="q", k_name="k", v_name="v"):
    """Check the SDPA shape rules; return ``(batch_shape, squeeze_head)``."""
    nd = len(q_shape)
    if nd < 2:
        raise ValueError(
            f"{q_name} must have at least 2 dimensions (L, D); got shape {tuple(q_shape)}"
        )
    for name, shp in ((k_name, k_shape), (v_name, v_shape)):
        if len(shp) != nd:
            raise ValueError(
                f"{name} must have the same number of dimensions as {q_name} ({nd}); "
                f"got shape {tuple(shp)} against {q_name} {tuple(q_shape)}"
            )
    if nd == 2:
        return (), True
    batch = tuple(q_shape[:-3])
    for name, shp in ((k_name, k_shape), (v_name, v_shape)):
        if tuple(shp[:-3]) != batch:
            raise ValueError(
                f"{name}'s batch dimensions {tuple(shp[:-3])} must equal {q_name}'s {batch}"
            )
    return batch, False


def canonical_qkv(q, k, v, *, q_name="q", k_name="k", v_name="v", head_pairs=False):
    """Check shapes and dtypes of q, k, v; return canonical 4-D arrays and facts.

    Returns
    -------
    q4, k4, v4 : arrays ``(B, Hq, Lq, D)``, ``(B, Hk, Lk, D)``, ``(B, Hk, Lk, Dv)``
        Host inputs become C-contiguous arrays in the compute dtype (a copy
        only where needed); device inputs stay on the device.
    batch_shape, squeeze_head, out_dtype, on_device
    """
    for name, x in ((q_name, q), (k_name, k), (v_name, v)):
        refuse_unreadable_tensor(name, x)  # before is_device_array reads the CUDA interface
    on_dev = [is_device_array(x) for x in (q, k, v)]
    if any(on_dev) and not all(on_dev):
        names = [n for n, d in zip((q_name, k_name, v_name), on_dev) if not d]
        raise TypeError(
            f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} on the host while the "
            "other inputs are CUDA device arrays; pass all of q, k, v on the same side"
        )
    if all(on_dev):
        from .device import device_view

        # Numba device arrays (also the simulator's) are used as they are; other
        # objects exposing __cuda_array_interface__ are wrapped without a copy.
        arrs = [device_view(x, name=n) for n, x in zip((q_name, k_name, v_name), (q, k, v))]
    else:
        arrs = [host_float_array(n, x) for n, x in zip((q_name, k_name, v_name), (q, k, v))]
    qa, ka, va = arrs
    batch, squeeze, comp, out_dtype = check_qkv(qa, ka, va, q_name=q_name, k_name=k_name,
                                                v_name=v_name, head_pairs=head_pairs)

    flat_batch = math.prod(batch)  # Python ints: no overflow, and 1 for ()

    def to4(a):
        if squeeze:
            return a.reshape((1, 1) + tuple(a.shape))
        return a.reshape((flat_batch,) + tuple(a.shape[-3:]))

    if all(on_dev):
        out = [to4(a) for a in arrs]
    else:
        out = [_kernel_ready(to4(a), comp) for a in arrs]
    return out[0], out[1], out[2], batch, squeeze, out_dtype, all(on_dev)


def check_qkv(qa, ka, va, *, q_name="q", k_name="k", v_name="v", head_pairs=False):
    """The shape and dtype rules of q, k, v, on anything with ``.shape`` and ``.dtype``.

    Reads no data, so lazy arrays (Dask) are checked without computing them.

    Returns
    -------
    batch_shape : tuple
    squeeze_head : bool
        2-D ``(L, D)`` inputs.
    compute_dtype, out_dtype : numpy dtypes
    """
    for name, a in zip((q_name, k_name, v_name), (qa, ka, va)):
        float_dtype_of(name, a.dtype)
    batch, squeeze = _split_qkv_shapes(qa.shape, ka.shape, va.shape,
                                       q_name=q_name, k_name=k_name, v_name=v_name)
    D = qa.shape[-1]
    if ka.shape[-1] != D:
        raise ValueError(
            f"{k_name}'s last axis ({ka.shape[-1]}) must equal {q_name}'s head dimension "
            f"({D}); got {k_name} {tuple(ka.shape)}, {q_name} {tuple(qa.shape)}"
        )
    if va.shape[-2] != ka.shape[-2]:
        raise ValueError(
            f"{v_name} must have as many keys as {k_name}: {v_name} {tuple(va.shape)} has "
            f"{va.shape[-2]}, {k_name} {tuple(ka.shape)} has {ka.shape[-2]}"
        )
    if head_pairs and not squeeze:
        # before v's head count, which is only meaningful once k holds whole pairs
        _check_even_heads(q_name, qa.shape, "query pairs 2h, 2h+1")
        _check_even_heads(k_name, ka.shape, "key pairs 2g, 2g+1")
    # with head pairs, v has one head per key pair (2g, 2g+1)
    if not squeeze and va.shape[-3] * (2 if head_pairs else 1) != ka.shape[-3]:
        raise ValueError(
            f"{v_name} must have {'half as many' if head_pairs else 'as many'} heads as "
            f"{k_name}: got {va.shape[-3]} and {ka.shape[-3]}"
        )
    if D == 0:
        raise ValueError(f"{q_name}'s head dimension (last axis) must be > 0; got shape "
                         f"{tuple(qa.shape)}")
    if not squeeze:
        Hq, Hk = qa.shape[-3], ka.shape[-3]
        if head_pairs:
            Hq, Hk = Hq // 2, Hk // 2
        if Hk == 0 or Hq % Hk:
            raise ValueError(
                f"{q_name}'s heads ({qa.shape[-3]}) must be a multiple of {k_name}'s heads "
                f"({ka.shape[-3]}) for grouped-query attention"
            )
    comp, out_dtype = compute_dtypes(qa.dtype, ka.dtype, va.dtype)
    return batch, squeeze, comp, out_dtype


def _check_even_heads(name, shape, pairs):
    """Differential attention: ``name``'s head axis must hold whole pairs of heads."""
    if shape[-3] % 2:
        raise ValueError(f"{name} must have an even number of heads ({pairs}); got "
                         f"{shape[-3]} heads in shape {tuple(shape)}")


def _kernel_ready(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """C-contiguous, writeable (never written) array in ``dtype``; copies only if needed.

    Numba types read-only arrays apart from writeable ones, so a read-only
    input would compile every kernel a second time; a copy costs far less.
    """
    out = np.ascontiguousarray(a, dtype=dtype)
    return out if out.flags.writeable else out.copy()


def check_sinks(sinks, normalizer, batch_shape, squeeze, B, Hq, dtype):
    """``sinks`` (real, broadcastable to ``(*batch, Hq)``) as a ``(B, Hq)`` array in
    ``dtype``; only with ``normalizer="softmax"``."""
    arr = as_named_array("sinks", sinks)
    if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
        raise TypeError(f"sinks must be a real numeric array; got dtype {arr.dtype}")
    if normalizer != "softmax":
        raise ValueError("sinks add e^sink to softmax's denominator: pass "
                         f"normalizer='softmax' (softmax1 is a sink of 0); got {normalizer!r}")
    return per_query_head("sinks", arr, batch_shape, squeeze, B, Hq, dtype)


def per_query_head(name, arr, batch_shape, squeeze, B, Hq, dtype):
    """A real array broadcastable to ``(*batch, Hq)`` (``(*batch,)`` for 2-D inputs), all
    finite, as a ``(B, Hq)`` array in ``dtype``: one value per query head (``sinks``, a
    learned ``sigmoid_bias``)."""
    full = batch_shape + (() if squeeze else (Hq,))
    try:
        view = np.broadcast_to(arr, full)
    except ValueError:
        raise ValueError(f"{name} of shape {arr.shape} cannot be broadcast to {full} "
                         "(batch..., query heads)") from None
    if not np.isfinite(view).all():
        raise ValueError(f"{name} must be finite")
    return np.ascontiguousarray(view.astype(dtype).reshape(B, Hq))


def sigmoid_offset(sigmoid_bias, normalizer: str, Lk: int, arrays: bool = False):
    """The bias ``b`` of ``normalizer="sigmoid"`` (``w = sigmoid(s + b)``): ``sigmoid_bias``
    (a real number) or by default ``-log(Lk)`` (0 without keys); 0 for the other
    normalizers, which take no ``sigmoid_bias``.  With ``arrays`` an array of any other
    shape (one bias per query head, :func:`per_query_head` checks its shape) is
    returned as a real NumPy array, not yet broadcast; without, it is refused."""
    if normalizer != "sigmoid":
        if sigmoid_bias is not None:
            raise ValueError("sigmoid_bias belongs to normalizer='sigmoid'; got normalizer="
                             f"{normalizer!r}")
        return 0.0
    if sigmoid_bias is None:
        return -math.log(Lk) if Lk else 0.0
    refuse_unreadable_tensor("sigmoid_bias", sigmoid_bias)
    if is_device_array(sigmoid_bias):  # (a value per head: small, read on the host)
        raise TypeError("sigmoid_bias must be a number or a host array (NumPy), even with "
                        "device q, k, v; got a device array")
    arr = np.asarray(sigmoid_bias)
    if isinstance(sigmoid_bias, (bool, np.bool_)) or arr.dtype.kind not in "fiu":
        raise TypeError("sigmoid_bias must be a real number or a real array (one bias per "
                        f"query head); got {sigmoid_bias!r}")
    if arr.ndim:
        if not arrays:
            raise TypeError("sigmoid_bias must be a real number here (one bias for every "
                            f"head); got an array of shape {arr.shape}")
        return arr
    b = float(sigmoid_bias)
    if not math.isfinite(b):
        raise ValueError(f"sigmoid_bias must be finite; got {b}")
    return b


def check_mods(mask_mod, score_mod, on_device: bool, Lq: int, Lk: int, dtype):
    """``mask_mod=`` and ``score_mod=`` as :mod:`attnnb.mods` objects, compiled for this
    call's types on the cpu (a ``TypeError`` names a function that does not compile;
    device inputs, ``on_device``, are checked in their compute dtype alike)."""
    from .._mods.core import as_mask_mod, as_score_mod, parameters, resolved

    # what the functions read, taken once for the whole call (attnnb._mods.reads)
    mask, score = resolved(as_mask_mod(mask_mod)), resolved(as_score_mod(score_mod))
    for role, mod in (("mask_mod", mask), ("score_mod", score)):
        for n, param in enumerate(parameters(mod) if mod is not None else ()):
            if getattr(param, "requires_grad", False):
                raise TypeError(f"{role} {mod.name!r} reads a torch.Tensor that requires grad "
                                f"(its array {n}): the NumPy functions would drop its "
                                "gradient; call attnnb.torch's function of the same name, or "
                                "build the mod from a detached tensor")
    from .._mods.compile import check_types

    check_types(mask, score, Lq, Lk, dtype)
    return mask, score


def attention_problem(q, k, v, *, mask=None, bias=None, key_size=None, causal=False,
                      scale=None, normalizer="softmax", head_pairs=False, dropout_p=0.0,
                      seed=None, sinks=None, sigmoid_bias=None, mask_mod=None,
                      score_mod=None) -> Problem:
    """Validate the arguments of :func:`attnnb.attention` into a :class:`Problem`.

    ``normalizer="sigmoid"``'s bias (:func:`sigmoid_offset`) is added to the
    problem's ``bias`` here, so that the backends see ``sigmoid(s)`` of biased
    logits only.
    """
    check_normalizer(normalizer)
    dropout_p, seed = check_dropout(dropout_p, seed)
    causal = check_bool("causal", causal)
    q4, k4, v4, batch, squeeze, out_dtype, on_dev = canonical_qkv(q, k, v, head_pairs=head_pairs)
    B, Hq, Lq, D = q4.shape
    Lk = k4.shape[2]
    if head_pairs:
        Hq //= 2
    comp = np.dtype(q4.dtype) if not on_dev else compute_dtypes(q4.dtype, k4.dtype, v4.dtype)[0]
    scl = check_scale(scale, D)
    prob = Problem(q4, k4, v4, causal=causal, scale=scl, normalizer=normalizer,
                   batch_shape=batch, squeeze_head=squeeze, out_dtype=out_dtype,
                   on_device=on_dev, dropout_p=dropout_p, seed=seed)
    for name, x in (("mask", mask), ("bias", bias), ("key_size", key_size), ("sinks", sinks)):
        refuse_unreadable_tensor(name, x)
    if sinks is not None:
        if is_device_array(sinks):  # (a logit per head: small, checked on the host)
            raise TypeError("sinks must be a host array (NumPy), even with device q, k, v; "
                            "got a device array")
        # differential attention: a sink per component map, i.e. per query head of q
        prob.sinks = check_sinks(sinks, normalizer, batch, squeeze, B,
                                 2 * Hq if head_pairs else Hq, comp)
        if not head_pairs:  # (the differential maps stay softmax, each with its sink)
            prob.normalizer = "softmax1"
    if mask_mod is not None or score_mod is not None:
        prob.mask_mod, prob.score_mod = check_mods(mask_mod, score_mod, on_dev, Lq, Lk, comp)
    if on_dev:  # host or device mask / bias / key_size: see attnnb/_front/device.py
        from .device import device_extras

        prob.mask, prob.bias, prob.log_key_size = device_extras(
            mask, bias, key_size, batch, squeeze, B, Hq, Lq, Lk, comp,
            offset=sigmoid_offset(sigmoid_bias, normalizer, Lk))
        return prob
    for name, x in (("mask", mask), ("bias", bias), ("key_size", key_size)):
        if x is not None and is_device_array(x):
            raise TypeError(f"{name} is a CUDA device array but q, k, v are on the host; "
                            "pass all of them on the same side")
    prob.mask = broadcast_pairwise("mask", mask, batch, squeeze, B, Hq, Lq, Lk, np.bool_)
    prob.bias = broadcast_pairwise("bias", bias, batch, squeeze, B, Hq, Lq, Lk, comp)
    offset = sigmoid_offset(sigmoid_bias, normalizer, Lk, arrays=True)
    per_head = isinstance(offset, np.ndarray)
    if per_head:  # one per query head: (*batch, Hq, 1, 1) against the bias
        prob.sigmoid_bias = per_query_head("sigmoid_bias", offset, batch, squeeze, B, Hq, comp)
        offset = prob.sigmoid_bias.reshape(batch + (() if squeeze else (Hq,)) + (1, 1))
    if per_head or offset:  # added to the bias as given (its own broadcast shape), or alone
        shifted = np.asarray(offset, comp) if bias is None else np.asarray(bias) + offset
        prob.bias = broadcast_pairwise("bias", shifted, batch, squeeze, B, Hq, Lq, Lk, comp)
    prob.log_key_size = log_key_sizes(key_size, batch, squeeze, B, Lk, comp)
    return prob
