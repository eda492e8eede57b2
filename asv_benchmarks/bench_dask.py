"""asv benchmarks of attention on Dask arrays (needs ``attnnb[dask]``; skipped without it).

``DaskAttention``: float32, one head, D = 64, N = 4096, keys in 1, 4 or 8
chunks (query in 4), causal and not, on Dask's threaded scheduler; beside
it the single call on the same NumPy arrays.  ``time_dask / time_single``
is the graph's overhead on one machine; the 2-worker ``LocalCluster``
comparison is ``python -m attnnb bench --only cluster`` (it starts
processes, too slow for asv's quick pass).
"""

from __future__ import annotations

import numpy as np

from ._ci import choose

N, D = 4096, 64


class DaskAttention:
    params = (choose([1, 4, 8], [4]), [False, True])
    param_names = ["key_chunks", "causal"]
    timeout = 300

    def setup(self, key_chunks, causal):
        try:
            import dask
            import dask.array as da
        except ImportError as exc:
            raise NotImplementedError(f"dask is not installed: {exc}") from None
        import attnnb

        self.attnnb, self.dask = attnnb, dask
        rng = np.random.default_rng(0)
        self.arrays = [rng.standard_normal((1, 1, N, D)).astype(np.float32) for _ in range(3)]
        q, k, v = self.arrays
        self.lazy = (da.from_array(q, chunks=(1, 1, N // 4, D)),
                     *(da.from_array(x, chunks=(1, 1, N // key_chunks, D)) for x in (k, v)))
        self.causal = causal
        self.time_dask(key_chunks, causal)  # compile, and warm the threads up
        self.time_single(key_chunks, causal)

    def time_dask(self, key_chunks, causal):
        out = self.attnnb.attention(*self.lazy, causal=self.causal)
        self.dask.compute(out, scheduler="threads")

    def time_single(self, key_chunks, causal):
        self.attnnb.attention(*self.arrays, causal=self.causal, backend="cpu")
