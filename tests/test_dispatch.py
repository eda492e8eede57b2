"""Backend selection (docs/contract.md §3): backend=, ATTNNB_BACKEND, use_backend, auto, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

import attnnb
from attnnb._front import dispatch as _dispatch

from .helpers import qkv


@pytest.fixture
def spy(monkeypatch):
    """Record which backend each call resolves to, without running any kernel."""
    calls = []
    real = _dispatch.implementation

    def fake(operation, backend):
        if backend != "cuda":
            real(operation, backend)  # the real implementation still resolves
        calls.append(backend)
        return lambda problem: (np.zeros(problem.q.shape[:3] + problem.v.shape[3:]),
                                np.zeros(problem.q.shape[:3]))

    monkeypatch.setattr(_dispatch, "implementation", fake)
    monkeypatch.delenv("ATTNNB_BACKEND", raising=False)
    return calls


@pytest.fixture
def data(rng):
    return qkv(rng, hq=2, lq=3, lk=4, d=2)


def test_default_is_cpu_for_host_arrays(spy, data):
    attnnb.attention(*data)
    attnnb.attention(*data, backend="auto")
    assert spy == ["cpu", "cpu"]


def test_backend_argument(spy, data):
    attnnb.attention(*data, backend="reference")
    attnnb.attention(*data, backend="cpu")
    assert spy == ["reference", "cpu"]


def test_environment_variable(spy, data, monkeypatch):
    monkeypatch.setenv("ATTNNB_BACKEND", "reference")
    attnnb.attention(*data)
    attnnb.attention(*data, backend="cpu")  # an explicit argument wins
    monkeypatch.setenv("ATTNNB_BACKEND", "auto")
    attnnb.attention(*data)
    monkeypatch.setenv("ATTNNB_BACKEND", "")  # empty means unset
    attnnb.attention(*data)
    assert spy == ["reference", "cpu", "cpu", "cpu"]


def test_bad_environment_variable(spy, data, monkeypatch):
    monkeypatch.setenv("ATTNNB_BACKEND", "numpy")
    with pytest.raises(ValueError, match="ATTNNB_BACKEND.*'numpy'"):
        attnnb.attention(*data)
    assert spy == []


def test_use_backend_nests_and_restores(spy, data, monkeypatch):
    monkeypatch.setenv("ATTNNB_BACKEND", "cpu")
    with attnnb.use_backend("reference") as name:
        assert name == "reference"
        attnnb.attention(*data)
        with attnnb.use_backend("cpu"):
            attnnb.attention(*data)
            attnnb.attention(*data, backend="reference")
        attnnb.attention(*data)
    attnnb.attention(*data)
    assert spy == ["reference", "cpu", "reference", "reference", "cpu"]


def test_use_backend_restores_after_an_exception(spy, data):
    with pytest.raises(KeyError), attnnb.use_backend("reference"):
        raise KeyError
    attnnb.attention(*data)
    assert spy == ["cpu"]


def test_use_backend_is_per_thread(spy, data):
    seen = {}
    inside = threading.Event()
    done = threading.Event()

    def other():
        inside.wait(10)
        attnnb.attention(*data)  # must not see the main thread's context
        seen["other"] = spy[-1]
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with attnnb.use_backend("reference"):
        inside.set()
        assert done.wait(10)
        attnnb.attention(*data)
        seen["main"] = spy[-1]
    t.join()
    assert seen == {"other": "cpu", "main": "reference"}


@pytest.mark.parametrize("name", ["gpu", "numpy", None, ""])
def test_use_backend_rejects_unknown(name):
    with pytest.raises(ValueError, match=r"use_backend\(\) must be one of"):
        with attnnb.use_backend(name):
            pass


def test_backends_report():
    report = attnnb.backends()
    assert list(report) == ["reference", "cpu", "cuda"]
    for name, (ok, why) in report.items():
        assert isinstance(ok, bool) and isinstance(why, str) and why, name
    assert report["reference"][0] and report["cpu"][0]
    assert "numba" in report["cpu"][1]


def test_cuda_unavailable_is_runtime_error_with_reason(data):
    ok, why = attnnb.backends()["cuda"]
    if ok:
        pytest.skip(f"cuda is available here: {why}")
    with pytest.raises(RuntimeError, match="cuda") as info:
        attnnb.attention(*data, backend="cuda")
    assert why in str(info.value)
    with pytest.raises(RuntimeError, match="cuda"), attnnb.use_backend("cuda"):
        attnnb.attention(*data)


def test_no_silent_fallback(data, monkeypatch):
    """A failing backend raises; the call is not retried on another backend."""
    tried = []

    def broken(operation, backend):
        def run(problem):
            tried.append(backend)
            raise FloatingPointError("kernel failed")
        return run

    monkeypatch.setattr(_dispatch, "implementation", broken)
    for backend in ("cpu", "reference", None):
        with pytest.raises(FloatingPointError):
            attnnb.attention(*data, backend=backend)
    assert tried == ["cpu", "reference", "cpu"]


def test_unimplemented_operation_is_runtime_error():
    with pytest.raises(RuntimeError, match="'no_such_op' is not implemented on backend 'cpu'"):
        _dispatch.implementation("no_such_op", "cpu")
    _dispatch.register("no_such_op", "cpu", "attnnb.cpu.no_such_module:fn")
    try:
        with pytest.raises(RuntimeError, match="not implemented on backend 'cpu'"):
            _dispatch.implementation("no_such_op", "cpu")
    finally:
        del _dispatch._REGISTRY[("no_such_op", "cpu")]


def test_missing_dependency_inside_a_backend_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "attnnb_fake_backend.py").write_text("import attnnb_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _dispatch.register("fake_op", "cpu", "attnnb_fake_backend:fn")
    try:
        with pytest.raises(ModuleNotFoundError, match="attnnb_no_such_dependency"):
            _dispatch.implementation("fake_op", "cpu")
    finally:
        del _dispatch._REGISTRY[("fake_op", "cpu")]


def test_register_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        _dispatch.register("attention", "tpu", "x:y")


IMPORT_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import attnnb
dt = time.perf_counter() - t0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite", "torch",
                                                           "numba_cuda", "scipy", "dask",
                                                           "distributed"))
print(json.dumps({"seconds": dt, "heavy": heavy}))
"""


def test_import_is_light():
    """``import attnnb`` imports neither Numba nor numba.cuda (nor scipy, torch, dask)."""
    proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True,
                          timeout=120, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"import attnnb took {result['seconds']:.3f} s")  # reported, not asserted
    assert result["heavy"] == []
