"""The command line: ``python -m attnnb {info,check,bench}`` (also ``attnnb ...``).

* ``info``  -- versions, backends (with reasons), Numba threading layer and
  thread count, CUDA device.
* ``check`` -- every case of every module in :mod:`attnnb.checks` on every
  available backend against ``"reference"``; a table of errors and times;
  exit status 1 on any failure.
* ``bench`` -- hands its arguments to ``attnnb.bench.main``.

Heavy modules (Numba, the checks, the benchmarks) are imported only by the
subcommand that needs them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import pkgutil
import sys
import time

import numpy as np

_DISTRIBUTIONS = ("attnnb", "numpy", "scipy", "numba", "llvmlite", "numba-cuda", "tbb", "torch")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _threading_facts() -> tuple[str, int]:
    """Numba's threading layer (after a tiny parallel call) and thread count."""
    import numba

    import attnnb.cpu  # noqa: F401  (selects the threading layer before the first call)

    @numba.njit(parallel=True, cache=False)
    def _tiny(n):
        acc = np.zeros(n)
        for i in numba.prange(n):
            acc[i] = i
        return acc.sum()

    _tiny(4)
    return numba.threading_layer(), numba.get_num_threads()


def cmd_info(args) -> int:
    import attnnb

    print(f"attnnb {attnnb.__version__}  (Python {sys.version.split()[0]}, {sys.platform})")
    for dist in _DISTRIBUTIONS[1:]:
        ver = _version(dist)
        print(f"  {dist:<11} {ver if ver is not None else 'not installed'}")
    print("backends:")
    avail = attnnb.backends()
    for name, (ok, why) in avail.items():
        print(f"  {name:<10} {'yes' if ok else 'no ':<4} {why}")
    try:
        layer, threads = _threading_facts()
        print(f"numba threading layer: {layer}, threads: {threads}")
    except Exception as exc:  # report, do not crash: info is for diagnosing
        print(f"numba threading layer: unknown ({type(exc).__name__}: {exc})")
    ok, why = avail["cuda"]
    print(f"CUDA device: {why if ok else 'none (' + why + ')'}")
    return 0


# ---------------------------------------------------------------- check


def discover_cases(only: str | None = None):
    """``[(module, name, run)]`` from every module of :mod:`attnnb.checks`."""
    import attnnb.checks as pkg

    found = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, run in module.cases():
            if only is None or only in name or only == info.name:
                found.append((info.name, name, run))
    return found


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def compare(actual, expected) -> tuple[float, float]:
    """``(max relative error, tolerance)`` of ``actual`` against ``expected``.

    Errors are relative to the largest finite magnitude of each expected
    array; NaN/Inf in different places, or a shape/dtype mismatch, is an
    infinite error.
    """
    from .checks import TOLERANCE

    actual, expected = _as_tuple(actual), _as_tuple(expected)
    if len(actual) != len(expected):
        return float("inf"), 0.0
    worst, tol = 0.0, float("inf")
    for a, e in zip(actual, expected, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        tol = min(tol, TOLERANCE.get(e.dtype, 1e-10))
        if a.shape != e.shape or a.dtype != e.dtype:
            return float("inf"), tol
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        if not (np.array_equal(np.isnan(a64), np.isnan(e64))
                and np.array_equal(a64[np.isinf(e64)], e64[np.isinf(e64)])
                and np.array_equal(np.isinf(a64), np.isinf(e64))):
            return float("inf"), tol
        fin = np.isfinite(e64)
        if fin.any():
            scale = max(np.abs(e64[fin]).max(), 1e-300)
            worst = max(worst, float(np.abs(a64[fin] - e64[fin]).max() / scale))
    return worst, tol


def _timed(run, backend):
    t0 = time.perf_counter()
    result = run(backend)
    return result, time.perf_counter() - t0


def cmd_check(args) -> int:
    import attnnb

    avail = attnnb.backends()
    if args.backend:
        for name in args.backend:
            if name not in avail:
                print(f"error: unknown backend {name!r}; expected one of {tuple(avail)}",
                      file=sys.stderr)
                return 2
            if not avail[name][0]:
                print(f"error: backend {name!r} is not available: {avail[name][1]}",
                      file=sys.stderr)
                return 2
        targets = list(dict.fromkeys(args.backend))  # reference vs itself is allowed
    else:
        targets = [n for n, (ok, _) in avail.items() if ok and n != "reference"]
        for name, (ok, why) in avail.items():
            if not ok:
                print(f"note: backend {name!r} skipped: {why}")
    cases = discover_cases(args.only)
    if not cases:
        print("error: no check case matches", file=sys.stderr)
        return 2
    width = max(len(name) for _, name, _ in cases)
    print(f"{'case':<{width}}  {'backend':<9}  {'max rel err':>11}  {'tolerance':>9}  "
          f"{'time':>8}  result")
    failures = skipped = passed = 0
    for _, name, run in cases:
        try:
            expected, t_ref = _timed(run, "reference")
        except Exception as exc:
            print(f"{name:<{width}}  {'reference':<9}  {'':>11}  {'':>9}  {'':>8}  "
                  f"FAIL ({type(exc).__name__}: {exc})")
            failures += 1
            continue
        for backend in targets:
            try:
                actual, t = _timed(run, backend)
            except NotImplementedError as exc:
                print(f"{name:<{width}}  {backend:<9}  {'':>11}  {'':>9}  {'':>8}  "
                      f"skipped ({exc})")
                skipped += 1
                continue
            except Exception as exc:
                print(f"{name:<{width}}  {backend:<9}  {'':>11}  {'':>9}  {'':>8}  "
                      f"FAIL ({type(exc).__name__}: {exc})")
                failures += 1
                continue
            err, tol = compare(actual, expected)
            ok = err <= tol
            failures += not ok
            passed += ok
            print(f"{name:<{width}}  {backend:<9}  {err:>11.2e}  {tol:>9.0e}  "
                  f"{t * 1e3:>6.1f}ms  {'OK' if ok else 'FAIL'}", flush=True)
    print(f"{passed} passed, {failures} failed" + (f", {skipped} skipped" if skipped else ""))
    print("(times include compiling or loading each kernel on its first call)")
    return 1 if failures else 0


# ---------------------------------------------------------------- bench


def cmd_bench(args, rest) -> int:
    try:
        bench = importlib.import_module("attnnb.bench")
    except ModuleNotFoundError as exc:
        if exc.name not in ("attnnb.bench",):
            raise
        print("error: the benchmark module attnnb.bench is not part of this installation",
              file=sys.stderr)
        return 2
    return int(bench.main(rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnnb", description="attnnb: attention kernels for NumPy and GPU arrays")
    sub = parser.add_subparsers(dest="command", metavar="{info,check,bench}")
    sub.add_parser("info", help="versions, backends, threading layer, CUDA device")
    check = sub.add_parser("check", help="every function on every backend against reference")
    check.add_argument("--backend", action="append", metavar="NAME",
                       help="check only this backend (repeatable); default: all available")
    check.add_argument("--only", metavar="TEXT",
                       help="run only cases whose name contains TEXT (or whose module is TEXT)")
    sub.add_parser("bench", help="speed and memory against NumPy (and PyTorch)",
                   add_help=False)
    return parser


def main(argv=None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "bench":  # everything after "bench" belongs to attnnb.bench
        return cmd_bench(None, argv[1:])
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "check":
        return cmd_check(args)
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
