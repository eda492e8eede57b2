"""Top-k selection of one row of logits, and the softmax over the keys it keeps.

:func:`select_row` finds a row's ``top_k`` largest modified logits (ties to
the lower key index) and hands back both the rule the backward pass holds
fixed -- a threshold ``thr`` and a tie cut ``cut``: key ``j`` is kept when
``x > thr``, or ``x == thr`` and ``j <= cut``, or ``x`` is NaN -- and the
kept keys themselves, so that :func:`gather_row` reads only their values.

Every key is touched only by vectorised passes; the scalar work is on a
few times ``top_k`` values.  In order:

1. NaN check (a row holding a NaN keeps everything, to propagate it);
2. the maxima of ``m`` strided groups ``{c, c + m, c + 2m, ...}`` of ``g``
   keys (an element-wise max of ``g`` contiguous runs);
3. a lower bound ``L`` of the row's ``top_k``-th largest logit: any ``L``
   with at least ``top_k`` group maxima ``>= L`` is one (those groups hold
   ``top_k`` distinct keys ``>= L``); bisection between the least and the
   largest finite maximum, each step a vectorised count over the ``m``
   maxima, stops once at most ``top_k + top_k / 8`` maxima pass;
4. the candidates: the keys ``>= L`` of the groups whose maximum is
   ``>= L`` (about ``top_k`` groups), and of the ``n - g m`` keys no group
   holds; every key at or above the row's ``top_k``-th largest is among
   them (short rows take every allowed key);
5. the threshold, the ``top_k``-th largest candidate (:func:`kth_largest`:
   one pass into value buckets, a quickselect among the few values of the
   bucket that holds it), and the tie cut: of the candidates equal to it,
   the ``need``-th lowest index, ``need`` being ``top_k`` minus the count
   above it.

The vectorised passes over the group maxima run over whole chunks of
:data:`CHUNK` values (padded with ``-inf``, which no pass counts): a loop
with a run-time trip count ends in a scalar remainder of up to 63 values.

It replaced two quickselects whose cost was mostly mispredicted branches
(docs/notes/performance.md, "Top-k selection" and "Figures moved out of the code's
comments").
"""

from __future__ import annotations

import numpy as np

from .._core import selection as _selection
from ._blocks import COLS
from ._dropout import drop_listed
from ._exp import exp_shifted_sum_at, maxnum
from ._jit import blocks, inner, wide_vectors
from ._numba_patches.views import flat

u64 = np.uint64
CHUNK = 64  # values per vectorised step (four 512-bit vectors of float32)

# Keys per strided group: at most MAX_GROUP, and at least GROUPS_PER_K * top_k groups
# (fewer groups make a looser bound, more candidates; larger groups scan more keys per
# candidate group), but pairs as long as there are 2 * top_k of them; rows of fewer than
# 4 * top_k keys take every allowed key as a candidate.
MAX_GROUP = 8
GROUPS_PER_K = 4
# Bisection steps for the bound, at most; each halves the interval of group maxima.
BISECT = 14
# Buckets of the threshold's selection among the candidates (kth_largest).
BUCKETS = 64

kth_smallest = inner(_selection.kth_smallest)


@inner
def chunks(n):
    """Whole :data:`CHUNK`-value steps covering ``n`` values."""
    return (n + CHUNK - 1) // CHUNK


@inner
def scratch_size(n):
    """Elements each scratch array of :func:`select_row` needs for rows of ``n`` keys."""
    return max(1, chunks(n)) * CHUNK


@inner
def pad(a, n):
    """``a[n:]`` up to the next whole chunk = ``-inf``; returns the chunks."""
    n = np.int64(n)
    nb = chunks(n)
    a[n : nb * CHUNK] = -np.inf
    return nb


@inner
def has_nan(row, n):
    """True when ``row[:n]`` holds a NaN (vectorised)."""
    wide_vectors()
    nans = np.int32(0)
    nb = u64(n // CHUNK)
    w = u64(CHUNK)
    for b in range(nb):
        o = b * w
        for i in range(w):
            nans += np.int32(row[o + i] != row[o + i])
    for j in range(nb * w, u64(n)):
        nans += np.int32(row[j] != row[j])
    return nans > 0


@inner
def count_at_least(a, nb, t):
    """How many of the ``nb`` chunks of ``a`` are ``>= t``."""
    wide_vectors()
    c = np.int32(0)
    w = u64(CHUNK)
    for b in range(u64(nb)):
        o = b * w
        for i in range(w):
            c += np.int32(a[o + i] >= t)
    return c


@inner
def largest(a, nb):
    """The largest of the ``nb`` chunks of ``a`` (NaN ignored)."""
    wide_vectors()
    mx = a[0]
    w = u64(CHUNK)
    for b in range(u64(nb)):
        o = b * w
        for i in range(w):
            mx = maxnum(mx, a[o + i])
    return mx


@inner
def least_at_least(a, nb, t):
    """The least of the ``nb`` chunks of ``a`` that is ``>= t`` (``+inf`` when none):
    a maxnum reduction of the negated values (a ``min`` reduction does not vectorise)."""
    wide_vectors()
    ninf = a.dtype.type(-np.inf)
    nmn = ninf
    w = u64(CHUNK)
    for b in range(u64(nb)):
        o = b * w
        for i in range(w):
            x = a[o + i]
            nmn = maxnum(nmn, -x if x >= t else ninf)
    return -nmn


@inner
def kth_largest(a, n, k, lo, hi, members, bucket, hist):
    """The ``k``-th largest of ``a[:n]`` (no NaN, ``1 <= k <= n``, every value in
    ``[lo, hi]``, ``hi`` the largest), by one bucket pass and a small quickselect.

    ``BUCKETS`` equal-width buckets over ``[lo, hi]``: a value's bucket is
    ``(x - lo) * scale`` truncated, monotone in ``x``, so each bucket holds a
    range of values and ties share one.  Counting from the top bucket finds
    the one holding the answer; the quickselect then runs among its members
    alone (a few values, unless they cluster).  Each value's bucket is
    computed once and stored in ``bucket`` (recomputing it could round
    differently where the compiler fuses differently); ``members`` (``a``'s
    dtype) and ``bucket`` are scratch of ``n``, ``hist`` of ``BUCKETS``.
    Cheaper than a quickselect over all of them, whose branches mispredict.
    Spans that overflow or are subnormal take
    the quickselect over all values.
    """
    span = hi - lo
    if not span > 0.0:  # every value equal
        return hi
    scale = BUCKETS / span
    if not (span < np.inf and scale < np.inf):
        # a span that overflows, or is subnormal: the bucket index could meet inf * 0
        # (the compiler may also reorder its arithmetic): a quickselect over all
        for x in range(u64(n)):
            members[x] = a[x]
        return kth_smallest(members, np.int64(n), np.int64(n) - k)
    for b in range(BUCKETS):
        hist[b] = 0
    top = BUCKETS - 1
    for x in range(u64(n)):
        # monotone in a[x] however the compiler arranges it, with a finite span
        y = (a[x] - lo) * scale
        b = min(np.int64(y), top) if y < BUCKETS else top
        bucket[x] = b
        hist[b] += 1
    above = 0
    b = top
    while above + hist[b] < k:
        above += hist[b]
        b -= 1
    cnt = u64(0)
    for x in range(u64(n)):  # the members of bucket b
        members[cnt] = a[x]
        cnt += u64(bucket[x] == b)
    c = np.int64(cnt)
    return kth_smallest(members, c, c - (k - above))


@inner
def group_maxima(row, g, m, gmax):
    """``gmax[c] = max(row[c + i * m] for i < g)`` for ``c < m``, padded with ``-inf``;
    returns ``(chunks of gmax, least finite maximum, largest maximum, count of maxima
    > -inf)``.

    ``row`` must hold no NaN.  With no maximum above ``-inf`` the least is ``+inf``.
    """
    wide_vectors()
    um = u64(m)
    for c in range(um):
        gmax[c] = row[c]
    for i in range(u64(1), u64(g)):
        o = i * um
        for c in range(um):
            gmax[c] = maxnum(gmax[c], row[o + c])
    mb = pad(gmax, m)
    lowest = row.dtype.type(-np.finfo(row.dtype).max)  # x >= lowest: x > -inf
    mn = least_at_least(gmax, mb, lowest)
    return mb, mn, largest(gmax, mb), count_at_least(gmax, mb, mn)


@inner
def group_bound(gmax, mb, top_k, lo, hi, mid):
    """A value ``L`` in ``[lo, hi]`` with at least ``top_k`` of the ``mb`` chunks of
    ``gmax`` ``>= L``.

    ``lo`` must have that property (the least finite maximum, when at least
    ``top_k`` are finite), ``hi`` is the largest.  Bisection keeps it for
    ``lo`` and stops early once at most ``top_k + top_k / 8`` maxima pass;
    ``mid`` is a one-element scratch in the row's dtype (the midpoint is
    rounded there, so that every comparison is in that dtype).
    """
    if count_at_least(gmax, mb, hi) >= top_k:  # ties at the largest maximum
        return hi
    slack = top_k + (top_k >> 3)
    for _ in range(BISECT):
        mid[0] = lo * 0.5 + hi * 0.5  # halves first: no overflow at +-max
        t = mid[0]
        c = count_at_least(gmax, mb, t)
        if c >= top_k:
            lo = t
            if c <= slack:
                break
        else:
            hi = t
    return lo


@inner
def select_row(row, n, top_k, gmax, cval, cidx, ftmp, itmp, hist):
    """Top-k selection of one row of ``n`` modified logits (``-inf`` = not allowed).

    Returns ``(thr, cut, cnt)``; ``cval[:cnt]``, ``cidx[:cnt]`` are the kept
    keys' logits and indices (in no particular order).  Key ``j`` is kept
    when ``row[j] > thr``, or ``row[j] == thr and j <= cut``, or ``row[j]``
    is NaN: exactly ``top_k`` keys when more than ``top_k`` are allowed,
    ties to the lower index.  With at most ``top_k`` allowed keys every one
    is kept (``thr = -inf``, ``cut = -1``); ``top_k = 0`` keeps nothing
    (``thr = +inf``); a row holding a NaN keeps everything (``cut = n``,
    ``cnt = -1``: no list) so that the NaN propagates.

    Scratch of :func:`scratch_size` ``(n)`` elements each: ``gmax``, ``cval``
    and ``ftmp`` in the row's dtype, ``cidx`` and ``itmp`` int64; ``hist``
    int64 of ``BUCKETS``.  See the module docstring.
    """
    ninf = row.dtype.type(-np.inf)
    if has_nan(row, n):
        return ninf, n, -1
    if top_k == 0:
        return -ninf, -1, 0
    g = min(MAX_GROUP, max(n // (GROUPS_PER_K * top_k), 2 if n >= 4 * top_k else 0))
    bounded = False
    lower = ninf
    hi = ninf
    if g >= 2:
        m = n // g
        mb, lo, hi, finite = group_maxima(row, g, m, gmax)
        if finite >= top_k:
            bounded = True
            lower = group_bound(gmax, mb, top_k, lo, hi, ftmp)
    cnt = u64(0)
    if bounded:
        um = u64(m)
        ng = u64(0)
        for c in range(um):  # the groups holding candidates, compacted without a branch
            itmp[ng] = c
            ng += u64(gmax[c] >= lower)
        for t in range(ng):
            c = u64(itmp[t])
            for i in range(u64(g)):
                j = c + i * um
                x = row[j]
                cval[cnt] = x
                cidx[cnt] = j
                cnt += u64(x >= lower)
        for j in range(u64(g) * um, u64(n)):  # the keys no group holds
            x = row[j]
            cval[cnt] = x
            cidx[cnt] = j
            cnt += u64(x >= lower)
            hi = max(hi, x)
    else:  # every allowed key is a candidate
        lower = -ninf
        for j in range(u64(n)):
            x = row[j]
            cval[cnt] = x
            cidx[cnt] = j
            cnt += u64(x > ninf)
            lower = min(lower, x) if x > ninf else lower
            hi = max(hi, x)
        if np.int64(cnt) <= top_k:
            return ninf, -1, np.int64(cnt)
    # cnt >= top_k: the bound's groups hold top_k distinct candidates, all >= lower
    thr = kth_largest(cval, cnt, top_k, lower, hi, ftmp, itmp, hist)
    need = np.int64(top_k)  # minus the keys above the threshold: kept at the threshold
    ties = u64(0)
    for x in range(cnt):  # the indices at the threshold; usually exactly one
        itmp[ties] = cidx[x]
        ties += u64(cval[x] == thr)
        need -= np.int64(cval[x] > thr)
    cut = itmp[0] if ties == u64(1) else kth_smallest(itmp, np.int64(ties), need - 1)
    kept = u64(0)
    for x in range(cnt):  # compact the candidates to the kept keys
        s = cval[x]
        j = cidx[x]
        cval[kept] = s
        cidx[kept] = j
        kept += u64((s > thr) | ((s == thr) & (j <= cut)))
    return thr, cut, np.int64(kept)


@blocks
def _weighted_rows(p, cnt, vflat, idx, dv, c0, blk):
    """``blk[c] = sum_x p[x] * vflat[idx[x] * dv + c0 + c]`` for ``c < COLS``.

    ``COLS`` value columns of the ``cnt`` value rows ``idx``: a constant
    width, so that LLVM keeps ``blk`` in registers for the whole sum (the
    ``noalias`` flag: ``blk`` overlaps neither input).
    """
    wide_vectors()
    w = u64(COLS)
    for c in range(w):
        blk[c] = 0.0
    udv = u64(dv)
    uc0 = u64(c0)
    for x in range(u64(cnt)):
        px = p[x]
        o = u64(idx[x]) * udv + uc0
        for c in range(w):
            blk[c] += px * vflat[o + c]


@inner
def gather_row(r, cval, cidx, cnt, vh, m, l, acc, pbuf, blk, dropout, key):
    """Softmax of row ``r`` over the ``cnt`` keys :func:`select_row` kept.

    Sets the task's state for :func:`~attnnb.cpu._tiles.finish_rows`:
    ``m[r]`` (the largest kept logit; ``-inf`` when none is kept, NaN for a
    row holding a NaN, ``cnt < 0``), ``l[r] = sum exp(s - m)`` and ``acc[r]
    = sum exp(s - m) * vh[j]`` over the kept keys, reading one value row
    each: ``O(top_k Dv)``.  Keys whose weight underflows to 0 are dropped
    first, so that their values leave no trace even when Inf or NaN (as in
    the tiled sweep).  ``acc[r]`` starts at zero; ``pbuf`` and ``blk`` are
    scratch of :func:`scratch_size` ``(cnt)`` and ``COLS`` values;
    ``cval`` is padded and ``cidx[:cnt]`` reordered.  With ``dropout``
    (:func:`attnnb.cpu._dropout.kernel_dropout`; ``key`` the row's key) the
    dropped keys' weights leave the list after the sum, so that the LSE is
    that of the weights before dropout.
    """
    if cnt < 0:
        m[r] = np.nan
        return
    if cnt == 0:
        m[r] = -np.inf
        return
    cb = pad(cval, cnt)
    mx = largest(cval, cb)
    m[r] = mx
    # the padding's weights are exactly 0 and add nothing to the sum
    l[r] = exp_shifted_sum_at(cval, 0, pbuf, 0, mx, cb * CHUNK)
    n = u64(cnt)
    tiny = pbuf.dtype.type(np.finfo(pbuf.dtype).tiny)
    dropped = drop_listed(pbuf, cidx, cnt, dropout, key)
    if dropped or count_at_least(pbuf, cb, tiny) < cnt:  # weights that are 0 (or subnormal)
        n = u64(0)
        for x in range(u64(cnt)):
            pbuf[n] = pbuf[x]
            cidx[n] = cidx[x]
            n += u64(pbuf[x] != 0.0)
    a = acc[r]
    dv = a.shape[0]
    vflat = flat(vh)
    full = dv - dv % COLS
    for c0 in range(0, full, COLS):
        _weighted_rows(pbuf, n, vflat, cidx, dv, c0, blk)
        for c in range(COLS):
            a[c0 + c] += blk[c]
    for x in range(n):  # the last dv % COLS columns
        px = pbuf[x]
        vj = vh[cidx[x]]
        for c in range(full, dv):
            a[c] += px * vj[c]


@inner
def select_tile(R, j0, nk, thr, cut, S, copy):
    """``S = -inf`` on keys ``j0 .. j0 + nk - 1`` that :func:`select_row`'s ``(thr, cut)``
    does not select among the ranked logit rows ``R``; on the selected ones ``S`` gets
    ``R``'s logits (``copy``), or keeps its own (another normalizer's, formed anew)."""
    nq = S.shape[0]
    ninf = -np.inf
    for r in range(nq):
        t = thr[r]
        c = cut[r] - j0
        src = R[r, j0 : j0 + nk]
        dst = S[r]
        for x in range(nk):  # branch-free, so that it vectorises
            s = src[x]
            keep = (s > t) | (s != s) | ((s == t) & (x <= c))
            dst[x] = (s if copy else dst[x]) if keep else ninf
