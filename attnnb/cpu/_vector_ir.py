"""Two loops of the tiled core written in LLVM's vector IR, a full key tile's row
maximum and a 16 x 16 transposed copy, and a cache prefetch hint.

**Row maximum.**
The online softmax needs each row's maximum of every 64-key tile before
any weight.  Written as a loop, ``max(mx, x)`` is a reduction LLVM does not
vectorise without the ``nnan`` flag, which the project leaves out (NaN
inputs must propagate, see :mod:`attnnb.cpu._jit`): with ``maxnum`` it was
scalar code, as slow as the tile's exponentials (docs/notes/performance.md, "Value
products that add in registers").

:func:`row_max_64` loads the row as 512-bit vectors and reduces them in a
tree of ``a > b ? a : b`` selects (vertical first, then halving shuffles),
which x86 lowers to ``vmaxps`` / ``vmaxpd`` one for one.

NaN: ``a > b ? a : b`` returns ``b`` when either is NaN, so with a NaN in
the row the result is either NaN or the maximum of some of the row's other
elements.  Both make the row NaN, as it must be (:func:`attnnb.cpu._tiles.
online_update`: a NaN shift marks the row NaN at once; a finite one gives
the NaN logit a NaN weight, and the row's sum turns NaN).  Without NaN the
result is the exact maximum, in any order: no rounding is involved, so the
bits do not depend on the reduction's shape.

**Transposed copy.** Written as a double loop, a 16 x 16 block's transpose
reads rows as vectors and stores its columns element by element: one
scalar store per element, and the copy is frequent (the forward's prologue
transposes every key tile once per call, decoding each key tile once per
task). :func:`transpose_16` loads the block's 16 rows as vectors and swaps
one bit of the row index with the same bit of the column index per round
(four rounds of 16 two-vector shuffles), then stores 16 rows, several times
faster (docs/notes/performance.md, "Value products that add in registers").  It
is a copy, exact in any order.

**Prefetch.** :func:`prefetch_line` is LLVM's ``llvm.prefetch`` (x86
``prefetcht1``): a hint that fetches the cache line of one element into L2
and changes no result.  Decoding reads every key and value once per call,
as a burst when a tile is first touched; prefetches of the next tile spread
over the current tile's products overlap that traffic with the FMAs
(:func:`attnnb.cpu._tiles.tile_logits_keys`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._blocks import COLS
from ._jit import FASTMATH

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _c_float_arrays(*arrays):
    """True for Numba array types, all C-contiguous and of one float dtype."""
    return (all(isinstance(a, types.Array) and a.layout == "C" for a in arrays)
            and isinstance(arrays[0].dtype, types.Float)
            and all(a.dtype == arrays[0].dtype for a in arrays))


def _select_max(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


@intrinsic
def row_max_64(typingctx, x, start):
    """``max(x[start : start + 64])`` of a C-contiguous 1-D float32 or float64 array
    (``a > b ? a : b`` semantics, see the module docstring).  No bounds check: the
    caller passes a row that lies inside ``x``."""
    if not (_c_float_arrays(x) and x.ndim == 1 and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        element = context.get_value_type(signature.args[0].dtype)
        lanes = 64 // context.get_abi_sizeof(element)  # 512 bits
        vector = ir.VectorType(element, lanes)
        base = builder.bitcast(builder.gep(arr.data, [args[1]]), vector.as_pointer())
        size = context.get_abi_sizeof(element)
        parts = [builder.load(builder.gep(base, [ir.Constant(_I64, i)]), align=size)
                 for i in range(COLS // lanes)]
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


BLOCK = 16  # rows and columns of one transposed block


def _row_pointer(builder, arr, row, col, stride, vector):
    """Pointer to ``arr[row, col]`` of a C-contiguous 2-D array as a vector pointer."""
    offset = builder.add(builder.mul(row, stride), col)
    return builder.bitcast(builder.gep(arr.data, [offset]), vector.as_pointer())


@intrinsic
def _transpose_16_c(typingctx, src, r0, c0, dst, d0, e0):
    """``dst[d0 + a, e0 + b] = src[r0 + b, c0 + a]`` for ``a, b < 16``: C-contiguous 2-D
    arrays of one dtype, the block inside both (not checked)."""
    if not (_c_float_arrays(src, dst) and src.ndim == 2 and dst.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        s_arr = context.make_array(signature.args[0])(context, builder, args[0])
        d_arr = context.make_array(signature.args[3])(context, builder, args[3])
        element = context.get_value_type(signature.args[0].dtype)
        size = context.get_abi_sizeof(element)
        vector = ir.VectorType(element, BLOCK)
        # C-contiguous: a row is shape[1] elements apart
        s_ld = cgutils.unpack_tuple(builder, s_arr.shape, 2)[1]
        d_ld = cgutils.unpack_tuple(builder, d_arr.shape, 2)[1]
        rows = []
        for r in range(BLOCK):
            row = builder.add(args[1], ir.Constant(_I64, r))
            ptr = _row_pointer(builder, s_arr, row, args[2], s_ld, vector)
            rows.append(builder.load(ptr, align=size))
        bit = 1
        while bit < BLOCK:  # swap this bit of the row and column indices
            for r in range(BLOCK):
                if r & bit:
                    continue
                # row r takes its columns with the bit set from row r | bit, and back
                low = [c if not c & bit else BLOCK + (c ^ bit) for c in range(BLOCK)]
                high = [c | bit if not c & bit else BLOCK + c for c in range(BLOCK)]
                a, b = rows[r], rows[r | bit]
                rows[r] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, BLOCK),
                                                                   low))
                rows[r | bit] = builder.shuffle_vector(
                    a, b, ir.Constant(ir.VectorType(_I32, BLOCK), high))
            bit *= 2
        for r in range(BLOCK):
            row = builder.add(args[4], ir.Constant(_I64, r))
            builder.store(rows[r], _row_pointer(builder, d_arr, row, args[5], d_ld, vector),
                          align=size)
        return context.get_dummy_value()

    return types.none(src, types.intp, types.intp, dst, types.intp, types.intp), codegen


def transpose_16(src, r0, c0, dst, d0, e0):
    """``dst[d0 + a, e0 + b] = src[r0 + b, c0 + a]`` for ``a, b < 16`` (2-D arrays; the
    block must lie inside both).  Vector IR for C-contiguous arrays of one float dtype,
    a plain double loop for any other layout."""
    raise NotImplementedError  # only callable from Numba code


@overload(transpose_16, jit_options={"fastmath": FASTMATH, "forceinline": True})
def _transpose_16_impl(src, r0, c0, dst, d0, e0):
    if _c_float_arrays(src, dst) and src.ndim == 2 and dst.ndim == 2:
        def impl_vector(src, r0, c0, dst, d0, e0):
            _transpose_16_c(src, r0, c0, dst, d0, e0)

        return impl_vector

    def impl_loop(src, r0, c0, dst, d0, e0):
        for b in range(BLOCK):
            for a in range(BLOCK):
                dst[d0 + a, e0 + b] = src[r0 + b, c0 + a]

    return impl_loop


@intrinsic
def prefetch_line(typingctx, x, index):
    """Ask the CPU to bring the cache line holding ``x[index]`` into L2; ``x`` a
    C-contiguous 1-D array, ``index`` inside it (not checked: a prefetch never faults,
    but the address should be the array's).  No effect on any result.

    L2 rather than L1 (locality 2 of ``llvm.prefetch``): the line is for the next
    tile, and the current tile's keys and values are still being read from L1.
    """
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C"
            and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        byte_pointer = ir.IntType(8).as_pointer()
        ptr = builder.bitcast(builder.gep(arr.data, [args[1]]), byte_pointer)
        fnty = ir.FunctionType(ir.VoidType(), [byte_pointer, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # (address, read, locality 2 = L2, data cache)
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 2),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(x, types.intp), codegen
