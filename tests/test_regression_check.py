"""asv_benchmarks/check_regression.py on small synthetic asv result files."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "asv_benchmarks", "check_regression.py")
MACHINE = "testbox"
COLUMNS = ["result", "params", "version", "started_at", "duration", "stats_ci_99_a",
           "stats_ci_99_b", "stats_q_25", "stats_q_75", "stats_number", "stats_repeat",
           "samples", "profile"]

_spec = importlib.util.spec_from_file_location("check_regression", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

# Commit hashes git does not know: the baseline is then found by commit date.
OLD, MID, NEW = "a" * 40, "b" * 40, "c" * 40
DATES = {OLD: 1_000, MID: 2_000, NEW: 3_000}


def _results(scale_dense=1.0, scale_tome=1.0, drop=(), nan_point=False):
    """asv's "results" dict: a parameterised benchmark (2 x 2 points, one skipped as
    NaN by asv), an unparameterised one, and a track_ one that the check ignores."""
    dense = [0.010 * scale_dense, 0.020 * scale_dense, 0.040 * scale_dense,
             float("nan") if nan_point else 0.080 * scale_dense]
    res = {
        "bench_attention.Attention.time_attention":
            [dense, [["'cpu'"], ["512", "2048"], ["False", "True"]], "v1", 0, 1.0],
        "bench_tome.TomeRandom2d.time_match_merge": [[0.005 * scale_tome], [], "v1", 0, 1.0],
        "bench_attention.Attention.track_gflops":
            [[1.0, 1.0, 1.0, 1.0], [["'cpu'"], ["512", "2048"], ["False", "True"]], "v1"],
    }
    for name in drop:
        del res[name]
    return res


def _write(results_dir, commit, results, env="virtualenv-py3.11"):
    folder = os.path.join(results_dir, MACHINE)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "machine.json"), "w") as f:
        json.dump({"machine": MACHINE, "version": 1}, f)
    data = {"commit_hash": commit, "env_name": env, "date": DATES[commit],
            "params": {"machine": MACHINE, "python": "3.11"}, "python": "3.11",
            "requirements": {}, "env_vars": {}, "result_columns": COLUMNS,
            "results": results, "durations": {}, "version": 2}
    path = os.path.join(folder, f"{commit[:8]}-{env}.json")
    with open(path, "w") as f:
        json.dump(data, f)  # NaN written as asv writes it
    return path


def _check(tmp_path, *args):
    return check.main(["--results-dir", str(tmp_path), "--machine", MACHINE, *args])


def test_two_x_slowdown_of_one_point_fails_and_is_named(tmp_path, capsys):
    _write(tmp_path, OLD, _results())
    _write(tmp_path, MID, _results())
    slow = _results()
    slow["bench_attention.Attention.time_attention"][0][2] *= 2.0  # (cpu, 2048, False)
    _write(tmp_path, NEW, slow)
    assert _check(tmp_path, "--commit", NEW) == 1
    out = capsys.readouterr().out
    assert f"{NEW[:8]} against {MID[:8]}" in out  # the last recorded commit before it
    failing = out.split("more than 1.3x slower:")[1].split()
    assert failing == ["bench_attention.Attention.time_attention('cpu',", "2048,", "False)"]
    row = [line for line in out.splitlines()
           if line.startswith("bench_attention.Attention.time_attention('cpu', 2048, False)")]
    assert row and "2.00" in row[0] and "SLOWER" in row[0]


def test_ten_percent_slower_everywhere_passes(tmp_path, capsys):
    _write(tmp_path, OLD, _results())
    _write(tmp_path, NEW, _results(scale_dense=1.1, scale_tome=1.1))
    assert _check(tmp_path, "--commit", NEW) == 0
    out = capsys.readouterr().out
    assert out.count(" 1.10 ") == 5  # four dense points and the unparameterised one
    assert "SLOWER" not in out


def test_factor_is_honoured(tmp_path):
    _write(tmp_path, OLD, _results())
    _write(tmp_path, NEW, _results(scale_tome=1.25))
    assert _check(tmp_path, "--commit", NEW) == 0
    assert _check(tmp_path, "--commit", NEW, "--factor", "1.2") == 1


def test_slowdown_of_an_unparameterised_benchmark_fails(tmp_path, capsys):
    _write(tmp_path, OLD, _results())
    _write(tmp_path, NEW, _results(scale_tome=3.0))
    assert _check(tmp_path, "--commit", NEW) == 1
    assert "  bench_tome.TomeRandom2d.time_match_merge\n" in capsys.readouterr().out


def test_point_missing_on_one_side_is_reported_not_failed(tmp_path, capsys):
    # The baseline lacks a whole benchmark; the commit lost one point (NaN: skipped).
    _write(tmp_path, OLD, _results(drop=["bench_tome.TomeRandom2d.time_match_merge"]))
    _write(tmp_path, NEW, _results(nan_point=True))
    assert _check(tmp_path, "--commit", NEW) == 0
    out = capsys.readouterr().out
    assert "bench_tome.TomeRandom2d.time_match_merge" in out
    assert "not measured at the baseline" in out
    assert "not measured at the commit" in out
    assert "track_gflops" not in out


def test_points_neither_side_measured_are_left_out(tmp_path, capsys):
    base, head = _results(nan_point=True), _results(nan_point=True)
    _write(tmp_path, OLD, base)
    _write(tmp_path, NEW, head)
    assert _check(tmp_path, "--commit", NEW) == 0
    out = capsys.readouterr().out
    assert "time_attention('cpu', 2048, True)" not in out
    assert "time_attention('cpu', 2048, False)" in out


def test_parameter_sets_are_matched_by_value_not_position(tmp_path, capsys):
    # The commit's benchmark gained a parameter value: the shared points keep their
    # ratios, the new one is reported only.
    _write(tmp_path, OLD, _results())
    res = _results()
    res["bench_attention.Attention.time_attention"] = [
        [0.001, 0.002, 0.010, 0.020, 0.040, 0.080],
        [["'cpu'"], ["128", "512", "2048"], ["False", "True"]], "v2", 0, 1.0]
    _write(tmp_path, NEW, res)
    assert _check(tmp_path, "--commit", NEW) == 0
    out = capsys.readouterr().out
    assert "time_attention('cpu', 128, False)" in out
    assert out.count(" 1.00 ") == 5  # the four shared points and the unchanged benchmark
    assert "(benchmark changed)" in out
    assert "SLOWER" not in out


def test_explicit_baseline_result_file_and_errors(tmp_path, capsys):
    _write(tmp_path, OLD, _results(scale_dense=0.4))
    _write(tmp_path, MID, _results())
    elsewhere = tmp_path / "other"
    path = _write(elsewhere, NEW, _results())
    assert _check(tmp_path, "--result", path) == 0  # against MID
    assert _check(tmp_path, "--result", path, "--baseline", OLD[:7]) == 1  # 2.5x OLD
    assert _check(tmp_path, "--commit", NEW) == 2  # not recorded in tmp_path
    assert "record it first" in capsys.readouterr().err
    assert _check(tmp_path, "--commit", OLD) == 2  # nothing before the first commit


def test_git_ancestry_picks_the_baseline(tmp_path, capsys):
    # In a real repository the nearest recorded first-parent ancestor is the baseline,
    # whatever the commit dates say.
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    hashes = []
    for i in range(3):
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
            "-m", f"c{i}")
        hashes.append(git("rev-parse", "HEAD"))
    results = tmp_path / "results"
    DATES.update({hashes[0]: 9_000, hashes[1]: 1, hashes[2]: 5_000})
    _write(results, hashes[0], _results())
    _write(results, hashes[2], _results(scale_dense=2.0))
    env = dict(os.environ, GIT_DIR=str(repo / ".git"))
    proc = subprocess.run([sys.executable, SCRIPT, "--results-dir", str(results),
                           "--machine", MACHINE, "--commit", hashes[2]],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{hashes[2][:8]} against {hashes[0][:8]}" in proc.stdout


@pytest.mark.parametrize("factor", ["1", "0.5"])
def test_factor_must_exceed_one(tmp_path, factor):
    with pytest.raises(SystemExit):
        _check(tmp_path, "--factor", factor)
