"""The PyTorch bridge (docs/contract.md §6): autograd, custom-op checks, torch.compile, SDPA.

Gradients are checked by ``torch.autograd.gradcheck`` (finite differences of
the bridge's own forward, float64) and against :func:`attnnb.vjp`; the
drop-in against ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.nn.attention.bias import causal_upper_left  # noqa: E402

import attnnb  # noqa: E402
import attnnb.torch as at  # noqa: E402
from attnnb import patterns  # noqa: E402

F = torch.nn.functional
BACKENDS = ("reference", "cpu")


def _t(rng, shape, dtype=torch.float64, grad=True, scale=1.0):
    x = torch.from_numpy(scale * rng.standard_normal(shape)).to(dtype)
    return x.requires_grad_(grad)


def _qkv(rng, hq=2, hk=None, lq=5, lk=6, d=4, dv=3, batch=(1,), dtype=torch.float64):
    hk = hq if hk is None else hk
    return (_t(rng, batch + (hq, lq, d), dtype), _t(rng, batch + (hk, lk, d), dtype),
            _t(rng, batch + (hk, lk, dv), dtype))


def _gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


# ---------------------------------------------------------------------------
# gradients: finite differences of the bridge, and the NumPy vjp


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_gradcheck_mask_bias_causal_gqa(backend):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, hq=4, hk=2)
    bias = _t(rng, (5, 6))  # broadcast over batch and heads: a (Lq, Lk) gradient
    mask = torch.from_numpy(rng.random((1, 4, 5, 6)) < 0.8)
    mask[0, 1, 2] = False  # an empty row: zero output, zero gradient, no NaN

    def f(q, k, v, bias):
        out, lse = at.attention(q, k, v, mask=mask, bias=bias, causal=True, return_lse=True,
                                backend=backend)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    _gradcheck(f, (q, k, v, bias))


@pytest.mark.parametrize("normalizer", ["softmax1", "relu_expm1"])
def test_attention_gradcheck_normalizers_and_key_size(normalizer):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng)
    size = torch.from_numpy(rng.integers(1, 4, (1, 6, 1)).astype(np.float64)).requires_grad_()
    _gradcheck(lambda q, k, v, s: at.attention(q, k, v, key_size=s, normalizer=normalizer,
                                               backend="cpu"), (q, k, v, size))


def test_sparse_attention_gradcheck():
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, lq=6, lk=6)
    pattern = patterns.local(6, 2) | patterns.strided(6, 3)
    _gradcheck(lambda q, k, v: at.sparse_attention(q, k, v, pattern, backend="cpu"), (q, k, v))


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid", "softpick"])
def test_topk_attention_gradcheck(normalizer):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, lq=5, lk=7)
    _gradcheck(lambda q, k, v: at.topk_attention(q, k, v, 3, causal=True, backend="cpu",
                                                 normalizer=normalizer),
               (q, k, v))


@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
def test_diff_attention_gradcheck_learned_lambda(mode):
    rng = np.random.default_rng(4)
    q, k, _ = _qkv(rng, hq=4, hk=2, d=3)  # H = 2 head pairs over one key pair
    v = _t(rng, (1, 1, 6, 4))  # one value head per key pair
    lam = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    bias = _t(rng, (2, 5, 6))
    _gradcheck(lambda q, k, v, lam, bias: at.diff_attention(q, k, v, lam, bias=bias, mode=mode,
                                                            backend="cpu"),
               (q, k, v, lam, bias))


@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
def test_diff_attention_gradcheck_learned_sinks(mode):
    rng = np.random.default_rng(6)
    q, k, _ = _qkv(rng, hq=4, hk=2, d=3)
    v = _t(rng, (1, 1, 6, 4))
    sinks = _t(rng, (4,))  # one per component map: query head 2h + c
    _gradcheck(lambda q, sinks: at.diff_attention(q, k, v, 0.4, sinks=sinks, mode=mode,
                                                  causal=True, backend="cpu"),
               (q, sinks))


def test_gradients_equal_numpy_vjp():
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, hq=2, lq=9, lk=11, d=8, dv=8, dtype=torch.float32)
    bias = _t(rng, (2, 9, 11), torch.float32)
    out = at.attention(q, k, v, bias=bias, causal=True)
    dout = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    out.backward(dout)
    arrays = [x.detach().numpy() for x in (q, k, v, bias)]
    expected, pullback = attnnb.vjp(attnnb.attention, *arrays[:3], bias=arrays[3], causal=True)
    grads = pullback(dout.numpy())
    np.testing.assert_array_equal(out.detach().numpy(), expected)  # the same kernels
    for name, x in zip(("q", "k", "v", "bias"), (q, k, v, bias)):
        np.testing.assert_array_equal(x.grad.numpy(), grads[name], err_msg=name)


def test_only_requested_gradients_and_unused_lse():
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng)
    k.requires_grad_(False)
    out, lse = at.attention(q, k, v, return_lse=True)
    out.sum().backward()  # lse unused: its cotangent is None, not zeros
    assert k.grad is None and q.grad is not None and v.grad is not None
    q2 = q.detach().clone().requires_grad_()
    _, lse = at.attention(q2, k, v, return_lse=True)
    lse.sum().backward()  # only the LSE used: dout is None
    expected = attnnb.vjp(attnnb.attention, q2.detach().numpy(), k.numpy(), v.detach().numpy(),
                          return_lse=True)[1](np.zeros((1, 2, 5, 3)), np.ones((1, 2, 5)))
    np.testing.assert_allclose(q2.grad.numpy(), expected["q"], rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------
# the operators: opcheck, torch.compile, memory


def _op_cases():
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, lq=6, lk=6)
    pattern = patterns.local(6, 2)
    ip, ix, nh = at._pattern_tensors(pattern)
    lam = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    bias = _t(rng, (6, 6))
    sinks = _t(rng, (q.shape[-3],))
    q4, k4 = (torch.cat([x, x * 0.5], dim=1).detach().requires_grad_() for x in (q, k))
    ops = torch.ops.attnnb
    return {
        "attention": (ops.attention.default,
                      (q, k, v, None, bias, None, True, None, "softmax", 0.3, 11, sinks,
                       None, None, "cpu")),
        "attention sigmoid": (ops.attention.default,
                              (q, k, v, None, bias, None, True, None, "sigmoid", 0.3, 11, None,
                               -1.5, None, "cpu")),
        "attention learned sigmoid bias": (ops.attention.default,
                                           (q, k, v, None, bias, None, True, None, "sigmoid",
                                            0.3, 11, None, None, sinks, "cpu")),
        "sparse_attention": (ops.sparse_attention.default,
                             (q, k, v, ip, ix, nh, None, None, "softmax", 0.2, 3, sinks,
                              None, "cpu")),
        "topk_attention": (ops.topk_attention.default,
                           (q, k, v, 2, None, False, None, 0.7, "softmax", 0.0, 0, sinks, None,
                            "cpu")),
        "diff_attention": (ops.diff_attention.default,
                           (q4, k4, v, lam, None, None, None, True, None, "difference", 0.25, 5,
                            None, "cpu")),
    }


@pytest.mark.parametrize("name", ["attention", "attention sigmoid",
                                  "attention learned sigmoid bias", "sparse_attention",
                                  "topk_attention", "diff_attention"])
def test_opcheck(name):
    op, args = _op_cases()[name]
    torch.library.opcheck(op, args)  # raises on any failed check


@pytest.mark.parametrize("name", ["attention", "attention sigmoid",
                                  "attention learned sigmoid bias", "sparse_attention",
                                  "topk_attention", "diff_attention"])
def test_opcheck_backward_operators(name):
    op, args = _op_cases()[name]
    result = op(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    outs = result if isinstance(result, tuple) else (result,)
    douts = [torch.ones_like(o) for o in outs]
    backward = getattr(torch.ops.attnnb, name.split()[0] + "_backward").default
    saved = (douts[0], douts[1], *outs) if len(outs) == 2 else (douts[0], outs[0])
    torch.library.opcheck(backward, (*saved, *[a.detach() if isinstance(a, torch.Tensor) else a
                                               for a in args]))


def test_torch_compile_keeps_one_operator_without_graph_break():
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, dtype=torch.float32)
    lam = torch.tensor(0.4, requires_grad=True)

    def loss(q, k, v, lam):
        a = at.attention(q, k, v, causal=True)
        b = at.diff_attention(torch.cat([q, q], 1), torch.cat([k, k], 1), v, lam)
        return (a.square().sum() + b.square().sum())

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")  # a break would raise
    eager_grads = torch.autograd.grad(loss(q, k, v, lam), (q, k, v, lam))
    compiled_grads = torch.autograd.grad(compiled(q, k, v, lam), (q, k, v, lam))
    for a, b in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_cpu_tensors_are_zero_copy_and_inputs_untouched():
    rng = np.random.default_rng(9)
    q, k, v = (x.detach() for x in _qkv(rng, dtype=torch.float32))
    view = at._array(q)
    assert view.ctypes.data == q.data_ptr() and view.dtype == np.float32
    before = [x.clone() for x in (q, k, v)]
    at.attention(q, k, v)
    for x, y in zip((q, k, v), before):
        assert torch.equal(x, y)


def test_half_precision_inputs_return_their_dtype():
    rng = np.random.default_rng(10)
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = _qkv(rng, dtype=dtype)
        out = at.attention(q, k, v)
        assert out.dtype == dtype
        ref = at.attention(*(x.detach().float() for x in (q, k, v)))
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
        out.float().sum().backward()
        assert q.grad.dtype == dtype


def test_errors_name_the_argument():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        at.attention(np.zeros((2, 3, 4)), q, q)
    with pytest.raises(TypeError, match="k must be a floating tensor"):
        at.attention(q, q.long(), q)
    with pytest.raises(TypeError, match="pattern must be an attnnb.patterns.Pattern"):
        at.sparse_attention(q, q, q, np.ones((3, 3), bool))
    with pytest.raises(ValueError, match="normalizer"):
        at.attention(q, q, q, normalizer="sparsemax")


def test_import_attnnb_does_not_import_torch():
    code = "import sys, attnnb; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA tensors need a GPU: the __cuda_array_interface__ path is "
                           "exercised only where torch sees one")
def test_cuda_tensors_stay_on_device():
    rng = np.random.default_rng(11)
    q, k, v = (x.detach().cuda() for x in _qkv(rng, dtype=torch.float32))
    out = at.attention(q, k, v, causal=True)
    assert out.device == q.device
    expected = at.attention(q.cpu(), k.cpu(), v.cpu(), causal=True)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# the drop-in for torch.nn.functional.scaled_dot_product_attention


SDPA_CASES = {
    "plain": dict(),
    "causal square": dict(is_causal=True),
    "causal Lq < Lk (top-left)": dict(is_causal=True, lk=9),
    "causal Lq > Lk (top-left)": dict(is_causal=True, lq=9, lk=5),
    "bool mask": dict(mask="bool"),
    "float mask": dict(mask="float"),
    "scale": dict(scale=0.3),
    "gqa": dict(enable_gqa=True, hk=1),
}


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_drop_in_forward_and_backward(case):
    o = dict(SDPA_CASES[case])
    rng = np.random.default_rng(12)
    lq, lk = o.pop("lq", 7), o.pop("lk", 7)
    q, k, v = _qkv(rng, hq=2, hk=o.pop("hk", 2), lq=lq, lk=lk, d=16, dv=16, batch=(2,),
                   dtype=torch.float32)
    kind = o.pop("mask", None)
    if kind == "bool":
        m = torch.from_numpy(rng.random((lq, lk)) < 0.6)
        m[3] = False  # an empty row: zeros in both
        o["attn_mask"] = m
    elif kind == "float":
        o["attn_mask"] = _t(rng, (2, 1, lq, lk), torch.float32)
    inputs = [q, k, v] + ([o["attn_mask"]] if kind == "float" else [])
    results = []
    for fn in (F.scaled_dot_product_attention, at.scaled_dot_product_attention):
        out = fn(q, k, v, **o)
        grads = torch.autograd.grad(out.square().sum(), inputs)
        results.append((out, grads))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shared", ["kv", "q"])
def test_sdpa_drop_in_broadcasts_batch_axes(shared):
    """As PyTorch's: keys and values of batch 1 against queries of batch 2 (or the other
    way), with 5-D inputs (two batch axes); the broadcast input's gradient is summed."""
    rng = np.random.default_rng(13)
    qb, kb = ((2, 3), (1, 3)) if shared == "kv" else ((1, 3), (2, 1))
    q = _t(rng, qb + (2, 5, 8), torch.float64)
    k, v = _t(rng, kb + (2, 6, 8), torch.float64), _t(rng, kb + (2, 6, 4), torch.float64)
    results = []
    for fn in (F.scaled_dot_product_attention, at.scaled_dot_product_attention):
        out = fn(q, k, v, is_causal=True)
        results.append((out, torch.autograd.grad(out.square().sum(), (q, k, v))))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_sdpa_refusals():
    """PyTorch's refusals, as instances of PyTorch's exception and of the earlier one."""
    from attnnb._bridges.torch_sdpa import SDPAError, SDPATypeError

    q = torch.zeros(1, 2, 3, 4)
    # PyTorch documents the refusal of a mask with is_causal, but its fused CPU kernel
    # (chosen at these shapes) accepts the pair: the drop-in keeps to the documentation
    with pytest.raises(SDPAError, match="is_causal"):
        at.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool),
                                        is_causal=True)
    cases = [
        (dict(key=torch.zeros(1, 3, 3, 4)), "broadcast", SDPAError),  # 2 heads against 3
        (dict(key=q.double()), "one dtype", SDPAError),
        (dict(attn_mask=torch.zeros(3, 3, dtype=torch.int64)), "attn_mask dtype",
         SDPATypeError),
        (dict(attn_mask=torch.zeros(3, 3, dtype=torch.float64)), "attn_mask dtype",
         SDPATypeError),
        (dict(attn_mask=torch.zeros(4, 3)), "does not broadcast", SDPAError),
        (dict(attn_mask=torch.zeros(1, 1, 1, 3, 3)), "does not broadcast", SDPAError),
        (dict(attn_mask=torch.zeros(3, 3).to_sparse()), "dense", SDPATypeError),
        (dict(dropout_p=1.5), "between 0 and 1", SDPAError),
    ]
    for kwargs, match, kind in cases:
        args = {"query": q, "key": q, "value": q, **kwargs}
        with pytest.raises(kind, match=match):
            at.scaled_dot_product_attention(**args)
        with pytest.raises(RuntimeError):  # as PyTorch raises
            at.scaled_dot_product_attention(**args)
        with pytest.raises(RuntimeError):  # PyTorch refuses each of them too
            F.scaled_dot_product_attention(**args)
    with pytest.raises(TypeError, match="subclass"):
        at.scaled_dot_product_attention(q, q, q, attn_mask=_SubclassTensor(torch.zeros(3, 3)))
    with pytest.raises(ValueError, match="CausalBias should not be used"):
        at.scaled_dot_product_attention(q, q, q, attn_mask=causal_upper_left(3, 3),
                                        is_causal=True)
    with pytest.raises(RuntimeError, match="CausalBias for 3 queries and 4 keys"):
        at.scaled_dot_product_attention(q, q, q, attn_mask=causal_upper_left(3, 4))


class _SubclassTensor(torch.Tensor):
    """A tensor subclass with a meaning of its own, as a user might write one."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def _sdpa_against_torch(q, k, v, rtol, atol, **kwargs):
    """attnnb's drop-in against PyTorch's: outputs and the gradients of q, k, v."""
    results = []
    for fn in (F.scaled_dot_product_attention, at.scaled_dot_product_attention):
        out = fn(q, k, v, **kwargs)
        results.append((out, torch.autograd.grad(out.square().sum(), (q, k, v))))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=10 * rtol, atol=10 * atol)


CAUSAL_BIAS_SHAPES = [(5, 5), (4, 9), (9, 4), (1, 6), (6, 1)]


@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize("lq, lk", CAUSAL_BIAS_SHAPES)
def test_sdpa_causal_bias_objects(variant, lq, lk):
    """PyTorch's CausalBias objects give PyTorch's result (they were read as a float
    tensor of whatever their storage held); float64, tight."""
    from torch.nn.attention import bias as tbias

    rng = np.random.default_rng(21)
    q, k, v = _qkv(rng, hq=2, lq=lq, lk=lk, d=8, dv=5, batch=(2,))
    with warnings.catch_warnings():  # lower-right with Lq > Lk: empty rows (zeros on CPU)
        warnings.simplefilter("ignore", UserWarning)
        mask = getattr(tbias, f"causal_{variant}")(lq, lk)
    _sdpa_against_torch(q, k, v, 1e-12, 1e-12, attn_mask=mask)


@pytest.mark.parametrize("lq, lk", CAUSAL_BIAS_SHAPES)
def test_sdpa_is_causal_top_left_without_a_mask(lq, lk, monkeypatch):
    """``is_causal`` with ``Lq != Lk`` runs attnnb's own causal limit on cut keys or split
    rows: no mask reaches the kernels, and the result is PyTorch's."""
    rng = np.random.default_rng(22)
    q, k, v = _qkv(rng, hq=3, hk=1, lq=lq, lk=lk, d=8, dv=4, batch=(2,))
    seen = []
    real = at.attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("mask"), kwargs.get("bias")))
        return real(*args, **kwargs)

    monkeypatch.setattr(at, "attention", spy)
    _sdpa_against_torch(q, k, v, 1e-12, 1e-12, is_causal=True, enable_gqa=True)
    assert seen and all(m is None and b is None for m, b in seen)


HEAD_BROADCASTS = {
    "kv heads 1": ((2, 3), (2, 1), (2, 1)),
    "q heads 1": ((2, 1), (2, 3), (2, 3)),
    "k batch 1": ((2, 3), (1, 3), (1, 3)),
    "kv rank 2": ((2, 3), (), ()),
    "v heads 1, k heads 3": ((2, 3), (2, 3), (2, 1)),
}


@pytest.mark.parametrize("case", HEAD_BROADCASTS)
def test_sdpa_broadcasts_heads_as_pytorch(case):
    """Axes before the last two broadcast as in PyTorch (a head axis of 1 too), without
    ``enable_gqa``; gradients of broadcast inputs are summed back."""
    rng = np.random.default_rng(23)
    qs, ks, vs = HEAD_BROADCASTS[case]
    q, k, v = _t(rng, qs + (5, 8)), _t(rng, ks + (7, 8)), _t(rng, vs + (7, 6))
    _sdpa_against_torch(q, k, v, 1e-12, 1e-12)
    _sdpa_against_torch(q, k, v, 1e-12, 1e-12, is_causal=True)


def test_sdpa_mask_dtypes_as_pytorch():
    """float32 masks serve any query dtype, the query's own dtype too, bool masks always."""
    rng = np.random.default_rng(24)
    q, k, v = _qkv(rng, hq=2, lq=5, lk=6, d=8, dv=8, batch=(1,))
    for mask in (_t(rng, (5, 6), torch.float32, grad=False), _t(rng, (1, 6), grad=False),
                 torch.from_numpy(rng.random((2, 5, 6)) < 0.7)):
        _sdpa_against_torch(q, k, v, 1e-6, 1e-7, attn_mask=mask)


def test_numpy_api_refuses_tensors_that_need_a_detach():
    """The NumPy functions name the argument and the fix instead of failing inside
    PyTorch ("Can't call numpy() on Tensor that requires grad") or reading a subclass's
    storage."""
    from torch.nn.attention.bias import causal_lower_right

    q = torch.zeros(2, 3, 4)
    for kwargs, name in ((dict(q=q.requires_grad_()), "q"),
                         (dict(v=torch.zeros(2, 3, 4, requires_grad=True)), "v"),
                         (dict(bias=torch.zeros(3, 3, requires_grad=True)), "bias"),
                         (dict(key_size=torch.ones(3, requires_grad=True)), "key_size")):
        args = {"q": q.detach(), "k": q.detach(), "v": q.detach(), **kwargs}
        with pytest.raises(TypeError, match=rf"^{name} is a torch.Tensor that requires "
                                            rf"grad.*attnnb.torch.*{name}.detach\(\)"):
            attnnb.attention(**args)
    with pytest.raises(TypeError, match="mask is a torch.nn.attention.bias.CausalBias"):
        attnnb.attention(q.detach(), q.detach(), q.detach(), mask=causal_lower_right(3, 3))
    with pytest.raises(TypeError, match="lam is a torch.Tensor that requires grad"):
        attnnb.diff_attention(torch.zeros(4, 3, 4), torch.zeros(4, 3, 4),
                              torch.zeros(2, 3, 4), torch.zeros((), requires_grad=True))
    plain = torch.nn.Parameter(torch.zeros(3, 3), requires_grad=False)  # a plain tensor
    out = attnnb.attention(q.detach(), q.detach(), q.detach(), bias=plain)
    assert out.shape == (2, 3, 4)


def test_readme_torch_block_runs(monkeypatch):
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    match = re.search(r"<!-- usage:torch -->\n```python\n(.*?)```\n<!-- /usage:torch -->",
                      text, re.S)
    assert match, "README has no usage:torch block"
    # the block swaps torch's function model-wide: undo that after the test
    monkeypatch.setattr(F, "scaled_dot_product_attention", F.scaled_dot_product_attention)
    namespace = {}
    exec(compile(match.group(1), "README.md:usage:torch", "exec"), namespace)
    assert namespace["bias"].grad.shape == (256, 256)
    assert namespace["od"].shape == (2, 4, 256, 64)
    assert torch.nn.functional.scaled_dot_product_attention is at.scaled_dot_product_attention


@pytest.mark.parametrize("torch_first", [False, True])
def test_passive_openmp_wait_policy_only_before_torch_loads(torch_first):
    code = ("import os, sys\n" + ("import torch\n" if torch_first else "")
            + "import attnnb.torch\nprint(os.environ.get('OMP_WAIT_POLICY', 'unset'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()[-1]
    assert out == ("unset" if torch_first else "PASSIVE")


def test_backward_runs_on_the_forward_backend(monkeypatch):
    """A forward under ``use_backend("reference")`` gets its backward there too, even
    when ``backward()`` runs after the context has ended (or on autograd's thread)."""
    from attnnb._front import dispatch as _dispatch

    seen = []
    original = _dispatch.implementation

    def spy(operation, backend):
        seen.append((operation, backend))
        return original(operation, backend)

    monkeypatch.setattr(_dispatch, "implementation", spy)
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng)
    with attnnb.use_backend("reference"):
        out = at.attention(q, k, v)
    out.sum().backward()
    assert ("attention", "reference") in seen
    assert ("attention_vjp", "reference") in seen
    assert not any(backend != "reference" for _, backend in seen), seen


# ---------------------------------------------------------------------------
# dropout (docs/contract.md §1.14) through the bridge and the drop-in


def test_attention_dropout_equals_numpy_and_gradchecks():
    """A given seed gives the NumPy API's output; gradients at that seed pass gradcheck."""
    rng = np.random.default_rng(31)
    q, k, v = _qkv(rng, hq=2, hk=1, lq=6, lk=7)
    out = at.attention(q, k, v, causal=True, dropout_p=0.3, seed=17)
    expected = attnnb.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(),
                                causal=True, dropout_p=0.3, seed=17)
    np.testing.assert_array_equal(out.detach().numpy(), expected)
    _gradcheck(lambda q, k, v: at.attention(q, k, v, causal=True, dropout_p=0.3, seed=17),
               (q, k, v))


def test_dropout_seed_comes_from_torch_generator():
    """``torch.manual_seed`` reproduces a run; the next draw differs; the mean over draws
    tends to the undropped output."""
    rng = np.random.default_rng(32)
    q, k, v = (x.detach() for x in _qkv(rng, hq=2, lq=5, lk=6))
    torch.manual_seed(0)
    a = at.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    b = at.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(0)
    again = at.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    torch.testing.assert_close(again, a, rtol=0, atol=0)
    assert not torch.equal(a, b)
    runs = torch.stack([at.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
                        for _ in range(1500)])
    exact = F.scaled_dot_product_attention(q, k, v)
    stderr = runs.std(dim=0) / np.sqrt(len(runs))
    assert bool(((runs.mean(dim=0) - exact).abs() < 5 * stderr + 1e-12).all())


def test_drop_in_dropout_keys_whole_call_rows():
    """Top-left causal with L > S and dropout runs as one masked call, so its decisions
    are those of the whole call's rows (a split would renumber them)."""
    rng = np.random.default_rng(33)
    q, k, v = _qkv(rng, hq=2, lq=9, lk=4)
    torch.manual_seed(5)
    out = at.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.5)
    torch.manual_seed(5)
    tril = torch.ones(9, 4, dtype=torch.bool).tril()
    expected = at.attention(q, k, v, mask=tril, dropout_p=0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert all(bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("shape", [(2,), (1, 2), ()])
def test_gradcheck_of_a_learned_sigmoid_bias(shape):
    """A tensor ``sigmoid_bias`` with a gradient is learned, one per query head (a 0-d
    one shared by all); a number or a 0-d tensor without one stays a constant."""
    rng = np.random.default_rng(22)
    q, k, v = _qkv(rng, hq=2, hk=1, d=3)
    _gradcheck(lambda q, sb: at.attention(q, k, v, causal=True, normalizer="sigmoid",
                                          sigmoid_bias=sb, backend="cpu"),
               (q, torch.tensor(rng.standard_normal(shape), requires_grad=True)))
    constant = at.attention(q, k, v, normalizer="sigmoid", sigmoid_bias=torch.tensor(0.25))
    torch.testing.assert_close(constant, at.attention(q, k, v, normalizer="sigmoid",
                                                      sigmoid_bias=0.25), rtol=0, atol=0)


@pytest.mark.parametrize("normalizer", ["sigmoid", "softpick"])
def test_gradcheck_of_the_newer_normalizers(normalizer):
    rng = np.random.default_rng(21)
    q, k, v = _qkv(rng, hq=2, hk=1, d=3)
    bias = _t(rng, (5, 6))
    extra = {"sigmoid_bias": torch.tensor(-0.5)} if normalizer == "sigmoid" else {}
    _gradcheck(lambda q, k, v, bias: at.attention(q, k, v, bias=2 * bias, causal=True,
                                                  normalizer=normalizer, backend="cpu",
                                                  **extra),
               (q, k, v, bias))

