"""The command line: ``python -m attnnb {info,check,bench,warmup}`` (also ``attnnb ...``).

* ``info``  -- versions, backends (with reasons), Numba threading layer and
  thread count, CUDA device.
* ``check`` -- every case of every module in :mod:`attnnb.checks` on every
  available backend against ``"reference"``; a table of errors and times;
  exit status 1 on any failure.  The engine (comparison, tolerances, table)
  is :mod:`attnnb.check`.  When the cpu backend is checked, its kernels are
  first compiled in several processes at once (``warmup``'s engine).
* ``bench`` -- hands its arguments to ``attnnb.bench.main``.
* ``warmup`` -- compiles every cpu kernel into the on-disk cache, several
  processes at once; the engine is :mod:`attnnb.warmup`.

This module parses the arguments and calls the engines.  Heavy modules
(Numba, the check cases, the benchmarks) are imported only by the
subcommand that needs them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

import numpy as np

from . import check, warmup
from .check import compare, discover_cases  # noqa: F401  (part of this module's interface)

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


def cmd_check(args) -> int:
    """``check``: the engine is :mod:`attnnb.check`; usage errors exit with status 2."""
    try:
        targets = check.select_backends(args.backend)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cases = discover_cases(args.only)
    if not cases:
        print("error: no check case matches", file=sys.stderr)
        return 2
    jobs = warmup.default_jobs() if args.jobs is None else args.jobs
    if "cpu" in targets and jobs > 1:  # compile in parallel; the table then loads the kernels
        print(warmup.run(cases, jobs=jobs).line(), flush=True)
    return check.run_cases(cases, targets)


# ---------------------------------------------------------------- warmup


def cmd_warmup(args) -> int:
    """``warmup``: the engine is :mod:`attnnb.warmup`; usage errors exit with status 2."""
    cases = discover_cases(args.only)
    if not cases:
        print("error: no warmup case matches", file=sys.stderr)
        return 2
    if args.list:
        for module, name, _ in cases:
            print(f"{module:<10} {name}")
        return 0
    summary = warmup.run(None if args.only is None else cases, jobs=args.jobs)
    print(summary.line())
    if args.times:
        for k in sorted(summary.kernels, key=lambda k: -k.seconds):
            print(f"  {k.seconds:6.1f} s  {'loaded' if k.loaded else 'compiled':<8}  {k.label}")
    for name in summary.unreached:
        print(f"note: no case called the kernel {name}", file=sys.stderr)
    for name, error in summary.failures:
        print(f"error: case {name!r} failed: {error}", file=sys.stderr)
    return 1 if summary.failures else 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


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
    sub = parser.add_subparsers(dest="command", metavar="{info,check,bench,warmup}")
    sub.add_parser("info", help="versions, backends, threading layer, CUDA device")
    check_parser = sub.add_parser("check",
                                  help="every function on every backend against reference")
    check_parser.add_argument(
        "--backend", action="append", metavar="NAME",
        help="check only this backend (repeatable); default: all available")
    check_parser.add_argument(
        "--only", action="append", metavar="TEXT",
        help="run only cases whose name contains TEXT (or whose module is TEXT); repeatable")
    check_parser.add_argument(
        "--jobs", type=_positive_int, metavar="N",
        help="compile the cpu kernels first in N processes (default: one per CPU; "
             "1: compile each on its first call instead)")
    sub.add_parser("bench", help="speed and memory against NumPy (and PyTorch)",
                   add_help=False)
    warmup_parser = sub.add_parser(
        "warmup", help="compile every cpu kernel into the on-disk cache")
    warmup_parser.add_argument(
        "--jobs", type=_positive_int, metavar="N",
        help="processes compiling at once (default: one per CPU)")
    warmup_parser.add_argument(
        "--only", action="append", metavar="TEXT",
        help="only the check cases whose name contains TEXT (or whose module is TEXT); "
             "repeatable")
    warmup_parser.add_argument(
        "--list", action="store_true", help="list the cases that would run, compile nothing")
    warmup_parser.add_argument(
        "--times", action="store_true", help="also print each kernel's time, slowest first")
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
    if args.command == "warmup":
        return cmd_warmup(args)
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
