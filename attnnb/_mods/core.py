"""The records of :mod:`attnnb.mods` (:class:`MaskMod`, :class:`ScoreMod`), their
constructors and checks, the snapshot a call takes of them (:func:`resolved`), and
the functions a mod's own code may call (:func:`like`, :func:`capped_tanh`).

Nothing here imports Numba (:mod:`attnnb._mods.compile` compiles them).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


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
                           "a call (attnnb._mods.core.resolved)")
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


def is_tensor(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def as_numpy(role: str, x: Any) -> np.ndarray:
    """The NumPy array a function reads for ``x``: a view of a CPU ``torch.Tensor``'s
    memory (detached: :mod:`attnnb.torch` carries the gradient), else ``np.asarray``."""
    if is_tensor(x):
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
        arr = as_numpy(f"{role}'s array {n}", a)
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
    return dataclasses.replace(mod, params=tuple(as_numpy("a parameter", p)
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
        a larger call (internal, :func:`attnnb._mods.compile.placed`).
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
        by value, helpers by content, arrays by place: :mod:`attnnb._mods.reads`) and the
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
    functions read (:func:`attnnb._mods.reads.snapshot`: the arrays it reads by name,
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
    from .reads import snapshot

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


def like(s, x):
    """``x`` as a number of the logit ``s``'s type.  Compiled, a float32 ``s`` makes it a
    float32: an integer times a float32 is a float64 in Numba, a float64 operation the
    cuda kernels' float32 arithmetic should not carry."""
    return float(x)


like._attnnb_overloaded = True  # compiled by its overload (attnnb._mods.reads.OVERLOADED)


def capped_tanh(s, cap):
    """``tanh(s / cap)``.  Compiled, a float32 ``s`` takes a vectorisable rational
    approximation in float32 (:func:`attnnb._mods.compile.capped_tanh_compiled`)."""
    return math.tanh(s / cap)


capped_tanh._attnnb_overloaded = True
