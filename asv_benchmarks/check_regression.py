"""Fail when a ``time_`` benchmark of a commit is slower than the last recorded commit.

``asv compare`` reports ratios but exits 0 even on a 3x slowdown; this check
reads asv's result files (``asv_benchmarks/results/<machine>/*.json``, the
committed history) and exits 1 when any ``time_`` benchmark, parameter set
by parameter set, takes more than ``--factor`` times as long at the commit
(default ``HEAD``) as at the last commit before it recorded on the same
machine::

    asv_benchmarks/record_history.sh HEAD        # record the commit first
    python asv_benchmarks/check_regression.py [--machine NAME] [--factor 1.3]

The baseline is the nearest first-parent ancestor of the commit with results
on the machine (``git rev-list --first-parent``); where git does not know the
commit, the recorded commit with the latest commit date before it.
``--result FILE`` takes the commit's results from a result file instead, and
``--baseline COMMIT`` names the baseline.  A point measured on one side only
(a new benchmark, one that failed or was skipped) is listed and not failed.
Standard library only, so that it runs in any environment.

Exit status: 0 no regression, 1 at least one, 2 nothing to compare.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MACHINE = "amd-epyc-zen4-2core"
DEFAULT_RESULTS = os.path.join(HERE, "results")


def load_result_file(path: str) -> dict:
    """One asv result file (API version 2) as ``{"commit", "date", "points", "versions"}``.

    ``points`` maps ``"name(param, ...)"`` (asv's own spelling, the bare name
    for an unparameterised benchmark) to seconds, or None where the point was
    not measured (failed, skipped); only ``time_`` benchmarks are kept.
    ``versions`` maps each benchmark name to asv's hash of its code.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    columns = data["result_columns"]
    col = {name: i for i, name in enumerate(columns)}
    points: dict[str, float | None] = {}
    versions: dict[str, str | None] = {}
    for name, row in data["results"].items():
        if not name.rpartition(".")[2].startswith("time_"):
            continue
        row = list(row) + [None] * (len(columns) - len(row))
        values = row[col["result"]]
        params = row[col["params"]] or []
        versions[name] = row[col["version"]] if "version" in col else None
        labels = ([f"{name}({', '.join(combo)})" for combo in itertools.product(*params)]
                  if params else [name])
        if not isinstance(values, list):
            values = [values]
        for label, value in itertools.zip_longest(labels, values):
            if label is None:
                break
            ok = isinstance(value, (int, float)) and math.isfinite(value) and value > 0
            points[label] = float(value) if ok else None
    return {"commit": data["commit_hash"], "date": data.get("date") or 0,
            "points": points, "versions": versions}


def load_machine(results_dir: str, machine: str) -> dict[str, dict]:
    """Every recorded commit of ``machine``: ``{commit hash: result}``.

    Several files of one commit (several environments) merge, later names winning.
    """
    commits: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(results_dir, machine, "*.json"))):
        if os.path.basename(path) == "machine.json":
            continue
        result = load_result_file(path)
        if result["commit"] in commits:
            old = commits[result["commit"]]
            old["points"].update(result["points"])
            old["versions"].update(result["versions"])
        else:
            commits[result["commit"]] = result
    return commits


def _git(*args: str) -> list[str] | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                             cwd=HERE).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.split()


class _Unknown(Exception):
    """A commit that neither the results nor git can name."""


def resolve(commit: str, recorded: dict[str, dict]) -> str:
    """The full hash of ``commit``: a recorded hash it starts, else what git says
    (a full 40-digit hash is taken as it is)."""
    matches = [h for h in recorded if h.startswith(commit.lower())]
    if len(matches) == 1:
        return matches[0]
    full = _git("rev-parse", "--verify", "--quiet", commit + "^{commit}")
    if full:
        return full[0]
    if len(commit) == 40 and all(c in "0123456789abcdef" for c in commit.lower()):
        return commit.lower()
    if matches:
        raise _Unknown(f"commit {commit!r} is ambiguous: {', '.join(matches)}")
    raise _Unknown(f"unknown commit {commit!r}")


def find_baseline(commit: str, date: int, recorded: dict[str, dict]) -> str | None:
    """The last recorded commit before ``commit``: its nearest recorded first-parent
    ancestor, or (where git does not know it) the latest earlier commit date."""
    ancestors = _git("rev-list", "--first-parent", commit)
    if ancestors:
        for h in ancestors[1:]:
            if h in recorded:
                return h
        return None
    earlier = [r for h, r in recorded.items() if h != commit and r["date"] < date]
    return max(earlier, key=lambda r: r["date"])["commit"] if earlier else None


def compare(base: dict, head: dict, factor: float) -> tuple[list[tuple], list[str]]:
    """Rows ``(point, base s, head s, ratio or None, status)`` and the regressed points.

    ``status`` is ``"SLOWER"`` above ``factor``, ``"ok"``, or says which side
    lacks the point (points that neither side measured are left out); a
    benchmark whose code differs between the two sides is still compared,
    marked ``"(benchmark changed)"``.
    """
    rows, slower = [], []
    for point in sorted(set(base["points"]) | set(head["points"])):
        b, h = base["points"].get(point), head["points"].get(point)
        name = point.partition("(")[0]
        changed = (name in base["versions"] and name in head["versions"]
                   and base["versions"][name] != head["versions"][name])
        if b is None and h is None:
            continue  # a parameter set neither side measured (not selected, skipped)
        if b is None or h is None:
            side = "baseline" if b is None else "commit"
            rows.append((point, b, h, None, f"not measured at the {side}"))
            continue
        ratio = h / b
        status = "SLOWER" if ratio > factor else "ok"
        if changed:
            status += " (benchmark changed)"
        if ratio > factor:
            slower.append(point)
        rows.append((point, b, h, ratio, status))
    return rows, slower


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e-9:.3g} ns"


def format_table(rows: list[tuple]) -> str:
    """The rows as a fixed-width text table."""
    header = ("benchmark", "baseline", "commit", "ratio", "")
    cells = [header] + [(p, _seconds(b), _seconds(h), "-" if r is None else f"{r:.2f}", s)
                        for p, b, h, r, s in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = []
    for c in cells:
        lines.append("  ".join([c[0].ljust(widths[0])]
                               + [c[i].rjust(widths[i]) for i in (1, 2, 3)] + [c[4]]).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machine", default=DEFAULT_MACHINE,
                        help=f"asv machine name (default {DEFAULT_MACHINE})")
    parser.add_argument("--factor", type=float, default=1.3,
                        help="fail above this time ratio, commit / baseline (default 1.3)")
    parser.add_argument("--results-dir", default=DEFAULT_RESULTS,
                        help="asv's results_dir (default: asv_benchmarks/results)")
    parser.add_argument("--commit", default="HEAD", help="the commit to check (default HEAD)")
    parser.add_argument("--result", metavar="FILE",
                        help="take the commit's results from this asv result file")
    parser.add_argument("--baseline", metavar="COMMIT",
                        help="compare with this recorded commit instead of the last one")
    args = parser.parse_args(argv)
    if not args.factor > 1.0:
        parser.error(f"--factor must be above 1, got {args.factor}")

    recorded = load_machine(args.results_dir, args.machine)
    try:
        return _check(args, recorded)
    except _Unknown as exc:
        print(f"check_regression: {exc}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace, recorded: dict[str, dict]) -> int:
    if args.result:
        head = load_result_file(args.result)
    else:
        commit = resolve(args.commit, recorded)
        if commit not in recorded:
            print(f"check_regression: no results for {commit[:8]} on machine {args.machine!r} "
                  f"in {args.results_dir}; record it first "
                  f"(asv_benchmarks/record_history.sh {commit[:8]})", file=sys.stderr)
            return 2
        head = recorded[commit]
    if args.baseline:
        base_hash = resolve(args.baseline, recorded)
    else:
        base_hash = find_baseline(head["commit"], head["date"], recorded)
    if base_hash is None or base_hash not in recorded:
        print(f"check_regression: no recorded commit before {head['commit'][:8]} on machine "
              f"{args.machine!r}", file=sys.stderr)
        return 2
    rows, slower = compare(recorded[base_hash], head, args.factor)
    print(f"machine {args.machine}: {head['commit'][:8]} against {base_hash[:8]}, "
          f"time ratios (> 1: slower), failing above {args.factor:g}")
    print(format_table(rows))
    if slower:
        print(f"\n{len(slower)} time_ benchmark(s) more than {args.factor:g}x slower:")
        for point in slower:
            print(f"  {point}")
        return 1
    print(f"\nno time_ benchmark is more than {args.factor:g}x slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
