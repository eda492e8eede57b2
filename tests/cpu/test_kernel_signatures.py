"""Which calls share a compiled cpu kernel (attnnb/cpu/_host.py, ``_placeholder_typed``).

Numba compiles one specialisation per tuple of argument types, layouts
included.  A mask or bias without broadcast axes (a one-head 2-D call's)
would be C-contiguous, and compile every kernel a second time, forward and
backward; it reaches the kernels typed like a broadcast one instead.
"""

from __future__ import annotations

import numpy as np

import attnnb
from attnnb.cpu.attention import attention_kernel
from attnnb.cpu.backward import dkdv_kernel, dq_kernel

KERNELS = (attention_kernel, dkdv_kernel, dq_kernel)


def signatures():
    return [set(kernel.signatures) for kernel in KERNELS]


def forward_and_gradients(q, k, v, **kwargs):
    out, pullback = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kwargs)
    return out, pullback(np.ones_like(out))


def test_a_one_head_mask_and_bias_share_the_broadcast_calls_kernels(rng):
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((9, 8), (13, 8), (13, 5)))
    mask = rng.random((9, 13)) > 0.3
    bias = rng.standard_normal((9, 13)).astype(np.float32)
    heads = [np.stack([x, x]) for x in (q, k, v)]  # two heads: the mask broadcasts over them
    forward_and_gradients(*heads, mask=mask, bias=bias)
    before = signatures()
    out, grads = forward_and_gradients(q, k, v, mask=mask, bias=bias)
    assert signatures() == before
    want, want_grads = attnnb.vjp(attnnb.attention, q.astype(np.float64), k.astype(np.float64),
                                  v.astype(np.float64), mask=mask, bias=bias.astype(np.float64),
                                  backend="reference")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    want_grads = want_grads(np.ones_like(want))
    for name in ("q", "k", "v", "bias"):
        np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_the_view_is_read_only_and_keeps_the_values(rng):
    from attnnb.cpu._host import _placeholder_typed

    x = rng.standard_normal((1, 1, 4, 6))
    view = _placeholder_typed(x)
    assert view.shape == (2, 1, 4, 6) and not view.flags.writeable
    assert not view.flags.c_contiguous and not view.flags.f_contiguous
    np.testing.assert_array_equal(view[0], x[0])
    np.testing.assert_array_equal(view[1], x[0])  # the added row repeats the real one
    full = rng.standard_normal((2, 3, 4, 6))
    assert _placeholder_typed(full) is full  # nothing to broadcast: its own kernels
