"""The cuda statistics pass of dense attention (docs/contract.md, attnnb.attention_stats)
against the float64 reference's rows: every statistic, a NaN row, an empty row, dropout,
a mask function.  Small sizes: the simulator runs a thread per GPU thread."""

import numpy as np
import pytest

import attnnb
from attnnb import inspection, mods

from .common import n

CASES = {
    "causal, keys": dict(causal=True),
    "mask, bias, sizes": dict(mask="mask", bias="bias", key_size="sizes"),
    "relu_expm1": dict(normalizer="relu_expm1", bias="bias"),
    "softmax1, dropout": dict(normalizer="softmax1", dropout_p=0.4, seed=21, mask="mask"),
    "window function, alibi": dict(mask_mod=mods.sliding_window(5),
                                   score_mod=mods.constant(mods.alibi(np.array([0.5, -0.2])))),
}


@pytest.mark.parametrize("case", CASES)
def test_cuda_stats_pass_equals_the_reference_rows(rng, case):
    lq, lk = n(9), n(11)
    q = rng.standard_normal((2, 2, lq, 4))
    k = rng.standard_normal((2, 1, lk, 4))
    v = rng.standard_normal((2, 1, lk, 3))
    q[1, 1, 4, 0] = np.nan
    made = {"mask": rng.random((2, 1, lq, lk)) < 0.7, "bias": rng.standard_normal((lq, lk)),
            "sizes": rng.uniform(0.5, 3.0, (2, lk))}
    kw = {name: made.get(x, x) if isinstance(x, str) and name != "normalizer" else x
          for name, x in CASES[case].items()}
    if "mask" in kw:
        kw["mask"][0, 0, 3] = False
    stats = dict(stats=inspection.STATS, keys=[0, lk - 1])
    if "mask_mod" in kw:  # (the compiled passes take no mods: the cuda kernel, directly)
        from attnnb._front.validate import attention_problem
        from attnnb.cuda.stats import attention_stats as cuda_stats

        problem = attention_problem(q, k, v, **kw)
        per_row, received = cuda_stats(problem, np.isin(np.arange(lk), [0, lk - 1]))
        got = {"entropy": per_row[..., 0], "max": per_row[..., 1], "argmax": per_row[..., 2],
               "mass": per_row[..., 3], "zeros": per_row[..., 4], "received": received}
    else:
        got = attnnb.attention_stats(attnnb.attention, q, k, v, backend="cuda", **stats, **kw)
    ref = attnnb.attention_stats(attnnb.attention, q, k, v, backend="reference", **stats, **kw)
    for name in got:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-12, atol=1e-12,
                                   err_msg=name)
    assert np.isnan(got["entropy"][1, 1, 4]) and got["argmax"][1, 1, 4] == -1
    assert np.isnan(got["received"][1, 1]).all()


def test_cuda_stats_pass_in_float32(rng):
    """float32 inputs: the pass accumulates in float32, within float32's tolerance of the
    float64 rows (ties and underflows of float32 logits aside: argmax and zeros)."""
    lq, lk = n(9), n(11)
    q = rng.standard_normal((1, 2, lq, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, lk, 4)).astype(np.float32)
    v = rng.standard_normal((1, 2, lk, 3)).astype(np.float32)
    kw = dict(stats=("entropy", "max", "mass", "received"), keys=[1], causal=True)
    got = attnnb.attention_stats(attnnb.attention, q, k, v, backend="cuda", **kw)
    ref = attnnb.attention_stats(attnnb.attention, q, k, v, backend="reference", **kw)
    for name in got:
        np.testing.assert_allclose(got[name], ref[name], rtol=2e-5, atol=2e-5, err_msg=name)
