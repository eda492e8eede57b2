"""A broadcast bias's gradient without a ``(B, Hq, Lq, Lk)`` buffer: the backward in chunks.

The backward kernels of the ``cpu`` and ``cuda`` backends write the bias
gradient element by element into a buffer of the full ``(B, Hq, Lq, Lk)``
shape (each key-tile task or block owns its columns, so there are no write
races and no atomics), which is then summed to the bias's own shape.  For a
bias that broadcasts (a shared ``(Lq, Lk)`` bias, one per head, a
key-padding bias) that buffer is ``B * Hq`` (or ``B``, or ``Hq``) times the
bias: 17 GB for an ``(Lq, Lk)`` bias at ``B = 8, H = 32, L = 4096`` in
float32, where the contract allows only the gradients themselves
(docs/contract.md §5.4).

So when the buffer would exceed :data:`CHUNK_BYTES` and the bias is not
full size, the problem is cut into chunks of whole batch elements, or of
one batch element's key heads (with their GQA groups of query heads), each
small enough (:func:`bias_chunks`); each chunk's backward runs on its own
and its bias gradient is summed into the bias's shape, chunk by chunk in
index order (:func:`chunked_vjp`).  The dense backward and the
differential one (whose query and key heads hold two streams each:
``streams=2``) of both backends share this host code; the kernels only
see smaller problems.  The chunks are a function of the shape alone, so
the result is the same on every run and with any thread count; it differs
from the one-piece sum only in the order of the additions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Largest full-size bias gradient buffer formed at once (bytes), unless one chunk of
# ``min_heads`` key heads is larger (see bias_chunks).
CHUNK_BYTES = 256 * 2**20


def bias_chunks(shape, itemsize, dbias_shape, min_heads=1):
    """``[(b0, b1, g0, g1)]``: batch elements ``b0:b1`` and key heads ``g0:g1`` per chunk,
    or None when the backward runs in one piece.

    ``shape`` is the problem's ``(B, Hq, Hk, Lq, Lk, D, Dv)``; one piece when no bias
    gradient is asked for (``dbias_shape`` None), when the bias is full size, or when the
    full buffer fits in :data:`CHUNK_BYTES`.  A chunk holds at least ``min_heads`` key
    heads (counted over its batch elements) where the problem has them, so that it
    keeps the backward's one-sweep form (``ONE_SWEEP_TASKS`` in
    :mod:`attnnb.cpu.backward`): chunks too small for it cost more than the memory
    they save (docs/notes/performance.md, "Figures moved out of the code's comments").
    The buffer is then at most ``CHUNK_BYTES`` or ``min_heads`` key heads' rows.
    """
    B, Hq, Hk, Lq, Lk = shape[:5]
    if dbias_shape is None or tuple(dbias_shape) == (B, Hq, Lq, Lk) or not Hk:
        return None
    per_key_head = (Hq // Hk) * Lq * Lk * itemsize  # one key head's query heads
    if B * Hk * per_key_head <= CHUNK_BYTES:
        return None
    heads = max(min_heads, CHUNK_BYTES // per_key_head, 1)  # key heads per chunk
    if heads >= Hk:  # whole batch elements
        n = heads // Hk
        return [(b0, min(B, b0 + n), 0, Hk) for b0 in range(0, B, n)]
    return [(b, b + 1, g0, min(Hk, g0 + heads)) for b in range(B) for g0 in range(0, Hk, heads)]


def chunk_problem(problem, b0, b1, g0, g1, streams=1):
    """The part of a canonical problem with batch elements ``b0:b1`` and value heads
    ``g0:g1`` (with the query heads of their GQA groups): views, contiguous where the
    whole is, since a chunk is whole batch elements or heads of one batch element.

    ``streams`` query and key heads per head: 1, or 2 for the rectified differential
    problem, whose ``q`` and ``k`` hold each head's two streams side by side (``2 H``
    and ``2 Hk`` heads against ``Hk`` value heads and ``H`` heads of mask and bias).
    """
    group = problem.q.shape[1] // streams // problem.v.shape[1]
    h0, h1 = g0 * group, g1 * group

    def part(x, heads):
        """``x[b0:b1, heads]``; an axis of length 1 is read whole: it broadcasts (a
        device problem's compact mask, bias and key sizes)."""
        if x is None:
            return None
        rows = slice(None) if x.shape[0] == 1 else slice(b0, b1)
        if x.ndim == 2:  # log_key_size, (B or 1, Lk)
            return x[rows]
        return x[rows, slice(None) if x.shape[1] == 1 else slice(*heads)]

    b_origin, h_origin = problem.dropout_origin
    return dataclasses.replace(
        problem, dropout_origin=(b_origin + b0, h_origin + h0),
        q=part(problem.q, (streams * h0, streams * h1)),
        k=part(problem.k, (streams * g0, streams * g1)), v=part(problem.v, (g0, g1)),
        mask=part(problem.mask, (h0, h1)), bias=part(problem.bias, (h0, h1)),
        log_key_size=part(problem.log_key_size, None),
        # (B, query heads): a sink per query head, a learned sigmoid bias per head
        sinks=per_head(problem.sinks, b0, b1, streams * h0, streams * h1),
        sigmoid_bias=per_head(problem.sigmoid_bias, b0, b1, h0, h1))


def per_head(x, b0, b1, h0, h1):
    """``x[b0:b1, h0:h1]`` of a ``(B, heads)`` array, or None."""
    return None if x is None else x[b0:b1, h0:h1]


def sum_to_shape(g, shape):
    """``g`` summed over the axes where ``shape`` has 1 and ``g`` does not (both 4-D): the
    gradient of a bias of ``shape`` broadcast to ``g``'s shape; ``g`` itself when there
    are none."""
    axes = tuple(a for a, (n, m) in enumerate(zip(g.shape, shape)) if m == 1 and n != 1)
    return g.sum(axis=axes, keepdims=True).reshape(tuple(shape)) if axes else g


def add_bias_part(dbias, part, b0, b1, h0, h1):
    """``dbias`` (the bias's own 4-D shape) += the chunk's gradient ``part``, ``(b1 - b0,
    h1 - h0, Lq, Lk)`` or already summed along some axes the bias broadcasts along,
    summed along the others."""
    rows = slice(b0, b1) if dbias.shape[0] > 1 else slice(None)
    heads = slice(h0, h1) if dbias.shape[1] > 1 else slice(None)
    target = dbias[rows, heads]
    target += sum_to_shape(part, target.shape)


def chunked_vjp(run, problem, per_row, chunks, dbias_shape, streams=1, host=np.asarray):
    """Gradients of a problem, chunk by chunk (:func:`bias_chunks`), as NumPy arrays.

    ``run(sub_problem, *sub_rows)`` returns the backward's ``(dq, dk, dv, dbias,
    dlog_key_size, *more)`` of one chunk, its ``dbias`` full size or already summed
    along the axes the bias broadcasts, each of ``more`` with the leading ``(B, H)``
    axes of the heads (the differential backward's ``dlam``); ``per_row`` are arrays
    with those leading axes (``out``, ``lse``, ``dout``, ``dlse``, ``lam``; None
    passes through), sliced for each chunk; ``streams`` as :func:`chunk_problem`
    takes it; ``host`` turns one chunk's result into a NumPy array (a device
    backend's copy to the host).  Returns the same outputs for the whole problem,
    the bias gradient in ``dbias_shape``, ``dlog_key_size`` ``(B, Lk)``.
    """
    q, k, v = problem.q, problem.k, problem.v
    group = q.shape[1] // streams // v.shape[1]
    B, H, Lk = q.shape[0], q.shape[1] // streams, k.shape[2]
    whole = None
    for b0, b1, g0, g1 in chunks:
        h0, h1 = g0 * group, g1 * group
        rows = [None if x is None else x[b0:b1, h0:h1] for x in per_row]
        gq, gk, gv, gbias, glks, *gmore = (
            None if x is None else host(x)
            for x in run(chunk_problem(problem, b0, b1, g0, g1, streams), *rows))
        if whole is None:  # the dtypes of the backward's results
            dt = gq.dtype
            whole = dict(q=np.empty(q.shape, dt), k=np.empty(k.shape, dt),
                         v=np.empty(v.shape, dt), bias=np.zeros(tuple(dbias_shape), dt),
                         ks=None if glks is None else np.zeros((B, Lk), dt),
                         more=[np.empty((B, H) + x.shape[2:], x.dtype) for x in gmore])
        whole["q"][b0:b1, streams * h0:streams * h1] = gq
        whole["k"][b0:b1, streams * g0:streams * g1] = gk
        whole["v"][b0:b1, g0:g1] = gv
        add_bias_part(whole["bias"], gbias, b0, b1, h0, h1)
        if glks is not None:
            whole["ks"][b0:b1] += glks
        for out, x in zip(whole["more"], gmore):
            out[b0:b1, h0:h1] = x
    return (whole["q"], whole["k"], whole["v"], whole["bias"], whole["ks"], *whole["more"])
