"""asv benchmarks for the normalizers against softmax (:func:`attnnb.attention`).

``Normalizers``: dense causal attention on the cpu backend, float32, B = 1, H = 8,
each normalizer's forward and forward + backward (:func:`attnnb.vjp`); compare one
normalizer's time with softmax's at the same ``N`` and ``D`` (the issue's target: at
most 1.15x).  The normalizer is a value the kernels branch on, not a
specialisation: every normalizer runs the kernels softmax compiled.
``python -m attnnb bench --only normalizers`` times the same cases interleaved in
one process.
"""

from __future__ import annotations

from ._ci import choose

NORMALIZERS = ("softmax", "relu_expm1", "sigmoid", "softpick")


class Normalizers:
    params = (NORMALIZERS, choose([2048], [256]), choose([64, 128], [64]))
    param_names = ["normalizer", "N", "D"]
    timeout = 300

    def setup(self, normalizer, n, d):
        from attnnb.benches.normalizers import data

        self.q, self.k, self.v = data(n, d)
        self.kw = dict(causal=True, normalizer=normalizer, backend="cpu")
        self.time_forward_backward(normalizer, n, d)  # compile / load both passes

    def time_forward(self, normalizer, n, d):
        import attnnb

        attnnb.attention(self.q, self.k, self.v, **self.kw)

    def time_forward_backward(self, normalizer, n, d):
        import attnnb

        out, pullback = attnnb.vjp(attnnb.attention, self.q, self.k, self.v, **self.kw)
        pullback(out)
