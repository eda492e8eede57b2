"""asv benchmarks over the shapes people run: head sizes, a ViT batch, decoding.

The shapes are those of :mod:`attnnb.benches.shapes` (float32, ``cpu``
backend): ``D`` in 16 .. 256 at ``N = 2048``, ``B = 32, H = 6, N = 197, D =
64``, and ``Lq`` in (1, 16) against ``Lk`` in (4096, 32768).

* :class:`Shapes` -- ``time_forward`` and ``time_forward_backward``
  (:func:`attnnb.vjp` and its pullback).
* :class:`ShapesVersusTorch` -- ``track_speed_vs_torch``: SDPA's forward time
  over attnnb's, interleaved medians in one process (higher is better;
  skipped without torch).
"""

import time

import numpy as np

from attnnb.benches.shapes import shape_list

from ._ci import QUICK

SHAPES = dict(shape_list(quick=False))
# CI's quick pass (ATTNNB_ASV_SKIP_SLOW set) runs three of them: one narrow head size, the
# ViT batch and one decoding step; recorded histories run them all.
CI_SHAPES = ("D=40 H=8 N=2048", "ViT B=32 H=6 N=197 D=64", "decode Lq=1 Lk=4096 H=8 D=64")
if QUICK:
    SHAPES = {name: SHAPES[name] for name in CI_SHAPES}


class _ShapeInputs:
    """Set-up shared by the classes below: the inputs and ``self.forward``."""

    params = (list(SHAPES),)
    param_names = ["shape"]
    timeout = 300

    def setup(self, shape):
        import attnnb

        b, h, lq, lk, d, causal = SHAPES[shape]
        rng = np.random.default_rng(0)
        self.q = rng.standard_normal((b, h, lq, d)).astype(np.float32)
        self.k, self.v = (rng.standard_normal((b, h, lk, d)).astype(np.float32)
                          for _ in range(2))
        self.do = rng.standard_normal(self.q.shape).astype(np.float32)
        self.causal = causal
        self.forward = lambda: attnnb.attention(self.q, self.k, self.v, causal=causal,
                                                backend="cpu")
        self.forward()  # compile / load from the cache


class Shapes(_ShapeInputs):
    def setup(self, shape):
        super().setup(shape)
        self.time_forward_backward(shape)  # compile / load the backward kernels

    def time_forward(self, shape):
        self.forward()

    def time_forward_backward(self, shape):
        import attnnb

        _, pullback = attnnb.vjp(attnnb.attention, self.q, self.k, self.v,
                                 causal=self.causal, backend="cpu")
        pullback(self.do)


class ShapesVersusTorch(_ShapeInputs):
    def setup(self, shape):
        from attnnb.benches.attention import _torch

        if _torch()[0] is None:  # skipped (not failed) where torch is not installed
            raise NotImplementedError("torch is not installed")
        super().setup(shape)

    def track_speed_vs_torch(self, shape):
        """SDPA forward time / attnnb forward time, interleaved medians (> 1: faster)."""
        from attnnb.benches.attention import _torch

        torch, F = _torch()
        tq, tk, tv = (torch.from_numpy(a) for a in (self.q, self.k, self.v))

        def sdpa():
            with torch.no_grad():
                F.scaled_dot_product_attention(tq, tk, tv, is_causal=self.causal)

        mine, theirs = [], []
        for _ in range(5):
            for fn, times in ((self.forward, mine), (sdpa, theirs)):
                fn()  # settle: the other candidate's threads go idle
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return float(np.median(theirs) / np.median(mine))

    track_speed_vs_torch.unit = "ratio"
