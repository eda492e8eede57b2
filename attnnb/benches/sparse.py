"""Benchmark cases for sparse and top-k attention (see ``python -m attnnb bench``).

The target (issue: sparse attention) is a cost proportional to the allowed
pairs: at ``N = 16384, H = 8, D = 64``, float32, the time *per allowed pair*
of :func:`attnnb.sparse_attention` with a local window of 256 and with a
BigBird pattern at most 1.5x dense :func:`attnnb.attention`'s time per pair
on the same backend.  Each case's ``work`` counts the flops of the allowed
pairs only (``4 * H * pairs * D``), so the GFLOP/s of a sparse case divided
by that of the dense case is the inverse of that ratio.

Candidates: ``attnnb-cpu`` (first), ``attnnb-cpu dense+mask`` (the same
result from dense attention with ``mask=pattern.to_mask()``) and ``torch``
(SDPA with the boolean mask) at the quick sizes.

``python -m attnnb.benches.sparse [--quick] [--threads T]`` prints the
per-pair ratios directly, timing dense and sparse interleaved in one process
(:func:`pair_cost_ratios`), and top-k's time over causal dense attention's
(:func:`topk_dense_ratio`; target: at most 1.3 for ``top_k = 64``, causal,
``N = 4096``).
"""

from __future__ import annotations

import sys
import time

import numpy as np

FULL = {"N": 16384, "H": 8, "D": 64, "window": 256}
QUICK = {"N": 2048, "H": 8, "D": 64, "window": 256}


def data(N, H, D, seed=0, dtype=np.float32):
    """``q, k, v`` of shape ``(1, H, N, D)``."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, H, N, D), dtype=np.float64).astype(dtype)
                 for _ in range(3))


def bench_patterns(N, window=256):
    """The benchmarked patterns: a local window and BigBird (64-blocks, 1 global, 3 window,
    3 random), both about 3 % dense at N = 16384."""
    from attnnb import patterns

    return {
        f"local w={window}": patterns.local(N, window),
        "bigbird b=64 g=1 w=3 r=3": patterns.bigbird(N, 64, 1, 3, 3, seed=0),
    }


def _torch_masked(q, k, v, mask):
    try:
        import torch
        import torch.nn.functional as F
    except Exception:
        return None
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    tm = torch.from_numpy(mask)

    def run():
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)

    return run


def cases(quick: bool = False):
    """Dense, then each pattern (sparse vs. dense+mask), then top-k, on the same data."""
    from attnnb import attention, sparse_attention, topk_attention

    size = QUICK if quick else FULL
    N, H, D = size["N"], size["H"], size["D"]
    q, k, v = data(N, H, D)
    out = [{
        "name": f"dense N={N} H={H} D={D} fp32",
        "work": 4.0 * H * N * N * D,
        "candidates": {"attnnb-cpu": lambda: attention(q, k, v, backend="cpu")},
    }]
    for name, p in bench_patterns(N, size["window"]).items():
        p.blocks()  # built once, outside the timing, as a model would
        cands = {"attnnb-cpu": lambda p=p: sparse_attention(q, k, v, p, backend="cpu")}
        if quick:  # the dense alternatives cost the full N^2: small sizes only
            mask = p.to_mask()
            cands["attnnb-cpu dense+mask"] = lambda m=mask: attention(q, k, v, mask=m,
                                                                      backend="cpu")
            torch_run = _torch_masked(q, k, v, mask)
            if torch_run is not None:
                cands["torch"] = torch_run
        out.append({"name": f"sparse {name} N={N} density {p.density:.3f}",
                    "work": 4.0 * H * p.nnz * D, "candidates": cands})
    Nk = 1024 if quick else 4096
    qt, kt, vt = (x[:, :, :Nk] for x in (q, k, v))
    out.append({  # dense first: the ratio column is then top-k's time over dense's
        "name": f"topk k=64 causal N={Nk}",
        "work": 4.0 * H * Nk * 64 * D,
        "candidates": {"attnnb-cpu dense causal": lambda: attention(qt, kt, vt, causal=True,
                                                                    backend="cpu"),
                       "attnnb-cpu": lambda: topk_attention(qt, kt, vt, 64, causal=True,
                                                            backend="cpu")},
        "target": "topk <= 1.3x dense",
    })
    return out


def pair_cost_ratios(N, H=8, D=64, window=256, rounds=3, calls=5, backend="cpu"):
    """Sparse time per allowed pair over dense time per pair, on the same backend.

    ``rounds`` rounds, each timing one dense call and then ``calls`` calls of
    every pattern, so that both see the same machine; the ratio compares
    medians.  A dense call at ``N = 16384`` runs for seconds and so averages
    over the machine's noise; a sparse call runs for a fraction of a second,
    and its median over ``rounds * calls`` calls is its typical time (the
    minimum would favour it).  Returns ``{pattern: (ratio, density, sparse
    seconds, dense seconds)}`` (medians).
    """
    from attnnb import attention, patterns, sparse_attention

    q, k, v = data(N, H, D)
    pats = bench_patterns(N, window)
    for p in pats.values():
        p.blocks()
    # compile and warm up on a small slice
    qs, ks, vs = (x[:, :, :128] for x in (q, k, v))
    attention(qs, ks, vs, backend=backend)
    sparse_attention(qs, ks, vs, patterns.local(128, 8), backend=backend)
    times = {"dense": []} | {name: [] for name in pats}
    for _ in range(rounds):
        t = time.perf_counter()
        attention(q, k, v, backend=backend)
        times["dense"].append(time.perf_counter() - t)
        for name, p in pats.items():
            for _ in range(calls):
                t = time.perf_counter()
                sparse_attention(q, k, v, p, backend=backend)
                times[name].append(time.perf_counter() - t)
    dense = float(np.median(times["dense"]))
    result = {}
    for name, p in pats.items():
        ts = float(np.median(times[name]))
        result[name] = ((ts / p.nnz) / (dense / (N * N)), p.density, ts, dense)
    return result


def topk_dense_ratio(N, H=8, D=64, top_k=64, causal=True, rounds=5, backend="cpu"):
    """Top-k attention's time over dense attention's on the same allowed set.

    The target (issue: top-k selection) is at most 1.3 for ``top_k = 64``,
    causal, ``N = 4096``.  ``rounds`` rounds of one call each, interleaved,
    after a warm-up call of each; returns ``(ratio of the medians, top-k
    seconds, dense seconds)``.
    """
    from attnnb import attention, topk_attention

    q, k, v = data(N, H, D)
    calls = {"topk": lambda: topk_attention(q, k, v, top_k, causal=causal, backend=backend),
             "dense": lambda: attention(q, k, v, causal=causal, backend=backend)}
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    tk, td = (float(np.median(times[name])) for name in ("topk", "dense"))
    return tk / td, tk, td


def main(argv=None):
    """``python -m attnnb.benches.sparse [--quick] [--threads T]``: the per-pair ratios."""
    argv = sys.argv[1:] if argv is None else argv
    size = QUICK if "--quick" in argv else FULL
    if "--threads" in argv:
        import numba

        numba.set_num_threads(int(argv[argv.index("--threads") + 1]))
    rounds = 3
    from numba import get_num_threads

    print(f"N={size['N']} H={size['H']} D={size['D']} fp32, cpu, {get_num_threads()} threads, "
          f"medians of {rounds} dense and {rounds * 5} sparse calls, interleaved")
    for name, (ratio, density, ts, dense) in pair_cost_ratios(
            size["N"], size["H"], size["D"], size["window"], rounds).items():
        print(f"{name:28s} density {density:.4f}  sparse {ts:8.3f} s  dense {dense:8.3f} s  "
              f"speed-up {dense / ts:6.1f}x  time per pair / dense's: {ratio:.2f}")
    n_topk = 1024 if "--quick" in argv else 4096
    ratio, tk, td = topk_dense_ratio(n_topk, size["H"], size["D"])
    print(f"topk k=64 causal N={n_topk}: topk {tk:8.3f} s  dense causal {td:8.3f} s  "
          f"time / dense's: {ratio:.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
