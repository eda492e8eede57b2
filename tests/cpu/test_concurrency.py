"""Threads, fork and the on-disk kernel cache (docs/contract.md §1.11, §1.13; issue 2 item 8).

Numba's threading layers fail differently: GNU OpenMP kills a child forked
after a parallel call, workqueue aborts on concurrent launches from Python
threads.  attnnb prefers TBB (loaded by attnnb/cpu/_threading.py), runs serial
twins of the kernels in a forked child otherwise, and serialises launches
under workqueue.  Each layer is forced here in a subprocess, because Numba
picks its layer once per process.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attnnb

# subprocesses import this module (as tests.cpu.test_concurrency) and the same attnnb
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHONPATH = os.pathsep.join([ROOT, os.path.dirname(os.path.dirname(attnnb.__file__))])
TIMEOUT = 180  # seconds: a hang (e.g. a Pool after fork under OpenMP) fails, never blocks


def problem(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, 130, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, 97, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 97, 8)).astype(dtype)
    return q, k, v


def work(seed):
    """One cpu call; module level so that worker processes can run it."""
    return attnnb.attention(*problem(seed), causal=True, return_lse=True, backend="cpu")


def test_threads_give_identical_results():
    want = work(0)
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: work(0), range(16), timeout=TIMEOUT))
    for out, lse in results:
        np.testing.assert_array_equal(out, want[0])
        np.testing.assert_array_equal(lse, want[1])


def test_thread_count_changes_nothing():
    import numba

    want = work(4)
    n = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        got = work(4)
    finally:
        numba.set_num_threads(n)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_fork_after_calls_process_pool():
    want = [work(s) for s in range(3)]  # the parent has run parallel regions
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as pool:
        got = list(pool.map(work, range(3), timeout=TIMEOUT))
    for (o, l), (wo, wl) in zip(got, want, strict=True):
        np.testing.assert_array_equal(o, wo)
        np.testing.assert_array_equal(l, wl)


def test_fork_after_calls_pool():
    want = work(1)
    with mp.get_context("fork").Pool(2) as pool:
        got = pool.map_async(work, [1, 1]).get(TIMEOUT)
    for o, l in got:
        np.testing.assert_array_equal(o, want[0])
        np.testing.assert_array_equal(l, want[1])


SCRIPT = """
import concurrent.futures as cf, json, multiprocessing as mp, sys
import numpy as np
import numba
from tests.cpu.test_concurrency import TIMEOUT, work
from attnnb.cpu._threading import TBB_PRELOADED, in_forked_child

def child(seed):
    return in_forked_child(), work(seed)

want = work(2)
layer = numba.threading_layer()
with cf.ThreadPoolExecutor(3) as pool:   # concurrent launches from Python threads
    threads = list(pool.map(lambda _: work(2), range(9), timeout=TIMEOUT))
# one worker, two tasks: a second call in the same child (its serial twin is compiled once)
with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
    forked = list(pool.map(child, [2, 2], timeout=TIMEOUT))
same = lambda r: all(np.array_equal(a, b) for a, b in zip(r, want))
print(json.dumps({"layer": layer, "tbb_preloaded": TBB_PRELOADED,
                  "threads_equal": all(same(r) for r in threads),
                  "forked_equal": all(same(r) for _, r in forked),
                  "child_serial": [s for s, _ in forked]}))
"""


def run_script(script, env_extra, timeout=TIMEOUT):
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = PYTHONPATH + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc


def layer_report(layer):
    proc = run_script(SCRIPT, {"NUMBA_THREADING_LAYER": layer} if layer else {})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_default_layer_is_tbb_when_the_wheel_is_installed():
    report = layer_report(None)
    assert report["threads_equal"] and report["forked_equal"]
    if report["tbb_preloaded"]:
        assert report["layer"] == "tbb"
        assert report["child_serial"] == [False, False]  # TBB survives fork: parallel kernels
    else:
        assert report["child_serial"] == [report["layer"] != "tbb"] * 2


@pytest.mark.parametrize("layer", ["omp", "workqueue"])
def test_other_layers_fall_back_safely(layer):
    """OpenMP: serial twins in the forked child; workqueue: launches serialised."""
    try:
        report = layer_report(layer)
    except AssertionError as exc:
        if "No threading layer could be loaded" in str(exc) or "not available" in str(exc):
            pytest.skip(f"threading layer {layer} cannot load here")
        raise
    assert report["layer"] == layer
    assert report["threads_equal"] and report["forked_equal"]
    assert report["child_serial"] == [True, True]


CACHE_SCRIPT = """
import sys
import numpy as np
from attnnb.cpu.attention import attention_kernel
from tests.cpu.test_concurrency import work
np.save(sys.argv[1], work(3)[0])
print("attention_kernel compiled here:", sum(attention_kernel.stats.cache_misses.values()) > 0)
"""
COMPILED_HERE = "attention_kernel compiled here: True"


def start_cached_run(out_file, env_extra):
    env = dict(os.environ, NUMBA_DEBUG_CACHE="1", **env_extra)
    env["PYTHONPATH"] = PYTHONPATH + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-c", CACHE_SCRIPT, str(out_file)], cwd=ROOT,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def kernel_cache_log(proc, stderr=None):
    """The NUMBA_DEBUG_CACHE lines about the attention kernel of a finished run
    (its standard error appended to the list ``stderr`` when given, for messages)."""
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err[-3000:]
    if stderr is not None:
        stderr.append(err[-3000:])
    return [x for x in out.splitlines() if "attention_kernel" in x]


def test_kernel_cache_loads_in_a_new_process(tmp_path):
    """A new process (with another thread count) loads the kernel from disk, and the
    loaded kernel gives this process's result bit for bit."""
    want, _ = work(3)  # compiles or loads, and saves to the cache if it was not there
    log = kernel_cache_log(start_cached_run(tmp_path / "load.npy", {"NUMBA_NUM_THREADS": "1"}))
    assert any("data loaded from" in x for x in log), log
    assert not any("data saved to" in x for x in log), log
    np.testing.assert_array_equal(np.load(tmp_path / "load.npy"), want)


def test_cache_stamp_covers_the_whole_package():
    """Every cached dispatcher of attnnb.cpu carries one stamp of all its modules."""
    from attnnb.cpu import _tiles
    from attnnb.cpu._numba_patches import ACTIVE, source_stamp
    from attnnb.cpu.attention import attention_kernel

    if not ACTIVE:
        pytest.skip("the Numba patches are off: Numba's own stamps")
    work(0)
    stamp = source_stamp.package_stamp()
    names = {os.path.basename(path) for path in source_stamp.package_sources()}
    assert names >= {"attention.py", "_tiles.py", "_exp.py", "views.py", "codes.py",
                     "selection.py", "dropout.py", "compile.py", "reads.py", "mods.py"}
    for fn in (attention_kernel, _tiles.finish_rows):
        assert fn._cache._cache_file._source_stamp == stamp


@pytest.mark.slow
def test_cache_after_an_edit_with_concurrent_writers(tmp_path):
    """Numba alone would load a stale kernel after an edit to _tiles.py (the kernel lives
    in attention.py); the package-wide stamp makes the next processes recompile.  Two of
    them start at once on the same cache (concurrent writers: each compiles, unless the
    other saved the kernel first), then a third loads what they saved: every result
    equals this process's."""
    import shutil

    from attnnb.cpu._numba_patches import ACTIVE

    if not ACTIVE:
        pytest.skip("the Numba patches are off: Numba's own stamps")

    want, _ = work(3)  # the package's own cache is now warm for this signature
    shutil.copytree(os.path.dirname(attnnb.__file__), tmp_path / "attnnb")  # mtimes kept
    env = dict(os.environ, NUMBA_DEBUG_CACHE="1",
               PYTHONPATH=str(tmp_path) + os.pathsep + ROOT)

    def start(name):
        return subprocess.Popen([sys.executable, "-c", CACHE_SCRIPT, str(tmp_path / name)],
                                cwd=str(tmp_path), env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    kernel_cache_log(start("before.npy"))  # the copy's cache: loaded (or filled)
    with open(tmp_path / "attnnb" / "cpu" / "_tiles.py", "a") as f:
        f.write("\n# an edit to a shared module\n")
    writers = [start(f"writer{i}.npy") for i in range(2)]
    errors: list = []
    logs = [kernel_cache_log(p, errors) for p in writers]
    # not the stale kernel: at least one of them compiled it
    assert any(COMPILED_HERE in log for log in logs), (logs, errors)
    log = kernel_cache_log(start("loader.npy"))
    assert any("data loaded from" in x for x in log) and COMPILED_HERE not in log, log
    for name in ("before", "writer0", "writer1", "loader"):
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), want, err_msg=name)
