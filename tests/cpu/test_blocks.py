"""The register-blocked tile products and the private compiler options they rely on.

``noalias`` and the 512-bit vector attributes are not public Numba API
(``attnnb/cpu/_numba_patches/``): these tests check that they still take
effect on the installed Numba, and that the same loops give the same results
without them.
"""

import re

import numba
import numpy as np
import pytest

from attnnb.cpu import _blocks, _jit
from attnnb.cpu._numba_patches import noalias as _noalias

from ..helpers import from_jit


def _with_noalias(opts):
    if not _noalias.NOALIAS:
        pytest.skip("the Numba patches are off: no noalias option")
    opts[_noalias.OPTION] = True


def _compile(fn, noalias, inline=False):
    opts = dict(fastmath=_jit.FASTMATH, nogil=True)  # no cache: inspection needs a fresh compile
    if noalias:
        _with_noalias(opts)
    if inline:
        opts["forceinline"] = True
    return numba.njit(**opts)(fn.py_func)


def _constant_width_block(width, noalias=True, rows=_blocks.ROWS):
    """:func:`gemm_block` inlined into a caller that passes ``width`` and ``rows`` as
    constants, as :func:`attnnb.cpu._blocks.block_product` does."""
    block = _compile(_blocks.gemm_block, noalias, inline=True)

    def call(a, a0, lda, n, b, b0, ldb, blk, c0):
        block(a, a0, lda, 1, n, b, b0, ldb, blk, c0, width, rows)

    opts = dict(fastmath=_jit.FASTMATH, nogil=True)
    if noalias:
        _with_noalias(opts)
    return numba.njit(**opts)(call)


# (width, rows) of every block shape the kernels use
BLOCK_SHAPES = [(64, _blocks.ROWS), (16, _blocks.ROWS), (16, 2 * _blocks.ROWS)]


def _gemm_args(rng, dtype, n=37):
    rows, cols = 2 * _blocks.ROWS, _blocks.COLS
    a = rng.standard_normal(rows * n + 5).astype(dtype)
    b = rng.standard_normal(n * (cols + 7) + 3).astype(dtype)
    blk = np.full(rows * cols + 9, np.nan, dtype)
    return a, b, blk, n


def _expected(a, b, n, a0, lda, b0, ldb, rows, cols):
    A = np.stack([a[a0 + r * lda: a0 + r * lda + n] for r in range(rows)]).astype(np.float64)
    B = np.stack([b[b0 + e * ldb: b0 + e * ldb + cols] for e in range(n)]).astype(np.float64)
    return A @ B


@pytest.mark.skipif(not _noalias.ACTIVE, reason="the Numba patches are off")
def test_noalias_option_is_registered():
    assert _jit.NOALIAS, "numba.core internals changed: the noalias flag is no longer available"


@pytest.mark.parametrize("width, rows", BLOCK_SHAPES)
@pytest.mark.parametrize("noalias", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_block_matches_numpy_with_and_without_noalias(rng, noalias, dtype, width, rows):
    fn = _constant_width_block(width, noalias, rows)
    a, b, blk, n = _gemm_args(rng, dtype)
    ldb = _blocks.COLS + 7
    fn(a, 5, n, n, b, 3, ldb, blk, 9)
    got = blk[9:9 + rows * width].reshape(rows, width)
    want = _expected(a, b, n, 5, n, 3, ldb, rows, width)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    assert np.isnan(blk[:9]).all(), "wrote before the block"
    assert np.isnan(blk[9 + rows * width:]).all(), "wrote after the block"


@pytest.mark.parametrize("width, rows", BLOCK_SHAPES)
@pytest.mark.parametrize("r_from, c_from", [(0, 0), (3, 0), (0, 9), (2, 5)])
def test_block_product_add_adds_only_the_new_rows_and_columns(rng, width, rows, r_from,
                                                              c_from):
    """The block's product is added to ``dst`` where ``r >= r_from`` and ``c >= c_from``;
    the other entries, and everything outside the block, keep their bits."""
    fn = numba.njit(fastmath=_jit.FASTMATH)(_blocks.block_product_add.py_func)
    a, b, _, n = _gemm_args(rng, np.float64)
    ldb, ldd = _blocks.COLS + 7, width + 5
    dst = rng.standard_normal((rows + 2) * ldd + 3)
    before = dst.copy()
    blk = np.empty(rows * width)
    fn(a, 5, n, 1, n, b, 3, ldb, blk, dst, 3, ldd, width, rows, r_from, c_from)
    want = before.copy()
    product = _expected(a, b, n, 5, n, 3, ldb, rows, width)
    for r in range(r_from, rows):
        for c in range(c_from, width):
            want[3 + r * ldd + c] += product[r, c]
    untouched = want == before
    np.testing.assert_array_equal(dst[untouched], before[untouched])
    np.testing.assert_allclose(dst, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("noalias", [True, False])
def test_gemm_row_matches_numpy(rng, noalias):
    fn = _compile(_blocks.gemm_row, noalias)
    a, b, blk, n = _gemm_args(rng, np.float64)
    fn(a, 2, 1, n, b, 1, 50, blk, 4, 23)
    want = _expected(a, b, n, 2, n, 1, 50, 1, 23)[0]
    np.testing.assert_allclose(blk[4:27], want, rtol=1e-12)


def test_noalias_flag_reaches_llvm(rng):
    """With the option the array arguments carry LLVM's ``noalias``; without, they do not."""
    a, b, blk, n = _gemm_args(rng, np.float32)
    args = (a, 0, n, 1, n, b, 0, _blocks.COLS, blk, 0, _blocks.COLS, _blocks.ROWS)
    counts = {}
    for flag in (True, False):
        fn = _compile(_blocks.gemm_block, flag)
        fn(*args)
        ir = fn.inspect_llvm(fn.signatures[0])
        define = next(line for line in ir.splitlines() if line.startswith("define")
                      and "gemm_block" in line and "cpython" not in line)
        counts[flag] = len(re.findall(r"noalias[^,]*%arg\.", define))
    assert counts[True] >= 3 and counts[False] == 0, counts


def _has_avx512():
    import llvmlite.binding as llvm

    return "+avx512f" in (numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten())


# the block shapes each register file is given (16 x 8 needs AVX-512's 32 registers)
SHAPES_FOR_HOST = BLOCK_SHAPES if _has_avx512() else BLOCK_SHAPES[:2]


@pytest.mark.parametrize("width, rows", SHAPES_FOR_HOST)
def test_blocks_keep_accumulators_in_registers(rng, width, rows):
    """A ``rows x width`` float32 block: ``rows * width / lanes`` vector FMAs per step,
    none scalar, and (AVX2) no more than a few moves to or from the stack.

    With AVX-512 the whole block is one pass (zmm registers, 16 lanes); with AVX2
    it is formed :data:`~attnnb.cpu._blocks.PASS_COLS` columns at a time so that
    its accumulators fit 16 ymm registers (a 4 x 64 block in one pass had 96
    stack moves, measured on an AMD EPYC of the znver1 type).
    """
    register, lanes = ("zmm", 16) if _has_avx512() else ("ymm", 8)
    assert _blocks.PASS_COLS == (_blocks.COLS if register == "zmm" else 16)
    fn = _constant_width_block(width, rows=rows)
    a, b, blk, n = _gemm_args(rng, np.float32)
    fn(a, 0, n, n, b, 0, _blocks.COLS, blk, 0)
    asm = fn.inspect_asm(fn.signatures[0])
    fmas = re.findall(rf"vfmadd\d+ps\s+[^\n]*{register}", asm)
    assert len(fmas) >= rows * width // lanes, f"{len(fmas)} {register} FMAs"
    scalar = re.findall(r"vfmadd\d+ss", asm)
    assert not scalar, f"{len(scalar)} scalar FMAs: the block was not vectorised"
    if register == "ymm":  # the spills measured were AVX2's; AVX-512's 32 registers hold 16
        stack = re.findall(r"vmov\w*ps\s+(?:%ymm\d+, -?\d*\(%rsp\)|-?\d*\(%rsp\), %ymm\d+)",
                           asm)
        assert len(stack) <= 16, f"{len(stack)} ymm moves to or from the stack"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("nr, nc", [(0, 5), (1, 1), (15, 17), (16, 16), (33, 48), (64, 64),
                                    (64, 20), (50, 64)])
def test_transposed_copy_is_the_transpose(rng, dtype, nr, nc):
    """The 16 x 16 blocks and the rows and columns left over give exactly ``src.T``
    (a window of it, at an offset), and write nothing outside ``dst[:nc, :nr]``."""
    from attnnb.cpu._tiles import transposed_copy

    src = rng.standard_normal((nr + 7, nc + 3)).astype(dtype)
    dst = np.full((nc + 2, nr + 5), np.nan, dtype)
    from_jit(transposed_copy)(src, 4, nr, 2, nc, dst)
    np.testing.assert_array_equal(dst[:nc, :nr], src[4 : 4 + nr, 2 : 2 + nc].T)
    assert np.isnan(dst[nc:]).all() and np.isnan(dst[:, nr:]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("nq, dv", [(4, 16), (7, 40), (8, 16), (13, 20), (13, 80), (64, 144),
                                    (128, 16), (9, 64), (5, 32), (3, 16), (21, 16), (12, 48),
                                    (9, 7), (9, 128), (6, 256), (5, 512), (4, 1024)])
def test_values_product_adds_p_times_v_at_every_width_and_row_count(rng, dtype, nq, dv):
    """``acc += P @ V[j0:j0+nk]`` over the single-row path, the 4 x 64, 4 x 16 and 8 x 16
    blocks, the blocks that reach back over rows or columns already added, and value
    rows 1, 2 and 4 KiB apart (keys in runs: :func:`attnnb.cpu._tiles.key_run`)."""
    from attnnb.cpu._tiles import values_product

    nk, j0 = 61, 10
    P = rng.random((nq, nk)).astype(dtype)
    v = rng.standard_normal((j0 + nk + 3, dv)).astype(dtype)
    acc = rng.standard_normal((nq, dv)).astype(dtype)
    want = acc.astype(np.float64) + P.astype(np.float64) @ v[j0:j0 + nk].astype(np.float64)
    T = np.empty(_blocks.ROWS * _blocks.COLS, dtype)
    from_jit(values_product)(P, v, j0, acc, T)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(acc, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("row_bytes, nk, run", [(256, 64, 64), (1024, 64, 32), (3072, 64, 32),
                                                (2048, 64, 16), (4096, 64, 8), (8192, 61, 8),
                                                (1024, 20, 20), (4096, 5, 5), (1040, 64, 64)])
def test_key_run_fits_a_column_block_in_l1(row_bytes, nk, run):
    """Keys per pass of the value product: all of them unless the rows are a multiple
    of 1 KiB apart, then 32, 16 or 8 (a 1, 2 or 4 KiB period), never more than ``nk``."""
    from attnnb.cpu._tiles import key_run

    assert from_jit(key_run)(nk, row_bytes) == run


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("nq, nk, dv", [(64, 64, 64), (37, 5, 16), (64, 13, 40), (3, 64, 80),
                                        (20, 9, 7), (64, 64, 16), (45, 64, 128), (40, 37, 256)])
def test_transposed_values_product_equals_the_product_with_a_transposed_copy(rng, dtype, nq,
                                                                             nk, dv):
    """``acc += W.T @ V[j0:j0+nq]`` read from ``W (nq, nk)`` as stored gives the same bits
    as :func:`values_product` with ``W.T`` copied out first (the same sums in the same
    order), and matches the float64 product."""
    from attnnb.cpu._tiles import transposed_values_product, values_product

    j0 = 6
    W = rng.random((nq, nk)).astype(dtype)
    v = rng.standard_normal((j0 + nq + 2, dv)).astype(dtype)
    start = rng.standard_normal((nk, dv)).astype(dtype)
    T = np.empty(_blocks.ROWS * _blocks.COLS, dtype)
    got, copied = start.copy(), start.copy()
    from_jit(transposed_values_product)(W, v, j0, got, T)
    from_jit(values_product)(np.ascontiguousarray(W.T), v, j0, copied, T)
    np.testing.assert_array_equal(got, copied)
    want = start.astype(np.float64) + W.T.astype(np.float64) @ v[j0:j0 + nq].astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_max_64_is_the_exact_maximum_and_marks_nan_rows(rng, dtype):
    """Without NaN the vector tree gives ``max`` exactly (-inf rows included); with a
    NaN in the row it gives NaN or a value of the row, never more than its maximum."""
    from attnnb.cpu._vector_ir import row_max_64

    @numba.njit
    def maxima(x, n):
        out = np.empty(n, x.dtype)
        for r in range(n):
            out[r] = row_max_64(x, r * 64)
        return out

    rows = rng.standard_normal((40, 64)).astype(dtype) * 1e4
    rows[1] = -np.inf
    rows[2, 17] = np.inf
    rows[3, :63] = -np.inf
    for r in range(4, 40):
        rows[r, rng.integers(64)] = rows[r].max() + 1.0  # a unique maximum, at a random lane
    np.testing.assert_array_equal(maxima(rows.ravel(), 40), rows.max(axis=1))
    for lane in (0, 5, 31, 63):
        with_nan = rows[4:8].copy()
        with_nan[:, lane] = np.nan
        got = maxima(with_nan.ravel(), 4)
        finite_max = np.nanmax(with_nan, axis=1)
        assert np.all(np.isnan(got) | (got <= finite_max)), (lane, got, finite_max)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transposed_copy_of_a_strided_view_takes_the_loop_and_is_the_transpose(rng, dtype):
    """A source that is not C-contiguous (every other column) goes through the plain
    loop of :func:`attnnb.cpu._vector_ir.transpose_16`, with the same result."""
    from attnnb.cpu._tiles import transposed_copy

    base = rng.standard_normal((40, 70)).astype(dtype)
    src = base[:, ::2]  # (40, 35), strided
    dst = np.full((33, 36), np.nan, dtype)
    from_jit(transposed_copy)(src, 3, 36, 1, 33, dst)
    np.testing.assert_array_equal(dst, src[3:39, 1:34].T)
