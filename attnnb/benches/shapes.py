"""Benchmark cases over the shapes people run (see ``python -m attnnb bench``).

Dense float32 attention through the ``cpu`` backend against PyTorch's
``F.scaled_dot_product_attention`` (skipped without torch), forward and
forward + backward (:func:`attnnb.vjp` against ``torch.autograd.grad``):

* head sizes ``D`` in :data:`HEAD_SIZES` at ``B = 1, H = 8, N = 2048``
  (``D = 32`` with ``H = 16``, as small models run it; ``quick``: N = 256);
* a ViT-B/16 batch: ``B = 32, H = 6, N = 197, D = 64`` (a ViT-S layer;
  ``quick``: B = 4);
* decoding: ``Lq`` in (1, 16) queries against ``Lk`` in (4096, 32768) keys,
  ``B = 1, H = 8, D = 64`` (``quick``: Lk = 1024), every query seeing every
  key.  Not causal: with ``Lq != Lk`` PyTorch's ``is_causal`` aligns the
  mask to the top left (query 0 sees key 0 only), attnnb's to the bottom
  right (the last query sees every key), so a causal comparison would time
  different problems.

In the engine's table the ratio on the torch row is torch's time over
attnnb's (``> 1``: attnnb is faster), from interleaved, settled calls in
one process.  The fair comparison runs each candidate alone in a fresh
process, alternating (PyTorch's spinning OpenMP threads slow what runs next
in the same process): ``python -m attnnb.benches.shapes [--quick]
[--rounds R]`` does that and prints a Markdown table of the ratios.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np

import attnnb

from .attention import _torch, attention_flops

HEAD_SIZES = (16, 32, 40, 64, 80, 96, 128, 160, 256)


def _heads(d):
    return 16 if d == 32 else 8


def shape_list(quick: bool) -> list[tuple[str, tuple[int, int, int, int, int, bool]]]:
    """``(tag, (B, H, Lq, Lk, D, causal))`` of every case."""
    n = 256 if quick else 2048
    shapes = [(f"D={d} H={_heads(d)} N={n}", (1, _heads(d), n, n, d, False))
              for d in HEAD_SIZES]
    batch = 4 if quick else 32
    shapes.append((f"ViT B={batch} H=6 N=197 D=64", (batch, 6, 197, 197, 64, False)))
    for lk in ((1024,) if quick else (4096, 32768)):
        for lq in (1, 16):
            shapes.append((f"decode Lq={lq} Lk={lk} H=8 D=64", (1, 8, lq, lk, 64, False)))
    return shapes


def _forward_backward(q, k, v, do, causal):
    _, pullback = attnnb.vjp(attnnb.attention, q, k, v, causal=causal, backend="cpu")
    return pullback(do)


def cases(quick: bool) -> list[dict]:
    torch, F = _torch()
    rng = np.random.default_rng(0)
    out = []
    for tag, (b, h, lq, lk, d, causal) in shape_list(quick):
        q = rng.standard_normal((b, h, lq, d)).astype(np.float32)
        k, v = (rng.standard_normal((b, h, lk, d)).astype(np.float32) for _ in range(2))
        do = rng.standard_normal(q.shape).astype(np.float32)
        work = attention_flops(b, h, lq, lk, d, d, causal)
        fwd = {"attnnb-cpu": (lambda q=q, k=k, v=v, c=causal:
                              attnnb.attention(q, k, v, causal=c, backend="cpu"))}
        both = {"attnnb-cpu": lambda q=q, k=k, v=v, do=do, c=causal:
                _forward_backward(q, k, v, do, c)}
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
            gq, gk, gv = (x.clone().requires_grad_() for x in (tq, tk, tv))
            tdo = torch.from_numpy(do)

            def sdpa(tq=tq, tk=tk, tv=tv, c=causal):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=c)

            def sdpa_grad(gq=gq, gk=gk, gv=gv, tdo=tdo, c=causal):
                res = F.scaled_dot_product_attention(gq, gk, gv, is_causal=c)
                return torch.autograd.grad(res, (gq, gk, gv), tdo)

            fwd["torch"] = sdpa
            both["torch"] = sdpa_grad
        out.append({"name": f"shapes fwd {tag}", "work": work, "candidates": fwd})
        out.append({"name": f"shapes fwd+bwd {tag}", "work": 3.5 * work, "candidates": both})
    return out


# One candidate alone in a fresh process: build the inputs of shape ``index``, call once
# (compile, or load from the cache), then time calls for about a second; print the median.
_ALONE = r"""
import sys, time
import numpy as np
from attnnb.benches.shapes import shape_list
candidate, what, index, quick = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
b, h, lq, lk, d, causal = shape_list(quick)[index][1]
rng = np.random.default_rng(0)
q = rng.standard_normal((b, h, lq, d)).astype(np.float32)
k, v = (rng.standard_normal((b, h, lk, d)).astype(np.float32) for _ in range(2))
do = rng.standard_normal(q.shape).astype(np.float32)
if candidate == "torch":
    import numba, torch
    import torch.nn.functional as F
    torch.set_num_threads(numba.get_num_threads())
    tq, tk, tv = (torch.from_numpy(a).requires_grad_(what == "both") for a in (q, k, v))
    tdo = torch.from_numpy(do)
    def call():
        if what == "fwd":
            with torch.no_grad():
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        return torch.autograd.grad(out, (tq, tk, tv), tdo)
else:
    import attnnb
    def call():
        if what == "fwd":
            return attnnb.attention(q, k, v, causal=causal, backend="cpu")
        _, pullback = attnnb.vjp(attnnb.attention, q, k, v, causal=causal, backend="cpu")
        return pullback(do)
call()
times, start = [], time.perf_counter()
while len(times) < 3 or (time.perf_counter() - start < 1.0 and len(times) < 50):
    t = time.perf_counter()
    call()
    times.append(time.perf_counter() - t)
print(float(np.median(times)))
"""


def time_alone(candidate: str, what: str, index: int, quick: bool) -> float:
    """Median seconds of one call of ``candidate`` ("attnnb" or "torch") on shape
    ``index`` of :func:`shape_list`, ``what`` "fwd" or "both", in a fresh process."""
    res = subprocess.run([sys.executable, "-c", _ALONE, candidate, what, str(index),
                          "1" if quick else "0"], capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def alternate(quick: bool, rounds: int, match: str = "") -> list[tuple[str, str, list[float]]]:
    """``(tag, what, ratios)``: torch's time over attnnb's for every shape whose tag
    contains ``match``, forward and forward + backward, each candidate alone in a
    fresh process, the two alternating, ``rounds`` times over the whole list (so that
    a slow spell of the machine is spread)."""
    shapes = shape_list(quick)
    ratios: dict[tuple[int, str], list[float]] = {}
    for _ in range(rounds):
        for index in range(len(shapes)):
            if match not in shapes[index][0]:
                continue
            for what in ("fwd", "both"):
                mine = time_alone("attnnb", what, index, quick)
                theirs = time_alone("torch", what, index, quick)
                ratios.setdefault((index, what), []).append(theirs / mine)
    return [(shapes[i][0], what, r) for (i, what), r in ratios.items()]


def machine_caption() -> str:
    """One line naming what a table ran on: the CPU (vendor, family, model, name), its
    logical cores, the date (UTC) and the PyTorch release it was compared against."""
    import datetime
    import os
    import platform

    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = info.get("model name") or platform.processor() or platform.machine()
    family = (f" (family {info['cpu family']}, model {info['model']})"
              if "cpu family" in info and "model" in info else "")
    try:
        import torch

        versus = f"PyTorch {torch.__version__}"
    except ImportError:
        versus = "no PyTorch"
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return f"{cpu}{family}, {os.cpu_count()} logical cores, {day}, against {versus}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m attnnb.benches.shapes",
        description="SDPA time / attnnb time per shape, candidates alone in fresh processes")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the shapes")
    parser.add_argument("--match", default="", help="only the shapes whose name contains this")
    args = parser.parse_args(argv)
    rows = alternate(args.quick, args.rounds, args.match)
    print(f"SDPA time / attnnb time (float32, cpu backend; {args.rounds} rounds, each "
          f"candidate alone in a fresh process): {machine_caption()}\n")
    print("| shape | forward | forward + backward |")
    print("|---|---|---|")
    by_tag: dict[str, dict[str, list[float]]] = {}
    for tag, what, r in rows:
        by_tag.setdefault(tag, {})[what] = r
    for tag, cols in by_tag.items():
        cells = [" / ".join(f"{x:.2f}" for x in cols[w]) for w in ("fwd", "both")]
        print(f"| {tag} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
