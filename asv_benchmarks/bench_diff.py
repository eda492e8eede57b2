"""asv benchmarks for :func:`attnnb.diff_attention`.

``DiffAttention``: the fused kernel per backend, mode and size.
``DiffVersusComposition``: the fused kernel against two ``attention()`` calls
on pre-split components and against the composition from the packed layout
(split, two calls, ``o1 - lam * o2``); compare the ``time_*`` results of one
parameter set with each other.
"""

from __future__ import annotations

import numpy as np

import attnnb
from attnnb.benches.diff import composed, data

from ._ci import choose


def _require(backend):
    ok, why = attnnb.backends()[backend]
    if not ok:
        raise NotImplementedError(why)


class DiffAttention:
    params = (["cpu", "reference"], ["difference", "rectified"], choose([256, 1024], [256]),
              choose(["float32", "float64"], ["float32"]))
    param_names = ["backend", "mode", "L", "dtype"]

    def setup(self, backend, mode, L, dtype):
        _require(backend)
        if backend == "reference" and L > 256:
            raise NotImplementedError("the reference materialises the maps: small sizes only")
        self.args = data(1, 4, 2, L, 64, dtype=np.dtype(dtype))
        self.kw = dict(mode=mode, backend=backend, causal=False)
        attnnb.diff_attention(*self.args, **self.kw)  # compile

    def time_diff_attention(self, backend, mode, L, dtype):
        attnnb.diff_attention(*self.args, **self.kw)

    def peakmem_diff_attention(self, backend, mode, L, dtype):
        attnnb.diff_attention(*self.args, **self.kw)


class DiffVersusComposition:
    params = (choose([256, 1024], [256]), [False, True])
    param_names = ["L", "causal"]

    def setup(self, L, causal):
        _require("cpu")
        self.q, self.k, self.v, self.lam = data(1, 8, 8, L, 64)
        self.q1 = np.ascontiguousarray(self.q[:, 0::2])
        self.q2 = np.ascontiguousarray(self.q[:, 1::2])
        self.k1 = np.ascontiguousarray(self.k[:, 0::2])
        self.k2 = np.ascontiguousarray(self.k[:, 1::2])
        self.time_fused(L, causal)  # compile both kernels
        self.time_attention_x2(L, causal)

    def time_fused(self, L, causal):
        attnnb.diff_attention(self.q, self.k, self.v, self.lam, causal=causal, backend="cpu")

    def time_attention_x2(self, L, causal):
        attnnb.attention(self.q1, self.k1, self.v, causal=causal, backend="cpu")
        attnnb.attention(self.q2, self.k2, self.v, causal=causal, backend="cpu")

    def time_composed(self, L, causal):
        composed(self.q, self.k, self.v, self.lam, causal)
