"""The one specialisation mechanism (attnnb._core.specialise): templates plus named bindings."""

from __future__ import annotations

import types

import numba
import pytest

from attnnb._core import dropout as _dropout
from attnnb._core.specialise import global_names, rebind, specialise, template


class Compiled:
    """A stand-in for a dispatcher: calls its Python function, remembers how it was made."""

    made: list = []

    def __init__(self, fn):
        self.py_func = fn
        Compiled.made.append(fn.__qualname__)

    def __call__(self, *args):
        return self.py_func(*args)


def compiled(fn):
    return template(Compiled(fn), compiled)


def _module(source: str) -> dict:
    """A fresh module namespace with ``source`` run in it (templates read its globals)."""
    scope = {"compiled": compiled, "__name__": "specimen"}
    exec(source, scope)  # noqa: S102 - the tests' own text
    return scope


SOURCE = """
FLAG = False

def hook(x):
    return x

hook = compiled(hook)
alias = hook

def leaf(x):
    return 2 * x

leaf = compiled(leaf)

def loop(x):
    return (hook(x) if not FLAG else -hook(x)) + leaf(x)

loop = compiled(loop)

def kernel(x):
    return loop(x) + leaf(x)

kernel = compiled(kernel)

def aliased(x):
    return alias(x)

aliased = compiled(aliased)
"""


def test_global_names_include_nested_code_in_order():
    def outer():
        a = first  # noqa: F821 - names only read, never run
        return [second for _ in a] + [lambda: third]  # noqa: F821

    assert global_names(outer.__code__) == ("first", "second", "third")


def test_rebind_binds_globals_and_cells_and_leaves_the_original():
    bound = 1

    def reads(x):
        return x + bound + OTHER  # noqa: F821 - bound below

    out = rebind(reads, {"bound": 10, "OTHER": 100, "unused": 0}, qualname="reads__t")
    assert out(1) == 111
    assert out.__qualname__ == "reads__t"
    assert "unused" not in out.__globals__
    assert reads.__closure__[0].cell_contents == 1 and "OTHER" not in reads.__globals__


def test_specialise_copies_the_path_to_a_binding_and_shares_the_rest():
    ns = _module(SOURCE)
    new_hook = compiled(lambda x: 100 * x)
    out = specialise(ns["kernel"], {"hook": new_hook}, "t1", required=["hook"])
    assert out(1) == 100 + 2 + 2
    assert ns["kernel"](1) == 1 + 2 + 2  # the template is untouched
    assert out.py_func.__qualname__ == "kernel__t1"
    loop_copy = out.py_func.__globals__["loop"]
    assert loop_copy.py_func.__qualname__ == "loop__t1"
    assert out.py_func.__globals__["leaf"] is ns["leaf"]  # reaches no binding: shared
    assert specialise(ns["kernel"], {"hook": new_hook}, "t1") is out  # memo by tag


def test_specialise_binds_constants_by_name():
    ns = _module(SOURCE)
    out = specialise(ns["kernel"], {"FLAG": True}, "flag", required=["FLAG"])
    assert out(1) == -1 + 2 + 2


def test_a_tag_met_again_with_other_constants_is_an_error():
    ns = _module(SOURCE)
    specialise(ns["kernel"], {"FLAG": True, "SIZE": 4}, "same")
    assert specialise(ns["kernel"], {"FLAG": True, "SIZE": 4}, "same")(1) == -1 + 2 + 2
    with pytest.raises(ValueError, match="differ in SIZE"):
        specialise(ns["kernel"], {"FLAG": True, "SIZE": 8}, "same")


def test_a_required_binding_no_function_reads_is_an_error():
    ns = _module(SOURCE)
    with pytest.raises(LookupError, match="leaf reads no hook"):
        specialise(ns["leaf"], {"hook": compiled(abs)}, "miss", required=["hook"])


def test_a_template_that_reaches_nothing_is_itself():
    ns = _module(SOURCE)
    assert specialise(ns["leaf"], {"hook": compiled(abs)}, "none") is ns["leaf"]


def test_originals_bind_a_hook_read_under_another_name():
    ns = _module(SOURCE)
    new_hook = compiled(lambda x: 7 * x)
    by_name = specialise(ns["aliased"], {"hook": new_hook}, "n")
    assert by_name is ns["aliased"]  # by name alone the alias is missed
    out = specialise(ns["aliased"], {"hook": new_hook}, "o", required=["hook"],
                     originals={"hook": ns["hook"]})
    assert out(1) == 7


def test_originals_leave_a_same_named_other_object_alone():
    ns = _module(SOURCE)
    with pytest.raises(LookupError):
        specialise(ns["kernel"], {"hook": compiled(abs)}, "other", required=["hook"],
                   originals={"hook": compiled(abs)})


def test_specialise_with_numba_templates():
    def njit_template(fn):
        return template(numba.njit(fn), njit_template)

    scope = {"njit_template": njit_template}
    exec(  # noqa: S102 - the tests' own text
        "def hook(x):\n    return x\n"
        "hook = njit_template(hook)\n"
        "def kernel(x):\n    return hook(x) + 1.0\n"
        "kernel = njit_template(kernel)\n", scope)
    scaled = numba.njit(lambda x: 3.0 * x)
    out = specialise(scope["kernel"], {"hook": scaled}, "numba", required=["hook"])
    assert out(2.0) == 7.0 and scope["kernel"](2.0) == 3.0
    assert isinstance(out.py_func, types.FunctionType)


def test_dropout_rebound_binds_the_mixer_and_refuses_a_function_without_it():
    calls = []

    def mixer(x):
        calls.append(x)
        return x

    assert _dropout.rebound(_dropout.column_word, lambda fn: mixer if fn is
                            _dropout.mix32 else fn)(5) == 5 ^ _dropout.COLUMN_SALT
    assert calls
    with pytest.raises(LookupError, match="calls no mix32"):
        _dropout.rebound(_dropout.seed_words, lambda fn: fn)
