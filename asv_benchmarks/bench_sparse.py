"""asv benchmarks for sparse and top-k attention.

``N`` is 2048 by default so that ``asv run --quick`` stays short in CI; set
``ATTNNB_ASV_FULL=1`` for the target size of the issue (``N = 16384``).
``track_pair_cost_ratio`` times dense and sparse attention in the same
process and reports sparse time per allowed pair / dense time per pair
(target: at most 1.5); ``track_topk_dense_ratio`` the same for top-k against
causal dense attention (target: at most 1.3).
"""

import os

FULL = os.environ.get("ATTNNB_ASV_FULL", "0") == "1"
N = 16384 if FULL else 2048
H, D = 8, 64


def _available(backend):
    import attnnb

    ok, why = attnnb.backends()[backend]
    if not ok:
        raise NotImplementedError(why)


class SparseAttention:
    params = (["cpu", "cuda"], ["local w=256", "bigbird b=64 g=1 w=3 r=3"])
    param_names = ["backend", "pattern"]
    timeout = 600

    def setup(self, backend, pattern):
        _available(backend)
        from attnnb.benches.sparse import bench_patterns, data

        self.q, self.k, self.v = data(N, H, D)
        self.pattern = bench_patterns(N)[pattern]
        self.pattern.blocks()
        self.backend = backend
        self._sparse()  # compile

    def _sparse(self):
        from attnnb import sparse_attention

        return sparse_attention(self.q, self.k, self.v, self.pattern, backend=self.backend)

    def time_sparse_attention(self, backend, pattern):
        self._sparse()

    def track_pair_cost_ratio(self, backend, pattern):
        """Sparse seconds per allowed pair / dense seconds per pair (lower is better):
        medians of interleaved calls, as ``python -m attnnb.benches.sparse``."""
        from attnnb.benches.sparse import pair_cost_ratios

        return pair_cost_ratios(N, H, D, rounds=2, calls=3, backend=backend)[pattern][0]

    track_pair_cost_ratio.unit = "ratio"


class TopkAttention:
    params = (["cpu", "cuda"], [8, 64])
    param_names = ["backend", "top_k"]
    timeout = 300

    def setup(self, backend, top_k):
        _available(backend)
        from attnnb import topk_attention
        from attnnb.benches.sparse import data

        self.q, self.k, self.v = data(1024, H, D)
        topk_attention(self.q[:, :, :70], self.k[:, :, :70], self.v[:, :, :70], 2,
                       backend=backend)

    def time_topk_attention(self, backend, top_k):
        from attnnb import topk_attention

        topk_attention(self.q, self.k, self.v, top_k, causal=True, backend=backend)


class TopkDenseRatio:
    """``topk_attention`` (causal) over causal dense attention on the same data: time ratio
    of interleaved calls in one process (target: at most 1.3 for ``top_k = 64`` at
    ``N = 4096``; ``N = 1024`` unless ``ATTNNB_ASV_FULL=1``)."""

    params = (["cpu", "cuda"], [64])
    param_names = ["backend", "top_k"]
    timeout = 300

    def setup(self, backend, top_k):
        _available(backend)

    def track_topk_dense_ratio(self, backend, top_k):
        from attnnb.benches.sparse import topk_dense_ratio

        return topk_dense_ratio(4096 if FULL else 1024, H, D, top_k, rounds=5,
                                backend=backend)[0]

    track_topk_dense_ratio.unit = "ratio"
