"""The row maximum of a full key tile, written in LLVM's vector IR.

The online softmax needs each row's maximum of every 64-key tile before
any weight.  Written as a loop, ``max(mx, x)`` is a reduction LLVM does not
vectorise without the ``nnan`` flag, which the project leaves out (NaN
inputs must propagate, see :mod:`attnnb.cpu._jit`): with ``maxnum`` it was
scalar code at ~13 ns a row (1.6-1.8 us of a 128 x 64 float32 tile, as long
as the tile's exponentials; a quarter of a tile's time at D = 16).

:func:`row_max_64` loads the row as 512-bit vectors and reduces them in a
tree of ``a > b ? a : b`` selects (vertical first, then halving shuffles),
which x86 lowers to ``vmaxps`` / ``vmaxpd`` one for one: 0.14 us a tile.

NaN: ``a > b ? a : b`` returns ``b`` when either is NaN, so with a NaN in
the row the result is either NaN or the maximum of some of the row's other
elements.  Both make the row NaN, as it must be (:func:`attnnb.cpu._tiles.
online_update`: a NaN shift marks the row NaN at once; a finite one gives
the NaN logit a NaN weight, and the row's sum turns NaN).  Without NaN the
result is the exact maximum, in any order: no rounding is involved, so the
bits do not depend on the reduction's shape.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

ROW = 64  # elements per row: the key tile's width (attnnb.cpu._blocks.COLS)
_I32 = ir.IntType(32)


def _select_max(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


@intrinsic
def row_max_64(typingctx, x, start):
    """``max(x[start : start + 64])`` of a C-contiguous 1-D float32 or float64 array
    (``a > b ? a : b`` semantics, see the module docstring).  No bounds check: the
    caller passes a row that lies inside ``x``."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C"
            and x.dtype in (types.float32, types.float64)
            and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        element = context.get_value_type(signature.args[0].dtype)
        lanes = 16 if signature.args[0].dtype == types.float32 else 8  # 512 bits
        vector = ir.VectorType(element, lanes)
        base = builder.bitcast(builder.gep(arr.data, [args[1]]), vector.as_pointer())
        size = 4 if lanes == 16 else 8
        parts = [builder.load(builder.gep(base, [ir.Constant(ir.IntType(64), i)]), align=size)
                 for i in range(ROW // lanes)]
        while len(parts) > 1:  # vertical: one vector of lanes
            parts = [_select_max(builder, parts[i], parts[i + 1])
                     for i in range(0, len(parts), 2)]
        v = parts[0]
        while lanes > 1:  # horizontal: halve the vector
            half = lanes // 2
            low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half),
                                                           list(range(half))))
            high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half),
                                                            list(range(half, lanes))))
            v = _select_max(builder, low, high)
            lanes = half
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return x.dtype(x, start), codegen
