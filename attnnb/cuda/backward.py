"""Gradients on the GPU: the cuda backend's backward operations, on the host side.

FlashAttention-2's backward on the register-tiled core, in four modules:

* :mod:`attnnb.cuda._backward_tiling`: the kernels' tile sizes and shared
  memory layouts;
* :mod:`attnnb.cuda._backward_pair`: the device functions, the math of one
  (query tile, key tile) pair;
* :mod:`attnnb.cuda._backward_kernels`: the kernels, their caches and the
  PTX gate's catalogue of them;
* this module: the operations the dispatcher registers
  (:func:`attention_vjp`, :func:`sparse_attention_vjp`,
  :func:`topk_attention_vjp`, :func:`diff_attention_vjp`; the interface is
  :mod:`attnnb.vjp`'s) and what they run on the host: the rows' terms, the
  tile lists, the launches, the bias gradient's chunks and sums.

Nothing ``(Lq, Lk)`` is stored but a bias gradient, as large as the bias it
belongs to, and the rectified and Heaviside modes' clip bits (one a (query,
key) pair).
One stream (dense, sparse, top-k): a kernel forms the rows' terms (``lse``,
the row factor, ``delta``), then the query-tile kernel and the key-tile
kernel sweep the tile lists (:func:`_sweep`; a dense problem's lists are
every key tile up to the causal limit).  Top-k keeps the forward's
selection: the top-k forward kernel is run again and writes it, one bit a
(query, key) pair (:func:`attnnb.cuda.topk.topk_selection`), which the
kernels read as the rectified mode's clip bits.  Differential attention takes
both streams' LSEs from its forward kernel, run again.  By default no mode
runs the two-stream kernels: each gradient is two one-stream backwards
("pair streams", stream 1's with row ratio ``-lam``), each query-tile kernel
first sweeping for its stream's ``delta`` (``d1``, ``e``), stream 1's
key-tile kernel adding to stream 0's ``dV`` and bias gradient; the rectified
mode's streams read the clip bits the differential forward's clip build
writes.  The Heaviside mode runs stream 0 alone (``"gated0"``), the same bits
its gate: they add ``-lam`` to the weights that reach ``dV``, not to ``ds1``;
the clip build's output is then ``H V``, so that ``dlam = -dout . (H V)``, and
the second stream has no gradient.  These builds meet the
register-tiling gate at ``d = 64, Dv = 128``; the two-stream ones do not
(``KNOWN_GATE_FAILURES``).  They stay as the alternative of every mode,
``diff_attention_vjp(..., two_streams=True)``, tested and timed against the
pair streams (gpu/run.py), and take the rectified and Heaviside modes past
``2**32`` clip words.

Invariants: the query-tile kernel runs before the key-tile kernel (with
two streams it writes ``d1`` and ``e`` for it) and a pair's stream 0
before its stream 1 (which adds to what stream 0 wrote); no kernel uses
atomics and every sum runs in a fixed order, so the gradients are the same
bit for bit from run to run.  Host problems get host gradients in the
compute dtype, device problems device gradients.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .._core.bias_chunks import bias_chunks, chunked_vjp
from .._core.codes import DIFF_MODE_CODES, DIFFERENCE, HEAVISIDE, NORMALIZER_CODES, RECTIFIED
from .._core.layout import BlockLayout
from .._front.checks import is_device_array
from .._front.device import device_view
from .._mods.compile import sum_param_grads
from ._arrays import device_problem
from ._backward_kernels import (
    build_negated_dot,
    build_negated_row,
    build_pair_rows,
    build_row_terms,
    build_sum_to,
    dkdv_kernel,
    dq_kernel,
    element_grid,
    helper_kernel,
)
from ._backward_tiling import backward_tiling
from ._dropout import kernel_dropout
from ._micro import own_build
from ._mods import device_mods, gradient_buffers, has_mods, parameter_gradients
from ._tiles import key_tiles_seen
from .topk import topk_build


def sum_to(x, shape, dtype):
    """``x`` (4-D device array) summed to ``shape`` (axes of length 1) on the device."""
    if tuple(x.shape) == tuple(shape):
        return x
    y = cuda.device_array(tuple(shape), dtype)
    if y.size:
        grid, threads = element_grid(y.size)
        helper_kernel("sum_to", build_sum_to, dtype)[grid, threads](x, y)
    return y


def _tile_lists(problem, tiling, pattern):
    """``(p_heads, indptr, indices, csr, by_query_tile, by_key_tile)`` on the device: the
    tile lists by query tile (``tile_ptr, tile_idx, tile_full``) and by key tile, and the
    pattern's CSR (placeholders for dense problems, whose lists are every key tile up to
    the causal limit)."""
    _, _, _, Lq, Lk, _, _ = problem.shape
    bq, bk = tiling.bq, tiling.bk
    if pattern is None:
        n_qt, n_kt = -(-Lq // bq), -(-Lk // bk)
        last = np.array([key_tiles_seen(t * bq, bq, Lq, Lk, bk, problem.causal)[1]
                         for t in range(n_qt)], np.int64)
        ptr = np.zeros(n_qt + 1, np.int64)
        np.cumsum(last, out=ptr[1:])
        idx = np.concatenate([np.arange(n, dtype=np.int32) for n in last] or
                             [np.zeros(0, np.int32)])
        layout = BlockLayout(bq, bk, n_qt, n_kt, ptr, idx, np.ones(idx.size, np.bool_))
        p_heads, indptr, indices = 1, np.zeros(1, np.int64), np.zeros(1, np.int32)
    else:
        layout = pattern.blocks(bq, bk)
        p_heads, indptr, indices = pattern.n_heads, pattern.indptr, pattern.indices
    by_query_tile = (layout.tile_ptr, layout.tile_idx, layout.tile_full)
    dev = [cuda.to_device(np.ascontiguousarray(x)) for x in
           (indptr, indices, *by_query_tile, *layout.by_key_tile())]
    return p_heads, dev[0], dev[1], pattern is not None, tuple(dev[2:5]), tuple(dev[5:])


def _on_device(x, dtype=None):
    if x is None:
        return None
    if is_device_array(x):
        return device_view(x, need_reshape=False)
    return cuda.to_device(np.ascontiguousarray(x, dtype))


def _finish(arrays, *results):
    """Gradients as device arrays (device problems) or host arrays; None stays None."""
    if arrays.on_device:
        return results
    return tuple(None if r is None else r.copy_to_host() for r in results)


def _sweep(problem, arrays, streams, row_terms, dout, pattern=None, selection=None,
           diff_mode=DIFFERENCE, need_dbias=False, stream=None, grads=None, clip=None,
           mod_grads=()):
    """Launch both kernels; returns device ``(dq, dk, dv, dbias_full, dlogks_per_head)``.

    ``mod_grads``: the score function's gradient buffers, a slot per key-tile block
    (:func:`key_tile_blocks`), added to.

    ``stream`` (0 or 1): one stream of a differential pair, through the one-stream
    kernels (``streams = 1``), into ``grads`` (what stream 0's call returned) for
    stream 1; with ``clip`` (the forward's clip bits) a rectified pair's stream, or the
    Heaviside mode's gated stream 0 (``diff_mode``, the mode code, which the two-stream
    kernels read too).
    """
    B, Hx, Hkx, Lq, Lk, D, Dv = problem.shape
    paired = streams == 2 or stream is not None
    H, Hk = (Hx // 2, Hkx // 2) if paired else (Hx, Hkx)
    dt = arrays.dtype
    if grads is None:
        dq = cuda.device_array(problem.q.shape, dt)
        dk = cuda.device_array(problem.k.shape, dt)
        dv = cuda.device_array(problem.v.shape, dt)
        # zeros: the tiles a causal limit or a pattern skips are never visited
        dbias = cuda.to_device(np.zeros((B, H, Lq, Lk) if need_dbias else (1, 1, 1, 1), dt))
        dlogks = cuda.to_device(np.zeros((B, Hk, Lk) if arrays.has_ks else (1, 1, 1), dt))
    else:
        dq, dk, dv, dbias, dlogks = grads
    own = own_build(problem.normalizer)
    t_dq = backward_tiling(arrays.dtype, D, Dv, streams, "dq")
    t_kv = backward_tiling(arrays.dtype, D, Dv, streams, "dkdv", own, selection is not None)
    p_heads, indptr, indices, csr, query_tile_lists, _ = _tile_lists(problem, t_dq, pattern)
    key_tile_lists = _tile_lists(problem, t_kv, pattern)[5]
    if selection is not None:  # top-k: a normalizer that weighs the kept keys its own way
        own = topk_build(problem.normalizer)  # (its key-tile tiles stay own_build's)
    bits = clip if selection is None else selection  # (top-k's selection: the clip's layout)
    clip_d = cuda.device_array(1, np.uint32) if bits is None else bits.reshape(bits.size)
    common = (arrays.q, arrays.k, arrays.v, dout, dt.type(problem.scale), arrays.bias,
              arrays.has_bias, arrays.mask, arrays.has_mask, arrays.logks, arrays.has_ks,
              problem.causal, NORMALIZER_CODES[problem.normalizer], row_terms,
              selection is not None, diff_mode, clip_d, p_heads, indptr, indices, csr,
              *kernel_dropout(problem, dt))
    n_qt, n_kt = -(-Lq // t_dq.bq), -(-Lk // t_kv.bk)
    # the query-tile kernel first: with two streams it forms d1 and e for the other
    variant = ("sparse" if pattern is not None else "topk" if selection is not None else
               "dense" if stream is None else
               f"stream{stream}" if clip is None else
               f"gated{stream}" if diff_mode == HEAVISIDE else f"clipped{stream}")
    dropping = bool(problem.dropout_p)
    mods = device_mods(problem)
    dq_kernel(dt, t_dq, variant, dropping, mods, own)[(B * H, n_qt), t_dq.threads](
        *common, *query_tile_lists, dq, arrays.mods)
    dkdv_kernel(dt, t_kv, variant, dropping, mods, own)[(B * Hk, n_kt), t_kv.threads](
        *common, *key_tile_lists, need_dbias, dk, dv, dbias, dlogks, arrays.mods, mod_grads)
    return dq, dk, dv, dbias, dlogks


def _zeros(problem, dtype, dbias_shape, extra=()):
    """The gradients of a problem without work (an empty axis)."""
    B, _, _, _, Lk, _, _ = problem.shape
    z = [np.zeros(x.shape, dtype) for x in (problem.q, problem.k, problem.v)]
    z.append(None if dbias_shape is None else np.zeros(dbias_shape, dtype))
    z.append(None if problem.log_key_size is None else np.zeros((B, Lk), dtype))
    z += [np.zeros(s, dtype) for s in extra]
    if problem.on_device:
        return tuple(None if x is None else cuda.to_device(x) for x in z)
    return tuple(z)


def _chunk_bias_shape(part, dbias_shape, streams):
    """A chunk's bias gradient shape: ``dbias_shape``'s broadcast axes, the chunk's
    batch elements and heads where the bias has them."""
    B, Hx, _, Lq, Lk = part.shape[:5]
    return (1 if dbias_shape[0] == 1 else B, 1 if dbias_shape[1] == 1 else Hx // streams,
            Lq, Lk)


def _host(x):
    return x.copy_to_host() if is_device_array(x) else np.asarray(x)


def _in_chunks(problem, per_row, dbias_shape, run, streams=1):
    """The backward of a broadcast bias whose full-size gradient buffer would pass
    :data:`~attnnb._core.bias_chunks.CHUNK_BYTES`, chunk by chunk (:mod:`attnnb._core.bias_chunks`),
    or None when it fits.  ``run(part, *rows, part_dbias_shape)`` is the one-piece
    backward of a chunk.  The chunks' gradients are gathered on the host (they are
    the gradients' own size), then copied to the device for a device problem."""
    B, Hx, Hkx, Lq, Lk = problem.shape[:5]
    itemsize = np.dtype(problem.compute_dtype).itemsize
    chunks = bias_chunks((B, Hx // streams, problem.v.shape[1], Lq, Lk), itemsize,
                         dbias_shape)
    if chunks is None:
        return None
    per_row = [None if x is None else _host(x) for x in per_row]

    def one_chunk(part, *rows):
        return run(part, *rows, _chunk_bias_shape(part, dbias_shape, streams))

    grads = chunked_vjp(one_chunk, problem, per_row, chunks, dbias_shape, streams=streams,
                        host=_host)
    if problem.on_device:
        return tuple(None if g is None else cuda.to_device(g) for g in grads)
    return grads


def _single(problem, out, lse, dout, dlse, dbias_shape, pattern=None, top_k=None):
    """Gradients of one stream (dense, sparse or top-k); the interface's 5-tuple, and
    the score function's parameters' gradients sixth when there is one."""
    if dbias_shape is not None:  # (sparse and top-k take no bias)
        mod_parts = []

        def piece(*args):
            grads = _single_piece(*args)
            mod_parts.extend(grads[5:])
            return grads[:5]

        chunked = _in_chunks(problem, (out, lse, dout, dlse), dbias_shape, piece)
        if chunked is not None:
            return chunked + ((sum_param_grads(mod_parts),) if mod_parts else ())
    return _single_piece(problem, out, lse, dout, dlse, dbias_shape, pattern, top_k)


def key_tile_blocks(problem, dtype, selected=False) -> int:
    """The blocks of the key-tile kernel of a one-stream problem (``B * Hk`` times its
    key tiles; ``selected``: top-k's)."""
    B, _, Hk, _, Lk, D, Dv = problem.shape
    tiling = backward_tiling(dtype, D, Dv, 1, "dkdv", own_build(problem.normalizer), selected)
    return B * Hk * -(-Lk // tiling.bk)


def _single_piece(problem, out, lse, dout, dlse, dbias_shape, pattern=None, top_k=None):
    """:func:`_single` with the bias gradient formed full size, in one piece."""
    B, Hq, _, Lq, Lk, D, Dv = problem.shape
    arrays = device_problem(problem)
    dt = arrays.dtype
    mod_grads = () if problem.score_mod is None else gradient_buffers(
        problem, key_tile_blocks(problem, dt, top_k is not None))
    tail = () if problem.score_mod is None else (parameter_gradients(problem, ()),)
    if not (B * Hq and Lq and Lk):
        return _zeros(problem, dt, dbias_shape) + tail
    selection = None
    if top_k is not None:  # the forward's own kernel makes the selection again
        from .topk import topk_selection

        selection = topk_selection(problem, top_k, arrays, want_bits=True)[2]
    dout = _on_device(dout)
    row_terms = cuda.device_array((B, Hq, 3, Lq), dt)
    grid, threads = element_grid(B * Hq * Lq)
    dlse_d = _on_device(dlse)
    helper_kernel("row_terms", build_row_terms, dt)[grid, threads](
        _on_device(out), dout, _on_device(lse), dlse_d if dlse is not None else row_terms,
        dlse is not None, NORMALIZER_CODES[problem.normalizer], arrays.sinks, row_terms)
    dq, dk, dv, dbias, dlogks = _sweep(problem, arrays, 1, row_terms, dout, pattern=pattern,
                                       selection=selection, need_dbias=dbias_shape is not None,
                                       mod_grads=mod_grads)
    if mod_grads:
        tail = (parameter_gradients(problem, mod_grads),)
    dbias = None if dbias_shape is None else sum_to(dbias, dbias_shape, dt)
    dlks = None
    if arrays.has_ks:
        dlks = sum_to(dlogks.reshape((B, dlogks.shape[1], 1, Lk)), (B, 1, 1, Lk),
                      dt).reshape((B, Lk))
    return _finish(arrays, dq, dk, dv, dbias, dlks) + tail


def attention_vjp(problem, out, lse, dout, dlse=None, dbias_shape=None):
    """Gradients of dense attention (see :mod:`attnnb.vjp` for the interface).

    Host problems give NumPy gradients in the compute dtype; device problems
    (and device ``out``, ``lse``, ``dout``) device gradients.  The bias
    gradient is formed full size, ``(B, Hq, Lq, Lk)``, each element by the
    one block that owns its key tile, then summed to ``dbias_shape`` on the
    device in index order.  For a broadcast bias whose full-size buffer would
    pass :data:`~attnnb._core.bias_chunks.CHUNK_BYTES`, chunk by chunk of batch
    elements or key heads instead (:mod:`attnnb._core.bias_chunks`), the chunks'
    gradients gathered on the host and, for a device problem, copied back.  A
    score function's arrays' gradients come sixth (host arrays): each key-tile
    block adds its pairs' into a slot of its own, one thread in order, and the
    slots are summed in order (:func:`attnnb.cuda._mods.gradient_buffers`).
    """
    return _single(problem, out, lse, dout, dlse, dbias_shape)


def sparse_attention_vjp(problem, pattern, out, lse, dout, dlse=None):
    """Gradients of sparse attention: the pattern's tiles only, both sweeps."""
    return _single(problem, out, lse, dout, dlse, None, pattern=pattern)


def topk_attention_vjp(problem, top_k, out, lse, dout, dlse=None):
    """Gradients of top-k attention, the forward's selection held fixed (recomputed by the
    top-k forward kernel itself, so it is the forward's exactly, ties included, and
    written as one bit a pair, ``Lq * Lk / 8`` bytes a head)."""
    B, Hq, _, Lq, Lk = problem.shape[:5]
    if B * Hq * Lq * -(-Lk // 32) >= 2**32:  # (the kernels index the words with 32 bits)
        raise NotImplementedError("topk_attention's backward past 2**32 selection words "
                                  f"(16 GiB; B * Hq * Lq * ceil(Lk / 32) = "
                                  f"{B * Hq * Lq * -(-Lk // 32)}) on the cuda backend: not "
                                  "yet; split the batch or the heads")
    return _single(problem, out, lse, dout, dlse, None, top_k=top_k)


def diff_attention_vjp(problem, lam, mode, out, dout, dbias_shape=None, two_streams=None):
    """Gradients of differential attention, every mode (module notes).

    Both streams' LSEs come from the differential forward kernel (run again;
    its output is dropped but in the Heaviside mode).  ``"difference"``: each stream's one-stream
    backward in turn (row ratio 1 and ``-lam``; the query-tile kernel sweeps
    for the stream's ``delta``, ``d1`` and ``e``), stream 1 adding to stream
    0's ``dV`` and bias gradient.  ``dlam = -e``.  ``"rectified"``: the same
    two one-stream backwards, each weight gated by its clip, which the
    differential forward's clip build writes as one bit a (query, key) pair
    (``B * H * Lq * ceil(Lk / 32) * 4`` bytes, the one ``(Lq, Lk)`` buffer
    of the backward: the clip needs both streams' weights, which a
    one-stream kernel does not form).  ``"heaviside"``: stream 0's backward alone,
    the weights that reach ``dV`` gated by the same bits (``W = A1 - lam H``; ``ds1``
    the plain stream's) and ``dlam = -dout . (H V)``, ``H V`` the clip build's output
    in this mode: the second map gets no gradient.  A broadcast bias's
    gradient is formed as in :func:`attention_vjp`.  With sinks the forward kernel's
    LSEs are the maps' normalisers, ``log(e^lse + e^sink)``: every mode's formulas
    (``ds = A (g - sum A g)``, the sums swept from the maps) then hold unchanged (the
    sinks' own gradient is :mod:`attnnb.vjp`'s).

    ``two_streams`` (an argument of this backend's only, not of :mod:`attnnb.vjp`'s
    interface): True runs either mode through the two-stream kernels instead, the other
    design, kept so that a GPU run can time the two against each other (gpu/run.py);
    None, the production route, and False the pair streams.  Past ``2**32`` clip words
    the rectified and Heaviside modes take the two-stream kernels whatever it says, and
    mask and score functions and dropout the pair streams (the two-stream kernels have
    neither).
    """
    if dbias_shape is not None:
        B, H2, _, Lq = problem.shape[:4]
        lam_rows = np.broadcast_to(_host(lam), (B, H2 // 2, Lq))
        mod_parts = []

        def piece(part, lam_c, *rest):
            grads = _diff_piece(part, lam_c, mode, *rest, two_streams=two_streams)
            mod_parts.extend(grads[6:])
            return grads[:6]

        chunked = _in_chunks(problem, (lam_rows, out, dout), dbias_shape, piece, streams=2)
        if chunked is not None:
            return chunked + ((sum_param_grads(mod_parts),) if mod_parts else ())
    return _diff_piece(problem, lam, mode, out, dout, dbias_shape, two_streams)


def _diff_piece(problem, lam, mode, out, dout, dbias_shape, two_streams=None):
    """:func:`diff_attention_vjp` with the bias gradient formed full size, in one piece."""
    from .diff import clip_words, diff_forward

    B, H2, _, Lq, Lk, D, Dv = problem.shape
    H = H2 // 2
    lam_h = _host(lam)
    arrays = device_problem(problem)
    dt = arrays.dtype
    mod_grads = () if problem.score_mod is None else gradient_buffers(
        problem, key_tile_blocks(problem, dt))
    tail = () if problem.score_mod is None else (parameter_gradients(problem, ()),)
    if not (B * H and Lq and Lk):
        return _zeros(problem, dt, dbias_shape, extra=[(B, H, Lq)]) + tail
    host_terms = np.zeros((B, H, 5, Lq), dt)
    host_terms[:, :, 4] = np.broadcast_to(lam_h, (B, H, Lq))
    pair_terms = cuda.to_device(host_terms)
    need_dbias = dbias_shape is not None
    code = DIFF_MODE_CODES[mode]
    gated = code == HEAVISIDE
    bits = code in (RECTIFIED, HEAVISIDE)  # the clip, or the gate
    # (the kernels index the clip's words with 32 bits: past 2**32 words, 16 GiB, the
    # two-stream kernels, which form the clip themselves, take the problem)
    huge = B * H * Lq * -(-Lk // 32) >= 2**32
    # None: the production route, the pair streams (they meet the register-tiling gate)
    two_streams = bool(two_streams) or (bits and huge)
    if two_streams and (has_mods(problem) or problem.dropout_p):  # the pair streams' own
        if bits and huge:
            raise NotImplementedError(f"mask and score functions or dropout in a {mode} "
                                      "backward past 2**32 clip words on the cuda backend: "
                                      "not yet")
        two_streams = False
    # the rectified and Heaviside pair streams read the bits the forward's clip build writes
    clip = clip_words(B, H, Lq, Lk) if bits and not two_streams else None
    # (its output is dropped, but for the Heaviside clip build's: H V, for dlam)
    gate_product = diff_forward(problem, cuda.to_device(np.ascontiguousarray(
        host_terms[:, :, 4])), mode, arrays, lses=pair_terms, clip=clip)[0]
    dout = _on_device(dout)
    # the row vectors stay on the device throughout
    grid, threads = element_grid(B * H * Lq)
    if two_streams:
        dq, dk, dv, dbias, dlogks = _sweep(problem, arrays, 2, pair_terms, dout,
                                           diff_mode=code, need_dbias=need_dbias)
        e_terms, e_slot = pair_terms, 3
    else:  # two one-stream backwards: dout weighs stream 0 by 1, stream 1 by -lam (the
        # Heaviside mode: stream 0 alone, its gate's weight -lam in a fourth row)
        stream_terms, grads = cuda.device_array((B, H, 4 if gated else 3, Lq), dt), None
        for c in (0,) if gated else (0, 1):
            helper_kernel("pair_rows", build_pair_rows, dt)[grid, threads](pair_terms, c,
                                                                           gated, stream_terms)
            grads = _sweep(problem, arrays, 1, stream_terms, dout, diff_mode=code,
                           need_dbias=need_dbias, stream=c, grads=grads, clip=clip,
                           mod_grads=mod_grads)
        dq, dk, dv, dbias, dlogks = grads
        e_terms, e_slot = (None, 0) if gated else (stream_terms, 2)
    dlam = cuda.device_array((B, H, Lq), dt)
    if e_terms is None:  # the Heaviside pair stream: -dout . (H V)
        helper_kernel("negated_dot", build_negated_dot, dt)[grid, threads](gate_product, dout,
                                                                           dlam)
    else:
        helper_kernel("negated_row", build_negated_row, dt)[grid, threads](e_terms, e_slot,
                                                                           dlam)
    dbias = None if dbias_shape is None else sum_to(dbias, dbias_shape, dt)
    dlks = None
    if arrays.has_ks:
        dlks = sum_to(dlogks.reshape((B, dlogks.shape[1], 1, Lk)), (B, 1, 1, Lk),
                      dt).reshape((B, Lk))
    if mod_grads:
        tail = (parameter_gradients(problem, mod_grads),)
    return _finish(arrays, dq, dk, dv, dbias, dlks, dlam) + tail


