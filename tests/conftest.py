import os
import zlib

import numpy as np
import pytest

# The suite tests the kernels compiled for mask functions from their first call; the
# stand-ins of a mask function's first calls have tests of their own
# (tests/cpu/test_first_tier.py).
os.environ.setdefault("ATTNNB_FIRST_TIER", "0")


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: reproducible, different per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
