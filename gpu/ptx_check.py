"""Compile every CUDA kernel to PTX and SASS and gate what the hardware would get.

Runs without a GPU: ``numba.cuda.compile_ptx`` needs NVRTC and ptxas runs
through nvJitLink (both from ``pip install "numba-cuda[cu13]"``).  Every
module ``attnnb.cuda.<name>`` that defines ``ptx_signatures()`` is compiled
for compute capability 9.0 with each of its signatures (float32 and float64).

The float64 builds of a kernel's variants (another head size, dropout, mods, a
normalizer or mode: ``"variant"`` in the case's options) are compiled with
``--every-float64`` only; their float32 builds, the same code, always are.

Checks, every kernel:

* a float32 kernel fails when its PTX holds any ``.f64`` instruction
  (arithmetic, or the conversions that come with it): that is a Python float
  literal, a float64 ``math`` call or an integer-float mix promoting the
  computation; a float64 kernel fails when it holds none (so that the
  detector is seen to work).

Checks, float32 kernels marked register-tiled (``"tiled": True`` in the
case's options; the performance gate):

* no stack frame and no spill stores or loads (per-thread arrays indexed by
  run-time values live in local memory: the kernel is not register-tiled);
* at most ``MAX_REGISTERS`` registers per thread (two blocks of 128 threads
  or more per SM need it);
* at least ``MIN_FMA_PER_LOAD`` ``fma.rn.f32`` per ``ld.shared`` instruction
  in the PTX (static counts: a micro-tile of ``TM x TN`` products per
  ``TM + TN`` operands loaded, wide loads counting once).

The table printed for every kernel: registers, stack frame, spill stores +
loads (bytes), FMA per shared load, threads per block, shared memory per
block (as ptxas reports it: sm_90 adds 1 KiB the system reserves).

A case is ``(name, python function, argument types)`` or the same with an
options dict ``{"threads": n, "tiled": bool, "known": why}`` as a fourth
element.  ``known`` marks a gated kernel that does not meet the gate yet:
its gate failures are printed as ``KNOWN`` with the reason and listed at the
end, and do not fail the run (a known failure that passes is reported too,
so that the mark is removed).

Usage: ``python gpu/ptx_check.py [--cc 9.0] [--show] [--jobs N] [--only TEXT]``; exit
status 1 on a failure.  ``--jobs`` processes compile the kernels at once (default: the
cores, at most 4); the output is in the same order whatever the number.  ``--only``
keeps the kernels whose name contains ``TEXT``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import sys
import time
import types

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.exit("ptx_check.py compiles real PTX: run it without NUMBA_ENABLE_CUDASIM=1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MAX_REGISTERS = 128
MIN_FMA_PER_LOAD = 4.0
F64_OP = re.compile(r"^\s*(?:@%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)\b.*\.f64\b")


def _no_device_needed(cc):
    """Device functions are compiled for the current device's capability; there is no
    device here, so report the target capability instead (this process only)."""
    import numba.cuda.dispatcher as dispatcher

    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)


def kernel_cases():
    """``[(module, name, python function, argument types)]`` of every CUDA kernel."""
    import attnnb.cuda

    cases = []
    for info in pkgutil.iter_modules(attnnb.cuda.__path__):
        module = importlib.import_module(f"attnnb.cuda.{info.name}")
        fn = getattr(module, "ptx_signatures", None)
        if fn is not None:
            cases += [(info.name,) + case for case in fn()]
    return cases


def f64_lines(ptx: str) -> list[str]:
    """PTX instructions (not declarations) that operate on or produce float64."""
    bad = []
    for line in ptx.splitlines():
        text = line.strip()
        if not text or text.startswith(("//", ".reg", ".param", ".local", ".shared")):
            continue
        if F64_OP.match(text):
            bad.append(text)
    return bad


def ptxas_figures(ptx: str, cc) -> dict:
    """``registers, stack, spill_stores, spill_loads, smem`` (bytes), as ptxas reports them.

    ptxas runs through nvJitLink (``-verbose``); with several functions in
    the module (device functions not inlined) the largest figures count.
    """
    from cuda.bindings import nvjitlink

    options = [f"-arch=sm_{cc[0]}{cc[1]}", "-verbose"]
    handle = nvjitlink.create(len(options), options)  # the count must match the list
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    finally:
        nvjitlink.destroy(handle)
    return parse_ptxas_log(log.decode(errors="replace"))


def parse_ptxas_log(text: str) -> dict:
    """The figures of a ptxas ``-verbose`` log (see :func:`ptxas_figures`)."""
    def largest(pattern):
        return max((int(x) for x in re.findall(pattern, text)), default=0)

    return {
        "registers": largest(r"[Uu]sed (\d+) registers"),
        "stack": largest(r"(\d+) bytes stack frame"),
        "spill_stores": largest(r"(\d+) bytes spill stores"),
        "spill_loads": largest(r"(\d+) bytes spill loads"),
        "smem": largest(r"(\d+) bytes smem"),
    }


def fma_per_shared_load(ptx: str) -> tuple[int, int]:
    """``(fma.rn.f32 count, ld.shared count)`` of the PTX's instructions."""
    fma = len(re.findall(r"^\s*(?:@!?%p\d+\s+)?fma\.rn\.f32\b", ptx, re.M))
    loads = len(re.findall(r"^\s*(?:@!?%p\d+\s+)?ld\.shared\b", ptx, re.M))
    return fma, loads


def gate_failures(name: str, figures: dict, fma: int, loads: int) -> list[str]:
    """Why a register-tiled float32 kernel is not fast by construction (empty: it passes)."""
    why = []
    if figures["stack"] or figures["spill_stores"] or figures["spill_loads"]:
        why.append(f"{figures['stack']} bytes stack frame, {figures['spill_stores']} / "
                   f"{figures['spill_loads']} bytes spill stores / loads")
    if figures["registers"] > MAX_REGISTERS:
        why.append(f"{figures['registers']} registers > {MAX_REGISTERS}")
    if fma < MIN_FMA_PER_LOAD * max(loads, 1):
        why.append(f"{fma} fma.rn.f32 per {loads} ld.shared < {MIN_FMA_PER_LOAD}")
    return why


_WORKER_CASES: list = []


def _start_worker(cc) -> None:
    """A worker process: no device, and the kernel cases listed once."""
    _no_device_needed(cc)
    _WORKER_CASES[:] = kernel_cases()


def examine(index: int, cc) -> dict:
    """Compile case ``index`` of :func:`kernel_cases` and take its figures (in a worker).

    Returns ``{"error"}`` when it does not compile, else the PTX line count, its
    float64 lines, ptxas's figures, the FMA and shared-load counts and the seconds.
    """
    from numba import cuda

    _module, _name, pyfunc, argtypes, *_ = _WORKER_CASES[index]
    t0 = time.perf_counter()
    try:
        ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=cc)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    fma, loads = fma_per_shared_load(ptx)
    return {"lines": len(ptx.splitlines()), "f64": f64_lines(ptx),
            "figures": ptxas_figures(ptx, cc), "fma": fma, "loads": loads,
            "seconds": time.perf_counter() - t0}


def examine_all(indices: list, cc, jobs: int):
    """:func:`examine` of the cases at ``indices``, in order: ``jobs`` processes compile at
    once (the cases are independent; NVRTC and ptxas are single-threaded)."""
    if jobs <= 1:
        _start_worker(cc)
        return [examine(i, cc) for i in indices]
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # no state inherited from this process
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context,
                                                initializer=_start_worker,
                                                initargs=(cc,)) as pool:
        return list(pool.map(examine, indices, [cc] * len(indices)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="9.0", help="compute capability (default 9.0)")
    parser.add_argument("--show", action="store_true", help="print offending PTX lines")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="processes compiling at once (default: the cores, at most 4)")
    parser.add_argument("--only", default="", metavar="TEXT",
                        help="only the kernels whose name contains TEXT (while working on them)")
    parser.add_argument("--every-float64", action="store_true",
                        help="compile the float64 builds of the variants too")
    args = parser.parse_args(argv)
    cc = tuple(int(x) for x in args.cc.split("."))
    _no_device_needed(cc)

    failures = 0
    known, fixed = [], []
    every = kernel_cases()
    indices = [i for i, case in enumerate(every) if args.only in case[1] and (
        args.every_float64 or not (case[4:] and case[4].get("variant")))]
    cases = [every[i] for i in indices]
    if not cases:
        print("no CUDA kernels found")
        return 1
    table = []
    results = examine_all(indices, cc, args.jobs)
    for (module, name, _pyfunc, _argtypes, *rest), result in zip(cases, results):
        options = rest[0] if rest else {}
        if "error" in result:
            failures += 1
            print(f"FAIL {module}: {name}: does not compile: {result['error']}")
            continue
        f64 = result["f64"]
        if "float32" in name:
            bad, extra = f64, f" ({len(f64)} float64 instructions)" if f64 else ""
        else:  # the detector itself must see a float64 kernel's arithmetic
            bad = [] if f64 else ["no float64 instruction found in a float64 kernel"]
            extra = f" ({len(f64)} float64 instructions, as expected)"
        figures, fma, loads = result["figures"], result["fma"], result["loads"]
        tiled = bool(options.get("tiled")) and "float32" in name
        gate = gate_failures(name, figures, fma, loads) if tiled else []
        known_why = options.get("known") if tiled else None
        if gate and known_why:
            known.append(f"{name}: {known_why}")
            status = "KNOWN"
        else:
            status = "FAIL" if bad or gate else "ok"
            failures += bool(bad or gate)
            if known_why:
                fixed.append(name)
        print(f"{status:4} {module}: {name}: {result['lines']} PTX lines, "
              f"{result['seconds']:.2f} s{extra}")
        for why in gate:
            print(f"     gate: {why}")
        if bad and args.show:
            print("\n".join("     " + b for b in bad[:20]))
        ratio = f"{fma / loads:.1f}" if loads else "-"
        spill = f"{figures['spill_stores']}/{figures['spill_loads']}"
        table.append((name, figures["registers"], figures["stack"], spill, ratio,
                      options.get("threads", "-"), figures["smem"],
                      ("known failure" if known_why and gate else "yes") if tiled else ""))
    print_table(table)
    for line in known:
        print(f"known gate failure: {line}")
    for name in fixed:
        print(f"marked as a known failure but passes the gate now: {name}")
    skipped = "" if args.every_float64 else (
        f"; {sum(1 for case in every if case[4:] and case[4].get('variant'))} float64 builds "
        "of variants not compiled (--every-float64)")
    print(f"{len(cases) - failures - len(known)} of {len(cases)} kernels passed, "
          f"{len(known)} known gate failures (cc {args.cc}){skipped}")
    return 1 if failures else 0


def print_table(rows) -> None:
    """The figures of every kernel as a Markdown table (pasted into gpu/RESULTS.md)."""
    head = ("kernel", "registers", "stack", "spill st/ld", "FMA/ld.shared", "threads",
            "smem bytes", "gated")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")


if __name__ == "__main__":
    sys.exit(main())
