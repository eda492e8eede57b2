"""Let LLVM use 512-bit vectors in the kernels' hot functions.

LLVM's tuning for many AVX-512 Intel cores prefers 256-bit vectors, which
halves the width of the register-blocked loops and leaves a 4 x 64 float32
block too large for the register file.  :func:`wide_vectors`, called at the top
of a function, sets two string attributes on that function only (and, through
LLVM's inliner, on functions it is inlined into); on CPUs without AVX-512 they
change nothing.  llvmlite's attribute set accepts only keyword attributes, so
the strings are added to the set directly.  Where the gate
(:mod:`attnnb.cpu._numba_patches`) is closed, :func:`wide_vectors` does nothing
and LLVM keeps its own width.
"""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic, register_jitable

from . import ACTIVE

_WIDE_ATTRIBUTES = ('"prefer-vector-width"="512"', '"min-legal-vector-width"="512"')


@intrinsic
def _wide_vectors(typingctx):
    """Let LLVM use 512-bit vectors in the function that calls this (a no-op)."""

    def codegen(context, builder, signature, args):
        attrs = builder.function.attributes
        for attr in _WIDE_ATTRIBUTES:
            if attr not in attrs:
                set.add(attrs, attr)  # llvmlite's add() accepts only keyword attributes
        return context.get_dummy_value()

    return types.none(), codegen


@register_jitable
def _nothing():
    return None


wide_vectors = _wide_vectors if ACTIVE else _nothing
