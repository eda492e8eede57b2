"""asv benchmarks for mask and score functions (:mod:`attnnb.mods`), cpu backend.

ALiBi as a score function against the same logits as a materialised bias,
and a document mask (8 causal documents) against dense causal attention;
float32, B = 1, H = 8, D = 64.  ``track_*`` report time ratios measured in
one process, interleaved (the targets of the mods' issue: ALiBi at most 1.0x
the bias, documents at most 0.2x dense causal).  ``N`` is 1024 in CI's quick
pass, 2048 (ALiBi) and 16384 (documents) otherwise.
"""

import os
import time

import numpy as np

from ._ci import choose

H, D = 8, 64
N_ALIBI = choose(2048, 1024)
N_DOCS = choose(16384, 1024)


def _data(n):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, H, n, D)).astype(np.float32) for _ in range(3))


def _ratio(first, second, rounds=3):
    """Median time of ``first`` over the median of ``second``, calls interleaved."""
    times = ([], [])
    for _ in range(rounds):
        for fn, out in zip((first, second), times):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return float(np.median(times[0]) / np.median(times[1]))


class Alibi:
    timeout = 600

    def setup(self):
        import attnnb
        from attnnb import mods

        q, k, v = _data(N_ALIBI)
        slopes = 2.0 ** -np.arange(1, H + 1, dtype=np.float32)
        i, j = np.arange(N_ALIBI)[:, None], np.arange(N_ALIBI)[None, :]
        bias = (slopes[:, None, None] * (j - i)).astype(np.float32)
        self.as_mod = lambda: attnnb.attention(q, k, v, causal=True, backend="cpu",
                                               score_mod=mods.alibi(slopes))
        self.as_bias = lambda: attnnb.attention(q, k, v, causal=True, backend="cpu", bias=bias)
        self.as_mod()  # compile
        self.as_bias()

    def time_alibi_mod(self):
        self.as_mod()

    def track_mod_over_bias(self):
        return _ratio(self.as_mod, self.as_bias)

    track_mod_over_bias.unit = "ratio"


class Documents:
    timeout = 900

    def setup(self):
        import attnnb
        from attnnb import mods

        os.environ["ATTNNB_FIRST_TIER"] = "0"  # the kernels made for the function
        q, k, v = _data(N_DOCS)
        mask = mods.document(np.arange(N_DOCS) // (N_DOCS // 8))
        self.docs = lambda: attnnb.attention(q, k, v, causal=True, backend="cpu",
                                             mask_mod=mask)
        self.dense = lambda: attnnb.attention(q, k, v, causal=True, backend="cpu")
        self.docs()  # compile
        self.dense()

    def time_documents(self):
        self.docs()

    def track_documents_over_dense_causal(self):
        return _ratio(self.docs, self.dense)

    track_documents_over_dense_causal.unit = "ratio"
