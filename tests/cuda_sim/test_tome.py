"""Token Merging's cuda backend (match, merge, unmerge) against the float64 reference."""

import numpy as np
import pytest

from ..helpers import assert_close, randn

tome = pytest.importorskip("attnnb.tome", reason="Token Merging is not in this tree yet")
MODES = ("mean", "sum", "amax")


def same_matching(metric, build, dtype):
    """``build(metric, backend)`` on cuda and reference: same edges, same merges."""
    cu = build(metric, "cuda")
    ref = build(metric, "reference")
    for name in ("unm_idx", "src_idx", "dst_idx"):
        np.testing.assert_array_equal(getattr(cu, name), getattr(ref, name), err_msg=name)
    x = randn(np.random.default_rng(0), metric.shape[:2] + (5,), dtype)
    for mode in MODES:
        merged = cu.merge(x, mode)
        assert_close(merged, ref.merge(x, mode), dtype, what=mode)
        assert_close(cu.unmerge(merged), ref.unmerge(merged), dtype, what="unmerge")
    return cu


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("flags", [(False, False), (True, False), (True, True)])
def test_bipartite(rng, dtype, flags):
    metric = randn(rng, (2, 13, 6), dtype)
    same_matching(metric, lambda m, be: tome.bipartite_soft_matching(
        m, 4, class_token=flags[0], distill_token=flags[1], backend=be), dtype)


def test_other_matchings(rng):
    metric = randn(rng, (2, 12, 3), np.float32)
    same_matching(metric, lambda m, be: tome.kth_bipartite_soft_matching(m, 3, backend=be),
                  np.float32)
    same_matching(metric, lambda m, be: tome.random_bipartite_soft_matching(
        m, 3, seed=5, backend=be), np.float32)
    grid = randn(rng, (1, 20, 3), np.float64)  # a 5 x 4 image
    same_matching(grid, lambda m, be: tome.bipartite_soft_matching_random2d(
        m, 5, 4, 2, 2, 6, seed=1, backend=be), np.float64)


def test_ties_nan_and_zero_rows(rng):
    """Duplicate tokens tie (the lower index first); NaN and zero rows win their rows."""
    metric = randn(rng, (1, 14, 4), np.float64)
    metric[0, 6] = metric[0, 4]
    metric[0, 9] = metric[0, 3]
    metric[0, 2] = np.nan
    metric[0, 10] = 0.0
    same_matching(metric, lambda m, be: tome.bipartite_soft_matching(m, 5, backend=be),
                  np.float64)


def test_backend_functions_directly(rng):
    """match's similarities and order; merge with dropped tokens; shared slot rows."""
    from attnnb.cuda import tome as cu
    from attnnb.reference import tome as ref

    metric = randn(rng, (3, 11, 4), np.float32)
    a_idx, b_idx = np.arange(0, 11, 2)[None], np.arange(1, 11, 2)[None]
    got = cu.match(metric, a_idx, b_idx, False, False)
    want = ref.match(metric, a_idx, b_idx, False, False)
    assert_close(got[0], want[0], np.float32, what="node_max")
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(g, w)
    x = randn(rng, (3, 7, 2), np.float32)
    slot = np.array([[0, 2, -1, 1, 0, 2, 1]])
    for mode in MODES:
        assert_close(cu.merge(x, slot, 3, mode), ref.merge(x, slot, 3, mode), np.float32)
    assert_close(cu.unmerge(x, slot[:, [0, 1, 3]]), ref.unmerge(x, slot[:, [0, 1, 3]]),
                 np.float32)


def test_device_arrays_in_place(rng):
    """Device metric, x, size and source: the same matching as the reference (exact), device
    merges and unmerges equal to the host arrays' bit for bit, merge_wavg and merge_source
    on the device."""
    from numba import cuda

    from attnnb._front.validate import is_device_array

    metric = randn(rng, (2, 13, 6), np.float32)
    x = randn(rng, (2, 13, 5), np.float32)
    size = rng.integers(1, 4, (2, 13, 1)).astype(np.float32)
    dev = tome.bipartite_soft_matching(cuda.to_device(metric), 4, class_token=True)
    ref = tome.bipartite_soft_matching(metric, 4, class_token=True, backend="reference")
    assert dev.backend == "cuda"
    for name in ("unm_idx", "src_idx", "dst_idx"):
        np.testing.assert_array_equal(getattr(dev, name), getattr(ref, name), err_msg=name)
    for mode in MODES:
        merged = dev.merge(cuda.to_device(x), mode)
        assert is_device_array(merged) and merged.dtype == np.float32
        np.testing.assert_array_equal(merged.copy_to_host(), dev.merge(x, mode))
        assert_close(merged.copy_to_host(), ref.merge(x, mode), np.float32, what=mode)
        back = dev.unmerge(merged)
        assert is_device_array(back)
        np.testing.assert_array_equal(back.copy_to_host(), ref.unmerge(merged.copy_to_host()))
    xw, sw = tome.merge_wavg(dev, cuda.to_device(x), cuda.to_device(size))
    want_x, want_s = tome.merge_wavg(ref, x, size)
    assert is_device_array(xw) and is_device_array(sw)
    assert_close(xw.copy_to_host(), want_x, np.float32, what="merge_wavg x")
    np.testing.assert_array_equal(sw.copy_to_host(), want_s)  # sums of small integers: exact
    src = tome.merge_source(dev, cuda.to_device(x))
    np.testing.assert_array_equal(src.copy_to_host(), tome.merge_source(ref, x))
    with pytest.raises(TypeError, match="backend 'cpu' runs on the host"):
        tome.bipartite_soft_matching(cuda.to_device(metric), 2, backend="cpu")


def test_device_float16_and_other_matchings(rng):
    from numba import cuda

    metric = randn(rng, (1, 12, 3), np.float16)
    x = randn(rng, (1, 12, 4), np.float16)
    for build in (lambda m, be: tome.kth_bipartite_soft_matching(m, 3, backend=be),
                  lambda m, be: tome.random_bipartite_soft_matching(m, 3, seed=2, backend=be)):
        dev, ref = build(cuda.to_device(metric), None), build(metric, "reference")
        np.testing.assert_array_equal(dev.dst_idx, ref.dst_idx)
        merged = dev.merge(cuda.to_device(x))
        assert merged.dtype == np.float16
        assert_close(merged.copy_to_host(), ref.merge(x), np.float16)
