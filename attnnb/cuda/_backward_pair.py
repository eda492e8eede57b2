"""The backward's device functions: the weights and logit gradients of one tile pair.

Both backward kernels (:mod:`attnnb.cuda._backward_kernels`) form, for each
(query tile, key tile) pair, the thread's micro-tile of weights and logit
gradients with what :func:`pair_functions` builds.  Nothing ``(Lq, Lk)`` is
stored: the forward's ``out`` and ``lse`` recompute every weight tile, with
the math of the cpu backward (:mod:`attnnb.cpu.backward`): for one stream,
with ``r`` the row factor (1, or ``sigmoid(lse)`` for ``softmax1``) and ``F``
the ``relu_expm1`` factor of the modified logit ``s'``
(:func:`~attnnb.cuda._micro` ``modify_value``)::

    p = r exp(s' - lse)     w = p F     dp = dO V^T     g = dp - delta
    ds = p g                delta = dO . O - dlse / r   (per row)
    dV += w^T dO    dK += scale ds^T Q    dQ += scale ds K
    dbias = ds      d log key_size += w g

``sigmoid`` (``s' = log sigmoid(x) + log c``, ``F = sigmoid(-x)``) is not
normalised: with ``p = exp(s' - lse)``, the weight over the row's total
``e^lse``, and the row terms ``r = e^lse``, ``delta = -dlse``, ``w = r p``
and ``ds = w (1 - sigmoid(x)) (dP + dlse e^-lse)`` is taken as ``p F (r dP -
delta)``: no ``e^-lse``, which overflows where the weights are all tiny, while
``p`` keeps the ``dlse`` term's scale (``d log key_size += p (r dP - delta)``).
``softpick`` (``s'`` the logit itself, ``F = c``; ``r = D / (D + eps)``, ``D =
e^lse``, its ``delta`` as softmax1's): ``a = r c e^(s - lse)``; above 0 ``w =
a (1 - e^-s)``, ``ds = a g``, ``d log key_size += w g``; below 0 (the
denominator alone) ``ds = a delta`` and ``d log key_size += c (e^s - 1) delta
/ (D + eps)``; a logit of ``-inf`` inside the set still counts there.  Both
run in builds of their own (:func:`attnnb.cuda._micro.own_build`).

Top-k (``selected``): the forward kernel writes each row's selection, one bit a
(query, key) pair in the clip's layout (:func:`attnnb.cuda.topk.topk_selection`),
and the keys whose bit is clear are dropped after the modification, ``s' = -inf``
and ``F = 0``, in every build (the softmax family's and those of a normalizer that
weighs the kept keys its own way): no ranking logit is formed again here, and no
threshold is held in registers.

and for differential attention's two streams (every mode; ``A_c = exp(s_c
- lse_c)``, ``W = A1 - lam A2``, clipped at 0 with ``G = 0`` there when
rectified, else ``G = dp``)::

    d1 = rowsum(G A1)   e = rowsum(G A2)   dlam = -e
    ds1 = A1 (G - d1)   ds2 = -lam A2 (G - e)   dV += W^T dO

(in ``"heaviside"`` mode ``A2`` is replaced by the gate ``H = [A1 - lam A2 > 0]``,
held fixed: ``W = A1 - lam H``, ``e = rowsum(G H)`` and ``ds2 = 0``)

(in ``"difference"`` mode ``d1 = dO . o1`` and ``e = dO . o2``; summing
them over the keys needs no second forward output).  The two-stream path
(``Tiling.streams = 2``) forms both at once; one stream of a pair
(:func:`pair_stream`) runs the one-stream path with row ratio ``r = 1`` or
``r = -lam`` (stream 1's ``p = -lam A2``, so ``ds2`` and ``W``'s second term
come out of it).  The rectified mode's streams ("clipped") gate every
weight by its clip bit, which the differential forward's clip build writes
(one bit a (query, key) pair): where the bit is clear ``w = 0`` and ``g =
-delta``, so ``ds_c = -A_c delta_c`` as above with ``G = 0``.  The Heaviside
mode runs one stream, the first ("gated0"), as a plain stream but for the
weights that reach ``dV`` in the key-tile kernel: where the same bits (its gate
``H``) are set, ``-lam`` is added to them (``W = A1 - lam H``; ``ds1``, ``d1``
and ``dQ`` are the plain stream's).  Its ``e = sum H dp = dO . (H V)`` comes
from the differential forward's clip build, whose output in that mode is ``H
V``; the second stream's ``dQ`` and ``dK`` are zeros.

Dropout (builds of their own, ``dropout=True``, so that the other kernels
carry none of it): each thread forms its rows' keys per tile
(:mod:`attnnb.cuda._dropout`) and the one-stream path scales ``dp`` by the
factor ``z`` (``1 / (1 - p)`` kept, 0 dropped) before ``g = z dp - delta``
and the weights that reach ``dV`` to ``z w``; the key sizes' term stays
``w g``.

Invariants: the functions are built per (dtype, tiling, dropout, mods); the
rows' terms (``row_terms``, three values a row for one stream, five for
two) are laid out as the host's row kernels write them
(:func:`attnnb.cuda._backward_kernels.build_row_terms`, ``build_pair_rows``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .._core.codes import (
    HEAVISIDE,
    RECTIFIED,
    RELU_EXPM1,
    SIGMOID,
    SOFTMAX,
    SOFTPICK,
    SOFTPICK_EPS,
)
from .._core.specialise import specialise
from ._backward_tiling import round_up4
from ._dropout import column_word, kept, row_key
from ._micro import I64, U32, Tiling, micro_functions
from ._tiles import device, unbound

PAIR_VARIANTS = ("stream0", "stream1", "clipped0", "clipped1", "gated0")


def pair_stream(streams: int, variant: str) -> tuple[int, int, bool]:
    """``(head step, head offset, one stream of a pair)`` of a kernel build: stream ``c``
    of score stream pair ``h`` is query head ``2h + c`` (key head ``2g + c``).
    ``"clipped0"`` / ``"clipped1"``: the same streams of the rectified mode, each weight
    gated by the forward's clip bits (:func:`pair_functions`); ``"gated0"``: the
    Heaviside mode's first stream, the bits its gate (the mode's only stream)."""
    if variant in PAIR_VARIANTS:
        return 2, int(variant[-1]), True
    return streams, 0, False


# the globals the templates read, bound per build (pair_constants)
(ZERO, NINF, ONE, EPS, TM, TN, STREAMS, nt, N_S, DROPOUT, N_TERMS, N_TERM_REGS, OWN, OWN_CODE,
 SIGMOID_BUILD, SOFTPICK_BUILD, SCORE_FN, ONE_WORD, ROW_WORD, modify_tile, tile_scores,
 apply_tile_mask, dscores) = unbound(23)


def pair_constants(micro, tiling: Tiling, dropout: bool) -> dict:
    """What the templates below read in one build, by name: the core's build (``micro``,
    :func:`attnnb.cuda._micro.micro_functions`) and the pair's own constants."""
    streams, tm, tn = tiling.streams, tiling.tm, tiling.tn
    n_terms = 3 if streams == 1 else 5  # values a row: lse, r, delta / lse1, lse2, d1, e, lam
    return {
        **micro.bindings, "EPS": micro.bindings["CAST"](SOFTPICK_EPS), "STREAMS": streams,
        "DROPOUT": dropout, "N_TERMS": n_terms,
        "N_TERM_REGS": n_terms * tm,  # (local array sizes must be plain constants)
        # key tiles start at multiples of BK: with BK dividing 32, a tile's keys share a
        # clip word; a micro-tile row's keys start at a multiple of TN: with TN dividing
        # 32, in one word
        "ONE_WORD": 32 % tiling.bk == 0, "ROW_WORD": 32 % tn == 0,
        "dscores": micro.scores_product(round_up4(tiling.dv)),
        "_tag": f"{micro.bindings['_tag']}_pair{int(dropout)}"}


def pair_functions(dtype, tiling: Tiling, dropout=False, mods=None, own=None):
    """Device functions shared by both backward kernels: the weights and logit
    gradients of one (query tile, key tile) pair in the thread's micro-tile
    (with ``dropout``, under the forward's keep decisions; with ``mods``, a problem's
    mask and score functions; ``own``: ``sigmoid``'s or ``softpick``'s build,
    :func:`attnnb.cuda._micro.micro_functions`): ``(pair_registers, load_rows,
    tile_gradients)``, and the build's bindings (for the kernels)."""
    micro = micro_functions(np.dtype(dtype), tiling, mods, own)
    constants = pair_constants(micro, tiling, dropout)
    built = tuple(specialise(fn, constants, constants["_tag"])
                  for fn in (pair_registers, load_rows, tile_gradients))
    return built + ({**constants, **dict(zip(("pair_registers", "load_rows",
                                             "tile_gradients"), built))},)


@device
def drop_unselected(S, F, selection, sel_row, words, row0, j0, key0, nq, Lk):
    """``S = -inf``, ``F = 0`` where the top-k ``selection`` (flat, one bit a pair: row
    ``i`` of the tile at ``sel_row + i``, ``words`` a row; keys past ``Lk`` clear) leaves
    the key of the thread's micro-tile out; rows past ``nq`` are left (not live)."""
    for r in range(TM):
        if row0 + r < nq:
            at = (sel_row + U32(row0 + r)) * words
            j = j0 + key0
            word = U32(0)
            if ROW_WORD and j < Lk:  # one load a row (registers)
                word = selection[at + U32(j >> 5)] >> U32(j & 31)
            for c in range(TN):
                keep = (word >> U32(c)) & U32(1) != U32(0)
                if not ROW_WORD:  # keys of the row in two words: a load a key
                    j = j0 + key0 + c
                    keep = j < Lk and (selection[at + U32(j >> 5)] >> U32(j & 31)) & U32(
                        1) != U32(0)
                if not keep:
                    S[r * TN + c] = NINF
                    F[r * TN + c] = ZERO


@device
def drop_factor(key, j, threshold, keep):
    """The dropout's factor ``z`` of key ``j`` in the row keyed by ``key``: ``keep``
    kept, 0 dropped (1 in a build without dropout)."""
    if not DROPOUT:
        return ONE
    return keep if kept(key, column_word(I64(j)), threshold) else ZERO


@device
def single(S, F, dP, terms, row0, j0, key0, nq, normalizer, clip, clipped, gated, clip_row,
           words, keys, threshold, keep):
    """One stream: ``S`` becomes ``ds``, ``dP`` becomes ``w g`` (a key size's term;
    0 where the weight is), ``F`` the weights that reach the values.  With dropout
    (``keys``: the rows' keys, ``threshold``, ``keep = 1 / (1 - p)``) the factor
    ``z`` (``keep`` or 0) scales ``dP`` before ``g = z dP - delta`` and the weights
    in ``F`` (``z w``).  ``terms``: the rows' ``lse, r, delta``.  Rows past ``nq`` get
    zeros.  ``S``, ``F``:
    the modified logits and their factors.  ``clipped``: a rectified pair's stream,
    ``clip[b, h, i, j // 32]`` bit ``j % 32`` the clip of weight ``(i, j)``; where it
    is clear the weight is 0 and ``g = -delta`` (the clip has derivative 0, the
    stream's softmax still moves the weight's logit); ``clip`` flat, row ``i`` of the
    tile ``clip_row + i`` (``(b * H + h) * Lq + i0``), ``words`` a row.  ``gated``:
    the Heaviside mode's stream, ``clip`` its gate ``H``: the row's ratio weighs the
    gate and the map weighs 1; ``F`` takes ``w + ratio H`` (also where ``p`` is 0:
    the key's value reaches the row through the gate), ``S`` and ``g`` are the plain
    stream's (the key size's term is ``ds``, not ``dP``).  ``sigmoid`` and
    ``softpick``: the module notes."""
    normalizer = OWN_CODE if OWN else normalizer  # (an own build's: a constant)
    sig = SIGMOID_BUILD and normalizer == SIGMOID
    pick = SOFTPICK_BUILD and normalizer == SOFTPICK
    for r in range(TM):
        lse = terms[r]
        ratio = terms[TM + r]
        delta = terms[2 * TM + r]
        gate = ratio
        if gated:
            ratio = ONE
        live = row0 + r < nq and lse != NINF
        bits = U32(0)
        if (clipped or gated) and live and ONE_WORD:  # the tile's keys: one word of the row
            bits = clip[(clip_row + U32(row0 + r)) * words + U32(j0 >> 5)] >> U32(
                (j0 & 31) + key0)
        # softpick: 1 / (D + eps) = ratio e^-lse, the scale of a denominator term below 0
        # (from e^-|lse|: e^lse overflows for logits of 1e4)
        floor = ZERO
        if pick and live:
            t = math.exp(-abs(lse))
            floor = t / (ONE + EPS * t) if lse >= ZERO else ONE / (t + EPS)
        for c in range(TN):
            x = r * TN + c
            s = S[x]  # (top-k's unselected keys: -inf already, tile_gradients)
            w = ZERO
            ds = ZERO
            g = ZERO
            z = ONE
            on = False  # the gate of a gated stream's key
            kg = ZERO  # sigmoid's and softpick's key size term
            if live:
                e = math.exp(s - lse)
                p = e if sig else ratio * e
                if gated:  # the key's gate: set, it weighs the key whatever p is
                    if not ONE_WORD:  # the bit to the position of bit c
                        j = j0 + key0 + c
                        word = clip[(clip_row + U32(row0 + r)) * words + U32(j >> 5)]
                        bits = (word >> U32(j & 31)) << U32(c)
                    on = (bits >> U32(c)) & U32(1) != U32(0)
                if pick:
                    a = p * F[x]  # r c e^(s - lse): both terms' derivative
                    if s > ZERO:
                        if a != ZERO:  # (as p below: a value the row does not weigh)
                            z = drop_factor(keys[r], j0 + key0 + c, threshold, keep)
                            w = a * -math.expm1(-s)
                            g = (dP[x] * z if DROPOUT else dP[x]) - delta
                            ds = a * g
                            kg = w * g
                    elif F[x] != ZERO:  # the denominator's term alone (F = 0: outside
                        # the set; s = 0: no slope; a NaN row stays NaN)
                        ds = a * (delta if s != ZERO else ZERO)
                        kg = F[x] * floor * math.expm1(s) * delta
                # a key the row does not weigh: its value never reaches it
                elif p != ZERO or on:
                    z = drop_factor(keys[r], j0 + key0 + c, threshold, keep)
                    g = dP[x] * z if DROPOUT else dP[x]
                    if sig:  # p = w / e^lse (module notes)
                        g *= ratio
                    g -= delta
                    w = (p * F[x] if normalizer == RELU_EXPM1
                         else p * ratio if sig else p)
                    if clipped:
                        if not ONE_WORD:  # the bit to the position of bit c
                            j = j0 + key0 + c
                            word = clip[(clip_row + U32(row0 + r)) * words + U32(j >> 5)]
                            bits = (word >> U32(j & 31)) << U32(c)
                        if not (bits >> U32(c)) & U32(1):
                            g = -delta
                            w = ZERO
                    ds = p * g
                    if sig:
                        kg = ds
                        ds *= F[x]
            S[x] = ds
            if on:
                w += gate
            F[x] = w * z if DROPOUT else w
            dP[x] = kg if sig or pick else w * g


@device
def pair(S1, S2, dP, W, terms, diff_mode, part1, part2, row0, nq):
    """Two streams: ``S1``, ``S2`` become ``ds1``, ``ds2``, ``dP`` becomes ``G``, ``W``
    (the factors' scratch) the combined weights; ``part1[r] += sum G A1``,
    ``part2[r] += sum G A2`` (the Heaviside ``diff_mode``: ``A2`` the gate ``H``, and
    ``ds2 = 0``).  ``terms``:
    the rows' ``lse1, lse2, d1, e, lam``; ``S1``, ``S2``: the modified logits."""
    gated = diff_mode == HEAVISIDE
    for r in range(TM):
        l1 = terms[r]
        l2 = terms[TM + r]
        d1 = terms[2 * TM + r]
        e = terms[3 * TM + r]
        lam = terms[4 * TM + r]
        valid = row0 + r < nq
        t1 = ZERO
        t2 = ZERO
        for c in range(TN):
            x = r * TN + c
            a1 = ZERO if not valid or l1 == NINF else math.exp(S1[x] - l1)
            a2 = ZERO if not valid or l2 == NINF else math.exp(S2[x] - l2)
            w = a1 - lam * a2
            g = dP[x]
            if gated:  # the gate, held fixed, takes the second map's place
                a2 = ONE if w > ZERO else ZERO
                w = a1 - lam * a2
            # outside both maps nothing flows (a NaN value there stays out); the clip
            # at 0 has derivative 0
            if (a1 == ZERO and a2 == ZERO) or (diff_mode == RECTIFIED and not w > ZERO):
                w = ZERO
                g = ZERO
            t1 += g * a1
            t2 += g * a2
            S1[x] = a1 * (g - d1)
            S2[x] = ZERO if gated else -lam * a2 * (g - e)
            W[x] = w
            dP[x] = g
        part1[r] += t1
        part2[r] += t2


@device
def pair_registers():
    """The thread's register arrays of a pair: ``S1, S2, F, dP`` (micro-tiles) and
    ``terms`` (three or five values a row)."""
    return (cuda.local.array(N_S, nt), cuda.local.array(N_S, nt),
            cuda.local.array(N_S, nt), cuda.local.array(N_S, nt),
            cuda.local.array(N_TERM_REGS, nt))


@device
def load_rows(row_terms, b, h, i0, row0, Lq, terms):
    """``terms[k * TM + r] = row_terms[b, h, k, row i0 + row0 + r]`` (rows past ``Lq``: the
    last)."""
    for r in range(TM):
        ii = min(i0 + row0 + r, Lq - 1)
        for k in range(N_TERMS):
            terms[k * TM + r] = row_terms[b, h, k, ii]


@device
def tile_gradients(Q1, Q2, K1, K2, Ot, Vt, Mt, partial, S1, S2, F, dP, terms,
                   selected, diff_mode, clip, clipped, gated, clip_row, words, part1, part2,
                   i0, row0, j0, key0, nq, Lq, Lk, diag, b, h, bias, has_bias, mask,
                   has_mask, logks, has_ks, normalizer, keys, drop, mods, R):
    """The logits (``Q K^T`` per stream), ``dP = dO V^T`` and the pair's weights and
    logit gradients (:func:`single` or :func:`pair`; the weights in ``F``) from the
    staged transposed tiles; ``Mt``: a partial tile's mask (``partial``); ``clip``,
    ``clipped``, ``gated``: as :func:`single`; ``diff_mode``: as :func:`pair`;
    ``drop``: the dropout's ``(seed_lo, seed_hi, batch0, head0, threshold, keep)``,
    read by a ``dropout`` build, which forms the rows' keys in ``keys``; ``mods``: the
    mods' arrays, a score function's build keeping the raw logits in ``R`` (for
    ``slope_tile``)."""
    if DROPOUT:
        for r in range(TM):
            keys[r] = row_key(drop[0], drop[1], I64(drop[2] + b), I64(drop[3] + h),
                              I64(i0 + row0 + r))
    tile_scores(Q1, K1, row0, key0, S1)
    if STREAMS == 2:
        tile_scores(Q2, K2, row0, key0, S2)
    dscores(Ot, Vt, row0, key0, dP)
    if SCORE_FN:
        for x in range(N_S):
            R[x] = S1[x]
    modify_tile(S1, F, i0, row0, j0, key0, Lq, Lk, diag, b, h, bias, has_bias, mask,
                has_mask, logks, has_ks, normalizer if STREAMS == 1 else SOFTMAX, mods)
    if partial:  # after the score function, which may map -inf to a number
        apply_tile_mask(S1, F, Mt, row0, key0)
    if selected:  # top-k: ``clip`` holds the selection
        drop_unselected(S1, F, clip, clip_row, words, row0, j0, key0, nq, Lk)
    if STREAMS == 1:
        single(S1, F, dP, terms, row0, j0, key0, nq, normalizer, clip, clipped, gated,
               clip_row, words, keys, drop[4], drop[5])
    else:
        modify_tile(S2, F, i0, row0, j0, key0, Lq, Lk, diag, b, h, bias, has_bias, mask,
                    has_mask, logks, has_ks, SOFTMAX, mods)
        pair(S1, S2, dP, F, terms, diff_mode, part1, part2, row0, nq)
