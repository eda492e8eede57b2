"""The built-in mask and score functions of :mod:`attnnb.mods`, with their derivatives."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from .core import OFFSET, MaskMod, ScoreMod, as_numpy, capped_tanh, is_tensor, like

# built-in masks (positions: the query at key position i + offset[0])


def _causal(b, h, i, j, offset):
    return j <= i + offset[0]


def _window(b, h, i, j, offset, width):
    d = i + offset[0] - j
    return (d >= 0) & (d < width[0])


def _first_keys(b, h, i, j, n):
    return j < n[0]


def _prefix(b, h, i, j, offset, n):
    return (j < n[0]) | (j <= i + offset[0])


def _same_document(b, h, i, j, offset, q_ids, kv_ids):
    qb = b if q_ids.shape[0] > 1 else 0
    kb = b if kv_ids.shape[0] > 1 else 0
    return q_ids[qb, i] == kv_ids[kb, j]


#: Key ``j`` allowed for query ``i`` when ``j <= i + Lk - Lq`` (bottom-right aligned).
causal = MaskMod("fn", fn=_causal, arrays=(OFFSET,), name="causal")


def _int_scalar(name: str, value: Any, low: int) -> np.ndarray:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer; got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    return np.array([int(value)], np.int64)


def sliding_window(width: int) -> MaskMod:
    """The last ``width`` keys up to the query's own position (Mistral's window, with the
    causal limit): ``0 <= (i + Lk - Lq) - j < width``.  Combine with :func:`sinks` by
    ``|`` for StreamingLLM."""
    return MaskMod("fn", fn=_window, arrays=(OFFSET, _int_scalar("width", width, 1)),
                   name=f"sliding_window({width})")


def sinks(n: int) -> MaskMod:
    """The first ``n`` keys, for every query (StreamingLLM's sink tokens); with
    :func:`sliding_window` as ``sliding_window(w) | sinks(n)``."""
    return MaskMod("fn", fn=_first_keys, arrays=(_int_scalar("n", n, 0),), name=f"sinks({n})")


def prefix_lm(n: int) -> MaskMod:
    """A prefix LM: the first ``n`` keys for every query, causal after them."""
    return MaskMod("fn", fn=_prefix, arrays=(OFFSET, _int_scalar("n", n, 0)),
                   name=f"prefix_lm({n})")


def _ids(name: str, ids: Any) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iub" or arr.ndim not in (1, 2):
        raise TypeError(f"{name} must be a 1-D (L,) or 2-D (batch, L) integer array; got "
                        f"dtype {arr.dtype}, shape {arr.shape}")
    return np.ascontiguousarray(arr.reshape((1,) * (2 - arr.ndim) + arr.shape), np.int64)


def document(ids: Any, kv_ids: Any = None) -> MaskMod:
    """Attention within a document only (packed sequences).

    Parameters
    ----------
    ids : int array ``(Lq,)`` or ``(B, Lq)``
        The document of each query (of each flattened batch element).
    kv_ids : int array ``(Lk,)`` or ``(B, Lk)``, optional
        The document of each key; default ``ids`` (then ``Lq == Lk``).

    Combine with :data:`causal` for packed causal language modelling.
    """
    q_ids = _ids("ids", ids)
    k_ids = q_ids if kv_ids is None else _ids("kv_ids", kv_ids)
    return MaskMod("fn", fn=_same_document, arrays=(OFFSET, q_ids, k_ids), name="document")


def from_cu_seqlens(cu_seqlens: Any) -> MaskMod:
    """:func:`document` from FlashAttention's varlen ``cu_seqlens`` ``(n_docs + 1,)``:
    ``[0, l_1, l_1 + l_2, ...]``, the packed sequences' boundaries."""
    cu = np.asarray(cu_seqlens)
    if cu.dtype.kind not in "iu" or cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or np.any(
            np.diff(cu) < 0):
        raise ValueError("cu_seqlens must be a 1-D nondecreasing integer array starting at 0;"
                         f" got {cu!r}")
    ids = np.repeat(np.arange(cu.size - 1), np.diff(cu))
    mod = document(ids)
    return MaskMod(mod.kind, fn=mod.fn, arrays=mod.arrays, name="from_cu_seqlens")


# ---------------------------------------------------------------------------
# built-in score functions, with their derivatives


def _alibi(s, b, h, i, j, offset, slopes):
    return s + slopes[h] * like(s, j - i - offset[0])


def _alibi_ds(s, b, h, i, j, offset, slopes):
    return like(s, 1)


def _alibi_da(g, s, b, h, i, j, grads, offset, slopes):
    grads[1][h] += g * (j - i - offset[0])


def alibi(slopes: Any) -> ScoreMod:
    """ALiBi (Press et al. 2022): ``s + slopes[h] * (j - i')`` with ``i' = i + Lk - Lq``
    the query's position; ``slopes`` ``(Hq,)`` float, learnable (gradient by
    :func:`attnnb.vjp`)."""
    arr = as_numpy("slopes", slopes)
    if arr.ndim != 1 or arr.dtype.kind != "f":
        raise TypeError(f"slopes must be a 1-D float array (one per query head); got dtype "
                        f"{arr.dtype}, shape {arr.shape}")
    return _builtin(_alibi, (OFFSET, arr), _alibi_ds, _alibi_da, "alibi", (slopes,))


def _softcap(s, b, h, i, j, cap):
    return cap[0] * capped_tanh(s, cap[0])


def _softcap_ds(s, b, h, i, j, cap):
    t = capped_tanh(s, cap[0])
    return 1.0 - t * t


def _softcap_da(g, s, b, h, i, j, grads, cap):
    x = s / cap[0]
    t = capped_tanh(s, cap[0])
    grads[0][0] += g * (t - x * (1.0 - t * t))


def softcap(cap: Any) -> ScoreMod:
    """Logit soft-capping (Gemma 2, Grok): ``cap * tanh(s / cap)``; ``cap`` a positive
    number (a constant), or a one-element float array or tensor (which then gets a
    gradient).  Float32 logits take a float32 rational ``tanh`` (relative error 3.3e-7;
    a libm call per logit kept the loop from vectorising)."""
    given = cap if is_tensor(cap) or isinstance(cap, np.ndarray) else np.float64(cap)
    arr = as_numpy("cap", given)
    if arr.dtype.kind != "f" or arr.size != 1 or arr.ndim > 1:
        raise ValueError(f"cap must be one positive finite number; got {cap!r}")
    if arr.ndim == 0:  # a number, or a 0-d array or tensor: a (1,) view of it
        arr = arr.reshape(1)
    if not (arr[0] > 0 and np.isfinite(arr[0])):
        raise ValueError(f"cap must be one positive finite number; got {cap!r}")
    mod = _builtin(_softcap, (arr,), _softcap_ds, _softcap_da, f"softcap({float(arr[0])})",
                   (given,))
    if not (is_tensor(cap) or isinstance(cap, np.ndarray)):
        mod = dataclasses.replace(mod, constant=True)  # a number: no gradient to compute
    return mod


def _t5_bucket(relative, bidirectional, num_buckets, max_distance):
    """transformers' ``T5Attention._relative_position_bucket`` for one ``j - i``, its
    logarithm in float32 as there, so that the buckets are the same."""
    bucket = 0
    n = num_buckets
    if bidirectional:
        n = n // 2
        if relative > 0:
            bucket += n
        relative = abs(relative)
    else:
        relative = -min(relative, 0)
    max_exact = n // 2
    if relative < max_exact:
        return bucket + relative
    ratio = np.float32(relative) / np.float32(max_exact)
    scaled = np.float32(np.log(ratio)) / np.float32(math.log(max_distance / max_exact))
    large = max_exact + int(scaled * np.float32(n - max_exact))
    return bucket + min(large, n - 1)


def _relative(s, b, h, i, j, offset, table, config):
    bucket = _t5_bucket(j - i - offset[0], config[0] != 0, config[1], config[2])
    return s + table[bucket, h]


def _relative_ds(s, b, h, i, j, offset, table, config):
    return 1.0


def _relative_da(g, s, b, h, i, j, grads, offset, table, config):
    bucket = _t5_bucket(j - i - offset[0], config[0] != 0, config[1], config[2])
    grads[1][bucket, h] += g


def relative_bias(table: Any, num_buckets: int = 32, max_distance: int = 128,
                  bidirectional: bool = True) -> ScoreMod:
    """T5's relative position bias: ``s + table[bucket(j - i'), h]``.

    ``table`` ``(num_buckets, Hq)`` float, as T5's ``relative_attention_bias.weight``;
    the buckets as transformers' ``T5Attention._relative_position_bucket``
    (``bidirectional=True`` for encoders, False for decoders).  ``table`` gets a gradient.
    """
    arr = as_numpy("table", table)
    nb = int(_int_scalar("num_buckets", num_buckets, 2)[0])
    md = int(_int_scalar("max_distance", max_distance, 1)[0])
    if arr.ndim != 2 or arr.dtype.kind != "f" or arr.shape[0] != nb:
        raise TypeError(f"table must be a float array (num_buckets={nb}, heads); got dtype "
                        f"{arr.dtype}, shape {arr.shape}")
    config = np.array([int(bool(bidirectional)), nb, md], np.int64)
    return _builtin(_relative, (OFFSET, arr, config), _relative_ds, _relative_da,
                    "relative_bias", (table, config))


def _forgetting(s, b, h, i, j, offset, cum):
    cb = b if cum.shape[0] > 1 else 0
    return s + cum[cb, h, i + offset[0]] - cum[cb, h, j]


def _forgetting_ds(s, b, h, i, j, offset, cum):
    return 1.0


def _forgetting_da(g, s, b, h, i, j, grads, offset, cum):
    cb = b if cum.shape[0] > 1 else 0
    grads[1][cb, h, i + offset[0]] += g
    grads[1][cb, h, j] -= g


def forgetting(log_f: Any) -> ScoreMod:
    """The Forgetting Transformer's decay (Lin et al. 2025): ``s + c_i' - c_j`` with
    ``c = cumsum(log_f)`` along the keys, ``log_f`` ``(Hq, Lk)`` or ``(B, Hq, Lk)``
    the log forget gates (``<= 0``); ``log_f`` gets a gradient.  Use with ``causal``."""
    arr = as_numpy("log_f", log_f)
    if arr.ndim not in (2, 3) or arr.dtype.kind != "f":
        raise TypeError(f"log_f must be a float array (heads, L) or (batch, heads, L); got "
                        f"dtype {arr.dtype}, shape {arr.shape}")
    arr3 = arr.reshape((1,) * (3 - arr.ndim) + arr.shape)
    cum = np.cumsum(arr3, axis=-1)

    def to_log_f(grads):  # d c -> d log_f: c_t = sum_{u <= t} log_f_u
        dcum = grads[0]
        if dcum is None:
            return (None,)
        dlog = np.flip(np.cumsum(np.flip(dcum, -1), -1), -1)
        return (dlog.reshape(arr.shape),)

    mod = _builtin(_forgetting, (OFFSET, cum), _forgetting_ds, _forgetting_da, "forgetting",
                   (log_f,))
    object.__setattr__(mod, "to_params", to_log_f)
    return mod


def _builtin(fn, arrays, grad_s, grad_arrays, name, params) -> ScoreMod:
    """A built-in score mod: ``params`` are its arrays as the caller gave them."""
    return ScoreMod("fn", fn=fn, arrays=arrays, grad_s=grad_s, grad_arrays=grad_arrays,
                    params=params, name=name)
