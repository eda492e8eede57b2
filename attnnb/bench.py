"""The engine behind ``python -m attnnb bench``.

Discovers every module of :mod:`attnnb.benches` (the convention is in its
docstring), runs their cases and prints one table: for each case and
candidate the median time, the time ratio against the case's first
candidate (``> 1``: the first candidate is faster), GFLOP/s and GFLOP/s as a
share of this machine's sgemm rate, measured in the same run (``np.dot`` of
two 2048 x 2048 float32 matrices).

Candidates of a case are timed interleaved (one call of each in turn, after
one untimed warm-up call each, which also compiles), so that a busy machine
slows them alike; the table shows medians.  Each timed call of a short
candidate follows an untimed call of the same candidate, so that it does
not pay for the previous candidate's spinning threads.  A case takes at least
``repeats`` rounds and then more, up to ``MAX_ROUNDS_FACTOR * repeats``,
until its rounds have run for ``budget`` seconds: on a shared two-core
machine one call of a 30 ms kernel varies by +-20 % from call to call, so a
ratio near 1 needs dozens of rounds, while a multi-second call needs few.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time

import numpy as np

from ._tools.progress import progress

DEFAULT_REPEATS = 7
QUICK_REPEATS = 3
DEFAULT_BUDGET_S = 4.0  # seconds of timed rounds per case (quick: none beyond the repeats)
MAX_ROUNDS_FACTOR = 10
# A candidate whose calls are shorter than this gets one untimed call before each timed
# one: the previous candidate's worker threads (PyTorch's OpenMP pool, Numba's) keep
# spinning for milliseconds after it returns; a 25 ms attnnb call measured 22 % slower
# right after an SDPA call than after one of its own.
SETTLE_BELOW_S = 0.25


def sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """This machine's float32 matrix-product rate (GFLOP/s, median of ``repeats``)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    np.dot(a, b)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.dot(a, b)
        times.append(time.perf_counter() - t)
    return 2.0 * n**3 / float(np.median(times)) / 1e9


class UnknownBenchmark(LookupError):
    """``--only`` names no module of :mod:`attnnb.benches` (a usage error: exit status 2)."""


def discover(only: str | None = None) -> list[tuple[str, object]]:
    """``(name, module)`` for every module of :mod:`attnnb.benches` (``only``: that one).

    Raises
    ------
    UnknownBenchmark
        ``only`` names no module (the command line exits with status 2).
    """
    import attnnb.benches as pkg

    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__))
    if only is not None:
        if only not in names:
            raise UnknownBenchmark(f"no benchmark module {only!r}; available: {', '.join(names)}")
        names = [only]
    return [(name, importlib.import_module(f"attnnb.benches.{name}")) for name in names]


def time_interleaved(candidates: dict, repeats: int, budget: float = 0.0) -> dict[str, list[float]]:
    """Warm each candidate up once, then rounds of one timed call each.

    At least ``repeats`` rounds; more while the rounds so far took less than
    ``budget`` seconds, up to ``MAX_ROUNDS_FACTOR * repeats`` rounds.  Short
    calls are preceded by an untimed one (see :data:`SETTLE_BELOW_S`).
    """
    for fn in candidates.values():
        fn()
    times = {label: [] for label in candidates}
    rounds, start = 0, time.perf_counter()
    while rounds < repeats or (time.perf_counter() - start < budget
                               and rounds < MAX_ROUNDS_FACTOR * repeats):
        for label, fn in candidates.items():
            if len(candidates) > 1 and (not times[label] or times[label][-1] < SETTLE_BELOW_S):
                fn()  # untimed: lets the previous candidate's threads go idle
            t = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t)
        rounds += 1
    return times


def measure_values(candidates: dict, repeats: int) -> dict[str, list[float]]:
    values = {label: [] for label in candidates}
    for _ in range(repeats):
        for label, fn in candidates.items():
            values[label].append(float(fn()))
    return values


def run_cases(cases: list[dict], repeats: int, bar=None, budget: float = 0.0) -> list[dict]:
    """Measure every case; returns rows ``{case, label, median, unit, work, ratio, target,
    rounds}`` (see :func:`time_interleaved` for ``repeats`` and ``budget``)."""
    rows = []
    for case in cases:
        reps = int(case.get("repeats", repeats))
        if bar is not None:
            bar.set_description(case["name"][:40])
        if case.get("measure", "time") == "value":
            results = measure_values(case["candidates"], reps)
            unit = case.get("unit", "")
        else:
            results = time_interleaved(case["candidates"], reps, budget)
            unit = "s"
        if bar is not None:
            bar.update(1)
        first = None
        for label, vals in results.items():
            med = float(np.median(vals))
            first = med if first is None else first
            rows.append({"case": case["name"], "label": label, "median": med, "unit": unit,
                         "work": case.get("work"), "ratio": med / first if first else np.nan,
                         "target": case.get("target", ""), "measure": case.get("measure", "time"),
                         "compare": case.get("compare", False), "rounds": len(vals)})
    return rows


def format_table(rows: list[dict], sgemm: float) -> str:
    head = (f"{'case':<46} {'candidate':<11} {'median':>11} {'ratio':>6} {'GFLOP/s':>8} "
            f"{'sgemm%':>7} {'rounds':>6}")
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        case = r["case"] if r["case"] != last else ""
        last = r["case"]
        if r["measure"] == "time":
            med = f"{r['median'] * 1e3:8.2f} ms"
            ratio = f"{r['ratio']:6.2f}"
        else:
            med = f"{r['median']:8.3g} {r['unit']}"
            ratio = f"{r['ratio']:6.2f}" if r.get("compare") else ""
        gf = share = ""
        if r["work"] and r["measure"] == "time":
            g = r["work"] / r["median"] / 1e9
            gf, share = f"{g:8.1f}", f"{100 * g / sgemm:6.0f}%"
        line = (f"{case:<46} {r['label']:<11} {med:>11} {ratio:>6} {gf:>8} {share:>7} "
                f"{r['rounds']:>6}")
        if r["target"] and case:
            line += f"  target {r['target']}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m attnnb bench [--quick] [--only NAME] [--repeats N]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="attnnb bench",
                                     description="Time attnnb against NumPy and PyTorch.")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--only", metavar="NAME", help="run one module of attnnb.benches")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"least timed rounds per case (default {DEFAULT_REPEATS}, quick "
                             f"{QUICK_REPEATS})")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds of timed rounds per case before stopping (default "
                             f"{DEFAULT_BUDGET_S:g}, quick 0); at most "
                             f"{MAX_ROUNDS_FACTOR}x the repeats")
    args = parser.parse_args(argv)
    repeats = args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    budget = args.budget if args.budget is not None else (0.0 if args.quick else DEFAULT_BUDGET_S)

    try:
        modules = discover(args.only)
    except UnknownBenchmark as exc:  # a usage error, as check's and warmup's (contract §4.1)
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    all_cases = []
    for name, module in modules:
        try:
            all_cases.extend(module.cases(args.quick))
        except ImportError as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
    bar = progress(len(all_cases))
    try:
        sgemm = sgemm_gflops()
        rows = run_cases(all_cases, repeats, bar, budget)
    finally:
        bar.close()
    print(f"sgemm (np.dot, float32, 2048^2): {sgemm:.1f} GFLOP/s; "
          f"ratio = median time / the case's first candidate's (> 1: the first is faster); "
          f"at least {repeats} interleaved rounds per case, more up to {budget:g} s")
    print(format_table(rows, sgemm))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
