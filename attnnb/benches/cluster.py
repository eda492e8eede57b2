"""Benchmarks of attention on Dask arrays (docs/contract.md §7.2); needs ``attnnb[dask]``.

Overhead: one head, D = 64, float32, N = 32768 (``quick``: 4096): the
single-process call (both cores, Numba's threads) against the same call on
Dask arrays whose keys are in two chunks (query one chunk), on a
``dask.distributed.LocalCluster`` of two worker processes with one thread
and one Numba thread each (so the two runs use the same two cores).  Each
run is in a fresh process, the two alternate, and each times its call
after an untimed warm-up (the cluster's start, the kernels' loading); the
inputs live on the workers (made there by ``dask.array.random``) and the
result is gathered into the client, as a user would run it.  The row's
ratio is Dask's time over the single call's (target <= 1.3).
"""

from __future__ import annotations

from .attention import run_python

D = 64

# both scripts: the inputs, a warm-up call, then the timed call; they print its seconds
_SINGLE_SCRIPT = r"""
import sys, time
import numpy as np
import attnnb

n = int(sys.argv[1])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, n, 64)).astype(np.float32) for _ in range(3))
small = np.ones((1, 1, 130, 64), np.float32)
attnnb.attention(small, small, small, return_lse=True, backend="cpu")
t = time.perf_counter()
attnnb.attention(q, k, v, backend="cpu")
print(time.perf_counter() - t)
"""

_DASK_SCRIPT = r"""
import logging, sys, time
import numpy as np
import dask.array as da
import distributed
import attnnb


def warm():
    small = np.ones((1, 1, 130, 64), np.float32)
    attnnb.attention(small, small, small, return_lse=True, backend="cpu")


if __name__ == "__main__":
    n, key_chunks = int(sys.argv[1]), int(sys.argv[2])
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None, silence_logs=logging.ERROR,
                                  env={"NUMBA_NUM_THREADS": "1"}) as cluster, \
            distributed.Client(cluster) as client:
        client.run(warm)
        rng = da.random.default_rng(0)
        q = rng.standard_normal((1, 1, n, 64), chunks=(1, 1, n, 64)).astype(np.float32)
        k, v = (rng.standard_normal((1, 1, n, 64), chunks=(1, 1, n // key_chunks, 64))
                .astype(np.float32) for _ in range(2))
        q, k, v = client.persist([q, k, v])
        distributed.wait([q, k, v])
        t = time.perf_counter()
        attnnb.attention(q, k, v).compute()
        print(time.perf_counter() - t)
"""


def single_seconds(n):
    return run_python(_SINGLE_SCRIPT, n)


def dask_seconds(n, key_chunks=2):
    return run_python(_DASK_SCRIPT, n, key_chunks)


def cases(quick: bool) -> list[dict]:
    import dask  # noqa: F401 - ImportError: the engine skips this module
    import distributed  # noqa: F401

    n = 4096 if quick else 32768
    return [{
        "name": f"dask 2 workers, keys in 2 chunks, N={n} H=1", "work": None,
        "measure": "value", "unit": "s", "repeats": 1 if quick else 3, "compare": True,
        "target": "dask <= 1.3x single",
        "candidates": {"single": lambda: single_seconds(n),
                       "dask": lambda: dask_seconds(n)},
    }]
