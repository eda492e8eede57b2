"""The command line (docs/contract.md §4): info, check, bench hand-off, exit statuses."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from attnnb import cli


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("attnnb", "numpy", "numba", "reference", "cpu", "cuda",
                 "threading layer", "threads", "CUDA device"):
        assert word in out


def test_check_passes_and_prints_a_table(capsys):
    assert cli.main(["check", "--backend", "cpu", "--only", "2-D"]) == 0
    out = capsys.readouterr().out
    assert "max rel err" in out and "tolerance" in out
    lines = [x for x in out.splitlines() if x.startswith("attention 2-D")]
    assert len(lines) == 2 and all(x.rstrip().endswith("OK") for x in lines)
    assert "2 passed, 0 failed" in out


def test_check_discovers_every_module():
    names = {module for module, _, _ in cli.discover_cases()}
    assert "attention" in names


def test_only_may_be_given_more_than_once():
    one = [name for _, name, _ in cli.discover_cases("plain GQA")]
    both = [name for _, name, _ in cli.discover_cases(["plain GQA", "tome"])]
    tome = [name for module, name, _ in cli.discover_cases() if module == "tome"]
    assert one and tome and both == one + tome
    args = cli.build_parser().parse_args(["check", "--only", "a", "--only", "b"])
    assert args.only == ["a", "b"]


def test_check_fails_on_a_wrong_result(monkeypatch, capsys):
    def run(backend):
        x = np.linspace(0, 1, 5, dtype=np.float32)
        return x if backend == "reference" else x + 1e-3, np.zeros(2)

    def raising(backend):
        if backend != "reference":
            raise ValueError("broken backend")
        return np.zeros(3)

    def nan(backend):
        return np.array([0.0, np.nan if backend == "reference" else 0.0])

    monkeypatch.setattr(cli, "discover_cases", lambda only=None: [
        ("fake", "wrong", run), ("fake", "raises", raising), ("fake", "nan moved", nan)])
    assert cli.main(["check", "--backend", "cpu"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") == 3 and "broken backend" in out


def test_check_option_errors(capsys):
    assert cli.main(["check", "--backend", "tpu"]) == 2
    assert cli.main(["check", "--only", "no case has this name"]) == 2
    if not cli.importlib.import_module("attnnb").backends()["cuda"][0]:
        assert cli.main(["check", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "tpu" in err and "no check case" in err


def test_compare():
    a = np.array([1.0, 2.0, -np.inf])
    assert cli.compare(a, a) == (0.0, 1e-12)
    err, _ = cli.compare(a + [0, 1e-6, 0], a)
    assert err == pytest.approx(5e-7)
    assert cli.compare(a.astype(np.float32), a)[0] == np.inf  # dtype differs
    assert cli.compare((a, a), (a,))[0] == np.inf
    assert cli.compare(np.array([np.inf]), np.array([-np.inf]))[0] == np.inf


def test_bench_is_handed_its_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("attnnb.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "attnnb.bench", fake)
    assert cli.main(["bench", "--quick", "-x"]) == 0
    assert seen == [["--quick", "-x"]]


def test_bench_missing_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "attnnb.bench", None)
    assert cli.main(["bench"]) == 2
    assert "attnnb.bench" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "info" in capsys.readouterr().out


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "attnnb", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "check" in proc.stdout


def test_bench_only_without_a_match_is_a_usage_error(capsys):
    assert cli.main(["bench", "--only", "no_such_module"]) == 2
    err = capsys.readouterr().err
    assert "no_such_module" in err and "available" in err
