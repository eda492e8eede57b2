"""Compile :mod:`attnnb.mods`' functions into the small Numba functions the kernels inline.

A mask mod becomes ``allowed(b, h, i, j, args) -> bool`` and a score mod
three functions of one flat ``args`` tuple (every leaf's arrays in leaf
order, from a given offset: the kernels put other arrays first):
``value(s, b, h, i, j, args)``, ``slope(s, b, h, i, j, args)`` (``d value /
d s``) and ``agrad(g, s, b, h, i, j, grads, args)`` (adds ``g`` times the
derivative with respect to the arrays into ``grads``, shaped like ``args``).
Flat, because Numba's parallel loops cannot take a tuple held in a tuple.
All are compiled with ``forceinline`` (inlined where they are called, as
the kernels' own shared loops), without caching: they are inlined into
kernels that the cpu backend caches under the mod's
fingerprint.

Also here: the call-time binding of the arrays (:func:`bind`), the type
check that names the function when it does not compile (:func:`check_types`),
the float64 loops that the reference backend materialises mods with, and
:func:`check_derivatives` behind :func:`attnnb.mods.check`.
"""

from __future__ import annotations

import dis
import hashlib
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba.extending import overload

from . import core
from .core import OFFSET, MaskMod, ScoreMod, as_numpy

COMPLEX_STEP = 1e-30

_compiled: dict = {}


# Eigen's rational approximation of tanh on [-7.9, 7.9] (float32: within 3.3e-7
# relative on [-12, 12], docs/notes/performance.md, "Mask and score functions"; +-1 to
# rounding beyond)
_F = np.float32
TANH_CLAMP = _F(7.90531110763549805)
A13, A11, A9, A7 = _F(-2.76076847742355e-16), _F(2.00018790482477e-13), _F(
    -8.60467152213735e-11), _F(5.12229709037114e-08)
A5, A3, A1 = _F(1.48572235717979e-05), _F(6.37261928875436e-04), _F(4.89352455891786e-03)
B6, B4, B2, B0 = _F(1.19825839466702e-06), _F(1.18534705686654e-04), _F(
    2.26843463243900e-03), _F(4.89352518554385e-03)


def _tanh_f32(x):
    """tanh of a float32 with no libm call and no branch, so that a loop of it vectorises."""
    x = TANH_CLAMP if x > TANH_CLAMP else x
    x = -TANH_CLAMP if x < -TANH_CLAMP else x  # (a NaN passes both)
    x2 = x * x
    p = (((((A13 * x2 + A11) * x2 + A9) * x2 + A7) * x2 + A5) * x2 + A3) * x2 + A1
    q = ((B6 * x2 + B4) * x2 + B2) * x2 + B0
    return x * p / q


@overload(core.capped_tanh, jit_options={"forceinline": True, "error_model": "numpy"})
def capped_tanh_compiled(s, cap):
    """:func:`attnnb.mods.capped_tanh` compiled: in float32 for a float32 ``s`` (the
    kernels' float32 logits; ``cap`` rounded to float32), by libm otherwise."""
    if isinstance(s, numba.types.Float) and s.bitwidth == 32:
        tanh32 = numba.njit(**_OPTIONS)(_tanh_f32)

        def impl(s, cap):
            return tanh32(s / np.float32(cap))
        return impl
    return lambda s, cap: math.tanh(s / cap)


@dataclass(frozen=True)
class Target:
    """How a backend compiles a mod's functions: ``decorate(fn)`` gives the function the
    kernels of ``name`` call (every function of a mod, the user's and the composing ones)."""

    name: str
    decorate: Callable


# error_model="numpy": a division by zero gives inf or NaN, as in NumPy, instead of a
# Python exception, whose check per division also kept loops from vectorising
_OPTIONS = dict(forceinline=True, nogil=True, error_model="numpy")
CPU = Target("cpu", lambda fn: numba.njit(**_OPTIONS)(fn))


@overload(core.like, jit_options={"forceinline": True})
def like_compiled(s, x):
    """:func:`attnnb.mods.like` compiled: ``x`` converted to ``s``'s float type."""
    if isinstance(s, numba.types.Float):
        convert = numba.np.numpy_support.as_dtype(s).type
        return lambda s, x: convert(x)
    return lambda s, x: float(x)


@dataclass(frozen=True)
class CompiledMask:
    allowed: Any
    fingerprint: str


@dataclass(frozen=True)
class CompiledScore:
    value: Any
    slope: Any
    agrad: Any
    fingerprint: str


_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fingerprint(mod: MaskMod | ScoreMod) -> str:
    """A short hash of the mod's functions, what they read (constants by value, helpers
    by content, arrays by place: :mod:`attnnb._mods.reads`) and the composition: mods
    with one fingerprint share their compiled functions and kernels, in this process and
    in the disk cache.  ``mod`` must be resolved (:func:`attnnb._mods.core.resolved`)."""
    found = _fingerprints.get(mod)
    if found is None:
        text = mod.fingerprint()
        found = _fingerprints[mod] = hashlib.sha256(text.encode()).hexdigest()[:20]
    return found


def _leaf_call(callee: Callable, head: str, offset: int, n: int, before: range = range(0),
               grads: bool = False):
    """A function ``(head..., [grads,] args)`` that calls ``callee(args[before]...,
    head..., [its grads,] args[offset], ..., args[offset + n - 1])``: a leaf's arrays at
    their static places in the flat ``args`` (Numba indexes a heterogeneous tuple by
    constants only), those its function reads by name (``before``) first."""
    read = "".join(f"args[{p}], " for p in before)
    arrays = "".join(f", args[{offset + n_}]" for n_ in range(n))
    own_grads = ""
    if grads:
        own_grads = ", (" + "".join(f"grads[{offset + n_}], " for n_ in range(n)) + ")"
    params = head + (", grads" if grads else "") + ", args"
    source = f"def leaf({params}):\n    return callee({read}{head}{own_grads}{arrays})\n"
    scope = {"callee": callee, "__name__": __name__}  # (an importable module: reads._importable)
    exec(source, scope)  # noqa: S102 - the text above, with integers only
    return scope["leaf"]


def _read_slots(leaf, offset: int) -> list:
    """The places in ``args`` of the arrays each of a leaf's functions reads by name
    (after the leaf's own arrays, in the order of :func:`attnnb._mods.core.implicit_arrays`)."""
    at = offset + len(leaf.arrays)
    out = []
    for node in leaf.reads:
        n = 0 if node is None else len(node.arrays)
        out.append(range(at, at + n))
        at += n
    return out


def arity(mod: MaskMod | ScoreMod) -> int:
    """How many arrays ``mod`` reads: its slots in the flat ``args``."""
    if mod.kind == "fn":
        return len(mod.arrays) + len(core.implicit_arrays(mod))
    return (mod.kind == "at") + sum(arity(p) for p in mod.parts)


def placed(mod: MaskMod | ScoreMod, origin, shape) -> MaskMod | ScoreMod:
    """``mod`` as seen from a block of a larger call: the block's ``(b, h, i, j)`` are
    shifted by ``origin = (b0, h0, i0, j0)`` (its first batch element, query head,
    query and key in the call) and :data:`~attnnb.mods.OFFSET` binds to the call's
    ``shape = (Lq, Lk)``.  One compiled copy serves every block (the shifts are an
    array, read at ``args``' first slot of the composition)."""
    arrays = (np.asarray(origin, np.int64), np.asarray(shape, np.int64))
    return type(mod)("at", arrays=arrays, parts=(mod,), name=mod.name)


def _shifted(inner: Callable, head: str, offset: int):
    """``(head..., args)`` calling ``inner`` with ``b, h, i, j`` plus ``args[offset]``'s
    four shifts (:func:`placed`)."""
    shifted = (head.replace("b, h, i, j", "b + o[0], h + o[1], i + o[2], j + o[3]"))
    source = (f"def at({head}, args):\n    o = args[{offset}]\n"
              f"    return inner({shifted}, args)\n")
    scope = {"inner": inner, "__name__": __name__}
    exec(source, scope)  # noqa: S102 - the text above, with an integer only
    return scope["at"]


def compile_mask(mod: MaskMod, offset: int = 0, target: Target = CPU) -> CompiledMask:
    """``allowed(b, h, i, j, args)`` of a mask mod whose arrays start at ``args[offset]``,
    compiled for ``target``."""
    key = ("mask", fingerprint(mod), offset, target.name)
    found = _compiled.get(key)
    if found is not None:
        return found
    if mod.kind == "fn":
        allowed = _leaf_call(mod.reads[0].compiled(target.decorate), "b, h, i, j", offset,
                             len(mod.arrays), _read_slots(mod, offset)[0])
    elif mod.kind == "at":
        allowed = _shifted(compile_mask(mod.parts[0], offset + 1, target).allowed,
                           "b, h, i, j", offset)
    elif mod.kind == "not":
        inner = compile_mask(mod.parts[0], offset, target).allowed

        def allowed(b, h, i, j, args):
            return not inner(b, h, i, j, args)
    else:
        left = compile_mask(mod.parts[0], offset, target).allowed
        right = compile_mask(mod.parts[1], offset + arity(mod.parts[0]), target).allowed
        # both sides always (no short circuit): a branch per pair keeps the classifier's
        # loop scalar (docs/notes/performance.md, "Mask and score functions"); each side must
        # be defined at every position
        if mod.kind == "and":
            def allowed(b, h, i, j, args):
                return bool(left(b, h, i, j, args)) & bool(right(b, h, i, j, args))
        else:
            def allowed(b, h, i, j, args):
                return bool(left(b, h, i, j, args)) | bool(right(b, h, i, j, args))
    found = CompiledMask(target.decorate(allowed), fingerprint(mod))
    _compiled[key] = found
    return found


def compile_score(mod: ScoreMod, offset: int = 0, target: Target = CPU) -> CompiledScore:
    """``value``, ``slope`` and ``agrad`` of a score mod whose arrays start at
    ``args[offset]`` (module docstring), compiled for ``target``."""
    key = ("score", fingerprint(mod), offset, target.name)
    found = _compiled.get(key)
    if found is not None:
        return found
    if mod.kind == "fn":
        n = len(mod.arrays)
        fn_reads, slope_reads, agrad_reads = _read_slots(mod, offset)
        f = mod.reads[0].compiled(target.decorate)
        value = _leaf_call(f, "s, b, h, i, j", offset, n, fn_reads)
        if mod.grad_s is not None:
            slope = _leaf_call(mod.reads[1].compiled(target.decorate), "s, b, h, i, j",
                               offset, n, slope_reads)
        else:
            at = target.decorate(_leaf_call(f, "s, b, h, i, j", offset, n, fn_reads))

            def slope(s, b, h, i, j, args):
                return at(complex(s, COMPLEX_STEP), b, h, i, j, args).imag / COMPLEX_STEP

        if mod.grad_arrays is not None:
            agrad = _leaf_call(mod.reads[2].compiled(target.decorate), "g, s, b, h, i, j",
                               offset, n, agrad_reads, grads=True)
        else:
            def agrad(g, s, b, h, i, j, grads, args):
                pass
    elif mod.kind == "at":
        inner = compile_score(mod.parts[0], offset + 1, target)
        value = _shifted(inner.value, "s, b, h, i, j", offset)
        slope = _shifted(inner.slope, "s, b, h, i, j", offset)
        agrad = _shifted(inner.agrad, "g, s, b, h, i, j, grads", offset)
    else:
        first = compile_score(mod.parts[0], offset, target)
        then = compile_score(mod.parts[1], offset + arity(mod.parts[0]), target)
        v1, s1, a1 = first.value, first.slope, first.agrad
        v2, s2, a2 = then.value, then.slope, then.agrad

        def value(s, b, h, i, j, args):
            return v2(v1(s, b, h, i, j, args), b, h, i, j, args)

        def slope(s, b, h, i, j, args):
            t = v1(s, b, h, i, j, args)
            return s2(t, b, h, i, j, args) * s1(s, b, h, i, j, args)

        def agrad(g, s, b, h, i, j, grads, args):
            t = v1(s, b, h, i, j, args)
            a2(g, t, b, h, i, j, grads, args)
            a1(g * s2(t, b, h, i, j, args), s, b, h, i, j, grads, args)
    found = CompiledScore(target.decorate(value), target.decorate(slope),
                          target.decorate(agrad), fingerprint(mod))
    _compiled[key] = found
    return found


def reads_argument(mod, position: int) -> bool:
    """Whether a mask mod's functions read their argument ``position`` (0: ``b``, 1:
    ``h``), in their bytecode or their helpers' (conservative: any use counts)."""
    if mod.kind != "fn":
        return any(reads_argument(p, position) for p in mod.parts)
    fn = getattr(mod.fn, "py_func", mod.fn)
    code = fn.__code__
    name = code.co_varnames[position]
    if name in code.co_cellvars:
        return True
    for ins in dis.get_instructions(code):
        if ins.opname.startswith(("LOAD_FAST", "STORE_FAST", "DELETE_FAST")):
            value = ins.argval
            if value == name or (isinstance(value, tuple) and name in value):
                return True
    return False


_views: dict = {}


def grad_views(n: int, target: Target = CPU):
    """``views(mod_grads, slot) -> (mod_grads[0][slot], ..., mod_grads[n - 1][slot])``:
    one slot's gradient buffers of a mod's ``n`` arrays, shaped like ``args`` (the
    backends keep a slot per group of backward tasks, summed in slot order)."""
    key = (n, target.name)
    found = _views.get(key)
    if found is None:
        body = "".join(f"mod_grads[{m}][slot], " for m in range(n))
        scope: dict = {"__name__": __name__}
        exec(f"def views(mod_grads, slot):\n    return ({body})\n", scope)  # noqa: S102
        found = _views[key] = target.decorate(scope["views"])
    return found


# ---------------------------------------------------------------------------
# the arrays at call time


def bind(mod: MaskMod | ScoreMod, Lq: int, Lk: int) -> tuple:
    """The flat ``args`` tuple of ``mod``'s arrays in leaf order for a call with ``Lq``
    queries and ``Lk`` keys (:data:`~attnnb.mods.OFFSET` becomes ``[Lk - Lq]``),
    C-contiguous."""
    if mod.kind == "fn":
        return tuple(np.array([Lk - Lq], np.int64) if a is OFFSET else _readable(a)
                     for a in mod.arrays + core.implicit_arrays(mod))
    if mod.kind == "at":  # (the call's shape, not the block's)
        return (mod.arrays[0],) + bind(mod.parts[0], *(int(n) for n in mod.arrays[1]))
    return sum((bind(p, Lq, Lk) for p in mod.parts), ())


def _readable(a: np.ndarray) -> np.ndarray:
    """C-contiguous and writeable (Numba types read-only arrays apart); never written."""
    out = np.ascontiguousarray(a)
    return out if out.flags.writeable else out.copy()


def zero_grads(args: tuple) -> tuple:
    """float64 zeros shaped like every array of ``args``."""
    return tuple(np.zeros(a.shape, np.float64) for a in args)


def param_grads(mod: ScoreMod, grads: tuple) -> tuple:
    """The gradients of ``mod``'s parameters, flat in leaf order, from ``grads`` shaped
    like its flat ``args``: ``None`` for integer and boolean arrays and constant leaves."""
    if mod.kind == "at":
        return param_grads(mod.parts[0], grads[1:])
    if mod.kind != "fn":
        out, at = (), 0
        for p in mod.parts:
            out += param_grads(p, grads[at:at + arity(p)])
            at += arity(p)
        return out
    own = tuple(None if mod.constant or a.dtype.kind != "f" else g  # (by name: constants)
                for a, g in zip(mod.arrays, grads[:len(mod.arrays)]) if a is not OFFSET)
    if mod.to_params is not None:
        own = mod.to_params(own)
    dtypes = [as_numpy("a parameter", p).dtype for p in mod.params]
    return tuple(None if g is None or dt.kind != "f" else g.astype(dt, copy=False)
                 for g, dt in zip(own, dtypes))


def sum_param_grads(parts: list) -> tuple | None:
    """Parameter gradients (:func:`param_grads`) of parts of one call added, entry by
    entry (``None`` stays ``None``); None for no parts."""
    if not parts:
        return None
    return tuple(None if column[0] is None else sum(column[1:], column[0].copy())
                 for column in zip(*parts))


def missing_array_gradients(mod: ScoreMod) -> list[str]:
    """Names of the leaves with float arrays, not constant, and no ``grad_arrays``."""
    if mod.kind != "fn":
        return sum((missing_array_gradients(p) for p in mod.parts), [])
    floats = any(a is not OFFSET and a.dtype.kind == "f" for a in mod.arrays)
    return [mod.name] if floats and not mod.constant and mod.grad_arrays is None else []


def needs_array_gradients(mod: ScoreMod) -> list[str]:
    """Names of the leaves whose float arrays take gradients (not constant)."""
    if mod.kind != "fn":
        return sum((needs_array_gradients(p) for p in mod.parts), [])
    floats = any(a is not OFFSET and a.dtype.kind == "f" for a in mod.arrays)
    return [mod.name] if floats and not mod.constant else []


# ---------------------------------------------------------------------------
# type checks


def _compile_for(role: str, mod, disp, argtypes: tuple, what: str):
    if argtypes in disp.overloads:  # (compile() takes Numba's lock even then)
        return disp.overloads[argtypes].signature.return_type
    try:
        disp.compile(argtypes)
    except numba.core.errors.NumbaError as err:
        detail = str(err).strip()
        if len(detail) > 2000:  # Numba's report: its first and last lines say what failed
            detail = detail[:800] + "\n...\n" + detail[-1200:]
        raise TypeError(f"{role} {mod.name!r} does not compile for {what}:\n{detail}") from None
    return disp.overloads[argtypes].signature.return_type


def check_types(mask: MaskMod | None, score: ScoreMod | None, Lq: int, Lk: int,
                dtype=np.float64) -> None:
    """Compile the mods for this call's argument types; a ``TypeError`` names the function
    when one does not compile or returns the wrong type."""
    i64 = numba.types.int64
    mask, score = core.resolved(mask), core.resolved(score)
    if mask is not None:
        args = bind(mask, Lq, Lk)
        ret = _compile_for("mask_mod", mask, compile_mask(mask).allowed,
                           (i64, i64, i64, i64, numba.typeof(args)),
                           "(b, h, i, j: int64, arrays)")
        if not isinstance(ret, numba.types.Boolean):
            raise TypeError(f"mask_mod {mask.name!r} must return a bool; it returns {ret}")
    if score is not None:
        args = bind(score, Lq, Lk)
        s = numba.from_dtype(np.dtype(dtype))
        ret = _compile_for("score_mod", score, compile_score(score).value,
                           (s, i64, i64, i64, i64, numba.typeof(args)),
                           f"(s: {s}, b, h, i, j: int64, arrays)")
        if not isinstance(ret, (numba.types.Float, numba.types.Integer)):
            raise TypeError(f"score_mod {score.name!r} must return a real number; it "
                            f"returns {ret}")


def check_slope(score: ScoreMod, Lq: int, Lk: int, dtype=np.float64) -> None:
    """Compile ``d score / d s``; a ``TypeError`` says to pass ``grad_s=`` when the
    complex step does not compile (a function that compares or clips ``s``)."""
    score = core.resolved(score)
    args = bind(score, Lq, Lk)
    s = numba.from_dtype(np.dtype(dtype))
    i64 = numba.types.int64
    try:
        _compile_for("score_mod", score, compile_score(score).slope,
                     (s, i64, i64, i64, i64, numba.typeof(args)), "a complex s")
    except TypeError as err:
        raise TypeError(f"{err}\nattnnb derives d score/ds by the complex step, which needs "
                        "a function of s built from arithmetic and analytic functions (no "
                        "comparisons, abs, min or max of s; np.tanh, not math.tanh); pass "
                        "grad_s= to score_mod") from None


# ---------------------------------------------------------------------------
# materialised, for the reference backend (float64, small problems)


@numba.njit
def _mask_loop(allowed, args, out, b0, h0, rows):
    B, H, n, Lk = out.shape
    for b in range(B):
        for h in range(H):
            for r in range(n):
                for j in range(Lk):
                    out[b, h, r, j] = allowed(b + b0, h + h0, rows[r], j, args)


@numba.njit
def _score_loop(value, args, s, out, b0, h0, rows):
    B, H, n, Lk = s.shape
    for b in range(B):
        for h in range(H):
            for r in range(n):
                for j in range(Lk):
                    out[b, h, r, j] = value(s[b, h, r, j], b + b0, h + h0, rows[r], j, args)


@numba.njit
def _agrad_loop(agrad, args, grads, g, s, b0, h0):
    B, H, Lq, Lk = s.shape
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                for j in range(Lk):
                    if g[b, h, i, j] != 0.0:  # a pair the output does not read gives nothing
                        agrad(g[b, h, i, j], s[b, h, i, j], b + b0, h + h0, i, j, grads, args)


def _rows(rows, Lq: int) -> np.ndarray:
    return np.arange(Lq, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)


def mask_values(mod: MaskMod, shape: tuple, origin=(0, 0), rows=None) -> np.ndarray:
    """bool ``(B, H, n, Lk)``: the mask mod at query rows ``rows`` (all ``Lq`` by default)
    of a problem of ``shape`` ``(B, H, Lq, Lk)`` (``origin``: ``(b0, h0)`` of the problem's
    first batch element and head in the call)."""
    mod = core.resolved(mod)
    B, H, Lq, Lk = shape
    index = _rows(rows, Lq)
    out = np.empty((B, H, index.size, Lk), np.bool_)
    _mask_loop(compile_mask(mod).allowed, bind(mod, Lq, Lk), out, *origin, index)
    return out


def score_values(mod: ScoreMod, s: np.ndarray, Lq: int, origin=(0, 0), rows=None,
                 with_slope=False):
    """``(value, slope)`` float64 of the score mod at every logit of ``s (B, H, n, Lk)``,
    the rows ``rows`` (all ``Lq`` by default) of a problem with ``Lq`` queries; ``slope``
    is None unless asked."""
    mod = core.resolved(mod)
    s = np.ascontiguousarray(s, np.float64)
    c = compile_score(mod)
    args, index = bind(mod, Lq, s.shape[3]), _rows(rows, Lq)
    out = np.empty_like(s)
    _score_loop(c.value, args, s, out, *origin, index)
    if not with_slope:  # (the slope is compiled only for gradients)
        return out, None
    dout = np.empty_like(s)
    _score_loop(c.slope, args, s, dout, *origin, index)
    return out, dout


def array_gradients(mod: ScoreMod, g: np.ndarray, s: np.ndarray, origin=(0, 0)) -> tuple:
    """The parameters' gradients (:func:`param_grads`) from ``g = dL / d value`` and the
    logits ``s``, both float64 ``(B, H, Lq, Lk)``."""
    mod = core.resolved(mod)
    args = bind(mod, s.shape[2], s.shape[3])
    grads = zero_grads(args)
    _agrad_loop(compile_score(mod).agrad, args, grads, np.ascontiguousarray(g, np.float64),
                np.ascontiguousarray(s, np.float64), *origin)
    return param_grads(mod, grads)


@numba.njit
def _block_allows(allowed, args, q0, q1, k0, k1, n_b, n_h):
    for b in range(n_b):
        for h in range(n_h):
            for i in range(q0, q1):
                for j in range(k0, k1):
                    if allowed(b, h, i, j, args):
                        return True
    return False


@numba.njit
def _blocks_loop(allowed, args, q_edges, k_edges, n_b, n_h, out):
    for x in range(q_edges.size - 1):
        for y in range(k_edges.size - 1):
            out[x, y] = _block_allows(allowed, args, q_edges[x], q_edges[x + 1], k_edges[y],
                                      k_edges[y + 1], n_b, n_h)


def blocks_allowed(mod: MaskMod, shape: tuple, q_edges, k_edges) -> np.ndarray:
    """bool ``(query blocks, key blocks)``: whether the mask mod allows any pair of each
    block (for any batch element and head, of ``shape`` ``(B, H, Lq, Lk)``; only those
    its functions read are walked), blocks cut at ``q_edges`` and ``k_edges``.  Exact:
    a block is False only when every pair of it was tested (an allowed pair ends a
    block's walk)."""
    mod = core.resolved(mod)
    B, H, Lq, Lk = shape
    q_edges, k_edges = (np.asarray(e, np.int64) for e in (q_edges, k_edges))
    out = np.zeros((q_edges.size - 1, k_edges.size - 1), np.bool_)
    _blocks_loop(compile_mask(mod).allowed, bind(mod, Lq, Lk), q_edges, k_edges,
                 B if reads_argument(mod, 0) else 1, H if reads_argument(mod, 1) else 1, out)
    return out


# ---------------------------------------------------------------------------
# attnnb.mods.check


def check_derivatives(mod: ScoreMod, *, points: int, seed: int, shape: tuple,
                      rtol: float) -> None:
    if not isinstance(mod, ScoreMod):
        raise TypeError(f"mods.check takes a score mod; got {type(mod).__name__}")
    B, H, Lq, Lk = shape
    rng = np.random.default_rng(seed)
    mod = core.resolved(mod)
    c = compile_score(mod)
    args = _copied(bind(mod, Lq, Lk))  # perturbed below: never the user's arrays
    check_types(None, mod, Lq, Lk)
    check_slope(mod, Lq, Lk)
    for _ in range(points):
        s = float(rng.uniform(-3, 3))
        b, h, i, j = (int(rng.integers(n)) for n in shape)
        step = 1e-6 * max(1.0, abs(s))
        numeric = (c.value(s + step, b, h, i, j, args)
                   - c.value(s - step, b, h, i, j, args)) / (2 * step)
        exact = c.slope(s, b, h, i, j, args)
        if not np.isclose(exact, numeric, rtol=rtol, atol=rtol):
            raise AssertionError(f"{mod.name}: d score/ds = {exact} but central differences "
                                 f"give {numeric} at s={s}, (b, h, i, j)={(b, h, i, j)}")
        if missing_array_gradients(mod):
            continue
        grads = zero_grads(args)
        _agrad_one(c.agrad, s, b, h, i, j, grads, args)
        _check_array_slopes(mod, c, s, (b, h, i, j), args, grads, rtol)


@numba.njit
def _agrad_one(agrad, s, b, h, i, j, grads, args):
    agrad(1.0, s, b, h, i, j, grads, args)


def _copied(args: tuple) -> tuple:
    return tuple(a.copy() for a in args)


def _bound_places(mod) -> list:
    """Per entry of ``mod``'s flat ``args``: whether it is an array bound to the mod (which
    takes gradients), not one its functions read by name (a constant)."""
    if mod.kind == "fn":
        return [True] * len(mod.arrays) + [False] * len(core.implicit_arrays(mod))
    return [False] * (mod.kind == "at") + sum((_bound_places(p) for p in mod.parts), [])


def _check_array_slopes(mod, c, s, index, args, grads, rtol) -> None:
    for arr, grad, bound in zip(args, grads, _bound_places(mod)):
        if arr.dtype.kind != "f" or not bound:
            continue
        for pos in np.ndindex(arr.shape):
            keep = arr[pos]
            step = 1e-6 * max(1.0, abs(float(keep)))
            arr[pos] = keep + step
            up = c.value(s, *index, args)
            arr[pos] = keep - step
            down = c.value(s, *index, args)
            arr[pos] = keep
            numeric = (up - down) / (2 * step)
            if not np.isclose(grad[pos], numeric, rtol=rtol, atol=rtol):
                raise AssertionError(
                    f"{mod.name}: the gradient into an array entry {pos} is {grad[pos]} but "
                    f"central differences give {numeric} at s={s}, (b, h, i, j)={index}")
