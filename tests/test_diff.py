"""diff_attention and the attnnb.diff helpers against their formulas, on every host backend."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnnb
from attnnb.diff import diff_attention, lambda_init, reparam_lambda, subln

from .helpers import HOST_BACKENDS, assert_close, assert_gradients_near_fd, randn

MODES = ("difference", "rectified", "heaviside")


def formula(q, k, v, lam, *, mask=None, bias=None, key_size=None, causal=False, scale=None,
            mode="difference", sinks=None):
    """The paper's definition written out directly in float64, from the user's arrays.

    Pair ``h`` = query heads ``2h, 2h+1`` meets key heads ``2g, 2g+1`` and value
    head ``g = h // (H // Hk)``, component with component; ``sinks`` (broadcastable to
    ``(*batch, 2H)``) add ``e^sink`` to map ``c``'s denominator, query head ``2h + c``'s.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    H, Hk = q.shape[-3] // 2, k.shape[-3] // 2
    rep = H // Hk
    Lq, Lk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    allowed = np.ones(q.shape[:-3] + (H, Lq, Lk), bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & (np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + Lk - Lq)
    maps = []
    for c in (0, 1):
        kc = np.repeat(k[..., c::2, :, :], rep, axis=-3)
        s = scale * q[..., c::2, :, :] @ np.swapaxes(kc, -1, -2)
        if bias is not None:
            s = s + bias
        if key_size is not None:
            s = s + np.log(np.asarray(key_size, np.float64))[..., None, None, :]
        s = np.where(allowed, s, -np.inf)
        m = s.max(axis=-1, keepdims=True) if Lk else np.zeros(s.shape[:-1] + (1,))
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m)
        z = e.sum(axis=-1, keepdims=True)
        if sinks is not None:
            z = z + np.exp(np.broadcast_to(sinks, q.shape[:-2])[..., c::2, None, None] - m)
        maps.append(np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0))
    lam = np.asarray(lam, np.float64)[..., None]
    w = maps[0] - lam * maps[1]
    if mode == "rectified":
        w = np.maximum(w, 0.0)
    if mode == "heaviside":  # A1 - lam H(A1 - lam A2), H(0) = 0
        w = maps[0] - lam * (w > 0)
    return w @ np.repeat(v, rep, axis=-3)


def packed(rng, batch=(2,), h=2, hk=1, lq=70, lk=131, d=8, dv=12, dtype=np.float64, scale=1.0):
    """Random q ``(*batch, 2h, lq, d)``, k ``(*batch, 2hk, lk, d)``, v ``(*batch, hk, lk, dv)``."""
    return (randn(rng, batch + (2 * h, lq, d), dtype, scale),
            randn(rng, batch + (2 * hk, lk, d), dtype, scale),
            randn(rng, batch + (hk, lk, dv), dtype, scale))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lam_shape", ["scalar", "per_head", "per_token", "full"])
def test_matches_formula_for_every_lam_shape(rng, backend, dtype, mode, lam_shape):
    q, k, v = packed(rng, dtype=dtype)
    lam = {"scalar": 0.6, "per_head": rng.uniform(-0.3, 1.2, (2, 1)),
           "per_token": rng.uniform(-0.3, 1.2, (70,)),
           "full": rng.uniform(-0.3, 1.2, (2, 2, 70))}[lam_shape]
    out = diff_attention(q, k, v, lam, mode=mode, backend=backend)
    assert out.shape == (2, 2, 70, 12) and out.dtype == dtype
    assert_close(out, formula(q, k, v, lam, mode=mode), dtype)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", MODES)
def test_causal_mask_bias_key_size(rng, backend, dtype, mode):
    q, k, v = packed(rng, batch=(2,), h=4, hk=2, lq=70, lk=131, dtype=dtype)
    mask = rng.random((4, 70, 131)) < 0.7  # one mask per head pair
    bias = rng.standard_normal((2, 1, 70, 131))
    key_size = rng.integers(1, 5, (2, 131)).astype(np.float64)
    lam = rng.uniform(0.1, 0.9, (4, 1))
    kw = dict(mask=mask, bias=bias, key_size=key_size, causal=True, mode=mode)
    out = diff_attention(q, k, v, lam, backend=backend, **kw)
    assert_close(out, formula(q, k, v, lam, **kw), dtype)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_each_restriction_alone(rng, backend, mode, causal):
    q, k, v = packed(rng, batch=(), h=3, hk=3, lq=65, lk=64, d=5, dv=3)
    lam = 0.8
    for kw in (dict(), dict(mask=rng.random(64) < 0.5), dict(bias=rng.standard_normal((65, 64))),
               dict(key_size=rng.uniform(0.5, 3.0, 64)), dict(scale=0.3)):
        out = diff_attention(q, k, v, lam, causal=causal, mode=mode, backend=backend, **kw)
        assert_close(out, formula(q, k, v, lam, causal=causal, mode=mode, **kw), np.float64,
                     what=str(sorted(kw)))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_gqa_pairs_component_with_component(rng, backend, mode):
    """Pair h equals a one-pair call on key heads (2g, 2g+1) and value head g, g = h // 3."""
    q, k, v = packed(rng, batch=(2,), h=6, hk=2, lq=9, lk=70, d=4, dv=7)
    lam = rng.uniform(0.2, 0.8, (2, 6, 9))
    out = diff_attention(q, k, v, lam, mode=mode, backend=backend)
    for h in range(6):
        g = h // 3
        one = diff_attention(q[:, 2 * h : 2 * h + 2], k[:, 2 * g : 2 * g + 2], v[:, g : g + 1],
                             lam[:, h : h + 1], mode=mode, backend="reference")
        assert_close(out[:, h : h + 1], one, np.float64, what=f"pair {h}")


def test_gqa_differs_from_repeated_key_heads(rng):
    """The naive reference file's repeat_kv pairing is a different function under GQA."""
    q, k, v = packed(rng, batch=(), h=2, hk=1, lq=5, lk=6, d=4, dv=3)
    out = diff_attention(q, k, v, 0.5, backend="reference")
    v2 = np.repeat(v, 2, axis=-3)
    # ours: both pairs meet (k0, k1); repeat_kv would give pair 0 (k0, k0) and pair 1 (k1, k1)
    assert_close(out, diff_attention(q, k[[0, 1, 0, 1]], v2, 0.5, backend="reference"),
                 np.float64)
    naive = diff_attention(q, np.repeat(k, 2, axis=-3), v2, 0.5, backend="reference")
    assert not np.allclose(out, naive)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", MODES)
def test_lam_zero_is_attention_on_the_first_map(rng, backend, dtype, mode):
    q, k, v = packed(rng, batch=(3,), h=4, hk=2, lq=67, lk=80, d=8, dv=16, dtype=dtype)
    mask = rng.random((3, 1, 67, 80)) < 0.8
    ks = rng.uniform(1, 3, (3, 80))
    out = diff_attention(q, k, v, 0, mask=mask, key_size=ks, causal=True, mode=mode,
                         backend=backend)
    ref = attnnb.attention(q[:, 0::2], k[:, 0::2], v, mask=mask, key_size=ks, causal=True,
                           backend=backend)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_weights_sum_to_one_minus_lam_per_token(rng, backend):
    """With ``v = 1`` the output is each row's weight sum: ``1 - lam[i]`` (0 on empty rows)."""
    q, k, _ = packed(rng, batch=(2,), h=2, hk=2, lq=70, lk=66, d=8)
    v = np.ones((2, 2, 66, 1))
    lam = rng.uniform(-1, 2, (2, 2, 70))
    mask = np.ones((70, 66), bool)
    mask[3] = False
    out = diff_attention(q, k, v, lam, mask=mask, backend=backend)[..., 0]
    expect = 1 - lam
    expect[..., 3] = 0.0
    assert_close(out, expect, np.float64)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_empty_rows_and_no_keys_give_zeros(rng, backend, mode):
    q, k, v = packed(rng, batch=(), h=2, hk=2, lq=7, lk=9, d=4, dv=3)
    mask = np.ones((2, 7, 9), bool)
    mask[1, 2] = False
    out = diff_attention(q, k, v, 0.7, mask=mask, mode=mode, backend=backend)
    assert np.all(out[1, 2] == 0) and np.all(np.isfinite(out))
    assert_close(out, formula(q, k, v, 0.7, mask=mask, mode=mode), np.float64)
    out0 = diff_attention(q, k[:, :0], v[:, :0], 0.7, mode=mode, backend=backend)
    assert out0.shape == (2, 7, 3) and np.all(out0 == 0)
    # causal with Lq > Lk: the first queries see no key
    qc = randn(rng, (4, 12, 4))
    outc = diff_attention(qc, k, v, 0.7, causal=True, mode=mode, backend=backend)
    assert np.all(outc[:, :3] == 0)
    assert_close(outc, formula(qc, k, v, 0.7, causal=True, mode=mode), np.float64)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_duplicate_keys_merge_with_key_size(rng, backend, mode):
    q, k, v = packed(rng, batch=(), h=2, hk=1, lq=20, lk=70, d=6, dv=5)
    idx = np.r_[np.arange(70), [3, 3, 40]]
    full = diff_attention(q, k[:, idx], v[:, idx], 0.6, mode=mode, backend=backend)
    size = np.ones(70)
    size[3], size[40] = 3, 2
    merged = diff_attention(q, k, v, 0.6, key_size=size, mode=mode, backend=backend)
    if mode == "heaviside":  # lam is subtracted per key: 3 copies lose it 3 times
        assert not np.allclose(merged, full)
        assert_close(merged, formula(q, k, v, 0.6, key_size=size, mode=mode), np.float64)
        return
    assert_close(merged, full, np.float64)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_large_logits_stay_finite(rng, backend, mode):
    q, k, v = packed(rng, batch=(), h=1, hk=1, lq=66, lk=70, d=4, dv=3, scale=100.0)
    out = diff_attention(q, k, v, 0.5, mode=mode, scale=1.0, backend=backend)  # logits ~ 1e4
    assert np.all(np.isfinite(out))
    assert_close(out, formula(q, k, v, 0.5, mode=mode, scale=1.0), np.float64)
    out32 = diff_attention(q.astype(np.float32), k, v, 0.5, mode=mode, scale=1.0, backend=backend)
    assert np.all(np.isfinite(out32))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_nan_stays_in_its_rows(rng, backend, mode):
    q, k, v = packed(rng, batch=(), h=2, hk=2, lq=8, lk=9, d=4, dv=3)
    q[3, 5, 0] = np.nan  # pair 1, component 2, query 5
    v[0, 4, 1] = np.nan  # key 4 of pair 0, masked for every query below
    mask = np.ones((8, 9), bool)
    mask[:, 4] = False
    out = diff_attention(q, k, v, 0.5, mask=mask, mode=mode, backend=backend)
    bad = np.zeros(out.shape, bool)
    bad[1, 5] = True
    np.testing.assert_array_equal(np.isnan(out), bad)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_dtypes_and_layouts(rng, backend):
    q, k, v = packed(rng, batch=(), h=2, hk=1, lq=9, lk=10, d=4, dv=6)
    ref = formula(q, k, v, 0.4)
    out16 = diff_attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), 0.4,
                           backend=backend)
    assert out16.dtype == np.float16
    assert_close(out16, formula(*(x.astype(np.float16) for x in (q, k, v)), 0.4), np.float16)
    mixed = diff_attention(q.astype(np.float32), k, v.astype(np.float32), np.float32(0.4),
                           backend=backend)
    assert mixed.dtype == np.float64
    # Fortran order, non-contiguous and read-only inputs; lists work too
    qf = np.asfortranarray(q)
    kn = np.repeat(k, 2, axis=-1)[..., ::2]
    vr = v.copy()
    vr.setflags(write=False)
    assert_close(diff_attention(qf, kn, vr, 0.4, backend=backend), ref, np.float64)
    assert_close(diff_attention(q.tolist(), k, v, [0.4], backend=backend), ref, np.float64)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_inputs_are_not_written(rng, backend, mode):
    q, k, v = packed(rng, batch=(2,), h=2, hk=1, lq=9, lk=10, d=4, dv=6)
    lam = rng.uniform(0, 1, (2, 2, 9))
    mask = rng.random((9, 10)) < 0.7
    bias = rng.standard_normal((2, 9, 10))
    ks = rng.uniform(1, 2, 10)
    args = (q, k, v, lam, mask, bias, ks)
    copies = [a.copy() for a in args]
    diff_attention(q, k, v, lam, mask=mask, bias=bias, key_size=ks, causal=True, mode=mode,
                   backend=backend)
    for a, c in zip(args, copies, strict=True):
        np.testing.assert_array_equal(a, c)


def test_output_can_leave_the_convex_hull(rng):
    """Two values on a line: softmax stays between them, the difference need not."""
    q = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # one pair, one query, d = 2
    k = np.array([[[4.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 4.0]]])
    v = np.array([[[1.0], [2.0]]])
    out = diff_attention(q, k, v, 1.0, scale=1.0)[0, 0, 0]
    a1 = np.exp([4.0, 0.0]) / np.exp([4.0, 0.0]).sum()
    assert_close(out, (a1 - a1[::-1]) @ v[0, :, 0], np.float64)
    assert out < 1.0  # outside [1, 2]


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        (((2, 3, 5, 4), (2, 2, 6, 4), (2, 1, 6, 4), 0.5), {}, ValueError, ["q", "even"]),
        (((2, 2, 5, 4), (2, 3, 6, 4), (2, 1, 6, 4), 0.5), {}, ValueError, ["v", "k"]),
        (((2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, 4), 0.5), {}, ValueError, ["v", "half"]),
        (((2, 6, 5, 4), (2, 4, 6, 4), (2, 2, 6, 4), 0.5), {}, ValueError, ["multiple"]),
        (((2, 2, 5, 4), (2, 2, 6, 3), (2, 1, 6, 4), 0.5), {}, ValueError, ["k", "last axis"]),
        (((5, 4), (6, 4), (6, 4), 0.5), {}, ValueError, ["head axis"]),
        (((2, 2, 5, 4), (2, 2, 6, 4), (2, 1, 6, 4), np.ones(3)), {}, ValueError, ["lam", "(3,)"]),
        (((2, 2, 5, 4), (2, 2, 6, 4), (2, 1, 6, 4), np.nan), {}, ValueError, ["lam", "finite"]),
        (((2, 2, 5, 4), (2, 2, 6, 4), (2, 1, 6, 4), 1j), {}, TypeError, ["lam", "complex"]),
        (((2, 2, 5, 4), (2, 2, 6, 4), (2, 1, 6, 4), None), {}, TypeError, ["lam"]),
        (((2, 2, 5, 4), (2, 2, 6, 4), (2, 1, 6, 4), 0.5), {"mode": "sum"}, ValueError,
         ["mode", "'sum'"]),
        (((2, 2, 5, 4), (2, 2, 6, 4), (2, 1, 6, 4), 0.5), {"mask": np.ones((2, 5, 6), bool)},
         ValueError, ["mask", "(2, 5, 6)"]),
        (((2, 2, 5, 4), (2, 2, 6, 4), (2, 1, 6, 4), 0.5), {"key_size": -np.ones(6)},
         ValueError, ["key_size", "positive"]),
        (((2, 2, 5, 4), (2, 2, 6, 4), (2, 1, 6, 4), 0.5), {"causal": 1}, TypeError, ["causal"]),
    ],
)
def test_bad_input_names_the_argument(args, kwargs, exc, words):
    q, k, v, lam = (np.zeros(a) if isinstance(a, tuple) else a for a in args)
    with pytest.raises(exc) as info:
        diff_attention(q, k, v, lam, backend="reference", **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    with pytest.raises(TypeError, match="q"):
        diff_attention(np.zeros((2, 5, 4), int), np.zeros((2, 6, 4)), np.zeros((1, 6, 4)), 0.5)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_cpu_matches_reference_property(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    hk = data.draw(st.integers(1, 2))
    h = hk * data.draw(st.integers(1, 2))
    lq, lk = data.draw(st.integers(1, 80)), data.draw(st.integers(0, 80))
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    mode = data.draw(st.sampled_from(MODES))
    causal = data.draw(st.booleans())
    q, k, v = packed(rng, batch=(), h=h, hk=hk, lq=lq, lk=lk, d=3, dv=5, dtype=dtype)
    lam = rng.uniform(-1, 2, (h, lq))
    mask = rng.random((lq, lk)) < 0.6 if data.draw(st.booleans()) else None
    kw = dict(mask=mask, causal=causal, mode=mode)
    out = diff_attention(q, k, v, lam, backend="cpu", **kw)
    ref = diff_attention(q, k, v, lam, backend="reference", **kw)
    assert_close(out, ref, dtype)


def test_lambda_init():
    assert lambda_init(0) == pytest.approx(0.2, abs=1e-15)
    assert isinstance(lambda_init(3), float)
    depth = np.arange(12)
    np.testing.assert_allclose(lambda_init(depth), 0.8 - 0.6 * np.exp(-0.3 * depth), rtol=1e-15)
    with pytest.raises(TypeError, match="depth"):
        lambda_init(1j)


def test_reparam_lambda(rng):
    lq1, lk1, lq2, lk2 = (0.1 * rng.standard_normal(16) for _ in range(4))
    expect = np.exp(lq1 @ lk1) - np.exp(lq2 @ lk2) + 0.35
    assert reparam_lambda(lq1, lk1, lq2, lk2, 0.35) == pytest.approx(expect, rel=1e-14)
    per_head = [0.1 * rng.standard_normal((3, 16)) for _ in range(4)]
    lam = reparam_lambda(*per_head, lambda_init(2))
    assert lam.shape == (3,)
    np.testing.assert_allclose(
        lam, [np.exp(per_head[0][h] @ per_head[1][h]) - np.exp(per_head[2][h] @ per_head[3][h])
              + lambda_init(2) for h in range(3)], rtol=1e-14)
    assert reparam_lambda(*(x.astype(np.float32) for x in per_head), 0.5).dtype == np.float32
    with pytest.raises(ValueError, match="last axis"):
        reparam_lambda(lq1, lk1[:8], lq2, lk2, 0.5)
    with pytest.raises(TypeError, match="lk2"):
        reparam_lambda(lq1, lk1, lq2, lk2 > 0, 0.5)


def test_subln(rng):
    x = rng.standard_normal((2, 3, 5, 8))
    w = rng.uniform(0.5, 1.5, 8)
    init = lambda_init(4)
    expect = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * w * (1 - init)
    np.testing.assert_allclose(subln(x, w, lambda_init=init), expect, rtol=1e-13)
    np.testing.assert_allclose(subln(x, lambda_init=init, eps=0.1),
                               x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 0.1) * (1 - init),
                               rtol=1e-13)
    y16 = subln(x.astype(np.float16), w, lambda_init=init)
    assert y16.dtype == np.float16
    np.testing.assert_allclose(y16, expect, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="weight"):
        subln(x, np.ones(5), lambda_init=init)
    with pytest.raises(TypeError):
        subln(x, w)  # lambda_init is required
    with pytest.raises(TypeError, match="x"):
        subln(np.ones(3, int), lambda_init=init)


def test_subln_weight_never_grows_the_result():
    x = np.ones(8)
    with pytest.raises(ValueError, match="weight of shape"):
        subln(x, np.ones((5, 8)), lambda_init=0.2)
    assert subln(np.ones((3, 8)), np.ones(8), lambda_init=0.2).shape == (3, 8)


def test_concurrent_calls_from_threads(rng):
    from concurrent.futures import ThreadPoolExecutor

    q, k, v = packed(rng, batch=(2,), h=2, hk=1, lq=70, lk=80, d=8, dv=12)
    lone = {m: diff_attention(q, k, v, 0.5, mode=m, backend="cpu") for m in MODES}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda m: (m, diff_attention(q, k, v, 0.5, mode=m,
                                                             backend="cpu")), MODES * 4))
    for m, out in results:
        np.testing.assert_array_equal(out, lone[m])


# ---------------------------------------------------------------------------
# learned sinks, one per component map


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", MODES)
def test_sinks_match_the_formula(rng, backend, dtype, mode):
    """A learned sink per component map (query head), every mode, GQA, an empty row."""
    q, k, v = packed(rng, lq=37, lk=70, dtype=dtype)
    lam = rng.uniform(0.2, 0.8, (2, 1))
    sinks = randn(rng, (2, 4))
    mask = rng.random((37, 70)) > 0.2
    mask[5] = False
    got = diff_attention(q, k, v, lam, mask=mask, causal=True, mode=mode, sinks=sinks,
                         backend=backend)
    want = formula(q, k, v, lam, mask=mask, causal=True, mode=mode, sinks=sinks)
    assert_close(got, want, dtype)
    assert not got[:, :, 5].any()


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_difference_with_sinks_is_two_attention_calls_with_sinks(rng, backend):
    q, k, v = packed(rng, batch=(), h=2, hk=2, lq=9, lk=11)
    lam, sinks = 0.6, randn(rng, (4,))
    got = diff_attention(q, k, v, lam, sinks=sinks, backend=backend)
    maps = [attnnb.attention(q[c::2], k[c::2], v, sinks=sinks[c::2], backend=backend)
            for c in range(2)]
    np.testing.assert_allclose(got, maps[0] - lam * maps[1], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_sink_gradients_against_finite_differences(rng, backend, mode):
    """The sinks' gradient (``attnnb.vjp``: from the output, ``dlam`` and each map's
    LSE), and every other input's with sinks in the maps."""
    q, k, v = packed(rng, batch=(1,), h=2, hk=1, lq=5, lk=7, d=3, dv=2)
    inputs = dict(q=q, k=k, v=v, lam=rng.uniform(0.2, 0.8, (2, 5)), sinks=randn(rng, (4,)),
                  bias=randn(rng, (5, 7)), key_size=rng.uniform(0.5, 2.0, 7))
    assert_gradients_near_fd(diff_attention, inputs, rng, points=4, mode=mode, causal=True,
                             backend=backend)


def test_sinks_refusals(rng):
    q, k, v = packed(rng, batch=(), h=2, hk=1, lq=4, lk=4)
    with pytest.raises(ValueError, match=r"sinks of shape \(2,\) cannot be broadcast to \(4,\)"):
        diff_attention(q, k, v, 0.5, sinks=np.zeros(2))
    da = pytest.importorskip("dask.array")
    lazy = [da.from_array(x) for x in (q, k, v)]
    with pytest.raises(TypeError, match="sinks must be a NumPy array"):
        diff_attention(*lazy, 0.5, sinks=da.zeros(4))
