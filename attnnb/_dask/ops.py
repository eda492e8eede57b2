"""The attention functions on Dask arrays: lazy task graphs (docs/contract.md §7.2).

Each function checks its arguments as its eager twin does (errors raised
before any graph exists, without computing anything), aligns the blocks
(:mod:`attnnb._dask.grid`), decides which key blocks each query block sees
(:mod:`attnnb._dask.visible`) and builds the graph (:mod:`attnnb._dask.graph`)
whose tasks run :mod:`attnnb._dask.blocks`:

* ``attention``, ``sparse_attention``: one part per visible block, merged
  through the LSEs; ``softmax1`` parts are computed as softmax and finished
  after the merge (its ``+1`` belongs to the whole row);
* ``topk_attention``: a query block with several key blocks first selects
  (:mod:`attnnb._dask.select`), then attends over the kept keys;
* ``diff_attention``: both streams merged through their LSEs, then
  ``o1 - lam * o2``; the rectified mode first merges each stream's LSE, then
  adds up every block's clipped share.

A query block that sees a single key block runs the function itself on it.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .._front.checks import (
    broadcast_pairwise,
    check_key_size_values,
    is_device_array,
    log_key_sizes,
)
from .._front.dispatch import requested_backend
from .._front.function_args import (
    check_lam_values,
    check_mode,
    check_pattern,
    check_top_k,
    lambda_rows,
)
from .._front.validate import (
    check_bool,
    check_normalizer,
    check_scale,
    check_sinks,
    lse_dtype,
    sigmoid_offset,
)
from . import any_dask, blocks, gates, select
from .graph import Graph
from .grid import known_sizes, make_grid, spans
from .visible import dense_blocks, pattern_blocks

ROLES = {"mask": ("h", "q", "k"), "bias": ("h", "q", "k"), "key_size": ("k",), "lam": ("h", "q"),
         "sinks": ("h",)}


def _stand_in(x, dtype=None):
    """A zero-stride NumPy array of ``x``'s shape (and ``dtype``): shape checks, no memory."""
    return np.broadcast_to(np.zeros((), x.dtype if dtype is None else dtype), x.shape)


def host_values(chunk):
    """A chunk's values as a NumPy array (a device chunk copied to the host: the
    checks read a few values, the chunk itself stays where it is)."""
    if is_device_array(chunk):
        from .._front.device import device_view  # imports numba.cuda: device chunks only

        return device_view(chunk, need_reshape=False).copy_to_host()
    return np.asarray(chunk)


def _checked_chunks(x, check_values):
    """Dask ``x`` whose chunks pass ``check_values(chunk, offset, shape)`` as they are
    computed, so that a bad value is reported at its index in ``x`` (the user's array),
    not in the chunk or the grid's block that a task reads."""
    def checked(chunk, block_info=None):
        location = block_info[0]["array-location"] if block_info else ()
        check_values(host_values(chunk), tuple(lo for lo, _ in location), x.shape)
        return chunk

    return x.map_blocks(checked, dtype=x.dtype, meta=x._meta)  # device chunks stay so


class Call:
    """One Dask call: its grid, its chunked extras and its graph."""

    def __init__(self, op, q, k, v, *, mask=None, bias=None, key_size=None, lam=None,
                 sinks=None, normalizer="softmax", scale=None, backend=None, pairs=False,
                 params=(), mods=(None, None)):
        for name, x in (("q", q), ("k", k), ("v", v), ("mask", mask), ("bias", bias),
                        ("key_size", key_size), ("lam", lam)):
            known_sizes(name, x)
        self.grid = g = make_grid(q, k, v, pairs=pairs)
        self.scale = check_scale(scale, g.shape[4])
        self.backend = requested_backend(backend)
        sinks = self._sinks(sinks, normalizer)
        # a pair's two sinks are read by the finish tasks as literal blocks (sinks_at)
        self.pair_sinks = sinks if pairs else None
        extras = {"mask": self._pairwise("mask", mask, np.bool_),
                  "bias": self._pairwise("bias", bias, g.compute_dtype),
                  "key_size": self._sizes(key_size), "lam": self._lam(lam),
                  "sinks": None if pairs else sinks}
        self.extras = {n: g.extra(x, ROLES[n]) for n, x in extras.items()}
        arrays = [g.q, g.k, g.v] + [e.array for e in self.extras.values() if e is not None]
        self.mask_mod, self.score_mod = self._mods(*mods)
        # (a pair's sinks are literal values of its tasks, not an input: named here)
        self.graph = Graph(op, arrays, self.scale, self.backend, *params, self.pair_sinks,
                           *(_mod_token(m) for m in (self.mask_mod, self.score_mod)))
        self.finals = {}

    # -- mask and score functions -------------------------------------------------------------
    def _mods(self, mask_mod, score_mod):
        """The call's mask and score functions, checked as the eager functions check them
        (a ``TypeError`` names one that does not compile), before any graph exists."""
        if mask_mod is None and score_mod is None:
            return None, None
        from .._front.validate import check_mods

        g = self.grid
        _, _, Lq, Lk, _, _ = g.shape
        return check_mods(mask_mod, score_mod, False, Lq, Lk, g.compute_dtype)

    def without_hidden(self, touched):
        """``touched`` (``{row key: [(key block, spec), ...]}`` by query block in the key's
        last place) less the key blocks where the mask function allows no pair."""
        if self.mask_mod is None:
            return touched
        from .._mods.compile import blocks_allowed

        g = self.grid
        B = int(np.prod(g.batch_shape, dtype=np.int64))
        _, _, Lq, Lk, _, _ = g.shape
        allowed = blocks_allowed(self.mask_mod, (B, g.row_heads, Lq, Lk), g.q_edges,
                                 g.k_edges)
        at = (lambda key: key[-1]) if touched and isinstance(next(iter(touched)), tuple) else (
            lambda key: key)
        return {key: [(kb, spec) for kb, spec in row if allowed[at(key), kb]]
                for key, row in touched.items()}

    def mods_at(self, index, kb) -> dict:
        """The ``mask_mod`` / ``score_mod`` keywords of the part of query block ``index``
        and key block ``kb``: the call's functions placed at the block."""
        if self.mask_mod is None and self.score_mod is None:
            return {}
        from .._mods.compile import placed, reads_argument

        g = self.grid
        _, _, Lq, Lk, _, _ = g.shape
        origin = (self._first_batch(index, self.mask_mod, self.score_mod, reads_argument),
                  g.heads.rows[index["h"]], g.q_edges[index["q"]], g.k_edges[kb])
        return {name: None if mod is None else placed(mod, origin, (Lq, Lk))
                for name, mod in (("mask_mod", self.mask_mod), ("score_mod", self.score_mod))}

    def _first_batch(self, index, mask_mod, score_mod, reads_argument) -> int:
        """The flat batch index of the block's first element; a block whose elements are
        not consecutive in the flat batch (an inner batch axis split while an outer one
        spans several) is refused when a function reads ``b``."""
        g = self.grid
        starts, sizes = zip(*g.batch_spans(index)) if g.nb else ((), ())
        reads_b = any(mod is not None and reads_argument(mod, 0)
                      for mod in (mask_mod, score_mod))
        spread = any(sizes[a] > 1 and any(sizes[c] != g.batch_shape[c]
                                          for c in range(a + 1, g.nb)) for a in range(g.nb))
        if reads_b and spread:
            chunks = tuple(g.chunks[f"b{a}"] for a in range(g.nb))
            raise NotImplementedError(
                "a mask or score function that reads b needs batch blocks whose elements "
                "are consecutive: rechunk so that a batch axis is split only where the axes "
                f"after it are whole (batch chunks {chunks})")
        return int(np.ravel_multi_index(starts, g.batch_shape)) if g.nb else 0

    # -- checks of the extras, as the eager functions make them ------------------------------
    def _facts(self):
        g = self.grid
        B = int(np.prod(g.batch_shape, dtype=np.int64))
        return g.batch_shape, g.squeeze, B

    def _pairwise(self, name, x, dtype):
        if x is None:
            return None
        batch, squeeze, B = self._facts()
        _, _, Lq, Lk, _, _ = self.grid.shape
        rows = self.grid.row_heads
        if any_dask(x):  # the dtype on a 0-d stand-in, the shape on one of the target dtype
            broadcast_pairwise(name, np.zeros((), x.dtype), batch, squeeze, B, rows, Lq, Lk,
                               dtype)
            broadcast_pairwise(name, _stand_in(x, dtype), batch, squeeze, B, rows, Lq, Lk,
                               dtype)
            return x
        broadcast_pairwise(name, x, batch, squeeze, B, rows, Lq, Lk, dtype)
        return np.asarray(x)

    def _sizes(self, key_size):
        """Check ``key_size`` (values too, when NumPy; a Dask one's values chunk by chunk
        as they are computed, reported in its own shape); drop ToMe's trailing axis of
        one."""
        if key_size is None:
            return None
        batch, squeeze, B = self._facts()
        Lk = self.grid.shape[3]
        x = key_size if any_dask(key_size) else np.asarray(key_size)
        probe = np.broadcast_to(np.ones((), x.dtype), x.shape) if any_dask(x) else x
        log_key_sizes(probe, batch, squeeze, B, Lk, self.grid.compute_dtype)
        if any_dask(x):
            x = _checked_chunks(x, check_key_size_values)
        if x.ndim >= 1 and x.shape[-1] == 1 and x.ndim == len(batch) + 2:
            x = x[..., 0]
        return x

    def _lam(self, lam):
        """``lam`` of differential attention: checked and broadcast when NumPy (or a
        number); a Dask one's shape and dtype now, its values chunk by chunk as they are
        computed (reported in its own shape)."""
        if not self.grid.pairs:
            return None
        batch, _, B = self._facts()
        _, _, Lq, _, _, _ = self.grid.shape
        H = self.grid.row_heads
        comp = self.grid.compute_dtype
        if any_dask(lam):
            lambda_rows(np.ones((), lam.dtype), batch, B, H, Lq, comp)
            lambda_rows(_stand_in(lam, comp), batch, B, H, Lq, comp)
            return _checked_chunks(lam, check_lam_values)
        return lambda_rows(lam, batch, B, H, Lq, comp).reshape(batch + (H, Lq))

    def _sinks(self, sinks, normalizer):
        """Learned sinks, checked as the eager functions check them, in the user's
        ``(*batch, Hq)`` (NumPy: a logit per head, read by the finish tasks); for
        differential attention ``(*batch, H, 2)``, a pair's two maps' sinks."""
        if sinks is None:
            return None
        if any_dask(sinks):
            raise TypeError("sinks must be a NumPy array (a logit per query head) when q, k "
                            "and v are Dask arrays; got a Dask array")
        batch, squeeze, B = self._facts()
        Hq = self.grid.shape[0]
        rows = check_sinks(sinks, normalizer, batch, squeeze, B, Hq, self.grid.compute_dtype)
        if self.grid.pairs:
            return rows.reshape(batch + (Hq // 2, 2))
        return rows.reshape(batch + (() if squeeze else (Hq,)))

    def sinks_at(self, index):
        """The pair sinks of query block ``index``, ``(*batch, H, 2)`` (NumPy), or None."""
        if self.pair_sinks is None:
            return None
        g = self.grid
        at = tuple(slice(start, start + size) for start, size in g.batch_spans(index))
        lo, hi = g.heads.rows[index["h"]], g.heads.rows[index["h"] + 1]
        return np.ascontiguousarray(self.pair_sinks[at + (slice(lo, hi),)])

    # -- tasks ------------------------------------------------------------------------------
    def keys(self, index, kb, names):
        """The keys of the chunks ``names`` (q, k, v, mask, ...) for query block ``index``
        and key block ``kb``; None for an extra not given."""
        g = self.grid
        k, v = g.kv_keys(index, kb)
        out = []
        for n in names:
            if n in ("q", "k", "v"):
                out.append({"q": g.q_key(index), "k": k, "v": v}[n])
            else:
                extra = self.extras[n]
                out.append(None if extra is None else extra.key({**index, "k": kb}))
        return out

    def part(self, stage, index, kb, fn, names, *more):
        """Add one block's task ``fn(*chunks, *more)``; returns its key."""
        return self.graph.add(stage, self.position(index) + (kb,),
                              (fn, *self.keys(index, kb, names), *more))

    def position(self, index) -> tuple:
        return (*(index[f"b{a}"] for a in range(self.grid.nb)), index["h"], index["q"])

    def common(self, index, spec, drop=()):
        """The keywords the parts of query block ``index`` take (less those in ``drop``)."""
        kw = dict(limit=spec, heads=self.grid.heads.key_slice[index["h"]], scale=self.scale,
                  backend=self.backend)
        return {k: v for k, v in kw.items() if k not in drop}

    def reduce(self, stage, index, parts, merge):
        return self.graph.reduce(stage, self.position(index), parts, merge)

    def finish(self, index, fn, key, *more, picks=(0, 1)):
        """The finish task of query block ``index``, ``fn(merged, *more)``; ``picks`` say
        where its output and LSE are in what it returns (None: the value itself)."""
        at = self.position(index)
        self.finals[at] = (self.graph.add("finish", at, (fn, key, *more)), picks)

    def empty(self, index):
        """A query block that sees no key: zeros, and ``-inf`` LSEs."""
        g = self.grid
        out_dtype = g.out_dtype
        fn = partial(blocks.empty, shape=g.block_shape(index, g.shape[5]), dtype=out_dtype,
                     lse_dtype=lse_dtype(out_dtype), like=g.q._meta)
        at = self.position(index)
        self.finals[at] = (self.graph.add("empty", at, (fn,)), (0, 1))

    def lse_finish(self, index, parts, softmax1, merge=blocks.merge_attention):
        """Merge ``(out, lse)`` parts (``merge``: through their LSEs, or
        :func:`~attnnb._dask.blocks.merge_sums` for sums) and finish them
        (``softmax1``: softmax parts, finished with the learned sinks when the call has
        them); no parts: an empty block."""
        if not parts:
            return self.empty(index)
        key = self.reduce("merge", index, parts, merge)
        dtype = self.grid.out_dtype
        sinks = self.extras["sinks"]
        fn = partial(blocks.finish_attention, softmax1=softmax1 or sinks is not None,
                     out_dtype=dtype, lse_dtype=lse_dtype(dtype))
        self.finish(index, fn, key, *(() if sinks is None else (sinks.key(index),)))

    def outputs(self, return_lse):
        """The output arrays (``(out, lse)`` with ``return_lse``) in the user's layout."""
        g = self.grid
        batch = tuple(g.chunks[f"b{a}"] for a in range(g.nb))
        rows = batch + (g.chunks["h"], g.chunks["q"])
        dtype = g.out_dtype
        outs = {at + (0,): (key, picks[0]) for at, (key, picks) in self.finals.items()}
        out = g.restore(self.graph.array("out", outs, rows + ((g.shape[5],),), dtype, g.q._meta))
        if not return_lse:
            return out
        lses = {at: (key, picks[1]) for at, (key, picks) in self.finals.items()}
        lse = g.restore(self.graph.array("lse", lses, rows, lse_dtype(dtype), g.q._meta))
        return out, lse


def _mod_token(mod):
    """What names a mod in the graph's token: its functions' fingerprint and its arrays."""
    if mod is None:
        return None
    from .._mods.compile import bind, fingerprint

    return fingerprint(mod), bind(mod, 0, 0)


def dense_parts(c, index, row, normalizer, sigmoid_bias=None):
    """Parts of dense (masked, causal) attention for one query block."""
    fn = partial(blocks.attention_part, normalizer=normalizer, sigmoid_bias=sigmoid_bias)
    return [c.part("part", index, kb, partial(fn, **c.common(index, spec), **c.mods_at(index, kb)),
                   ("q", "k", "v", "mask", "bias", "key_size")) for kb, spec in row]


def part_rules(sigmoid_bias, normalizer, Lk):
    """``(sigmoid_bias, merge)`` of the parts: ``sigmoid``'s bias fixed by the whole
    call's key count (a block's own default would differ) and parts that add up;
    ``softpick``'s parts merged as finished ``softmax1`` parts (its ``eps`` a sink);
    the others merge through their LSEs."""
    offset = sigmoid_offset(sigmoid_bias, normalizer, Lk)
    if normalizer == "sigmoid":
        return offset, blocks.merge_sums
    if normalizer == "softpick":
        return None, blocks.merge_softpick
    return None, blocks.merge_attention


def part_normalizer(normalizer, row):
    """softmax1 over several key blocks is computed as softmax and finished after the merge."""
    return "softmax" if normalizer == "softmax1" and len(row) > 1 else normalizer


def attention(q, k, v, *, mask=None, bias=None, key_size=None, causal=False, scale=None,
              normalizer="softmax", return_lse=False, sinks=None, sigmoid_bias=None,
              mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.attention` on Dask arrays."""
    return_lse = check_bool("return_lse", return_lse)
    check_normalizer(normalizer)
    causal = check_bool("causal", causal)
    c = Call("attention", q, k, v, mask=mask, bias=bias, key_size=key_size, sinks=sinks,
             normalizer=normalizer, scale=scale, backend=backend,
             params=(causal, normalizer, sigmoid_bias), mods=(mask_mod, score_mod))
    offset, merge = part_rules(sigmoid_bias, normalizer, c.grid.shape[3])
    visible = c.without_hidden(dense_blocks(c.grid.q_edges, c.grid.k_edges, causal))
    for index in c.grid.query_blocks():
        row = visible[index["q"]]
        norm = part_normalizer(normalizer, row)
        c.lse_finish(index, dense_parts(c, index, row, norm, offset), norm != normalizer,
                     merge)
    return c.outputs(return_lse)


def sparse_attention(q, k, v, pattern, *, key_size=None, scale=None, normalizer="softmax",
                     return_lse=False, sinks=None, sigmoid_bias=None, mask_mod=None,
                     score_mod=None, backend=None):
    """:func:`attnnb.sparse_attention` on Dask arrays."""
    return_lse = check_bool("return_lse", return_lse)
    check_normalizer(normalizer)
    c = Call("sparse", q, k, v, key_size=key_size, sinks=sinks, normalizer=normalizer,
             scale=scale, backend=backend,
             params=(normalizer, sigmoid_bias, getattr(pattern, "indptr", None),
                     getattr(pattern, "indices", None)), mods=(mask_mod, score_mod))
    g = c.grid
    Hq, _, Lq, Lk, _, _ = g.shape
    check_pattern(pattern, Lq, Lk, Hq)
    touched = c.without_hidden(pattern_blocks(pattern, g.heads.rows, g.q_edges, g.k_edges))
    offset, merge = part_rules(sigmoid_bias, normalizer, Lk)
    stored = c.graph.add("pattern", (), pattern)  # one copy, sent to the workers that need it
    head_spans, q_spans, k_spans = spans(g.heads.rows), spans(g.q_edges), spans(g.k_edges)
    for index in g.query_blocks():
        row = touched[index["h"], index["q"]]
        norm = part_normalizer(normalizer, row)
        parts = []
        for kb, whole in row:
            where = None if whole else (head_spans[index["h"]], q_spans[index["q"]], k_spans[kb])
            fn = partial(blocks.sparse_part, where=where, normalizer=norm, sigmoid_bias=offset,
                         **c.common(index, None, drop=("limit",)), **c.mods_at(index, kb))
            parts.append(c.part("part", index, kb, fn, ("q", "k", "v", "key_size"), stored))
        c.lse_finish(index, parts, norm != normalizer, merge)
    return c.outputs(return_lse)


def topk_attention(q, k, v, top_k, *, mask=None, causal=False, key_size=None, scale=None,
                   normalizer="softmax", return_lse=False, sinks=None, sigmoid_bias=None,
                   mask_mod=None, score_mod=None, backend=None):
    """:func:`attnnb.topk_attention` on Dask arrays: an exact, global selection (softmax's
    ranking), then the normalizer's parts over the kept keys, merged as
    :func:`attention`'s are."""
    return_lse = check_bool("return_lse", return_lse)
    top_k = check_top_k(top_k)
    causal = check_bool("causal", causal)
    check_normalizer(normalizer)
    c = Call("topk", q, k, v, mask=mask, key_size=key_size, sinks=sinks, normalizer=normalizer,
             scale=scale, backend=backend, params=(top_k, causal, normalizer, sigmoid_bias),
             mods=(mask_mod, score_mod))
    Lk = c.grid.shape[3]
    offset, merge = part_rules(sigmoid_bias, normalizer, Lk)
    weighing = dict(normalizer=normalizer, sigmoid_bias=offset)
    visible = c.without_hidden(dense_blocks(c.grid.q_edges, c.grid.k_edges, causal))
    k_starts = c.grid.k_edges
    names = ("q", "k", "v", "mask", "key_size")
    for index in c.grid.query_blocks():
        row = visible[index["q"]] if top_k else []
        norm = part_normalizer(normalizer, row)
        if top_k >= Lk or len(row) <= 1:
            if top_k >= Lk or not row:  # every allowed key is kept: plain masked attention
                parts = dense_parts(c, index, row, norm, offset)
            else:
                fn = partial(blocks.topk_solo, top_k=top_k, **weighing,
                             **c.common(index, row[0][1]), **c.mods_at(index, row[0][0]))
                parts = [c.part("part", index, row[0][0], fn, names)]
            c.lse_finish(index, parts, norm != normalizer, merge)
            continue
        found = [c.part("candidates", index, kb,
                        partial(select.candidates, start=k_starts[kb], top_k=top_k,
                                **c.common(index, spec, drop=("backend",)),
                                **c.mods_at(index, kb)),
                        ("q", "k", "mask", "key_size")) for kb, spec in row]
        merged = c.reduce("cmerge", index, found, partial(select.merge_candidates, top_k=top_k))
        chosen = c.graph.add("selection", c.position(index),
                             (partial(select.selection, top_k=top_k), merged))
        parts = [c.part("part", index, kb,
                        partial(select.topk_part, start=k_starts[kb], normalizer=norm,
                                sigmoid_bias=offset, **c.common(index, spec),
                                **c.mods_at(index, kb)),
                        names, chosen) for kb, spec in row]
        c.lse_finish(index, parts, norm != normalizer, merge)
    return c.outputs(return_lse)


def diff_attention(q, k, v, lam, *, mask=None, bias=None, key_size=None, causal=False,
                   scale=None, mode="difference", sinks=None, mask_mod=None, score_mod=None,
                   backend=None):
    """:func:`attnnb.diff_attention` on Dask arrays."""
    check_mode(mode)
    causal = check_bool("causal", causal)
    c = Call("diff", q, k, v, mask=mask, bias=bias, key_size=key_size, lam=lam, sinks=sinks,
             scale=scale, backend=backend, pairs=True, params=(causal, mode),
             mods=(mask_mod, score_mod))
    visible = c.without_hidden(dense_blocks(c.grid.q_edges, c.grid.k_edges, causal))
    names = ("q", "k", "v", "mask", "bias", "key_size")
    cast = partial(blocks.finish_cast, dtype=c.grid.out_dtype)
    for index in c.grid.query_blocks():
        row = visible[index["q"]]
        lam_key = c.keys(index, 0, ("lam",))[0]
        sink = c.sinks_at(index)
        if not row:
            c.empty(index)
        elif len(row) == 1:
            kb, spec = row[0]
            fn = partial(blocks.diff_solo, mode=mode, sinks=sink, **c.common(index, spec),
                         **c.mods_at(index, kb))
            c.finish(index, cast, c.part("part", index, kb, fn, names + ("lam",)),
                     picks=(None, None))
        elif mode == "difference":
            parts = [c.part("part", index, kb,
                            partial(blocks.streams_part, lse_only=False, **c.common(index, spec),
                                    **c.mods_at(index, kb)), names) for kb, spec in row]
            merged = c.reduce("merge", index, parts, blocks.merge_streams)
            c.finish(index, partial(blocks.finish_difference, out_dtype=c.grid.out_dtype),
                     merged, lam_key, sink, picks=(None, None))
        else:  # the maps' LSEs over every key block first, then each block's share
            local = {kb: c.part("lse", index, kb,
                                partial(blocks.streams_part, lse_only=True,
                                        **c.common(index, spec), **c.mods_at(index, kb)), names)
                     for kb, spec in row}
            total = c.reduce("lmerge", index, list(local.values()), blocks.merge_lses)
            if sink is not None:
                total = c.graph.add("sinks", c.position(index), (blocks.with_sinks, total, sink))
            rectified = mode == "rectified"  # the Heaviside gate needs the global maps only
            share = blocks.rectified_part if rectified else gates.heaviside_part
            parts = [c.part("part", index, kb,
                            partial(share, **c.common(index, spec), **c.mods_at(index, kb)),
                            names + ("lam",), *((local[kb],) if rectified else ()), total)
                     for kb, spec in row]
            c.finish(index, cast, c.reduce("merge", index, parts, blocks.merge_sum),
                     picks=(None, None))
    return c.outputs(False)
