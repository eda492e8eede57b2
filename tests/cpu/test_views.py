"""The kernels' own views (attnnb/cpu/_numba_patches/views.py) against NumPy's reshapes and
slices; with the Numba patches off, their plain fallbacks."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from attnnb.cpu._numba_patches.views import flat, keep_alive, rows_of, unowned


@numba.njit(cache=False)
def _flat_copy(x):
    f = flat(x)
    out = np.empty(f.size, f.dtype)
    for i in range(f.size):
        out[i] = f[i]
    return out


@numba.njit(cache=False)
def _rows_copy(x, rows, cols):
    v = rows_of(x, rows, cols)
    return v.copy()


@numba.njit(cache=False)
def _scratch_through_aliases(n):
    # the pattern of the dense kernel's tasks: owners kept, work on their aliases
    a = np.zeros(n)
    b = np.ones((3, n))
    owners = (a, b)
    a, b = unowned(owners)
    for r in range(3):
        row = b[r]
        for c in range(n):
            a[c] += row[c] * (r + 1)
    total = rows_of(a, 1, n).sum() + flat(b).sum()
    keep_alive(owners)
    return total


def test_flat_is_reshape():
    x = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(_flat_copy(x), x.reshape(-1))
    np.testing.assert_array_equal(_flat_copy(x[1]), x[1].reshape(-1))
    np.testing.assert_array_equal(_flat_copy(x[1:, 1:]), x[1:, 1:].reshape(-1))  # contiguous: 'C'


def test_only_c_contiguous_arrays_are_viewed():
    with pytest.raises(numba.core.errors.TypingError):
        _flat_copy(np.arange(24.0).reshape(4, 6)[:, ::2])


def test_rows_of_is_the_start_of_the_buffer():
    x = np.arange(30.0)
    np.testing.assert_array_equal(_rows_copy(x, 4, 6), x[:24].reshape(4, 6))
    np.testing.assert_array_equal(_rows_copy(x[6:], 3, 5), x[6:21].reshape(3, 5))


def test_aliases_write_through_to_their_owners():
    assert _scratch_through_aliases(7) == 7 * 6 + 3 * 7


def test_an_alias_of_an_argument_reads_its_values():
    @numba.njit(cache=False)
    def second_row_sum(x):
        return unowned(x)[1].sum()

    x = np.arange(12.0).reshape(3, 4)
    assert second_row_sum(x) == x[1].sum()
