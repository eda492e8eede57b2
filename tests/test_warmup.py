"""``python -m attnnb warmup`` (docs/contract.md §4.5) and its engine, attnnb/warmup.py.

The engine is tested on tests/warmup_cases.py (one small kernel, two dtypes)
rather than on the check cases, which would compile every kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from attnnb import cli, warmup
from tests import warmup_cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE_MODULE = "tests.warmup_cases"
UNMERGE = "attnnb.cpu.tome.unmerge_kernel"


def cheap_cases(*names):
    return [(CASE_MODULE, name, run) for name, run in warmup_cases.cases()
            if not names or name in names]


def test_processes_compile_each_kernel_once_then_load_it(tmp_path, monkeypatch):
    """Two processes share three cases and two kernels: each kernel is compiled once
    (the float32 one is reached by two cases at once), the failing case is reported,
    and a second run loads both kernels from the cache."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    first = warmup.run(cheap_cases(), jobs=2, bar=False)
    assert first.jobs == 2
    assert sorted(k.name for k in first.kernels) == [UNMERGE, UNMERGE]
    assert {"float32", "float64"} == {k.label.split()[1] for k in first.kernels}
    assert first.loaded == 0 and first.compilations == 2
    assert first.failures == [("broken", "ValueError: broken on purpose")]
    assert first.line().startswith("warmup: compiled 2 kernels (0 loaded from cache) in ")
    assert first.line().endswith(" s with 2 processes")

    again = warmup.run(cheap_cases(), jobs=2, bar=False)
    assert len(again.kernels) == 2 and again.loaded == 2 and again.compilations == 0


ONE_PROCESS = """
import json
from numba.core.dispatcher import Dispatcher
from attnnb import warmup
from tests.test_warmup import cheap_cases
runs = [warmup.run(cheap_cases("unmerge float64", "broken"), jobs=1, bar=False)
        for _ in range(2)]
print(json.dumps({"runs": [[s.jobs, len(s.kernels), s.loaded, s.compilations, len(s.failures)]
                           for s in runs],
                  "line": runs[0].line(),
                  "restored": Dispatcher.compile.__qualname__ == "Dispatcher.compile"}))
"""


def test_one_process_counts_what_it_compiled(tmp_path):
    """With one job the cases run in this process (a fresh one here, so that nothing is
    compiled yet); the hooks are removed afterwards."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", ONE_PROCESS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    # the second run finds the kernel in the process already: nothing to make ready
    assert report["runs"] == [[1, 1, 0, 1, 1], [1, 0, 0, 0, 1]]
    assert report["line"].endswith(" s with 1 process")
    assert report["restored"]


def test_jobs_are_capped_by_the_cases(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert warmup.run(cheap_cases("broken"), jobs=8, bar=False).jobs == 1


def test_list_names_the_check_cases_and_imports_no_numba():
    code = ("import sys; from attnnb import cli; status = cli.main(['warmup', '--list']); "
            "print(status, 'numba' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "0 False"
    names = [name for _, name, _ in cli.discover_cases()]
    assert len(lines) - 1 == len(names)
    for wanted in ("attention plain GQA float64", "grad diff_attention rectified float32",
                   "tome bipartite N=77 r=20 float32"):
        assert any(line.endswith(wanted) for line in lines)


def fake_summary(failures=()):
    kernels = [warmup.Kernel("attnnb.cpu.attention.attention_kernel",
                             "(Array(float32, 4, 'C', False, aligned=True), int64)", 12.5, False),
               warmup.Kernel(UNMERGE, "(Array(float64, 3, 'C', False, aligned=True),)", 0.1,
                             True)]
    return warmup.Summary(kernels, list(failures), 13.0, 2, ["attnnb.cpu.x.never_kernel"], 1)


def test_command_prints_the_closing_line_times_and_problems(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(warmup, "run", lambda cases, jobs: seen.append((cases, jobs))
                        or fake_summary())
    assert cli.main(["warmup", "--times"]) == 0
    out, err = capsys.readouterr()
    assert seen == [(None, None)]  # everything, one process per CPU
    lines = out.splitlines()
    assert lines[0] == "warmup: compiled 2 kernels (1 loaded from cache) in 13.0 s with 2 processes"
    assert "12.5 s  compiled  attention_kernel float32" in lines[1]
    assert "loaded    unmerge_kernel float64" in lines[2]
    assert "never_kernel" in err

    monkeypatch.setattr(warmup, "run", lambda cases, jobs: seen.append((cases, jobs))
                        or fake_summary([("tome random r=17 float32", "ValueError: no")]))
    assert cli.main(["warmup", "--only", "tome random r=17", "--jobs", "3"]) == 1
    cases, jobs = seen[-1]
    assert [name for _, name, _ in cases] == ["tome random r=17 float32",
                                              "tome random r=17 float64"]
    assert jobs == 3
    assert "tome random r=17 float32" in capsys.readouterr().err


def test_command_usage_errors(capsys):
    assert cli.main(["warmup", "--only", "no case has this name"]) == 2
    assert "no warmup case" in capsys.readouterr().err
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["warmup", "--jobs", bad])
        assert exc.value.code == 2


def test_check_compiles_the_cpu_kernels_of_its_cases_first(monkeypatch, capsys):
    seen = []

    def run(cases, jobs):
        seen.append(([name for _, name, _ in cases], jobs))
        return fake_summary()

    monkeypatch.setattr(warmup, "run", run)
    x = np.zeros(3)
    monkeypatch.setattr(cli, "discover_cases", lambda only=None: [("fake", "same", lambda b: x)])
    assert cli.main(["check", "--backend", "cpu", "--jobs", "2"]) == 0
    assert seen == [(["same"], 2)]
    assert capsys.readouterr().out.startswith("warmup: compiled 2 kernels")
    assert cli.main(["check", "--backend", "cpu", "--jobs", "1"]) == 0  # 1: no warmup
    assert cli.main(["check", "--backend", "reference", "--jobs", "2"]) == 0  # no cpu
    assert len(seen) == 1
