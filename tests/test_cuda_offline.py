"""The cuda backend where no GPU is used: imports, availability reasons, the PTX checker.

(The kernels themselves are tested under the simulator in tests/cuda_sim.)
"""

import importlib
import os
import pkgutil
import sys

import numpy as np
import pytest

import attnnb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_cuda_module_imports_without_a_device():
    pytest.importorskip("numba.cuda")
    import attnnb.cuda

    names = [m.name for m in pkgutil.iter_modules(attnnb.cuda.__path__)]
    assert {"attention", "diff", "sparse", "topk", "tome"} <= set(names)
    for name in names:
        importlib.import_module(f"attnnb.cuda.{name}")  # lazy kernels: no driver needed


def test_unavailable_cuda_says_why():
    ok, why = attnnb.backends()["cuda"]
    if ok:
        pytest.skip(f"cuda runs here: {why}")
    assert why and any(w in why for w in ("driver", "GPU", "numba", "CUDA"))
    q = np.zeros((2, 3), np.float32)
    with pytest.raises(RuntimeError, match="backend 'cuda' is not available"):
        attnnb.attention(q, q, q, backend="cuda")


def test_ptx_checker_flags_float64_instructions():
    sys.path.insert(0, os.path.join(ROOT, "gpu"))
    try:
        from ptx_check import f64_lines
    finally:
        sys.path.pop(0)
    ptx = "\n".join([
        "\t.reg .f64 \t%fd<4>;",  # a declaration, not arithmetic
        "\t.param .f64 p0,",
        "\tadd.f32 \t%f3, %f2, %f1;",
        "\tfma.rn.f64 \t%fd3, %fd2, %fd1, %fd0;",
        "\tcvt.f64.f32 \t%fd2, %f109;",
        "\t@%p1 bra \t$L__BB0_2;",
        "\t@%p2 mul.f64 \t%fd1, %fd1, %fd1;",
        "// add.f64 in a comment",
    ])
    assert f64_lines(ptx) == ["fma.rn.f64 \t%fd3, %fd2, %fd1, %fd0;",
                              "cvt.f64.f32 \t%fd2, %f109;",
                              "@%p2 mul.f64 \t%fd1, %fd1, %fd1;"]
