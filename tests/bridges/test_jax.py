"""attnnb.jax: the four functions as ``jax.custom_vjp`` functions (docs/contract.md §6.3).

Finite-difference checks of the gradients (``jax.test_util.check_grads``,
float64), equality with attnnb's NumPy results and ``attnnb.vjp``'s
gradients, and the three transformations: ``jax.jit``, ``jax.grad`` and
``jax.vmap`` (against a loop).  Sizes are tiny; the default backend (cpu)
runs in float64, as the cpu gradient tests compile it, plus one float32
attention; the other option sets run on ``reference``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import attnnb  # noqa: E402
import attnnb.jax as ajax  # noqa: E402
from attnnb import patterns  # noqa: E402
from attnnb._front import dispatch as _dispatch  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
REF = "reference"
Lq, Lk, D = 5, 7, 4


@pytest.fixture(autouse=True, scope="module")
def x64():
    """float64 JAX arrays for this module only."""
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def randn(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


# One call per function and option set: (jax function, NumPy function, differentiable
# arrays by name, other keyword arguments).  GQA everywhere (2 query heads, 1 key head).
def _case(name, rng):
    q, k = randn(rng, 1, 2, Lq, D), randn(rng, 1, 1, Lk, D)
    v = randn(rng, 1, 1, Lk, 3)
    mask = rng.random((Lq, Lk)) > 0.3
    if name == "attention":  # default backend
        return (ajax.attention, attnnb.attention, dict(q=q, k=k, v=v, bias=randn(rng, Lq, Lk)),
                dict(mask=mask, causal=True, return_lse=True))
    if name == "attention-key_size":  # ToMe's (B, N, 1) sizes, softmax1
        return (ajax.attention, attnnb.attention,
                dict(q=q, k=k, v=v, key_size=rng.uniform(0.5, 2, (1, Lk, 1))),
                dict(normalizer="softmax1", backend=REF))
    if name == "attention-sinks":  # learned sinks, with a gradient
        return (ajax.attention, attnnb.attention, dict(q=q, k=k, v=v, sinks=randn(rng, 2)),
                dict(causal=True, return_lse=True, backend=REF))
    if name == "attention-sigmoid-bias":  # a learned sigmoid bias per query head
        return (ajax.attention, attnnb.attention,
                dict(q=q, k=k, v=v, sigmoid_bias=randn(rng, 2)),
                dict(normalizer="sigmoid", mask=mask, return_lse=True, backend=REF))
    if name == "attention-softpick":
        return (ajax.attention, attnnb.attention, dict(q=q, k=k, v=v, bias=randn(rng, Lq, Lk)),
                dict(normalizer="softpick", mask=mask))
    if name == "sparse":
        return (ajax.sparse_attention, attnnb.sparse_attention,
                dict(q=q, k=k, v=v, key_size=rng.uniform(0.5, 2, Lk)),
                dict(pattern=patterns.local((Lq, Lk), 1), return_lse=True))
    if name == "topk":
        return (ajax.topk_attention, attnnb.topk_attention, dict(q=q, k=k, v=v),
                dict(top_k=3, mask=mask, causal=True))
    if name == "topk-sigmoid":
        return (ajax.topk_attention, attnnb.topk_attention, dict(q=q, k=k, v=v),
                dict(top_k=3, normalizer="sigmoid", sigmoid_bias=-1.0, return_lse=True))
    # differential attention: q (1, 2H, Lq, d) with H = 2 pairs, k one key pair
    qd, kd, vd = randn(rng, 1, 4, Lq, D), randn(rng, 1, 2, Lk, D), randn(rng, 1, 1, Lk, 6)
    if name == "diff":  # per-head lam, bias, mask
        return (ajax.diff_attention, attnnb.diff_attention,
                dict(q=qd, k=kd, v=vd, lam=rng.uniform(0.2, 0.6, (2, 1)),
                     bias=randn(rng, Lq, Lk)), dict(mask=mask))
    if name == "diff-sinks":  # a learned sink per component map
        return (ajax.diff_attention, attnnb.diff_attention,
                dict(q=qd, k=kd, v=vd, lam=rng.uniform(0.2, 0.6, (2, 1)), sinks=randn(rng, 4)),
                dict(mode="rectified", mask=mask, backend=REF))
    assert name == "diff-rectified"  # per-token lam, key sizes
    return (ajax.diff_attention, attnnb.diff_attention,
            dict(q=qd, k=kd, v=vd, lam=rng.uniform(0.2, 0.6, (1, 2, Lq)),
                 key_size=rng.uniform(0.5, 2, Lk)),
            dict(mode="rectified", causal=True, backend=REF))


CASES = ["attention", "attention-key_size", "attention-sinks", "attention-sigmoid-bias",
         "attention-softpick", "sparse", "topk", "topk-sigmoid", "diff", "diff-sinks",
         "diff-rectified"]


def _as_positional(jfn, names, kwargs):
    """``jfn`` as a function of the differentiable arrays, in ``names`` order."""
    return lambda *xs: jfn(**dict(zip(names, xs)), **kwargs)


def _pieces(result):
    return result if isinstance(result, tuple) else (result,)


def _cotangents(rng, result):
    return tuple(randn(rng, *r.shape) for r in _pieces(result))


@pytest.mark.parametrize("name", CASES)
def test_gradients_match_finite_differences(rng, name):
    jfn, _, arrays, kwargs = _case(name, rng)
    check_grads(_as_positional(jfn, list(arrays), kwargs), tuple(arrays.values()), order=1,
                modes=["rev"])


@pytest.mark.parametrize("name", CASES)
def test_results_and_gradients_are_attnnbs(rng, name):
    """Eager and jitted results, and jax.grad of a scalar loss, equal attnnb.vjp's exactly."""
    jfn, fn, arrays, kwargs = _case(name, rng)
    names = list(arrays)
    f = _as_positional(jfn, names, kwargs)
    result, pullback = attnnb.vjp(fn, **arrays, **kwargs)
    weights = _cotangents(rng, result)
    want = pullback(*weights)

    def loss(*xs):
        return sum((r * w).sum() for r, w in zip(_pieces(f(*xs)), weights))

    for got in (f(*arrays.values()), jax.jit(f)(*arrays.values())):
        for g, r in zip(_pieces(got), _pieces(result), strict=True):
            assert g.dtype == r.dtype and g.shape == r.shape
            np.testing.assert_array_equal(np.asarray(g), r)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(*arrays.values())
    assert set(want) == set(names)
    for n, g in zip(names, grads):
        assert g.shape == want[n].shape and g.dtype == want[n].dtype, n
        np.testing.assert_array_equal(np.asarray(g), want[n], err_msg=n)


@pytest.mark.parametrize("name", CASES)
def test_vmap_over_a_leading_axis_is_a_loop(rng, name):
    """q and v batched, k shared; forward and per-example gradients against a loop."""
    jfn, fn, arrays, kwargs = _case(name, rng)
    names = list(arrays)
    batched = ("q", "v")
    stacked = {n: (np.stack([x] + [randn(rng, *x.shape) for _ in range(2)]) if n in batched
                   else x) for n, x in arrays.items()}
    axes = tuple(0 if n in batched else None for n in names)
    f = _as_positional(jfn, names, kwargs)
    got = jax.vmap(f, in_axes=axes)(*stacked.values())
    weights = _cotangents(rng, got)  # one per example, mapped with q and v

    def loss(*xs_and_weights):
        xs, ws = xs_and_weights[:len(names)], xs_and_weights[len(names):]
        return sum((r * w).sum() for r, w in zip(_pieces(f(*xs)), ws))

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=tuple(range(len(names)))),
                             in_axes=axes + (0,) * len(weights)))(*stacked.values(), *weights)
    for i in range(3):
        one = {n: (x[i] if n in batched else x) for n, x in stacked.items()}
        result, pullback = attnnb.vjp(fn, **one, **kwargs)
        for g, r in zip(_pieces(got), _pieces(result), strict=True):
            np.testing.assert_allclose(np.asarray(g)[i], r, rtol=1e-13, atol=1e-15)
        want = pullback(*(w[i] for w in weights))
        for n, g in zip(names, grads):
            np.testing.assert_allclose(np.asarray(g)[i], want[n], rtol=1e-12, atol=1e-14,
                                       err_msg=n)


def test_grad_of_vmap_sums_a_shared_bias(rng):
    q, k, v = randn(rng, 3, 2, Lq, D), randn(rng, 2, Lk, D), randn(rng, 2, Lk, 3)
    bias = randn(rng, Lq, Lk)
    g = jax.grad(lambda b: jax.vmap(lambda x: ajax.attention(x, k, v, bias=b, backend=REF))(
        q).sum())(bias)
    want = sum(attnnb.vjp(attnnb.attention, x, k, v, bias=bias, backend=REF)[1](
        np.ones((2, Lq, 3)))["bias"] for x in q)
    assert g.shape == (Lq, Lk)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-13)


def test_nested_vmap_of_keys_masks_and_two_dimensional_inputs(rng):
    """Only k (two vmap levels) or only the mask batched; 2-D (L, D) inputs (one head)."""
    q, v = randn(rng, Lq, D), randn(rng, Lk, 3)
    ks, masks = randn(rng, 3, 2, Lk, D), rng.random((3, Lq, Lk)) > 0.3
    size = rng.uniform(0.5, 2, Lk)
    got = jax.vmap(jax.vmap(lambda k: ajax.attention(q, k, v, key_size=size, backend=REF)))(ks)
    want = [[attnnb.attention(q, k, v, key_size=size, backend=REF) for k in row] for row in ks]
    assert got.shape == (3, 2, Lq, 3)
    np.testing.assert_allclose(np.asarray(got), np.array(want), rtol=1e-13)
    got = jax.vmap(lambda m: ajax.attention(q, ks[0, 0], v, mask=m, backend=REF))(masks)
    want = [attnnb.attention(q, ks[0, 0], v, mask=m, backend=REF) for m in masks]
    np.testing.assert_allclose(np.asarray(got), np.array(want), rtol=1e-13)
    g = jax.grad(lambda q: ajax.attention(q, ks[0, 0], v, mask=masks[0], backend=REF).sum())(q)
    assert g.shape == q.shape


def test_float32_on_the_default_backend(rng):
    """What users run: float32 on cpu under jit, equal to attnnb's NumPy call."""
    q = randn(rng, 1, 2, Lq, D, dtype=np.float32)
    k, v = (randn(rng, 1, 2, Lk, D, dtype=np.float32) for _ in range(2))
    bias = randn(rng, Lq, Lk, dtype=np.float32)
    (out, lse), pullback = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, return_lse=True)
    dout, dlse = np.ones_like(out), np.full_like(lse, 0.5)
    want = pullback(dout, dlse)

    def loss(q, k, v, bias):
        o, s = ajax.attention(q, k, v, bias=bias, return_lse=True)
        return o.sum() + 0.5 * s.sum()

    jo, jl = jax.jit(lambda *a: ajax.attention(*a[:3], bias=a[3], return_lse=True))(
        q, k, v, bias)
    assert jo.dtype == jl.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(jo), out)
    np.testing.assert_array_equal(np.asarray(jl), lse)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for n, g in zip(("q", "k", "v", "bias"), grads):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), want[n], rtol=1e-6, atol=1e-7, err_msg=n)


def test_float16_keeps_float32_residuals(rng):
    q, k, v = (randn(rng, 2, Lq, D, dtype=np.float16) for _ in range(3))
    out, lse = ajax.attention(q, k, v, return_lse=True, backend=REF)
    assert out.dtype == jnp.float16 and lse.dtype == jnp.float32
    g = jax.grad(lambda q: ajax.attention(q, k, v, backend=REF).astype(jnp.float32).sum())(q)
    want = attnnb.vjp(attnnb.attention, q, k, v, backend=REF)[1](np.ones((2, Lq, D)))["q"]
    assert g.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(g), want)


def test_lam_as_a_python_float_and_its_gradient(rng):
    q, k, v = randn(rng, 2, Lq, D), randn(rng, 2, Lk, D), randn(rng, 1, Lk, 6)
    g = jax.grad(lambda lam: ajax.diff_attention(q, k, v, lam, backend=REF).sum())(0.5)
    want = attnnb.vjp(attnnb.diff_attention, q, k, v, 0.5, backend=REF)[1](
        np.ones((1, Lq, 6)))["lam"]
    assert g.shape == ()
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-13)


def test_the_backward_pass_does_not_run_the_forward_again(rng, monkeypatch):
    real = _dispatch.implementation("attention", REF)
    calls = []

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setitem(_dispatch._LOADED, ("attention", REF), counted)
    q, k, v = randn(rng, 2, Lq, D), randn(rng, 2, Lk, D), randn(rng, 2, Lk, 3)
    jax.grad(lambda q: ajax.attention(q, k, v, backend=REF).sum())(q)
    assert len(calls) == 1


def test_errors(rng):
    q, k, v = randn(rng, 2, Lq, D), randn(rng, 2, Lk, D), randn(rng, 2, Lk, 3)
    # shapes and dtypes: attnnb's own errors, at trace time
    with pytest.raises(ValueError, match=re.escape("k's last axis (3) must equal q's head")):
        jax.jit(lambda k: ajax.attention(q, k, v))(k[..., :3])
    with pytest.raises(TypeError, match="q must have a floating dtype"):
        ajax.attention(jnp.asarray(q, jnp.bfloat16), k, v, backend=REF)
    with pytest.raises(TypeError, match="scale must be a real number"):
        jax.jit(lambda s: ajax.attention(q, k, v, scale=s, backend=REF))(1.0)
    # values are checked when the callback runs: JAX's runtime error carries the message,
    # the entry named in the argument's own shape (not the rank the callback gives it)
    where = re.escape(f"got -1.0 at index (0,) of shape ({Lk},)")
    qb, kb, vb = (x[None] for x in (q, k, v))  # a batch axis: the callback sees (1, Lk)
    with pytest.raises(Exception, match="key_size must be positive.*" + where):
        jax.jit(lambda s: ajax.attention(qb, kb, vb, key_size=s, backend=REF))(-np.ones(Lk))
    # known values are checked before the call: NumPy's ValueError
    sizes = np.ones(Lk)
    sizes[Lk - 1] = np.nan
    with pytest.raises(ValueError, match=re.escape(f"NaN at index ({Lk - 1},) of shape ({Lk},)")):
        ajax.attention(q, k, v, key_size=jnp.asarray(sizes), backend=REF)
    # ... after the dtype and shape checks, as in the NumPy call
    with pytest.raises(TypeError, match="key_size must be a real numeric array"):
        ajax.attention(q, k, v, key_size=jnp.zeros(Lk, bool), backend=REF)
    with pytest.raises(ValueError, match="cannot be broadcast"):
        ajax.attention(q, k, v, key_size=jnp.zeros(Lk + 1), backend=REF)
    lam = np.array([[0.5], [np.inf]])
    qd, kd, vd = randn(rng, 4, Lq, D), randn(rng, 4, Lk, D), randn(rng, 2, Lk, 6)
    with pytest.raises(ValueError, match=re.escape("got inf at index (1, 0) of shape (2, 1)")):
        ajax.diff_attention(qd, kd, vd, jnp.asarray(lam), backend=REF)
    with pytest.raises(Exception, match=re.escape("got inf at index (1, 0) of shape (2, 1)")):
        jax.jit(lambda lam: ajax.diff_attention(qd, kd, vd, lam, backend=REF))(lam)


def test_import_attnnb_does_not_import_jax():
    code = ("import sys, attnnb; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('jax', 'jaxlib') or m == 'attnnb.jax'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout.strip() == "[]"


def test_readme_jax_block_runs():
    match = re.search(r"<!-- usage:jax -->\n```python\n(.*?)```\n.*?<!-- /usage:jax -->",
                      README.read_text(), re.S)
    assert match, "README has no usage:jax block"
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", False)  # as users run it: float32
    try:
        namespace = {}
        exec(compile(match.group(1), "README.md:usage:jax", "exec"), namespace)
    finally:
        jax.config.update("jax_enable_x64", before)
    grads = namespace["grads"]
    assert [g.shape for g in grads] == [(2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8), (16, 16)]
    assert namespace["per_example"].shape == (2, 4, 16, 8)


def test_eager_calls_of_one_kind_share_one_function(rng):
    """Outside jit, a new callback per call would make JAX compile every call anew."""
    q, k, v = randn(rng, 2, Lq, D), randn(rng, 2, Lk, D), randn(rng, 2, Lk, 3)
    pattern = patterns.local((Lq, Lk), 2)
    ajax.sparse_attention(q, k, v, pattern, backend=REF)
    before = dict(ajax._FUNCTIONS)
    for _ in range(3):
        ajax.sparse_attention(q + 1, k, v, pattern, backend=REF)
    assert ajax._FUNCTIONS == before
    ajax.sparse_attention(q, k, v, pattern, backend=REF, return_lse=True)
    assert len(ajax._FUNCTIONS) == len(before) + 1


def test_mods_are_static_constants_of_the_gradient(rng):
    """Mask and score functions: attnnb's results and gradients (the score function as
    ``mods.constant``, its slopes from a concrete JAX array), under ``jax.jit`` too; a
    mod built from a traced array is refused where it is built."""
    from attnnb import mods

    q, k, v = randn(rng, 1, 2, Lq, D), randn(rng, 1, 1, Lk, D), randn(rng, 1, 1, Lk, 3)
    slopes = jnp.asarray([0.5, -0.25])
    kw = dict(mask_mod=mods.sliding_window(3), score_mod=mods.alibi(slopes) + mods.softcap(2.0))
    (want, want_lse), pullback = attnnb.vjp(
        attnnb.attention, q, k, v, return_lse=True, backend=REF, mask_mod=kw["mask_mod"],
        score_mod=mods.constant(kw["score_mod"]))
    dout = randn(rng, *want.shape)
    grads = pullback(dout)

    def loss(q, k, v):
        out, lse = ajax.attention(q, k, v, return_lse=True, backend=REF, **kw)
        return jnp.sum(out * dout), (out, lse)

    for f in (loss, jax.jit(loss)):
        (_, (out, lse)), got = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
        for g, name in zip(got, "qkv"):
            np.testing.assert_allclose(g, grads[name], rtol=1e-10, atol=1e-13, err_msg=name)
    with pytest.raises(TypeError, match="outside jax.jit and jax.grad"):
        jax.grad(lambda s: ajax.attention(q, k, v, score_mod=mods.alibi(s)).sum())(slopes)


def test_dropout_with_a_static_or_traced_seed(rng):
    """Dropout: attnnb's keep decisions and gradients for the same seed, whether the seed
    is a Python int or a traced array under ``jax.jit`` (a new seed: new decisions)."""
    q, k, v = randn(rng, 1, 2, Lq, D), randn(rng, 1, 1, Lk, D), randn(rng, 1, 1, Lk, 3)
    kw = dict(dropout_p=0.4, causal=True, backend=REF)
    want, pullback = attnnb.vjp(attnnb.attention, q, k, v, seed=11, **kw)
    dout = randn(rng, *want.shape)
    grads = pullback(dout)

    def loss(q, k, v, seed):
        out = ajax.attention(q, k, v, seed=seed, **kw)
        return jnp.sum(out * dout), out

    for f, seed in ((loss, 11), (jax.jit(loss), jnp.uint32(11)), (loss, jnp.int32(11))):
        (_, out), got = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v, seed)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
        for g, name in zip(got, "qkv"):
            np.testing.assert_allclose(g, grads[name], rtol=1e-10, atol=1e-13, err_msg=name)
    other = jax.jit(loss)(q, k, v, jnp.uint32(12))[1]
    assert not np.allclose(other, want)
    with pytest.raises(TypeError, match="needs seed="):
        ajax.attention(q, k, v, dropout_p=0.4, backend=REF)
