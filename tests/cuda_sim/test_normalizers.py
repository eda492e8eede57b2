"""``normalizer="sigmoid"`` and ``"softpick"`` on the cuda backend against the float64
reference (docs/contract.md §1.5): outputs, LSEs and every gradient (the LSE's
cotangent and key sizes included), dense and sparse, host and device arrays, and
each one's edges.  Small sizes: the simulator runs a thread per GPU thread."""

import math

import numpy as np
import pytest

import attnnb
from attnnb import patterns

from ..helpers import assert_close, qkv
from .common import assert_several_tiles, host, n, to_device

NORMALIZERS = ["sigmoid", "softpick"]
LQ, LK, D, DV = n(13), n(14), 5, 7
RTOL = {np.float64: 1e-12, np.float32: 2e-5}
GRAD_RTOL = {np.float64: 1e-12, np.float32: 1e-4}

CASES = {
    "GQA, Lq != Lk": dict(hq=4, hk=2, lq=LQ, lk=LK),
    "one head, Lq > Lk, causal": dict(hq=1, hk=1, lq=LQ, lk=n(6), causal=True),
    "mask, bias, key sizes, causal": dict(hq=2, hk=1, lq=LQ, lk=LK, causal=True,
                                          extras=True),
    "dropout, sigmoid_bias": dict(hq=2, hk=2, lq=n(7), lk=n(10), dropout=True,
                                  sigmoid_bias=0.6, extras=True),
}


def _arguments(rng, normalizer, case, dtype):
    """``(q, k, v, kw)`` of a case: the attention arguments, in ``dtype``."""
    spec = dict(CASES[case])
    hq, hk, lq, lk = (spec.pop(x) for x in ("hq", "hk", "lq", "lk"))
    q, k, v = qkv(rng, batch=(2,), hq=hq, hk=hk, lq=lq, lk=lk, d=D, dv=DV, dtype=dtype,
                  scale=1.5)
    kw = dict(normalizer=normalizer, return_lse=True)
    if spec.pop("extras", False):
        mask = rng.random((2, 1, lq, lk)) > 0.3
        mask[0, 0, 2] = False  # an empty row
        kw.update(mask=mask, bias=rng.standard_normal((lq, lk)).astype(dtype),
                  key_size=rng.uniform(0.5, 3.0, (2, lk)).astype(dtype))
    if spec.pop("dropout", False):
        kw.update(dropout_p=0.3, seed=11)
    sigmoid_bias = spec.pop("sigmoid_bias", None)
    if sigmoid_bias is not None and normalizer == "sigmoid":
        kw["sigmoid_bias"] = sigmoid_bias
    kw.update(spec)
    return q, k, v, kw


def _as64(kw):
    return {name: x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype != bool
            else x for name, x in kw.items()}


def _compare_vjp(fn, args, kw, dtype, rng):
    """Output, LSE and every gradient of ``fn`` on cuda (in ``dtype``) against the
    float64 reference's (``dlse`` where the reference's LSE is finite); returns cuda's
    ``(out, lse)``."""
    (out, lse), pb = attnnb.vjp(fn, *args, backend="cuda", **kw)
    (ref, ref_lse), pb_ref = attnnb.vjp(fn, *(x.astype(np.float64) for x in args[:3]),
                                        *args[3:], backend="reference", **_as64(kw))
    assert out.dtype == lse.dtype == np.dtype(dtype)
    assert_close(out, ref, dtype, rtol=RTOL[dtype])
    assert_close(lse, ref_lse, dtype, rtol=RTOL[dtype], what="lse")
    dout = rng.standard_normal(out.shape)
    dlse = np.where(np.isfinite(ref_lse), rng.standard_normal(lse.shape), 0.0)
    got, want = pb(dout.astype(dtype), dlse.astype(dtype)), pb_ref(dout, dlse)
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
            continue
        assert got[name].dtype == np.dtype(dtype), name
        assert_close(got[name], want[name], dtype, rtol=GRAD_RTOL[dtype], what=f"d{name}")
    return out, lse


def test_sizes_cross_several_tiles():
    assert_several_tiles(LQ, LK, D, DV)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_attention_equals_the_reference(rng, normalizer, case, dtype):
    """Forward, LSE and gradients (``dlse`` and key sizes included)."""
    q, k, v, kw = _arguments(rng, normalizer, case, dtype)
    out, lse = _compare_vjp(attnnb.attention, (q, k, v), kw, dtype, rng)
    if "mask" in kw:  # the empty row: zeros, -inf
        assert not out[0, 0, 2].any() and np.isneginf(lse[0, 0, 2])


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_one_row_and_two_keys_a_thread(rng, normalizer):
    """The micro-tiles of these normalizers' key-tile kernel at D <= 64 (one query row
    and two keys a thread; here with the simulator's small tiles, 4 x 6 of 1 x 2)."""
    from attnnb.cuda import _micro

    old = _micro.set_micro_tiles((4, 6, 1, 2))
    try:
        q, k, v, kw = _arguments(rng, normalizer, "mask, bias, key sizes, causal", np.float64)
        _compare_vjp(attnnb.attention, (q, k, v), kw, np.float64, rng)
    finally:
        _micro.set_micro_tiles(old)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_sparse_attention_equals_the_reference(rng, normalizer, dtype):
    """Per-head patterns (full, partial and skipped tiles, an empty row), GQA, key sizes,
    sigmoid's default bias: keys outside a partial tile's pattern take no part in
    softpick's denominator."""
    lq, lk = n(11), n(16)
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=lq, lk=lk, d=D, dv=DV, dtype=dtype,
                  scale=1.5)
    per_head = rng.random((2, lq, lk)) > 0.5
    per_head[1, 3] = False  # an empty row
    per_head[0, :, :6] = True  # full tiles next to partial ones
    kw = dict(normalizer=normalizer, return_lse=True,
              key_size=rng.uniform(0.5, 3.0, (1, lk)).astype(dtype))
    out, lse = _compare_vjp(attnnb.sparse_attention, (q, k, v, patterns.from_mask(per_head)),
                            kw, dtype, rng)
    assert not out[0, 1, 3].any() and np.isneginf(lse[0, 1, 3])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_edges(rng, normalizer, dtype):
    """Empty rows (zeros, -inf); logits of +-1e4; a logit of -inf from the bias (softpick:
    still counted below 0); rows whose logits are all below 0 (softpick: zeros and a
    finite LSE) or all exactly 0 (softpick: no weight at all, -inf); a NaN logit (its row
    NaN, the others not); +inf (sigmoid: a weight of its key size; softpick: a NaN row).
    Then the gradients of the rows that are not NaN."""
    lq, lk = 8, n(9)
    q, k, v = qkv(rng, hq=2, hk=1, lq=lq, lk=lk, d=3, dtype=dtype)
    q[1] = 0.0  # head 1: the logits are the bias
    mask = np.ones((2, lq, lk), bool)
    mask[:, 0] = False
    bias = np.zeros((2, lq, lk))
    bias[1, 1, :4], bias[1, 1, 4:] = 1e4, -1e4  # (logits of the bias alone: exact)
    bias[1, 2] = -rng.uniform(0.1, 3.0, lk)  # all below 0
    bias[1, 3, ::3] = -np.inf
    bias[1, 4] = 0.0  # all exactly 0
    bias[1, 5, 2] = np.inf
    bias[1, 6, 3] = np.nan
    kw = dict(mask=mask, bias=bias.astype(dtype), normalizer=normalizer,
              key_size=rng.uniform(0.5, 2.0, lk).astype(dtype))
    out, lse = attnnb.attention(q, k, v, return_lse=True, backend="cuda", **kw)
    ref, ref_lse = attnnb.attention(q.astype(np.float64), k.astype(np.float64),
                                    v.astype(np.float64), return_lse=True,
                                    backend="reference", **_as64(kw))
    assert_close(out, ref, dtype, rtol=RTOL[dtype])
    assert_close(lse, ref_lse, dtype, rtol=RTOL[dtype], what="lse")
    assert not out[:, 0].any() and np.isneginf(lse[:, 0]).all()
    assert np.isfinite(out[:, 1]).all() and np.isfinite(lse[:, 1]).all()
    assert np.isnan(out[1, 6]).all() and np.isnan(lse[1, 6])
    if normalizer == "sigmoid":
        assert np.isfinite(out[1, 5]).all()
    else:
        assert not out[1, 2].any() and np.isfinite(lse[1, 2])
        assert not out[1, 4].any() and np.isneginf(lse[1, 4])
        assert np.isnan(out[1, 5]).all()
    # the rows that are not NaN (a NaN row spreads to dk, dv and the key sizes); a float32
    # LSE near 1e4 is known to its spacing, ~1e-3, and so are softpick's weights from it
    kept = np.ones((2, lq, lk), bool)
    kept[1, 5:7] = False
    kept[1, 1] = dtype == np.float64 or normalizer == "sigmoid"
    _compare_vjp(attnnb.attention, (q, k, v), dict(kw, mask=mask & kept, return_lse=True),
                 dtype, rng)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_the_gradient_reaches_the_logits_below_0(rng, normalizer):
    """A row whose logits are all below 0: the LSE's cotangent reaches every logit
    (softpick: through its denominator, with zero weights; the values get no gradient)."""
    q, k, v = qkv(rng, hq=1, lq=2, lk=n(6), d=3)
    q[:] = 0.0
    bias = -rng.uniform(0.2, 2.0, (2, k.shape[-2]))
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, normalizer=normalizer,
                                return_lse=True, backend="cuda")
    g = pb(np.zeros_like(out), np.ones_like(lse))
    assert (g["bias"] != 0).all() and np.isfinite(lse).all()
    if normalizer == "softpick":
        assert not out.any() and not g["v"].any()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sigmoid_keeps_precision_where_its_weights_are_tiny(rng, dtype):
    """Rows whose logits are all near -95 (-730 in float64): ``sigmoid`` is subnormal or 0
    in the compute dtype there, yet the LSE and its gradient are exact, and an output
    that is a normal number keeps its digits (``out = O e^m`` with ``e^m`` subnormal).
    Against the formulas (``sigmoid(x) = e^x`` to the last digit there): the float64
    reference's own weights are subnormal at -730.  Logits of -1e4 output 0 (their
    weights are below the smallest number) with the LSE of the row's total weight,
    where the reference's ``sigmoid`` underflows to an LSE of -inf."""
    low, scale = (-95.0, 1e8) if dtype == np.float32 else (-730.0, 1e290)
    lq, lk = 5, n(7)
    q, k, v = qkv(rng, hq=1, lq=lq, lk=lk, d=3, dtype=dtype)
    q[:] = 0.0  # the logits are the bias
    v = (v * scale).astype(dtype)
    x = (low + rng.uniform(-1.0, 1.0, (lq, lk))).astype(dtype)
    kw = dict(normalizer="sigmoid", sigmoid_bias=0.0, return_lse=True, backend="cuda")
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, bias=x, **kw)
    e = np.exp(x.astype(np.float64) - low)
    half = np.exp(low / 2)  # (e^low itself is subnormal in float64 too)
    want = (half * (e @ v[0].astype(np.float64))) * half
    assert (np.abs(want) > np.finfo(dtype).tiny * 100).all()
    np.testing.assert_allclose(out[0], want, rtol=30 * np.finfo(dtype).eps)
    np.testing.assert_allclose(lse[0], low + np.log(e.sum(1)), rtol=RTOL[dtype])
    dlse = rng.standard_normal(lse.shape)
    g = pb(np.zeros_like(out), dlse.astype(dtype))["bias"]
    # d lse / dx_j = w_j (1 - sigmoid(x_j)) / e^lse: the softmax of x here
    assert_close(g, dlse[0][:, None] * e / e.sum(1, keepdims=True), dtype, what="dbias")
    out, lse = attnnb.attention(q, k, v, bias=np.full((lq, lk), -1e4, dtype), **kw)
    assert not out.any()
    np.testing.assert_allclose(lse, -1e4 + math.log(lk), rtol=RTOL[dtype])


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_a_merged_key_weighs_what_its_copies_weigh(rng, normalizer):
    q, k, v = qkv(rng, hq=2, lq=5, lk=n(7), d=3)
    sizes = np.ones(k.shape[-2])
    sizes[0] = 2
    b = {"sigmoid_bias": -math.log(k.shape[-2])} if normalizer == "sigmoid" else {}
    merged = attnnb.attention(q, k, v, key_size=sizes, normalizer=normalizer, backend="cuda",
                              **b)
    twice = attnnb.attention(q, np.concatenate([k[:, :1], k], 1),
                             np.concatenate([v[:, :1], v], 1), normalizer=normalizer,
                             backend="cuda", **b)
    np.testing.assert_allclose(merged, twice, rtol=1e-12)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_device_arrays(rng, normalizer):
    """Device q, k, v with the bias on either side or none, the default and a given
    ``sigmoid_bias``: the reference's results; a device bias is not written (sigmoid's
    offset goes to a copy); device gradients equal the host run's bit for bit."""
    q, k, v = qkv(rng, batch=(2,), hq=2, hk=1, lq=n(5), lk=n(7), d=3, dv=2,
                  dtype=np.float32)
    bias = rng.standard_normal((k.shape[-2],)).astype(np.float32)
    dbias = to_device(bias)[0]
    for sb in ((None, 0.4) if normalizer == "sigmoid" else (None,)):
        extra = {} if sb is None else {"sigmoid_bias": sb}
        for given in (None, bias, dbias):
            kw = dict(normalizer=normalizer, causal=True, return_lse=True, **extra)
            ref, ref_lse = attnnb.attention(q, k, v, bias=None if given is None else bias,
                                            backend="reference", **kw)
            out, lse = attnnb.attention(*to_device(q, k, v), bias=given, **kw)
            assert attnnb._front.validate.is_device_array(out)
            assert_close(host(out), ref, np.float32)
            assert_close(host(lse), ref_lse, np.float32, what="lse")
    np.testing.assert_array_equal(host(dbias), bias)
    kw = dict(normalizer=normalizer, causal=True, return_lse=True)
    (out, lse), pullback = attnnb.vjp(attnnb.attention, *to_device(q, k, v), bias=dbias, **kw)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    on_device = pullback(*to_device(dout, dlse))
    _, host_pullback = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, backend="cuda", **kw)
    on_host = host_pullback(dout, dlse)
    for name, g in on_device.items():
        np.testing.assert_array_equal(host(g), on_host[name], err_msg=name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_learned_sigmoid_bias(rng, dtype):
    """An array ``sigmoid_bias`` (one per query head, host inputs): the reference's
    output and gradients, its own included."""
    q, k, v = qkv(rng, batch=(2,), hq=2, hk=1, lq=n(6), lk=n(9), d=3, dtype=dtype)
    kw = dict(normalizer="sigmoid", sigmoid_bias=np.array([0.5, -1.0], dtype), causal=True,
              return_lse=True, bias=rng.standard_normal((n(6), n(9))).astype(dtype))
    _compare_vjp(attnnb.attention, (q, k, v), kw, dtype, rng)


def test_sigmoid_bias_on_device_inputs_is_checked(rng):
    """Checked as for host inputs; a learned (array) bias is for host inputs only."""
    q, k, v = to_device(*qkv(rng, hq=1, lq=3, lk=4, d=2, dtype=np.float32))
    with pytest.raises(ValueError, match="sigmoid_bias belongs to normalizer='sigmoid'"):
        attnnb.attention(q, k, v, sigmoid_bias=0.5)
    with pytest.raises(ValueError, match="sigmoid_bias must be finite"):
        attnnb.attention(q, k, v, normalizer="sigmoid", sigmoid_bias=np.inf)
    with pytest.raises(TypeError, match="sigmoid_bias must be a real number here"):
        attnnb.attention(q, k, v, normalizer="sigmoid", sigmoid_bias=np.zeros(1))


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_the_cuda_stats_pass_refuses_them_by_name(rng, normalizer):
    """The statistics kernel forms softmax-like weights only: it refuses, never answers
    wrongly (``attnnb.attention_stats`` takes these normalizers on the host)."""
    from attnnb._front.validate import attention_problem
    from attnnb.cuda.stats import attention_stats

    q, k, v = qkv(rng, hq=1, lq=3, lk=4, d=2)
    problem = attention_problem(q, k, v, normalizer=normalizer)
    with pytest.raises(NotImplementedError, match=f"normalizer='{normalizer}' on the cuda"):
        attention_stats(problem, np.zeros(4, bool))
    stats = attnnb.attention_stats(attnnb.attention, q, k, v, normalizer=normalizer,
                                   backend="cuda", stats=("mass",), keys=[0])
    want = attnnb.attention_stats(attnnb.attention, q, k, v, normalizer=normalizer,
                                  backend="reference", stats=("mass",), keys=[0])
    np.testing.assert_allclose(stats["mass"], want["mass"], rtol=1e-12)
