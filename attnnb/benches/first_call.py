"""A new mask or score function's first calls (``python -m attnnb bench --only first_call``).

Each value is measured in a fresh process with a function that was never
compiled before (a new constant in it: contract §2.10 keys constants by
value), after one small call that loads the kernels without mods from the
disk cache (run ``python -m attnnb warmup`` first): the first ``attention``
call, then the first ``vjp`` with its pullback.  ``B = 1, H = 8, N = 1024,
D = 64`` (``quick``: ``N = 256``), float32 and float64.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

_SCRIPT = r"""
import sys, time
import numpy as np
import attnnb
kind, dtype, N, W = sys.argv[1], np.dtype(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def mask_fn(b, h, i, j):
    return (i - j) % W != 1
def score_fn(s, b, h, i, j):
    return s + (j - i) / W
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, N, 64)).astype(dtype) for _ in range(3))
kw = dict(mask_mod=mask_fn) if kind == "mask" else dict(score_mod=score_fn)
attnnb.attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], backend="cpu")
t0 = time.perf_counter()
out = attnnb.attention(q, k, v, backend="cpu", **kw)
t1 = time.perf_counter()
out, pullback = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kw)
pullback(np.ones_like(out))
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def _first_calls(kind: str, dtype: str, N: int) -> tuple[float, float]:
    env = {name: value for name, value in os.environ.items() if name != "ATTNNB_FIRST_TIER"}
    salt = str(1000 + time.time_ns() % 1_000_000)  # a constant never compiled before
    done = subprocess.run([sys.executable, "-c", _SCRIPT, kind, dtype, str(N), salt],
                          capture_output=True, text=True, env=env, check=True)
    first, then = (float(x) for x in done.stdout.split()[-2:])
    return first, then


def _case(kind: str, dtype: str, N: int) -> dict:
    seen: dict = {}

    def measure(which: int):
        def run():
            if which == 0 or "times" not in seen:
                seen["times"] = _first_calls(kind, dtype, N)
            return seen["times"][which]
        return run

    return {"name": f"first calls of a new {kind} function {dtype} B=1 H=8 N={N} D=64",
            "work": None, "measure": "value", "unit": "s", "repeats": 1,
            "candidates": {"first forward": measure(0),
                           "then first forward + backward": measure(1)}}


def cases(quick: bool) -> list[dict]:
    N = 256 if quick else 1024
    return [_case(kind, dtype, N) for kind in ("mask", "score")
            for dtype in ("float32", "float64")]
