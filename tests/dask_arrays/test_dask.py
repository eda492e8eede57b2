"""Dask arrays in, Dask arrays out (contract §7.2): exact against the unchunked call.

Every function is compared with the same call on NumPy arrays (the cpu
backend on both sides), under Dask's threaded scheduler for every chunking
and on a ``dask.distributed.LocalCluster`` of two worker processes; then the
task counts (blocks a query block cannot see are not scheduled), the merge
tree, the argument checks and a worker killed in the middle of a computation.
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import re
import time

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")

import attnnb  # noqa: E402
from attnnb import patterns  # noqa: E402
from tests.helpers import assert_close  # noqa: E402

RTOL = 1e-12  # float64 against the unchunked call: only the merges' rounding differs

# q (2, 4, 20, 8), k (2, 2, 23, 8), v (2, 2, 23, 5): batch, heads (GQA 2), queries, keys
SHAPES = {"q": (2, 4, 20, 8), "k": (2, 2, 23, 8), "v": (2, 2, 23, 5)}
CHUNKINGS = {
    "batch": {"q": (1, 4, 20, 8), "k": (1, 2, 23, 8), "v": (1, 2, 23, 5)},
    "heads": {"q": (2, 1, 20, 8), "k": (2, 1, 23, 8), "v": (2, 2, 23, 5)},
    "queries": {"q": (2, 4, 7, 8), "k": (2, 2, 23, 8), "v": (2, 2, 23, 5)},
    "keys": {"q": (2, 4, 20, 8), "k": (2, 2, 6, 8), "v": (2, 2, 9, 5)},
    # uneven, different in q, k and v, and a head chunk (3, 1) that cuts a GQA group
    "all": {"q": ((1, 1), (3, 1), (5, 9, 6), (8,)), "k": ((2,), (1, 1), (4, 10, 9), (8,)),
            "v": ((1, 1), (2,), (12, 11), (5,))},
}
# differential attention: q (2, 8, 20, 8) = 4 pairs, k (2, 4, 23, 8) = 2 key pairs, v (2, 2, 23, 6)
DIFF_SHAPES = {"q": (2, 8, 20, 8), "k": (2, 4, 23, 8), "v": (2, 2, 23, 6)}
DIFF_CHUNKINGS = {
    "batch": {"q": (1, 8, 20, 8), "k": (1, 4, 23, 8), "v": (1, 2, 23, 6)},
    "heads": {"q": (2, 2, 20, 8), "k": (2, 2, 23, 8), "v": (2, 1, 23, 6)},
    "queries": {"q": (2, 8, 7, 8), "k": (2, 4, 23, 8), "v": (2, 2, 23, 6)},
    "keys": {"q": (2, 8, 20, 8), "k": (2, 4, 6, 8), "v": (2, 2, 9, 6)},
    # an odd head boundary (3) splits a pair: the pair is kept whole
    "all": {"q": ((1, 1), (3, 5), (5, 9, 6), (8,)), "k": ((2,), (2, 2), (4, 10, 9), (8,)),
            "v": ((1, 1), (1, 1), (12, 11), (6,))},
}


def data(rng, shapes):
    return {n: rng.standard_normal(s) for n, s in shapes.items()}


def chunked(arrays, chunks):
    return {n: da.from_array(a, chunks=chunks[n]) for n, a in arrays.items()}


def extras(rng):
    """A padding mask, a shared bias, key sizes, a per-head lam (with a negative entry) and
    differential attention's sinks (one per map)."""
    mask = rng.random((2, 1, 1, 23)) < 0.8
    mask[1, ..., :] = False
    mask[1, ..., 5:] = True  # batch 1: the first keys are padding
    return {"mask": mask, "bias": rng.standard_normal((20, 23)),
            "key_size": rng.integers(1, 4, (2, 23)).astype(np.float64),
            "lam": np.array([[0.5], [-0.3], [0.8], [0.1]]),
            "sinks": rng.standard_normal((2, 8))}


def run_attention(q, k, v, x, normalizer, causal):
    return attnnb.attention(q, k, v, mask=x["mask"], bias=x["bias"], key_size=x["key_size"],
                            causal=causal, normalizer=normalizer, return_lse=True)


CASES = {
    "softmax causal, mask, bias, sizes": lambda q, k, v, x: run_attention(q, k, v, x, "softmax",
                                                                           True),
    "softmax1": lambda q, k, v, x: run_attention(q, k, v, x, "softmax1", False),
    "relu_expm1 causal": lambda q, k, v, x: run_attention(q, k, v, x, "relu_expm1", True),
    "sparse window": lambda q, k, v, x: attnnb.sparse_attention(
        q, k, v, patterns.local((20, 23), 3, causal=True), key_size=x["key_size"],
        return_lse=True),
    "sparse per head, softmax1": lambda q, k, v, x: attnnb.sparse_attention(
        q, k, v, patterns.from_mask(np.random.default_rng(5).random((4, 20, 23)) < 0.3),
        normalizer="softmax1", return_lse=True),
    "topk causal": lambda q, k, v, x: attnnb.topk_attention(
        q, k, v, 3, mask=x["mask"], causal=True, key_size=x["key_size"], return_lse=True),
    "topk softpick, sizes": lambda q, k, v, x: attnnb.topk_attention(
        q, k, v, 4, key_size=x["key_size"], normalizer="softpick", return_lse=True),
    "topk sigmoid causal": lambda q, k, v, x: attnnb.topk_attention(
        q, k, v, 5, causal=True, normalizer="sigmoid", return_lse=True),
    "topk softmax1, relu_expm1": lambda q, k, v, x: tuple(attnnb.topk_attention(
        q, k, v, 2, mask=x["mask"], normalizer=n, return_lse=True)[i]
        for n in ("softmax1", "relu_expm1") for i in (0, 1)),
}
DIFF_CASES = {
    "difference": lambda q, k, v, x: attnnb.diff_attention(
        q, k, v, x["lam"], bias=x["bias"], key_size=x["key_size"], causal=True),
    "rectified": lambda q, k, v, x: attnnb.diff_attention(
        q, k, v, x["lam"], mask=x["mask"], causal=True, mode="rectified"),
    "heaviside": lambda q, k, v, x: attnnb.diff_attention(
        q, k, v, x["lam"], mask=x["mask"], bias=x["bias"], key_size=x["key_size"], causal=True,
        mode="heaviside"),
    "sinks, every mode": lambda q, k, v, x: tuple(attnnb.diff_attention(
        q, k, v, x["lam"], mask=x["mask"], causal=c, mode=m, sinks=x["sinks"])
        for m, c in (("difference", False), ("rectified", True), ("heaviside", True))),
}


def check(result, expected):
    assert len(_items(result)) == len(_items(expected))
    for a, b, what in zip(_items(result), _items(expected), ("out", "lse") * 3):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype
        assert_close(a, b, rtol=RTOL, what=what)


def _items(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def lazy(x):
    """The Dask results (one array or a tuple), checked to be lazy and computed on threads."""
    assert all(isinstance(a, da.Array) for a in _items(x))
    return dask.compute(*_items(x), scheduler="threads")


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("case", CASES)
def test_equals_unchunked_call(rng, case, chunking):
    arrays, x = data(rng, SHAPES), extras(rng)
    expected = CASES[case](**arrays, x=x)
    check(lazy(CASES[case](**chunked(arrays, CHUNKINGS[chunking]), x=x)), expected)


@pytest.mark.parametrize("chunking", DIFF_CHUNKINGS)
@pytest.mark.parametrize("case", DIFF_CASES)
def test_diff_equals_unchunked_call(rng, case, chunking):
    arrays, x = data(rng, DIFF_SHAPES), extras(rng)
    expected = DIFF_CASES[case](**arrays, x=x)
    check(lazy(DIFF_CASES[case](**chunked(arrays, DIFF_CHUNKINGS[chunking]), x=x)), expected)


def test_chunked_masks_biases_sizes_and_lam(rng):
    """Dask extras with chunks of their own are aligned to the blocks of q, k and v."""
    arrays = data(rng, SHAPES)
    q, k, v = chunked(arrays, CHUNKINGS["all"]).values()
    mask = rng.random((2, 4, 20, 23)) < 0.7
    bias = rng.standard_normal((4, 1, 23))
    sizes = rng.integers(1, 4, (2, 23, 1)).astype(np.float64)  # ToMe's (B, N, 1)
    expected = attnnb.attention(*arrays.values(), mask=mask, bias=bias, key_size=sizes,
                                return_lse=True)
    res = attnnb.attention(q, k, v, mask=da.from_array(mask, chunks=(1, 3, 11, 4)),
                           bias=da.from_array(bias, chunks=(2, 1, 7)),
                           key_size=da.from_array(sizes, chunks=(1, 10, 1)), return_lse=True)
    check(lazy(res), expected)
    d = data(rng, DIFF_SHAPES)
    lam = rng.standard_normal((2, 4, 20))
    expected = attnnb.diff_attention(*d.values(), lam, mode="rectified", causal=True)
    dq, dk, dv = chunked(d, DIFF_CHUNKINGS["all"]).values()
    res = attnnb.diff_attention(dq, dk, dv, da.from_array(lam, chunks=(2, 3, 6)),
                                mode="rectified", causal=True)
    check(lazy(res), expected)


def test_shapes_and_dtypes(rng):
    # 2-D inputs, Lq > Lk under causal (empty first rows), MQA with one query head per chunk,
    # NumPy k and v next to a Dask q, float32 and float16
    q, k, v = rng.standard_normal((30, 8)), rng.standard_normal((17, 8)), rng.standard_normal(
        (17, 3))
    expected = attnnb.attention(q, k, v, causal=True, return_lse=True)
    res = attnnb.attention(da.from_array(q, chunks=(7, 8)), da.from_array(k, chunks=(5, 8)),
                           v, causal=True, return_lse=True)
    assert res[0].shape == (30, 3) and res[1].shape == (30,)
    check(lazy(res), expected)
    q = rng.standard_normal((1, 6, 40, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, 40, 8)).astype(np.float32) for _ in range(2))
    expected = attnnb.attention(q, k, v, causal=True, return_lse=True)
    res = lazy(attnnb.attention(da.from_array(q, chunks=(1, 1, 16, 8)),
                                da.from_array(k, chunks=(1, 1, 16, 8)), v, causal=True,
                                return_lse=True))
    for a, b in zip(res, expected):
        assert a.dtype == np.float32
        assert_close(a, b, rtol=2e-6)
    h = q.astype(np.float16)
    res = lazy(attnnb.attention(da.from_array(h, chunks=(1, 3, 16, 8)), k.astype(np.float16),
                                v.astype(np.float16), return_lse=True))
    assert res[0].dtype == np.float16 and res[1].dtype == np.float32
    assert_close(res[0], attnnb.attention(h, k.astype(np.float16), v.astype(np.float16)))


@pytest.mark.parametrize("top_k", [0, 1, 23, 40])
def test_topk_edges_and_ties(rng, top_k):
    # integer-valued keys: many equal logits, so the ties decide which keys are kept
    arrays = {n: np.round(a * 2) for n, a in data(rng, SHAPES).items()}
    sizes = np.ones((2, 23))
    sizes[0, ::3] = 2.0  # a size of 2 adds log 2: ties between sized and unsized keys break
    expected = attnnb.topk_attention(*arrays.values(), top_k, key_size=sizes, return_lse=True)
    res = attnnb.topk_attention(*chunked(arrays, CHUNKINGS["keys"]).values(), top_k,
                                key_size=sizes, return_lse=True)
    check(lazy(res), expected)


def test_nan_rows_stay_where_they_are(rng):
    arrays = data(rng, SHAPES)
    arrays["k"][0, 1, 15] = np.nan  # key 15 of key head 1: query heads 2, 3 of batch 0
    arrays["v"][1, 0, 2, 1] = np.inf
    for fn in (lambda q, k, v: attnnb.attention(q, k, v, return_lse=True),
               lambda q, k, v: attnnb.topk_attention(q, k, v, 2, return_lse=True)):
        expected = fn(*arrays.values())
        check(lazy(fn(*chunked(arrays, CHUNKINGS["all"]).values())), expected)


@pytest.mark.parametrize("mode", ["rectified", "heaviside"])
def test_diff_values_that_are_not_finite_and_large_logits(rng, mode):
    """Infinite and NaN values, a NaN key and logits of about 1e4: the same infinities,
    NaNs and signs as one call (a key whose weight is zero carries no value)."""
    arrays = data(rng, DIFF_SHAPES)
    arrays["q"][1, 2] *= 3000
    arrays["k"][0, 1, 15] = np.nan
    arrays["v"][1, 0, 2, 1] = np.inf
    arrays["v"][0, 1, 7, 3] = -np.inf
    arrays["v"][0, 0, 3, 2] = np.nan
    lam = np.array([[0.5], [-0.3], [0.8], [0.0]])
    expected = attnnb.diff_attention(*arrays.values(), lam, causal=True, mode=mode)
    assert np.isinf(expected).any() and np.isnan(expected).any()
    res = attnnb.diff_attention(*chunked(arrays, DIFF_CHUNKINGS["all"]).values(), lam,
                                causal=True, mode=mode)
    check(lazy(res), expected)


def part_count(x, stage="part"):
    """Tasks of one stage in the graph of ``x``."""
    return sum(1 for key in dict(x.__dask_graph__())
               if isinstance(key, tuple) and str(key[0]).startswith("attnnb-")
               and str(key[0]).split("-")[2] == stage)


def square(rng, n=24, chunk=6, h=1):
    q, k, v = (rng.standard_normal((1, h, n, 8)) for _ in range(3))
    return (q, k, v), tuple(da.from_array(a, chunks=(1, h, chunk, 8)) for a in (q, k, v))


def test_blocks_a_query_block_cannot_see_are_not_scheduled(rng):
    _, (q, k, v) = square(rng)
    assert part_count(attnnb.attention(q, k, v)) == 16
    assert part_count(attnnb.attention(q, k, v, causal=True)) == 10  # 4 + 3 + 2 + 1
    # uneven, misaligned blocks: count the (query block, key block) pairs with a visible pair
    qd = da.from_array(q.compute(), chunks=(1, 1, (5, 9, 10), 8))
    kd = da.from_array(k.compute(), chunks=(1, 1, (7, 7, 10), 8))
    out = attnnb.attention(qd, kd, kd, causal=True)
    expected = sum(1 for q0, q1 in ((0, 5), (5, 14), (14, 24)) for k0 in (0, 7, 14)
                   if k0 <= q1 - 1)
    assert part_count(out) == expected == 6
    # a window of 2 on blocks of 6 touches the diagonal and its two neighbours
    assert part_count(attnnb.sparse_attention(q, k, v, patterns.local(24, 2))) == 10
    assert part_count(attnnb.sparse_attention(q, k, v, patterns.local(24, 2, causal=True))) == 7
    # two phases (a selection, or the LSEs, then the attention) per visible block, except
    # in the first query block: it sees one key block, and runs the call itself on it
    res = attnnb.topk_attention(q, k, v, 2, causal=True)
    assert (part_count(res, "candidates"), part_count(res)) == (9, 10)
    res = attnnb.diff_attention(*(da.concatenate([x, x], axis=1) for x in (q, k)), v, 0.5,
                                causal=True, mode="rectified")
    assert (part_count(res, "lse"), part_count(res)) == (9, 10)


def test_merge_tree_follows_split_every(rng):
    (q, k, v), (qd, kd, vd) = square(rng, n=24, chunk=3)  # 8 key blocks per query block
    qd = da.from_array(q, chunks=(1, 1, 24, 8))
    expected = attnnb.attention(q, k, v, return_lse=True)
    for every, merges in ((2, 4 + 2 + 1), (4, 2 + 1), (8, 1)):
        with dask.config.set(split_every=every):
            res = attnnb.attention(qd, kd, vd, return_lse=True)
        counts = [part_count(res[0], f"merge{level}") for level in range(3)]
        assert sum(counts) == merges, counts
        check(lazy(res), expected)
    with dask.config.set(split_every=1), pytest.raises(ValueError, match="split_every"):
        attnnb.attention(qd, kd, vd)


def test_bad_arguments_are_refused_before_any_work(rng):
    arrays = data(rng, SHAPES)
    q, k, v = chunked(arrays, CHUNKINGS["keys"]).values()
    with pytest.raises(ValueError, match="q's head dimension D .* single chunk"):
        attnnb.attention(q.rechunk({3: 4}), k, v)
    with pytest.raises(ValueError, match="k's head dimension D .* single chunk"):
        attnnb.attention(q, k.rechunk({3: 4}), v)
    with pytest.raises(TypeError, match="mask must be a boolean array"):
        attnnb.attention(q, k, v, mask=da.zeros((20, 23)))
    with pytest.raises(ValueError, match=r"bias of shape \(20, 22\) cannot be broadcast"):
        attnnb.attention(q, k, v, bias=da.zeros((20, 22)))
    with pytest.raises(ValueError, match="key_size must be positive"):
        attnnb.attention(q, k, v, key_size=np.zeros(23))
    with pytest.raises(ValueError, match="backend must be one of"):
        attnnb.attention(q, k, v, backend="tpu")
    with pytest.raises(ValueError, match="must be a multiple"):
        attnnb.attention(q, k[:, :1].rechunk({1: 1}).repeat(3, axis=1), v[:, :1].repeat(3, 1))
    with pytest.raises(ValueError, match="pattern has shape"):
        attnnb.sparse_attention(q, k, v, patterns.local(20, 2))
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        attnnb.topk_attention(q, k, v, -1)
    with pytest.raises(ValueError, match="lam must be finite"):
        attnnb.diff_attention(*chunked(data(rng, DIFF_SHAPES), DIFF_CHUNKINGS["keys"]).values(),
                              np.nan)
    with pytest.raises(ValueError, match="must have a head axis"):
        attnnb.diff_attention(q[0, 0], k[0, 0], v[0, 0], 0.5)
    with pytest.raises(TypeError, match="sigmoid_bias must be a real number here"):
        attnnb.topk_attention(q, k, v, 3, normalizer="sigmoid", sigmoid_bias=np.zeros(4))
    with pytest.raises(ValueError, match="sinks of shape \\(4,\\) cannot be broadcast"):
        attnnb.diff_attention(*chunked(data(rng, DIFF_SHAPES), DIFF_CHUNKINGS["keys"]).values(),
                              0.5, sinks=np.zeros(4))

    def boom():
        raise AssertionError("an input was computed while the graph was built")

    never = da.from_delayed(dask.delayed(boom)(), SHAPES["q"], dtype=np.float64)
    out = attnnb.attention(never, k, v, causal=True, return_lse=True)
    assert all(isinstance(a, da.Array) for a in out)
    # values of Dask arguments are checked chunk by chunk when computed, and reported at
    # their index in the argument as given (not in a chunk of it)
    sizes = np.ones(23)
    sizes[17] = 0.0
    with pytest.raises(ValueError, match=re.escape("got 0.0 at index (17,) of shape (23,)")):
        lazy(attnnb.attention(q, k, v, key_size=da.from_array(sizes, chunks=5)))
    lam = da.from_array(np.array([[1.0], [0.5], [0.0], [np.inf]]), chunks=(2, 1))
    with pytest.raises(ValueError, match=re.escape("lam must be finite everywhere; got inf at "
                                                   "index (3, 0) of shape (4, 1)")):
        lazy(attnnb.diff_attention(
            *chunked(data(rng, DIFF_SHAPES), DIFF_CHUNKINGS["keys"]).values(), lam))


def test_dask_arrays_of_unknown_chunk_sizes_are_refused():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(2)
    q = da.from_array(rng.standard_normal((6, 4)), chunks=(3, 4))
    unknown = q[q[:, 0] > -100]  # chunks ((nan, nan), (4,))
    k, v = rng.standard_normal((7, 4)), rng.standard_normal((7, 3))
    with pytest.raises(ValueError, match=r"q has chunks of unknown size.*compute_chunk_sizes"):
        attnnb.attention(unknown, k, v, causal=True, backend="reference")
    known = unknown.compute_chunk_sizes()
    np.testing.assert_allclose(attnnb.attention(known, k, v, backend="reference").compute(),
                               attnnb.attention(q.compute(), k, v, backend="reference"))


def test_combine_stays_lazy_on_dask_arrays(rng):
    o = [da.from_array(rng.standard_normal((4, 3)), chunks=2) for _ in range(2)]
    s = [da.from_array(rng.standard_normal(4), chunks=2) for _ in range(2)]
    out, lse = attnnb.combine(o, s)
    assert isinstance(out, da.Array) and isinstance(lse, da.Array)
    expected = attnnb.combine([a.compute() for a in o], [a.compute() for a in s])
    check(lazy((out, lse)), expected)


# -- on a cluster ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address=None, silence_logs=logging.ERROR) as cluster:
        with distributed.Client(cluster) as c:
            yield c


async def die():
    """Ends the worker process at once, as a crash would (run on the worker's event loop)."""
    os._exit(1)


@pytest.mark.parametrize("case", list(CASES) + list(DIFF_CASES))
def test_on_a_local_cluster(client, rng, case):
    diff = case in DIFF_CASES
    arrays = data(rng, DIFF_SHAPES if diff else SHAPES)
    fn, x = (DIFF_CASES if diff else CASES)[case], extras(rng)
    expected = fn(**arrays, x=x)
    res = fn(**chunked(arrays, (DIFF_CHUNKINGS if diff else CHUNKINGS)["all"]), x=x)
    check(client.compute(list(_items(res)), sync=True) if isinstance(res, tuple)
          else client.compute(res, sync=True), expected)


def test_a_killed_worker_is_recomputed(client, rng):
    """A worker dies in the middle of a computation: Dask recomputes its tasks, exactly."""
    q, k, v = (rng.standard_normal((1, 2, 96, 8)) for _ in range(3))
    expected = attnnb.attention(q, k, v, causal=True, return_lse=True)

    def slow(x):  # each key block takes a while, so that the kill lands mid-way
        time.sleep(0.4)
        return x

    qd = da.from_array(q, chunks=(1, 1, 16, 8))
    kd, vd = (da.from_array(a, chunks=(1, 2, 16, 8)).map_blocks(slow) for a in (k, v))
    out = attnnb.attention(qd, kd, vd, causal=True, return_lse=True)
    futures = client.compute(list(out))
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        held = client.has_what()
        ours = {w: [key for key in keys if "attnnb-attention" in str(key)]
                for w, keys in held.items()}
        victim = next((w for w, keys in ours.items() if keys), None)
        time.sleep(0.05)
    assert victim is not None, "no worker held a result of the graph"
    assert not all(f.done() for f in futures), "the computation ended before the kill"
    client.run(die, workers=[victim], wait=False)
    res = client.gather(futures)
    assert victim not in client.scheduler_info()["workers"]
    token = out[0].name.rsplit("-", 1)[1]  # the graph's own tasks
    assert client.run_on_scheduler(started_twice, token), "no task of the graph ran again"
    check(tuple(res), expected)


def started_twice(token, dask_scheduler):
    """Keys holding ``token`` that the scheduler sent to a worker more than once."""
    runs = collections.Counter(str(t[0]) for t in dask_scheduler.transition_log
                               if t[2] == "processing" and token in str(t[0]))
    return sorted(key for key, n in runs.items() if n > 1)


def test_readme_dask_block_runs():
    text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    match = re.search(r"<!-- usage:dask -->\n```python\n(.*?)```\n<!-- /usage:dask -->", text,
                      re.S)
    assert match, "README has no usage:dask block"
    namespace = {"__name__": "__main__"}
    exec(compile(match.group(1), "README.md:usage:dask", "exec"), namespace)
    assert namespace["out"].shape == (1, 4, 8192, 64)
    qn, kn, vn = namespace["qn"], namespace["kn"], namespace["vn"]
    assert_close(namespace["merged"], attnnb.attention(qn, kn, vn), rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_topk_equal_keys_in_blocks_of_other_widths(seed):
    """Equal keys get equal ranking logits whatever the width of their key block, so
    the lower index wins their tie as in one call (float32: a product's rounding
    depends on its shape)."""
    rng = np.random.default_rng(seed)
    d, lk = 40, 150
    q = rng.standard_normal((1, 3, 30, d)).astype(np.float32)
    k = rng.standard_normal((1, 1, lk, d)).astype(np.float32)
    v = rng.standard_normal((1, 1, lk, 7)).astype(np.float32)
    for r in range(8):  # key r (block 0, 17 wide) equals key 90 + 7 r (block 2, 72 wide)
        k[0, 0, r] = k[0, 0, 90 + 7 * r] = 4.0 * q[0, 0, r]  # query r of head 0 ranks it first
    expected = attnnb.topk_attention(q, k, v, 1, return_lse=True)
    chunks = {"q": (1, 3, 30, d), "k": ((1,), (1,), (17, 61, 72), (d,)),
              "v": ((1,), (1,), (17, 61, 72), (7,))}
    res = attnnb.topk_attention(*chunked({"q": q, "k": k, "v": v}, chunks).values(), 1,
                                return_lse=True)
    out, lse = lazy(res)
    assert_close(out, expected[0], np.float32)
    assert_close(lse, expected[1], np.float32)


def test_diff_sinks_are_part_of_the_graphs_name(rng):
    """A pair's sinks are values inside its tasks: two calls that differ only in their
    sinks get graphs of their own, and computed together each is its own call."""
    arrays = data(rng, DIFF_SHAPES)
    sinks = [rng.standard_normal((2, 8)), rng.standard_normal((2, 8))]
    lazy_calls = [attnnb.diff_attention(*chunked(arrays, DIFF_CHUNKINGS["all"]).values(), 0.5,
                                        mode=mode, sinks=s)
                  for mode in ("difference", "rectified") for s in sinks]
    assert len({x.name for x in lazy_calls}) == 4
    results = dask.compute(*lazy_calls, scheduler="threads")
    for (mode, s), got in zip([(m, s) for m in ("difference", "rectified") for s in sinks],
                              results):
        check(got, attnnb.diff_attention(*arrays.values(), 0.5, mode=mode, sinks=s))


@pytest.mark.parametrize("lam", [-0.3, 0.6])
def test_float32_heaviside_gate_of_keys_neither_map_weighs(rng, lam):
    """Large logits: many keys' maps are below float32's smallest normal number in both
    maps.  The literal gate would open at those where ``A1 > lam A2`` (everywhere for
    ``lam < 0``) in float64; the kernels' float32 maps are 0 there and the gate stays
    closed, so the key blocks' shares must count them as 0 too."""
    arrays = {name: (a * (6 if name == "q" else 1)).astype(np.float32)
              for name, a in data(rng, DIFF_SHAPES).items()}
    kw = dict(mode="heaviside", causal=True, scale=3.0)
    expected = attnnb.diff_attention(*arrays.values(), lam, **kw)
    res = lazy(attnnb.diff_attention(*chunked(arrays, DIFF_CHUNKINGS["keys"]).values(), lam,
                                     **kw))[0]
    assert res.dtype == np.float32
    assert_close(res, expected, rtol=1e-5)
