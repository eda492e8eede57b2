"""Benchmarks of :func:`attnnb.attention`: speed, memory and start-up.

Speed: float32, B=1, H=8, D=64, N = 1024, 2048, 4096 (``quick``: 256, 512),
causal and not, for attnnb's ``cpu`` backend, plain NumPy (matmul, softmax,
matmul: the whole ``(N, N)`` score matrix) and, when importable, PyTorch's
``F.scaled_dot_product_attention`` on the CPU with as many threads as Numba.

Memory: the growth of peak RSS over one causal call with N = 32768, one
head, D = 64 (``quick``: N = 8192), measured in a fresh subprocess (a
float32 score matrix would take 4 GiB).  On Linux the peak (``VmHWM``) is
reset to the current RSS just before the call (``/proc/self/clear_refs``),
because loading Numba peaks higher than the call itself.

Start-up, each in a fresh subprocess: ``import attnnb``; the first call when
Numba's on-disk cache is warm; the first call with an empty cache (a
temporary ``NUMBA_CACHE_DIR``: the cold compile).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np

import attnnb

D = 64
HEADS = 8


def attention_flops(b, h, lq, lk, d, dv, causal):
    """Multiply-adds of ``QK^T`` and ``PV`` counted as 2 flops, over allowed pairs."""
    if causal:
        diag = lk - lq
        pairs = sum(max(0, min(lk, i + diag + 1)) for i in range(lq))
    else:
        pairs = lq * lk
    return 2.0 * b * h * pairs * (d + dv)


def numpy_attention(q, k, v, causal):
    """Plain NumPy attention (materialises the scores), float32 throughout."""
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    s *= np.float32(1.0 / np.sqrt(q.shape[-1]))
    if causal:
        lq, lk = s.shape[-2:]
        s[..., np.triu(np.ones((lq, lk), bool), k=lk - lq + 1)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v)


def _torch():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, None
    try:
        import numba

        torch.set_num_threads(numba.get_num_threads())
    except Exception:  # pragma: no cover - numba is a dependency
        pass
    return torch, F


def _speed_cases(sizes):
    torch, F = _torch()
    rng = np.random.default_rng(0)
    cases = []
    for causal in (False, True):
        for n in sizes:
            q, k, v = (rng.standard_normal((1, HEADS, n, D)).astype(np.float32) for _ in range(3))
            cands = {
                "attnnb-cpu": (lambda q=q, k=k, v=v, c=causal:
                               attnnb.attention(q, k, v, causal=c, backend="cpu")),
                "numpy": lambda q=q, k=k, v=v, c=causal: numpy_attention(q, k, v, c),
            }
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
                cands["torch"] = (lambda tq=tq, tk=tk, tv=tv, c=causal:
                                  F.scaled_dot_product_attention(tq, tk, tv, is_causal=c))
            cases.append({
                "name": f"attention f32 B=1 H={HEADS} N={n} D={D}{' causal' if causal else ''}",
                "work": attention_flops(1, HEADS, n, n, D, D, causal),
                "candidates": cands,
            })
    return cases


# The start of every memory-measuring script: imports, /proc/self/status reader, size.
MEMORY_PREAMBLE = r"""
import resource, sys
import numpy as np
import attnnb

def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])

n = int(sys.argv[1])
rng = np.random.default_rng(0)
"""

_MEMORY_SCRIPT = MEMORY_PREAMBLE + r"""
small = rng.standard_normal((1, 1, 130, 64)).astype(np.float32)
attnnb.attention(small, small, small, causal=True, backend="cpu")  # load the kernel
q, k, v = (rng.standard_normal((1, 1, n, 64)).astype(np.float32) for _ in range(3))
try:  # Linux: reset the high-water mark to the current RSS (loading Numba peaks higher)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS")
    out = attnnb.attention(q, k, v, causal=True, backend="cpu")
    print((status_kib("VmHWM") - before) / 1024.0)
except OSError:  # elsewhere: growth of the peak since start (a lower bound)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = attnnb.attention(q, k, v, causal=True, backend="cpu")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1.0 if sys.platform == "darwin" else 1024.0  # bytes on macOS, KiB elsewhere
    print((after - before) * scale / 2**20)
"""

_IMPORT_SCRIPT = r"""
import time
t = time.perf_counter()
import attnnb
dt = time.perf_counter() - t
import sys
assert "numba" not in sys.modules, "import attnnb loaded numba"
print(dt)
"""

_FIRST_CALL_SCRIPT = r"""
import time
import numpy as np
import attnnb
q = np.random.default_rng(0).standard_normal((1, 2, 100, 64)).astype(np.float32)
t = time.perf_counter()
attnnb.attention(q, q, q, backend="cpu")
print(time.perf_counter() - t)
"""


def timed_tail(call: str, rounds: str, warmup: int = 2) -> str:
    """The closing lines of a benchmark script: ``call()`` ``warmup`` times untimed, then
    ``rounds`` (a name the script defines) timed calls, and the median printed in ms.
    The script imports ``time`` and ``numpy as np``."""
    return f"""
for _ in range({warmup}):
    {call}()
times = []
for _ in range({rounds}):
    t = time.perf_counter()
    {call}()
    times.append(time.perf_counter() - t)
print(1e3 * float(np.median(times)))
"""


def run_python(script, *args, env=None):
    """Run ``script`` in a fresh interpreter; return the float it prints last."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    res = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=full_env,
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"benchmark subprocess failed: {res.stderr.strip()[-500:]}")
    return float(res.stdout.strip().splitlines()[-1])


def peak_rss_growth_mib(n):
    """Peak-RSS growth (MiB) over one causal call, N=n, one head, D=64, fresh process."""
    return run_python(_MEMORY_SCRIPT, n)


def import_seconds():
    return run_python(_IMPORT_SCRIPT)


def first_call_seconds(cold=False):
    """First cpu call in a fresh process; ``cold``: with an empty Numba cache."""
    if not cold:
        run_python(_FIRST_CALL_SCRIPT)  # make sure the on-disk cache is warm
        return run_python(_FIRST_CALL_SCRIPT)
    with tempfile.TemporaryDirectory() as tmp:
        return run_python(_FIRST_CALL_SCRIPT, env={"NUMBA_CACHE_DIR": tmp})


def cases(quick: bool) -> list[dict]:
    sizes = (256, 512) if quick else (1024, 2048, 4096)
    mem_n = 8192 if quick else 32768
    out = _speed_cases(sizes)
    out.append({
        "name": f"peak RSS growth, causal N={mem_n} H=1 D=64 f32", "work": None,
        "measure": "value", "unit": "MiB", "repeats": 1, "target": "< 256 MiB",
        "candidates": {"attnnb-cpu": lambda: peak_rss_growth_mib(mem_n)},
    })
    out.append({
        "name": "import attnnb", "work": None, "measure": "value", "unit": "s",
        "repeats": 1 if quick else 3, "target": "<= 0.3 s",
        "candidates": {"attnnb": import_seconds},
    })
    out.append({
        "name": "first cpu call, warm on-disk cache", "work": None, "measure": "value",
        "unit": "s", "repeats": 1 if quick else 3, "target": "<= 0.5 s",
        "candidates": {"attnnb-cpu": first_call_seconds},
    })
    out.append({
        "name": "first cpu call, empty cache (cold compile)", "work": None,
        "measure": "value", "unit": "s", "repeats": 1,
        "candidates": {"attnnb-cpu": lambda: first_call_seconds(cold=True)},
    })
    return out
