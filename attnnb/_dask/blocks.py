"""What the tasks of a Dask attention graph run: the public functions, on chunks.

Every part is a call of :func:`attnnb.attention`, :func:`~attnnb.sparse_attention`,
:func:`~attnnb.topk_attention` or :func:`~attnnb.diff_attention` on one
block's NumPy (or CuPy) chunks, so each task runs the per-chunk backend
through the dispatcher.  Chunks arrive in the compute dtype; parts are
returned in it and cast to the output dtype only by the finish tasks.

Arguments common to the part functions (keywords, fixed when the graph is built):

* ``limit``: None (the whole block is allowed) or a
  :class:`~attnnb._dask.visible.Diagonal` (the causal limit crosses it);
* ``heads``: None, or the key units ``(a, b)`` of the key chunk that the
  query chunk reads (a query-head chunk smaller than the key-head chunk);
* ``scale``, ``backend``: as the user gave them (``backend`` resolved to a
  name or ``"auto"`` when the graph was built);
* ``mask_mod``, ``score_mod``: the call's functions placed at the block
  (:func:`attnnb._mods.compile.placed`: the block's indices shifted to the
  call's), or None.
"""

from __future__ import annotations

import numpy as np

from .._front.eager import attention, diff_attention, sparse_attention, topk_attention
from .._front.function_args import lambda_rows
from ..combine import add_parts, combine, finish_softmax1, merge_parts
from .visible import sub_pattern


def namespace(x):
    """The array module of ``x``: CuPy for CuPy arrays, else NumPy."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def native(x, like):
    """``x`` as an array of ``like``'s kind (device results wrapped as CuPy, without a copy)."""
    xp = namespace(like)
    return x if xp is np or isinstance(x, xp.ndarray) else xp.asarray(x)


def key_heads(k, v, heads, pairs=False):
    """The key heads a query chunk reads: all of the chunk, or key units ``heads``
    (``v`` may be None)."""
    if heads is None:
        return k, v
    a, b = heads
    unit = 2 if pairs else 1
    return k[..., a * unit:b * unit, :, :], None if v is None else v[..., a:b, :, :]


def restrict(mask, limit, nq, nk):
    """``(mask, causal)`` for the block's call: the user's mask and the causal limit."""
    if limit is None:
        return mask, False
    if limit.native and mask is None:
        return None, True
    if limit.native:
        return mask, True
    diagonal = limit.mask(nq, nk)
    if mask is None:
        return diagonal, False
    return namespace(mask).logical_and(mask, namespace(mask).asarray(diagonal)), False


def attention_part(q, k, v, mask, bias, key_size, *, limit, heads, scale, normalizer, backend,
                   sigmoid_bias=None, mask_mod=None, score_mod=None):
    """``(out, lse)`` of dense attention over one block (``sigmoid_bias``: the whole call's)."""
    k, v = key_heads(k, v, heads)
    mask, causal = restrict(mask, limit, q.shape[-2], k.shape[-2])
    out, lse = attention(q, k, v, mask=mask, bias=bias, key_size=key_size, causal=causal,
                         scale=scale, normalizer=normalizer, return_lse=True, backend=backend,
                         sigmoid_bias=sigmoid_bias, mask_mod=mask_mod, score_mod=score_mod)
    return native(out, q), native(lse, q)


def sparse_part(q, k, v, key_size, pattern, *, where, heads, scale, normalizer, backend,
                sigmoid_bias=None, mask_mod=None, score_mod=None):
    """``(out, lse)`` over one block of a pattern; ``where`` None: every pair allowed,
    else ``(query heads, query rows, key columns)`` of the block in the pattern."""
    k, v = key_heads(k, v, heads)
    kw = dict(key_size=key_size, scale=scale, normalizer=normalizer, return_lse=True,
              backend=backend, sigmoid_bias=sigmoid_bias, mask_mod=mask_mod,
              score_mod=score_mod)
    if where is None:
        out, lse = attention(q, k, v, **kw)
    else:
        out, lse = sparse_attention(q, k, v, sub_pattern(pattern, *where), **kw)
    return native(out, q), native(lse, q)


def topk_solo(q, k, v, mask, key_size, *, top_k, limit, heads, scale, normalizer, backend,
              sigmoid_bias=None, mask_mod=None, score_mod=None):
    """Top-k attention of a query block that sees one key block: the call itself
    (``sigmoid_bias``: the whole call's)."""
    k, v = key_heads(k, v, heads)
    mask, causal = restrict(mask, limit, q.shape[-2], k.shape[-2])
    out, lse = topk_attention(q, k, v, top_k, mask=mask, causal=causal, key_size=key_size,
                              scale=scale, normalizer=normalizer, return_lse=True,
                              sigmoid_bias=sigmoid_bias, backend=backend, mask_mod=mask_mod,
                              score_mod=score_mod)
    return native(out, q), native(lse, q)


def streams_part(q, k, v, mask, bias, key_size, *, limit, heads, scale, backend, lse_only,
                 mask_mod=None, score_mod=None):
    """Differential attention's two softmax streams over one block.

    ``(o1, lse1, o2, lse2)``; with ``lse_only`` just ``(lse1, lse2)`` (the
    values are not read).  Stream ``c`` is query heads ``c::2`` with key heads
    ``c::2`` and the pair's value head, as :func:`attnnb.diff_attention`.
    """
    k, v = key_heads(k, v, heads, pairs=True)
    mask, causal = restrict(mask, limit, q.shape[-2], k.shape[-2])
    vals = v[..., :0] if lse_only else v
    res = []
    for c in (0, 1):
        out, lse = attention(q[..., c::2, :, :], k[..., c::2, :, :], vals, mask=mask, bias=bias,
                             key_size=key_size, causal=causal, scale=scale, return_lse=True,
                             backend=backend, mask_mod=mask_mod, score_mod=score_mod)
        res += [native(lse, q)] if lse_only else [native(out, q), native(lse, q)]
    return tuple(res)


def diff_solo(q, k, v, mask, bias, key_size, lam, *, limit, heads, scale, mode, backend,
              sinks=None, mask_mod=None, score_mod=None):
    """Differential attention of a query block that sees one key block: the call itself
    (``sinks``: the block's pair sinks ``(*batch, H, 2)``, or None)."""
    k, v = key_heads(k, v, heads, pairs=True)
    mask, causal = restrict(mask, limit, q.shape[-2], k.shape[-2])
    if sinks is not None:  # query head 2h + c holds map c's sink
        sinks = sinks.reshape(sinks.shape[:-2] + (-1,))
    out = diff_attention(q, k, v, lam, mask=mask, bias=bias, key_size=key_size, causal=causal,
                         scale=scale, mode=mode, sinks=sinks, backend=backend,
                         mask_mod=mask_mod, score_mod=score_mod)
    return native(out, q)


def rectified_part(q, k, v, mask, bias, key_size, lam, local, total, *, limit, heads, scale,
                   backend, mask_mod=None, score_mod=None):
    """One key block's share of rectified differential attention.

    With ``A_c`` the block's own softmax maps (normalised over the block),
    ``local`` their LSEs and ``total`` the LSEs over every key block, the
    global maps are ``e^(local_c - total_c) A_c``, so the block adds
    ``sum_j max(0, a1 A1[j] - lam a2 A2[j]) v[j]`` (``a_c = e^(local_c -
    total_c)``) ``= a1 * rectified(lam' = lam a2 / a1)``: one
    :func:`attnnb.diff_attention` call with per-row ``lam'``.  Where ``lam'``
    would not be finite in the compute dtype (stream 1 absent from the
    block, or negligible against stream 2) the first term is dropped, and
    the block adds ``max(0, -lam) a2 (A2 @ v)``.
    """
    k, v = key_heads(k, v, heads, pairs=True)
    mask, causal = restrict(mask, limit, q.shape[-2], k.shape[-2])
    xp = namespace(q)
    (l1, l2), (t1, t2) = local, total
    lam = xp.asarray(lam_rows(lam, tuple(l1.shape), np.float64))
    with np.errstate(invalid="ignore", over="ignore"):
        l1, l2, t1, t2 = (x.astype(np.float64) for x in (l1, l2, t1, t2))
        nan = xp.isnan(l1) | xp.isnan(l2) | xp.isnan(t1) | xp.isnan(t2)
        d1 = l1 - xp.where(xp.isfinite(t1), t1, 0)  # log a1, log a2
        d2 = l2 - xp.where(xp.isfinite(t2), t2, 0)
        a1, a2 = xp.exp(d1), xp.exp(d2)
        lam_p = lam * xp.exp(d2 - d1)
        ok = xp.isfinite(l1) & (xp.abs(lam_p) < np.finfo(q.dtype).max / 4) & ~nan
    lam_p = xp.where(ok, lam_p, 0)
    mods = dict(mask_mod=mask_mod, score_mod=score_mod)
    out = diff_attention(q, k, v, xp.asnumpy(lam_p) if xp is not np else lam_p, mask=mask,
                         bias=bias, key_size=key_size, causal=causal, scale=scale,
                         mode="rectified", backend=backend, **mods)
    out = native(out, q).astype(np.float64)
    with np.errstate(invalid="ignore"):  # non-finite values of rows that are not ok
        out = xp.where(ok[..., None], a1[..., None] * out, 0)
    rest = ~ok & ~nan & (lam < 0) & xp.isfinite(l2)
    if bool(rest.any()):
        o2, _ = attention(q[..., 1::2, :, :], k[..., 1::2, :, :], v, mask=mask, bias=bias,
                          key_size=key_size, causal=causal, scale=scale, return_lse=True,
                          backend=backend, **mods)
        out = xp.where(rest[..., None], (-lam * a2)[..., None] * native(o2, q), out)
    return xp.where(nan[..., None], np.nan, out).astype(q.dtype)


def lam_rows(lam, rows, dtype):
    """``lam`` (a chunk broadcastable to the block's rows) as an array of shape ``rows``."""
    B = int(np.prod(rows[:-2], dtype=np.int64))
    return lambda_rows(lam, rows[:-2], B, rows[-2], rows[-1], dtype).reshape(rows)


def with_sinks(total, sink):
    """Both maps' LSEs over every key block, ``(lse1, lse2)``, with each map's learned sink
    added to its denominator: ``log(e^lse_c + e^sink_c)`` (``sink`` ``(*batch, H, 2)``)."""
    xp = namespace(total[0])
    return tuple(xp.logaddexp(t, xp.asarray(sink[..., c])[..., None].astype(t.dtype))
                 for c, t in enumerate(total))


# -- merges (lists of parts in key-block order) --------------------------------------------

def merge_attention(parts):
    """``(out, lse)`` parts merged through their LSEs."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return merge_parts([p[0] for p in parts], [p[1] for p in parts])


def merge_softpick(parts):
    """``(out, lse)`` softpick parts merged (:func:`attnnb.combine`: finished again, so
    that merges of merges work alike)."""
    return combine([p[0] for p in parts], [p[1] for p in parts], normalizer="softpick")


def merge_sums(parts):
    """``(out, lse)`` parts that add up (``sigmoid``)."""
    return add_parts([p[0] for p in parts], [p[1] for p in parts])


def merge_streams(parts):
    """Differential attention's ``(o1, lse1, o2, lse2)`` parts merged stream by stream."""
    first = merge_attention([p[0:2] for p in parts])
    second = merge_attention([p[2:4] for p in parts])
    return first + second


def merge_lses(parts):
    """``(lse1, lse2)`` parts merged: ``logaddexp`` per stream."""
    out = []
    for c in range(len(parts[0])):
        lse = parts[0][c]
        for p in parts[1:]:
            with np.errstate(invalid="ignore"):  # NaN rows stay NaN
                lse = namespace(lse).logaddexp(lse, p[c])
        out.append(lse)
    return tuple(out)


def merge_sum(parts):
    """Parts that simply add up (rectified differential attention)."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


# -- finishes ------------------------------------------------------------------------------

def finish_attention(merged, sink=None, *, softmax1, out_dtype, lse_dtype):
    """``(out, lse)`` in the output dtypes; ``softmax1`` finishes softmax parts, with the
    block's learned ``sink`` logits (``(*batch, H)``, NumPy) when given, else a sink of 0."""
    out, lse = merged
    if softmax1:
        out = finish_softmax1(out, lse, 0.0 if sink is None
                              else namespace(lse).asarray(sink)[..., None])
    return out.astype(out_dtype), lse.astype(lse_dtype)


def finish_difference(merged, lam, sink=None, *, out_dtype):
    """``o1 - lam * o2`` from the merged streams, in the output dtype; ``sink``: the learned
    sinks of the block's pairs, ``(*batch, H, 2)`` (NumPy), one per map."""
    o1, l1, o2, l2 = merged
    if sink is not None:  # each map finished with its own sink (its query head's)
        o1, o2 = (finish_softmax1(o, lse, namespace(lse).asarray(sink[..., c])[..., None])
                  for c, (o, lse) in enumerate(((o1, l1), (o2, l2))))
    lam = lam_rows(lam, tuple(l1.shape), o1.dtype)
    with np.errstate(invalid="ignore"):  # inf - inf: the propagation one call gives too
        return (o1 - namespace(o1).asarray(lam)[..., None] * o2).astype(out_dtype)


def finish_cast(x, *, dtype):
    return x.astype(dtype)


def empty(*, shape, dtype, lse_dtype, like):
    """``(zeros, -inf)`` of a query block that sees no key: ``shape`` ``S + (Dv,)``."""
    xp = namespace(like)
    return xp.zeros(shape, dtype), xp.full(shape[:-1], -np.inf, lse_dtype)
