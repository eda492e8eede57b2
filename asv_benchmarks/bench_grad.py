"""asv benchmarks for the gradients (:func:`attnnb.vjp`).

``AttentionGradient``: forward + backward and the backward alone (the
pullback of a saved forward) of dense attention on the cpu backend.
``GradientVersusTorch``: forward + backward against PyTorch SDPA's on the
same data; skipped where PyTorch is not installed.
"""

from __future__ import annotations

import numpy as np

import attnnb

from ._ci import choose


def _data(n, heads=8, d=64):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, heads, n, d)).astype(np.float32) for _ in range(4))


class AttentionGradient:
    params = (choose([512, 2048], [512]), [False, True])
    param_names = ["N", "causal"]

    def setup(self, n, causal):
        self.q, self.k, self.v, self.do = _data(n)
        self.kw = dict(causal=causal, backend="cpu")
        _, self.pullback = attnnb.vjp(attnnb.attention, self.q, self.k, self.v, **self.kw)
        self.pullback(self.do)  # compile or load

    def time_forward_backward(self, n, causal):
        _, pullback = attnnb.vjp(attnnb.attention, self.q, self.k, self.v, **self.kw)
        pullback(self.do)

    def time_backward(self, n, causal):
        self.pullback(self.do)


class GradientVersusTorch:
    params = ([1024], [False, True])
    param_names = ["N", "causal"]

    def setup(self, n, causal):
        try:
            import torch
            import torch.nn.functional as F
        except ImportError as exc:
            raise NotImplementedError("PyTorch is not installed") from exc
        self.torch, self.F = torch, F
        self.q, self.k, self.v, self.do = _data(n)
        self.t = [torch.from_numpy(a).requires_grad_() for a in (self.q, self.k, self.v)]
        self.tdo = torch.from_numpy(self.do)
        self.causal = causal
        self.time_attnnb(n, causal)
        self.time_sdpa(n, causal)

    def time_attnnb(self, n, causal):
        _, pullback = attnnb.vjp(attnnb.attention, self.q, self.k, self.v, causal=causal,
                                 backend="cpu")
        pullback(self.do)

    def time_sdpa(self, n, causal):
        out = self.F.scaled_dot_product_attention(*self.t, is_causal=causal)
        self.torch.autograd.grad(out, self.t, self.tdo)
