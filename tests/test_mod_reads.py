"""What a mask or score function reads (docs/contract.md §2.10, "What a function reads").

FlexAttention's idioms: closures over arrays longer than NumPy's ``repr``
shows, globals rebound before each batch, factories with helpers of their
own, ``numba.njit`` helpers, constants and helpers edited between two
processes.  Each is checked on the cpu kernels and on the reference against
masks materialised here in NumPy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

import attnnb
from attnnb import mods
from attnnb._mods import reads as _mod_reads
from tests.helpers import assert_close

L = 1100  # past the 1,000 elements NumPy's repr shows in full


def _qkv(Lq, Lk=None, H=1, D=8, seed=0):
    rng = np.random.default_rng(seed)
    Lk = Lq if Lk is None else Lk
    return (rng.standard_normal((1, H, Lq, D)), rng.standard_normal((1, H, Lk, D)),
            rng.standard_normal((1, H, Lk, D)))


def _documents(seed, n=L):
    return np.sort(np.random.default_rng(seed).integers(0, 5, n))


def generate_doc_mask_mod(document_id):
    """attention-gym's document mask factory."""
    def doc_mask_mod(b, h, q_idx, kv_idx):
        return document_id[q_idx] == document_id[kv_idx]
    return doc_mask_mod


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_closure_over_a_long_array_follows_each_layout(backend):
    q, k, v = _qkv(L)
    for seed in (1, 2):
        ids = _documents(seed)
        got = attnnb.attention(q, k, v, mask_mod=generate_doc_mask_mod(ids), backend=backend)
        want = attnnb.attention(q, k, v, mask=ids[:, None] == ids[None, :],
                                backend="reference")
        assert_close(got, want, rtol=1e-12)


document_id = np.zeros(L, np.int64)


def packed_documents(b, h, q_idx, kv_idx):
    return (document_id[q_idx] == document_id[kv_idx]) & (kv_idx <= q_idx)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_global_rebound_before_each_batch_is_read_at_each_call(backend):
    global document_id
    q, k, v = _qkv(L)
    for seed in (3, 4, 5):
        document_id = _documents(seed)  # a training loop packing a new batch
        got = attnnb.attention(q, k, v, mask_mod=packed_documents, backend=backend)
        mask = (document_id[:, None] == document_id[None, :]) & np.tri(L, dtype=bool)
        assert_close(got, attnnb.attention(q, k, v, mask=mask, backend="reference"),
                     rtol=1e-12)


def test_a_rebound_array_needs_no_compile():
    """A new array of the same type is an argument: the same compiled kernel runs."""
    global document_id
    document_id = _documents(6)
    first = mods.resolved(mods.mask_mod(packed_documents))
    document_id = _documents(7)
    second = mods.resolved(mods.mask_mod(packed_documents))
    assert first.fingerprint() == second.fingerprint()
    assert mods.implicit_arrays(second)[0] is document_id


def generate_natten(canvas_w, kernel_w, kernel_h):
    """attention-gym's NATTEN factory: helpers defined inside it, constants in cells."""
    def get_x_y(idx):
        return idx // canvas_w, idx % canvas_w

    def natten_mask_mod(b, h, q_idx, kv_idx):
        q_x, q_y = get_x_y(q_idx)
        kv_x, kv_y = get_x_y(kv_idx)
        return (abs(q_x - kv_x) <= kernel_w // 2) & (abs(q_y - kv_y) <= kernel_h // 2)
    return natten_mask_mod


@numba.njit
def _scaled_distance(i, j, scale):
    return scale * (j - i)


def generate_decay(scale, table):
    """A factory returning a score function that calls a ``numba.njit`` helper and reads
    a closure array (a constant to gradients)."""
    def decay(s, b, h, i, j):
        return s + _scaled_distance(i, j, scale) + table[h]
    return decay


def test_factory_style_helpers_and_njit_helpers_compile():
    Lq, W = 35, 7
    q, k, v = _qkv(Lq, H=2)
    table = np.array([0.25, -0.5])
    natten = mods.mask_mod(generate_natten(W, 3, 5))
    decay = mods.score_mod(generate_decay(0.125, table), constant=False)
    kwargs = dict(mask_mod=natten, score_mod=decay)
    got = attnnb.attention(q, k, v, backend="cpu", **kwargs)
    x, y = np.divmod(np.arange(Lq), W)
    mask = (np.abs(x[:, None] - x[None, :]) <= 1) & (np.abs(y[:, None] - y[None, :]) <= 2)
    bias = 0.125 * (np.arange(Lq)[None, :] - np.arange(Lq)[:, None]) + table[:, None, None]
    want = attnnb.attention(q, k, v, mask=mask, bias=bias[None], backend="reference")
    assert_close(got, want, rtol=1e-12)
    assert_close(attnnb.attention(q, k, v, backend="reference", **kwargs), want, rtol=1e-12)


def test_keys_follow_content_not_addresses():
    """Two closures of one factory over equal constants share a key; another constant,
    another key; an array's value never enters it."""
    def key(fn):
        return _mod_reads.snapshot(fn, "mask_mod").key

    assert key(generate_natten(7, 3, 5)) == key(generate_natten(7, 3, 5))
    assert key(generate_natten(7, 3, 5)) != key(generate_natten(8, 3, 5))
    assert key(generate_doc_mask_mod(_documents(1))) == key(
        generate_doc_mask_mod(_documents(2)))
    node = _mod_reads.snapshot(generate_decay(0.5, np.ones(2)), "score_mod")
    assert len(node.arrays) == 1 and node.helpers


LIST_OF_IDS = [0, 0, 1]


def reads_a_list(b, h, i, j):
    return LIST_OF_IDS[i] == LIST_OF_IDS[j]


def reads_a_module(b, h, i, j):
    return os.sep == "/"


def test_what_cannot_be_read_is_refused_by_name():
    q, k, v = _qkv(3)
    with pytest.raises(TypeError, match=r"reads_a_list.*'LIST_OF_IDS'.*builtins\.list"):
        attnnb.attention(q, k, v, mask_mod=reads_a_list)
    with pytest.raises(TypeError, match=r"reads 'os'.*module 'os'"):
        attnnb.attention(q, k, v, mask_mod=reads_a_module)


def test_an_array_read_by_name_without_source_is_refused():
    scope = {"ids": np.zeros(4, np.int64)}
    exec("def no_source(b, h, i, j):\n    return ids[i] == ids[j]\n", scope)
    q, k, v = _qkv(4)
    with pytest.raises(TypeError, match=r"no_source.*reads arrays by name \(ids\).*source"):
        attnnb.attention(q, k, v, mask_mod=scope["no_source"], backend="cpu")


def test_a_lambda_over_an_array_is_read_at_each_call():
    q, k, v = _qkv(40)
    for seed in (1, 2):
        ids = _documents(seed, 40)
        mask_mod = lambda b, h, i, j: ids[i] == ids[j]  # noqa: E731, B023 - the idiom tested
        got = attnnb.attention(q, k, v, mask_mod=mask_mod, backend="cpu")
        want = attnnb.attention(q, k, v, mask=ids[:, None] == ids[None, :],
                                backend="reference")
        assert_close(got, want, rtol=1e-12)


SLOPE_TABLE = np.array([0.5])


def slope_by_name(s, b, h, i, j):
    return s + SLOPE_TABLE[h] * (j - i)


def test_gradients_with_a_float_array_read_by_name():
    """Read by name, a float array is a constant: q, k and v get their gradients, and a
    rebound table is followed by the backward too."""
    global SLOPE_TABLE
    q, k, v = _qkv(24)
    dout = np.random.default_rng(1).standard_normal(q.shape)
    for value in (0.5, -0.25):
        SLOPE_TABLE = np.array([value])
        bias = value * (np.arange(24)[None, :] - np.arange(24)[:, None])[None, None]
        want_out, want_pb = attnnb.vjp(attnnb.attention, q, k, v, bias=bias,
                                       backend="reference")
        for backend in ("reference", "cpu"):
            out, pb = attnnb.vjp(attnnb.attention, q, k, v, score_mod=slope_by_name,
                                 backend=backend)
            assert_close(out, want_out, rtol=1e-12)
            grads, want = pb(dout), want_pb(dout)
            for name in ("q", "k", "v"):
                assert_close(grads[name], want[name], rtol=1e-10)


# ---------------------------------------------------------------------------
# between processes: the disk cache keyed by content

_SCRIPT = """
import numpy as np, numba, attnnb
from user_mods import window_mod, WINDOW
L = 40
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, L, 8)) for _ in range(3))
got = attnnb.attention(q, k, v, mask_mod=window_mod(), backend="cpu")
i, j = np.arange(L)[:, None], np.arange(L)[None, :]
want = attnnb.attention(q, k, v, mask=EXPECTED, backend="reference")
print("error", float(np.abs(got - want).max()))
"""

_MODULE = """
import numba
WINDOW = {window}

def near(d):
    return {near}

def window_mod():
    @numba.njit
    def inner(b, h, i, j):
        return near(i - j) & (j <= i)
    return inner
"""


def _run(tmp_path, window, near, expected):
    (tmp_path / "user_mods.py").write_text(_MODULE.format(window=window, near=near))
    script = _SCRIPT.replace("EXPECTED", expected)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    error = float(done.stdout.split("error")[-1])
    assert error < 1e-12, (window, near, error)


def _cache_files(tmp_path) -> dict:
    root = tmp_path / "cache"
    return {p.relative_to(root): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_edits_between_processes_compile_anew_and_nothing_else_does(tmp_path):
    """A constant edited, then a helper edited: each next process follows the user's
    file; a process over unchanged code (a closure-held ``numba.njit`` function
    included) loads everything from the disk cache and writes nothing."""
    _run(tmp_path, 16, "d < WINDOW", "(i - j < 16) & (j <= i)")
    _run(tmp_path, 5, "d < WINDOW", "(i - j < 5) & (j <= i)")
    _run(tmp_path, 5, "d <= 2 * WINDOW", "(i - j <= 10) & (j <= i)")
    before = _cache_files(tmp_path)
    _run(tmp_path, 5, "d <= 2 * WINDOW", "(i - j <= 10) & (j <= i)")
    assert _cache_files(tmp_path) == before


def test_check_skips_arrays_read_by_name():
    """mods.check verifies the bound arrays' gradients; one read by name is a constant."""
    mods.check(mods.score_mod(slope_by_name), shape=(1, 1, 4, 4), points=8)
    shift = np.array([0.5, -0.5])
    mods.check(mods.score_mod(_shifted_by_name_and_bound, shift,
                              grad_arrays=_shifted_grad), shape=(1, 2, 4, 4), points=8)


def _shifted_by_name_and_bound(s, b, h, i, j, shift):
    return s + shift[h] + SLOPE_TABLE[0] * i


def _shifted_grad(g, s, b, h, i, j, grads, shift):
    grads[0][h] += g


def test_torch_tensors_read_by_name():
    """A CPU tensor read by name is read at every call (FlexAttention's captured tensors);
    one that requires grad is refused by name (bind it to the mod for its gradient)."""
    torch = pytest.importorskip("torch")
    global TORCH_IDS
    q, k, v = _qkv(30)
    for seed in (1, 2):
        ids = _documents(seed, 30)
        TORCH_IDS = torch.from_numpy(ids)
        got = attnnb.attention(q, k, v, mask_mod=torch_documents, backend="cpu")
        want = attnnb.attention(q, k, v, mask=ids[:, None] == ids[None, :],
                                backend="reference")
        assert_close(got, want, rtol=1e-12)
    TORCH_IDS = torch.zeros(30, requires_grad=True)
    with pytest.raises(TypeError, match=r"'TORCH_IDS'.*requires grad"):
        attnnb.attention(q, k, v, mask_mod=torch_documents, backend="cpu")


TORCH_IDS = None


def torch_documents(b, h, i, j):
    return TORCH_IDS[i] == TORCH_IDS[j]


MASKED_IDS = np.ma.masked_array([0, 0, 1], mask=[False, True, False])


def reads_a_masked_array(b, h, i, j):
    return MASKED_IDS[i] == MASKED_IDS[j]


def test_an_array_subclass_read_by_name_is_refused():
    q, k, v = _qkv(3)
    with pytest.raises(TypeError, match=r"'MASKED_IDS'.*MaskedArray"):
        attnnb.attention(q, k, v, mask_mod=reads_a_masked_array)


_BY_PATH = """
import importlib.util, sys
import numpy as np, attnnb
from attnnb import mods
spec = importlib.util.spec_from_file_location("loaded_by_path", sys.argv[1])
user = importlib.util.module_from_spec(spec)  # not in sys.modules, as exec'd code is not
spec.loader.exec_module(user)
q = np.random.default_rng(0).standard_normal((1, 2, 9, 4))
if sys.argv[2] == "other first":  # another function compiled first: Numba's ids move on
    attnnb.attention(q, q, q, score_mod=mods.softcap(3.0), backend="cpu")
out = attnnb.attention(q, q, q, score_mod=user.tilted, backend="cpu")
print("sum", float(out.sum()))
"""


def test_a_function_from_a_module_loaded_by_path_loads_from_the_disk_cache(tmp_path):
    """A kernel inlining a function whose module Python cannot import again (loaded by
    path, not in ``sys.modules``) is loaded from the disk cache by a later process that
    compiled other functions first (it failed naming the module ``<dynamic>``)."""
    (tmp_path / "user.py").write_text("def tilted(s, b, h, i, j):\n    return s + 0.5 * h\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), ATTNNB_FIRST_TIER="0",
               PYTHONPATH=os.getcwd())
    sums = []
    for order in ("alone", "other first"):
        done = subprocess.run([sys.executable, "-c", _BY_PATH, str(tmp_path / "user.py"), order],
                              env=env, capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        sums.append(done.stdout.split("sum")[-1])
    assert sums[0] == sums[1]
