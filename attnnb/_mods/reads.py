"""What a mask or score function reads, taken at the moment of a call.

A user's function (and every helper it calls, to any depth) reads names it
does not define: globals, closure cells, default arguments.  Numba freezes
what such a name holds into the compiled code, and its caches do not look at
it, so a function over a rebound global array, a closure over a new layout
or a constant edited in the user's file would silently keep the first value.
The rule here (docs/contract.md §2.10, "What a function reads"):

* **arrays** (NumPy arrays, CPU torch tensors, concrete JAX arrays) are
  read at every call: the function is rebuilt from its source to take them
  as arguments, and the kernels get them as they get a mod's bound arrays,
  so a new value needs no compile;
* **numbers, strings, None, and tuples of them** are constants of the
  compiled code, keyed by their whole value: a changed value compiles its
  own specialisation;
* **functions** (plain or ``numba.njit``) are helpers, followed to any depth
  and keyed by their code and what they read, never by their address;
* **modules** NumPy, ``math``, ``cmath``, ``operator``, Numba and
  :mod:`attnnb` itself, the built-ins and their functions are used as
  they are;
* anything else (a list, a dict, an object, a module of the user's, a
  torch tensor that requires grad) is refused by a ``TypeError`` that names
  the function and the name.

:func:`snapshot` takes this for one function, :class:`Node` is the result:
its :attr:`~Node.key` (a digest of everything the compiled code depends on,
the same in every process for the same code and values), its
:attr:`~Node.arrays` (read now) and :meth:`~Node.compiled`, the function
Numba compiles, which takes the arrays first: ``fn(*arrays, *params)``.
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import inspect
import linecache
import sys
import textwrap
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from .._core.specialise import global_names, rebind

_LIBRARIES = ("numpy", "numba", "math", "cmath", "operator", "builtins", "llvmlite",
              "attnnb", "_operator")
_SLOT = "__attnnb_array_{}"
_CONSTANT_TYPES = (bool, int, float, complex, str, bytes, type(None), np.number, np.bool_)


def _library(value: Any) -> bool:
    """A module, function or type of a library the compiled code uses as it is (attnnb's
    own functions are helpers like the user's, but for those compiled by an overload)."""
    if isinstance(value, types.ModuleType):
        return value.__name__.split(".")[0] in _LIBRARIES
    module = (getattr(value, "__module__", None) or "").split(".")[0]
    if module == "attnnb" and isinstance(_python_function(value), types.FunctionType):
        return getattr(value, OVERLOADED, False)
    return module in _LIBRARIES


#: The attribute that marks a function of attnnb compiled by its Numba overload
#: (:func:`attnnb.mods.like`): used as it is, not followed as a helper.
OVERLOADED = "_attnnb_overloaded"


def _python_function(value: Any):
    """The Python function behind ``value`` (itself, or a ``numba.njit`` dispatcher's),
    or None."""
    py = getattr(value, "py_func", value)
    return py if isinstance(py, types.FunctionType) else None


def _constant_key(value: Any) -> str | None:
    """The text that keys a constant by its whole value, or None if it is no constant."""
    if isinstance(value, tuple):
        parts = [_constant_key(v) for v in value]
        return None if None in parts else "(" + ",".join(parts) + ")"
    if isinstance(value, _CONSTANT_TYPES):
        if isinstance(value, (float, np.floating)):
            return f"{type(value).__name__}:{float(value).hex()}"
        return f"{type(value).__name__}:{value!r}"
    return None


@functools.lru_cache(maxsize=4096)
def code_digest(code: types.CodeType) -> str:
    """A digest of what ``code`` does: its bytecode, names and constants (nested code
    followed), not its line numbers or file, so that a comment or a move changes nothing."""
    digest = hashlib.sha256()
    for part in (code.co_code, code.co_names, code.co_varnames, code.co_freevars,
                 code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
                 code.co_kwonlyargcount, code.co_flags,
                 getattr(code, "co_exceptiontable", b"")):
        digest.update(repr(part).encode())
        digest.update(b"\0")
    for const in code.co_consts:
        text = code_digest(const) if isinstance(const, types.CodeType) else (
            f"{type(const).__name__}:{const!r}")
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _as_array(value: Any) -> np.ndarray | None:
    """The NumPy array a name's value is read as, or None if it is no array."""
    if isinstance(value, np.ndarray):
        return value
    package = type(value).__module__.split(".")[0]
    if package == "torch" and hasattr(value, "detach"):
        return value  # checked and viewed by _array_value
    if package in ("jax", "jaxlib") and hasattr(value, "shape"):
        return value
    return None


def _importable(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` (a copy) named after a module Python can import: Numba names a compiled
    function's environment after its module and imports that module again when a cached
    kernel that inlines the function is loaded in another process, so a function from a
    module loaded by path (not in ``sys.modules``) or made by ``exec`` takes this
    module's name (its code and what it reads are unchanged)."""
    if sys.modules.get(fn.__module__) is None:
        fn.__module__ = __name__
    return fn


class Node:
    """What one function reads at one moment (:func:`snapshot`).

    Attributes
    ----------
    py : function
        The Python function (a ``numba.njit`` function's ``py_func``).
    key : str
        A digest of its code and of what it reads (constants by value, helpers by
        their keys, arrays by their place only).
    arrays : tuple of ndarray
        The arrays it reads, its helpers' included, in the order ``compiled`` takes
        them.
    """

    def __init__(self, py: types.FunctionType, role: str):
        self.py, self.role = py, role
        self.constants: dict[str, Any] = {}   # name -> value, bound in the compiled code
        self.helpers: dict[str, Node] = {}    # name -> the helper's node
        self.own_arrays: dict[str, int] = {}  # name -> slot (into the root's arrays)
        self.array_defaults: dict[str, int] = {}  # parameter -> slot
        self.slots: list[int] = []            # every slot it and its helpers read
        self.key = ""
        self.arrays: tuple = ()

    @property
    def name(self) -> str:
        return self.py.__qualname__

    def compiled(self, decorate: Callable) -> Any:
        """The function ``decorate`` compiles: ``py`` with its constants and helpers bound
        and, when it reads arrays, rebuilt from its source to take them first."""
        memo_key = (self.key, decorate)
        with _lock:
            found = _built.get(memo_key)
        if found is not None:
            return found
        helpers = {n: h.compiled(decorate) for n, h in self.helpers.items()}
        plain = (self._rebuilt(helpers) if self.slots
                 else self._rebound({**self.constants, **helpers}))
        found = decorate(_importable(plain))
        with _lock:
            _built.setdefault(memo_key, found)
        return found

    def python(self) -> Callable:
        """``py`` calling its helpers' Python functions (never a ``numba.njit`` helper
        compiled on its own, which would freeze what it reads), the rest read as it is
        when it runs: what the reference backend evaluates."""
        if not self.helpers:
            return self.py
        return self._rebound({n: h.python() for n, h in self.helpers.items()})

    def _rebound(self, replaced: dict) -> types.FunctionType:
        """``py``'s own code with the names in ``replaced`` bound to their values (its
        globals copied, its closure cells new)."""
        return rebind(self.py, replaced)

    def _rebuilt(self, helpers: dict) -> types.FunctionType:
        """``py`` recompiled from its source with its arrays as leading parameters, and
        the calls to helpers that read arrays passing theirs on."""
        tree, first_line = _function_tree(self)
        renames = {name: _SLOT.format(slot) for name, slot in
                   {**self.own_arrays, **self.array_defaults}.items()}
        calls = {name: [_SLOT.format(s) for s in h.slots] for name, h in self.helpers.items()
                 if h.slots}
        tree = _Rewrite(renames, calls).visit(tree)
        args = tree.args
        kept = [(a, d) for a, d in zip(args.args[len(args.args) - len(args.defaults):],
                                       args.defaults) if a.arg not in self.array_defaults]
        args.args = [ast.arg(arg=_SLOT.format(s)) for s in self.slots] + [
            a for a in args.args if a.arg not in self.array_defaults]
        args.defaults = [ast.Constant(value=None) for _ in kept]
        tree.decorator_list = []
        tree.name = "rebuilt"
        module = ast.Module(body=[tree], type_ignores=[])
        ast.fix_missing_locations(module)
        ast.increment_lineno(module, first_line - 1)
        scope = dict(self.py.__globals__)
        scope.update(self.constants)
        scope.update(helpers)
        for name, cell in zip(self.py.__code__.co_freevars, self.py.__closure__ or ()):
            if name not in self.constants and name not in helpers and (
                    name not in self.own_arrays):
                try:  # a library module or function held in a closure
                    scope[name] = cell.cell_contents
                except ValueError:  # an empty cell: Numba names it
                    pass
        exec(compile(module, self.py.__code__.co_filename, "exec"), scope)  # noqa: S102
        out = scope["rebuilt"]
        values = [v for p, v in _defaults(self.py) if p not in self.array_defaults]
        out.__defaults__ = tuple(values) or None
        out.__qualname__ = self.py.__qualname__
        out.__module__ = self.py.__module__
        return out


class _Rewrite(ast.NodeTransformer):
    """Array names to their parameters; helper calls given their arrays first."""

    def __init__(self, renames: dict, calls: dict):
        self.renames, self.calls = renames, calls

    def visit_Name(self, node):
        if node.id in self.renames:
            return ast.copy_location(ast.Name(id=self.renames[node.id], ctx=node.ctx), node)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in self.calls:
            node.args = [ast.Name(id=n, ctx=ast.Load()) for n in self.calls[node.func.id]] + (
                node.args)
        return node


def _defaults(py) -> list:
    """``(parameter, default)`` of ``py``'s positional parameters that have one."""
    code, values = py.__code__, py.__defaults__ or ()
    names = code.co_varnames[:code.co_argcount]
    return list(zip(names[len(names) - len(values):], values))


def _function_tree(node: Node):
    """The ``def`` (a ``lambda`` made one) of ``node.py`` from its source, and the line
    of the file it starts on; a ``TypeError`` when the source cannot be read."""
    py = node.py
    reads = ", ".join(sorted({**node.own_arrays, **node.array_defaults}))
    why = (f"{node.role} {node.name!r} reads arrays by name ({reads or 'through helpers'}), "
           "which attnnb passes to the kernels at every call by recompiling the function "
           "from its source")
    if py.__name__ == "<lambda>":
        return _lambda_tree(py, why)
    try:
        lines, first = inspect.getsourcelines(py)
    except (OSError, TypeError):
        raise TypeError(f"{why}; its source cannot be read: define it in a file, or bind "
                        "the arrays as the mod's arrays (mods.mask_mod(fn, array))") from None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef):
        raise TypeError(f"{why}; its source is not a plain def")
    return fn, first


def _lambda_tree(py, why: str):
    code = py.__code__
    lines = linecache.getlines(code.co_filename)
    try:
        tree = ast.parse("".join(lines))
    except SyntaxError:
        tree = None
    params = list(code.co_varnames[:code.co_argcount])
    found = [] if tree is None else [
        n for n in ast.walk(tree) if isinstance(n, ast.Lambda)
        and n.lineno == code.co_firstlineno and [a.arg for a in n.args.args] == params]
    if len({ast.dump(n) for n in found}) != 1:
        raise TypeError(f"{why}; the lambda's source cannot be told apart in "
                        f"{code.co_filename}, line {code.co_firstlineno}: write it as a def")
    lam = found[0]
    fields = dict(name="rebuilt", args=lam.args, body=[ast.Return(value=lam.body)],
                  decorator_list=[], returns=None)
    if "type_params" in ast.FunctionDef._fields:  # Python 3.12 and later
        fields["type_params"] = []
    fn = ast.FunctionDef(**fields)
    ast.copy_location(fn, lam)
    # the lambda's lines relative to line 1, as a def parsed from its own source would be
    ast.increment_lineno(fn, 1 - lam.lineno)
    return fn, lam.lineno


_lock = threading.RLock()
_built: dict = {}


class _Walk:
    """One snapshot: the functions being walked, and the arrays read so far (slots)."""

    def __init__(self, role: str):
        self.role = role
        self.arrays: list = []
        self.stack: list = []

    def slot(self, value) -> int:
        self.arrays.append(value)
        return len(self.arrays) - 1

    def node(self, py: types.FunctionType) -> Node:
        """A new node for every reference (a tree: a node's arrays are its own slots, in
        the order its structure gives, so that one key means one parameter layout)."""
        if py in self.stack:
            raise TypeError(f"{self.role} {self.stack[0].__qualname__!r} calls "
                            f"{py.__qualname__!r} recursively: mods compile without recursion")
        self.stack.append(py)
        node = Node(py, self.role)
        parts = [py.__qualname__, code_digest(py.__code__)]
        cells = dict(zip(py.__code__.co_freevars, py.__closure__ or ()))
        names = [(n, "cell") for n in py.__code__.co_freevars] + [
            (n, "global") for n in global_names(py.__code__) if n not in cells]
        for name, where in names:
            parts.append(self._read(node, name, where, cells))
        for param, value in _defaults(py):
            parts.append(self._default(node, param, value))
        slots = set(node.own_arrays.values()) | set(node.array_defaults.values())
        for helper in node.helpers.values():
            slots |= set(helper.slots)
        node.slots = sorted(slots)  # (contiguous: slots are taken in the walk's order)
        node.key = hashlib.sha256("|".join(parts).encode()).hexdigest()
        self.stack.pop()
        return node

    def _value(self, name: str, where: str, cells: dict):
        if where == "cell":
            try:
                return True, cells[name].cell_contents
            except ValueError:
                return False, None
        scope = self.stack[-1].__globals__
        if name in scope:
            return True, scope[name]
        if hasattr(builtins, name):
            return True, getattr(builtins, name)
        return False, None

    def _read(self, node: Node, name: str, where: str, cells: dict) -> str:
        found, value = self._value(name, where, cells)
        if not found:
            return f"{name}=?"  # undefined: Numba names it when it compiles
        return f"{name}=" + self._classify(node, name, value, where)

    def _classify(self, node: Node, name: str, value, where: str) -> str:
        array = _as_array(value)
        if array is not None:
            node.own_arrays[name] = self.slot(_array_value(self._who(name), array))
            return f"array#{node.own_arrays[name]}"
        py = _python_function(value)
        if isinstance(value, np.ufunc):
            return f"lib:numpy.{value.__name__}"
        if py is not None and not _library(py):
            helper = self.node(py)
            node.helpers[name] = helper
            return f"fn:{helper.key}"
        if isinstance(value, types.ModuleType) or _library(value) or (
                getattr(value, "__module__", None) == "builtins"):
            if isinstance(value, types.ModuleType) and not _library(value):
                raise TypeError(f"{self._who(name)} is the module {value.__name__!r}: mods "
                                "read NumPy, math and Numba's modules only (Numba would "
                                "freeze its attributes unseen); read its values into "
                                "names or arrays of your own")
            module = value.__name__ if isinstance(value, types.ModuleType) else (
                f"{getattr(value, '__module__', '')}."
                f"{getattr(value, '__qualname__', type(value).__name__)}")
            return f"lib:{module}"
        key = _constant_key(value)
        if key is not None:
            node.constants[name] = value
            return f"const:{key}"
        raise TypeError(
            f"{self._who(name)} is a {type(value).__module__}.{type(value).__name__}, which "
            "compiled code cannot read: mods read NumPy arrays (read at every call), "
            "numbers, strings and tuples of them (constants), and functions")

    def _default(self, node: Node, param: str, value) -> str:
        array = _as_array(value)
        if array is not None:
            node.array_defaults[param] = self.slot(_array_value(self._who(param), array))
            return f"default {param}=array#{node.array_defaults[param]}"
        key = _constant_key(value)
        if key is None:
            raise TypeError(f"{self._who(param)} (a default argument) is a "
                            f"{type(value).__name__}: defaults must be arrays, numbers, "
                            "strings or tuples of them")
        return f"default {param}=const:{key}"

    def _who(self, name: str) -> str:
        fn = self.stack[-1]
        path = " -> ".join(repr(f.__qualname__) for f in self.stack)
        where = "its helper " + path if len(self.stack) > 1 else repr(fn.__qualname__)
        return f"{self.role} {where} reads {name!r}, which"


def _array_value(who: str, value) -> np.ndarray:
    """A name's array as the kernels read it (checked like a mod's bound arrays)."""
    package = type(value).__module__.split(".")[0]
    if package == "torch":
        if getattr(value, "requires_grad", False):
            raise TypeError(f"{who} is a torch.Tensor that requires grad: an array read by "
                            "name is a constant to gradients; bind it as the mod's array "
                            "(mods.score_mod(fn, tensor)) for attnnb.torch to carry its "
                            "gradient, or detach it")
        if value.device.type != "cpu":
            raise TypeError(f"{who} is a torch tensor on {value.device}: mods read CPU "
                            "arrays")
        value = value.detach().numpy()
    elif isinstance(value, np.ndarray) and type(value) is not np.ndarray:
        raise TypeError(f"{who} is a {type(value).__module__}.{type(value).__name__}: mods "
                        "read plain NumPy arrays (a subclass's mask or meaning would be "
                        "lost); pass np.asarray of it")
    elif package in ("jax", "jaxlib"):
        if type(value).__name__.endswith("Tracer"):
            raise TypeError(f"{who} is a traced JAX value: mods read concrete arrays")
        value = np.asarray(value)
    if value.dtype.kind not in "biuf" or value.dtype.itemsize > 8:
        raise TypeError(f"{who} is an array of dtype {value.dtype}: mods read real numbers "
                        "or booleans")
    return value


def snapshot(fn: Callable, role: str) -> Node:
    """What ``fn`` reads now (module docstring); ``role`` names it in errors
    (``"mask_mod"``, ``"grad_s"``, ...)."""
    py = _python_function(fn)
    if py is None:
        raise TypeError(f"{role} must be a Python function; got {type(fn).__name__} {fn!r}")
    walk = _Walk(role)
    node = walk.node(py)
    node.arrays = tuple(walk.arrays)
    return node
