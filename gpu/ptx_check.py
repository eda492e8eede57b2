"""Compile every CUDA kernel to PTX and check that float32 kernels do float32 arithmetic.

Runs without a GPU: ``numba.cuda.compile_ptx`` needs NVRTC only
(``pip install "numba-cuda[cu13]"``).  Every module ``attnnb.cuda.<name>``
that defines ``ptx_signatures()`` is compiled for compute capability 9.0
with each of its signatures (float32 and float64).  A float32 kernel fails
the check when its PTX holds any ``.f64`` instruction (arithmetic, or the
conversions that come with it): that is a Python float literal, a float64
``math`` call or an integer-float mix promoting the computation.

Usage: ``python gpu/ptx_check.py [--cc 9.0] [--show]``; exit status 1 on a failure.
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="9.0", help="compute capability (default 9.0)")
    parser.add_argument("--show", action="store_true", help="print offending PTX lines")
    args = parser.parse_args(argv)
    cc = tuple(int(x) for x in args.cc.split("."))
    _no_device_needed(cc)
    from numba import cuda

    failures = 0
    cases = kernel_cases()
    if not cases:
        print("no CUDA kernels found")
        return 1
    for module, name, pyfunc, argtypes in cases:
        t0 = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=cc)
        except Exception as exc:
            failures += 1
            print(f"FAIL {module}: {name}: does not compile: {type(exc).__name__}: {exc}")
            continue
        f64 = f64_lines(ptx)
        if "float32" in name:
            bad, extra = f64, f" ({len(f64)} float64 instructions)" if f64 else ""
        else:  # the detector itself must see a float64 kernel's arithmetic
            bad = [] if f64 else ["no float64 instruction found in a float64 kernel"]
            extra = f" ({len(f64)} float64 instructions, as expected)"
        status = "FAIL" if bad else "ok"
        failures += bool(bad)
        print(f"{status:4} {module}: {name}: {len(ptx.splitlines())} PTX lines, "
              f"{time.perf_counter() - t0:.2f} s{extra}")
        if bad and args.show:
            print("\n".join("     " + b for b in bad[:20]))
    print(f"{len(cases) - failures} of {len(cases)} kernels passed (cc {args.cc})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
