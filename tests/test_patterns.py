"""attnnb.patterns: every builder against a literal loop over (i, j), algebra, conversions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import sparse

from attnnb import patterns as P

# Shapes: squares, and rectangles both ways (bottom-right alignment).
SHAPES = [13, (13, 13), (5, 17), (17, 5), (1, 9), (9, 1)]


def literal(shape, rule):
    """The mask of ``rule(i', j)`` by plain loops, with ``i' = i + Lk - Lq``."""
    Lq, Lk = (shape, shape) if isinstance(shape, int) else shape
    m = np.zeros((Lq, Lk), bool)
    for i in range(Lq):
        ii = i + Lk - Lq
        for j in range(Lk):
            m[i, j] = bool(rule(ii, j))
    return m


def check(p, expected):
    assert isinstance(p, P.Pattern)
    np.testing.assert_array_equal(p.to_mask(), expected)
    assert p.shape == expected.shape[-2:]
    assert p.nnz == expected.sum()
    assert p.density == pytest.approx(expected.mean() if expected.size else 0.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 1, 3, 40])
@pytest.mark.parametrize("causal", [False, True])
def test_local(shape, window, causal):
    def rule(i, j):
        return i - window <= j <= i + window and (not causal or j <= i)
    check(P.local(shape, window, causal=causal), literal(shape, rule))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stride", [1, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_strided(shape, stride, causal):
    def rule(i, j):
        return (i - j) % stride == 0 and (not causal or j <= i)
    check(P.strided(shape, stride, causal=causal), literal(shape, rule))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("block", "summary"), [(1, 0), (1, 1), (4, 1), (4, 0), (5, 2), (3, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_fixed(shape, block, summary, causal):
    def rule(i, j):
        return ((j // block == i // block or j % block >= block - summary)
                and (not causal or j <= i))
    check(P.fixed(shape, block, summary, causal=causal), literal(shape, rule))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("window", "dilation"), [(0, 2), (1, 1), (2, 3), (5, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_dilated(shape, window, dilation, causal):
    def rule(i, j):
        return (abs(i - j) <= window * dilation and (i - j) % dilation == 0
                and (not causal or j <= i))
    check(P.dilated(shape, window, dilation, causal=causal), literal(shape, rule))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 2])
@pytest.mark.parametrize("glob", [[], [0], [4, 0, 4]])
def test_longformer(shape, window, glob):
    Lk = shape if isinstance(shape, int) else shape[1]
    g = {x for x in glob if x < Lk}

    def rule(i, j):
        return abs(i - j) <= window or i in g or j in g
    check(P.longformer(shape, window, sorted(g)), literal(shape, rule))


@pytest.mark.parametrize(("n", "block", "ng", "nw", "nr"),
                         [(16, 4, 1, 3, 1), (23, 4, 1, 3, 2), (40, 4, 2, 1, 3), (10, 3, 0, 0, 0),
                          (9, 4, 0, 5, 9)])
def test_bigbird(n, block, ng, nw, nr):
    p = P.bigbird(n, block, ng, nw, nr, seed=7)
    m = p.to_mask()
    nb = -(-n // block)
    # the deterministic part, literally; the random part: per block-row, exactly
    # min(nr, free) extra whole blocks among the free ones
    fixed_part = literal(n, lambda i, j: (i // block < ng or j // block < ng
                                          or abs(i // block - j // block) <= nw // 2))
    assert (m | fixed_part).sum() == m.sum()  # m contains the fixed part
    for bi in range(nb):
        rows = slice(bi * block, min(n, (bi + 1) * block))
        free = [bj for bj in range(nb) if not fixed_part[bi * block, bj * block]]
        picked = [bj for bj in free if m[bi * block, bj * block]]
        expected = 0 if bi < ng else min(nr, len(free))
        assert len(picked) == expected
        for bj in range(nb):  # whole blocks, identical rows within a block-row
            cols = slice(bj * block, min(n, (bj + 1) * block))
            blk = m[rows, cols]
            assert blk.all() or not blk.any()
    assert P.bigbird(n, block, ng, nw, nr, seed=7) == p
    np.testing.assert_array_equal(P.bigbird(n, block, ng, nw, nr, seed=7).to_mask(), m)


def test_bigbird_seeds_differ():
    masks = {P.bigbird(64, 4, 1, 3, 2, seed=s).to_mask().tobytes() for s in range(5)}
    assert len(masks) > 1


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("shape", [None, (7, 10)])
def test_block_sparse(rng, per_head, shape):
    block = 3
    lay = rng.random((2, 3, 4) if per_head else (3, 4)) < 0.5
    p = P.block_sparse(lay, block, shape=shape)
    Lq, Lk = shape or (9, 12)
    lay3 = lay if per_head else lay[None]
    expected = np.zeros((lay3.shape[0], Lq, Lk), bool)
    for h in range(lay3.shape[0]):
        for i in range(Lq):
            for j in range(Lk):
                expected[h, i, j] = lay3[h, i // block, j // block]
    check(p, expected if per_head else expected[0])
    assert p.n_heads == (2 if per_head else 1)


def test_from_mask_and_scipy_round_trips(rng):
    m = rng.random((3, 11, 7)) < 0.4
    m[1, 4] = False  # an empty row
    p = P.from_mask(m)
    assert p.n_heads == 3
    check(p, m)
    for h in range(3):
        s = p.to_scipy()[h]
        assert sparse.issparse(s)
        np.testing.assert_array_equal(s.toarray(), m[h])
        assert P.from_scipy(s) == p.head(h)
    m2 = m[0]
    p2 = P.from_mask(m2)
    np.testing.assert_array_equal(P.from_mask(p2.to_mask()).to_mask(), m2)
    for fmt in ("csr", "csc", "coo", "lil"):
        assert P.from_scipy(sparse.random(11, 7, 0.3, format=fmt, random_state=1)).to_mask() \
            .tolist() == (sparse.random(11, 7, 0.3, format="csr", random_state=1)
                          .toarray() != 0).tolist()


def test_from_scipy_explicit_zeros_duplicates_and_matrix():
    coo = sparse.coo_matrix(([1.0, 0.0, 2.0, -2.0, np.nan], ([0, 1, 2, 2, 3], [0, 1, 2, 2, 3])),
                            shape=(4, 4))
    before = coo.copy()
    p = P.from_scipy(coo)
    np.testing.assert_array_equal(p.to_mask(), np.diag([True, False, False, True]))
    np.testing.assert_array_equal(coo.toarray(), before.toarray())  # input untouched


def test_algebra(rng):
    a = P.local((9, 14), 2)
    b = P.strided((9, 14), 3, causal=False)
    check(a | b, a.to_mask() | b.to_mask())
    check(a & b, a.to_mask() & b.to_mask())
    per_head = P.from_mask(rng.random((3, 9, 14)) < 0.3)
    check(a | per_head, a.to_mask()[None] | per_head.to_mask())
    check(per_head & a, a.to_mask()[None] & per_head.to_mask())
    empty = P.from_mask(np.zeros((9, 14), bool))
    check(a & empty, np.zeros((9, 14), bool))
    check(a | empty, a.to_mask())


def test_block_layout(rng):
    m = rng.random((2, 70, 45)) < 0.05
    m[0, :16, 16:32] = True  # a full tile
    p = P.from_mask(m)
    lay = p.blocks(16, 16)
    assert (lay.n_qt, lay.n_kt) == (5, 3)
    for h in range(2):
        for t in range(5):
            r = h * 5 + t
            got = list(zip(lay.tile_idx[lay.tile_ptr[r]:lay.tile_ptr[r + 1]].tolist(),
                           lay.tile_full[lay.tile_ptr[r]:lay.tile_ptr[r + 1]].tolist(),
                           strict=True))
            want = []
            for kt in range(3):
                blk = m[h, t * 16:(t + 1) * 16, kt * 16:(kt + 1) * 16]
                if blk.any():
                    want.append((kt, bool(blk.all())))
            assert got == want
    assert (1, True) in [(int(a), bool(b)) for a, b in
                         zip(lay.tile_idx[:lay.tile_ptr[1]], lay.tile_full[:lay.tile_ptr[1]],
                             strict=True)]
    assert p.blocks(16, 16) is lay  # cached


def test_csr_invariants():
    p = P.local(20, 3)
    assert p.indptr.dtype == np.int64 and p.indices.dtype == np.int32
    assert p.indptr.shape == (21,)
    with pytest.raises(ValueError):
        p.indices[0] = 1  # read-only
    with pytest.raises(ValueError, match="strictly increasing"):
        P.Pattern([0, 2], [1, 1], (1, 3))
    with pytest.raises(ValueError, match=r"\[0, Lk\)"):
        P.Pattern([0, 1], [3], (1, 3))
    with pytest.raises(ValueError, match="indptr"):
        P.Pattern([0, 1, 1], [0], (1, 3))


def test_validation_errors():
    with pytest.raises(ValueError, match="window"):
        P.local(8, -1)
    with pytest.raises(TypeError, match="window"):
        P.local(8, 1.5)
    with pytest.raises(ValueError, match="stride"):
        P.strided(8, 0)
    with pytest.raises(ValueError, match="summary"):
        P.fixed(8, 2, 3)
    with pytest.raises(ValueError, match="dilation"):
        P.dilated(8, 1, 0)
    with pytest.raises(ValueError, match="global_tokens"):
        P.longformer(8, 1, [8])
    with pytest.raises(TypeError, match="square"):
        P.bigbird((8, 9), 2, 1, 1, 1)
    with pytest.raises(ValueError, match="layout"):
        P.block_sparse(np.ones(3, bool), 2)
    with pytest.raises(ValueError, match="shape"):
        P.block_sparse(np.ones((2, 2), bool), 2, shape=(5, 4))
    with pytest.raises(TypeError, match="boolean"):
        P.from_mask(np.ones((3, 3)))
    with pytest.raises(TypeError, match="scipy"):
        P.from_scipy(np.ones((3, 3)))
    with pytest.raises(ValueError, match="same shape"):
        _ = P.local(8, 1) | P.local(9, 1)
    with pytest.raises(ValueError, match="head counts"):
        _ = P.from_mask(np.ones((2, 3, 3), bool)) | P.from_mask(np.ones((3, 3, 3), bool))


def test_pattern_leaves_the_callers_arrays_writeable():
    indptr = np.array([0, 1, 3], np.int64)
    indices = np.array([0, 0, 1], np.int32)
    pattern = P.Pattern(indptr, indices, (2, 2))
    assert indptr.flags.writeable and indices.flags.writeable
    indptr[0] = 0  # still the caller's to write
    assert not pattern.indptr.flags.writeable and not pattern.indices.flags.writeable


def test_pattern_refuses_keys_that_int32_would_wrap():
    with pytest.raises(ValueError, match=r"indices must lie in \[0, Lk\)"):
        P.Pattern(np.array([0, 1]), np.array([2**32 + 1], np.int64), (1, 4))


@pytest.mark.parametrize("tokens", [np.array([False, False, False, False, True]), [1.7], ["a"]])
def test_longformer_global_tokens_must_be_integer_positions(tokens):
    with pytest.raises(TypeError, match="global_tokens"):
        P.longformer(5, 1, tokens)


@pytest.mark.parametrize("builder", [lambda c: P.local(5, 1, causal=c),
                                     lambda c: P.strided(5, 2, causal=c),
                                     lambda c: P.fixed(6, 3, 1, causal=c),
                                     lambda c: P.dilated(6, 2, 2, causal=c)])
@pytest.mark.parametrize("value", [None, 1, "yes"])
def test_builders_take_a_real_bool_for_causal(builder, value):
    with pytest.raises(TypeError, match="causal must be True or False"):
        builder(value)


def test_empty_and_degenerate():
    check(P.local(0, 3), np.zeros((0, 0), bool))
    check(P.local((0, 5), 3), np.zeros((0, 5), bool))
    check(P.local((4, 0), 3), np.zeros((4, 0), bool))
    assert P.local(0, 1).blocks().n_tiles == 0


def test_large_local_builds_fast():
    import time

    t = time.perf_counter()
    p = P.local(16384, 256)
    elapsed = time.perf_counter() - t
    assert p.nnz == 16384 * 513 - 2 * (256 * 257 // 2)
    # generous bound: a loop over rows in Python takes far longer
    assert elapsed < 5.0


def test_plot_and_coarse():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    p = P.bigbird(200, 10, 1, 3, 1, seed=0)
    fig = p.plot(max_pixels=50)
    assert fig.axes
    c = p.coarse(50)
    assert c.shape == (50, 50)
    assert c.mean() == pytest.approx(p.density)
    fig2 = P.from_mask(np.ones((2, 4, 4), bool)).plot(head=1)
    assert fig2 is not fig


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lq=st.integers(0, 20), lk=st.integers(0, 20),
       ha=st.sampled_from([1, 3]), hb=st.sampled_from([1, 3]),
       density=st.floats(0.0, 1.0), tq=st.integers(1, 7), tk=st.integers(1, 7))
def test_property_algebra_round_trips_and_blocks(seed, lq, lk, ha, hb, density, tq, tk):
    rng = np.random.default_rng(seed)
    ma = rng.random((ha, lq, lk)) < density
    mb = rng.random((hb, lq, lk)) < 0.5
    a = P.from_mask(ma if ha > 1 else ma[0])
    b = P.from_mask(mb if hb > 1 else mb[0])
    union, inter = a | b, a & b
    assert union.n_heads == inter.n_heads == max(ha, hb)
    for got, want in ((union, ma | mb), (inter, ma & mb)):
        want = want if got.n_heads > 1 else want[0]
        np.testing.assert_array_equal(got.to_mask(), want)
    assert (a | a) == a and (a & a) == a
    sp = a.to_scipy()
    for h, s in enumerate(sp if ha > 1 else [sp]):
        np.testing.assert_array_equal(P.from_scipy(s).to_mask(), ma[h])
    lay = a.blocks(tq, tk)
    for h in range(ha):
        for t in range(lay.n_qt):
            r = h * lay.n_qt + t
            sl = slice(lay.tile_ptr[r], lay.tile_ptr[r + 1])
            blocks = [ma[h, t * tq:(t + 1) * tq, kt * tk:(kt + 1) * tk] for kt in range(lay.n_kt)]
            assert lay.tile_idx[sl].tolist() == [kt for kt, x in enumerate(blocks) if x.any()]
            assert lay.tile_full[sl].tolist() == [bool(x.all()) for x in blocks if x.any()]
