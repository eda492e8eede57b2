"""attnnb.tome against an independent NumPy transcription of the reference algorithm.

The oracle below follows facebookresearch/ToMe ``tome/merge.py`` and
dbolya/tomesd ``tomesd/merge.py`` step by step (gather, argsort, scatter
reduce with ``include_self=True``), with the documented choices of attnnb:
stable descending sort (lower index first on ties, NaN first), NumPy random
generators in place of ``torch.rand``/``torch.randint``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnnb
from attnnb import tome

from .helpers import HOST_BACKENDS, assert_close

# ---------------------------------------------------------------------------
# oracle
# ---------------------------------------------------------------------------


def _gather(x, idx):
    return np.take_along_axis(x, idx[..., None], axis=1)


def _scatter_reduce(dst, idx, src, mode):
    """torch.Tensor.scatter_reduce(dim=1, include_self=True), one row at a time."""
    out = dst.astype(np.float64).copy()
    count = np.ones(out.shape[:2])
    for b in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            d = idx[b, j]
            if mode == "amax":
                out[b, d] = np.maximum(out[b, d], src[b, j])
            else:
                out[b, d] += src[b, j]
                count[b, d] += 1
    if mode == "mean":
        out /= count[..., None]
    return out


def _top_edges(scores, r, class_token=False):
    node_max = scores.max(axis=-1)
    node_idx = scores.argmax(axis=-1)  # first maximum, or first NaN
    key = np.where(np.isnan(node_max), -np.inf, -node_max)
    edge_idx = np.argsort(key, axis=-1, kind="stable")
    unm_idx, src_idx = edge_idx[:, r:], edge_idx[:, :r]
    dst_idx = np.take_along_axis(node_idx, src_idx, axis=1)
    if class_token:
        unm_idx = np.sort(unm_idx, axis=1)
    return unm_idx, src_idx, dst_idx


def _unit(metric):
    metric = metric.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return metric / np.linalg.norm(metric, axis=-1, keepdims=True)


def _identity(x, mode=None):
    return np.asarray(x, np.float64)


def oracle_bipartite(metric, r, class_token=False, distill_token=False):
    t = metric.shape[1]
    r = min(r, (t - int(class_token) - int(distill_token)) // 2)
    if r <= 0:
        return _identity, _identity
    m = _unit(metric)
    scores = m[:, ::2] @ m[:, 1::2].transpose(0, 2, 1)
    if class_token:
        scores[:, 0, :] = -np.inf
    if distill_token:
        scores[:, :, 0] = -np.inf
    unm_idx, src_idx, dst_idx = _top_edges(scores, r, class_token)

    def merge(x, mode="mean"):
        x = x.astype(np.float64)
        src, dst = x[:, ::2], x[:, 1::2]
        unm = _gather(src, unm_idx)
        dst = _scatter_reduce(dst, dst_idx, _gather(src, src_idx), mode)
        if distill_token:
            return np.concatenate([unm[:, :1], dst[:, :1], unm[:, 1:], dst[:, 1:]], axis=1)
        return np.concatenate([unm, dst], axis=1)

    def unmerge(x):  # the reference's (plain output order)
        x = x.astype(np.float64)
        n_unm = unm_idx.shape[1]
        unm, dst = x[:, :n_unm], x[:, n_unm:]
        out = np.zeros((x.shape[0], t, x.shape[2]))
        rows = np.arange(x.shape[0])[:, None]
        out[:, 1::2] = dst
        out[rows, 2 * unm_idx] = unm
        out[rows, 2 * src_idx] = _gather(dst, dst_idx)
        return out

    return merge, unmerge


def oracle_kth(metric, k):
    if k <= 1:
        return _identity, _identity

    def split(x):
        B, _, C = x.shape
        t_rnd = (x.shape[1] // k) * k
        x = x[:, :t_rnd].reshape(B, -1, k, C)
        return x[:, :, : k - 1].reshape(B, -1, C), x[:, :, k - 1]

    a, b = split(_unit(metric))
    dst_idx = (a @ b.transpose(0, 2, 1)).argmax(axis=-1)

    def merge(x, mode="mean"):
        src, dst = split(x.astype(np.float64))
        return _scatter_reduce(dst, dst_idx, src, mode)

    def unmerge(x):
        B, _, C = x.shape
        src = _gather(x.astype(np.float64), dst_idx).reshape(B, -1, k - 1, C)
        out = np.concatenate([src, x.astype(np.float64)[:, :, None]], axis=2)
        return out.reshape(B, -1, C)

    return merge, unmerge


def oracle_random(metric, r, seed):
    if r <= 0:
        return _identity, _identity
    B, N, _ = metric.shape
    rand_idx = np.argsort(np.random.default_rng(seed).random((B, N)), axis=1, kind="stable")
    a_idx, b_idx = rand_idx[:, :r], rand_idx[:, r:]

    def split(x):
        return _gather(x, a_idx), _gather(x, b_idx)

    a, b = split(_unit(metric))
    dst_idx = (a @ b.transpose(0, 2, 1)).argmax(axis=-1)

    def merge(x, mode="mean"):
        src, dst = split(x.astype(np.float64))
        return _scatter_reduce(dst, dst_idx, src, mode)

    def unmerge(x):
        x = x.astype(np.float64)
        out = np.zeros((B, N, x.shape[2]))
        rows = np.arange(B)[:, None]
        out[rows, a_idx] = _gather(x, dst_idx)
        out[rows, b_idx] = x
        return out

    return merge, unmerge


def oracle_random2d(metric, w, h, sx, sy, r, no_rand=False, seed=None):
    B, N, _ = metric.shape
    if r <= 0:
        return _identity, _identity
    hsy, wsx = h // sy, w // sx
    if no_rand:
        rand_idx = np.zeros((hsy, wsx, 1), np.int64)
    else:
        rand_idx = np.random.default_rng(seed).integers(sy * sx, size=(hsy, wsx))[..., None]
    view = np.zeros((hsy, wsx, sy * sx), np.int64)
    np.put_along_axis(view, rand_idx, -1, axis=2)
    view = view.reshape(hsy, wsx, sy, sx).transpose(0, 2, 1, 3).reshape(hsy * sy, wsx * sx)
    buffer = np.zeros((h, w), np.int64)
    buffer[: hsy * sy, : wsx * sx] = view
    rand = np.argsort(buffer.reshape(1, -1), axis=1, kind="stable")
    num_dst = hsy * wsx
    a_idx, b_idx = rand[:, num_dst:], rand[:, :num_dst]

    def split(x):
        return x[:, a_idx[0]], x[:, b_idx[0]]

    a, b = split(_unit(metric))
    r = min(a.shape[1], r)
    unm_idx, src_idx, dst_idx = _top_edges(a @ b.transpose(0, 2, 1), r)

    def merge(x, mode="mean"):
        src, dst = split(x.astype(np.float64))
        unm = _gather(src, unm_idx)
        dst = _scatter_reduce(dst, dst_idx, _gather(src, src_idx), mode)
        return np.concatenate([unm, dst], axis=1)

    def unmerge(x):
        x = x.astype(np.float64)
        n_unm = unm_idx.shape[1]
        unm, dst = x[:, :n_unm], x[:, n_unm:]
        out = np.zeros((B, N, x.shape[2]))
        rows = np.arange(B)[:, None]
        out[:, b_idx[0]] = dst
        out[rows, a_idx[0][unm_idx]] = unm
        out[rows, a_idx[0][src_idx]] = _gather(dst, dst_idx)
        return out

    return merge, unmerge


def oracle_parse_r(num_layers, r):
    inflect = 0
    if isinstance(r, list):
        return list(r) + [0] * (num_layers - len(r))
    if isinstance(r, tuple):
        r, inflect = r
    min_val = int(r * (1.0 - inflect))
    max_val = 2 * r - min_val
    step = (max_val - min_val) / (num_layers - 1)
    return [int(min_val + step * i) for i in range(num_layers)]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

MODES = ("mean", "sum", "amax")


def _data(rng, B, N, C, dtype=np.float64):
    return rng.standard_normal((B, N, C)).astype(dtype)


def _check_against(matching, oracle, x, check_unmerge=True):
    merge, unmerge = oracle
    for mode in MODES:
        got = matching.merge(x, mode)
        assert got.dtype == x.dtype
        assert_close(got, merge(x, mode), dtype=x.dtype, what=f"merge {mode}")
    if check_unmerge:
        merged = matching.merge(x)
        assert_close(matching.unmerge(merged), unmerge(merged.astype(np.float64)),
                     dtype=x.dtype, what="unmerge")


# ---------------------------------------------------------------------------
# bipartite_soft_matching
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("class_token,distill_token",
                         [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("N,r", [(13, 4), (14, 6), (9, 100), (2, 1)])
def test_bipartite_against_oracle(rng, backend, class_token, distill_token, N, r):
    metric, x = _data(rng, 3, N, 5), _data(rng, 3, N, 4)
    m = tome.bipartite_soft_matching(metric, r, class_token=class_token,
                                     distill_token=distill_token, backend=backend)
    expected_r = max(0, min(r, (N - class_token - distill_token) // 2))
    assert m.r == expected_r and m.n_out == N - expected_r
    oracle = oracle_bipartite(metric, r, class_token, distill_token)
    # the reference's unmerge assumes the plain order, also after a distillation merge
    _check_against(m, oracle, x, check_unmerge=not distill_token)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_bipartite_index_arrays(rng, backend):
    metric = _data(rng, 2, 11, 6)
    m = tome.bipartite_soft_matching(metric, 4, class_token=True, backend=backend)
    m_ = _unit(metric)
    scores = m_[:, ::2] @ m_[:, 1::2].transpose(0, 2, 1)
    scores[:, 0] = -np.inf
    unm, src, dst = _top_edges(scores, 4, class_token=True)
    np.testing.assert_array_equal(m.unm_idx, unm)
    np.testing.assert_array_equal(m.src_idx, src)
    np.testing.assert_array_equal(m.dst_idx, dst)
    np.testing.assert_array_equal(m.a_idx[0], np.arange(0, 11, 2))
    np.testing.assert_array_equal(m.b_idx[0], np.arange(1, 11, 2))
    assert (m.unm_idx[:, 0] == 0).all()  # class token kept first
    assert m.slot.shape == (2, 11) and m.slot.min() == 0 and m.slot.max() == m.n_out - 1


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_class_token_first_and_never_merged(rng, backend):
    metric = _data(rng, 2, 21, 3)
    metric[:, 0] = metric[:, 1]  # the class token's best partner is exact; still protected
    x = _data(rng, 2, 21, 4)
    m = tome.bipartite_soft_matching(metric, 10, class_token=True, backend=backend)
    assert m.r == 10
    np.testing.assert_array_equal(m.merge(x, "sum")[:, 0], x[:, 0])


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_distill_token_order_and_unmerge_inverse(rng, backend):
    metric, x = _data(rng, 2, 15, 4), _data(rng, 2, 15, 3)
    metric[:, 3] = metric[:, 1]  # token 3 would like to merge into the distillation token
    m = tome.bipartite_soft_matching(metric, 6, class_token=True, distill_token=True,
                                     backend=backend)
    merged = m.merge(x, "sum")
    np.testing.assert_array_equal(merged[:, 0], x[:, 0])  # class token
    np.testing.assert_array_equal(merged[:, 1], x[:, 1])  # distillation token, untouched
    assert (m.dst_idx != 0).all()
    # unmerge is the inverse of merge's order: every token gets its group's mean
    back = m.unmerge(m.merge(x))
    group_mean = m.merge(x)[np.arange(2)[:, None], m.slot]
    assert_close(back, group_mean)
    np.testing.assert_array_equal(back[:, :2], x[:, :2])


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("r", [0, -3])
def test_r_not_positive_is_a_no_op(rng, backend, r):
    metric = _data(rng, 2, 9, 3, np.float32)
    m = tome.bipartite_soft_matching(metric, r, backend=backend)
    assert m.r == 0 and m.n_out == 9
    for mode in MODES:
        out = m.merge(metric, mode)
        np.testing.assert_array_equal(out, metric)
        assert out is not metric and out.dtype == np.float32
    np.testing.assert_array_equal(m.unmerge(metric), metric)
    x, size = tome.merge_wavg(m, metric)
    np.testing.assert_array_equal(x, metric)
    np.testing.assert_array_equal(size, np.ones((2, 9, 1), np.float32))


def test_r_clamped_with_protected_tokens(rng):
    metric = _data(rng, 1, 7, 3)
    assert tome.bipartite_soft_matching(metric, 50).r == 3
    assert tome.bipartite_soft_matching(metric, 50, class_token=True).r == 3
    assert tome.bipartite_soft_matching(metric, 50, class_token=True, distill_token=True).r == 2
    assert tome.bipartite_soft_matching(metric[:, :2], 1, class_token=True).r == 0


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_ties_lower_index_first(backend):
    """All similarities equal: edges in A order, every destination B token 0."""
    metric = np.ones((2, 10, 3))
    m = tome.bipartite_soft_matching(metric, 3, backend=backend)
    np.testing.assert_array_equal(m.src_idx, [[0, 1, 2]] * 2)
    np.testing.assert_array_equal(m.unm_idx, [[3, 4]] * 2)
    np.testing.assert_array_equal(m.dst_idx, 0)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_nan_rows_follow_torch(rng, backend):
    """A zero metric row gives NaN similarities: NaN ranks first, at its first column."""
    metric = _data(rng, 2, 12, 3)
    metric[0, 4] = 0.0   # A token 2 of batch 0: a NaN row
    metric[1, 7] = 0.0   # B token 3 of batch 1: a NaN column
    m = tome.bipartite_soft_matching(metric, 2, backend=backend)
    np.testing.assert_array_equal(m.src_idx[0, :1], [2])
    np.testing.assert_array_equal(m.dst_idx[0, :1], [0])
    np.testing.assert_array_equal(m.src_idx[1], [0, 1])  # every row NaN: A order
    np.testing.assert_array_equal(m.dst_idx[1], [3, 3])
    x = _data(rng, 2, 12, 2)
    _check_against(m, oracle_bipartite(metric, 2), x)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cpu_equals_reference_across_tiles(rng, dtype):
    """Sizes past one A tile (256) and one B tile (256) of the cpu kernel."""
    metric = _data(rng, 2, 1101, 6, dtype)
    x = _data(rng, 2, 1101, 5, dtype)
    for kw in ({}, {"class_token": True, "distill_token": True}):
        ref = tome.bipartite_soft_matching(metric, 300, backend="reference", **kw)
        cpu = tome.bipartite_soft_matching(metric, 300, backend="cpu", **kw)
        if dtype == np.float64:
            for name in ("unm_idx", "src_idx", "dst_idx", "slot"):
                np.testing.assert_array_equal(getattr(cpu, name), getattr(ref, name), name)
            for mode in MODES:
                assert_close(cpu.merge(x, mode), ref.merge(x, mode))
        else:
            # float32 similarities may order near-ties differently: the chosen edges
            # must be as good as the reference's to float32 rounding
            u = _unit(metric)
            sims = [np.einsum("bjc,bjc->bj", _gather(u[:, ::2], mm.src_idx),
                              _gather(u[:, 1::2], mm.dst_idx)) for mm in (cpu, ref)]
            np.testing.assert_allclose(np.sort(sims[0]), np.sort(sims[1]), atol=1e-5)
        assert_close(cpu.merge(x, "sum", backend="cpu"), cpu.merge(x, "sum", backend="reference"))
        merged = cpu.merge(x)
        assert_close(cpu.unmerge(merged, backend="cpu"), cpu.unmerge(merged, backend="reference"))


def test_unpacks_like_the_reference(rng):
    metric = _data(rng, 1, 8, 3)
    merge, unmerge = tome.bipartite_soft_matching(metric, 2)
    merged = merge(metric, mode="sum")
    assert merged.shape == (1, 6, 3) and unmerge(merged).shape == (1, 8, 3)
    m = tome.bipartite_soft_matching(metric, 2)
    np.testing.assert_array_equal(m(metric, "amax"), m.merge(metric, "amax"))


def test_float16_and_readonly_inputs(rng):
    metric = _data(rng, 2, 9, 4, np.float16)
    metric.setflags(write=False)
    m = tome.bipartite_soft_matching(metric, 3)
    out = m.merge(metric)
    assert out.dtype == np.float16 and out.shape == (2, 6, 4)
    assert m.unmerge(out).dtype == np.float16
    fortran = np.asfortranarray(_data(rng, 2, 9, 4))
    assert_close(m.merge(fortran), m.merge(np.ascontiguousarray(fortran)))


# ---------------------------------------------------------------------------
# the other matchings
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("N,k", [(12, 3), (14, 3), (10, 2), (7, 7), (9, 4)])
def test_kth_against_oracle(rng, backend, N, k):
    metric, x = _data(rng, 2, N, 4), _data(rng, 2, N, 3)
    m = tome.kth_bipartite_soft_matching(metric, k, backend=backend)
    assert m.n_out == N // k and m.n_kept == (N // k) * k
    _check_against(m, oracle_kth(metric, k), x)


def test_kth_edge_cases(rng):
    metric = _data(rng, 2, 7, 3)
    for k in (1, 0, -2):
        m = tome.kth_bipartite_soft_matching(metric, k)
        assert m.n_out == 7
        np.testing.assert_array_equal(m.merge(metric), metric)
    with pytest.raises(ValueError, match="k"):
        tome.kth_bipartite_soft_matching(metric, 8)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("N,r", [(11, 4), (8, 1), (6, 5)])
def test_random_against_oracle(rng, backend, N, r):
    metric, x = _data(rng, 3, N, 4), _data(rng, 3, N, 3)
    m = tome.random_bipartite_soft_matching(metric, r, seed=7, backend=backend)
    assert m.n_out == N - r
    _check_against(m, oracle_random(metric, r, 7), x)


def test_random_seeds(rng):
    metric = _data(rng, 2, 30, 4)
    a = tome.random_bipartite_soft_matching(metric, 10, seed=1)
    b = tome.random_bipartite_soft_matching(metric, 10, seed=1)
    c = tome.random_bipartite_soft_matching(metric, 10, seed=2)
    np.testing.assert_array_equal(a.a_idx, b.a_idx)
    np.testing.assert_array_equal(a.slot, b.slot)
    assert not np.array_equal(a.a_idx, c.a_idx)
    gen = np.random.default_rng(1)
    np.testing.assert_array_equal(tome.random_bipartite_soft_matching(metric, 10, seed=gen).a_idx,
                                  a.a_idx)
    assert tome.random_bipartite_soft_matching(metric, 100).r == 29  # clamped to N - 1
    assert tome.random_bipartite_soft_matching(metric, 0).n_out == 30


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("w,h,sx,sy,r,no_rand", [
    (8, 6, 2, 2, 20, False),   # divisible
    (7, 5, 2, 2, 12, False),   # neither side divisible
    (9, 4, 3, 2, 30, True),    # top-left destinations, r capped at the sources
    (5, 5, 2, 3, 100, False),  # r capped
])
def test_random2d_against_oracle(rng, backend, w, h, sx, sy, r, no_rand):
    N = w * h
    metric, x = _data(rng, 2, N, 4), _data(rng, 2, N, 3)
    m = tome.bipartite_soft_matching_random2d(metric, w, h, sx, sy, r, no_rand=no_rand,
                                              seed=3, backend=backend)
    num_dst = (w // sx) * (h // sy)
    assert m.b_idx.shape == (1, num_dst)
    assert m.r == min(r, N - num_dst) and m.n_out == N - m.r
    _check_against(m, oracle_random2d(metric, w, h, sx, sy, r, no_rand, seed=3), x)


def test_random2d_cells_and_seeds(rng):
    w, h = 8, 6
    metric = _data(rng, 1, w * h, 3)
    m = tome.bipartite_soft_matching_random2d(metric, w, h, 2, 2, 10, seed=5)
    cells = (m.b_idx[0] // w // 2) * (w // 2) + (m.b_idx[0] % w) // 2
    np.testing.assert_array_equal(np.sort(cells), np.arange(12))  # one destination per cell
    same = tome.bipartite_soft_matching_random2d(metric, w, h, 2, 2, 10, seed=5)
    np.testing.assert_array_equal(m.b_idx, same.b_idx)
    fixed = tome.bipartite_soft_matching_random2d(metric, w, h, 2, 2, 10, no_rand=True)
    rows, cols = np.divmod(fixed.b_idx[0], w)
    assert (rows % 2 == 0).all() and (cols % 2 == 0).all()
    assert tome.bipartite_soft_matching_random2d(metric, w, h, 1, 1, 10).n_out == w * h
    assert tome.bipartite_soft_matching_random2d(metric, w, h, 2, 2, 0).n_out == w * h


# ---------------------------------------------------------------------------
# merge_wavg, merge_source, parse_r
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_merge_wavg_size_bookkeeping(rng, backend):
    B, N, C = 2, 17, 5
    x = _data(rng, B, N, C)
    size = None
    for r in (4, 3, 2):
        metric = _data(rng, B, x.shape[1], 3)
        m = tome.bipartite_soft_matching(metric, r, class_token=True, backend=backend)
        merge, _ = oracle_bipartite(metric, r, class_token=True)
        s_in = np.ones((B, x.shape[1], 1)) if size is None else size
        expected = merge(x * s_in, "sum") / merge(s_in, "sum")
        x, size = tome.merge_wavg(m, x, size)
        assert size.shape == (B, x.shape[1], 1)
        assert_close(x, expected)
    assert x.shape[1] == N - 9
    np.testing.assert_array_equal(size.sum(axis=(1, 2)), N)
    np.testing.assert_array_equal(size[:, 0, 0], 1)  # class token never grows


def test_merge_wavg_accepts_a_merge_function(rng):
    metric = _data(rng, 1, 10, 3)
    m = tome.bipartite_soft_matching(metric, 3)
    merge, _ = m
    a = tome.merge_wavg(merge, metric)
    b = tome.merge_wavg(m, metric)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)


def test_merge_wavg_takes_integer_counts():
    rng = np.random.default_rng(1)
    matching = tome.bipartite_soft_matching(rng.standard_normal((1, 6, 3)), 2)
    x = rng.standard_normal((1, 6, 4))
    counts = rng.integers(1, 4, (1, 6, 1))
    got = tome.merge_wavg(matching, x, counts)
    want = tome.merge_wavg(matching, x, counts.astype(np.float64))
    for g, w in zip(got, want):
        assert g.dtype == np.float64
        np.testing.assert_array_equal(g, w)
    with pytest.raises(TypeError):
        tome.merge_wavg(matching, x, np.ones((1, 6, 1), bool))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_merge_source(rng, backend):
    B, N = 2, 15
    x = _data(rng, B, N, 4)
    source = None
    for r in (4, 3):
        m = tome.bipartite_soft_matching(_data(rng, B, x.shape[1], 3), r, backend=backend)
        new = tome.merge_source(m, x, source)
        src = np.broadcast_to(np.eye(x.shape[1]), (B, x.shape[1], x.shape[1])) \
            if source is None else source
        np.testing.assert_array_equal(new, m.merge(src, "amax"))
        source, x = new, m.merge(x)
    assert source.shape == (B, N - 7, N)
    np.testing.assert_array_equal(source.sum(axis=1), 1)  # every original token in one group
    assert set(np.unique(source)) <= {0.0, 1.0}


def test_parse_r():
    for num_layers, r in [(12, 8), (12, (8, -1)), (12, (8, 0.5)), (24, (13, 1)), (5, [1, 2]),
                          (3, [4, 4, 4, 4])]:
        assert tome.parse_r(num_layers, r) == oracle_parse_r(num_layers, r)
    assert tome.parse_r(1, 5) == [5]
    assert tome.parse_r(12, (8, -1))[0] == 16 and tome.parse_r(12, (8, -1))[-1] == 0
    with pytest.raises(ValueError):
        tome.parse_r(0, 4)
    with pytest.raises(TypeError):
        tome.parse_r(4, 2.5)


# ---------------------------------------------------------------------------
# end to end: proportional attention and duplicates
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_merged_duplicates_leave_attention_unchanged(rng, backend, dtype):
    """Tokens with exact duplicates -> match -> merge_wavg -> attention(key_size=size)."""
    B, N, C, H = 2, 24, 16, 2
    tokens = _data(rng, B, N, C)
    dup = [2, 6, 10, 16]  # even token 2i duplicates odd token 2i + 1
    for p in dup:
        tokens[:, p] = tokens[:, p + 1]
    tokens = tokens.astype(dtype)
    wq, wk, wv = (rng.standard_normal((C, H * 8)).astype(dtype) / 4 for _ in range(3))

    def heads(t, w):
        return (t @ w).reshape(B, -1, H, 8).transpose(0, 2, 1, 3)

    full = attnnb.attention(heads(tokens, wq), heads(tokens, wk), heads(tokens, wv),
                            backend=backend)
    m = tome.bipartite_soft_matching(tokens, len(dup), backend=backend)
    np.testing.assert_array_equal(np.sort(2 * m.src_idx, axis=1), [dup] * B)
    merged, size = tome.merge_wavg(m, tokens)
    np.testing.assert_array_equal(size.sum(axis=1), N)
    out = attnnb.attention(heads(tokens, wq), heads(merged, wk), heads(merged, wv),
                           key_size=size, backend=backend)
    assert_close(out, full, dtype=dtype)
    wrong = attnnb.attention(heads(tokens, wq), heads(merged, wk), heads(merged, wv),
                             backend=backend)
    assert np.abs(wrong - full).max() > 1e-3  # without sizes the normalisation is off


# ---------------------------------------------------------------------------
# properties and bad input
# ---------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), N=st.integers(1, 40), r=st.integers(-2, 25),
       cls=st.booleans(), dist=st.booleans(), seed=st.integers(0, 2**16))
def test_property_backends_agree_and_unmerge_inverts(B, N, r, cls, dist, seed):
    rng = np.random.default_rng(seed)
    metric = _data(rng, B, N, 3)
    ref = tome.bipartite_soft_matching(metric, r, class_token=cls, distill_token=dist,
                                       backend="reference")
    cpu = tome.bipartite_soft_matching(metric, r, class_token=cls, distill_token=dist,
                                       backend="cpu")
    np.testing.assert_array_equal(ref.slot, cpu.slot)
    assert ref.n_out == N - max(0, min(r, (N - cls - dist) // 2))
    # one-hot tokens: amax merge then unmerge recovers each token's group membership
    eye = np.broadcast_to(np.eye(N), (B, N, N))
    groups = cpu.unmerge(cpu.merge(eye, "amax"))
    same = ref.slot[..., :, None] == ref.slot[..., None, :]
    np.testing.assert_array_equal(groups, np.broadcast_to(same, (B, N, N)).astype(float))


def test_bad_input(rng):
    metric = _data(rng, 2, 8, 3)
    with pytest.raises(ValueError, match="metric"):
        tome.bipartite_soft_matching(metric[0], 2)
    with pytest.raises(TypeError, match="metric"):
        tome.bipartite_soft_matching(metric.astype(int), 2)
    with pytest.raises(ValueError, match="channel"):
        tome.bipartite_soft_matching(metric[..., :0], 2)
    with pytest.raises(TypeError, match="r"):
        tome.bipartite_soft_matching(metric, 2.0)
    with pytest.raises(TypeError, match="r"):
        tome.bipartite_soft_matching(metric, True)
    with pytest.raises(TypeError, match="class_token"):
        tome.bipartite_soft_matching(metric, 2, class_token=1)
    with pytest.raises(ValueError, match="backend"):
        tome.bipartite_soft_matching(metric, 2, backend="gpu")
    m = tome.bipartite_soft_matching(metric, 2)
    with pytest.raises(ValueError, match="mode"):
        m.merge(metric, "max")
    with pytest.raises(ValueError, match="x"):
        m.merge(metric[:, :7])
    with pytest.raises(ValueError, match="x"):
        m.unmerge(metric)
    with pytest.raises(ValueError, match="w \\* h"):
        tome.bipartite_soft_matching_random2d(metric, 3, 3, 1, 1, 2)
    with pytest.raises(ValueError, match="cell"):
        tome.bipartite_soft_matching_random2d(metric, 4, 2, 1, 3, 2)
    with pytest.raises(ValueError, match="size"):
        tome.merge_wavg(m, metric, np.ones((2, 8)))
    with pytest.raises(TypeError, match="matching"):
        tome.merge_wavg("merge", metric)
    before = metric.copy()
    tome.merge_wavg(m, metric)
    np.testing.assert_array_equal(metric, before)


def test_inf_in_metric_gives_a_nan_row_on_every_backend(rng):
    metric = _data(rng, 1, 10, 3)
    metric[0, 2, 1] = np.inf  # A token 1: inf / inf = NaN in its unit row
    ref, cpu = (tome.bipartite_soft_matching(metric, 2, backend=b) for b in HOST_BACKENDS)
    np.testing.assert_array_equal(ref.slot, cpu.slot)
    assert ref.src_idx[0, 0] == 1 and ref.dst_idx[0, 0] == 0



def test_concurrent_threads_match_a_lone_call(rng):
    from concurrent.futures import ThreadPoolExecutor

    metric = _data(rng, 2, 301, 8, np.float32)

    def step(_):
        m = tome.bipartite_soft_matching(metric, 100, class_token=True, backend="cpu")
        return m.slot, m.merge(metric)

    alone = step(0)
    with ThreadPoolExecutor(4) as pool:
        for slot, merged in pool.map(step, range(8)):
            np.testing.assert_array_equal(slot, alone[0])
            np.testing.assert_array_equal(merged, alone[1])
