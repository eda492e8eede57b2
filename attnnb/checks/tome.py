"""Self-check cases for :mod:`attnnb.tome` (see :mod:`attnnb.checks`).

Every case matches on seeded random data (awkward sizes, float32 and
float64) and returns the merged tokens in every mode, the unmerged tokens
and the token-to-slot map, so a backend that picks different edges fails.
"""

from __future__ import annotations

import numpy as np

from .. import tome


def _data(seed, B, N, C, dtype):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, N, C)).astype(dtype),
            rng.standard_normal((B, N, 5)).astype(dtype))


def _outputs(m, x, backend):
    merged = m.merge(x, "mean", backend=backend)
    return (merged, m.merge(x, "sum", backend=backend), m.merge(x, "amax", backend=backend),
            m.unmerge(merged, backend=backend), m.slot.astype(np.float64))


def _case(make, seed, B, N, C, dtype):
    metric, x = _data(seed, B, N, C, dtype)

    def run(backend):
        return _outputs(make(metric, backend), x, backend)

    return run


def _wavg_case(seed, dtype):
    """Two ToMe layers: merge_wavg sizes and merge_source maps."""
    metric, x = _data(seed, 2, 61, 9, dtype)

    def run(backend):
        y, size, source = x, None, None
        for r in (13, 9):
            m = tome.bipartite_soft_matching(metric[:, : y.shape[1]], r, class_token=True,
                                             backend=backend)
            source = tome.merge_source(m, y, source)
            y, size = tome.merge_wavg(m, y, size)
        return y, size, source

    return run


def cases():
    """``(name, run)`` pairs for every matching function and helper."""
    out = []
    for dtype in (np.float32, np.float64):
        tag = np.dtype(dtype).name
        out += [
            (f"tome bipartite N=77 r=20 {tag}",
             _case(lambda m, b: tome.bipartite_soft_matching(m, 20, backend=b),
                   11, 2, 77, 12, dtype)),
            (f"tome bipartite class+distill r clamped {tag}",
             _case(lambda m, b: tome.bipartite_soft_matching(
                 m, 99, class_token=True, distill_token=True, backend=b), 12, 3, 50, 7, dtype)),
            (f"tome bipartite N=1101 (several tiles) {tag}",
             _case(lambda m, b: tome.bipartite_soft_matching(m, 400, backend=b),
                   13, 1, 1101, 6, dtype)),
            (f"tome kth k=3 N=40 {tag}",
             _case(lambda m, b: tome.kth_bipartite_soft_matching(m, 3, backend=b),
                   14, 2, 40, 8, dtype)),
            (f"tome random r=17 {tag}",
             _case(lambda m, b: tome.random_bipartite_soft_matching(m, 17, seed=5, backend=b),
                   15, 2, 45, 8, dtype)),
            (f"tome random2d 9x7 cells 2x2 {tag}",
             _case(lambda m, b: tome.bipartite_soft_matching_random2d(
                 m, 9, 7, 2, 2, 30, seed=6, backend=b), 16, 2, 63, 10, dtype)),
            (f"tome merge_wavg+merge_source two layers {tag}", _wavg_case(17, dtype)),
        ]
    return out
