"""asv benchmarks of the cuda backend with device-resident inputs (skipped without a GPU).

The inputs live on the device (Numba device arrays), so the timings cover
the kernels and the launch, not host transfers; each call synchronises
before returning to asv.  ``gpu/run.py`` compares with PyTorch on the GPU.
"""

import numpy as np

from ._ci import choose

H, D = 16, 64


def _device_inputs(n, dtype):
    import attnnb

    ok, why = attnnb.backends()["cuda"]
    if not ok or "simulator" in why:
        raise NotImplementedError(f"no GPU: {why}")
    from numba import cuda

    rng = np.random.default_rng(0)
    return tuple(cuda.to_device(rng.standard_normal((1, H, n, D)).astype(dtype))
                 for _ in range(3))


class CudaAttention:
    params = (choose([1024, 4096], [1024]), [False, True], ["float32", "float64"])
    param_names = ["N", "causal", "dtype"]
    timeout = 300

    def setup(self, n, causal, dtype):
        self.q, self.k, self.v = _device_inputs(n, dtype)
        self.time_attention(n, causal, dtype)  # compile

    def time_attention(self, n, causal, dtype):
        from numba import cuda

        import attnnb

        attnnb.attention(self.q, self.k, self.v, causal=causal)
        cuda.synchronize()


class CudaDiffAttention:
    params = (choose([1024, 4096], [1024]), ["difference", "rectified"])
    param_names = ["N", "mode"]
    timeout = 300

    def setup(self, n, mode):
        q, k, v = _device_inputs(n, "float32")  # 16 heads = 8 pairs; v keeps 16 heads of D
        self.q, self.k, self.v = q, k, v[:, : H // 2]
        self.time_diff_attention(n, mode)

    def time_diff_attention(self, n, mode):
        from numba import cuda

        import attnnb

        attnnb.diff_attention(self.q, self.k, self.v, 0.5, causal=True, mode=mode)
        cuda.synchronize()
