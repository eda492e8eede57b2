"""A vectorisable ``exp`` for float32 tiles.

llvmlite's wheels carry no vector math library, so ``np.exp`` inside a
Numba loop is a scalar libm call, which would be much of a tile's time
(docs/notes/performance.md, "Figures moved out of the code's comments").  For
float32 we use Cephes' ``expf`` polynomial instead: ``exp(x) = 2**n *
exp(r)`` with ``n = round(x / ln 2)``, ``|r| <= ln(2) / 2``, and ``2**n``
built directly in the exponent bits.  The loop is branch-free so LLVM
vectorises it; relative error ~1e-7.  Inputs below ``EXP_MIN`` (masked
``-inf`` logits among them) give exactly 0.

float64 keeps libm's ``exp`` (the float64 tolerance is ~1e-12).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload, register_jitable

from ._jit import FASTMATH, wide_vectors

LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
EXP_MIN = np.float32(-87.33654)  # exp below this is subnormal: return 0
EXP_MAX = np.float32(88.37626)
HALF = np.float32(0.5)
ONE = np.float32(1.0)
ZERO = np.float32(0.0)
P0 = np.float32(1.9875691500e-4)
P1 = np.float32(1.3981999507e-3)
P2 = np.float32(8.3334519073e-3)
P3 = np.float32(4.1665795894e-2)
P4 = np.float32(1.6666665459e-1)
P5 = np.float32(5.0000001201e-1)


@intrinsic
def _bits_as_float32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (no conversion)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


def exp_shifted_sum(src, dst, shift, n):
    """``dst[j] = exp(src[j] - shift)`` for ``j < n``; returns ``sum(dst[:n])``.

    See :func:`exp_shifted_sum_at`.
    """
    raise NotImplementedError  # only callable from Numba code


@overload(exp_shifted_sum, jit_options={"fastmath": FASTMATH, "forceinline": True})
def _exp_shifted_sum_impl(src, dst, shift, n):
    def impl(src, dst, shift, n):
        return exp_shifted_sum_at(src, 0, dst, 0, shift, n)

    return impl


@intrinsic
def maxnum(typingctx, a, b):
    """LLVM's ``maxnum`` (the larger, ignoring a NaN operand): unlike Python's
    ``max`` it is a reduction LLVM vectorises."""
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, signature, args):
        t = args[0].type
        fn = builder.module.declare_intrinsic("llvm.maxnum", [t], ir.FunctionType(t, [t, t]))
        return builder.call(fn, args)

    return a(a, b), codegen


@intrinsic
def quotient(typingctx, a, b):
    """``a / b`` as LLVM's ``fdiv`` under the project's fast-math flags (IEEE: ``x / 0``
    is an infinity, ``0 / 0`` NaN).  Numba's ``/`` tests every divisor for zero (to
    raise ``ZeroDivisionError``), a branch per element that keeps loops scalar."""
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, signature, args):
        return builder.fdiv(args[0], args[1], flags=tuple(sorted(FASTMATH)))

    return a(a, b), codegen


@register_jitable(fastmath=FASTMATH, inline="always")
def _exp_f32(x0):
    """``exp(x0)`` for float32: Cephes' polynomial, branch-free; NaN stays NaN."""
    x = min(max(x0, EXP_MIN), EXP_MAX)
    kf = np.floor(x * LOG2E + HALF)
    r = x - kf * LN2_HI - kf * LN2_LO
    p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5
    p = p * r * r + r + ONE
    two_n = _bits_as_float32((np.int32(kf) + 127) << 23)
    # select, not branch: keeps loops vectorisable; NaN fails the comparison
    # and stays NaN (the clamp may have lost it)
    return ZERO if x0 < EXP_MIN else p * two_n + (x0 - x0)


@register_jitable(fastmath=FASTMATH, forceinline=True)
def sum_at(a, a0, n):
    """``sum(a[a0 : a0 + n])`` in an order fixed when the kernel is compiled.

    Loops that store an array and sum what they store are split into a
    storing loop and this one.  Fused, LLVM vectorises the loop behind a
    run-time check that the arrays it reads and writes do not overlap, and
    falls back to a scalar loop, which adds in another order, when it cannot
    rule it out; scratch arrays come from the allocator at addresses that
    vary with the thread that runs a task, so the sum's last bit did too
    (a float64 top-k row was an ulp off in some calls: docs/notes/performance.md, "Figures
    moved out of the code's comments").  A loop
    that only reads has no such check: its order depends on ``n`` alone.
    """
    wide_vectors()
    total = a.dtype.type(0.0)
    u0 = np.uint64(a0)
    for j in range(np.uint64(n)):
        total += a[u0 + j]
    return total


@register_jitable(fastmath=FASTMATH, forceinline=True)
def _exp_f32_loop(src, s0, dst, d0, shift, n):
    wide_vectors()
    sh = np.float32(shift)
    us = np.uint64(s0)
    ud = np.uint64(d0)
    for j in range(n):
        dst[ud + j] = _exp_f32(src[us + j] - sh)
    return sum_at(dst, d0, n)


def exp_tile_accumulate(src, dst, m, l, nq):
    """For full 64-key tiles: ``dst[r, c] = exp(src[r, c] - m[r])`` and
    ``l[r] += sum_c dst[r, c]`` for the rows ``r < nq`` whose ``m[r]`` is
    finite (other rows are left untouched); ``src``, ``dst`` flat ``(nq, 64)``.

    One call per tile: per row the loop has a constant trip count and the
    polynomial's constants stay in registers (a call per row costs more than the
    row's arithmetic: docs/notes/performance.md, "Figures moved out of the code's
    comments").
    """
    raise NotImplementedError  # only callable from Numba code


@overload(exp_tile_accumulate, jit_options={"fastmath": FASTMATH, "forceinline": True})
def _exp_tile_accumulate_impl(src, dst, m, l, nq):
    if src.dtype == types.float32:

        def impl_f32(src, dst, m, l, nq):
            wide_vectors()
            w = np.uint64(64)
            for r in range(np.uint64(nq)):
                sh = m[r]
                if sh == -np.inf or sh != sh:
                    continue
                o = r * w
                for j in range(w):
                    dst[o + j] = _exp_f32(src[o + j] - sh)
                l[r] += sum_at(dst, o, w)  # a loop of its own: see sum_at

        return impl_f32

    def impl_f64(src, dst, m, l, nq):
        for r in range(nq):
            sh = m[r]
            if sh == -np.inf or sh != sh:
                continue
            for j in range(64):
                dst[r * 64 + j] = math.exp(src[r * 64 + j] - sh)
            l[r] += sum_at(dst, r * 64, 64)

    return impl_f64


def sigmoid_tile_accumulate(src, f, dst, m, l, nq, nk):
    """``sigmoid``'s weights of a tile in one pass: ``dst[r, c] = f[r, c] / (1 +
    exp(-src[r, c]))``, exactly 0 where ``exp(-src)`` is out of range (a ``-inf``
    logit, a key outside the set; float32 logits below ``-EXP_MAX``), and
    ``l[r] += sum_c dst[r, c]`` for the rows ``r < nq`` whose ``m[r]`` is not NaN
    (other rows are left untouched); ``src``, ``f``, ``dst`` flat ``(nq, nk)``.

    The exponential is the vectorised one; a call per tile keeps its constants in
    registers, as :func:`exp_tile_accumulate`.
    """
    raise NotImplementedError  # only callable from Numba code


def _vector_exp(x):
    """``exp(x)``: the vectorised polynomial for float32, libm's for float64."""
    raise NotImplementedError  # only callable from Numba code


@overload(_vector_exp, jit_options={"fastmath": FASTMATH, "forceinline": True})
def _vector_exp_impl(x):
    if x == types.float32:
        return lambda x: _exp_f32(x)
    return lambda x: math.exp(x)


def exp_overflows(x):
    """True where :func:`_vector_exp` of ``x`` is out of the dtype's range: float32's
    polynomial clamps at ``EXP_MAX`` (a finite value), float64's libm gives ``inf``, so
    ``1 / (1 + exp(x))`` is then 0 as IEEE arithmetic has it."""
    raise NotImplementedError  # only callable from Numba code


@overload(exp_overflows, jit_options={"fastmath": FASTMATH, "forceinline": True})
def _exp_overflows_impl(x):
    if x == types.float32:
        return lambda x: x > EXP_MAX
    return lambda x: x == np.inf


@register_jitable(fastmath=FASTMATH, forceinline=True)
def _sigmoid_rows(src, f, dst, m, l, nq, w):
    wide_vectors()
    one, zero = src.dtype.type(1.0), src.dtype.type(0.0)
    for r in range(np.uint64(nq)):
        if m[r] != m[r]:
            continue
        o = r * w
        for j in range(w):
            x = src[o + j]
            e = _vector_exp(-x)
            # 0 where e^-x is out of range (a -inf logit among them), not f / clamped e^-x
            dst[o + j] = zero if exp_overflows(-x) else quotient(f[o + j], one + e)
        l[r] += sum_at(dst, o, w)  # a loop of its own: see sum_at


@overload(sigmoid_tile_accumulate, jit_options={"fastmath": FASTMATH, "forceinline": True})
def _sigmoid_tile_accumulate_impl(src, f, dst, m, l, nq, nk):
    def impl(src, f, dst, m, l, nq, nk):
        if nk == 64:  # a full tile: a constant trip count, no remainder loop
            _sigmoid_rows(src, f, dst, m, l, nq, np.uint64(64))
        else:
            _sigmoid_rows(src, f, dst, m, l, nq, np.uint64(nk))

    return impl


def exp_shifted_sum_at(src, s0, dst, d0, shift, n):
    """``dst[d0 + j] = exp(src[s0 + j] - shift)`` for ``j < n``; returns their sum.

    ``src`` and ``dst`` are flat 1-D arrays, the offsets non-negative.

    A NaN ``src[j] - shift`` (a NaN logit, or ``+inf - +inf``) gives NaN, so
    the sum tells the caller that the row is NaN; ``-inf`` gives 0.
    Implemented per dtype below; only callable from Numba code.
    """
    raise NotImplementedError


@overload(exp_shifted_sum_at, jit_options={"fastmath": FASTMATH, "forceinline": True})
def _exp_shifted_sum_at_impl(src, s0, dst, d0, shift, n):
    if src.dtype == types.float32:

        def impl_f32(src, s0, dst, d0, shift, n):
            wide_vectors()
            if n == 64:  # a full tile: a constant trip count, no remainder loop
                return _exp_f32_loop(src, s0, dst, d0, shift, np.uint64(64))
            return _exp_f32_loop(src, s0, dst, d0, shift, np.uint64(n))

        return impl_f32

    def impl_f64(src, s0, dst, d0, shift, n):
        for j in range(n):
            dst[d0 + j] = math.exp(src[s0 + j] - shift)
        return sum_at(dst, d0, n)

    return impl_f64


def exp_shifted(src, dst, shift, n):
    """``dst[j] = exp(src[j] - shift)`` for ``j < n`` (see :func:`exp_shifted_sum`)."""
    raise NotImplementedError  # only callable from Numba code


@overload(exp_shifted, jit_options={"fastmath": FASTMATH, "forceinline": True})
def _exp_shifted_impl(src, dst, shift, n):
    def impl(src, dst, shift, n):
        exp_shifted_sum(src, dst, shift, n)

    return impl


THIRD = np.float32(1.0 / 3.0)
QUARTER = np.float32(0.25)
FIFTH = np.float32(0.2)
TENTH = np.float32(0.1)


def relu_expm1_factors(src, dst, n):
    """``dst[j] = 1 - exp(-src[j])`` where ``src[j] > 0``, else 0 (NaN too), for ``j < n``:
    ``relu_expm1``'s factor, ``max(0, e^s - 1) = e^s * factor``.  Only callable from
    Numba code."""
    raise NotImplementedError


@overload(relu_expm1_factors, jit_options={"fastmath": FASTMATH, "forceinline": True})
def _relu_expm1_factors_impl(src, dst, n):
    if src.dtype == types.float32:

        def impl_f32(src, dst, n):
            # branch-free, so that the loop vectorises: below 0.1 the Taylor series of
            # 1 - e^-s to s^5 (relative error < 2e-8), above it (e^s - 1) / e^s from
            # Cephes' exp (within ~1e-6; e^s clamps at 88, where the factor is 1)
            wide_vectors()
            for j in range(n):
                s = src[j]
                e = _exp_f32(s)
                small = s * (ONE - s * HALF * (ONE - s * THIRD * (ONE - s * QUARTER
                                                                  * (ONE - s * FIFTH))))
                f = small if s < TENTH else quotient(e - ONE, e)
                dst[j] = f if s > ZERO else ZERO

        return impl_f32

    def impl_f64(src, dst, n):
        for j in range(n):
            s = src[j]
            dst[j] = -math.expm1(-s) if s > 0.0 else 0.0

    return impl_f64
