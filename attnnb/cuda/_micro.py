"""The register-tiled core of the CUDA kernels: many threads per query row.

A block of ``NT = (BQ / TM) * (BK / TN)`` threads owns a tile of ``BQ``
query rows.  Thread ``(ty, tx)`` (``t = ty * NX + tx``, ``NX = BK / TN``)
owns rows ``ty * TM ... + TM`` of the tile and, per key tile of ``BK`` keys,
a ``TM x TN`` register micro-tile of ``S = Q K^T`` (keys ``tx * TN ... +
TN``) and a ``TM x TO`` micro-tile of ``O += P V`` (value columns ``tx * TO
... + TO``, ``TO = ceil(Dv / NX)``).  The ``NX`` threads of a row reduce its
maximum through shared memory (warp shuffles do not run under the
simulator); each keeps its own partial sum ``l``, reduced once at the end.

Shared memory, flat 1-D arrays indexed with unsigned 32-bit offsets (no
negative-index wrap-around, so NVVM merges neighbouring loads into
``ld.shared.v4``): ``Qt`` (``Dp x BQ``, transposed, pre-scaled), one buffer
``KV`` that holds the key tile transposed (``Dp x BK``) and then the value
tile (``BK x Dvp``), ``Pt`` (``BK x BQ``, the weights, transposed) and the
row reduction (``BQ x NX`` and ``BQ``).  Rows, keys and columns past the
ends are staged as zeros (keys past ``Lk`` are then masked), so the micro
tiles need no bounds tests.  Register arrays are indexed only by unrolled
constants (``range`` over closure constants), so they stay in registers
(``gpu/ptx_check.py`` checks: no stack frame, no spill).

Numerics are those of the cpu core (:mod:`attnnb.cpu._tiles`):
bias, then mask / causal / key bound to ``-inf``, ``relu_expm1``'s factor
(tiny factors folded into the logit), ``log key_size``; a NaN logit spoils
its row; zero weights never touch the values (a tile holding a non-finite
value takes a guarded product); the tile's ``P V`` is summed on its own
before ``O = O * alpha + P V``, and ``alpha = 0`` clears ``O``.

``sigmoid`` and ``softpick`` run the same sweep, not the cpu core's own
loops: ``sigmoid``'s logit becomes ``log sigmoid(s)``, so that the running
maximum keeps the weights' scale for any logits and the row's ``lse`` is
exact where ``sigmoid(s)`` itself underflows (the finish multiplies by
``e^m`` instead of dividing); ``softpick`` sums its numerators into ``O``
and its denominator's terms into ``l`` under a maximum of at least 0.  Each
has kernel builds of its own (:func:`own_build`): the others carry none of
their code, nor its registers.

:func:`micro_functions` builds the device functions for one compute dtype and
:class:`Tiling`; the kernels (dense, and the variants) are thin sweeps over
them.  The device functions are templates (:func:`device`): module-level Python
functions whose constants (the dtype's, the tiling's, the build's mods and
normalizer) are global names, bound per build by
:func:`attnnb._core.specialise.specialise` (:func:`build_constants` lists them);
``numba.cuda`` reads a global as a compile-time constant, as it reads a closure cell,
so the register arrays keep constant sizes.
"""

from __future__ import annotations

import math
import re
from functools import cache
from types import SimpleNamespace
from typing import NamedTuple

import numba
import numpy as np
from numba import config, cuda

from .._core.codes import NORMALIZER_CODES, RELU_EXPM1, SIGMOID, SOFTPICK
from .._core.specialise import specialise
from ._dropout import column_word, kept, row_key
from ._tiles import SHARED_BYTES, cached_kernel, device, device_functions, unbound

U32 = numba.uint32
I64 = numba.int64  # the dropout generator's words are computed in 64-bit integers
ALIGN = None if config.ENABLE_CUDASIM else 16  # the simulator takes no alignment
_NORMALIZER_NAMES = {code: name for name, code in NORMALIZER_CODES.items()}


class Tiling(NamedTuple):
    """Compile-time tile sizes of a register-tiled kernel.

    ``bq`` query rows and ``bk`` keys per tile; each thread owns ``tm`` rows
    and ``tn`` keys of ``S``; ``d`` / ``dv`` are the head sizes; ``streams``
    query / key tiles are staged side by side (2: differential attention).
    """

    bq: int
    bk: int
    tm: int
    tn: int
    d: int
    dv: int
    streams: int = 1

    @property
    def nx(self) -> int:
        """Threads per row."""
        return self.bk // self.tn

    @property
    def threads(self) -> int:
        return (self.bq // self.tm) * self.nx

    @property
    def to(self) -> int:
        """Value columns per thread."""
        return -(-self.dv // self.nx)

    @property
    def dp(self) -> int:
        """``d`` padded to a multiple of 4 (whole wide loads)."""
        return -(-self.d // 4) * 4

    def shared_parts(self) -> tuple[int, ...]:
        """Lengths of ``Qt, KV, Pt, red, rows, flag`` (multiples of 4: aligned starts).

        ``Qt`` holds ``streams`` query tiles and ``KV`` ``streams`` key tiles
        (or the value tile), each stream's part at a multiple of 4.
        """
        kv = max(self.streams * self.dp * self.bk, self.bk * self.to * self.nx)
        return tuple(-(-n // 4) * 4 for n in (
            self.streams * self.dp * self.bq, kv, self.bk * self.bq, self.bq * self.nx,
            self.bq, 1))

    def shared_elements(self) -> int:
        return sum(self.shared_parts())


# production tilings (float32 on sm_90: see gpu/RESULTS.md), by the largest head size
_PRODUCTION = ((64, (64, 32, 4, 2)), (128, (32, 32, 2, 2)))
_OVERRIDE: list = [None]


def set_micro_tiles(tiles: tuple[int, int, int, int] | None):
    """Force ``(bq, bk, tm, tn)`` for every register-tiled kernel (tests); returns the old one.

    ``None`` restores the production choice.  ``tm`` must divide ``bq`` and
    ``tn`` divide ``bk``.
    """
    if tiles is not None:
        bq, bk, tm, tn = tiles
        if min(tiles) < 1 or bq % tm or bk % tn:
            raise ValueError(f"micro tiles (bq, bk, tm, tn) must have tm | bq and tn | bk; "
                             f"got {tiles!r}")
    old, _OVERRIDE[0] = _OVERRIDE[0], tiles
    return old


def own_build(normalizer: str):
    """The normalizer code compiled into a problem's kernels: ``sigmoid`` and ``softpick``
    have builds of their own (their code in every build would cost the others registers,
    past the PTX gate's limit in the backward); None for the softmax family, whose one
    build reads the code from a kernel argument."""
    code = NORMALIZER_CODES[normalizer]
    return code if code in (SIGMOID, SOFTPICK) else None


def kernel_label(name: str, dropout: bool = False, mods=None, own=None) -> str:
    """A kernel build's name: ``name``, ``-dropout``, its mods' tag
    (:class:`attnnb.cuda._mods.DeviceMods`) and its own normalizer (:func:`own_build`),
    so that each build is cached apart."""
    return (name + ("-dropout" if dropout else "") + ("" if mods is None else "-" + mods.tag)
            + ("" if own is None else "-" + _NORMALIZER_NAMES[own]))


def tiled_kernel(name: str, build, dtype, tiling: Tiling):
    """The compiled-on-first-launch kernel ``build(dtype, tiling)``, cached per
    ``(name, dtype, tiling)``."""
    key = (name, np.dtype(dtype).str, tiling)
    return cached_kernel(key, lambda: cuda.jit(build(np.dtype(dtype), tiling)))


def ptx_cases(label: str, build, argtypes, d: int, dv: int, streams: int = 1,
              tiles=None, variant: bool = False) -> list:
    """``[(name, python function, argument types, options)]`` of a register-tiled kernel
    for the PTX check: float32 (gated) and float64, production tiles at ``d``, ``dv``.

    ``argtypes(ty)`` gives the kernel's argument types for the Numba float type ``ty``;
    ``tiles(dtype, d, dv, streams)`` the tiling (default :func:`tiling_for`).
    ``variant``: a build of a kernel whose plain build is listed too (another head size,
    dropout, mods, a normalizer or mode); its float64 case is marked ``"variant"``, which
    the check compiles only when asked for every float64 build (its float32 case, the
    same code, is always compiled and gated).
    """
    cases = []
    for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        tiling = (tiles or tiling_for)(dtype, d, dv, streams)
        size = f"D={d}" if d == dv else f"d={d}"  # d: the score depth, values wider
        cases.append((f"{label} {dtype.name} {size}",
                      build(dtype, tiling), argtypes(numba.from_dtype(dtype)),
                      {"threads": tiling.threads, "tiled": True,
                       "variant": variant and dtype == np.float64}))
    return cases


def tiling_for(dtype, d: int, dv: int, streams: int = 1, elements=Tiling.shared_elements,
               production=_PRODUCTION) -> Tiling:
    """The tiling of a kernel for a compute dtype, head sizes ``d``, ``dv`` and
    ``streams`` score streams.

    The ``production`` tiles of the head size (the next listed size up) shrink,
    key tile first, until ``elements(tiling)`` shared values fit in 48 KiB
    (the forward's arrays by default; the backward passes its own).
    """
    if _OVERRIDE[0] is not None:
        return Tiling(*_OVERRIDE[0], d, dv, streams)
    width = max(d, dv)
    bq, bk, tm, tn = next((t for w, t in production if width <= w), production[-1][1])
    itemsize = np.dtype(dtype).itemsize
    while True:
        tiling = Tiling(bq, bk, tm, tn, d, dv, streams)
        if elements(tiling) * itemsize <= SHARED_BYTES:
            return tiling
        if bk > tn * 2:
            bk //= 2
        elif bq > tm * 2:
            bq //= 2
        else:
            raise ValueError(f"head sizes d={d}, dv={dv} are too large for the cuda backend: "
                             f"the smallest tiles need more than {SHARED_BYTES} bytes of "
                             f"shared memory")


# the globals the templates read, bound per build (build_constants) or per instance
(nt, CAST, ZERO, ONE, NINF, NAN, F_FOLD, BQ, BK, TM, TN, DV, NX, NT, TO, DP, DVP, O_KV, O_P,
 O_RED, O_ROWS, O_FLAG, N_ALL, N_S, N_O, OWN, OWN_CODE, SIGMOID_BUILD, SOFTPICK_BUILD, SCORE_FN,
 MASK_FN, mod_value, mod_slope, mod_allowed, index, map_lse, finish_value, DEPTH, ROWS, LD,
 ZN, NA, NB, GUARDED, SDEPTH, PSTEPS, PLDA, PLDB, STORE, score_step, plain_step,
 safe_step, tiles_seen, N_QS, N_KS) = unbound(55)


@device
def shared_arrays(smem):
    """``(Qt, KV, Pt, red, rows, flag)``: the block's shared arrays (module notes), parts
    of the one array a kernel declares (``cuda.shared.array(N_ALL, nt, alignment=ALIGN)``)."""
    return (smem[:O_KV], smem[O_KV:O_P], smem[O_P:O_RED], smem[O_RED:O_ROWS],
            smem[O_ROWS:O_FLAG], smem[O_FLAG:])


@device
def thread_place():
    """``(t, row0, key0, col0)``: the thread and the first row / key / value column
    it owns in the tile (signed; shared offsets convert them to unsigned)."""
    t = cuda.threadIdx.x
    ty = t // NX
    tx = t - ty * NX
    return t, ty * TM, tx * TN, tx * TO


@device
def stage_transposed(src, j0, n, scale, dst, width):
    """``dst[e * width + r] = scale * src[j0 + r, e]`` for the ``width`` rows of a tile and
    ``DEPTH`` columns (zeros past ``n`` rows and past the source's columns);
    block-cooperative.  Bound with ``DEPTH = DP``: the kernels' queries and keys."""
    cols = src.shape[1]
    for e in range(cuda.threadIdx.x, width * DEPTH, NT):
        r = e // DEPTH
        c = e - r * DEPTH
        x = ZERO
        if r < n and c < cols:
            x = CAST(src[j0 + r, c]) * scale
        dst[U32(c * width + r)] = x


@device
def stage_values(src, j0, n, dst):
    """``dst[r * LD + c] = src[j0 + r, c]`` for ``ROWS`` rows (zeros past ``n`` rows and
    past the source's columns); returns True when this thread staged a non-finite
    value.  Block-cooperative.  Bound with ``ROWS = BK``, ``LD = DVP``: a value tile."""
    cols = src.shape[1]
    bad = False
    for e in range(cuda.threadIdx.x, ROWS * LD, NT):
        r = e // LD
        c = e - r * LD
        x = ZERO
        if r < n and c < cols:
            x = CAST(src[j0 + r, c])
            if x - x != ZERO:
                bad = True
        dst[U32(r * LD + c)] = x
    return bad


@device
def clear(a, n):
    for x in range(n):
        a[x] = ZERO


@device
def fresh_pair():
    """Two new register arrays of ``ZN`` zeros (a constant size; a device function may
    return local arrays in a tuple only)."""
    a = cuda.local.array(ZN, nt)
    b = cuda.local.array(ZN, nt)
    clear(a, ZN)
    clear(b, ZN)
    return a, b


@device
def outer_step(A, ao, B, bo, R):
    """``R[x * NB + y] += A[ao + x] * B[bo + y]``: one rank-1 step of an ``NA x NB``
    micro-tile (``GUARDED``: a zero ``A`` value skips its ``B`` values, which may be
    non-finite)."""
    a = cuda.local.array(NA, nt)
    w = cuda.local.array(NB, nt)
    for x in range(NA):
        a[x] = A[ao + U32(x)]
    for y in range(NB):
        w[y] = B[bo + U32(y)]
    for x in range(NA):
        for y in range(NB):
            if GUARDED:
                R[x * NB + y] += a[x] * (w[y] if a[x] != ZERO else ZERO)
            else:
                R[x * NB + y] += a[x] * w[y]


@device
def tile_scores(A, B, row0, key0, S):
    """``S[r * TN + c] = sum_d A[d, row0 + r] * B[d, key0 + c]`` over ``SDEPTH`` (a
    multiple of 4) rows of ``A`` (``SDEPTH x BQ``) and ``B`` (``SDEPTH x BK``): the
    logits ``Q K^T`` and, in the backward, ``dO V^T`` (``score_step``: a ``TM x TN``
    :func:`outer_step`)."""
    clear(S, TM * TN)
    for d0 in range(0, SDEPTH, 4):
        for u in range(4):
            score_step(A, U32(d0 + u) * U32(BQ) + U32(row0),
                       B, U32(d0 + u) * U32(BK) + U32(key0), S)


@device
def values_product(A, ao, B, bo, guarded, R):
    """``R[x * nb + y] += sum_k A[k * PLDA + ao + x] * B[k * PLDB + bo + y]`` over
    ``PSTEPS`` rows of both (shared) operands (``plain_step`` and ``safe_step``: the
    ``na x nb`` :func:`outer_step`, unguarded and guarded).

    ``guarded`` (an operand tile holding a non-finite value): zero ``A``
    values skip their ``B`` values, so a key outside a row's set never
    reaches it.  The forward's ``P V`` and the backward's ``P^T dO``,
    ``dS^T Q`` and ``dS K``.
    """
    for k0 in range(0, PSTEPS, 2):
        for u in range(2):  # two rows a step: longer straight runs for the scheduler
            if k0 + u < PSTEPS:
                pa = U32(k0 + u) * U32(PLDA) + U32(ao)
                pb = U32(k0 + u) * U32(PLDB) + U32(bo)
                if guarded:
                    safe_step(A, pa, B, pb, R)
                else:
                    plain_step(A, pa, B, pb, R)


@device
def key_allowed(i, j, Lk, diag, b, h, mask, has_mask, mods):
    """Whether key ``j`` is in row ``i``'s set: before ``Lk`` and the causal limit,
    and allowed by the mask array and the mask function (``mods``: their arrays,
    ``mods[0]`` the origin; row ``i`` a real row, ``< Lq``)."""
    if j >= Lk or j > i + diag:
        return False
    if has_mask and not mask[index(b, mask.shape[0]), index(h, mask.shape[1]),
                             index(i, mask.shape[2]), index(j, mask.shape[3])]:
        return False
    if MASK_FN:  # (a constant: a build without the function has none of this)
        if not mod_allowed(b + mods[0][0], h + mods[0][1], i, j, mods):
            return False
    return True


@device
def log_sigmoid(x):
    """``(log sigmoid(x), sigmoid(-x))``: ``-log1p(e^-|x|)`` (plus ``x`` below 0) and
    ``-expm1`` of it, exact where ``sigmoid(-x)`` is tiny; no overflow, ``(0, 0)`` at
    ``+inf``, ``(-inf, 1)`` at ``-inf``, NaN at NaN."""
    ls = -math.log1p(math.exp(-abs(x)))
    if x < ZERO:
        ls += x
    return ls, -math.expm1(ls)


@device
def modify_value(s, i, j, Lk, diag, b, h, bias, has_bias, mask, has_mask, logks, has_ks,
                 normalizer, mods):
    """``(s, f)``: one modified logit and its factor ``f``, as the cpu core's
    ``modify_logits`` (a key outside the set, :func:`key_allowed`: ``(-inf, 0)``).
    The score function comes first, then the bias, the normalizer's factor, the
    key sizes.

    ``f`` is 1 but for ``relu_expm1`` (``1 - e^-s``, the weight's factor),
    ``sigmoid`` (``s`` becomes ``log sigmoid(s)``, swept as softmax's logits are, and
    ``f = sigmoid(-s)``, the backward's factor) and ``softpick`` (``s`` stays, the
    key size ``c`` goes to ``f`` instead of ``log c`` to ``s``).
    """
    normalizer = OWN_CODE if OWN else normalizer
    if not key_allowed(i, j, Lk, diag, b, h, mask, has_mask, mods):
        return NINF, ZERO
    if SCORE_FN:
        s = CAST(mod_value(s, b + mods[0][0], h + mods[0][1], i, j, mods))
    f = ONE
    if has_bias:
        s += CAST(bias[index(b, bias.shape[0]), index(h, bias.shape[1]),
                       index(i, bias.shape[2]), index(j, bias.shape[3])])
    if normalizer == RELU_EXPM1:
        if s > ZERO:
            f = -math.expm1(-s)
            if f < F_FOLD:  # tiny: fold into the logit so the maximum follows the weight
                s += math.log(f)
                f = ONE
        else:
            f = ZERO
            if s == s:
                s = NINF
    elif SIGMOID_BUILD and normalizer == SIGMOID:  # log sigmoid(s): for the online sum
        s, f = log_sigmoid(s)
    if has_ks:
        lks = CAST(logks[index(b, logks.shape[0]), index(j, logks.shape[1])])
        if SOFTPICK_BUILD and normalizer == SOFTPICK:  # the sign counts: c is a factor
            f = math.exp(lks)
        else:
            s += lks
    return s, f


@device
def row_reduce(red, rows, t, row0, key0, part, out, take_max):
    """``out[r]`` = the max (NaN if any is NaN) or the sum over the ``NX`` threads of
    row ``row0 + r`` of their ``part[r]``.  Every thread must call it."""
    tx = U32(key0 // TN)
    for r in range(TM):
        red[(U32(row0) + U32(r)) * U32(NX) + tx] = part[r]
    cuda.syncthreads()
    if t < BQ:
        acc = red[U32(t) * U32(NX)]
        for x in range(1, NX):
            y = red[U32(t) * U32(NX) + U32(x)]
            if take_max:
                acc = y if (y > acc or y != y) and acc == acc else acc
            else:
                acc += y
        rows[U32(t)] = acc
    cuda.syncthreads()
    for r in range(TM):
        out[r] = rows[U32(row0) + U32(r)]
    cuda.syncthreads()  # rows / red are reused by the next call


@device
def modify_tile(S, F, i0, row0, j0, key0, Lq, Lk, diag, b, h, bias, has_bias, mask,
                has_mask, logks, has_ks, normalizer, mods):
    """:func:`modify_value` over the thread's micro-tile of ``S`` (key tile at ``j0``);
    ``F``: the factors (:func:`modify_value`'s; not ``S`` itself)."""
    for r in range(TM):
        i = min(i0 + row0 + r, Lq - 1)  # rows past Lq: read a real row, not kept
        for c in range(TN):
            s, fr = modify_value(S[r * TN + c], i, j0 + key0 + c, Lk, diag, b, h, bias,
                                 has_bias, mask, has_mask, logks, has_ks, normalizer, mods)
            S[r * TN + c] = s
            F[r * TN + c] = fr


@device
def key_tile_logits(kh, j0, nk, Qt, KV, S, F, i0, row0, key0, Lq, Lk, diag, b, h, bias,
                    has_bias, mask, has_mask, logks, has_ks, normalizer, mods):
    """Stage the key tile at ``j0`` (``nk`` keys of ``kh``) in ``KV``, then the
    thread's micro-tile of modified logits ``S`` (factors ``F``) against the staged
    queries ``Qt``.  Every thread must call it; a barrier must follow before ``KV``
    is staged again."""
    stage_transposed(kh, j0, nk, ONE, KV, BK)
    cuda.syncthreads()
    tile_scores(Qt, KV, row0, key0, S)
    modify_tile(S, F, i0, row0, j0, key0, Lq, Lk, diag, b, h, bias, has_bias, mask,
                has_mask, logks, has_ks, normalizer, mods)


@device
def slope_tile(dS, R, i0, row0, j0, key0, Lq, Lk, b, h, mods):
    """``dS *= d score / d s`` at the raw logits ``R`` over the thread's micro-tile: the
    logit gradients through the score function (a zero ``ds``, outside the set or
    past the ends, stays zero whatever the slope there)."""
    if SCORE_FN:
        for r in range(TM):
            i = min(i0 + row0 + r, Lq - 1)
            for c in range(TN):
                x = r * TN + c
                if dS[x] != ZERO:
                    dS[x] *= CAST(mod_slope(R[x], b + mods[0][0], h + mods[0][1], i,
                                            min(j0 + key0 + c, Lk - 1), mods))


@device
def thread_max(S, part):
    """``part[r]`` = the maximum of the thread's logits of row ``r`` (NaN if any is)."""
    for r in range(TM):
        mx = NINF
        for c in range(TN):
            s = S[r * TN + c]
            if (s > mx or s != s) and mx == mx:
                mx = s
        part[r] = mx


@device
def store_tile(W, Pt, row0, key0):
    """``Pt[key0 + c, row0 + r] = W[r, c]``: the thread's weights, transposed."""
    for r in range(TM):
        for c in range(TN):
            Pt[(U32(key0) + U32(c)) * U32(BQ) + U32(row0) + U32(r)] = W[r * TN + c]


@device
def softpick_terms(s, c, mx, floor):
    """``(numerator, denominator term)`` of softpick's key of logit ``s`` and size ``c``
    in units of ``e^mx`` (``floor = e^-mx``, ``mx >= max(s, 0)``): ``c e^-mx max(e^s -
    1, 0)`` and ``c e^-mx |e^s - 1|``, each from ``expm1`` (no cancellation near 0)."""
    if s > ZERO:
        u = c * math.exp(s - mx) * -math.expm1(-s)
        return u, u
    return ZERO, c * floor * -math.expm1(s)  # (a NaN logit: NaN, and its row NaN)


@device
def tile_weights(S, F, m, l, alpha, tmax, normalizer, Pt, row0, key0):
    """Fold a tile's maxima ``tmax`` into the running ``m``; ``S`` becomes the
    weights ``p`` (to ``Pt``, transposed, when ``STORE``), ``l = l * alpha + sum p``
    (this thread's keys); ``alpha[r]``.  ``softpick``: ``m`` is at least 0, ``p``
    its numerators and ``l`` sums its denominator's terms (:func:`softpick_terms`;
    ``F`` the key sizes, 0 outside the row's set).  Bound twice: ``tile_weights``
    (``STORE``) and ``tile_sums`` (the sums alone)."""
    normalizer = OWN_CODE if OWN else normalizer
    pick = SOFTPICK_BUILD and normalizer == SOFTPICK
    for r in range(TM):
        mo = m[r]
        mx = tmax[r]
        if pick and mx < ZERO:  # e^-m <= 1: no term overflows
            mx = ZERO
        a = ONE
        live = False
        if mo != mo or mx != mx:
            m[r] = NAN
        else:
            if mo > mx:
                mx = mo
            if mx != NINF:
                a = math.exp(mo - mx)
                live = True
            m[r] = mx
        alpha[r] = a
        floor = math.exp(-mx) if pick else ZERO
        tot = ZERO
        for c in range(TN):
            p = ZERO
            if live:
                if pick:
                    p, term = softpick_terms(S[r * TN + c], F[r * TN + c], mx, floor)
                    tot += term
                else:
                    p = math.exp(S[r * TN + c] - mx)
                    if normalizer == RELU_EXPM1:
                        p *= F[r * TN + c]
                    tot += p
            S[r * TN + c] = p
        l[r] = l[r] * a + tot
    if STORE:
        store_tile(S, Pt, row0, key0)


@device
def tile_product(Pt, Vs, row0, col0, guarded, T):
    """``T = Pt^T Vs`` over the thread's micro-tile.

    ``guarded`` (a tile holding a non-finite value): zero weights skip
    their values, so a key outside a row's set never reaches it.
    """
    clear(T, N_O)
    values_product(Pt, row0, Vs, col0, guarded, T)


@device
def tile_values(Pt, Vs, row0, col0, guarded, O, T, alpha):
    """``O = O * alpha + Pt^T Vs`` (:func:`tile_product`; ``T``: scratch)."""
    tile_product(Pt, Vs, row0, col0, guarded, T)
    for r in range(TM):
        a = alpha[r]
        for e in range(TO):
            # alpha = 0: the earlier weights underflowed; 0 * inf would be NaN
            O[r * TO + e] = T[r * TO + e] if a == ZERO else O[r * TO + e] * a + T[r * TO + e]


@device
def add_tile(O, T, coef):
    """``O += coef[r] * T`` over the thread's micro-tile (``coef[r] = 1``: ``O + T``
    exactly)."""
    for r in range(TM):
        for e in range(TO):
            O[r * TO + e] += coef[r] * T[r * TO + e]


@device
def dropout_keys(keys, seed_lo, seed_hi, b, h, i0, row0):
    """``keys[r]``: the dropout's key of the thread's row ``i0 + row0 + r`` of batch
    ``b``, head ``h`` (:mod:`attnnb.cuda._dropout`)."""
    for r in range(TM):
        keys[r] = row_key(seed_lo, seed_hi, I64(b), I64(h), I64(i0 + row0 + r))


@device
def scale_values(O, keep):
    """``O *= keep``: the kept weights' factor ``1 / (1 - p)``, once on the values."""
    for e in range(N_O):
        O[e] *= keep


@device
def drop_stored(Pt, row0, key0, j0, keys, threshold):
    """Zero the dropped weights of the thread's micro-tile in ``Pt`` (rows keyed by
    ``keys``, :mod:`attnnb.cuda._dropout`; keys ``j0 + key0 + c``)."""
    for c in range(TN):
        word = column_word(I64(j0 + key0 + c))
        for r in range(TM):
            if not kept(keys[r], word, threshold):
                Pt[(U32(key0) + U32(c)) * U32(BQ) + U32(row0) + U32(r)] = ZERO


@device
def online_tile(S, F, part, m, l, alpha, normalizer, vh, j0, nk, tile, KV, Pt, red, rows,
                flag, t, row0, key0, col0, O, T, keys, threshold):
    """One key tile of the online softmax after its logits ``S`` (factors ``F``) are
    final: row maxima, weights to ``Pt``, the value tile staged in ``KV`` (over the
    key tile: the row reduction's barriers come first), ``O = O * alpha + P V``.

    ``tile`` names this step (unique within the sweep) for the non-finite flag.
    With a dropout ``threshold`` (0: none; a constant 0 compiles the test away) the
    dropped weights leave ``Pt`` after they entered the row sums (rows keyed by
    ``keys``).  Every thread must call it.
    """
    thread_max(S, part)
    row_reduce(red, rows, t, row0, key0, part, part, True)  # ends with syncthreads
    tile_weights(S, F, m, l, alpha, part, normalizer, Pt, row0, key0)
    if threshold != 0:
        drop_stored(Pt, row0, key0, j0, keys, threshold)
    if stage_values(vh, j0, nk, KV):
        flag[0] = CAST(tile)
    cuda.syncthreads()
    tile_values(Pt, KV, row0, col0, flag[0] == CAST(tile), O, T, alpha)
    cuda.syncthreads()


@device
def stage_tile_mask(Pt, t, i, p, j0, indptr, indices):
    """``Pt[c, t] = 1`` where key ``j0 + c`` is in the CSR run of row ``i`` (pattern
    row), else 0; thread ``t < BQ`` walks its row from position ``p`` (no later than
    the run's first key ``>= j0``) and returns the position past the tile, so a
    row's stored keys are read once over the sweep."""
    if t >= BQ:
        return p
    for c in range(BK):
        Pt[U32(c) * U32(BQ) + U32(t)] = ZERO
    end = indptr[i + 1]
    while p < end and indices[p] < j0:
        p += 1
    while p < end and indices[p] < j0 + BK:
        Pt[U32(indices[p] - j0) * U32(BQ) + U32(t)] = ONE
        p += 1
    return p


@device
def apply_tile_mask(S, F, Pt, row0, key0):
    """``S = -inf``, ``F = 0`` where the tile mask in ``Pt`` is 0 (the thread's
    micro-tile): as :func:`modify_value` leaves a key outside the set (softpick's
    sum counts a logit of ``-inf`` with a factor)."""
    for r in range(TM):
        for c in range(TN):
            if Pt[(U32(key0) + U32(c)) * U32(BQ) + U32(row0) + U32(r)] == ZERO:
                S[r * TN + c] = NINF
                F[r * TN + c] = ZERO


@device
def block_tile(Hq, Hk, qt0):
    """``(b, h, g, i0)``: the block's batch, query head, key / value head (grouped
    queries: ``g = h // (Hq // Hk)``) and first query row (query tile ``qt0 +
    blockIdx.y``)."""
    bh = cuda.blockIdx.x
    b = bh // Hq
    h = bh - b * Hq
    return b, h, h // (Hq // Hk), (qt0 + cuda.blockIdx.y) * BQ


@device
def start_rows(m, l):
    for r in range(TM):
        m[r] = NINF
        l[r] = ZERO


@device
def start(m, l, O, flag):
    """An empty online state; the non-finite flag set to no tile (first thread)."""
    start_rows(m, l)
    clear(O, N_O)
    if cuda.threadIdx.x == 0:
        flag[0] = CAST(-1)


@device
def finish_tile(red, rows, t, row0, key0, col0, i0, Lq, m, l, O, lrow, normalizer,
                out, lse, sink):
    """Reduce the partial sums ``l`` per row, write the thread's ``out`` values and
    (first thread of a row) the row's ``lse``; ``sink``: the head's sink logit
    (``softmax1``).  Every thread must call it."""
    normalizer = OWN_CODE if OWN else normalizer
    row_reduce(red, rows, t, row0, key0, l, lrow, False)
    for r in range(TM):
        i = i0 + row0 + r
        if i < Lq:
            row_lse = map_lse(m[r], lrow[r])
            if key0 == 0:
                lse[i] = row_lse
            for e in range(TO):
                col = col0 + e
                if col < DV:
                    out[i, col] = finish_value(O[r * TO + e], m[r], lrow[r], row_lse,
                                               normalizer, sink)


@device(inline="always")
def begin_tile(q_bh, i0, scale):
    """A forward kernel's start on query tile ``i0``, every thread: ``(Qt, KV, Pt, red,
    rows, flag)`` (:func:`shared_arrays`), ``(t, row0, key0, col0)``
    (:func:`thread_place`) and the thread's empty online state ``(S, F, m, l, part,
    alpha, O, T)`` -- logits and factors (``TM x TN``), row maxima, sums, partial
    sums and rescales (``TM``), values and products (``TM x TO``) -- with the
    tile's scaled queries ``q_bh (Lq, D)`` staged in ``Qt``.

    Inlined in Numba's IR (``inline="always"``), so that these shared and local
    arrays are the kernel's own, exactly as if it declared them itself.
    """
    Qt, KV, Pt, red, rows, flag = shared_arrays(
        cuda.shared.array(N_ALL, nt, alignment=ALIGN))
    t, row0, key0, col0 = thread_place()
    S = cuda.local.array(N_S, nt)
    F = cuda.local.array(N_S, nt)
    m = cuda.local.array(TM, nt)
    l = cuda.local.array(TM, nt)
    part = cuda.local.array(TM, nt)
    alpha = cuda.local.array(TM, nt)
    O = cuda.local.array(N_O, nt)
    T = cuda.local.array(N_O, nt)
    start(m, l, O, flag)
    stage_transposed(q_bh, i0, min(BQ, q_bh.shape[0] - i0), scale, Qt, BQ)
    return (Qt, KV, Pt, red, rows, flag, t, row0, key0, col0, S, F, m, l, part, alpha, O,
            T)


def build_constants(dtype, tiling: Tiling, mods=None, own=None) -> dict:
    """The globals the templates read in one build (module notes), by name."""
    dtype = np.dtype(dtype)
    base = device_functions(dtype)
    score_fn = mods is not None and mods.value is not None
    mask_fn = mods is not None and mods.allowed is not None
    bq, bk, tm, tn = tiling.bq, tiling.bk, tiling.tm, tiling.tn
    n_q, n_kv, n_p, n_red, n_rows, _ = tiling.shared_parts()
    to, nx = tiling.to, tiling.nx
    constants = dict(
        nt=numba.from_dtype(dtype), CAST=base.CAST, ZERO=base.ZERO, ONE=dtype.type(1),
        NINF=base.NINF, NAN=base.NAN, F_FOLD=dtype.type(2.0**-40),
        BQ=bq, BK=bk, TM=tm, TN=tn, DV=tiling.dv, NX=nx, NT=tiling.threads, TO=to,
        DP=tiling.dp, DVP=to * nx,
        O_KV=n_q, O_P=n_q + n_kv, O_RED=n_q + n_kv + n_p, O_ROWS=n_q + n_kv + n_p + n_red,
        O_FLAG=n_q + n_kv + n_p + n_red + n_rows, N_ALL=tiling.shared_elements(),
        N_S=tm * tn, N_O=tm * to, N_QS=tiling.dp * bq, N_KS=tiling.dp * bk,
        # an own build's code is a constant: the other normalizers' branches compile away
        OWN=own is not None, OWN_CODE=own if own is not None else 0,
        SIGMOID_BUILD=own == SIGMOID, SOFTPICK_BUILD=own == SOFTPICK,
        SCORE_FN=score_fn, MASK_FN=mask_fn,
        mod_value=mods.value if score_fn else None,
        mod_slope=mods.slope if score_fn else None,
        mod_allowed=mods.allowed if mask_fn else None,
        index=base.index, map_lse=base.map_lse, finish_value=base.finish_value,
        tiles_seen=base.tiles_seen,
        # the main instances of the parameterised templates
        DEPTH=tiling.dp, ROWS=bk, LD=to * nx, SDEPTH=tiling.dp, PSTEPS=bk, PLDA=bq,
        PLDB=to * nx, STORE=True)
    label = kernel_label(f"{dtype.char}{bq}x{bk}x{tm}x{tn}x{tiling.d}x{tiling.dv}x"
                         f"{tiling.streams}", mods=mods, own=own)
    constants["_tag"] = re.sub(r"\W", "_", label)
    steps = _outer_steps(constants)
    constants.update(score_step=steps(tm, tn, False), plain_step=steps(tm, to, False),
                     safe_step=steps(tm, to, True))
    return constants


def _instance(fn, constants: dict, suffix: str, **params):
    """``fn`` specialised with the build's ``constants`` and ``params`` over them."""
    bound = {**constants, **params}
    return specialise(fn, bound, f"{constants['_tag']}_{suffix}")


def _outer_steps(constants: dict):
    def step(na, nb, guarded):
        return _instance(outer_step, constants, f"s{na}_{nb}_{int(guarded)}", NA=na, NB=nb,
                         GUARDED=guarded)
    return step


# the templates a build exposes under their own names (module notes)
_TEMPLATES = {name: globals()[name] for name in (
    "shared_arrays", "thread_place", "stage_transposed", "stage_values", "clear",
    "tile_scores", "values_product", "key_allowed", "log_sigmoid", "modify_value",
    "row_reduce", "modify_tile", "key_tile_logits", "slope_tile", "thread_max", "store_tile",
    "softpick_terms", "tile_weights", "tile_product", "tile_values", "add_tile",
    "dropout_keys", "scale_values", "drop_stored", "online_tile", "stage_tile_mask",
    "apply_tile_mask", "block_tile", "start_rows", "start", "finish_tile", "begin_tile")}


def _factories(constants: dict) -> dict:
    """The parameterised templates as functions of their parameters (the backward's
    other shapes)."""
    steps = _outer_steps(constants)

    def zeros(n):
        return _instance(fresh_pair, constants, f"z{n}", ZN=n)

    def transposed_stager(depth):
        return _instance(stage_transposed, constants, f"t{depth}", DEPTH=depth)

    def row_stager(rows, ld):
        return _instance(stage_values, constants, f"r{rows}_{ld}", ROWS=rows, LD=ld)

    def scores_product(depth):
        return _instance(tile_scores, constants, f"q{depth}", SDEPTH=depth)

    def micro_product(na, nb, steps_, lda, ldb):
        return _instance(values_product, constants, f"p{na}_{nb}_{steps_}_{lda}_{ldb}",
                         PSTEPS=steps_, PLDA=lda, PLDB=ldb, plain_step=steps(na, nb, False),
                         safe_step=steps(na, nb, True))

    return dict(zeros=zeros, transposed_stager=transposed_stager, row_stager=row_stager,
                scores_product=scores_product, micro_product=micro_product)


@cache
def micro_functions(dtype, tiling: Tiling, mods=None, own=None) -> SimpleNamespace:
    """The device functions of the register-tiled core for one dtype and tiling, with a
    problem's mask and score functions compiled in (``mods``:
    :class:`attnnb.cuda._mods.DeviceMods`; None: none, and no code for them) and the code
    of ``sigmoid`` or ``softpick`` in their own builds (``own``, :func:`own_build`; None:
    the softmax family's, picked by the kernel's normalizer argument).  ``bindings``: the
    build's constants and device functions by name, for the templates built on it."""
    constants = build_constants(dtype, tiling, mods, own)
    tag = constants["_tag"]
    built = {name: specialise(fn, constants, tag) for name, fn in _TEMPLATES.items()}
    built["tile_sums"] = _instance(tile_weights, constants, "sums", STORE=False)
    exported = {name: constants[name] for name in (
        "nt", "N_ALL", "N_S", "N_O", "N_QS", "N_KS", "TM", "TN", "TO", "BQ", "BK", "NT", "DV",
        "SCORE_FN",
        "OWN", "OWN_CODE", "SIGMOID_BUILD", "SOFTPICK_BUILD", "map_lse")}
    return SimpleNamespace(**exported, **built, **_factories(constants),
                           bindings={**constants, **built})


def core_kernel(fn, micro: SimpleNamespace, name: str, **constants):
    """The Python function of the kernel template ``fn`` (:func:`attnnb.cuda._tiles.kernel`)
    over the core build ``micro`` (:func:`micro_functions`), with its own ``constants``
    (and device templates of its module, specialised with it); ``name`` and the constants
    that are numbers end its tag."""
    suffix = "_".join([name] + [f"{k}{int(v) if isinstance(v, bool) else v}"
                                for k, v in sorted(constants.items())
                                if isinstance(v, (bool, int))])
    return specialise(fn, {**micro.bindings, **constants}, f"{micro.bindings['_tag']}_{suffix}")
