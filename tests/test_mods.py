"""Mask and score functions (attnnb.mods, docs/contract.md §2.10).

The reference backend against materialised masks and biases (its own
arithmetic, written out here), the cpu kernels against the reference,
gradients against finite differences, composition, the tile map of a mask
function, and the errors.  Each distinct mod compiles its own cpu kernels
(seconds each), so the cpu tests combine several mods per call.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

import attnnb
from attnnb import mods
from tests.helpers import assert_close, assert_gradients_near_fd, qkv

# ---------------------------------------------------------------------------
# user functions (module level: their kernels are cached by their source)


def checkerboard(b, h, i, j):
    return (i + j) % 3 != 0


def per_head_shift(s, b, h, i, j, shift):
    return s + shift[h] * 0.5


def per_head_shift_grad(g, s, b, h, i, j, grads, shift):
    grads[0][h] += 0.5 * g


def cubic(s, b, h, i, j):
    return s + 0.1 * s * s * s  # the complex step derives 1 + 0.3 s^2


def clipped(s, b, h, i, j):
    return s if s < 1.0 else 1.0


def returns_float(b, h, i, j):
    return 1.5


def reads_a_python_object(s, b, h, i, j):
    return s + len(object())


# ---------------------------------------------------------------------------
# materialised equivalents (independent of attnnb's compiled functions)


def positions(Lq, Lk):
    return np.arange(Lq)[:, None] + (Lk - Lq), np.arange(Lk)[None, :]


def t5_bucket(relative, bidirectional, num_buckets, max_distance):
    """transformers' T5Attention._relative_position_bucket, in NumPy (float32 logarithm)."""
    buckets = np.zeros(relative.shape, np.int64)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0) * num_buckets
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    small = relative < max_exact
    with np.errstate(divide="ignore", invalid="ignore"):
        large = max_exact + (np.log(relative.astype(np.float32) / max_exact)
                             / np.float32(math.log(max_distance / max_exact))
                             * (num_buckets - max_exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(small, relative, large)


def plain(q, k, v, **kw):
    return attnnb.attention(q, k, v, backend="reference", **kw)


# ---------------------------------------------------------------------------
# reference backend: each built-in against its materialised form


@pytest.mark.parametrize("lq,lk", [(7, 9), (9, 9), (1, 12)])
def test_builtin_masks_equal_their_materialised_masks(lq, lk):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=lq, lk=lk)
    i, j = positions(lq, lk)
    ids = np.repeat(np.arange(4), 3)[:lk]
    cases = [
        (mods.causal, j <= i),
        (mods.sliding_window(3), (i - j >= 0) & (i - j < 3)),
        (mods.sliding_window(3) | mods.sinks(2), ((i - j >= 0) & (i - j < 3)) | (j < 2)),
        (mods.prefix_lm(4), (j < 4) | (j <= i)),
        (mods.document(ids[:lq] if lq == lk else ids[-lq:], ids) & mods.causal,
         ((ids[i] == ids[j]) if lq == lk else (ids[-lq:][:, None] == ids[None, :])) & (j <= i)),
        (~mods.sinks(2), j >= 2),
    ]
    for mod, mask in cases:
        assert_close(plain(q, k, v, mask_mod=mod), plain(q, k, v, mask=mask), what=mod.name)


def test_from_cu_seqlens_is_the_document_mask():
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, hq=1, lq=10, lk=10)
    ids = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    expected = plain(q, k, v, mask=ids[:, None] == ids[None, :], causal=True)
    got = plain(q, k, v, mask_mod=mods.from_cu_seqlens([0, 3, 5, 9, 10]), causal=True)
    assert_close(got, expected)


@pytest.mark.parametrize("lq,lk", [(7, 9), (5, 5)])
def test_builtin_scores_equal_their_materialised_biases(lq, lk):
    rng = np.random.default_rng(2)
    H = 3
    q, k, v = qkv(rng, batch=(2,), hq=H, lq=lq, lk=lk)
    i, j = positions(lq, lk)
    slopes = rng.standard_normal(H)
    table = rng.standard_normal((16, H))
    log_f = -np.abs(rng.standard_normal((H, lk)))
    c = np.cumsum(log_f, axis=-1)
    for bidirectional in (True, False):
        bucket = t5_bucket(j - i, bidirectional, 16, 20)
        mod = mods.relative_bias(table, 16, 20, bidirectional)
        assert_close(plain(q, k, v, score_mod=mod, causal=True),
                     plain(q, k, v, bias=np.moveaxis(table[bucket], -1, 0), causal=True))
    assert_close(plain(q, k, v, score_mod=mods.alibi(slopes), causal=True),
                 plain(q, k, v, bias=slopes[:, None, None] * (j - i), causal=True))
    cq = np.take(c, np.arange(lq) + lk - lq, axis=-1)
    assert_close(plain(q, k, v, score_mod=mods.forgetting(log_f), causal=True),
                 plain(q, k, v, bias=cq[:, :, None] - c[:, None, :], causal=True))


def test_softcap_and_chains_apply_in_order():
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, hq=2, lq=6, lk=8, scale=3.0)
    slopes = np.array([0.5, -1.0])
    i, j = positions(6, 8)
    s = np.einsum("hid,hjd->hij", q, k) / math.sqrt(q.shape[-1])
    for mod, logits in (
            (mods.softcap(2.0), 2.0 * np.tanh(s / 2.0)),
            (mods.softcap(2.0) + mods.alibi(slopes),
             2.0 * np.tanh(s / 2.0) + slopes[:, None, None] * (j - i)),
            (mods.alibi(slopes) + mods.softcap(2.0),
             2.0 * np.tanh((s + slopes[:, None, None] * (j - i)) / 2.0))):
        w = np.exp(logits - logits.max(-1, keepdims=True))
        expected = (w / w.sum(-1, keepdims=True)) @ v
        assert_close(plain(q, k, v, score_mod=mod), expected, what=mod.name)


def test_score_mod_comes_before_bias_key_sizes_and_normalizer():
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, hq=1, lq=5, lk=7)
    bias = rng.standard_normal((5, 7))
    sizes = rng.uniform(1, 3, 7)
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    logits = 2.0 * np.tanh(s / 2.0) + bias + np.log(sizes)
    expected = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)) @ v
    got = plain(q, k, v, score_mod=mods.softcap(2.0), bias=bias, key_size=sizes)
    assert_close(got, expected)


def test_user_functions_plain_and_bound():
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, hq=2, lq=6, lk=6)
    i, j = positions(6, 6)
    assert_close(plain(q, k, v, mask_mod=checkerboard),
                 plain(q, k, v, mask=(i + j) % 3 != 0))
    shift = np.array([1.0, -2.0])
    got = plain(q, k, v, score_mod=mods.score_mod(per_head_shift, shift, constant=True))
    assert_close(got, plain(q, k, v, bias=0.5 * shift[:, None, None] + 0 * i))


def test_empty_rows_from_a_mask_function_are_zero():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, hq=1, lq=4, lk=4)
    out, lse = plain(q, k, v, mask_mod=mods.document([0, 1, 1, 2], [1, 1, 1, 1]),
                     return_lse=True)
    assert np.all(out[0, [0, 3]] == 0) and np.all(np.isneginf(lse[0, [0, 3]]))
    assert np.all(np.isfinite(lse[0, [1, 2]]))


# ---------------------------------------------------------------------------
# gradients (reference) against finite differences, into the mods' arrays too


def _mod_loss_fd(mod_of, params, q, k, v, rng, **kw):
    """vjp's gradients of the mod's parameters against central differences."""
    out, pullback = attnnb.vjp(attnnb.attention, q, k, v, score_mod=mod_of(*params),
                               backend="reference", **kw)
    dout = rng.standard_normal(out.shape)
    grads = pullback(dout)["score_mod"]
    for n, p in enumerate(params):
        for idx in list(np.ndindex(p.shape))[:6]:
            plus, minus = [x.copy() for x in params], [x.copy() for x in params]
            plus[n][idx] += 1e-6
            minus[n][idx] -= 1e-6
            fd = (np.sum(dout * plain(q, k, v, score_mod=mod_of(*plus), **kw))
                  - np.sum(dout * plain(q, k, v, score_mod=mod_of(*minus), **kw))) / 2e-6
            assert abs(fd - grads[n][idx]) <= 1e-6 * (1 + abs(fd)), (mod_of, n, idx)


@pytest.mark.parametrize("name", ["alibi", "softcap", "relative_bias", "forgetting", "chain"])
def test_builtin_score_gradients_against_finite_differences(name):
    rng = np.random.default_rng(7)
    H = 2
    q, k, v = qkv(rng, batch=(2,), hq=H, lq=5, lk=7)
    mod_of, params = {
        "alibi": (mods.alibi, [rng.standard_normal(H)]),
        "softcap": (mods.softcap, [np.array([1.5])]),
        "relative_bias": (lambda t: mods.relative_bias(t, 8, 10, False),
                          [rng.standard_normal((8, H))]),
        "forgetting": (mods.forgetting, [-np.abs(rng.standard_normal((H, 7)))]),
        "chain": (lambda s, c: mods.alibi(s) + mods.softcap(c),
                  [rng.standard_normal(H), np.array([2.0])]),
    }[name]
    _mod_loss_fd(mod_of, params, q, k, v, rng, causal=True)
    assert_gradients_near_fd(attnnb.attention, dict(q=q, k=k, v=v), rng,
                             score_mod=mod_of(*params), mask_mod=mods.sliding_window(4),
                             backend="reference")


def test_user_function_gradients_complex_step_and_given():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, hq=2, lq=5, lk=6)
    assert_gradients_near_fd(attnnb.attention, dict(q=q, k=k, v=v), rng, score_mod=cubic,
                             backend="reference")
    _mod_loss_fd(lambda s: mods.score_mod(per_head_shift, s, grad_arrays=per_head_shift_grad),
                 [rng.standard_normal(2)], q, k, v, rng)


def test_check_passes_builtins_and_names_a_wrong_derivative():
    rng = np.random.default_rng(9)
    for mod in (mods.alibi(rng.standard_normal(2)), mods.softcap(3.0),
                mods.relative_bias(rng.standard_normal((8, 2)), 8, 16),
                mods.forgetting(-np.abs(rng.standard_normal((2, 8)))),
                mods.score_mod(cubic)):
        mods.check(mod)
    wrong = mods.score_mod(cubic, grad_s=lambda s, b, h, i, j: 1.0)
    with pytest.raises(AssertionError, match="cubic.*d score/ds"):
        mods.check(wrong)
    half = mods.score_mod(per_head_shift, np.zeros(2),
                          grad_arrays=lambda g, s, b, h, i, j, grads, shift: None)
    with pytest.raises(AssertionError, match="per_head_shift.*array entry"):
        mods.check(half)


def test_check_never_writes_the_mods_arrays():
    slopes = np.array([0.25, -0.5])
    before = slopes.copy()
    mods.check(mods.alibi(slopes))
    assert np.array_equal(slopes, before)


# ---------------------------------------------------------------------------
# errors


def test_errors_name_the_function_and_what_was_expected():
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, hq=1, lq=3, lk=3)
    with pytest.raises(TypeError, match="returns_float.*must return a bool"):
        plain(q, k, v, mask_mod=returns_float)
    with pytest.raises(TypeError, match="reads_a_python_object.*does not compile"):
        plain(q, k, v, score_mod=reads_a_python_object)
    with pytest.raises(TypeError, match="per_head_shift.*must take 5 arguments"):
        mods.score_mod(per_head_shift)
    with pytest.raises(TypeError, match="score_mod got a mask mod"):
        plain(q, k, v, score_mod=mods.causal)
    with pytest.raises(TypeError, match="array 0 must hold real numbers"):
        mods.score_mod(per_head_shift, np.array(["a"]))
    with pytest.raises(ValueError, match="cap must be one positive"):
        mods.softcap(-1.0)


def test_vjp_refuses_missing_derivatives_before_the_forward():
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, hq=2, lq=3, lk=3)
    with pytest.raises(NotImplementedError, match="per_head_shift.*grad_arrays"):
        attnnb.vjp(attnnb.attention, q, k, v,
                   score_mod=mods.score_mod(per_head_shift, np.ones(2)), backend="reference")
    with pytest.raises(TypeError, match="(?s)clipped.*complex s.*pass grad_s="):
        attnnb.vjp(attnnb.attention, q, k, v, score_mod=clipped, backend="reference")
    # forward only: no derivative needed
    plain(q, k, v, score_mod=clipped)


def test_constant_mods_take_no_gradient_and_like_converts():
    """``mods.constant``: the same outputs, ``None`` for every parameter's gradient (and
    no ``grad_arrays`` asked for); ``mods.like`` gives a float of the logit's type."""
    import numba

    q, k, v = qkv(np.random.default_rng(5), hq=2, lq=6, lk=6, d=4)
    slopes = np.array([0.5, -0.25])
    fixed = mods.constant(mods.alibi(slopes) + mods.softcap(np.array([4.0])))
    out, pb = attnnb.vjp(attnnb.attention, q, k, v, score_mod=fixed, backend="cpu")
    learned = attnnb.attention(q, k, v, score_mod=mods.alibi(slopes) + mods.softcap(4.0),
                               backend="cpu")
    np.testing.assert_array_equal(out, learned)
    assert pb(np.ones_like(out))["score_mod"] == (None, None)
    with pytest.raises(TypeError, match="score mod"):
        mods.constant(mods.causal)

    @numba.njit
    def typed(s, x):
        return mods.like(s, x)

    assert typed(np.float32(1), 3) == typed(1.0, 3) == mods.like(1.0, 3) == 3.0
    returns = {str(sig.args[0]): sig.return_type for sig in typed.nopython_signatures}
    assert returns == {"float32": numba.float32, "float64": numba.float64}


def _every_third_by_batch(b, h, i, j):
    return (i + j + b + h) % 3 != 0


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_dask_mods_see_the_calls_positions(backend):
    """Dask attention and sparse attention with mods: every block's functions see the
    call's (b, h, i, j) and its Lk - Lq (not the block's), so the result is one call's;
    GQA, Lq != Lk, blocks split on every axis."""
    da = pytest.importorskip("dask.array")
    from attnnb import patterns

    rng = np.random.default_rng(21)
    q, k, v = qkv(rng, batch=(2,), hq=2, hk=1, lq=37, lk=45, d=8, dv=5)
    ids = np.repeat(np.arange(4), 12)[:45]
    cases = [dict(mask_mod=mods.document(ids[8:], ids),
                  score_mod=mods.alibi(np.array([0.5, 0.25]))),
             dict(mask_mod=mods.mask_mod(_every_third_by_batch) & mods.causal,
                  score_mod=mods.softcap(2.0), bias=rng.standard_normal((37, 45)))]
    lazy = [da.from_array(x, chunks=(1, 1, 10, 8) if x is q else (1, 1, 13, x.shape[-1]))
            for x in (q, k, v)]
    for kw in cases:
        ref, ref_lse = attnnb.attention(q, k, v, return_lse=True, backend="reference", **kw)
        out, lse = attnnb.attention(*lazy, return_lse=True, backend=backend, **kw)
        assert_close(out.compute(), ref, np.float64)
        assert_close(lse.compute(), ref_lse, np.float64, what="lse")
    pattern = patterns.local((37, 45), 6)
    kw = {name: x for name, x in cases[1].items() if name != "bias"}
    ref = attnnb.sparse_attention(q, k, v, pattern, backend="reference", **kw)
    assert_close(attnnb.sparse_attention(*lazy, pattern, backend=backend, **kw).compute(),
                 ref, np.float64)


def test_dask_skips_blocks_the_mask_function_hides_and_refuses_the_rest():
    """Four documents of 16 in blocks of 16: only the diagonal blocks get a part (a task
    per block the function allows); a function that reads b refuses batch blocks that are
    not consecutive; top-k selects across blocks by the modified logits."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(22)
    q, k, v = qkv(rng, batch=(1,), hq=1, lq=64, lk=64, d=4)
    lazy = [da.from_array(x, chunks=(1, 1, 16, 4)) for x in (q, k, v)]
    docs = mods.document(np.arange(64) // 16)
    out = attnnb.attention(*lazy, mask_mod=docs, backend="cpu")
    parts = [key for key in out.dask if isinstance(key, tuple) and "-part-" in key[0]]
    assert len(parts) == 4
    assert_close(out.compute(), attnnb.attention(q, k, v, mask_mod=docs, backend="reference"),
                 np.float64)
    x = da.from_array(rng.standard_normal((2, 2, 1, 5, 4)), chunks=(2, 1, 1, 5, 4))
    with pytest.raises(NotImplementedError, match="reads b needs batch blocks"):
        attnnb.attention(x, x, x, mask_mod=_every_third_by_batch)
    attnnb.attention(x, x, x, mask_mod=mods.causal)  # (b not read: any blocks)
    for mask in (docs, mods.sliding_window(24)):  # one key block a query block; several
        kw = dict(mask_mod=mask, score_mod=mods.softcap(2.0) + mods.alibi(np.array([0.1])))
        assert_close(attnnb.topk_attention(*lazy, 5, **kw).compute(),
                     attnnb.topk_attention(q, k, v, 5, backend="reference", **kw), np.float64)


@pytest.mark.parametrize("mode", ["difference", "rectified"])
def test_dask_diff_attention_takes_mods(mode):
    """Differential attention on Dask arrays with mods on both maps (h the pair's index):
    the one call's result, in blocks of every axis."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(23)
    q, k, v = qkv(rng, batch=(1,), hq=4, hk=2, lq=21, lk=25, d=4, dv=3)
    v = v[:, :1]
    lam = rng.uniform(0.1, 0.6, (1, 2, 21))
    kw = dict(mask_mod=mods.sliding_window(9) | mods.sinks(2),
              score_mod=mods.alibi(np.array([0.3, -0.2])), mode=mode)
    ref = attnnb.diff_attention(q, k, v, lam, backend="reference", **kw)
    lazy = [da.from_array(x, chunks=(1, 2, 8, 4)) for x in (q, k)]
    out = attnnb.diff_attention(*lazy, da.from_array(v, chunks=(1, 1, 8, 3)), lam,
                                backend="reference", **kw)
    assert_close(out.compute(), ref, np.float64)


# ---------------------------------------------------------------------------
# cpu kernels against the reference (a few combined mods: each compiles its kernels)

CPU_CASES = {
    "alibi+relative, window|sinks": lambda rng, H: (
        mods.alibi(rng.standard_normal(H)) + mods.relative_bias(rng.standard_normal((16, H)),
                                                                16, 40, False),
        mods.sliding_window(70) | mods.sinks(3)),
    "softcap+forgetting, document&causal": lambda rng, H: (
        mods.softcap(2.0) + mods.forgetting(-0.05 * np.abs(rng.standard_normal((H, 150)))),
        mods.document(np.arange(130) // 50 + 1, np.arange(150) // 50) & mods.causal),
}


@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_cpu_forward_and_gradients_match_the_reference(name):
    rng = np.random.default_rng(12)
    H = 4
    q, k, v = qkv(rng, batch=(2,), hq=H, hk=2, lq=130, lk=150, d=16)
    score, mask = CPU_CASES[name](rng, H)
    results = {}
    for backend in ("reference", "cpu"):
        out, pullback = attnnb.vjp(attnnb.attention, q, k, v, score_mod=score, mask_mod=mask,
                                   backend=backend, return_lse=True)
        dout = np.random.default_rng(0).standard_normal(out[0].shape)
        results[backend] = out, pullback(dout, None)
    (out_r, lse_r), g_r = results["reference"]
    (out_c, lse_c), g_c = results["cpu"]
    assert_close(out_c, out_r, rtol=1e-12)
    assert_close(lse_c, lse_r, rtol=1e-12, what="lse")
    for n in ("q", "k", "v"):
        assert_close(g_c[n], g_r[n], rtol=1e-12, what=n)
    assert len(g_c["score_mod"]) == len(g_r["score_mod"])
    for a, b in zip(g_c["score_mod"], g_r["score_mod"]):
        assert (a is None) == (b is None)  # a constant (softcap of a number) gets None
        if a is not None:
            assert_close(a, b, rtol=1e-12, what="score_mod arrays")


def test_cpu_float32_mask_only_and_user_functions():
    """A function with no derivative (``clipped``) runs forward: its slope is never compiled."""
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, batch=(1,), hq=2, lq=100, lk=140, d=8, dtype=np.float32, scale=2.0)
    for kw in (dict(mask_mod=mods.prefix_lm(70)),
               dict(mask_mod=checkerboard, score_mod=clipped),
               dict(score_mod=mods.softcap(1.5), causal=True)):  # float32's rational tanh
        expected = attnnb.attention(q, k, v, backend="reference", **kw)
        assert_close(attnnb.attention(q, k, v, backend="cpu", **kw), expected,
                     dtype=np.float32)


def test_cpu_mask_function_tile_map_matches_the_materialised_mask():
    from attnnb._front.validate import attention_problem
    from attnnb.cpu._mask_tiles import mask_tile_classes
    from attnnb.cpu._mods import tile_map

    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, batch=(1,), hq=2, lq=200, lk=260, d=4)
    mod = mods.prefix_lm(70)
    problem = attention_problem(q, k, v, mask_mod=mod)
    i, j = positions(200, 260)
    materialised = np.broadcast_to((j < 70) | (j <= i), (1, 1, 200, 260))
    by_function = tile_map(problem)
    assert by_function.shape[:2] == (1, 1)  # prefix_lm reads neither b nor h
    assert np.array_equal(by_function, mask_tile_classes(materialised))


def test_cpu_copies_differ_by_closure_and_load_in_a_new_process(tmp_path):
    """Two closures of one source are two kernels; a new process finds both in the cache."""
    script = tmp_path / "closures.py"
    script.write_text(
        "import numpy as np, attnnb\n"
        "def scaled(c):\n"
        "    def f(s, b, h, i, j):\n"
        "        return s * c\n"
        "    return f\n"
        "rng = np.random.default_rng(0)\n"
        "q, k, v = (rng.standard_normal((1, 70, 8)) for _ in range(3))\n"
        "for c in (0.5, 3.0):\n"
        "    got = attnnb.attention(q, k, v, score_mod=scaled(c), backend='cpu')\n"
        "    ref = attnnb.attention(q, k, v, scale=c / np.sqrt(8), backend='reference')\n"
        "    assert np.abs(got - ref).max() < 1e-12, c\n"
        "print('ok')\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              env=env, cwd=os.getcwd(), timeout=600)
        assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_weights_of_a_call_with_mods():
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, batch=(1,), hq=2, lq=9, lk=9, d=4)
    slopes = np.array([0.3, -0.2])
    i, j = positions(9, 9)
    w = attnnb.weights(attnnb.attention, q, k, v, score_mod=mods.alibi(slopes),
                       mask_mod=mods.sliding_window(4), rows=[2, 7], backend="reference")
    expected = attnnb.weights(attnnb.attention, q, k, v,
                              bias=slopes[:, None, None] * (j - i),
                              mask=(i - j >= 0) & (i - j < 4), rows=[2, 7], backend="reference")
    assert_close(w, expected)


def test_readme_example_runs():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    match = re.search(r"<!-- usage:mods -->\n```python\n(.*?)```\n<!-- /usage:mods -->", text,
                      re.S)
    assert match, "README has no usage:mods block"
    namespace: dict = {}
    exec(compile(match.group(1), "README.md:usage:mods", "exec"), namespace)
    assert namespace["out"].shape == (1, 4, 256, 32)


def test_cpu_kernel_copies_carry_the_package_stamp():
    """A copy loads from the cache only while the backend's sources, the compiling of
    mods and the built-ins are unchanged (an edit to any recompiles it)."""
    from attnnb._front.validate import attention_problem
    from attnnb.cpu._mods import mod_kernel
    from attnnb.cpu._numba_patches import ACTIVE, source_stamp
    from attnnb.cpu.attention import attention_kernel

    if not ACTIVE:
        pytest.skip("the Numba patches are off: Numba's own stamps")
    q = np.ones((1, 1, 4, 4))
    copy = mod_kernel(attention_kernel, attention_problem(q, q, q, mask_mod=mods.causal))
    assert copy is not attention_kernel
    assert copy.py_func.__qualname__.startswith("attention_kernel__mod_")
    assert copy._cache._cache_file._source_stamp == source_stamp.package_stamp()


def cpu_matches_reference(fn, args, kw):
    """``fn(*args, **kw)`` and its gradients (q, k, v, the score function's first array)
    on cpu against the reference, float64 to 1e-12; returns the reference's output."""
    results = {}
    for backend in ("reference", "cpu"):
        out, pullback = attnnb.vjp(fn, *args, backend=backend, **kw)
        results[backend] = out, pullback(np.cos(out))
    assert_close(results["cpu"][0], results["reference"][0], rtol=1e-12)
    for n in ("q", "k", "v"):
        assert_close(results["cpu"][1][n], results["reference"][1][n], rtol=1e-12, what=n)
    assert_close(results["cpu"][1]["score_mod"][0], results["reference"][1]["score_mod"][0],
                 rtol=1e-12, what="score_mod's first array")
    return results["reference"][0]


def test_sparse_attention_with_mods_is_dense_with_the_pattern_as_a_mask():
    """Reference: the mask function intersected with the pattern; cpu: the same, both ways."""
    from attnnb import patterns

    rng = np.random.default_rng(16)
    H = 2
    q, k, v = qkv(rng, batch=(1,), hq=H, lq=150, lk=150, d=8)
    pattern = patterns.local(150, 40, causal=True)
    slopes = rng.standard_normal(H)
    kw = dict(score_mod=mods.alibi(slopes), mask_mod=mods.document(np.arange(150) // 60))
    dense = plain(q, k, v, mask=pattern.to_mask(), **kw)
    assert_close(attnnb.sparse_attention(q, k, v, pattern, backend="reference", **kw), dense)
    cpu_matches_reference(attnnb.sparse_attention, (q, k, v, pattern), kw)


# ---------------------------------------------------------------------------
# attnnb.torch: the mods' tensors get .grad


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_torch_mod_tensors_get_gradients(backend):
    torch = pytest.importorskip("torch")
    import attnnb.torch as at

    rng = np.random.default_rng(17)
    q, k, v = (torch.tensor(x, requires_grad=True) for x in qkv(rng, batch=(1,), hq=2,
                                                                  lq=70, lk=70, d=8))
    slopes = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    table = torch.tensor(rng.standard_normal((16, 2)), requires_grad=True)
    score = mods.alibi(slopes) + mods.relative_bias(table, 16, 40, False)
    out = at.attention(q, k, v, causal=True, score_mod=score, mask_mod=mods.sliding_window(30),
                       backend=backend)
    cot = torch.tensor(rng.standard_normal(out.shape))
    (out * cot).sum().backward()
    arrays = [x.detach().numpy() for x in (q, k, v)]
    plain_mods = dict(score_mod=mods.alibi(slopes.detach().numpy())
                      + mods.relative_bias(table.detach().numpy(), 16, 40, False),
                      mask_mod=mods.sliding_window(30))
    expected, pullback = attnnb.vjp(attnnb.attention, *arrays, causal=True, backend=backend,
                                    **plain_mods)
    grads = pullback(cot.numpy())
    assert_close(out.detach().numpy(), expected, rtol=1e-12)
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert_close(t.grad.numpy(), grads[name], rtol=1e-12, what=name)
    assert_close(slopes.grad.numpy(), grads["score_mod"][0], rtol=1e-12, what="slopes")
    assert_close(table.grad.numpy(), grads["score_mod"][1], rtol=1e-12, what="table")


def test_torch_topk_and_diff_attention_take_mods():
    """attnnb.torch's top-k and differential attention with mods: attnnb's results and
    every gradient (lam's and the slopes' too), through the autograd function."""
    torch = pytest.importorskip("torch")
    import attnnb.torch as at

    rng = np.random.default_rng(18)
    q, k, v = qkv(rng, batch=(1,), hq=4, hk=2, lq=9, lk=11, d=4, dv=3)
    lam = rng.uniform(0.1, 0.5, (1, 2, 9))
    slopes = rng.standard_normal(4)
    window = mods.sliding_window(5)
    calls = {
        "topk": (lambda q, k, v, lam, s, f: f.topk_attention(
            q, k, v, 4, mask_mod=window, score_mod=mods.alibi(s), backend="reference"),
            (q, k, v), dict(q=0, k=1, v=2)),
        "diff": (lambda q, k, v, lam, s, f: f.diff_attention(
            q, k, v, lam, mask_mod=window, score_mod=mods.alibi(s[:2]), backend="reference"),
            (q, k, v[:, :1]), dict(q=0, k=1, v=2, lam=3)),
    }
    for name, (run, (qq, kk, vv), wanted) in calls.items():
        tensors = [torch.tensor(x, requires_grad=True) for x in (qq, kk, vv, lam, slopes)]
        out = run(*tensors, at)
        cot = rng.standard_normal(tuple(out.shape))
        (out * torch.tensor(cot)).sum().backward()
        fn = attnnb.topk_attention if name == "topk" else attnnb.diff_attention

        def numpy_call(q, k, v, lam, s, fn=fn, name=name):
            mod = mods.alibi(s if name == "topk" else s[:2])
            args = (q, k, v, 4) if name == "topk" else (q, k, v, lam)
            return attnnb.vjp(fn, *args, mask_mod=window, score_mod=mod, backend="reference")

        expected, pullback = numpy_call(qq, kk, vv, lam, slopes)
        grads = pullback(cot)
        assert_close(out.detach().numpy(), expected, np.float64, what=name)
        for arg, at_ in wanted.items():
            assert_close(tensors[at_].grad.numpy(), grads[arg], np.float64, what=f"{name} {arg}")
        slope_grad = tensors[4].grad.numpy()
        want = grads["score_mod"][0]
        assert_close(slope_grad[:want.size], want, np.float64, what=f"{name} slopes")


def test_torch_gradcheck_and_the_numpy_api_refuses_a_grad_tensor():
    torch = pytest.importorskip("torch")
    import attnnb.torch as at

    rng = np.random.default_rng(18)
    q, k, v = (torch.tensor(x) for x in qkv(rng, hq=2, lq=5, lk=6, d=4))
    log_f = torch.tensor(-np.abs(rng.standard_normal((2, 6))), requires_grad=True)
    qg = q.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q_, f: at.attention(q_, k, v, causal=True, score_mod=mods.forgetting(f),
                                   backend="reference"), (qg, log_f))
    with pytest.raises(TypeError, match="forgetting.*requires grad"):
        attnnb.attention(q.numpy(), k.numpy(), v.numpy(), score_mod=mods.forgetting(log_f))


def test_topk_attention_ranks_the_modified_logits():
    """Top-k with mods: the reference against dense attention over the keys it keeps, and
    the cpu kernels (forward, selection held fixed in the backward) against the reference."""
    rng = np.random.default_rng(19)
    H = 2
    q, k, v = qkv(rng, batch=(1,), hq=H, lq=90, lk=110, d=8)
    slopes = rng.standard_normal(H)
    kw = dict(score_mod=mods.alibi(slopes), mask_mod=mods.sliding_window(50), causal=True)
    reference = cpu_matches_reference(attnnb.topk_attention, (q, k, v, 7), kw)
    # the reference's selection: the 7 largest modified logits among the allowed keys
    i, j = positions(90, 110)
    s = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(8) + slopes[:, None, None] * (j - i)
    allowed = (j <= i) & (i - j < 50)
    s = np.where(allowed, s, -np.inf)
    keep = s >= np.sort(s, axis=-1)[..., -7:-6]
    assert_close(reference, plain(q, k, v, mask=keep & allowed, score_mod=mods.alibi(slopes)))


def test_chunked_cpu_backward_gives_the_functions_the_calls_batch_indices(monkeypatch):
    """A broadcast bias's backward in chunks of batch elements (attnnb._core.bias_chunks): the
    functions see each chunk's batch elements by their index in the call."""
    from attnnb._core import bias_chunks as _bias_chunks

    rng = np.random.default_rng(20)
    B, H, L = 10, 1, 70
    q, k, v = qkv(rng, batch=(B,), hq=H, lq=L, lk=L, d=4)
    log_f = -0.1 * np.abs(rng.standard_normal((B, H, L)))
    ids = np.sort(rng.integers(0, 3, (B, L)), axis=-1)
    kw = dict(score_mod=mods.forgetting(log_f), mask_mod=mods.document(ids) & mods.causal,
              bias=rng.standard_normal((L, L)), backend="cpu")
    out, pullback = attnnb.vjp(attnnb.attention, q, k, v, **kw)
    whole = pullback(np.cos(out))
    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", 1)  # 8 key heads (batch elements) a chunk
    assert len(_bias_chunks.bias_chunks((B, H, H, L, L, 4, 4), 8, (1, 1, L, L), 8)) == 2
    out_c, pullback_c = attnnb.vjp(attnnb.attention, q, k, v, **kw)
    parts = pullback_c(np.cos(out_c))
    np.testing.assert_array_equal(out_c, out)
    for name in ("q", "k", "v", "bias"):
        np.testing.assert_allclose(parts[name], whole[name], rtol=1e-12, atol=1e-14,
                                   err_msg=name)
    np.testing.assert_allclose(parts["score_mod"][0], whole["score_mod"][0], rtol=1e-12,
                               atol=1e-14)
    ref = attnnb.vjp(attnnb.attention, q, k, v, **dict(kw, backend="reference"))[1](np.cos(out))
    assert_close(parts["score_mod"][0], ref["score_mod"][0], rtol=1e-12, what="log_f")


@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
def test_diff_attention_takes_mods_on_both_maps(mode):
    """The reference against its own two maps with the mods materialised; cpu forward and
    gradients in every mode against the reference."""
    rng = np.random.default_rng(21)
    H = 2
    q, k, v = qkv(rng, batch=(1,), hq=2 * H, hk=2, lq=80, lk=80, d=8)
    v = v[:, :1]
    slopes = rng.standard_normal(H)
    lam = 0.4
    kw = dict(score_mod=mods.alibi(slopes), mask_mod=mods.sliding_window(30), mode=mode)
    i, j = positions(80, 80)
    expected = attnnb.diff_attention(q, k, v, lam, bias=slopes[:, None, None] * (j - i),
                                     mask=(i - j >= 0) & (i - j < 30), mode=mode,
                                     backend="reference")
    got = attnnb.diff_attention(q, k, v, lam, backend="reference", **kw)
    assert_close(got, expected)
    assert_close(attnnb.diff_attention(q, k, v, lam, backend="cpu", **kw), expected,
                 rtol=1e-12)
    out, pullback = attnnb.vjp(attnnb.diff_attention, q, k, v, lam, backend="reference", **kw)
    ref = pullback(np.cos(out))
    bias = np.broadcast_to(slopes[:, None, None] * (j - i), (1, H, 80, 80))
    plain_grads = attnnb.vjp(attnnb.diff_attention, q, k, v, lam, bias=bias,
                             mask=(i - j >= 0) & (i - j < 30), mode=mode,
                             backend="reference")[1](np.cos(out))
    assert_close(ref["q"], plain_grads["q"], what="q")
    assert_close(ref["score_mod"][0], (plain_grads["bias"] * (j - i)).sum(axis=(0, 2, 3)),
                 what="slopes")
    out_c, pullback_c = attnnb.vjp(attnnb.diff_attention, q, k, v, lam, backend="cpu", **kw)
    cpu = pullback_c(np.cos(out_c))
    for n in ("q", "k", "v", "lam"):
        assert_close(cpu[n], ref[n], rtol=1e-12, what=n)
    assert_close(cpu["score_mod"][0], ref["score_mod"][0], rtol=1e-12, what="slopes")
