"""The input contract of attention() (docs/contract.md §1): errors name the argument, inputs are
never written, NaN stays in its own rows, odd layouts and foreign arrays work."""

from __future__ import annotations

import re

import numpy as np
import pytest

import attnnb
from attnnb._front.validate import attention_problem

from .helpers import HOST_BACKENDS, assert_close, qkv

OTHERS = [b for b in HOST_BACKENDS if b != "reference"]


@pytest.fixture
def data(rng):
    return qkv(rng, batch=(2,), hq=4, hk=2, lq=7, lk=9, d=8, dv=6)


def raises(exc, *words):
    """pytest.raises whose message must contain every word (case-sensitive, literal)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(w)})" for w in words))


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64,
                                   np.complex128, object])
def test_non_float_inputs_are_type_errors(data, which, dtype):
    args = dict(zip("qkv", data, strict=True))
    args[which] = args[which].astype(dtype)
    with raises(TypeError, which, np.dtype(dtype).name, "floating"):
        attnnb.attention(**args)


def test_ragged_list_is_type_error():
    with raises(TypeError, "q"):
        attnnb.attention([[1.0, 2.0], [3.0]], np.ones((2, 2)), np.ones((2, 2)))


@pytest.mark.parametrize("name", ["mask", "bias", "key_size"])
def test_ragged_lists_name_the_argument(name):
    q = np.zeros((2, 3, 4))
    value = [[True, False], [True]] if name == "mask" else [[1.0, 2.0], [1.0]]
    with pytest.raises(TypeError, match=f"^{name} could not be read"):
        attnnb.attention(q, q, q, backend="reference", **{name: value})


def test_lists_are_accepted(data):
    q, k, v = (x[0, 0] for x in data)
    out = attnnb.attention(q.tolist(), k.tolist(), v.tolist(), backend="reference")
    assert_close(out, attnnb.attention(q, k, v, backend="reference"), rtol=0)


@pytest.mark.parametrize("name, value, words", [
    ("mask", np.ones((7, 9), dtype=np.int8), ("mask", "int8", "bool")),
    ("mask", np.ones((7, 9)), ("mask", "float64", "bool")),
    ("bias", np.ones((7, 9), dtype=bool), ("bias", "bool")),
    ("bias", np.ones((7, 9), dtype=complex), ("bias", "complex128")),
    ("key_size", np.ones(9, dtype=bool), ("key_size", "bool")),
    ("key_size", np.array(["a"] * 9), ("key_size", "<U1")),
])
def test_option_dtypes(data, name, value, words):
    with raises(TypeError, *words):
        attnnb.attention(*data, **{name: value})


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize("shapes, words", [
    (((8,), (9, 8), (9, 6)), ("q", "at least 2", "(8,)")),
    (((7, 8), (2, 9, 8), (9, 6)), ("k", "same number of dimensions", "(2, 9, 8)")),
    (((2, 4, 7, 8), (3, 2, 9, 8), (3, 2, 9, 6)), ("batch", "(3,)", "(2,)")),
    (((4, 7, 8), (2, 9, 5), (2, 9, 6)), ("k", "head dimension", "(2, 9, 5)")),
    (((4, 7, 8), (2, 9, 8), (2, 8, 6)), ("v", "keys", "(2, 8, 6)")),
    (((4, 7, 8), (2, 9, 8), (1, 9, 6)), ("v", "heads")),
    (((3, 7, 8), (2, 9, 8), (2, 9, 6)), ("q", "multiple", "(3)", "(2)")),
    (((4, 7, 0), (2, 9, 0), (2, 9, 6)), ("head dimension", "> 0")),
])
def test_bad_shapes(shapes, words):
    q, k, v = (np.zeros(s) for s in shapes)
    with raises(ValueError, *words):
        attnnb.attention(q, k, v)


@pytest.mark.parametrize("name, shape", [
    ("mask", (8, 9)), ("mask", (3, 7, 9)), ("bias", (7, 10)), ("bias", (1, 2, 4, 7, 9)),
    ("key_size", (8,)), ("key_size", (3, 9)),
])
def test_unbroadcastable_options(data, name, shape):
    value = np.ones(shape, dtype=bool if name == "mask" else float)
    with raises(ValueError, name, str(shape), "broadcast"):
        attnnb.attention(*data, **{name: value})


def test_bias_and_mask_of_two_batch_axes_copy_the_batch_axes_only():
    rng = np.random.default_rng(0)
    B1, B2, H, L, D = 2, 8, 4, 32, 8
    q = rng.standard_normal((B1, B2, H, L, D))
    bias = rng.standard_normal((B1, 1, 1, L, L))
    mask = rng.random((1, B2, 1, L, L)) > 0.3
    problem = attention_problem(q, q, q, bias=bias, mask=mask)
    for canonical, user in ((problem.bias, bias), (problem.mask, mask)):
        held = canonical.base if canonical.base is not None else canonical
        while getattr(held, "base", None) is not None:
            held = held.base
        assert held.nbytes <= B1 * B2 * L * L * user.itemsize  # never the heads
        np.testing.assert_array_equal(
            canonical, np.broadcast_to(user, (B1, B2, H, L, L)).reshape(B1 * B2, H, L, L))
    got = attnnb.attention(q, q, q, bias=bias, mask=mask, backend="reference")
    want = attnnb.attention(q, q, q, bias=np.broadcast_to(bias, (B1, B2, H, L, L)).copy(),
                            mask=np.broadcast_to(mask, (B1, B2, H, L, L)).copy(),
                            backend="reference")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", [0.0, -1.0, np.nan])
def test_key_size_must_be_positive(data, size):
    key_size = np.ones(9)
    key_size[3] = size
    with raises(ValueError, "key_size", "positive"):
        attnnb.attention(*data, key_size=key_size)


# ------------------------------------------------------------------ scalar options


@pytest.mark.parametrize("normalizer", ["softmax2", "Softmax", None, 1])
def test_bad_normalizer(data, normalizer):
    with raises(ValueError, "normalizer", repr(normalizer), "softmax1"):
        attnnb.attention(*data, normalizer=normalizer)


@pytest.mark.parametrize("scale, exc", [
    ("0.5", TypeError), (True, TypeError), ([0.5], TypeError), (1j, TypeError),
    (np.inf, ValueError), (np.nan, ValueError),
])
def test_bad_scale(data, scale, exc):
    with raises(exc, "scale"):
        attnnb.attention(*data, scale=scale)


def test_numpy_scalar_scale(data):
    a = attnnb.attention(*data, scale=np.float32(0.25), backend="reference")
    b = attnnb.attention(*data, scale=0.25, backend="reference")
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["causal", "return_lse"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_bad_flags(data, name, value):
    with raises(TypeError, name, repr(value)):
        attnnb.attention(*data, **{name: value})


@pytest.mark.parametrize("backend", ["gpu", "CPU", "", 3])
def test_bad_backend(data, backend):
    with raises(ValueError, "backend", repr(backend)):
        attnnb.attention(*data, backend=backend)


def test_errors_come_before_work(data, monkeypatch):
    """A bad argument must fail in validation: no backend is ever called."""
    from attnnb._front import dispatch as _dispatch

    def boom(*args, **kwargs):
        raise AssertionError("a backend ran despite invalid input")

    monkeypatch.setattr(_dispatch, "implementation", lambda op, backend: boom)
    with raises(ValueError, "mask"):
        attnnb.attention(*data, mask=np.ones((3, 3), bool), backend="cpu")
    with raises(TypeError, "return_lse"):
        attnnb.attention(*data, return_lse="no", backend="cpu")


# ------------------------------------------------------------------ inputs untouched


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_inputs_never_written(rng, backend):
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=70, lk=67, d=8, dtype=np.float32)
    mask = rng.random((70, 67)) < 0.6
    bias = rng.standard_normal((2, 70, 67)).astype(np.float32)
    key_size = rng.random((2, 67, 1)).astype(np.float32) + 0.5
    args = (q, k, v, mask, bias, key_size)
    copies = [a.copy() for a in args]
    attnnb.attention(q, k, v, mask=mask, bias=bias, key_size=key_size, causal=True,
                     return_lse=True, backend=backend)
    for a, c in zip(args, copies, strict=True):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_read_only_inputs(rng, backend):
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=70, lk=67, d=8, dtype=np.float64)
    bias = rng.standard_normal((70, 67))
    mask = rng.random((70, 67)) < 0.7
    want = attnnb.attention(q, k, v, mask=mask, bias=bias, backend="reference")
    for a in (q, k, v, bias, mask):
        a.setflags(write=False)
    out = attnnb.attention(q, k, v, mask=mask, bias=bias, backend=backend)
    assert_close(out, want)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_non_contiguous_and_fortran(rng, backend):
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=70, lk=67, d=8, dtype=np.float32)
    want = attnnb.attention(q, k, v, causal=True, backend="reference")
    qf = np.asfortranarray(q)
    kt = np.ascontiguousarray(np.swapaxes(k, -1, -2)).swapaxes(-1, -2)  # transposed strides
    vs = np.repeat(v, 2, axis=-1)[..., ::2]  # every other column
    assert not (qf.flags.c_contiguous or kt.flags.c_contiguous or vs.flags.c_contiguous)
    out = attnnb.attention(qf, kt, vs, causal=True, backend=backend)
    assert_close(out, want, np.float32)
    # reversed (negative-stride) view
    out = attnnb.attention(q[..., ::-1, :], k, v, backend=backend)
    want = attnnb.attention(np.ascontiguousarray(q[..., ::-1, :]), k, v, backend="reference")
    assert_close(out, want, np.float32)


def test_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=70, lk=67, d=8, dtype=np.float32)
    tq, tk, tv = (torch.from_numpy(x.copy()) for x in (q, k, v))
    mask = torch.from_numpy(rng.random((70, 67)) < 0.7)
    want = attnnb.attention(q, k, v, mask=mask.numpy(), backend="reference")
    for backend in HOST_BACKENDS:
        out = attnnb.attention(tq, tk, tv, mask=mask, backend=backend)
        assert isinstance(out, np.ndarray) and out.dtype == np.float32
        assert_close(out, want)
    # and the same numbers as PyTorch's own SDPA (GQA expanded by hand)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        tq, tk.repeat_interleave(2, dim=1), tv.repeat_interleave(2, dim=1), attn_mask=mask)
    assert_close(want, sdpa.numpy(), np.float32)


def test_masked_arrays_with_masked_entries_are_refused():
    v = np.ma.masked_array(np.ones((5, 3)), mask=np.zeros((5, 3), bool))
    q = np.zeros((2, 3))
    assert attnnb.attention(q, np.ones((5, 3)), v, backend="reference").shape == (2, 3)
    v[2] = np.ma.masked
    with pytest.raises(TypeError, match="^v is a masked array"):
        attnnb.attention(q, np.ones((5, 3)), v, backend="reference")


# ------------------------------------------------------------------ non-finite values


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_stays_in_its_rows(rng, backend, where):
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=67, lk=70, d=8, dtype=np.float32)
    {"q": q, "k": k, "v": v}[where][0, 0, 5, 3] = np.nan
    out, lse = attnnb.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    bad = np.zeros(out.shape[:-1], bool)
    if where == "q":
        bad[0, 0, 5] = True  # only query 5 of head 0
    else:
        bad[:, :, 5 - (70 - 67):] = True  # every query whose causal set holds key 5
    np.testing.assert_array_equal(np.isnan(out).any(-1), bad)
    if where == "v":  # a NaN value spoils only its own column, and the weights not at all
        np.testing.assert_array_equal(np.isnan(out).any(-2)[0], [[0, 0, 0, 1, 0, 0, 0, 0]] * 2)
        assert np.isfinite(lse).all()
    else:
        np.testing.assert_array_equal(np.isnan(lse), bad)
        assert np.isfinite(lse[~bad]).all()


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_masked_key_never_affects_other_rows(rng, backend, value):
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=2, lq=70, lk=67, d=8, dtype=np.float32)
    clean = [x.copy() for x in (q, k, v)]
    k[0, :, 10, 2] = value
    v[0, :, 10, 1] = value
    mask = rng.random((70, 67)) < 0.7
    mask[:, 10] = False
    mask[3, 10] = True  # only query 3 may attend key 10
    out = attnnb.attention(q, k, v, mask=mask, backend=backend)
    want = attnnb.attention(*clean, mask=mask, backend="reference")
    rows = np.arange(70) != 3
    assert_close(out[..., rows, :], want[..., rows, :], np.float32)
    if np.isnan(value):  # a NaN logit reaches the one row that attends it
        assert np.isnan(out[..., 3, :]).all()


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("normalizer", ["softmax", "softmax1", "relu_expm1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_logits_stay_finite(rng, backend, normalizer, dtype):
    q, k, v = qkv(rng, batch=(1,), hq=2, lq=70, lk=67, d=4, dtype=dtype)
    bias = np.where(rng.random((70, 67)) < 0.5, 1e4, -1e4).astype(dtype)
    bias[:, 0] = 1e4  # every row has at least one huge positive logit
    out, lse = attnnb.attention(q, k, v, bias=bias, normalizer=normalizer, return_lse=True,
                                backend=backend)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert (lse > 9e3).all()
    if backend != "reference":
        want, want_lse = attnnb.attention(q, k, v, bias=bias, normalizer=normalizer,
                                          return_lse=True, backend="reference")
        # logits of 1e4 carry an absolute rounding error of 1e4 * eps in the compute
        # dtype, so the weights can only agree with the float64 reference to about that
        rtol = 1e4 * 8 * np.finfo(dtype).eps
        assert_close(out, want, rtol=rtol)
        assert_close(lse, want_lse, rtol=rtol, what="lse")
    # all logits -1e4: softmax still normalises (running maximum), no underflow to 0/0
    out = attnnb.attention(q, k, v, bias=np.full((70, 67), -1e4, dtype), backend=backend)
    if normalizer == "softmax":
        assert np.isfinite(out).all() and np.abs(out).max() > 0


@pytest.mark.parametrize("has_copy_keyword", [True, False])
def test_no_copy_reshape_of_a_broadcast_view_on_either_numpy(monkeypatch, has_copy_keyword):
    """The canonical mask or bias is a view where the batch axes merge, and a named
    ValueError where they do not, with and without NumPy 2.1's ``reshape(copy=)``."""
    from attnnb._front import checks as _checks

    if has_copy_keyword and np.lib.NumpyVersion(np.__version__) < "2.1.0":
        pytest.skip("NumPy before 2.1 has no reshape(copy=)")
    monkeypatch.setattr(_checks, "_RESHAPE_HAS_COPY", has_copy_keyword)
    full = np.ones((2, 5, 2, 3, 4))
    view = _checks._reshaped_view(full, (10, 2, 3, 4))
    assert np.shares_memory(view, full) and view.shape == (10, 2, 3, 4)
    broadcast = np.broadcast_to(np.ones((2, 1, 1, 3, 4)), (2, 5, 2, 3, 4))
    with pytest.raises(ValueError):
        _checks._reshaped_view(broadcast, (10, 2, 3, 4))
