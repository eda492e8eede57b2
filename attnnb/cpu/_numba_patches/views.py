"""Array views for the kernels' inner loops that cost no call into Numba's runtime.

Two costs of Numba's own views, paid on every key tile of a sweep, show when
decoding (one query row per tile, so the per-tile costs are large next to the
arithmetic):

* **Reference counts.**  Every array value Numba binds (a view, a slice, an
  argument of an inlined function) adds one to its owner's count and takes
  one away after, each an atomic instruction, most of them on the task's own
  scratch.  :func:`unowned` makes aliases without an
  owner (Numba skips the count of those), :func:`keep_alive` keeps the owners
  alive for as long as the aliases are used.
* **Reshapes.**  ``x.reshape(...)`` calls a helper of Numba's runtime that
  checks whether the new shape needs a copy.
  :func:`flat` and :func:`rows_of` make the views the tiled core takes of
  C-contiguous arrays directly (every array they see is C-contiguous: a
  scratch buffer, or a head of a C-contiguous input).

The cost figures are in docs/notes/performance.md ("One sweep for the gradients, and
what a tile's views cost").  Where the gate (:mod:`attnnb.cpu._numba_patches`) is
closed, the four names are plain Numba functions with the same meaning: the
array itself, nothing, ``x.reshape(x.size)`` and
``x[:rows * cols].reshape((rows, cols))``.
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload, register_jitable
from numba.np.arrayobj import populate_array

from . import ACTIVE


def _alias(context, builder, typ, value):
    """``value`` of Numba type ``typ`` with every array in it made ownerless."""
    if isinstance(typ, types.Array):
        src = context.make_array(typ)(context, builder, value=value)
        alias = context.make_array(typ)(context, builder)
        for field in ("nitems", "itemsize", "data", "shape", "strides"):
            setattr(alias, field, getattr(src, field))
        alias.meminfo = cgutils.get_null_value(alias.meminfo.type)
        alias.parent = cgutils.get_null_value(alias.parent.type)
        return alias._getvalue()
    if isinstance(typ, types.BaseTuple):
        for i, member in enumerate(typ):
            item = _alias(context, builder, member, builder.extract_value(value, i))
            value = builder.insert_value(value, item, i)
        return value
    return value


@intrinsic
def _unowned(typingctx, x):
    """``x`` itself (an array, or a tuple holding arrays), every array in it made one
    that holds no reference to its owner (a null ``meminfo``), as are the views taken
    from it.  Valid only while the owners stay alive: keep them in a variable that is
    used after the last use of the aliases (:func:`keep_alive`)."""
    if not isinstance(x, (types.Array, types.BaseTuple)):
        return None

    def codegen(context, builder, signature, args):
        return _alias(context, builder, x, args[0])

    return x(x), codegen


@intrinsic
def _keep_alive(typingctx, x):
    """Nothing, except that ``x`` is used here: Numba drops a variable's reference after
    its last use, so the arrays in ``x`` live at least until this point."""

    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return types.none(x), codegen


def _c_view(context, builder, src_type, value, out_type, shape):
    """A C-contiguous view of ``value`` (an array of ``src_type``) with ``shape`` (LLVM
    integers), holding a new reference to the same owner."""
    src = context.make_array(src_type)(context, builder, value=value)
    view = context.make_array(out_type)(context, builder)
    itemsize = src.itemsize
    strides, stride = [], itemsize
    for extent in reversed(shape):
        strides.insert(0, stride)
        stride = builder.mul(stride, extent)
    populate_array(view, data=src.data, shape=cgutils.pack_array(builder, shape),
                   strides=cgutils.pack_array(builder, strides), itemsize=itemsize,
                   meminfo=src.meminfo, parent=src.parent)
    context.nrt.incref(builder, out_type, view._getvalue())
    return view._getvalue()


@intrinsic
def _flat(typingctx, x):
    """All of a C-contiguous ``x``'s elements as a 1-D view: ``x.reshape(x.size)``."""
    if not (isinstance(x, types.Array) and x.layout == "C"):
        return None
    out = x.copy(ndim=1, layout="C")

    def codegen(context, builder, signature, args):
        src = context.make_array(x)(context, builder, value=args[0])
        return _c_view(context, builder, x, args[0], out, [src.nitems])

    return out(x), codegen


@intrinsic
def _rows_of(typingctx, x, rows, cols):
    """The first ``rows * cols`` elements of a 1-D C-contiguous ``x`` as a ``(rows,
    cols)`` C-contiguous view: ``x[:rows * cols].reshape((rows, cols))``, which it
    equals when ``rows * cols <= x.size`` (the caller's promise: not checked)."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C"):
        return None
    out = x.copy(ndim=2, layout="C")

    def codegen(context, builder, signature, args):
        _, rows_type, cols_type = signature.args
        n_rows = context.cast(builder, args[1], rows_type, types.intp)
        n_cols = context.cast(builder, args[2], cols_type, types.intp)
        return _c_view(context, builder, x, args[0], out, [n_rows, n_cols])

    return out(x, rows, cols), codegen


@register_jitable
def _same(x):
    return x


@register_jitable
def _nothing(x):
    return None


def _reshaped_flat(x):
    """Plain Numba's :func:`flat`: refused at typing for all but C-contiguous arrays."""


def _reshaped_rows(x, rows, cols):
    """Plain Numba's :func:`rows_of`: refused at typing for all but 1-D C arrays."""


@overload(_reshaped_flat)
def _reshaped_flat_typed(x):
    if isinstance(x, types.Array) and x.layout == "C":
        return lambda x: x.reshape(x.size)
    return None


@overload(_reshaped_rows)
def _reshaped_rows_typed(x, rows, cols):
    if isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C":
        return lambda x, rows, cols: x[:rows * cols].reshape((rows, cols))
    return None


if ACTIVE:
    unowned, keep_alive, flat, rows_of = _unowned, _keep_alive, _flat, _rows_of
else:
    unowned, keep_alive, flat, rows_of = _same, _nothing, _reshaped_flat, _reshaped_rows
