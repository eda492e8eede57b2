"""CONTRIBUTING.md's worked example of a variant runs as written, on every cpu path, and is
right: forward against the float64 reference, its parameters' gradients against central
differences."""

import importlib.util
import pathlib
import re

import numpy as np
import pytest

import attnnb
from attnnb import mods

from .helpers import assert_close

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "CONTRIBUTING.md"


@pytest.fixture(scope="module")
def kerple(tmp_path_factory):
    """The example's module, written to a file as a contributor would."""
    section = GUIDE.read_text().split("### Worked example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.splitlines()) < 100
    path = tmp_path_factory.mktemp("example") / "kerple.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("kerple", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(dtype, hq=4, hk=2, lq=37, lk=53, d=16):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, hq, lq, d)).astype(dtype)
    k, v = (rng.standard_normal((2, hk, lk, d)).astype(dtype) for _ in range(2))
    return q, k, v, rng.uniform(0.5, 2, hq), rng.uniform(0.1, 1, hq)


def test_its_derivatives_hold(kerple):
    _, _, _, r1, r2 = _inputs(np.float64)
    mods.check(kerple.kerple_log(r1, r2), shape=(2, 4, 37, 53))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_matches_the_reference(kerple, dtype, causal):
    q, k, v, r1, r2 = _inputs(dtype)  # Lq != Lk, grouped query heads
    mod = kerple.kerple_log(r1, r2)
    want = attnnb.attention(*(x.astype(np.float64) for x in (q, k, v)), score_mod=mod,
                            causal=causal, backend="reference")
    got = attnnb.attention(q, k, v, score_mod=mod, causal=causal, backend="cpu")
    assert_close(got, want, dtype)


def test_its_parameters_learn(kerple):
    q, k, v, r1, r2 = _inputs(np.float64, hq=2, hk=1, lq=9, lk=13, d=4)
    dout = np.random.default_rng(1).standard_normal((2, 2, 9, 4))

    def loss(a, b):
        out = attnnb.attention(q, k, v, score_mod=kerple.kerple_log(a, b), causal=True,
                               backend="reference")
        return float((out * dout).sum())

    _, back = attnnb.vjp(attnnb.attention, q, k, v, score_mod=kerple.kerple_log(r1, r2),
                         causal=True, backend="cpu")
    d_r1, d_r2 = back(dout)["score_mod"]
    eps = 1e-6
    for got, which in ((d_r1, 0), (d_r2, 1)):
        for h in range(2):
            step = np.zeros(2)
            step[h] = eps
            plus = loss(r1 + step, r2) if which == 0 else loss(r1, r2 + step)
            minus = loss(r1 - step, r2) if which == 0 else loss(r1, r2 - step)
            assert got[h] == pytest.approx((plus - minus) / (2 * eps), rel=1e-6, abs=1e-9)
