"""Integer codes that the public names of modes become before a kernel sees them.

Kernels on every backend branch on small integers, not strings; this leaf
module (no imports) is the one place where each code is defined, so that the
``cpu`` and ``cuda`` backends cannot disagree on what ``2`` means.
"""

# attention(normalizer=...): how a row's weights are normalised (docs/contract.md §1)
SOFTMAX = 0
SOFTMAX1 = 1
RELU_EXPM1 = 2
SIGMOID = 3
SOFTPICK = 4
NORMALIZER_CODES = {"softmax": SOFTMAX, "softmax1": SOFTMAX1, "relu_expm1": RELU_EXPM1,
                    "sigmoid": SIGMOID, "softpick": SOFTPICK}

# softpick's eps: its denominator is sum_j |e^x_j - 1| + SOFTPICK_EPS (Zuhri et al. 2025)
SOFTPICK_EPS = 1e-6

# diff_attention(mode=...)
DIFFERENCE = 0
RECTIFIED = 1
HEAVISIDE = 2
DIFF_MODE_CODES = {"difference": DIFFERENCE, "rectified": RECTIFIED, "heaviside": HEAVISIDE}

# Matching.merge(mode=...) in Token Merging
MERGE_MEAN = 0
MERGE_SUM = 1
MERGE_AMAX = 2
MERGE_MODE_CODES = {"mean": MERGE_MEAN, "sum": MERGE_SUM, "amax": MERGE_AMAX}
