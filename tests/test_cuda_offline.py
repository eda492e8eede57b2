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


def _ptx_check():
    sys.path.insert(0, os.path.join(ROOT, "gpu"))
    try:
        import ptx_check
    finally:
        sys.path.pop(0)
    return ptx_check


def test_ptx_gate_reads_ptxas_figures_and_fails_slow_kernels():
    check = _ptx_check()
    log = "\n".join([
        "ptxas         .     768 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads",
        "ptxas info    : Used 191 registers, used 1 barriers",
        "info    : used 191 registers, used 1 barriers, 768 stack, 33792 bytes smem",
    ])
    figures = check.parse_ptxas_log(log)
    assert figures == {"registers": 191, "stack": 768, "spill_stores": 8, "spill_loads": 4,
                       "smem": 33792}
    why = check.gate_failures("k", figures, fma=10, loads=5)
    assert len(why) == 3 and "stack" in why[0] and "191" in why[1] and "10 fma" in why[2]
    clean = dict(figures, registers=96, stack=0, spill_stores=0, spill_loads=0)
    assert check.gate_failures("k", clean, fma=20, loads=5) == []
    ptx = "\n".join([
        "\tfma.rn.f32 \t%f3, %f2, %f1, %f0;",
        "\t@%p1 fma.rn.f32 \t%f4, %f2, %f1, %f0;",
        "\tld.shared.v4.f32 \t{%f1, %f2, %f3, %f4}, [%r1];",  # a wide load counts once
        "\tld.shared.f32 %f5, [%r2];",
        "\tld.global.f32 %f6, [%rd1];",
        "// fma.rn.f32 in a comment",
    ])
    assert check.fma_per_shared_load(ptx) == (2, 2)


def test_the_gate_leaves_out_only_float64_builds_of_variants():
    """The float64 builds the check compiles by default: every kernel's float32 build,
    and a float64 build of each kernel family; only a variant's float64 twin (its float32
    build being the same code) waits for ``--every-float64``."""
    pytest.importorskip("numba.cuda")
    cases = _ptx_check().kernel_cases()
    names = {name for _module, name, *_ in cases}
    variants = [name for _module, name, _fn, _types, *rest in cases
                if rest and rest[0].get("variant")]
    assert variants and all("float64" in name for name in variants)
    assert all(name.replace("float64", "float32") in names for name in variants)
    kept = {module for module, name, _fn, _types, *rest in cases
            if "float64" in name and not (rest and rest[0].get("variant"))}
    assert kept == {module for module, *_ in cases}
