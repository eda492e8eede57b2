"""One way to build a variant of compiled code: a template plus named bindings.

A backend's compiled functions read what they vary on (a mask or score
function's hooks, the dropout generator's mixer, a dtype's constants) through
global names, which Numba and ``numba.cuda`` resolve at compile time.  A
variant is a copy of the function over the same code with some of those names
bound to other values, compiled by the same decorator:

* :func:`rebind` copies one Python function with names bound, in its globals
  and in its closure cells;
* :func:`template` marks a compiled function as one that :func:`specialise`
  may copy, keeping the decorator that made it;
* :func:`specialise` copies a template, and every template on the way from it
  to a bound name, under a qualified name that ends in the bindings' ``tag``
  (Numba's disk cache keys a function by its name and code, not its globals,
  so copies of one template must differ by name).  Templates that reach no
  bound name are shared, not copied.

It fails loudly rather than build a variant without its bindings: a name in
``required`` that no copied function reads is a ``LookupError``, and with
``originals`` (the namespace the bound names come from) a function that
reads an original under another name (``from hooks import mod_value as
value``) is bound all the same, where binding by name alone would miss it.
"""

from __future__ import annotations

import dis
import functools
import numbers
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# the attribute of a compiled function that holds its Python function and how to compile
# a copy of it
REMAKE = "_attnnb_remake"

_copies: dict = {}
_lock = threading.RLock()


@functools.lru_cache(maxsize=4096)  # read on every call with a mask or score function
def global_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` and the code nested in it load, in order of first use."""
    names: dict[str, None] = {}
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names.setdefault(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(global_names(const)))
    return tuple(names)


def rebind(fn: types.FunctionType, bindings: Mapping[str, Any], *,
           qualname: str | None = None) -> types.FunctionType:
    """``fn``'s own code over a copy of its globals and new closure cells, with the names
    in ``bindings`` that it reads bound to their values; named ``qualname`` if given."""
    scope = dict(fn.__globals__)
    read = global_names(fn.__code__)
    scope.update((n, v) for n, v in bindings.items() if n in read)
    cells = fn.__closure__
    if cells:
        cells = tuple(types.CellType(bindings[name]) if name in bindings else cell
                      for name, cell in zip(fn.__code__.co_freevars, cells))
    out = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, cells)
    out.__qualname__ = fn.__qualname__ if qualname is None else qualname
    out.__module__, out.__doc__ = fn.__module__, fn.__doc__
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def template(compiled, remake: Callable, py: types.FunctionType | None = None):
    """Mark ``compiled``, compiled from the Python function ``py`` (by default
    ``compiled.py_func``), as a template that :func:`specialise` copies with
    ``remake(copy_of_py)``."""
    setattr(compiled, REMAKE, (compiled.py_func if py is None else py, remake))
    return compiled


def is_template(value) -> bool:
    return getattr(value, REMAKE, None) is not None


def specialise(compiled, bindings: Mapping[str, Any], tag: str, *,
               required: Iterable[str] = (), originals: Mapping[str, Any] | None = None):
    """``compiled`` with the global names in ``bindings`` bound to their values, in it and
    in every template it calls on the way to them; ``compiled`` itself where it reads none.

    Parameters
    ----------
    compiled : template (:func:`template`)
        The function to copy.
    bindings : mapping of str to any
        Global names and the values the copy reads for them.
    tag : str
        Names the bindings and must differ whenever they do: it ends the copies'
        qualified names and keys this process's memo (a tag met again with other numbers
        or strings bound is a ``ValueError``).
    required : iterable of str
        Names that some copied function must read (``LookupError`` otherwise).
    originals : mapping of str to any, optional
        The values the bound names have where the templates import them from.  A global
        holding one of these objects under another name is bound too, and a global of a
        bound name that holds some other object is left alone.
    """
    originals = {} if originals is None else {n: originals[n] for n in bindings}
    aliases = {id(v): n for n, v in originals.items()
               if not isinstance(v, (bool, int, float, str, type(None)))}
    constants = _constants(bindings)
    with _lock:
        reached: set[str] = set()
        out = _copy(compiled, bindings, tag, originals, aliases, reached, constants)
    missing = sorted(set(required) - reached)
    if missing:
        name = getattr(compiled, REMAKE)[0].__qualname__
        raise LookupError(f"{name} reads no {', '.join(missing)}: its variant would be built "
                          "without them")
    return out


def _bound_name(name: str, value, bindings, originals, aliases) -> str | None:
    """The binding a global ``name`` holding ``value`` takes, or None."""
    if name in bindings and (name not in originals or value is originals[name]):
        return name
    return aliases.get(id(value))


def _constants(bindings) -> tuple:
    """The bindings that are numbers or strings, as text (NaN equals itself there)."""
    return tuple(sorted((n, type(v).__name__, repr(v)) for n, v in bindings.items()
                        if isinstance(v, (numbers.Number, str, bytes, type(None)))))


def _copy(compiled, bindings, tag, originals, aliases, reached, constants):
    found = _copies.get((compiled, tag))
    if found is not None:
        copied, names, seen = found
        if seen != constants:
            differ = sorted({c[0] for c in set(seen) ^ set(constants)})
            raise ValueError(f"the tag {tag!r} names two sets of bindings (they differ in "
                             f"{', '.join(differ)}): a variant's tag must name all of them")
        reached |= names
        return copied
    fn, remake = getattr(compiled, REMAKE)
    scope = fn.__globals__
    replaced, names = {}, set()
    for name in global_names(fn.__code__):
        value = scope.get(name)
        bound = _bound_name(name, value, bindings, originals, aliases)
        if bound is not None:
            replaced[name] = bindings[bound]
            names.add(bound)
        elif is_template(value):
            inner: set[str] = set()
            copied = _copy(value, bindings, tag, originals, aliases, inner, constants)
            names |= inner
            if copied is not value:
                replaced[name] = copied
    copied = compiled
    if replaced:
        clone = rebind(fn, replaced, qualname=f"{fn.__qualname__}__{tag}")
        copied = remake(clone)
    _copies[(compiled, tag)] = (copied, frozenset(names), constants)
    reached |= names
    return copied
