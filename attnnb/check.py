"""The engine behind ``python -m attnnb check``, and the accuracy rule the tests share.

Discovers every module of :mod:`attnnb.checks` (the convention is in its
docstring), runs each case on ``"reference"`` and on every backend being
checked, compares the results and prints one table: per case and backend
the largest relative error, the tolerance, the time and OK / FAIL.

The comparison is the one the test suite uses too (``tests/helpers.py``
imports :data:`TOLERANCE` and :func:`relative_error` from here), so the
command and the tests hold the backends to the same standard:

* NaN must sit in the same places in both results, and so must the
  infinities, with the same signs;
* on the remaining (finite) entries, the largest absolute difference
  divided by the largest finite magnitude of the expected result must not
  exceed the tolerance of the expected result's dtype (:data:`TOLERANCE`).

:func:`compare` also requires equal shapes and dtypes.  Only NumPy is
imported here; the check modules load when :func:`discover_cases` runs.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

# Relative tolerance of a result against the float64 reference, by dtype (see the module
# docstring for how the error is measured).  float16 results are computed in float32 and
# rounded once, so their error is float16's rounding (2^-11, about 4.9e-4) plus a little.
TOLERANCE: dict[np.dtype, float] = {
    np.dtype(np.float16): 2e-3,
    np.dtype(np.float32): 2e-5,
    np.dtype(np.float64): 1e-12,
}

# For any other dtype (an integer map returned by a case, for example): all but exact.
OTHER_TOLERANCE = 1e-10

Case = tuple[str, str, Callable[[str], object]]  # (module, name, run)


def tolerance(dtype) -> float:
    """The relative tolerance for a result of ``dtype``.

    Parameters
    ----------
    dtype : numpy dtype or anything ``np.dtype`` accepts

    Returns
    -------
    float
        :data:`TOLERANCE` for float16, float32 and float64;
        :data:`OTHER_TOLERANCE` otherwise.
    """
    return TOLERANCE.get(np.dtype(dtype), OTHER_TOLERANCE)


def _where(differs: np.ndarray) -> str:
    first = tuple(int(i) for i in np.argwhere(differs)[0])
    return f"{int(differs.sum())} of {differs.size} entries differ, first at {first}"


def relative_error(actual, expected) -> tuple[float, str]:
    """The largest error of ``actual`` relative to ``expected``, or why they cannot match.

    Parameters
    ----------
    actual, expected : array_like
        Compared in float64; their dtypes are not compared (see :func:`compare`).

    Returns
    -------
    error : float
        ``max |actual - expected|`` over the entries where ``expected`` is
        finite, divided by the largest finite ``|expected|``; 0.0 when no entry is
        finite.  ``inf`` when ``problem`` is not empty.
    problem : str
        Empty when the arrays are comparable; otherwise what differs: the
        shapes, the places of NaN, or the places or signs of infinities.
    """
    a = np.asarray(actual)
    e = np.asarray(expected)
    if a.shape != e.shape:
        return float("inf"), f"shape {a.shape} != {e.shape}"
    a = a.astype(np.float64)
    e = e.astype(np.float64)
    differs = np.isnan(a) != np.isnan(e)
    if differs.any():
        return float("inf"), f"NaN positions: {_where(differs)}"
    inf_e = np.isinf(e)
    differs = np.isinf(a) != inf_e
    if differs.any():
        return float("inf"), f"Inf positions: {_where(differs)}"
    differs = inf_e & (a != e)
    if differs.any():
        return float("inf"), f"Inf signs: {_where(differs)}"
    fin = np.isfinite(e)
    if not fin.any():
        return 0.0, ""
    scale = max(float(np.abs(e[fin]).max()), 1e-300)
    return float(np.abs(a[fin] - e[fin]).max() / scale), ""


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def compare(actual, expected) -> tuple[float, float]:
    """``(max relative error, tolerance)`` of a case's result against the reference's.

    Parameters
    ----------
    actual, expected : array or tuple of arrays
        What a case's ``run(backend)`` returned on the backend checked and on
        ``"reference"``.

    Returns
    -------
    error : float
        The largest :func:`relative_error` over the arrays; ``inf`` when the
        numbers of arrays, a shape or a dtype differ, or NaN / Inf sit in
        different places.
    tol : float
        The smallest :func:`tolerance` of the expected arrays' dtypes (0.0 when
        the numbers of arrays differ).  The case passes when ``error <= tol``.
    """
    actual, expected = _as_tuple(actual), _as_tuple(expected)
    if len(actual) != len(expected):
        return float("inf"), 0.0
    worst, tol = 0.0, float("inf")
    for a, e in zip(actual, expected, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        tol = min(tol, tolerance(e.dtype))
        if a.shape != e.shape or a.dtype != e.dtype:
            return float("inf"), tol
        err, problem = relative_error(a, e)
        if problem:
            return float("inf"), tol
        worst = max(worst, err)
    return worst, tol


def discover_cases(only: str | Sequence[str] | None = None) -> list[Case]:
    """Every case of every module of :mod:`attnnb.checks`.

    Parameters
    ----------
    only : str or sequence of str, optional
        Keep the cases whose name contains one of these texts, or whose module is
        named one of them.

    Returns
    -------
    list of ``(module, name, run)``
        In module-name order, each module's cases in its own order.
    """
    import attnnb.checks as pkg

    texts = [only] if isinstance(only, str) else only
    found = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, run in module.cases():
            if texts is None or any(text in name or text == info.name for text in texts):
                found.append((info.name, name, run))
    return found


def select_backends(requested: Sequence[str] | None = None, *, out=None) -> list[str]:
    """The backends to check against the reference.

    Parameters
    ----------
    requested : sequence of str, optional
        Backend names (duplicates dropped; ``"reference"`` against itself is
        allowed).  None: every available backend but ``"reference"``, with a
        note on ``out`` for each one skipped and why.
    out : file, optional
        Where the notes go (default ``sys.stdout``).

    Returns
    -------
    list of str

    Raises
    ------
    ValueError
        A requested backend is unknown or cannot run here; the message says why.
    """
    import attnnb

    out = sys.stdout if out is None else out
    avail = attnnb.backends()
    if requested:
        for name in requested:
            if name not in avail:
                raise ValueError(f"unknown backend {name!r}; expected one of {tuple(avail)}")
            if not avail[name][0]:
                raise ValueError(f"backend {name!r} is not available: {avail[name][1]}")
        return list(dict.fromkeys(requested))
    for name, (ok, why) in avail.items():
        if not ok:
            print(f"note: backend {name!r} skipped: {why}", file=out)
    return [n for n, (ok, _) in avail.items() if ok and n != "reference"]


def _timed(run, backend):
    t0 = time.perf_counter()
    result = run(backend)
    return result, time.perf_counter() - t0


def run_cases(cases: Sequence[Case], backends: Sequence[str], *, out=None) -> int:
    """Run every case on ``"reference"`` and on each of ``backends``; print the table.

    Parameters
    ----------
    cases : sequence of ``(module, name, run)``
        As :func:`discover_cases` returns them.
    backends : sequence of str
        Backends to compare with the reference (see :func:`select_backends`).
    out : file, optional
        Where the table goes (default ``sys.stdout``).

    Returns
    -------
    int
        The exit status: 1 when any case failed on any backend (a wrong
        result, or an exception other than :class:`NotImplementedError`, which
        counts as skipped), else 0.
    """
    out = sys.stdout if out is None else out
    width = max((len(name) for _, name, _ in cases), default=4)

    def row(name, backend, err="", tol="", t="", result=""):
        print(f"{name:<{width}}  {backend:<9}  {err:>11}  {tol:>9}  {t:>8}  {result}",
              file=out, flush=True)

    row("case", "backend", "max rel err", "tolerance", "time", "result")
    failures = skipped = passed = 0
    for _, name, run in cases:
        try:
            expected, _ = _timed(run, "reference")
        except Exception as exc:
            row(name, "reference", result=f"FAIL ({type(exc).__name__}: {exc})")
            failures += 1
            continue
        for backend in backends:
            try:
                actual, t = _timed(run, backend)
            except NotImplementedError as exc:
                row(name, backend, result=f"skipped ({exc})")
                skipped += 1
                continue
            except Exception as exc:
                row(name, backend, result=f"FAIL ({type(exc).__name__}: {exc})")
                failures += 1
                continue
            err, tol = compare(actual, expected)
            ok = err <= tol
            failures += not ok
            passed += ok
            row(name, backend, f"{err:.2e}", f"{tol:.0e}", f"{t * 1e3:6.1f}ms",
                "OK" if ok else "FAIL")
    print(f"{passed} passed, {failures} failed" + (f", {skipped} skipped" if skipped else ""),
          file=out)
    print("(times include compiling or loading each kernel on its first call)", file=out)
    return 1 if failures else 0
