"""Decoding: few query rows against many keys, split along the keys.

A step of autoregressive decoding asks for ``Lq = 1 .. 16`` queries against
thousands of keys.  Two things of the general sweep then cost more than the
attention itself:

* the sweeps' prologue transposes every key tile into a buffer as large as
  ``k`` (:func:`attnnb.cpu._tiles.prepare_key_tile`), which pays off only
  when many query tiles read each key tile.  With at most
  :data:`LOCAL_TILE_ROWS` query rows a task transposes each key tile itself,
  into a tile of scratch that stays in L1, just before it uses it (the
  prologue was most of a decoding call: docs/notes/performance.md, "Head sizes, ViT
  batches and decoding");
* a transposed key tile serves at most 16 rows.  Where the register blocks
  are AVX2's (:data:`LOGITS_FROM_KEYS`), tasks of 4 to 16 rows form a full
  tile's logits from the keys as stored instead
  (:func:`attnnb.cpu._tiles.tile_logits_keys`, the same bits), prefetching
  the next tile's keys and values as they go;
* one task per (batch, head, query tile) is too few tasks to keep every core
  busy when ``B * H`` is small.  :func:`key_splits` then cuts each row's
  key tiles into contiguous ranges, one task each, and
  :func:`merge_split_rows` merges their normalised partial results
  through their log-sum-exps (the merge of :func:`attnnb.combine`).

The number of splits is a function of the shape alone, never of the thread
count, so that results are the same on every machine with any number of
threads (docs/contract.md §1).
"""

from __future__ import annotations

import math

import numpy as np

from .._core.codes import SIGMOID, SOFTMAX1, SOFTPICK
from ._jit import WIDE_REGISTERS, inner
from ._tiles import TILE_K, sigmoid

# Query rows up to which tasks transpose their key tiles themselves.
LOCAL_TILE_ROWS = 16
# Full key tiles of 4 to 16 query rows by tile_logits_keys instead of a transposed copy:
# with AVX2 the copy costs more than it saves (docs/notes/performance.md, "Decoding from the
# keys as stored").  With AVX-512 its 16-wide blocks of 4 rows would keep 4
# accumulators (FMA latency-bound, where the transposed tiles' 4 x 64 blocks keep 16):
# those types keep the transposed tiles until it is measured there.
LOGITS_FROM_KEYS = not WIDE_REGISTERS
# Tasks that the splits aim for, and the least key tiles a split gets.
SPLIT_TASKS = 32
MIN_SPLIT_TILES = 4


def key_splits(batch: int, heads: int, lq: int, lk: int) -> int:
    """Key ranges per (batch, head) for a dense call of this shape (1: no split).

    Only calls with at most :data:`LOCAL_TILE_ROWS` queries split: enough
    ranges that ``batch * heads * splits >= SPLIT_TASKS``, each at least
    :data:`MIN_SPLIT_TILES` key tiles long.
    """
    if lq > LOCAL_TILE_ROWS or batch * heads == 0:
        return 1
    n_kt = -(-lk // TILE_K)
    return max(1, min(n_kt // MIN_SPLIT_TILES, -(-SPLIT_TASKS // (batch * heads))))


@inner
def merge_split_rows(part_out, part_lse, row, normalizer, sinks, out, lse):
    """Merge the key splits of one output row, ``row`` of ``B * H * Lq``.

    ``part_out (n_split, B, H, Lq, Dv)`` and ``part_lse (n_split, B, H, Lq)`` are
    each split's softmax-normalised output and LSE (``softmax1``'s ``+1`` not
    yet applied: it belongs to the whole row).  ``out = sum_s exp(lse_s -
    lse) out_s`` with ``lse = log sum_s exp(lse_s)``, in split order; a NaN
    split makes the row NaN, splits that saw no key (``lse_s = -inf``) weigh
    nothing, and a row no split saw is empty (zeros, ``-inf``).  A weight
    that underflows to 0 skips its split, so that an Inf value behind it
    leaves no trace, as inside the sweep.  ``sinks (B, H)``: ``softmax1``'s sink
    logits (:func:`~attnnb.cpu._tiles.finish_rows`).  ``sigmoid``'s splits are
    sums: they simply add (``out = sum_s out_s``, the same LSE).
    """
    n_split, H, Lq = part_out.shape[0], part_out.shape[2], part_out.shape[3]
    b, h, i = row // (H * Lq), (row // Lq) % H, row % Lq
    orow = out[b, h, i]
    mx = -np.inf
    for s in range(n_split):
        x = part_lse[s, b, h, i]
        if x != x:
            orow[:] = np.nan
            lse[b, h, i] = np.nan
            return
        mx = max(mx, x)
    orow[:] = 0.0
    if mx == -np.inf:
        lse[b, h, i] = -np.inf
        return
    total = 0.0
    for s in range(n_split):
        total += math.exp(part_lse[s, b, h, i] - mx)
    row_lse = mx + math.log(total)
    for s in range(n_split):
        x = part_lse[s, b, h, i]
        # the split's share: its weight in the merged softmax, or all of it (sigmoid)
        w = 1.0 if normalizer == SIGMOID else math.exp(x - row_lse)
        if x != -np.inf and w != 0.0:
            prow = part_out[s, b, h, i]
            for c in range(orow.shape[0]):
                orow[c] += w * prow[c]
    if normalizer == SOFTMAX1 or normalizer == SOFTPICK:  # softpick's eps is a sink
        sig = sigmoid(row_lse - sinks[b, h])
        for c in range(orow.shape[0]):
            orow[c] *= sig
    lse[b, h, i] = row_lse
