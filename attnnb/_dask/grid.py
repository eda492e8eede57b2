"""Dask inputs checked and aligned into one block grid.

A Dask attention call is a grid of blocks: batch blocks x head blocks x
query blocks (the output's chunks) times key blocks.  :func:`make_grid`
checks ``q``, ``k``, ``v`` with the rules every attention function uses
(:func:`attnnb._front.validate.check_qkv`), casts them to the compute dtype and
rechunks them so that the blocks line up:

* batch axes: the common refinement of the chunks of ``q``, ``k`` and ``v``;
* heads: the query-head chunks of ``q``, split where a chunk would cut
  a grouped-query group in a way the chunk's own call could not express
  (a chunk must hold whole groups, or lie inside one group); the key-head
  chunks of ``k`` and ``v`` are merged until every query-head chunk reads
  its key heads from one of them (a slice of it, under MQA);
* queries: the chunks of ``q``; keys: the common refinement of ``k``'s and ``v``'s;
* ``D`` must be one chunk (``ValueError``); ``v``'s last axis is made one chunk.

:meth:`Grid.extra` does the same for ``mask``, ``bias``, ``key_size`` and
``lam`` (NumPy or Dask), chunked along the grid's blocks on their
non-broadcast axes only, so a ``(Lk,)`` padding mask stays ``Lk`` booleans.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import dask.array as da
import numpy as np

from .._front.function_args import check_head_axis
from .._front.validate import check_qkv, host_float_array
from . import any_dask


def edges(chunks) -> tuple[int, ...]:
    """Block boundaries ``(0, c0, c0 + c1, ..., n)`` of one axis' chunk sizes."""
    return tuple(int(e) for e in np.concatenate([[0], np.cumsum(chunks, dtype=np.int64)]))


def spans(bounds) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the blocks between consecutive boundaries."""
    return list(zip(bounds[:-1], bounds[1:]))


def _sizes(bounds) -> tuple[int, ...]:
    return tuple(int(b - a) for a, b in spans(bounds)) or (0,)


def _refine(*chunkings) -> tuple[int, ...]:
    """The common refinement of several chunkings of one axis."""
    return _sizes(sorted(set().union(*(edges(c) for c in chunkings))))


@dataclass(frozen=True)
class Heads:
    """How query-head blocks meet key-head blocks.

    ``rows`` are the boundaries of the query-head blocks in *row heads*
    (query heads; head pairs for differential attention), ``keys`` those of
    the key-head blocks in *key units* (key heads; key pairs, i.e. value
    heads, for differential attention).  Query block ``i`` reads key block
    ``key_block[i]``, all of it or the key units ``key_slice[i] = (a, b)``
    of it (counted from the block's start).
    """

    rows: tuple[int, ...]
    keys: tuple[int, ...]
    key_block: tuple[int, ...]
    key_slice: tuple


def _whole_or_inside_groups(rows, group):
    """Split query-head blocks that neither hold whole groups nor lie inside one group."""
    out = set(rows)
    for lo, hi in spans(rows):
        if (lo % group == 0 and hi % group == 0) or lo // group == (hi - 1) // group:
            continue
        out.update(range((lo // group + 1) * group, hi, group))
    return tuple(sorted(out))


def head_blocks(q_chunks, k_chunks, v_chunks, group: int, pairs: bool) -> Heads:
    """Align the head chunks of q, k and v (see :class:`Heads`); ``group`` rows per key unit."""
    unit = 2 if pairs else 1  # packed heads per row head (q) and per key unit (k)
    rows = _whole_or_inside_groups(sorted({e // unit for e in edges(q_chunks)}), group)
    keys = {e // unit for e in edges(k_chunks)} | set(edges(v_chunks))
    needed = [(lo // group, -(-hi // group)) for lo, hi in spans(rows)]
    # a key boundary inside the key units a query block needs would split its read
    keys = tuple(sorted(c for c in keys if not any(a < c < b for a, b in needed)))
    block, where = [], []
    for a, b in needed:
        j = bisect.bisect_right(keys, a) - 1
        block.append(j)
        where.append(None if (keys[j], keys[j + 1]) == (a, b) else (a - keys[j], b - keys[j]))
    return Heads(rows, keys, tuple(block), tuple(where))


@dataclass
class Grid:
    """q, k, v as aligned Dask arrays ``(*batch, H, L, D)`` and their block grid.

    2-D inputs get a head axis of one (``squeeze``), dropped again by
    :meth:`restore`.  ``pairs`` marks differential attention's packed heads.
    """

    q: da.Array
    k: da.Array
    v: da.Array
    batch_shape: tuple
    squeeze: bool
    compute_dtype: np.dtype
    out_dtype: np.dtype
    pairs: bool
    heads: Heads
    q_edges: tuple[int, ...]
    k_edges: tuple[int, ...]
    chunks: dict = field(default_factory=dict)  # role -> chunk sizes ('b0', ..., 'h', 'q', 'k')

    @property
    def nb(self) -> int:
        """Number of batch axes (of the canonical arrays, with the head axis added)."""
        return self.q.ndim - 3

    @property
    def shape(self):
        """``(Hq, Hk, Lq, Lk, D, Dv)`` of the canonical arrays (packed heads for pairs)."""
        Hq, Lq, D = self.q.shape[-3:]
        Hk, Lk = self.k.shape[-3:-1]
        return Hq, Hk, Lq, Lk, D, self.v.shape[-1]

    @property
    def row_heads(self) -> int:
        """Query heads (head pairs for differential attention): the heads of mask and bias."""
        return self.q.shape[-3] // (2 if self.pairs else 1)

    def query_blocks(self):
        """Every ``index`` (a dict of block numbers by role, without ``'k'``) of the output."""
        batch = [range(len(self.chunks[f"b{a}"])) for a in range(self.nb)]
        for b in itertools.product(*batch):
            for h in range(len(self.heads.rows) - 1):
                for i in range(len(self.q_edges) - 1):
                    yield {**{f"b{a}": b[a] for a in range(self.nb)}, "h": h, "q": i}

    def q_key(self, index) -> tuple:
        return (self.q.name, *self._batch(index), index["h"], index["q"], 0)

    def kv_keys(self, index, kb) -> tuple[tuple, tuple]:
        b, h = self._batch(index), self.heads.key_block[index["h"]]
        return (self.k.name, *b, h, kb, 0), (self.v.name, *b, h, kb, 0)

    def _batch(self, index):
        return tuple(index[f"b{a}"] for a in range(self.nb))

    def batch_spans(self, index) -> list[tuple[int, int]]:
        """``[(start, size), ...]``: the batch block of ``index`` along each batch axis."""
        return [(sum(self.chunks[f"b{a}"][:index[f"b{a}"]]), self.chunks[f"b{a}"][index[f"b{a}"]])
                for a in range(self.nb)]

    def block_shape(self, index, width) -> tuple[int, ...]:
        """Shape of the output block at ``index``, ``width`` values per row (None: none)."""
        sizes = [self.chunks[f"b{a}"][index[f"b{a}"]] for a in range(self.nb)]
        sizes += [self.chunks["h"][index["h"]], self.chunks["q"][index["q"]]]
        return tuple(sizes) + (() if width is None else (width,))

    def extra(self, x, roles):
        """``x`` (NumPy or Dask, already checked) as an :class:`Extra` chunked along the grid.

        ``roles`` names the axes of the full shape ``x`` broadcasts to, from
        the last: e.g. ``('h', 'q', 'k')`` after the batch axes.
        """
        if x is None:
            return None
        roles = tuple(f"b{a}" for a in range(self.nb)) + tuple(roles)
        if self.squeeze:  # the user's shapes have no head axis; the canonical ones do
            roles = tuple(r for r in roles if r != "h")
        full = tuple(sum(self.chunks[r]) for r in roles)
        x = x if any_dask(x) else np.asarray(x)
        x = x.reshape((1,) * (len(full) - x.ndim) + tuple(x.shape))
        axes = tuple(None if n == 1 else r for r, n in zip(roles, x.shape))  # 1: broadcast
        chunks = tuple(self.chunks[r] if r else (1,) for r in axes)
        arr = x.rechunk(chunks) if any_dask(x) else da.from_array(x, chunks=chunks)
        if self.squeeze and "q" in roles:  # the canonical head axis (one head), broadcast
            at = roles.index("q")
            arr = arr[(slice(None),) * at + (None,)]
            axes = axes[:at] + (None,) + axes[at:]
        return Extra(arr, axes)

    def restore(self, x):
        """Drop the head axis that 2-D inputs were given (the canonical batch is then empty)."""
        return x[0] if self.squeeze else x


@dataclass(frozen=True)
class Extra:
    """An argument chunked along the grid: axes with a role follow the blocks, None ones are 1."""

    array: da.Array
    axes: tuple

    def key(self, index) -> tuple:
        return (self.array.name, *(index[r] if r else 0 for r in self.axes))


def known_sizes(name, x):
    """Refuse a Dask array whose chunk sizes are unknown (NaN, after boolean indexing):
    the grid is built from them before anything is computed."""
    if any_dask(x) and any(n != n for n in x.shape):
        raise ValueError(f"{name} has chunks of unknown size (shape {x.shape}); call "
                         f"{name}.compute_chunk_sizes() (or give the sizes) first")


def _as_dask(name, x):
    """``x`` itself when it is a Dask array, else one chunk holding it (checked first)."""
    if any_dask(x):
        return x
    arr = host_float_array(name, x)
    return da.from_array(arr, chunks=-1)


def _single_chunk(name, x, axis_name):
    if len(x.chunks[-1]) > 1:
        raise ValueError(
            f"{name}'s {axis_name} (last axis, {x.shape[-1]}) must be a single chunk; got "
            f"chunks {x.chunks[-1]}: rechunk with {name}.rechunk({{-1: -1}})"
        )


def make_grid(q, k, v, *, pairs: bool = False) -> Grid:
    """Check, cast and align ``q``, ``k``, ``v``; see the module docstring."""
    q, k, v = (_as_dask(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    batch, squeeze, comp, out_dtype = check_qkv(q, k, v, head_pairs=pairs)
    if pairs:
        check_head_axis(squeeze, q.shape[-2:])
    _single_chunk("q", q, "head dimension D")
    _single_chunk("k", k, "head dimension D")
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    q, k, v = (x.astype(comp) for x in (q, k, v))
    nb = q.ndim - 3
    unit = 2 if pairs else 1
    group = (q.shape[-3] // unit) // max(k.shape[-3] // unit, 1)
    heads = head_blocks(q.chunks[-3], k.chunks[-3], v.chunks[-3], group, pairs)
    chunks = {f"b{a}": _refine(q.chunks[a], k.chunks[a], v.chunks[a]) for a in range(nb)}
    keys = _refine(k.chunks[-2], v.chunks[-2])
    chunks.update(h=_sizes(heads.rows), q=q.chunks[-2], k=keys)
    batch_chunks = tuple(chunks[f"b{a}"] for a in range(nb))
    q = q.rechunk(batch_chunks + (tuple(n * unit for n in chunks["h"]), q.chunks[-2], -1))
    k_heads = _sizes(heads.keys)
    k = k.rechunk(batch_chunks + (tuple(n * unit for n in k_heads), keys, -1))
    v = v.rechunk(batch_chunks + (k_heads, keys, -1))
    return Grid(q, k, v, batch, squeeze, comp, out_dtype, pairs, heads,
                edges(q.chunks[-2]), edges(keys), chunks)
