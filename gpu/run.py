"""The GPU harness: cuda tests on the device, then attnnb's cuda backend against PyTorch.

On a machine with an NVIDIA GPU and numba-cuda::

    python gpu/run.py                      # tests at larger shapes, then the timings
    python gpu/run.py --skip-tests         # timings only

Without a GPU, the whole harness runs end to end under Numba's CUDA
simulator at a tiny size (timings then mean nothing; PyTorch runs on the CPU)::

    python gpu/run.py --simulator-tiny

Steps: (a) ``tests/cuda_sim`` in a child pytest on the device
(``ATTNNB_CUDA_TESTS=device``, shapes scaled by ``--test-scale``); (b)
attention timings, float32, B=1, H=16, D in (64, 128), N = 1024 ... 16384,
causal and not: attnnb cuda (inputs are torch CUDA tensors, used without a
copy) against ``torch.nn.functional.scaled_dot_product_attention`` and, at
``--flex-n``, FlexAttention (compiled), timed with CUDA events after warm-up;
GFLOP/s count ``4 N^2 D H`` (half of it causal); (c) forward + backward
timings (``attnnb.vjp`` and its pullback against SDPA's forward and
``backward()``, float32 with TF32 off in both, gradients compared), GFLOP/s
counting ``3.5x`` the forward's (the backward is 2.5 forward passes of
matrix products), at ``--backward-sizes``; (d) differential attention's
forward + backward (``H / 2`` pairs of query and key heads of size D, values
of ``2 D``, ``lam = 0.5``) at ``--diff-sizes`` and the first D: the
difference mode through its two one-stream backwards (the default) and
through the two-stream kernels (the alternative, off by default), against two SDPA
calls (``o1 - lam o2``, then ``backward()``); (e) mask and score functions,
forward + backward at ``--mods-sizes`` and the first D, causal: ALiBi as a
constant ``mods.alibi`` against SDPA given the same logits as a float mask, and
8 documents as ``mods.document`` against SDPA given them as a boolean mask;
(f) full results as JSON (``--out``) and the short tables printed last.  A time
budget (``--budget``, default 7 minutes) stops starting new sizes so the run ends
within 8 minutes; after the tests, each timing step may spend only its share of what
is left (b: 45 %, c: 60 % of the rest, d: 60 % of the rest, e: all of the rest), and
the first size of every step runs whatever the
clock says, so that a slow step never leaves a later one without a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--simulator-tiny", action="store_true",
                   help="no GPU: run everything under the CUDA simulator at a tiny size")
    p.add_argument("--skip-tests", action="store_true", help="timings only")
    p.add_argument("--test-scale", type=int, default=8,
                   help="sequence-length factor for the device tests (default 8)")
    p.add_argument("--sizes", default=None, help="comma-separated N (default 1024..16384)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--dims", default=None, help="comma-separated D (default 64,128)")
    p.add_argument("--flex-n", default="4096",
                   help="N at which FlexAttention is also timed (comma-separated; '' for none)")
    p.add_argument("--backward-sizes", default=None,
                   help="comma-separated N of the forward+backward timings (default "
                        "1024,4096,8192; '' for none)")
    p.add_argument("--diff-sizes", default=None,
                   help="comma-separated N of the differential forward+backward timings "
                        "(default 4096; '' for none)")
    p.add_argument("--mods-sizes", default=None,
                   help="comma-separated N of the mask and score function timings (default "
                        "4096; '' for none)")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for everything")
    p.add_argument("--out", default=os.path.join(ROOT, "gpu", "out", "results.json"))
    args = p.parse_args(argv)
    if args.simulator_tiny:
        args.sizes = args.sizes or "8,13"
        args.heads = args.heads or 2
        args.dims = args.dims or "4,8"
        args.flex_n = ""
        args.backward_sizes = "8" if args.backward_sizes is None else args.backward_sizes
        args.diff_sizes = "8" if args.diff_sizes is None else args.diff_sizes
        args.mods_sizes = "16" if args.mods_sizes is None else args.mods_sizes
    args.sizes = [int(x) for x in (args.sizes or "1024,2048,4096,8192,16384").split(",")]
    args.dims = [int(x) for x in (args.dims or "64,128").split(",")]
    args.heads = args.heads or 16
    args.flex_n = {int(x) for x in args.flex_n.split(",") if x}
    raw = "1024,4096,8192" if args.backward_sizes is None else args.backward_sizes
    args.backward_sizes = [int(x) for x in raw.split(",") if x]
    raw = "4096" if args.diff_sizes is None else args.diff_sizes
    args.diff_sizes = [int(x) for x in raw.split(",") if x]
    raw = "4096" if args.mods_sizes is None else args.mods_sizes
    args.mods_sizes = [int(x) for x in raw.split(",") if x]
    return args


def run_tests(args) -> dict:
    """(a): the cuda tests in a child pytest, on the device or under the simulator."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.simulator_tiny:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        env["ATTNNB_CUDA_TESTS"] = "device"
        env["ATTNNB_CUDA_TEST_SCALE"] = str(args.test_scale)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(ROOT, "tests", "cuda_sim")],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-300:]
    print(f"cuda tests: {summary}", flush=True)
    if proc.returncode:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    return {"returncode": proc.returncode, "summary": summary,
            "seconds": round(time.perf_counter() - t0, 1)}


class Timer:
    """Median milliseconds per call: CUDA events on a GPU, the wall clock in the simulator."""

    def __init__(self, simulator):
        from numba import cuda

        self.cuda = cuda
        self.simulator = simulator

    def once(self, fn, reps):
        if self.simulator:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / reps
        start, end = self.cuda.event(timing=True), self.cuda.event(timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return self.cuda.event_elapsed_time(start, end) / reps

    def __call__(self, fn, target_ms=200.0):
        fn()
        fn()  # warm-up: compile, caches, clocks
        self.sync()
        first = self.once(fn, 1)
        reps = max(1, min(20, int(target_ms / max(first, 1e-3))))
        return statistics.median(self.once(fn, reps) for _ in range(3))

    def sync(self):
        if not self.simulator:
            self.cuda.synchronize()


def candidates(args, torch, n, d, causal):
    """``{label: callable}`` and the inputs; the attnnb output for the error check."""
    import attnnb

    dev = "cpu" if args.simulator_tiny else "cuda"
    g = torch.Generator(device=dev).manual_seed(n * 1000 + d)
    shape = (1, args.heads, n, d)
    q, k, v = (torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
               for _ in range(3))
    dq, dk, dv = attnnb_inputs(args, q, k, v)
    F = torch.nn.functional
    found = {
        "attnnb-cuda": lambda: attnnb.attention(dq, dk, dv, causal=causal, backend="cuda"),
        "torch-sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    if n in args.flex_n:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention)
            block = None
            if causal:
                block = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n,
                                          device=dev)
            found["torch-flex"] = lambda: flex(q, k, v, block_mask=block)
        except Exception as exc:  # older torch, no compiler: recorded, not fatal
            print(f"FlexAttention unavailable: {type(exc).__name__}: {exc}", flush=True)
    return found


def max_rel_error(a, b, torch):
    a = torch.as_tensor(a, device=b.device).double()
    b = b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def to_host(x):
    """A Numba device array's values on the host (tensors and arrays as they are)."""
    import numpy as np

    return np.asarray(x.copy_to_host()) if hasattr(x, "copy_to_host") else x


def step_deadline(args, started, share):
    """When a timing step must stop starting sizes: ``share`` of the budget still left."""
    now = time.perf_counter()
    return now + share * max(0.0, started + args.budget - now)


def sweep(args, deadline, sizes, make, error, flop_factor, causals=(False, True),
          **extra) -> list[dict]:
    """Time ``make(args, torch, n, d, causal)``'s candidates at every size (and each of
    ``causals``) until
    ``deadline`` (a ``time.perf_counter()`` value; the first size always runs);
    ``error(ours, sdpa)`` compares their results; GFLOP/s count ``flop_factor`` times
    the forward's ``4 N^2 D H`` (half of it causal)."""
    import torch

    timer = Timer(args.simulator_tiny)
    rows = []
    for d in args.dims:
        for causal in causals:
            for n in sizes:
                row = {"N": n, "H": args.heads, "D": d, "causal": causal, "dtype": "float32",
                       **extra}
                rows.append(row)
                if len(rows) > 1 and time.perf_counter() > deadline:
                    row["skipped"] = "time budget"
                    continue
                flops = flop_factor * 4.0 * n * n * d * args.heads * (0.5 if causal else 1.0)
                try:
                    fns = make(args, torch, n, d, causal)
                    ref = fns["torch-sdpa"]()
                    row["max_rel_err_vs_sdpa"] = error(fns["attnnb-cuda"](), ref, torch)
                    for label in fns:  # other attnnb routes are checked too
                        if label.startswith("attnnb-cuda-"):
                            row[f"{label}_max_rel_err_vs_sdpa"] = error(fns[label](), ref, torch)
                    for label, fn in fns.items():
                        ms = timer(fn)
                        row[f"{label}_ms"] = ms
                        row[f"{label}_gflops"] = flops / (ms * 1e6)
                    row["sdpa_over_attnnb"] = row["torch-sdpa_ms"] / row["attnnb-cuda_ms"]
                except Exception as exc:  # keep going: one failed size is a result too
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(json.dumps(row), flush=True)
    return rows


def run_timings(args, deadline) -> list[dict]:
    """(b): the forward at every size."""
    def error(out, ref, torch):
        return max_rel_error(to_host(out), ref, torch)

    return sweep(args, deadline, args.sizes, candidates, error, 1.0)


def attnnb_inputs(args, *tensors):
    """What attnnb is given: the torch CUDA tensors themselves (read in place), or under
    the simulator Numba device copies of the CPU tensors."""
    if not args.simulator_tiny:
        return tensors
    from numba import cuda

    return tuple(cuda.to_device(x.numpy()) for x in tensors)


def backward_pair(args, torch, n, d, seed, ours_kw, theirs_kw):
    """``{label: callable}`` running forward + backward on the same random inputs
    ``(1, H, n, d)``: attnnb's ``vjp`` then the pullback with ``ours_kw`` (device inputs,
    device gradients), SDPA on tensors that require grad with ``theirs_kw``, then
    ``backward()``."""
    import attnnb

    dev = "cpu" if args.simulator_tiny else "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    shape = (1, args.heads, n, d)
    q, k, v, dout = (torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
                     for _ in range(4))
    dq, dk, dv, ddout = attnnb_inputs(args, q, k, v, dout)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    F = torch.nn.functional

    def ours():
        _, pullback = attnnb.vjp(attnnb.attention, dq, dk, dv, backend="cuda", **ours_kw)
        return pullback(ddout)

    def theirs():
        for x in leaves:
            x.grad = None
        F.scaled_dot_product_attention(*leaves, **theirs_kw).backward(dout)
        return {name: x.grad for name, x in zip("qkv", leaves, strict=True)}

    return {"attnnb-cuda": ours, "torch-sdpa": theirs}


def backward_candidates(args, torch, n, d, causal):
    """Dense attention forward + backward (:func:`backward_pair`)."""
    return backward_pair(args, torch, n, d, n * 1000 + d + 1, dict(causal=causal),
                         dict(is_causal=causal))


def plain_float32(args, torch):
    """TF32 off for PyTorch's products (attnnb's are plain float32)."""
    if not args.simulator_tiny:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def run_backward_timings(args, deadline) -> list[dict]:
    """(c): forward + backward at ``--backward-sizes`` (float32, TF32 off)."""
    import torch

    plain_float32(args, torch)

    def error(ours, theirs, torch):
        return max(max_rel_error(to_host(ours[x]), theirs[x], torch) for x in "qkv")

    return sweep(args, deadline, args.backward_sizes, backward_candidates, error, 3.5,
                 **{"pass": "forward+backward"})


def diff_candidates(args, torch, n, d, causal):
    """``{label: callable}`` running differential attention forward + backward.

    attnnb: ``vjp`` of ``diff_attention`` and its pullback, the difference mode through
    the pair streams (``attnnb-cuda``, the cuda backward's production route) and through
    the two-stream kernels (``attnnb-cuda-two-streams``: its ``two_streams=True``);
    torch: ``SDPA(q1, k1, v) - lam SDPA(q2, k2, v)``.
    """
    import dataclasses
    import functools

    import attnnb
    from attnnb.vjp import run as vjp_run

    dev = "cpu" if args.simulator_tiny else "cuda"
    g = torch.Generator(device=dev).manual_seed(n * 1000 + d + 2)
    pairs = args.heads // 2  # (even: run_diff_timings)
    q, k = (torch.randn((1, 2 * pairs, n, d), generator=g, device=dev, dtype=torch.float32)
            for _ in range(2))
    v, dout = (torch.randn((1, pairs, n, 2 * d), generator=g, device=dev,
                           dtype=torch.float32) for _ in range(2))
    lam = 0.5
    dq, dk, dv, ddout = attnnb_inputs(args, q, k, v, dout)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    F = torch.nn.functional

    def ours(two_streams):
        """``vjp`` and its pullback, the pullback's backward (the cuda backend's
        ``diff_attention_vjp``) given ``two_streams`` (None: its production route)."""
        def run():
            _, saved, _ = vjp_run(attnnb.diff_attention, (dq, dk, dv, lam),
                                  {"causal": causal, "backend": "cuda"})
            backward = functools.partial(saved.backward, two_streams=two_streams)
            return dataclasses.replace(saved, backward=backward).gradients(ddout, None)
        return run

    def theirs():
        for x in leaves:
            x.grad = None
        ql, kl, vl = leaves
        o1 = F.scaled_dot_product_attention(ql[:, 0::2], kl[:, 0::2], vl, is_causal=causal)
        o2 = F.scaled_dot_product_attention(ql[:, 1::2], kl[:, 1::2], vl, is_causal=causal)
        (o1 - lam * o2).backward(dout)
        return {name: x.grad for name, x in zip("qkv", leaves, strict=True)}

    return {"attnnb-cuda": ours(None), "attnnb-cuda-two-streams": ours(True),
            "torch-sdpa": theirs}


def run_diff_timings(args, deadline) -> list[dict]:
    """(d): differential attention forward + backward at ``--diff-sizes``, the first D."""
    import torch

    plain_float32(args, torch)

    def error(ours, theirs, torch):
        return max(max_rel_error(to_host(ours[x]), theirs[x], torch) for x in "qkv")

    # whole pairs of query heads: H (the FLOP count's and the table's) is what runs
    one_d = argparse.Namespace(**{**vars(args), "dims": args.dims[:1],
                                  "heads": 2 * max(1, args.heads // 2)})
    # a pair's forward, 2 N^2 D for each stream's scores and 4 N^2 D for its values, is
    # 1.5x a D-wide head's 4 N^2 D per query head; the backward 2.5x that again
    return sweep(one_d, deadline, args.diff_sizes, diff_candidates, error, 3.5 * 1.5,
                 **{"pass": "diff forward+backward"})


def mods_candidates(kind):
    """``make(args, torch, n, d, causal)`` for ``sweep``: attnnb with one mod (``kind``
    ``"alibi"`` or ``"documents"``), forward + backward, against SDPA given the same
    logits as a materialised float or boolean mask (causal in both)."""
    def make(args, torch, n, d, causal):
        import numpy as np

        from attnnb import mods

        dev = "cpu" if args.simulator_tiny else "cuda"
        i = torch.arange(n, device=dev)
        allowed = i[None, :] <= i[:, None]
        if kind == "alibi":
            slopes = 2.0 ** -np.arange(1, args.heads + 1)
            mod = dict(score_mod=mods.constant(mods.alibi(slopes)), causal=True)
            bias = torch.as_tensor(slopes, device=dev, dtype=torch.float32)[:, None, None] * (
                i[None, :] - i[:, None]).float()
            mask = torch.where(allowed, bias, torch.tensor(float("-inf"), device=dev))
        else:
            ids = np.arange(n) * 8 // n
            mod = dict(mask_mod=mods.document(ids) & mods.causal)
            same = torch.as_tensor(ids, device=dev)
            mask = allowed & (same[:, None] == same[None, :])
        return backward_pair(args, torch, n, d, n * 1000 + d + 7, mod, dict(attn_mask=mask))
    return make


def run_mods_timings(args, deadline) -> list[dict]:
    """(e): ALiBi and 8 documents, forward + backward at ``--mods-sizes``, the first D,
    causal only (the candidates build their own causal limit)."""
    import torch

    plain_float32(args, torch)

    def error(ours, theirs, torch):
        return max(max_rel_error(to_host(ours[x]), theirs[x], torch) for x in "qkv")

    one_d = argparse.Namespace(**{**vars(args), "dims": args.dims[:1]})
    rows = []
    for kind in ("alibi", "documents"):
        rows += sweep(one_d, deadline, args.mods_sizes, mods_candidates(kind), error, 3.5,
                      causals=(True,), **{"pass": f"{kind} forward+backward"})
    return rows


def device_info(simulator) -> dict:
    info = {"python": platform.python_version(), "simulator": simulator}
    try:
        import numba
        import torch

        info.update(numba=numba.__version__, torch=torch.__version__)
        if not simulator:
            from numba import cuda

            dev = cuda.get_current_device()
            name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
            info.update(gpu=name, compute_capability=list(dev.compute_capability))
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


def table(rows) -> str:
    head = ("N", "D", "causal", "attnnb ms", "SDPA ms", "SDPA/attnnb", "attnnb GF/s",
            "flex ms", "max err")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append(f"{r['N']} | {r['D']} | {r['causal']} | "
                         f"{r.get('skipped') or r.get('error')}")
            continue
        flex = r.get("torch-flex_ms")
        lines.append(" | ".join([
            str(r["N"]), str(r["D"]), str(r["causal"]), f"{r['attnnb-cuda_ms']:.3f}",
            f"{r['torch-sdpa_ms']:.3f}", f"{r['sdpa_over_attnnb']:.2f}",
            f"{r['attnnb-cuda_gflops']:.1f}", "-" if flex is None else f"{flex:.3f}",
            f"{r['max_rel_err_vs_sdpa']:.1e}"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    if args.simulator_tiny:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before Numba is imported
    sys.path.insert(0, ROOT)
    started = time.perf_counter()
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "device": device_info(args.simulator_tiny), "args": {
                  "sizes": args.sizes, "heads": args.heads, "dims": args.dims,
                  "flex_n": sorted(args.flex_n), "simulator_tiny": args.simulator_tiny}}
    result["tests"] = None if args.skip_tests else run_tests(args)
    result["timings"] = run_timings(args, step_deadline(args, started, 0.45))
    result["backward_timings"] = run_backward_timings(args, step_deadline(args, started, 0.6))
    result["diff_timings"] = run_diff_timings(args, step_deadline(args, started, 0.6))
    result["mods_timings"] = run_mods_timings(args, step_deadline(args, started, 1.0))
    result["seconds"] = round(time.perf_counter() - started, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    dev = result["device"].get("gpu", "CUDA simulator" if args.simulator_tiny else "?")
    tests = result["tests"]["summary"] if result["tests"] else "skipped"
    print(f"\nresults: {args.out} ({result['seconds']} s)")
    print(f"device: {dev}; cuda tests: {tests}")
    print(table(result["timings"]))
    if result["backward_timings"]:
        print("\nforward + backward:")
        print(table(result["backward_timings"]))
    if result["diff_timings"]:
        print("\ndifferential attention, forward + backward (D: the score depth; values 2D):")
        print(table(result["diff_timings"]))
        for r in result["diff_timings"]:
            if "attnnb-cuda-two-streams_ms" in r:
                print(f"N = {r['N']}, causal {r['causal']}: through the two-stream kernels "
                      f"{r['attnnb-cuda-two-streams_ms']:.3f} ms, max err "
                      f"{r['attnnb-cuda-two-streams_max_rel_err_vs_sdpa']:.1e}")
    if result["mods_timings"]:
        print("\nALiBi (score function) and 8 documents (mask function), forward + backward, "
              "against SDPA with the materialised mask (rows: alibi, then documents):")
        print(table(result["mods_timings"]))
    timed = (result["timings"] + result["backward_timings"] + result["diff_timings"]
             + result["mods_timings"])
    failed = (result["tests"] or {}).get("returncode", 0) != 0
    failed |= any("error" in r for r in timed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
