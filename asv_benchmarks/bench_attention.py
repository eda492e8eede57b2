"""asv benchmarks for :func:`attnnb.attention`.

* :class:`Attention` -- backend x N x dtype x causal: ``time_attention`` and
  ``track_gflops`` (B=1, H=8, D=64).  The ``reference`` backend runs only at
  the smallest N (it materialises float64 scores).
* :class:`Comparison` -- float32 attnnb ``cpu`` against plain NumPy and
  PyTorch's ``F.scaled_dot_product_attention`` (skipped without torch), and
  ``track_speed_vs_torch``: SDPA time / attnnb time from interleaved calls in
  one process (higher is better; ``asv compare`` assumes lower is better).
* :class:`Memory` -- ``track_peak_rss_growth_mib``: one causal call, N=32768,
  one head, D=64, in a fresh subprocess (target < 256 MiB).
* :class:`Startup` -- ``timeraw_import`` (``import attnnb``) and
  ``timeraw_first_call`` (first cpu call with a warm on-disk cache), each in
  a fresh interpreter.

Sizes are modest so that ``asv run --python=same --quick`` stays short in CI.
Kernels compile in ``setup`` (Numba's on-disk cache makes later processes
fast).
"""

import time

import numpy as np

from ._ci import choose

H, D = 8, 64
SIZES = choose([512, 2048], [512])
# float64 and non-causal calls: in the tests and recorded histories, not in CI's quick pass
DTYPES = choose(["float32", "float64"], ["float32"])
CAUSAL = choose([False, True], [True])


def _available(backend):
    import attnnb

    ok, why = attnnb.backends()[backend]
    if not ok:
        raise NotImplementedError(why)


def _inputs(n, dtype):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, H, n, D)).astype(dtype) for _ in range(3))


def _median_seconds(fn, repeats=3):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


class Attention:
    params = (["reference", "cpu", "cuda"], SIZES, DTYPES, CAUSAL)
    param_names = ["backend", "N", "dtype", "causal"]
    timeout = 300

    def setup(self, backend, n, dtype, causal):
        _available(backend)
        if backend == "reference" and n > SIZES[0]:
            raise NotImplementedError("reference only at the smallest N")
        import attnnb

        self.q, self.k, self.v = _inputs(n, dtype)
        self.call = lambda: attnnb.attention(self.q, self.k, self.v, causal=causal,
                                             backend=backend)
        self.call()  # compile / load from the cache

    def time_attention(self, backend, n, dtype, causal):
        self.call()

    def track_gflops(self, backend, n, dtype, causal):
        from attnnb.benches.attention import attention_flops

        return attention_flops(1, H, n, n, D, D, causal) / _median_seconds(self.call) / 1e9

    track_gflops.unit = "GFLOP/s"


class _Implementations:
    """Set-up shared by the comparison classes: ``self.call`` and ``self.torch_call``."""

    param_names = ["impl", "N", "causal"]
    timeout = 300

    def setup(self, impl, n, causal):
        import attnnb
        from attnnb.benches.attention import _torch, numpy_attention

        q, k, v = _inputs(n, "float32")
        torch, F = _torch()
        self.torch_call = None
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
            self.torch_call = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        if impl == "torch":
            if torch is None:
                raise NotImplementedError("torch is not installed")
            self.call = self.torch_call
        elif impl == "numpy":
            self.call = lambda: numpy_attention(q, k, v, causal)
        else:
            _available("cpu")
            self.call = lambda: attnnb.attention(q, k, v, causal=causal, backend="cpu")
        self.call()


class Comparison(_Implementations):
    params = (["attnnb-cpu", "numpy", "torch"], SIZES, CAUSAL)

    def time_attention(self, impl, n, causal):
        self.call()

    def track_gflops(self, impl, n, causal):
        from attnnb.benches.attention import attention_flops

        return attention_flops(1, H, n, n, D, D, causal) / _median_seconds(self.call) / 1e9

    track_gflops.unit = "GFLOP/s"


class VersusTorch(_Implementations):
    params = (["attnnb-cpu", "numpy"], SIZES, CAUSAL)

    def setup(self, impl, n, causal):
        from attnnb.benches.attention import _torch

        if _torch()[0] is None:  # skipped (not failed) where torch is not installed
            raise NotImplementedError("torch is not installed")
        super().setup(impl, n, causal)

    def track_speed_vs_torch(self, impl, n, causal):
        """SDPA time / this implementation's time, interleaved medians (> 1: faster)."""
        mine, theirs = [], []
        for _ in range(5):
            t = time.perf_counter()
            self.call()
            mine.append(time.perf_counter() - t)
            t = time.perf_counter()
            self.torch_call()
            theirs.append(time.perf_counter() - t)
        return float(np.median(theirs) / np.median(mine))

    track_speed_vs_torch.unit = "ratio"


class Memory:
    timeout = 600

    def setup(self):
        _available("cpu")

    def track_peak_rss_growth_mib(self):
        """Peak-RSS growth over one causal call, N=32768, H=1, D=64, float32."""
        from attnnb.benches.attention import peak_rss_growth_mib

        return peak_rss_growth_mib(32768)

    track_peak_rss_growth_mib.unit = "MiB"


class Startup:
    timeout = 300

    def setup(self):
        _available("cpu")
        import attnnb

        q = _inputs(100, "float32")[0][:, :2]
        attnnb.attention(q, q, q, backend="cpu")  # the on-disk cache is now warm

    def timeraw_import(self):
        return "import attnnb"

    def timeraw_first_call(self):
        code = 'attnnb.attention(q, q, q, backend="cpu")'
        setup = ("import numpy as np\nimport attnnb\n"
                 "q = np.random.default_rng(0).standard_normal((1, 2, 100, 64))"
                 ".astype(np.float32)")
        return code, setup
