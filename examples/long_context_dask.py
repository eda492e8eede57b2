"""One-head causal attention over N = 131072 tokens on a Dask cluster.

Starts a ``dask.distributed.LocalCluster`` of two worker processes (one
thread and one Numba thread each, so that they share two cores without
oversubscribing them), or connects to a running cluster with
``--scheduler ADDRESS``.  ``q``, ``k`` and ``v`` are made on the workers
(``dask.array.random``: no N-row array passes through this process), in
blocks of 8192 tokens.  Causal attention over them is one task per
(query block, key block) on or below the diagonal (136 of the 256 pairs;
the others are never scheduled), followed by the LSE merges; Dask's
progress bar follows the computation.  The script then prints

* the time of the computation and each worker's peak memory during it
  (the growth of its resident set, and the peak itself);
* the largest error of 64 sampled output rows against the same rows
  computed directly in float64 with NumPy;

and saves ``examples/out/long_context_dask.png``: how long each
(query block, key block) task ran (white: not scheduled).  With the
kernels in Numba's on-disk cache, about half a minute on two cores.

    python examples/long_context_dask.py [--n 131072] [--chunk 8192] [--scheduler tcp://...]
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import time

import dask
import dask.array as da
import distributed
import numpy as np

import attnnb

D = 64
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def warm_up():
    """Load the kernels (from Numba's cache) on a worker before the clock starts."""
    small = np.ones((1, 1, 130, D), np.float32)
    attnnb.attention(small, small, small, return_lse=True, backend="cpu")


def reset_peak():
    """Linux: make the worker's peak resident set (VmHWM) its current one; returns MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def peak_mib():
    return _status_mib("VmHWM")


def _status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024


def exact_rows(q, k, v, rows):
    """Causal softmax attention of query ``rows`` in float64, with NumPy."""
    s = q[rows].astype(np.float64) @ k.astype(np.float64).T / np.sqrt(D)
    s[np.arange(k.shape[0])[None, :] > rows[:, None]] = -np.inf
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return (w / w.sum(axis=1, keepdims=True)) @ v.astype(np.float64)


def task_times(stream, name, blocks):
    """Seconds of each part task (query block, key block) from a task stream; NaN: none."""
    grid = np.full((blocks, blocks), np.nan)
    for record in stream:
        key = record["key"]
        if isinstance(key, str) and key.startswith("("):  # keys may arrive as their repr
            key = ast.literal_eval(key)
        if isinstance(key, tuple) and key[0] == name:
            compute = [s for s in record["startstops"] if s["action"] == "compute"]
            grid[key[-2], key[-1]] = sum(s["stop"] - s["start"] for s in compute)
    return grid


def plot(grid, n, chunk, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture")
        return
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    im = ax.imshow(grid * 1e3, cmap="viridis", origin="upper")
    fig.colorbar(im, ax=ax, label="task time (ms)")
    ax.set_xlabel(f"key block ({chunk} keys)")
    ax.set_ylabel(f"query block ({chunk} queries)")
    ax.set_title(f"causal attention, N = {n}: one task per visible block")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main(args):
    if args.scheduler:
        client = distributed.Client(args.scheduler)
        cluster = None
    else:
        cluster = distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1,
                                           processes=True, silence_logs=logging.ERROR,
                                           dashboard_address=None,
                                           env={"NUMBA_NUM_THREADS": "1"})
        client = distributed.Client(cluster)
    try:
        client.run(warm_up)
        n, chunk = args.n, args.chunk
        rng = da.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 1, n, D), chunks=(1, 1, chunk, D))
                   .astype(np.float32) for _ in range(3))
        q, k, v = client.persist([q, k, v])
        distributed.wait([q, k, v])
        before = client.run(reset_peak)
        out = attnnb.attention(q, k, v, causal=True)
        part = next(key[0] for key in dict(out.__dask_graph__())
                    if isinstance(key, tuple) and "-part-" in str(key[0]))
        # without low-level fusion, every part task keeps its name in the task stream (a
        # query block with a single part would otherwise be fused with its finish)
        with dask.config.set({"optimization.fuse.active": False}), \
                distributed.get_task_stream(client) as stream:
            start = time.perf_counter()
            out = client.persist(out)
            distributed.progress(out)
            distributed.wait(out)
            seconds = time.perf_counter() - start
        peaks = client.run(peak_mib)
        print(f"\ncausal attention, N = {n}, one head, D = {D}, float32, blocks of {chunk}: "
              f"{seconds:.1f} s on {len(peaks)} workers")
        for worker, peak in peaks.items():
            print(f"  {worker}: peak {peak:.0f} MiB (+{peak - before[worker]:.0f} MiB during "
                  "the computation)")
        rows = np.sort(np.random.default_rng(1).choice(n, 64, replace=False))
        got = out[0, 0, rows].compute()
        q1, k1, v1 = (x[0, 0].compute() for x in (q, k, v))
        exact = exact_rows(q1, k1, v1, rows)
        err = np.abs(got - exact).max() / np.abs(exact).max()
        print(f"64 sampled rows against float64 NumPy: max relative error {err:.2e}")
        blocks = -(-n // chunk)
        plot(task_times(stream.data, part, blocks), n, chunk,
             os.path.join(OUT, "long_context_dask.png"))
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=131072, help="sequence length")
    parser.add_argument("--chunk", type=int, default=8192, help="tokens per block")
    parser.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes")
    parser.add_argument("--scheduler", help="address of a running Dask scheduler to use instead")
    main(parser.parse_args())
