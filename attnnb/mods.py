"""Mask and score functions: any variant a researcher writes down, in the kernels.

A **mask function** ``mask(b, h, i, j, *arrays) -> bool`` says whether query
``i`` of batch element ``b`` and query head ``h`` may attend key ``j``; a
**score function** ``score(s, b, h, i, j, *arrays) -> float`` rewrites the
scaled logit ``s = scale q_i . k_j`` before the bias, the key sizes and the
normalizer see it (docs/contract.md §2.10).  Both are plain Python functions
that Numba can compile; ``arrays`` are the NumPy arrays they read (slopes,
tables, document ids, gates).  Bind a function to its arrays with
:func:`mask_mod` and :func:`score_mod`, or use this module's built-ins, and
pass the result to :func:`attnnb.attention` (``mask_mod=``, ``score_mod=``)::

    def alibi_like(s, b, h, i, j, slopes):
        return s + slopes[h] * (j - i)

    out = attnnb.attention(q, k, v, causal=True,
                           score_mod=mods.score_mod(alibi_like, slopes))

What a function reads by name (globals, closure cells, defaults, helpers to any
depth) is taken at every call (:mod:`attnnb._mod_reads`, contract §2.10): arrays
are passed to the kernels as they are then, numbers and strings are constants
keyed by value, helpers are compiled with the function; anything else is refused
by name.

Masks compose with ``&``, ``|`` and ``~``; score functions chain with ``+``
(``a + b`` applies ``a``, then ``b`` to its result: for additive biases the
sum of both).  The functions are compiled into the tiled kernels (never an
``(Lq, Lk)`` array on the cpu backend), forward and backward.

Gradients (:func:`attnnb.vjp`): ``ds`` flows through ``d score / d s``, taken
from ``grad_s=`` or, without it, derived by the complex step
(``Im f(s + i h) / h`` with ``h = 1e-30``: exact to rounding for a function
built from arithmetic and analytic functions of ``s``; a function that
compares, clips or takes ``abs`` of ``s`` needs ``grad_s=``).  A score
function's float arrays get gradients from ``grad_arrays=``, a function
``grad_arrays(g, s, b, h, i, j, grads, *arrays)`` that adds ``g`` times the
derivative of the score with respect to each entry it read into
``grads`` (a tuple of float64 arrays shaped like ``arrays``); without it
``vjp`` raises, unless the mod was made with ``constant=True`` (its arrays
then get no gradient, ``None``).  :func:`check` compares both derivatives
with central differences.  Integer and boolean arrays never get one.

Speed: a mask function written without branches (``&``, ``|`` and ``~`` on
comparisons rather than ``and``, ``or``, ``if``) lets the tile classifier's
loops vectorise, where a branch per pair leaves them scalar (docs/notes/performance.md,
"Mask and score functions"); the built-ins are written so.

Positions: a user's function gets the row and column indices ``i``, ``j``
as they are.  The built-ins that compare positions read query ``i`` as
sitting at key position ``i + Lk - Lq``, as the kernels' ``causal`` does
(bottom-right aligned: decoding with a KV cache needs no other offset).

Nothing here imports Numba: functions compile on first use
(:mod:`attnnb._mod_compile`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MaskMod",
    "ScoreMod",
    "alibi",
    "causal",
    "check",
    "constant",
    "document",
    "forgetting",
    "from_cu_seqlens",
    "like",
    "mask_mod",
    "prefix_lm",
    "relative_bias",
    "score_mod",
    "sinks",
    "sliding_window",
    "softcap",
]


class _Offset:
    """An array slot filled at call time with ``[Lk - Lq]`` (int64): where query ``i``
    sits among the keys, for built-ins aligned bottom-right."""

    def __repr__(self) -> str:
        return "OFFSET"


OFFSET = _Offset()


def _keys(leaf) -> str:
    """The content keys of a resolved leaf's functions (``-`` where it has none)."""
    if not leaf.reads:
        raise RuntimeError(f"{leaf.name}: a mod's fingerprint is taken of its snapshot at "
                           "a call (attnnb.mods.resolved)")
    return ";".join("-" if node is None else node.key for node in leaf.reads)


def _name_of(fn: Callable) -> str:
    fn = getattr(fn, "py_func", fn)
    return getattr(fn, "__qualname__", None) or repr(fn)


def _check_function(role: str, fn: Any, n_fixed: int, n_arrays: int) -> None:
    """``fn`` must be a Python function (or ``numba.njit`` function) taking ``n_fixed``
    fixed arguments and then one per array."""
    py = getattr(fn, "py_func", fn)
    if not inspect.isfunction(py):
        raise TypeError(f"{role} must be a Python function; got {type(fn).__name__} {fn!r}")
    try:
        inspect.signature(py).bind(*range(n_fixed + n_arrays))
    except TypeError:
        raise TypeError(f"{role} {_name_of(fn)!r} must take {n_fixed} arguments and then one "
                        f"per array ({n_arrays} given): got the signature "
                        f"{inspect.signature(py)}") from None


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def _as_numpy(role: str, x: Any) -> np.ndarray:
    """The NumPy array a function reads for ``x``: a view of a CPU ``torch.Tensor``'s
    memory (detached: :mod:`attnnb.torch` carries the gradient), else ``np.asarray``."""
    if _is_tensor(x):
        if x.device.type != "cpu":
            raise TypeError(f"{role} is a torch tensor on {x.device}: mods read CPU arrays "
                            "(the cuda backend copies them to the device itself)")
        return x.detach().numpy()
    package = type(x).__module__.split(".")[0]
    if package in ("jax", "jaxlib") and not type(x).__name__.endswith("Tracer"):
        return np.asarray(x)  # a concrete JAX array: its values, a constant to JAX
    if package in ("jax", "jaxlib", "dask", "cupy"):
        raise TypeError(f"{role} is a {type(x).__module__}.{type(x).__name__}: pass NumPy "
                        "arrays (or CPU torch tensors with attnnb.torch; attnnb.jax takes "
                        "mods of concrete arrays, constants of its gradients: build them "
                        "outside jax.jit and jax.grad)")
    return np.asarray(x)


def _check_arrays(role: str, arrays: tuple) -> tuple:
    """The arrays a function reads: real numbers or booleans (or :data:`OFFSET`), never
    written, kept as given (CPU torch tensors as NumPy views)."""
    out = []
    for n, a in enumerate(arrays):
        if a is OFFSET:
            out.append(a)
            continue
        arr = _as_numpy(f"{role}'s array {n}", a)
        if arr.dtype.kind not in "biuf" or arr.dtype.itemsize > 8:
            raise TypeError(f"{role}'s array {n} must hold real numbers or booleans; got dtype "
                            f"{arr.dtype}")
        out.append(arr)
    return tuple(out)


def detached(mod: MaskMod | ScoreMod | None):
    """``mod`` with its parameters as the NumPy arrays its functions read (torch tensors
    as views): what :mod:`attnnb.torch` hands the NumPy functions."""
    if not isinstance(mod, ScoreMod):
        return mod
    if mod.kind != "fn":
        return dataclasses.replace(mod, parts=tuple(detached(p) for p in mod.parts))
    return dataclasses.replace(mod, params=tuple(_as_numpy("a parameter", p)
                                                 for p in mod.params))


def constant(mod: ScoreMod) -> ScoreMod:
    """``mod`` with every array a constant: no gradient into them (fixed ALiBi slopes,
    a frozen bias table), and none computed."""
    if not isinstance(mod, ScoreMod):
        raise TypeError(f"mods.constant takes a score mod; got {type(mod).__name__}")
    if mod.kind != "fn":
        return dataclasses.replace(mod, parts=tuple(constant(p) for p in mod.parts))
    return dataclasses.replace(mod, constant=True)


def parameters(mod: MaskMod | ScoreMod) -> list:
    """A mod's parameter arrays as given (NumPy arrays or torch tensors), in leaf order:
    what :func:`attnnb.vjp`'s ``"score_mod"`` gradients line up with."""
    if mod.kind == "fn":
        return list(getattr(mod, "params", ()))
    return [p for part in mod.parts for p in parameters(part)]


@dataclass(frozen=True, eq=False)
class MaskMod:
    """A mask function bound to its arrays (:func:`mask_mod`), or a composition of them.

    Attributes
    ----------
    kind : {"fn", "and", "or", "not", "at"}
    fn : callable or None
        ``fn(b, h, i, j, *arrays) -> bool`` for ``kind="fn"``.
    arrays : tuple of ndarray
    parts : tuple of MaskMod
        The operands of ``&``, ``|`` and ``~``; ``"at"``: the mod placed in a block of
        a larger call (internal, :func:`attnnb._mod_compile.placed`).
    name : str
    """

    kind: str
    fn: Callable | None = None
    arrays: tuple = ()
    parts: tuple = ()
    name: str = ""
    reads: tuple = ()

    def __and__(self, other: MaskMod) -> MaskMod:
        return MaskMod("and", parts=(self, _as_mask(other, "&")),
                       name=f"({self.name} & {other.name})")

    def __or__(self, other: MaskMod) -> MaskMod:
        return MaskMod("or", parts=(self, _as_mask(other, "|")),
                       name=f"({self.name} | {other.name})")

    def __invert__(self) -> MaskMod:
        return MaskMod("not", parts=(self,), name=f"~{self.name}")

    def fingerprint(self) -> str:
        """Text that names the functions by their content and what they read (constants
        by value, helpers by content, arrays by place: :mod:`attnnb._mod_reads`) and the
        composition; of a mod :func:`resolved` at a call."""
        if self.kind == "fn":
            return f"mask[{_keys(self)};{len(self.arrays)}]"
        return f"{self.kind}(" + ",".join(p.fingerprint() for p in self.parts) + ")"

    def __repr__(self) -> str:
        return f"<mask_mod {self.name}>"


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score function bound to its arrays (:func:`score_mod`), or a chain of them.

    Attributes
    ----------
    kind : {"fn", "chain", "at"}
    fn, grad_s, grad_arrays : callables (``kind="fn"``); see :func:`score_mod`.
    arrays : tuple of ndarray
        What the compiled function reads.
    params : tuple of ndarray
        What gradients are reported for (the arrays, unless a built-in reads
        something derived from its parameters, as :func:`forgetting` reads
        cumulative sums).
    to_params : callable or None
        Maps the gradients of ``arrays`` to those of ``params``.
    constant : bool
        The arrays get no gradient (``None``) and need no ``grad_arrays``.
    parts : tuple of ScoreMod
        A chain's functions, applied in order; ``"at"``: as :class:`MaskMod`'s.
    name : str
    """

    kind: str
    fn: Callable | None = None
    arrays: tuple = ()
    grad_s: Callable | None = None
    grad_arrays: Callable | None = None
    params: tuple = ()
    to_params: Callable | None = None
    constant: bool = False
    parts: tuple = ()
    name: str = ""
    reads: tuple = ()

    def __add__(self, other: ScoreMod) -> ScoreMod:
        if not isinstance(other, ScoreMod):
            raise TypeError(f"score_mod + needs another score mod; got {type(other).__name__}")
        return ScoreMod("chain", parts=(self, other), name=f"({self.name} + {other.name})")

    def fingerprint(self) -> str:
        if self.kind == "fn":
            return f"score[{_keys(self)};{len(self.arrays)}]"
        return f"{self.kind}(" + ",".join(p.fingerprint() for p in self.parts) + ")"

    def __repr__(self) -> str:
        return f"<score_mod {self.name}>"


def _as_mask(other: Any, op: str) -> MaskMod:
    if not isinstance(other, MaskMod):
        raise TypeError(f"mask_mod {op} needs another mask mod; got {type(other).__name__}")
    return other


def mask_mod(fn: Callable, *arrays: Any) -> MaskMod:
    """Bind ``fn(b, h, i, j, *arrays) -> bool`` to the arrays it reads.

    Also a decorator for a function that reads no arrays::

        @mods.mask_mod
        def checkerboard(b, h, i, j):
            return (i + j) % 2 == 0

    Parameters
    ----------
    fn : Python function
        True where query ``i`` (of batch element ``b``, query head ``h``) may
        attend key ``j``.  Compiled by Numba (``nopython``): it may read the
        arrays and use NumPy and ``math`` functions, not Python objects.
    *arrays : array_like
        Read-only arrays, kept as given (not copied).

    Returns
    -------
    MaskMod
    """
    _check_function("mask_mod", fn, 4, len(arrays))
    return MaskMod("fn", fn=fn, arrays=_check_arrays("mask_mod", arrays), name=_name_of(fn))


def score_mod(fn: Callable, *arrays: Any, grad_s: Callable | None = None,
              grad_arrays: Callable | None = None, constant: bool = False) -> ScoreMod:
    """Bind ``fn(s, b, h, i, j, *arrays) -> float`` to the arrays it reads.

    Parameters
    ----------
    fn : Python function
        The new logit for the scaled logit ``s`` of query ``i`` and key ``j``
        (batch element ``b``, query head ``h``).
    *arrays : array_like
        Read-only arrays, kept as given.
    grad_s : Python function, optional
        ``grad_s(s, b, h, i, j, *arrays) -> float``: ``d fn / d s``.  Default:
        the complex step (module docstring).
    grad_arrays : Python function, optional
        ``grad_arrays(g, s, b, h, i, j, grads, *arrays)``: add ``g * d fn /
        d arrays[n][idx]`` to ``grads[n][idx]`` for every entry ``fn`` read.
    constant : bool
        The arrays are constants: no gradient, and no ``grad_arrays`` needed.

    Returns
    -------
    ScoreMod
    """
    _check_function("score_mod", fn, 5, len(arrays))
    if grad_s is not None:
        _check_function("grad_s", grad_s, 5, len(arrays))
    if grad_arrays is not None:
        _check_function("grad_arrays", grad_arrays, 7, len(arrays))
    if not isinstance(constant, bool):
        raise TypeError(f"constant must be True or False; got {constant!r}")
    arrs = _check_arrays("score_mod", arrays)
    return ScoreMod("fn", fn=fn, arrays=arrs, grad_s=grad_s, grad_arrays=grad_arrays,
                    params=tuple(a for a in arrays if a is not OFFSET), constant=constant,
                    name=_name_of(fn))


def resolved(mod: MaskMod | ScoreMod | None) -> MaskMod | ScoreMod | None:
    """``mod`` as its functions read now: every leaf with the snapshot of what its
    functions read (:func:`attnnb._mod_reads.snapshot`: the arrays it reads by name,
    its constants and helpers), taken once per call so that the compiled code, its
    cache key and the arrays passed agree.  A leaf already resolved is kept (a Dask
    graph's tasks run with the values of the call that built it)."""
    if mod is None:
        return None
    if mod.kind != "fn":
        parts = tuple(resolved(p) for p in mod.parts)
        if all(p is q for p, q in zip(parts, mod.parts)):
            return mod
        return dataclasses.replace(mod, parts=parts)
    if mod.reads:
        return mod
    from ._mod_reads import snapshot

    roles = ("mask_mod",) if isinstance(mod, MaskMod) else ("score_mod", "grad_s",
                                                             "grad_arrays")
    fns = (mod.fn,) if isinstance(mod, MaskMod) else (mod.fn, mod.grad_s, mod.grad_arrays)
    return dataclasses.replace(mod, reads=tuple(
        None if fn is None else snapshot(fn, role) for fn, role in zip(fns, roles)))


def implicit_arrays(leaf: MaskMod | ScoreMod) -> tuple:
    """The arrays a resolved leaf's functions read by name, after its own arrays: those
    of ``fn``, then ``grad_s``'s, then ``grad_arrays``'."""
    _keys(leaf)  # (raises for a leaf not resolved)
    return sum((node.arrays for node in leaf.reads if node is not None), ())


def as_mask_mod(value: Any) -> MaskMod | None:
    """``mask_mod=`` as :func:`attnnb.attention` takes it: None, a :class:`MaskMod`, or a
    Python function of ``(b, h, i, j)``."""
    if value is None or isinstance(value, MaskMod):
        return value
    if isinstance(value, ScoreMod):
        raise TypeError(f"mask_mod got a score mod {value!r}: pass it as score_mod=")
    return mask_mod(value)


def as_score_mod(value: Any) -> ScoreMod | None:
    """``score_mod=``: None, a :class:`ScoreMod`, or a Python function of ``(s, b, h, i,
    j)``."""
    if value is None or isinstance(value, ScoreMod):
        return value
    if isinstance(value, MaskMod):
        raise TypeError(f"score_mod got a mask mod {value!r}: pass it as mask_mod=")
    return score_mod(value)


# ---------------------------------------------------------------------------
# built-in masks (positions: the query at key position i + offset[0])


def _causal(b, h, i, j, offset):
    return j <= i + offset[0]


def _window(b, h, i, j, offset, width):
    d = i + offset[0] - j
    return (d >= 0) & (d < width[0])


def _first_keys(b, h, i, j, n):
    return j < n[0]


def _prefix(b, h, i, j, offset, n):
    return (j < n[0]) | (j <= i + offset[0])


def _same_document(b, h, i, j, offset, q_ids, kv_ids):
    qb = b if q_ids.shape[0] > 1 else 0
    kb = b if kv_ids.shape[0] > 1 else 0
    return q_ids[qb, i] == kv_ids[kb, j]


#: Key ``j`` allowed for query ``i`` when ``j <= i + Lk - Lq`` (bottom-right aligned).
causal = MaskMod("fn", fn=_causal, arrays=(OFFSET,), name="causal")


def _int_scalar(name: str, value: Any, low: int) -> np.ndarray:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer; got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    return np.array([int(value)], np.int64)


def sliding_window(width: int) -> MaskMod:
    """The last ``width`` keys up to the query's own position (Mistral's window, with the
    causal limit): ``0 <= (i + Lk - Lq) - j < width``.  Combine with :func:`sinks` by
    ``|`` for StreamingLLM."""
    return MaskMod("fn", fn=_window, arrays=(OFFSET, _int_scalar("width", width, 1)),
                   name=f"sliding_window({width})")


def sinks(n: int) -> MaskMod:
    """The first ``n`` keys, for every query (StreamingLLM's sink tokens); with
    :func:`sliding_window` as ``sliding_window(w) | sinks(n)``."""
    return MaskMod("fn", fn=_first_keys, arrays=(_int_scalar("n", n, 0),), name=f"sinks({n})")


def prefix_lm(n: int) -> MaskMod:
    """A prefix LM: the first ``n`` keys for every query, causal after them."""
    return MaskMod("fn", fn=_prefix, arrays=(OFFSET, _int_scalar("n", n, 0)),
                   name=f"prefix_lm({n})")


def _ids(name: str, ids: Any) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iub" or arr.ndim not in (1, 2):
        raise TypeError(f"{name} must be a 1-D (L,) or 2-D (batch, L) integer array; got "
                        f"dtype {arr.dtype}, shape {arr.shape}")
    return np.ascontiguousarray(arr.reshape((1,) * (2 - arr.ndim) + arr.shape), np.int64)


def document(ids: Any, kv_ids: Any = None) -> MaskMod:
    """Attention within a document only (packed sequences).

    Parameters
    ----------
    ids : int array ``(Lq,)`` or ``(B, Lq)``
        The document of each query (of each flattened batch element).
    kv_ids : int array ``(Lk,)`` or ``(B, Lk)``, optional
        The document of each key; default ``ids`` (then ``Lq == Lk``).

    Combine with :data:`causal` for packed causal language modelling.
    """
    q_ids = _ids("ids", ids)
    k_ids = q_ids if kv_ids is None else _ids("kv_ids", kv_ids)
    return MaskMod("fn", fn=_same_document, arrays=(OFFSET, q_ids, k_ids), name="document")


def from_cu_seqlens(cu_seqlens: Any) -> MaskMod:
    """:func:`document` from FlashAttention's varlen ``cu_seqlens`` ``(n_docs + 1,)``:
    ``[0, l_1, l_1 + l_2, ...]``, the packed sequences' boundaries."""
    cu = np.asarray(cu_seqlens)
    if cu.dtype.kind not in "iu" or cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or np.any(
            np.diff(cu) < 0):
        raise ValueError("cu_seqlens must be a 1-D nondecreasing integer array starting at 0;"
                         f" got {cu!r}")
    ids = np.repeat(np.arange(cu.size - 1), np.diff(cu))
    mod = document(ids)
    return MaskMod(mod.kind, fn=mod.fn, arrays=mod.arrays, name="from_cu_seqlens")


# ---------------------------------------------------------------------------
# built-in score functions, with their derivatives


def like(s, x):
    """``x`` as a number of the logit ``s``'s type.  Compiled, a float32 ``s`` makes it a
    float32: an integer times a float32 is a float64 in Numba, a float64 operation the
    cuda kernels' float32 arithmetic should not carry."""
    return float(x)


like._attnnb_overloaded = True  # compiled by its overload (attnnb._mod_reads.OVERLOADED)


def _alibi(s, b, h, i, j, offset, slopes):
    return s + slopes[h] * like(s, j - i - offset[0])


def _alibi_ds(s, b, h, i, j, offset, slopes):
    return like(s, 1)


def _alibi_da(g, s, b, h, i, j, grads, offset, slopes):
    grads[1][h] += g * (j - i - offset[0])


def alibi(slopes: Any) -> ScoreMod:
    """ALiBi (Press et al. 2022): ``s + slopes[h] * (j - i')`` with ``i' = i + Lk - Lq``
    the query's position; ``slopes`` ``(Hq,)`` float, learnable (gradient by
    :func:`attnnb.vjp`)."""
    arr = _as_numpy("slopes", slopes)
    if arr.ndim != 1 or arr.dtype.kind != "f":
        raise TypeError(f"slopes must be a 1-D float array (one per query head); got dtype "
                        f"{arr.dtype}, shape {arr.shape}")
    return _builtin(_alibi, (OFFSET, arr), _alibi_ds, _alibi_da, "alibi", (slopes,))


def capped_tanh(s, cap):
    """``tanh(s / cap)``.  Compiled, a float32 ``s`` takes a vectorisable rational
    approximation in float32 (:func:`attnnb._mod_compile.capped_tanh_compiled`)."""
    return math.tanh(s / cap)


capped_tanh._attnnb_overloaded = True


def _softcap(s, b, h, i, j, cap):
    return cap[0] * capped_tanh(s, cap[0])


def _softcap_ds(s, b, h, i, j, cap):
    t = capped_tanh(s, cap[0])
    return 1.0 - t * t


def _softcap_da(g, s, b, h, i, j, grads, cap):
    x = s / cap[0]
    t = capped_tanh(s, cap[0])
    grads[0][0] += g * (t - x * (1.0 - t * t))


def softcap(cap: Any) -> ScoreMod:
    """Logit soft-capping (Gemma 2, Grok): ``cap * tanh(s / cap)``; ``cap`` a positive
    number (a constant), or a one-element float array or tensor (which then gets a
    gradient).  Float32 logits take a float32 rational ``tanh`` (relative error 3.3e-7;
    a libm call per logit kept the loop from vectorising)."""
    given = cap if _is_tensor(cap) or isinstance(cap, np.ndarray) else np.float64(cap)
    arr = _as_numpy("cap", given)
    if arr.dtype.kind != "f" or arr.size != 1 or arr.ndim > 1:
        raise ValueError(f"cap must be one positive finite number; got {cap!r}")
    if arr.ndim == 0:  # a number, or a 0-d array or tensor: a (1,) view of it
        arr = arr.reshape(1)
    if not (arr[0] > 0 and np.isfinite(arr[0])):
        raise ValueError(f"cap must be one positive finite number; got {cap!r}")
    mod = _builtin(_softcap, (arr,), _softcap_ds, _softcap_da, f"softcap({float(arr[0])})",
                   (given,))
    if not (_is_tensor(cap) or isinstance(cap, np.ndarray)):
        mod = dataclasses.replace(mod, constant=True)  # a number: no gradient to compute
    return mod


def _t5_bucket(relative, bidirectional, num_buckets, max_distance):
    """transformers' ``T5Attention._relative_position_bucket`` for one ``j - i``, its
    logarithm in float32 as there, so that the buckets are the same."""
    bucket = 0
    n = num_buckets
    if bidirectional:
        n = n // 2
        if relative > 0:
            bucket += n
        relative = abs(relative)
    else:
        relative = -min(relative, 0)
    max_exact = n // 2
    if relative < max_exact:
        return bucket + relative
    ratio = np.float32(relative) / np.float32(max_exact)
    scaled = np.float32(np.log(ratio)) / np.float32(math.log(max_distance / max_exact))
    large = max_exact + int(scaled * np.float32(n - max_exact))
    return bucket + min(large, n - 1)


def _relative(s, b, h, i, j, offset, table, config):
    bucket = _t5_bucket(j - i - offset[0], config[0] != 0, config[1], config[2])
    return s + table[bucket, h]


def _relative_ds(s, b, h, i, j, offset, table, config):
    return 1.0


def _relative_da(g, s, b, h, i, j, grads, offset, table, config):
    bucket = _t5_bucket(j - i - offset[0], config[0] != 0, config[1], config[2])
    grads[1][bucket, h] += g


def relative_bias(table: Any, num_buckets: int = 32, max_distance: int = 128,
                  bidirectional: bool = True) -> ScoreMod:
    """T5's relative position bias: ``s + table[bucket(j - i'), h]``.

    ``table`` ``(num_buckets, Hq)`` float, as T5's ``relative_attention_bias.weight``;
    the buckets as transformers' ``T5Attention._relative_position_bucket``
    (``bidirectional=True`` for encoders, False for decoders).  ``table`` gets a gradient.
    """
    arr = _as_numpy("table", table)
    nb = int(_int_scalar("num_buckets", num_buckets, 2)[0])
    md = int(_int_scalar("max_distance", max_distance, 1)[0])
    if arr.ndim != 2 or arr.dtype.kind != "f" or arr.shape[0] != nb:
        raise TypeError(f"table must be a float array (num_buckets={nb}, heads); got dtype "
                        f"{arr.dtype}, shape {arr.shape}")
    config = np.array([int(bool(bidirectional)), nb, md], np.int64)
    return _builtin(_relative, (OFFSET, arr, config), _relative_ds, _relative_da,
                    "relative_bias", (table, config))


def _forgetting(s, b, h, i, j, offset, cum):
    cb = b if cum.shape[0] > 1 else 0
    return s + cum[cb, h, i + offset[0]] - cum[cb, h, j]


def _forgetting_ds(s, b, h, i, j, offset, cum):
    return 1.0


def _forgetting_da(g, s, b, h, i, j, grads, offset, cum):
    cb = b if cum.shape[0] > 1 else 0
    grads[1][cb, h, i + offset[0]] += g
    grads[1][cb, h, j] -= g


def forgetting(log_f: Any) -> ScoreMod:
    """The Forgetting Transformer's decay (Lin et al. 2025): ``s + c_i' - c_j`` with
    ``c = cumsum(log_f)`` along the keys, ``log_f`` ``(Hq, Lk)`` or ``(B, Hq, Lk)``
    the log forget gates (``<= 0``); ``log_f`` gets a gradient.  Use with ``causal``."""
    arr = _as_numpy("log_f", log_f)
    if arr.ndim not in (2, 3) or arr.dtype.kind != "f":
        raise TypeError(f"log_f must be a float array (heads, L) or (batch, heads, L); got "
                        f"dtype {arr.dtype}, shape {arr.shape}")
    arr3 = arr.reshape((1,) * (3 - arr.ndim) + arr.shape)
    cum = np.cumsum(arr3, axis=-1)

    def to_log_f(grads):  # d c -> d log_f: c_t = sum_{u <= t} log_f_u
        dcum = grads[0]
        if dcum is None:
            return (None,)
        dlog = np.flip(np.cumsum(np.flip(dcum, -1), -1), -1)
        return (dlog.reshape(arr.shape),)

    mod = _builtin(_forgetting, (OFFSET, cum), _forgetting_ds, _forgetting_da, "forgetting",
                   (log_f,))
    object.__setattr__(mod, "to_params", to_log_f)
    return mod


def _builtin(fn, arrays, grad_s, grad_arrays, name, params) -> ScoreMod:
    """A built-in score mod: ``params`` are its arrays as the caller gave them."""
    return ScoreMod("fn", fn=fn, arrays=arrays, grad_s=grad_s, grad_arrays=grad_arrays,
                    params=params, name=name)


def check(mod: ScoreMod, *, points: int = 64, seed: int = 0, shape=(2, 2, 8, 8),
          rtol: float = 1e-5) -> None:
    """Compare a score mod's derivatives with central differences at random points.

    Draws ``points`` logits ``s`` in ``[-3, 3]`` and indices ``(b, h, i, j)``
    within ``shape`` ``(B, H, Lq, Lk)`` (which the mod's arrays must cover),
    and checks ``d score / d s`` and, unless the mod is constant, the
    gradients into its float arrays (by perturbing each entry) in float64.

    Raises
    ------
    AssertionError
        Naming the function, the derivative and the first point that
        disagrees.
    """
    from ._mod_compile import check_derivatives

    check_derivatives(mod, points=points, seed=seed, shape=shape, rtol=rtol)
